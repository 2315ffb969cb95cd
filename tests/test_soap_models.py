"""The paper's kinds of network (and a batch-matmul mixer) under random SOAP configs: every split each op declares
(sample, attribute, parameter, partial-sum reduce, head, ordered sequence chunks, batch
norm's synchronized statistics) trains to the numbers of one device; and the Operation
dimension: branches on disjoint devices run at the same time, stacked LSTM layers on two
devices as a wavefront."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ops import SGD, Model, TileConfig
from ops.lower import Lowering
from strategies.random import random_config
from taskrt import Machine, Runtime, TaskNode

DEVICES = (1, 2, 4)
STEPS = 3


@pytest.fixture(scope="module")
def runtimes():
    rts = {n: Runtime(cpus=n, separate_memories=True) for n in DEVICES}
    yield rts
    for rt in rts.values():
        rt.shutdown()


def cnn(rt, seed=1):
    """conv, batch norm (and one with its relu fused), pool and a dense pair."""
    m = Model(rt, seed=seed)
    x = m.input((4, 2, 8, 8), name="img")
    h = m.relu(m.batch_norm(m.conv2d(x, 4, 3, padding=1)))
    h = m.batch_norm(m.conv2d(m.pool2d(h, 2), 4, 3, padding=1), relu=True)
    h = m.dense(m.flat(h), 8, activation="relu")
    m.softmax(m.dense(h, 3))
    return m


def rnn(rt, seed=2):
    """An embedding, two stacked LSTMs and a dense head on the last hidden state."""
    m = Model(rt, seed=seed)
    idx = m.input((4, 6), "int64", name="tokens")
    y, _, _ = m.lstm(m.embedding(idx, 10, 6), 8)
    _, h, _ = m.lstm(y, 8)
    m.dense(h, 3)
    return m


def transformer(rt, seed=3):
    """Self-attention with a residual and layer norm, then a column/row dense pair with gelu."""
    m = Model(rt, seed=seed)
    x = m.input((4, 6, 8), name="seq")
    h = m.layer_norm(m.add(x, m.multihead_attention(x, num_heads=2)))
    f = m.dense(m.gelu(m.dense(h, 16)), 8)
    m.layer_norm(m.add(h, f))
    return m


def mixer(rt, seed=4):
    """Token mixing written with batch matmuls (scores x x^T, a softmax, scores @ x), then a dense."""
    m = Model(rt, seed=seed)
    x = m.input((4, 6, 8), name="seq")
    h = m.dense(x, 8)
    mixed = m.batch_matmul(m.softmax(m.batch_matmul(h, m.transpose(h, [0, 2, 1]))), h)
    m.dense(m.add(x, mixed), 8)
    return m


def data(kind: str):
    """(inputs, labels, loss) of one batch for a model kind."""
    rng = np.random.default_rng(7)
    if kind == "cnn":
        return rng.standard_normal((4, 2, 8, 8)).astype(np.float32), rng.integers(0, 3, 4), \
            "sparse_categorical_crossentropy"
    if kind == "rnn":
        return rng.integers(0, 10, (4, 6)), rng.integers(0, 3, 4), "sparse_categorical_crossentropy"
    return rng.standard_normal((4, 6, 8)).astype(np.float32), rng.standard_normal((4, 6, 8)).astype(np.float32), \
        "mean_squared_error"


MODELS = {"cnn": cnn, "rnn": rnn, "transformer": transformer, "mixer": mixer}


def train(m: Model, kind: str, configs: dict) -> tuple[list[float], dict, dict]:
    """Loss of each of STEPS SGD steps, then the parameters and running stats."""
    x, y, loss = data(kind)
    m.compile(SGD(lr=0.05, momentum=0.9), loss, configs=configs)
    history = m.fit(x, y, iterations=STEPS, shuffle=False, verbose=False)
    return history.loss, m.parameters(), m.stats()


_REFERENCE: dict[str, tuple] = {}


def reference(kind: str, rt) -> tuple:
    """The one-tile, one-device run of a model kind (computed once)."""
    if kind not in _REFERENCE:
        m = MODELS[kind](rt)
        _REFERENCE[kind] = train(m, kind, {op.name: TileConfig((1,) * len(op.tile_shape), (0,)) for op in m.ops})
    return _REFERENCE[kind]


@pytest.mark.parametrize("devices", DEVICES)
@pytest.mark.parametrize("kind", sorted(MODELS))
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_random_configs_train_like_one_device(runtimes, kind, devices, seed):
    rt = runtimes[devices]
    want_loss, want_params, want_stats = reference(kind, runtimes[1])
    m = MODELS[kind](rt)
    rng = np.random.default_rng(seed)
    configs = {op.name: random_config(op, rt.machine, rng) for op in m.ops}
    loss, params, stats = train(m, kind, configs)
    where = f"{kind} on {devices} devices, configs {({k: str(v) for k, v in configs.items()})}"
    np.testing.assert_allclose(loss, want_loss, rtol=1e-4, err_msg=where)
    for got, want in ((params, want_params), (stats, want_stats)):
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6, err_msg=f"{where}: {k}")


def test_every_new_split_at_once_trains_like_one_device(runtimes):
    """The splits a random draw may miss, all in one run on 4 devices: batch norm over samples
    and rows, dense and batch matmul over their inner dims, embedding over its vocabulary,
    attention over its heads, LSTM over its sequence."""
    rt = runtimes[4]
    for kind, split in (("cnn", {"batch_norm_0": (2, 1, 2, 1), "batch_norm_1": (1, 2, 1, 2), "dense_1": (1, 1, 4)}),
                        ("rnn", {"embedding_0": (1, 2, 1, 2), "lstm_0": (2, 2, 1), "lstm_1": (1, 4, 1),
                                 "dense_0": (2, 1, 2)}),
                        ("transformer", {"multihead_attention_0": (1, 2, 1, 2), "dense_0": (1, 1, 4, 1),
                                         "dense_1": (1, 1, 1, 4)}),
                        ("mixer", {"batch_matmul_0": (1, 1, 2, 2), "batch_matmul_1": (2, 1, 1, 2)})):
        m = MODELS[kind](rt)
        configs = {name: TileConfig(degrees) for name, degrees in split.items()}
        loss, params, stats = train(m, kind, configs)
        want_loss, want_params, want_stats = reference(kind, runtimes[1])
        np.testing.assert_allclose(loss, want_loss, rtol=1e-4, err_msg=kind)
        for k in want_params:
            np.testing.assert_allclose(params[k], want_params[k], rtol=1e-4, atol=1e-6, err_msg=f"{kind}: {k}")
        for k in want_stats:
            np.testing.assert_allclose(stats[k], want_stats[k], rtol=1e-4, atol=1e-6, err_msg=f"{kind}: {k}")


# ---- the Operation dimension -----------------------------------------------------------------------
def _intervals(rt, ops: set[str]) -> list[tuple[float, float, str]]:
    return [(e["start"], e["end"], e["proc"]) for e in rt.tracer.records() if e["kind"] == "task" and e["op"] in ops]


def test_two_branches_on_disjoint_devices_run_at_the_same_time():
    with Runtime(cpus=2, separate_memories=True, trace=True) as rt:
        m = Model(rt, seed=4)
        x = m.input((256, 512))
        a = m.dense(m.dense(x, 512, activation="relu", name="a0"), 512, activation="relu", name="a1")
        b = m.dense(m.dense(x, 512, activation="relu", name="b0"), 512, activation="relu", name="b1")
        m.dense(m.concat([a, b], axis=1), 4, name="head")
        on = {name: TileConfig((1, 1, 1), (dev,)) for name, dev in (("a0", 0), ("a1", 0), ("b0", 1), ("b1", 1))}
        m.compile(SGD(lr=0.01), "mean_squared_error", configs=on)
        rng = np.random.default_rng(0)
        m.fit(rng.standard_normal((256, 512)).astype(np.float32), rng.standard_normal((256, 4)).astype(np.float32),
              iterations=2, verbose=False)
        rt.wait()
        first, second = _intervals(rt, {"a0", "a1"}), _intervals(rt, {"b0", "b1"})
    assert {p for _, _, p in first} == {"r0.cpu0"} and {p for _, _, p in second} == {"r0.cpu1"}
    overlap = max(min(e1, e2) - max(s1, s2) for s1, e1, _ in first for s2, e2, _ in second)
    assert overlap > 0, "no task of branch a ran while a task of branch b did"


def _ancestors(graph, node_id: int) -> set[int]:
    seen, stack = set(), [node_id]
    while stack:
        for p in graph.preds[stack.pop()]:
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def test_stacked_lstms_on_two_devices_form_a_wavefront():
    """Sequence chunks chain through the carry alone: chunk k of layer 2 waits for chunk k of layer 1
    and chunk k-1 of layer 2, never for chunk k+1 of layer 1 (and the other way round in backward)."""
    with Runtime(machine=Machine.build(1, 2), execute=False) as rt:
        m = Model(rt, seed=5)
        y, _, _ = m.lstm(m.input((2, 8, 4)), 6, name="l1")
        y, _, _ = m.lstm(y, 6, name="l2")
        m.dense(y, 3, name="head")
        ops, inputs, loss = m.training_graph("mean_squared_error")
        configs = {op.name: TileConfig((1,) * len(op.tile_shape), (0,)) for op in ops}
        configs.update(l1=TileConfig((1, 4, 1), (0,) * 4), l2=TileConfig((1, 4, 1), (1,) * 4))
        low = Lowering(rt, ops, inputs, configs, SGD(lr=0.1), loss=loss.name)
        low.forward(training=True)
        low.backward()
        graph = rt.graph
        tasks = {n.name: n.id for n in graph.nodes.values() if isinstance(n, TaskNode)}
        for k in range(4):
            up = _ancestors(graph, tasks[f"l2.fwd[{k}]"])
            assert tasks[f"l1.fwd[{k}]"] in up and (k == 0 or tasks[f"l2.fwd[{k - 1}]"] in up)
            assert all(tasks[f"l1.fwd[{j}]"] not in up for j in range(k + 1, 4)), f"layer 2 chunk {k} waits too long"
            back = _ancestors(graph, tasks[f"l1.bwd[{k}]"])
            assert tasks[f"l2.bwd[{k}]"] in back
            assert all(tasks[f"l2.bwd[{j}]"] not in back for j in range(k)), f"layer 1 chunk {k} waits too long"


@pytest.mark.parametrize("ranks", [2, 4])
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_random_configs_on_mpi_ranks_train_like_one_device(ranks, seed):
    """tests/mpi_programs/soap_models.py: every model kind under a random strategy over 2 and 4
    ranks (tiles, partial sums, carries and weight shards crossing ranks) equals one device."""
    from tests.test_mpi import assert_every_rank_ok, run_mpi
    proc, _ = run_mpi(ranks, "soap_models.py", seed, timeout=180)
    assert_every_rank_ok(proc, ranks)
