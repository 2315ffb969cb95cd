"""The model API against PyTorch (same weights, same numbers), learning through fit, saving and
loading bit for bit, and clear errors before any work."""
from __future__ import annotations

import gc
import io
import json
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ops import SGD, Adam, ConfigError, History, Model, TileConfig
from ops.base import ShapeError
from taskrt import Machine, Runtime


@pytest.fixture(scope="module")
def rt():
    with Runtime(cpus=2) as rt:
        yield rt


def torch_params(m):
    return {k: torch.tensor(v, requires_grad=True) for k, v in m.parameters().items()}


def assert_grads(m, params, rtol=1e-4, atol=1e-6):
    got = m.gradients()
    assert got.keys() == params.keys()
    for k, p in params.items():
        np.testing.assert_allclose(got[k], p.grad.numpy(), rtol=rtol, atol=atol, err_msg=k)


# ---- against PyTorch ----------------------------------------------------------------------------
def small_cnn(rt, batch=6, seed=0, classes=4):
    m = Model(rt, seed=seed)
    x = m.input((batch, 3, 8, 8))
    h = m.conv2d(x, 5, 3, padding=1)
    h = m.batch_norm(h)
    h = m.relu(h)
    h = m.pool2d(h, 2)
    h = m.flat(h)
    m.softmax(m.dense(h, classes))
    return m


def test_cnn_forward_and_gradients_match_pytorch(rt):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 3, 8, 8)).astype(np.float32)
    y = rng.integers(0, 4, 6)
    m = small_cnn(rt)
    m.compile(SGD(lr=0.1), "sparse_categorical_crossentropy")
    p = torch_params(m)
    running_mean, running_var = torch.zeros(5), torch.ones(5)
    h = F.conv2d(torch.tensor(x), p["conv2d_0.weight"], p["conv2d_0.bias"], padding=1)
    h = F.batch_norm(h, running_mean, running_var, p["batch_norm_0.weight"], p["batch_norm_0.bias"], training=True)
    h = F.max_pool2d(F.relu(h), 2).flatten(1)
    prob = torch.softmax(F.linear(h, p["dense_0.weight"], p["dense_0.bias"]), -1)
    loss = F.nll_loss(torch.log(prob), torch.tensor(y))
    loss.backward()

    out = m.forward(x)
    assert list(out) == ["softmax_0.out"]
    np.testing.assert_allclose(out["softmax_0.out"], prob.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert m.backward(y) == pytest.approx(loss.item(), rel=1e-5)
    assert_grads(m, p)
    stats = m.stats()
    np.testing.assert_allclose(stats["batch_norm_0.running_mean"], running_mean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["batch_norm_0.running_var"], running_var.numpy(), rtol=1e-5, atol=1e-6)


def small_mlp(rt, batch=5, seed=1, out=3):
    m = Model(rt, seed=seed)
    x = m.input((batch, 7))
    h = m.dense(x, 16, activation="relu")
    h = m.tanh(m.dense(h, 8))
    m.dense(h, out)
    return m


@pytest.mark.parametrize("loss", ["mean_squared_error", "sparse_categorical_crossentropy"])
def test_mlp_forward_and_gradients_match_pytorch(rt, loss):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 7)).astype(np.float32)
    m = small_mlp(rt)
    m.compile("adam", loss)
    p = torch_params(m)
    h = F.relu(F.linear(torch.tensor(x), p["dense_0.weight"], p["dense_0.bias"]))
    h = torch.tanh(F.linear(h, p["dense_1.weight"], p["dense_1.bias"]))
    z = F.linear(h, p["dense_2.weight"], p["dense_2.bias"])
    if loss == "mean_squared_error":
        y = rng.standard_normal((5, 3)).astype(np.float32)
        ref = F.mse_loss(z, torch.tensor(y))
    else:  # not a softmax output: the loss reads logits
        y = rng.integers(0, 3, 5)
        ref = F.cross_entropy(z, torch.tensor(y))
    ref.backward()
    np.testing.assert_allclose(m.forward(x)["dense_2.out"], z.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert m.backward(y) == pytest.approx(ref.item(), rel=1e-5)
    assert_grads(m, p)


def test_training_steps_match_pytorch_adam(rt):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 7)).astype(np.float32)
    y = rng.standard_normal((5, 3)).astype(np.float32)
    m = small_mlp(rt)
    m.compile(Adam(lr=0.01, weight_decay=0.01), "mean_squared_error")
    p = torch_params(m)
    opt = torch.optim.Adam(p.values(), lr=0.01, weight_decay=0.01)
    for _ in range(3):
        opt.zero_grad()
        h = F.relu(F.linear(torch.tensor(x), p["dense_0.weight"], p["dense_0.bias"]))
        h = torch.tanh(F.linear(h, p["dense_1.weight"], p["dense_1.bias"]))
        F.mse_loss(F.linear(h, p["dense_2.weight"], p["dense_2.bias"]), torch.tensor(y)).backward()
        opt.step()
    history = m.fit(x, y, iterations=3, verbose=False)
    assert isinstance(history, History) and len(history) == 3 and m.step == 3
    for k, v in m.parameters().items():
        np.testing.assert_allclose(v, p[k].detach().numpy(), rtol=1e-4, atol=1e-6, err_msg=k)


