"""The FlexFlow paper's RNN apps (apps/rnntc.py, rnnlm.py, nmt.py): parameter counts and output
shapes against formulas at full size (graph alone) and tiny size, the tiny networks against
PyTorch with the same weights, the tiny text classifier learning through its command line, and
each app's command line for two iterations on 1 rank and on 2 MPI ranks."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from apps import nmt, rnnlm, rnntc
from apps.cli import build_model, count_parameters
from ops import Model
from taskrt import Runtime
from tests.test_mpi import ROOT, output, run_mpi


@pytest.fixture(scope="module")
def rt():
    with Runtime(cpus=2) as rt:
        yield rt


# ---- sizes: parameter counts and output shapes against formulas ---------------------------------
def lstm_params(n_in: int, h: int) -> int:
    """One LSTM layer with PyTorch's weights: W_ih [4h, in], W_hh [4h, h] and two biases [4h]."""
    return 4 * h * (n_in + h) + 8 * h


def stack_params(n_in: int, h: int, layers: int) -> int:
    return lstm_params(n_in, h) + (layers - 1) * lstm_params(h, h)


def rnntc_params(s: dict) -> int:
    return (s["vocab_size"] * s["embed_size"] + stack_params(s["embed_size"], s["hidden_size"], s["num_layers"])
            + s["hidden_size"] * s["num_classes"] + s["num_classes"])


def rnnlm_params(s: dict) -> int:
    return (s["vocab_size"] * s["embed_size"] + stack_params(s["embed_size"], s["hidden_size"], s["num_layers"])
            + s["hidden_size"] * s["vocab_size"] + s["vocab_size"])


def nmt_params(s: dict) -> int:
    embeddings = (s["src_vocab_size"] + s["tgt_vocab_size"]) * s["embed_size"]
    encoder_and_decoder = 2 * stack_params(s["embed_size"], s["hidden_size"], s["num_layers"])
    attention = 2 * s["hidden_size"] * s["hidden_size"]  # W_c [hidden, 2 hidden], no bias
    return embeddings + encoder_and_decoder + attention + s["hidden_size"] * s["tgt_vocab_size"] + s["tgt_vocab_size"]


APPS = {
    "rnntc": (rnntc, rnntc_params, lambda s, b: (b, s["num_classes"])),
    "rnnlm": (rnnlm, rnnlm_params, lambda s, b: (b, s["seq_length"], s["vocab_size"])),
    "nmt": (nmt, nmt_params, lambda s, b: (b, s["seq_length"], s["tgt_vocab_size"])),
}
#: the full-size counts, as each app's docstring states them
FULL_PARAMS = {"rnntc": 52_804_610, "rnnlm": 66_034_000, "nmt": 134_020_352}


@pytest.mark.parametrize("app", sorted(APPS))
def test_full_size_graphs_have_the_papers_sizes(app):
    module, formula, out_shape = APPS[app]
    graph, out = build_model(module.build, module.FULL, 64, weights=False)
    with graph:
        assert module.FULL["seq_length"] == 40
        assert count_parameters(graph) == formula(module.FULL) == FULL_PARAMS[app]
        assert f"{FULL_PARAMS[app]:,} parameters" in module.__doc__
        assert out.shape == out_shape(module.FULL, 64) and out is graph.ops[-1].outputs[0]
        assert [t.shape for t in graph.inputs] == [(64, 40)] * len(graph.inputs)


@pytest.mark.parametrize("app", sorted(APPS))
def test_tiny_sizes_shapes_and_data(rt, app):
    module, formula, out_shape = APPS[app]
    sizes = module.TINY
    m, out = build_model(module.build, sizes, 4, seed=2, runtime=rt)
    assert sum(v.size for v in m.parameters().values()) == count_parameters(m) == formula(sizes)
    assert out.shape == out_shape(sizes, 4)
    inputs, labels = module.make_batch(np.random.default_rng(5), m, 6, sizes)
    assert labels.shape == out_shape(sizes, 6)[:-1] and labels.dtype.kind == "i"
    arrays = inputs if isinstance(inputs, dict) else {m.inputs[0].name: inputs}
    assert sorted(arrays) == sorted(t.name for t in m.inputs)
    assert all(arrays[t.name].shape == (6,) + t.shape[1:] for t in m.inputs)

    def flat(seed):
        x, y = module.make_batch(np.random.default_rng(seed), m, 6, sizes)
        return np.concatenate([a.ravel() for a in (list(x.values()) if isinstance(x, dict) else [x])] + [y.ravel()])

    assert np.array_equal(flat(5), flat(5)) and not np.array_equal(flat(5), flat(6))


def test_sizes_that_cannot_work_are_refused(rt):
    with pytest.raises(ValueError, match=r"rnntc: vocab_size 4 leaves no neutral words for 2 classes"):
        rnntc.build(Model(rt), 2, **{**rnntc.TINY, "vocab_size": 4})
    with pytest.raises(ValueError, match=r"nmt: vocabularies need a word besides BOS, got 1 and 24"):
        nmt.build(Model(rt), 2, **{**nmt.TINY, "src_vocab_size": 1})


# ---- against PyTorch ------------------------------------------------------------------------------
def torch_params(m):
    return {k: torch.tensor(v, requires_grad=True) for k, v in m.parameters().items()}


