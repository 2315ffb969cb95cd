"""Weight synchronization under data parallelism: sharded, bandwidth-optimal, and exact.

A weight replicated over P devices is reduce-scattered by the runtime's partial folds and
all-gathered by the next forward's reads (ops/lower.py UpdatePlan, taskrt/analysis.py
_flush): per training step no memory takes in or sends out much more than 2(P-1)/P of the
weights' bytes. Checked on graphs built with execute=False, then by running it.
"""
from __future__ import annotations

import numpy as np
import pytest

from ops.model import Model
from ops.optimizers import SGD, Adam
from strategies.graph import weight_sync_bytes
from taskrt import Runtime
from taskrt.machine import Machine
from taskrt.taskgraph import CopyNode
from tests.test_soap_models import _ancestors


def _mlp(rt, batch=64, width=512, seed=0):
    model = Model(rt, seed=seed)
    x = model.input((batch, width), name="x")
    h = model.dense(x, width, activation="relu")
    model.dense(h, 10)
    return model


@pytest.mark.parametrize("ranks,per_rank", [(1, 2), (1, 4), (1, 8), (1, 64), (2, 1), (2, 4), (4, 2), (8, 8)])
def test_data_parallel_moves_about_2_p_minus_1_over_p_of_the_weights_per_memory(ranks, per_rank):
    machine = Machine.build(ranks, per_rank, separate_memories=True)
    p = ranks * per_rank
    with Runtime(machine, execute=False) as rt:
        model = _mlp(rt)
        model.compile(optimizer=SGD(lr=0.1, momentum=0.9))
        low = model._low
        model._attach({"x": np.zeros((64, 512), "float32")}, np.zeros(64, "int64"))
        low.train_step(1)  # the first step starts from the host copies attach made
        first = rt._next_id
        low.train_step(2)
        into, out = weight_sync_bytes([rt.graph.nodes[i] for i in range(first, rt._next_id)],
                                      low.params.values())
    weight_bytes = sum(int(np.prod(p_.value.shape)) * 4 for p_ in low.params.values())
    ideal = 2 * (p - 1) / p * weight_bytes
    memories = {proc.memory for proc in machine.processors}
    assert set(into) == memories and set(out) == memories
    for mem in memories:
        assert 0.9 * ideal <= into[mem] <= 1.1 * ideal, (mem, into[mem], ideal)
        assert 0.9 * ideal <= out[mem] <= 1.1 * ideal, (mem, out[mem], ideal)


def test_weight_sync_bytes_counts_a_copy_into_its_destination_and_out_of_its_source():
    """Data parallelism moves as much into each memory as out of it, so the test above could not
    tell the two counts apart: one copy each way is checked here by hand."""
    from types import SimpleNamespace
    from taskrt import Rect, Region
    from taskrt.machine import Memory
    w, g, other = Region((4, 2), "float32", "w"), Region((4, 2), "float64", "w.grad"), Region((4,), "float32", "x")
    a, b = Memory("sys", 0, 0), Memory("sys", 0, 1)
    nodes = [CopyNode(0, w, Rect((0, 0), (2, 2)), a, b), CopyNode(1, g, Rect((0, 0), (4, 2)), b, a, "+", (7, 0)),
             CopyNode(2, other, Rect((0,), (4,)), a, b), CopyNode(3, w, Rect((0, 0), (4, 2)), a, a)]
    into, out = weight_sync_bytes(nodes, [SimpleNamespace(value=w, grad=g)])
    assert into == {b: 16, a: 64} and out == {a: 16, b: 64}