# ---- learning ---------------------------------------------------------------------------------------
def test_small_cnn_learns_where_the_bright_spot_is(rt):
    rng = np.random.default_rng(5)
    n = 128
    y = rng.integers(0, 2, n)
    x = 0.3 * rng.standard_normal((n, 1, 8, 8)).astype(np.float32)
    rows, cols = rng.integers(1, 7, n), rng.integers(0, 3, n) + 1 + 4 * y  # left half or right half
    x[np.arange(n), 0, rows, cols] += 3.0
    m = Model(rt, seed=2)
    h = m.input((16, 1, 8, 8))
    h = m.relu(m.batch_norm(m.conv2d(h, 4, 3, padding=1)))
    h = m.flat(m.pool2d(h, 2))
    m.softmax(m.dense(h, 2))
    m.compile(Adam(lr=0.02), metrics=["accuracy"])
    history = m.fit(x, y, epochs=6, verbose=False)
    assert history.epoch_loss[-1] < 0.3 * history.loss[0]
    assert m.evaluate(x, y)["accuracy"] > 0.9


def test_small_lstm_learns_the_sign_of_a_sum(rt):
    rng = np.random.default_rng(6)
    n = 256
    x = rng.standard_normal((n, 5, 2)).astype(np.float32)
    y = (x[:, :, 0].sum(axis=1) > 0).astype(np.int64)
    m = Model(rt, seed=3)
    seq = m.input((32, 5, 2))
    _, h, _ = m.lstm(seq, 12)
    m.softmax(m.dense(h, 2))
    m.compile(Adam(lr=0.03), metrics=["accuracy"])
    history = m.fit(x, y, epochs=8, verbose=False)
    assert history.epoch_loss[-1] < 0.5 * history.loss[0]
    assert m.evaluate(x, y)["accuracy"] > 0.85


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as fit's progress line asks."""

    def isatty(self) -> bool:
        return True


def test_fit_shows_one_line_per_epoch_and_can_be_quiet(rt):
    m = small_mlp(rt, batch=4)
    m.compile("sgd", "mean_squared_error")
    x, y = np.ones((12, 7), np.float32), np.zeros((12, 3), np.float32)
    out = Terminal()
    history = m.fit(x, y, epochs=2, stream=out)
    text = out.getvalue()
    assert text.count("\n") == 2 and text.count("\r") == 6
    assert "epoch 2/2  3/3  loss" in text and len(history.epoch_loss) == 2 and len(history.loss) == 6
    log = io.StringIO()   # not a terminal: each epoch's last line only, no carriage returns
    m.fit(x, y, epochs=2, stream=log)
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and [line.split("  loss")[0] for line in lines] == ["epoch 1/2  3/3",
                                                                                         "epoch 2/2  3/3"]
    quiet = io.StringIO()
    m.fit(x, y, iterations=4, stream=quiet, verbose=False)
    assert quiet.getvalue() == ""


def test_predict_and_evaluate_handle_a_partial_last_batch(rt):
    rng = np.random.default_rng(7)
    m = small_mlp(rt, batch=4)
    m.compile("sgd", "sparse_categorical_crossentropy", metrics=["accuracy"])
    x = rng.standard_normal((10, 7)).astype(np.float32)
    y = rng.integers(0, 3, 10)
    logits = m.predict(x)
    assert logits.shape == (10, 3)
    np.testing.assert_allclose(logits[:4], m.forward(x[:4], training=False)["dense_2.out"], rtol=1e-6)
    z = logits - logits.max(axis=1, keepdims=True)
    nll = np.log(np.exp(z).sum(axis=1)) - z[np.arange(10), y]
    result = m.evaluate(x, y)
    assert result["loss"] == pytest.approx(nll.mean(), rel=1e-5)
    assert result["accuracy"] == pytest.approx((logits.argmax(axis=1) == y).mean())