def torch_lstm(x, p, name, state=None):
    """nn.LSTM (batch first) run with the model's weights of `name`: (y, (h_n, c_n)), h_n [1, b, h]."""
    w_ih = p[f"{name}.weight_ih"]
    layer = torch.nn.LSTM(w_ih.shape[1], w_ih.shape[0] // 4, batch_first=True)
    weights = {f"{k}_l0": p[f"{name}.{k}"] for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")}
    return torch.func.functional_call(layer, weights, (x,) if state is None else (x, state))


def assert_matches(m, out, p, inputs, labels, logits, rtol=1e-4, atol=1e-5):
    """The model's logits, mean loss and every gradient against PyTorch's (logits [b, T, V], labels [b, T])."""
    ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.tensor(labels).reshape(-1))
    ref.backward()
    got = m.forward(inputs, outputs=[out])[out.name]
    np.testing.assert_allclose(got, logits.detach().numpy(), rtol=rtol, atol=atol)
    assert m.backward(labels) == pytest.approx(ref.item(), rel=1e-5)
    grads = m.gradients()
    assert grads.keys() == p.keys()
    for k, v in p.items():
        np.testing.assert_allclose(grads[k], v.grad.numpy(), rtol=rtol, atol=atol, err_msg=k)


def test_tiny_rnnlm_matches_pytorch(rt):
    sizes = rnnlm.TINY
    m, out = build_model(rnnlm.build, sizes, 4, seed=3, runtime=rt)
    m.compile("sgd", output=out)
    words, following = rnnlm.make_batch(np.random.default_rng(3), m, 4, sizes)
    p = torch_params(m)
    h = F.embedding(torch.tensor(words), p["embedding.weight"])
    for i in range(sizes["num_layers"]):
        h, _ = torch_lstm(h, p, f"lstm_{i}")
    assert_matches(m, out, p, words, following, F.linear(h, p["decoder.weight"], p["decoder.bias"]))


def test_tiny_nmt_matches_pytorch(rt):
    sizes = nmt.TINY
    m, out = build_model(nmt.build, sizes, 3, seed=4, runtime=rt)
    m.compile("sgd", output=out)
    inputs, target = nmt.make_batch(np.random.default_rng(4), m, 3, sizes)
    p = torch_params(m)
    enc = F.embedding(torch.tensor(inputs["source"]), p["src_embedding.weight"])
    states = []
    for i in range(sizes["num_layers"]):
        enc, state = torch_lstm(enc, p, f"encoder_lstm_{i}")
        states.append(state)
    dec = F.embedding(torch.tensor(inputs["target_in"]), p["tgt_embedding.weight"])
    for i, state in enumerate(states):
        dec, _ = torch_lstm(dec, p, f"decoder_lstm_{i}", state)
    weights = torch.softmax(dec @ enc.transpose(1, 2), dim=-1)
    attentional = torch.tanh(F.linear(torch.cat([weights @ enc, dec], dim=-1), p["attention_combine.weight"]))
    logits = F.linear(attentional, p["decoder_output.weight"], p["decoder_output.bias"])
    assert_matches(m, out, p, inputs, target, logits)


# ---- the command line -------------------------------------------------------------------------------
def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_tiny_rnntc_learns(capsys):
    report = rnntc.main(["--tiny", "--iterations", "40", "--cpus-per-rank", "1"])
    assert last_json(capsys.readouterr().out) == report
    assert report["final_loss"] < 0.3 * report["first_loss"]


@pytest.mark.parametrize("app", sorted(APPS))
def test_tiny_app_on_one_rank(app, capsys):
    module, formula, _ = APPS[app]
    report = module.main(["--tiny", "--iterations", "2", "--cpus-per-rank", "2"])
    assert last_json(capsys.readouterr().out) == report
    assert report["app"] == app and report["ranks"] == 1 and report["devices"] == 2 and report["iterations"] == 2
    assert report["parameters"] == formula(module.TINY) and report["strategy"] == "data"
    assert np.isfinite(report["first_loss"]) and np.isfinite(report["final_loss"])


#: each app on 2 ranks with data parallelism and one other baseline
MPI_RUNS = [(app, baseline) for app, other in (("rnntc", "model"), ("rnnlm", "expert"), ("nmt", "tensor"))
            for baseline in ("data", other)]


@pytest.fixture(scope="module")
def mpi_runs():
    """The MPI runs, started together so that their start-ups overlap: (app, baseline) -> a future
    of (CompletedProcess, seconds)."""
    with ThreadPoolExecutor(len(MPI_RUNS)) as pool:
        yield {(app, baseline): pool.submit(run_mpi, 2, ROOT / "apps" / f"{app}.py", "--tiny", "--iterations", 2,
                                            "--baseline", baseline, timeout=120)
               for app, baseline in MPI_RUNS}


@pytest.mark.parametrize("app,baseline", MPI_RUNS)
def test_tiny_app_on_two_ranks_trains_as_on_one(mpi_runs, app, baseline, capsys):
    proc, _ = mpi_runs[app, baseline].result()
    assert proc.returncode == 0, output(proc)
    report = last_json(proc.stdout)
    assert report["app"] == app and report["ranks"] == 2 and report["strategy"] == baseline, output(proc)
    # the same data, weights and strategy on one rank with two processors
    one = APPS[app][0].main(["--tiny", "--iterations", "2", "--cpus-per-rank", "2", "--baseline", baseline])
    capsys.readouterr()
    assert report["devices"] == one["devices"] == 2 and report["parameters"] == one["parameters"]
    assert report["first_loss"] == pytest.approx(one["first_loss"], rel=1e-5)
    assert report["final_loss"] == pytest.approx(one["final_loss"], rel=1e-4)