def test_the_folds_of_different_shards_do_not_wait_for_each_other():
    machine = Machine.build(1, 4, separate_memories=True)
    with Runtime(machine, execute=False) as rt:
        model = _mlp(rt, batch=8, width=64)
        model.compile(optimizer=SGD(lr=0.1))
        low = model._low
        model._attach({"x": np.zeros((8, 64), "float32")}, np.zeros(8, "int64"))
        low.train_step(1)
        first = rt._next_id
        low.train_step(2)
        grad = low.params["dense_0.weight"].grad
        folds = [rt.graph.nodes[i] for i in range(first, rt._next_id)
                 if isinstance(rt.graph.nodes.get(i), CopyNode) and rt.graph.nodes[i].redop
                 and rt.graph.nodes[i].region is grad]
        # 4 replicas' partial gradients, each folded in 4 shards: one fold per (replica, shard)
        assert len(folds) == 16 and len({f.rect for f in folds}) == 4
        assert {f.dst for f in folds} == {p.memory for p in machine.processors}
        ids = {f.id for f in folds}
        ancestors = {i: _ancestors(rt.graph, i) for i in ids}
        for f in folds:
            # a fold waits only for folds of its own shard
            assert all(rt.graph.nodes[a].rect == f.rect for a in ancestors[f.id] & ids)


def test_optimizer_state_lives_only_in_its_shard():
    machine = Machine.build(1, 4, separate_memories=True)
    with Runtime(machine) as rt:
        model = _mlp(rt, batch=8, width=64)
        model.compile(optimizer=Adam(lr=0.01))
        rng = np.random.default_rng(0)
        model.fit({"x": rng.standard_normal((8, 64)).astype("float32")}, rng.integers(0, 10, 8), iterations=2,
                  verbose=False)
        rt.wait()
        low = model._low
        update = next(u for u in low.updates if u.param.name == "dense_0.weight")
        assert len(update.colors) == 4
        state = low.params["dense_0.weight"].state["exp_avg"]
        st = rt.analyzer.state(state)
        # every piece of the state is valid in exactly one memory: its shard's device
        for rect, valid in st.pieces.items():
            owners = [c for c, r in update.reqs[0].partition.rects.items() if r == rect]
            assert len(owners) == 1 and list(valid) == [machine.processors[update.placement[owners[0]]].memory]


@pytest.mark.parametrize("optimizer", [SGD(lr=0.05, momentum=0.9), Adam(lr=0.01)], ids=["sgd", "adam"])
def test_sharded_updates_equal_one_device(optimizer):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 24)).astype("float32")
    y = rng.integers(0, 10, 16)
    results = []
    for cpus in (1, 4):
        with Runtime(cpus=cpus, separate_memories=True) as rt:
            model = _mlp(rt, batch=16, width=24, seed=3)
            model.compile(optimizer=optimizer)
            history = model.fit({"x": x}, y, iterations=3, verbose=False)
            results.append((history.loss, model.parameters()))
    (loss1, params1), (loss4, params4) = results
    np.testing.assert_allclose(loss4, loss1, rtol=1e-5)
    for k in params1:
        np.testing.assert_allclose(params4[k], params1[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_small_weights_take_fewer_shards_than_devices():
    machine = Machine.build(1, 4, separate_memories=True)
    with Runtime(machine, execute=False) as rt:
        model = _mlp(rt, batch=8, width=64)
        model.compile(optimizer=SGD(lr=0.1))
        shards = {u.param.name: len(u.colors) for u in model._low.updates}
    # 16 KiB over 4 devices: 4 shards; 256 B of bias: one piece; 2.5 KiB: 2 shards of >= 1 KiB
    assert shards == {"dense_0.weight": 4, "dense_0.bias": 1, "dense_1.weight": 2, "dense_1.bias": 1}


def test_weights_of_fewer_shards_than_devices_take_turns_over_the_devices():
    """Each weight's shards start one device after the last weight's (UpdatePlan's rotate): a bias
    and a small weight's shards all went to the first device, which then updated every small
    weight and gathered their gradients."""
    machine = Machine.build(1, 4, separate_memories=True)
    with Runtime(machine, execute=False) as rt:
        model = _mlp(rt, batch=8, width=64)
        model.compile(optimizer=SGD(lr=0.1))
        devices = {u.param.name: list(u.placement.values()) for u in model._low.updates}
    assert devices == {"dense_0.weight": [0, 1, 2, 3], "dense_0.bias": [1], "dense_1.weight": [2, 3],
                       "dense_1.bias": [3]}