# ---- saving and loading ------------------------------------------------------------------------------
def test_save_and_load_continue_training_bit_for_bit(rt, tmp_path):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((24, 3, 8, 8)).astype(np.float32)
    y = rng.integers(0, 4, 24)
    a = small_cnn(rt, batch=6, seed=11)
    a.compile(Adam(lr=0.01), metrics=["accuracy"], configs={"dense_0": TileConfig((1, 2, 1))})
    a.fit(x, y, iterations=3, verbose=False)
    path = tmp_path / "cnn.npz"
    a.save(path)
    want = a.fit(x, y, iterations=5, verbose=False)

    b = Model.load(path, runtime=rt)
    assert [op.name for op in b.ops] == [op.name for op in a.ops] and b.step == 3
    assert b.configs == a.configs
    got = b.fit(x, y, iterations=5, verbose=False)
    assert got.loss == want.loss
    for k, v in a.parameters().items():
        assert np.array_equal(b.parameters()[k], v), k
    for k, v in a.stats().items():
        assert np.array_equal(b.stats()[k], v), k
    # new names continue where the saved model's left off
    assert b._name("conv2d", None) == "conv2d_1"

    # loading into a model with the same graph restores weights, state, optimizer and step
    c = small_cnn(rt, batch=6, seed=99)
    c.compile(Adam(lr=0.01), metrics=["accuracy"], configs={"dense_0": TileConfig((1, 2, 1))})
    c.load(path)
    assert c.step == 3
    c.fit(x, y, iterations=5, verbose=False)
    for k, v in a.parameters().items():
        assert np.array_equal(c.parameters()[k], v), k
    other = small_mlp(rt)
    with pytest.raises(ValueError, match=r"different graph than this model: its inputs are"):
        other.load(path)
    # a graph of the same op names with another attribute: the attribute is named
    same_names = small_cnn(rt, batch=6, seed=99, classes=5)
    with pytest.raises(ValueError,
                       match=r"different graph than this model: op 'dense_0' has out_features 4 there, 5 here"):
        same_names.load(path)
    # the saved configs place tiles on processor 1; a 1-cpu runtime needs configs of its own
    with Runtime(cpus=1) as one:
        with pytest.raises(ConfigError, match=r"load .*: the configs saved with the model do not fit this runtime's "
                                              r".*places tile 1 on device 1, but .* computes on 1 cpu: devices 0..0 "
                                              r"\(Model.load\(path, configs=...\) gives others\)"):
            Model.load(path, runtime=one)
        d = Model.load(path, runtime=one, configs={})
        saved = Model.load(path, runtime=rt)
        np.testing.assert_allclose(d.predict(x), saved.predict(x), rtol=1e-5, atol=1e-6)


def test_load_restores_step_and_data_order_without_optimizer_state(rt, tmp_path):
    """SGD without momentum keeps no state: the step and the data order come back all the same."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((24, 3, 8, 8)).astype(np.float32)
    y = rng.integers(0, 4, 24)
    a = small_cnn(rt, batch=6, seed=11)
    a.compile(SGD(lr=0.05))
    a.fit(x, y, iterations=3, verbose=False)
    path = tmp_path / "sgd.npz"
    a.save(path)
    want = a.fit(x, y, iterations=4, verbose=False)
    c = small_cnn(rt, batch=6, seed=99)
    c.compile(SGD(lr=0.05))
    c.load(path)
    assert c.step == 3
    assert c.fit(x, y, iterations=4, verbose=False).loss == want.loss


def test_a_checkpoint_of_format_1_numbered_processors_and_loads_on_the_machine_it_names(rt, tmp_path):
    """Format 2 saves configs' devices as compute devices; a format-1 file's were processor
    indices (a GPU run's GPUs after its CPU workers), now read as the devices they are."""
    m = Model(rt, seed=1)
    m.dense(m.input((4, 6)), 3, name="fc")
    m.compile(SGD(lr=0.1), configs={"fc": TileConfig((2, 1, 1))})
    m.save(tmp_path / "m.npz")
    with np.load(tmp_path / "m.npz") as f:
        arrays = {k: f[k] for k in f.files}
    meta = json.loads(str(arrays.pop("meta")))
    assert meta["graph"]["format"] == 2
    gpus = Machine.build(1, cpus_per_rank=3, gpus_per_rank=2)   # the GPUs are processors 3 and 4
    for devices, want in (([4, 3], (1, 0)), ([1, 3], "places op 'fc' on processor 1, not one of the 2 compute")):
        meta["graph"]["format"] = 1
        for config in meta["compiled"]["configs"].values():   # (fc's and the loss op's: two tiles each)
            config["devices"] = devices
        np.savez(tmp_path / "old.npz", meta=np.array(json.dumps(meta)), **arrays)
        with Runtime(gpus, execute=False) as other:
            if isinstance(want, str):
                with pytest.raises(ConfigError, match=want):
                    Model.load(tmp_path / "old.npz", runtime=other)
                continue
            back = Model.load(tmp_path / "old.npz", runtime=other)
            assert back.configs["fc"].devices == want
            assert list(back._low.plans["fc"].placement.values()) == devices


def test_an_uncompiled_model_saves_and_loads_its_graph_and_weights(rt, tmp_path):
    m = small_mlp(rt, seed=4)
    m.save(tmp_path / "mlp.npz")
    back = Model.load(tmp_path / "mlp.npz", runtime=rt)
    assert repr(back).endswith("not compiled)")
    for k, v in m.parameters().items():
        assert np.array_equal(back.parameters()[k], v)


# ---- names and errors ------------------------------------------------------------------------------
def test_names_are_stable_and_given_names_are_checked(rt):
    m = Model(rt)
    x = m.input((2, 4))
    assert x.name == "input_0"
    d = m.dense(x, 3)
    m.dense(d, 3, name="head")
    assert [op.name for op in m.ops] == ["dense_0", "head"]
    assert list(m.parameters()) == ["dense_0.weight", "dense_0.bias", "head.weight", "head.bias"]
    with pytest.raises(ValueError, match=r"relu: name 'head' is already used in this model \(by an op\)"):
        m.relu(d, name="head")
    with pytest.raises(ValueError, match=r"input: name 'head.out' is already used in this model \(by a tensor\)"):
        m.input((2, 3), name="head.out")
    with pytest.raises(ValueError, match="dense: name must be a non-empty string, got ''"):
        m.dense(d, 3, name="")
    # an op whose output would take an input's name (it used to replace the input, failing at fit)
    m.input((2, 3), name="tail.out")
    with pytest.raises(ValueError, match=r"dense 'tail': its output would be named 'tail.out', the name of a "
                                         r"tensor already in this model"):
        m.dense(d, 3, name="tail")
    assert [op.name for op in m.ops] == ["dense_0", "head"]
    with pytest.raises(TypeError, match="not a tensor of this model"):
        Model(rt).relu(x)
    with pytest.raises(ShapeError, match=r"concat 'concat_0': input 1 has shape \(2, 5\)"):
        m.concat([x, m.input((2, 5))], axis=0)
    assert m.relu(x).name == "relu_0.out" and m.concat([x, x], axis=1).name == "concat_0.out"
    parts = m.split(m.input((2, 7)), 3, axis=1)
    assert [t.shape for t in parts] == [(2, 3), (2, 3), (2, 1)]
    # a chunk size with a bad axis: the Split op's own error (it was an IndexError or a TypeError)
    with pytest.raises(ShapeError, match=r"split 'split_1': axis=3 is out of range for 2 dims"):
        m.split(x, 2, axis=3)
    with pytest.raises(ShapeError, match=r"split 'split_1': axis must be an int, got str '1'"):
        m.split(x, 2, axis="1")


@pytest.mark.parametrize("make,attr", [
    (lambda m: m.dense(m.input((2, 3)), True), "dense 'dense_0': out_features"),
    (lambda m: m.lstm(m.input((2, 3, 4)), True), "lstm 'lstm_0': hidden_size"),
    (lambda m: m.embedding(m.input((2, 3), dtype="int64"), True, 4), "embedding 'embedding_0': num_embeddings"),
    (lambda m: m.embedding(m.input((2, 3), dtype="int64"), 4, True), "embedding 'embedding_0': embedding_dim"),
    (lambda m: m.multihead_attention(m.input((2, 3, 4)), num_heads=True),
     "multihead_attention 'multihead_attention_0': num_heads"),
])
def test_a_bool_is_not_a_size(rt, make, attr):
    # as conv2d's out_channels: True used to pass for a size of 1
    with pytest.raises(ShapeError, match=f"{attr} must be a positive int, got True"):
        make(Model(rt))


def test_errors_come_before_any_work(rt):
    m = small_mlp(rt, batch=4)
    for bad, match in [(dict(loss="hinge"), "unknown loss 'hinge'"),
                       (dict(optimizer="rmsprop"), "unknown optimizer 'rmsprop'"),
                       (dict(metrics=["f1"]), "unknown metric 'f1'"),
                       (dict(loss="mean_squared_error", metrics=["accuracy"]), "'accuracy' needs loss"),
                       (dict(configs={"nope": TileConfig((1, 1))}), "configs name op 'nope'")]:
        issued = rt._next_id
        with pytest.raises(ValueError, match=match):
            m.compile(**bad)
        assert rt._next_id == issued
    with pytest.raises(ConfigError, match=r"dense 'dense_1'.* splits dim 1 \(parameter\) 9 ways"):
        m.compile(configs={"dense_1": TileConfig((1, 9, 1))})
    with pytest.raises(TypeError, match=r"compile: metrics must be a metric's name or a list of them, got int 5"):
        m.compile(metrics=5)   # ('int' object is not iterable)
    with pytest.raises(RuntimeError, match="fit: call compile"):
        m.fit(np.ones((4, 7)), np.zeros(4, np.int64))
    m.compile(SGD(lr=0.1), metrics=["accuracy"])
    x, y = np.ones((8, 7), np.float32), np.zeros(8, np.int64)
    issued = rt._next_id
    for call, match in [(lambda: m.fit({}, y), r"missing inputs \['input_0'\]"),
                        (lambda: m.fit({"input_0": x, "extra": x}, y), r"unknown inputs \['extra'\]"),
                        (lambda: m.fit(np.ones((8, 6)), y), r"shape \(8, 6\), expected \(N,\) \+ \(7,\)"),
                        (lambda: m.fit(x, np.zeros((8, 3))), r"labels must be 8 integers"),
                        (lambda: m.fit(x, np.full(8, 3)), "label 3 is out of range for 3 classes"),
                        (lambda: m.fit(x, y, batch_size=2), "built for batches of 4"),
                        (lambda: m.fit(x[:3], y[:3]), "fewer than one batch"),
                        (lambda: m.fit(x, y, epochs=1, iterations=2), "not both"),
                        (lambda: m.forward(x), "expects one batch of 4 samples, got 8"),
                        (lambda: m.evaluate(x, y[:5]), r"shape \(5,\)")]:
        with pytest.raises(ValueError, match=match):
            call()
    assert rt._next_id == issued
    with pytest.raises(RuntimeError, match="call forward"):
        m.backward(y[:4])
    with pytest.raises(RuntimeError, match="already compiled"):
        m.compile()
    with pytest.raises(RuntimeError, match="build the whole graph before compile"):
        m.relu(m.outputs[0])
    with pytest.raises(KeyError, match="unknown parameter 'dense_9.weight'"):
        m.set_parameters({"dense_9.weight": np.zeros(3)})
    with pytest.raises(ValueError, match=r"dense_0.bias has shape \(2,\), expected \(16,\)"):
        m.set_parameters({"dense_0.bias": np.zeros(2)})


def test_compile_refuses_an_output_whose_dim_0_is_not_the_batch():
    """A transpose that moves the batch used to compile, then fail in fit for any labels: the
    labels region took the output's dim 0 (6 here), fit wanted one label a sample (4)."""
    m = Model(Runtime(cpus=1), seed=0)
    a = m.input((4, 6, 2), name="a")
    m.softmax(m.dense(m.flat(m.transpose(a, (1, 0, 2))), 3))
    with pytest.raises(ValueError, match=r"compile: the output 'softmax_0.out' \(6, 3\) does not keep the batch "
                                         r"\(4 samples\) as dim 0"):
        m.compile(optimizer=SGD(lr=0.1))
    m.rt.shutdown()


def test_a_dropout_s_default_seed_stays_in_64_bits_for_any_model_seed():
    """It was seed * 1,000,003 + the op's index: from a model seed of about 1.8e13 a dropout was
    refused as `seed must be below 2**64` (apps' --seed 100000000000000 ended in a traceback)."""
    m = Model(weights=False, seed=10**14)
    m.dropout(m.input((2, 3)), 0.5, name="d")
    assert m.ops[0].seed == (10**14 * 1_000_003) % 2**64


def test_model_arguments_are_checked_before_a_runtime_is_made():
    for kwargs, error, match in (({"seed": -1}, ValueError, r"Model: seed must be >= 0, got -1"),
                                 ({"seed": 2.7}, TypeError, r"Model: seed must be an int, got float 2.7"),
                                 ({"runtime": "rt"}, TypeError, r"Model: runtime must be a taskrt Runtime, got str"),
                                 ({"weights": "no"}, TypeError, r"Model: weights must be True or False")):
        with pytest.raises(error, match=match):
            Model(**kwargs)


def test_a_model_dropped_without_close_stops_its_own_runtime_and_not_a_shared_one(rt):
    """Its workers hold the runtime, not the model: without this every dropped model left its
    threads behind. A collection on one of those workers shuts down on a thread of its own."""
    m = Model(seed=0)
    m.dense(m.input((4, 6)), 3)
    m.compile(SGD(lr=0.1))
    m.fit(np.ones((4, 6)), np.zeros(4, np.int64), iterations=2, verbose=False)
    own, workers = m.rt, list(m.rt.executor.threads)
    del m
    gc.collect()
    assert own._closed and not any(t.is_alive() for t in workers)

    m = Model(seed=0)   # train_on's task held the model (a bound method) in its runtime's caches
    m.dense(m.input((4, 6)), 3)
    m.compile(SGD(lr=0.1))
    list(m.train_on(lambda step, lo, hi: (np.ones((hi - lo, 6)), np.zeros(hi - lo, np.int64)), 2))
    own, workers = m.rt, list(m.rt.executor.threads)
    del m
    gc.collect()
    assert own._closed and not any(t.is_alive() for t in workers)

    m = Model(seed=0)
    own, workers = m.rt, list(m.rt.executor.threads)
    ran = []
    own.launch(lambda: (m._shut_when_dropped(), ran.append(threading.current_thread())))
    for t in workers:
        t.join(timeout=10)
    assert ran[0] in workers and own._closed and not any(t.is_alive() for t in workers)

    shared = Model(rt, seed=0)
    assert shared._shut_when_dropped is None
    shared.close()
    del shared
    gc.collect()
    assert not rt._closed


def test_closing_a_model_on_a_shared_runtime_frees_what_it_held_there(rt, tmp_path):
    """close() did nothing on a runtime given to the model: each model trained on it kept its
    weights, gradients, optimizer state and activations there (8.5 MB a model with a 1024-wide
    dense layer). Then the model refuses work, rather than train on what is gone."""
    def uids():
        rt.wait()
        return {uid for uid, _, _ in rt.store.instances}
    before = uids()
    m = Model(rt, seed=0)
    m.dense(m.input((4, 6)), 3, name="fc")
    m.compile(SGD(lr=0.1, momentum=0.9), configs={"fc": TileConfig((2, 1, 1))})
    m.fit(np.ones((4, 6)), np.zeros(4, np.int64), iterations=3, verbose=False)
    assert uids() > before
    g = m.train_on(lambda step, lo, hi: (np.ones((hi - lo, 6)), np.zeros(hi - lo, np.int64)), 4)
    next(g)
    m.save(tmp_path / "m.npz")
    m.close()
    assert uids() == before
    for what, call in (("fit", lambda: m.fit(np.ones((4, 6)), np.zeros(4, np.int64), verbose=False)),
                       ("parameters", m.parameters), ("set_parameters", lambda: m.set_parameters({})),
                       ("predict", lambda: m.predict(np.ones((4, 6)))), ("compile", m.compile),
                       ("save", lambda: m.save(tmp_path / "n.npz")), ("load", lambda: m.load(tmp_path / "m.npz")),
                       ("train_on", lambda: next(g))):   # (a generator went on: on regions gone)
        with pytest.raises(RuntimeError, match=f"^{what}: the model is closed$"):
            call()
    assert uids() == before
    m.close()   # (twice: nothing more)
    n = Model(rt, seed=0)   # the runtime goes on
    n.dense(n.input((4, 6)), 3)
    n.compile(SGD(lr=0.1))
    assert n.fit(np.ones((4, 6)), np.zeros(4, np.int64), iterations=1, verbose=False).loss[0] > 0
    n.close()


def test_a_graph_only_model_says_it_has_no_weights():
    m = Model(weights=False)
    m.dense(m.input((4, 6)), 3)
    for call in (m.parameters, lambda: m.set_parameters({})):
        with pytest.raises(RuntimeError, match=r"built with weights=False \(its graph alone\)"):
            call()


def test_compile_arguments_are_checked(tmp_path):
    m = Model(Runtime(cpus=1), seed=0)
    m.dense(m.input((4, 6), name="x"), 3)
    with pytest.raises(TypeError, match=r"compile: optimizer SGD is a class: give an object, SGD\(...\)"):
        m.compile(optimizer=SGD)
    with pytest.raises(TypeError, match=r"compile: configs must be a dict of op name -> TileConfig, got str"):
        m.compile(configs="dense_0")
    with pytest.raises(ValueError, match=r"set_parameters: dense_0.bias has values that float32 cannot hold"):
        m.set_parameters({"dense_0.bias": np.array([1e300] * 3)})
    with pytest.raises(ValueError, match=r"compile: SGD lr 1e\+300 is beyond the range of float32, the weights' type"):
        m.compile(optimizer=SGD(lr=1e300))   # (every weight became inf, then nan)
    m.compile(metrics="accuracy")   # one metric by name (it used to be taken letter by letter)
    m.rt.shutdown()
    n = Model(Runtime(cpus=1), seed=0)
    n.dense(n.input((4, 6), name="x"), 3)
    n.rt.shutdown()
    with pytest.raises(RuntimeError, match="the runtime has been shut down"):
        n.compile()
    assert "not compiled" in repr(n)


def test_a_file_that_does_not_fit_changes_nothing(tmp_path):
    """The optimizer state was checked after the weights were already put in."""
    a = Model(Runtime(cpus=1), seed=1)
    a.dense(a.input((4, 6), name="x"), 3)
    a.compile(SGD(lr=0.1))
    a.save(tmp_path / "a.npz")
    b = Model(Runtime(cpus=1), seed=2)
    b.dense(b.input((4, 6), name="x"), 3)
    b.compile(optimizer=Adam())
    before = b.parameters()
    with pytest.raises(ValueError, match=r"no optimizer state 'opt/dense_0.weight/exp_avg'"):
        b.load(tmp_path / "a.npz")
    after = b.parameters()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    a.rt.shutdown()
    b.rt.shutdown()


def test_fit_options_are_checked_before_a_step_and_forward_takes_one_name():
    m = Model(Runtime(cpus=1), seed=0)
    m.softmax(m.dense(m.input((4, 6), name="x"), 3))
    m.compile(SGD(lr=0.1))
    x, y = np.zeros((4, 6), np.float32), np.zeros(4, np.int64)
    before = m.parameters()["dense_0.weight"]
    for kwargs, match in (({"stream": 5}, r"fit: stream must have write"),
                          ({"shuffle": "no"}, r"fit: shuffle must be True or False, got str 'no'"),
                          ({"verbose": "no"}, r"fit: verbose must be True or False"),
                          ({"stop_on_nan": "x"}, r"fit: stop_on_nan must be True or False")):
        with pytest.raises(TypeError, match=match):
            m.fit(x, y, iterations=1, **kwargs)
    assert np.array_equal(before, m.parameters()["dense_0.weight"]) and m.step == 0
    assert list(m.forward(x, outputs="dense_0.out")) == ["dense_0.out"]
    with pytest.raises(TypeError, match="forward: training must be True or False, got str 'no'"):
        m.forward(x, training="no")   # it used to run in training mode: a non-empty string is true
    m.rt.shutdown()


def test_inputs_that_float32_cannot_hold_and_a_list_for_one_input_are_named():
    m = Model(Runtime(cpus=1), seed=0)
    m.softmax(m.dense(m.input((4, 6), name="x"), 3))
    m.compile(SGD(lr=0.1))
    y = np.zeros(4, np.int64)
    with pytest.raises(ValueError, match=r"fit: input 'x' has values that float32 cannot hold \(largest magnitude "
                                         r"1e\+300\); they would become inf"):
        m.fit(np.full((4, 6), 1e300), y, iterations=1)
    with pytest.raises(ValueError, match=r"fit: 4 input arrays for 1 inputs \(a list is one array per input"):
        m.fit(np.zeros((4, 6)).tolist(), y, iterations=1)
    m.fit(np.zeros((4, 6)), y, iterations=1, verbose=False)   # float64 that fits is taken
    m.rt.shutdown()
