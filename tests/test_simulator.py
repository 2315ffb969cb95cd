"""The simulator times the runtime's own graph of one iteration against the cost model."""
from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ops.lower import TileConfig
from ops.model import Model
from ops.strategy import Strategy, StrategyError
from strategies import data_parallel, model_parallel
from strategies.cost import CostModel
from strategies.graph import build_iteration
from strategies.machine_model import load_machine
from strategies.random import random_config
from strategies.segments import AssembledIteration
from strategies.simulator import Simulator
from strategies.timing import NO_NAPS, Naps
from taskrt import Rect, Runtime, TaskNode
from taskrt.taskgraph import CopyNode
from tests.test_soap_models import MODELS, data


def mlp(batch=64, width=256):
    m = Model(Runtime(execute=False), weights=False)
    x = m.input((batch, width), name="x")
    h = m.dense(x, width, activation="relu")
    m.dense(h, 10)
    return m


def test_one_device_runs_every_task_in_turn():
    mm = load_machine("p100", nodes=1)
    mm = dataclasses.replace(mm, devices_per_node=1)
    sim = Simulator.for_model(mlp(), mm, CostModel(mm, measured=False))
    result = sim.simulate(data_parallel(mlp(), sim.machine))
    graph = result.graph
    gpu = next(i for i, p in enumerate(sim.machine.processors) if p.kind == "gpu")
    on_gpu = [i for i, n in enumerate(graph.nodes) if isinstance(n, TaskNode)
              and sim.machine.processors.index(n.proc) == gpu]
    res, dur, _, _, _ = sim.node_costs(graph)
    assert result.busy[gpu] == pytest.approx(sum(dur[i] for i in on_gpu))
    assert result.time >= result.busy[gpu]
    # tasks on one processor never overlap
    spans = sorted((result.timing.start[i], result.timing.end[i]) for i in on_gpu)
    assert all(a[1] <= b[0] + 1e-15 for a, b in zip(spans, spans[1:]))


def test_the_optimizer_s_state_and_updates_are_part_of_the_step():
    """Adam keeps two states a weight where SGD with momentum keeps one, each in the weight's
    update shards, and the host keeps the state it attached at the start whole: given Adam, the
    simulator's devices hold one more copy of every weight between them and the host one more,
    and its updates take longer. Given none, the graph, the memory and the costs
    all take the cost model's optimizer (a run with the apps' default, SGD with momentum 0.9)."""
    model = mlp()
    mm = load_machine("p100", nodes=1)
    sgd = Simulator.for_model(model, mm, CostModel(mm, measured=False))
    adam = Simulator.for_model(model, mm, CostModel(mm, measured=False), optimizer="adam")
    assert sgd.optimizer is sgd.cost.optimizer and sgd.optimizer.state_names() == ("momentum",)
    procs = len(adam.machine.processors)
    assert repr(adam) == f"Simulator({len(adam.ops)} ops on p100, {procs} processors, adam updates)"
    strategy = data_parallel(model, sgd.machine)
    a, s = adam.simulate(strategy), sgd.simulate(strategy)
    weights = sum(4 * int(np.prod(shape)) for op in model.ops for shape in op.weight_shapes().values())
    assert sum(a.peak_memory.values()) - sum(s.peak_memory.values()) == 2 * weights
    assert sum(a.busy.values()) > sum(s.busy.values()) and a.time > s.time


def test_a_strategy_that_names_no_op_of_the_model_is_refused():
    """A dict naming an op the model does not have used to be simulated as data parallelism."""
    model = mlp()
    mm = load_machine("p100", nodes=1)
    sim = Simulator.for_model(model, mm, CostModel(mm, measured=False))
    first = model.ops[0].name
    with pytest.raises(ValueError, match=r"simulate: no op named 'nosuch' in the model \(its ops: "):
        sim.simulate({"nosuch": sim.configs(None)[first]})
    with pytest.raises(TypeError, match="simulate: a strategy is a Strategy, a dict .* got str 'data'"):
        sim.simulate("data")
    with pytest.raises(TypeError, match="simulate: delta must be True or False, got str 'no'"):
        sim.simulate(None, delta="no")   # (it ran as delta=True)


def test_a_model_its_costs_and_its_source_are_checked_when_the_simulator_is_made():
    """An output that moves the batch used to fail at simulate, naming the labels and a batch
    source the user never made; a cost model of another machine, or a source that is no function,
    were taken (the first timed the machine's devices with another's figures)."""
    moved = Model(weights=False)
    moved.transpose(moved.dense(moved.input((8, 4, 6)), 3), (1, 0, 2))
    p100, k80 = load_machine("p100", nodes=1), load_machine("k80", nodes=1)
    with pytest.raises(ValueError, match=r"Simulator.for_model: the output 'transpose_0.out' \(4, 8, 3\) does "
                                         r"not keep the batch"):
        Simulator.for_model(moved, p100)
    with pytest.raises(ValueError, match=r"Simulator.for_model: unknown loss 'hinge'"):   # (it said 'compile:')
        Simulator.for_model(mlp(), p100, loss="hinge")
    with pytest.raises(ValueError, match="Simulator: the cost model times k80's devices .* the machine model is p100"):
        Simulator.for_model(mlp(), p100, CostModel(k80))
    with pytest.raises(TypeError, match="Simulator: source must be a function source\\(step, lo, hi\\)"):
        Simulator.for_model(mlp(), p100, source="data")
    assert Simulator.for_model(mlp(), load_machine("p100", nodes=2), CostModel(p100)).machine.num_ranks == 2


def test_the_graph_is_the_runtimes_second_iteration():
    m = mlp(batch=8, width=64)
    ops, inputs, loss = m.training_graph()
    mm = load_machine("p100", nodes=1)
    machine = mm.to_machine()
    from ops.lower import default_config
    graph = build_iteration(ops, inputs, loss.name, {op.name: default_config(op, machine) for op in ops}, machine)
    phases = {graph.task_cost(n).phase for n in graph.nodes if isinstance(n, TaskNode)}
    assert {"forward", "backward", "update", "fill"} <= phases
    names = [n.name for n in graph.nodes if isinstance(n, TaskNode)]
    assert names.index("dense_0.fwd") < names.index("dense_1.fwd") < names.index("dense_1.bwd") \
        < names.index("dense_0.bwd") < names.index("dense_0.weight.update")
    # weights are sharded over the 4 GPUs: each update has 4 pieces, each gradient shard 3 remote folds
    assert names.count("dense_0.weight.update") == 4
    folds = [n for n in graph.nodes if isinstance(n, CopyNode) and n.redop and n.region.name == "dense_0.weight.grad"
             and n.src != n.dst]
    assert len(folds) == 4 * 3
    for i, preds in enumerate(graph.preds):
        assert all(p < i for p in preds)


def test_more_devices_share_the_compute_and_pay_for_copies():
    model = mlp(batch=256, width=1024)
    times = {}
    for nodes in (1, 2):
        mm = load_machine("p100", nodes=nodes)
        sim = Simulator.for_model(model, mm, CostModel(mm, measured=False))
        result = sim.simulate(data_parallel(model, sim.machine))
        times[nodes] = result
        gpu_busy = [b for i, b in result.busy.items() if sim.machine.processors[i].kind == "gpu"]
        assert len(gpu_busy) == 4 * nodes and max(gpu_busy) < 1.5 * min(gpu_busy)
    assert max(times[2].busy.values()) < max(times[1].busy.values())
    # every weight byte crosses a link twice per step (reduce-scatter and all-gather): copies exist
    assert any(isinstance(n, CopyNode) and n.src.rank != n.dst.rank for n in times[2].graph.nodes)


def test_a_strategy_that_does_not_fit_is_flagged():
    model = mlp(batch=64, width=512)
    mm = load_machine("p100", nodes=1)
    small = dataclasses.replace(mm, device=dataclasses.replace(mm.device, mem_bytes=1 << 16))
    sim = Simulator.for_model(model, small, CostModel(small, measured=False))
    result = sim.simulate(data_parallel(model, sim.machine))
    assert not result.fits and max(result.peak_memory.values()) > 1 << 16
    roomy = Simulator.for_model(model, mm, CostModel(mm, measured=False)).simulate(model_parallel(model, sim.machine))
    assert roomy.fits


_preds = AssembledIteration.preds.fget


def test_the_trace_is_in_the_runtimes_format(tmp_path, monkeypatch):
    model = mlp(batch=16, width=32)
    mm = load_machine("k80", nodes=1)
    sim = Simulator.for_model(model, mm, CostModel(mm, measured=False))
    result = sim.simulate(model_parallel(model, sim.machine))
    made = []   # an assembled graph's preds are made at each access: read once (8,000 nodes took 26 s)
    monkeypatch.setattr(type(result.graph), "preds", property(lambda g: made.append(1) or _preds(g)))
    path = result.write_trace(str(tmp_path / "sim.jsonl"))
    assert len(made) == 1
    monkeypatch.undo()
    lines = [json.loads(line) for line in open(path)]
    assert lines[0]["kind"] == "meta" and lines[0]["simulated"] is True
    events = lines[1:]
    assert {"id", "name", "kind", "op", "rank", "proc", "start", "end", "bytes", "point"} <= set(events[0])
    assert max(e["end"] for e in events) == pytest.approx(result.time * 1e6, abs=1e-3)
    assert all(e["end"] >= e["start"] for e in events)
    assert len(events) == len(result.graph.nodes)
    ids = {e["id"] for e in events}
    assert all(set(e["preds"]) <= ids for e in events) and sum(len(e["preds"]) for e in events) == sum(
        map(len, result.graph.preds))
    # a task's or a fold's event starts after its launch, the hand-off a run's trace shows as a wait
    launch = mm.launch_overhead * 1e6
    folds = [e for e in events if e["kind"] == "reduce"]
    assert folds and {e["launch"] for e in events if e["kind"] in ("task", "reduce")} == {launch}
    assert {e["launch"] for e in events if e["kind"] == "copy" and "->" in e["proc"]
            and e["proc"].split("->")[0] != e["proc"].split("->")[1]} == {0}
    for e in events:
        i = e["id"]
        assert e["start"] - e["launch"] == pytest.approx(result.timing.start[i] * 1e6, abs=1e-3)
        assert e["end"] == pytest.approx(result.timing.end[i] * 1e6, abs=1e-3)


def test_every_rank_makes_its_share_of_the_batch_on_its_host_as_train_on_does():
    """The iteration starts with one source task a rank on its host processor, writing its share of
    the inputs and labels (Model.train_on's launch); a data-parallel input is read where it was
    made, so no copy of the inputs or labels crosses ranks; the source's time is the cost model's."""
    model = mlp(batch=10, width=32)
    mm = dataclasses.replace(load_machine("local", nodes=3), devices_per_node=1)
    cost = CostModel(mm, measured=False)
    sim = Simulator.for_model(model, mm, cost)
    result = sim.simulate(data_parallel(model, sim.machine))
    graph = result.graph
    sources = [(i, n) for i, n in enumerate(graph.nodes) if isinstance(n, TaskNode) and n.name == "source"]
    assert [n.proc for _, n in sources] == [sim.machine.host_processor(r) for r in range(3)]
    assert [[r.rect for r in n.reqs] for _, n in sources] == [
        [Rect((lo, 0), (hi, 32)), Rect((lo,), (hi,))] for lo, hi in ((0, 3), (3, 6), (6, 10))]
    assert all(not graph.preds[i] for i, _ in sources)
    inputs = {r.region.name for r in sources[0][1].reqs}
    assert not [n for n in graph.nodes if isinstance(n, CopyNode) and n.region.name in inputs
                and n.src.rank != n.dst.rank]
    _, dur, _, _, _ = sim.node_costs(graph)
    for i, n in sources:
        assert dur[i] == pytest.approx(cost.source_time(n.reqs[0].rect.shape[0], n.nbytes, n.proc))
    slow = CostModel(mm, measured=False)
    slow.source_time = lambda samples, nbytes, device: 1e-3 * samples
    slowed = Simulator.for_model(model, mm, slow).simulate(data_parallel(model, sim.machine)).time
    assert slowed > 4e-3 and slowed > result.time   # rank 2's 4 samples come first


def test_a_copy_between_ranks_holds_its_sending_and_receiving_processors():
    """On a cpu machine with message overheads each copy between ranks adds send_overhead to its
    source's processor and receive_overhead to its destination's, and ends no sooner than its
    receive; copies within a rank and every task are costed as without them."""
    model = mlp(batch=16, width=32)
    plain = dataclasses.replace(load_machine("local", nodes=2), devices_per_node=1, send_overhead=0.0,
                                receive_overhead=0.0)
    handled = dataclasses.replace(plain, send_overhead=3e-4, receive_overhead=7e-4)
    results = []
    for mm in (plain, handled):
        sim = Simulator.for_model(model, mm, CostModel(mm, measured=False))
        results.append(sim.simulate(data_parallel(model, sim.machine)))
    base, result = results
    procs = sim.machine.processors
    sends, receives = {i: 0 for i in result.busy}, {i: 0 for i in result.busy}
    between = [i for i, n in enumerate(result.graph.nodes) if isinstance(n, CopyNode) and n.src.rank != n.dst.rank]
    assert between
    for i in between:
        node = result.graph.nodes[i]
        sends[next(k for k, p in enumerate(procs) if p.memory == node.src)] += 1
        receives[next(k for k, p in enumerate(procs) if p.memory == node.dst)] += 1
        assert result.timing.end[i] - result.timing.start[i] >= 7e-4
    for k in result.busy:
        assert result.busy[k] == pytest.approx(base.busy[k] + 3e-4 * sends[k] + 7e-4 * receives[k])
    assert result.time > base.time


def test_a_receipt_waits_for_its_receivers_nap_only_where_the_ranks_share_cores(monkeypatch):
    """Where a node's ranks have no core to spare for their progress threads (as the runtime
    decides: Machine.threads_fit_node), each receipt waits for its receiver's nap (Naps, in
    flight: the busy times stay) and the iteration grows; with cores to spare, or no share, none."""
    model = mlp(batch=16, width=32)
    mm = dataclasses.replace(load_machine("local", nodes=2), devices_per_node=1, send_overhead=1e-4,
                             receive_overhead=1e-4)
    assert mm.nap_share > 0
    strategy = data_parallel(model, mm.to_machine())
    runs = {}
    for cores, model_ in ((2, mm), (64, mm), (2, dataclasses.replace(mm, nap_share=0.0))):
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        sim = Simulator.for_model(model, model_, CostModel(model_, measured=False))
        runs[cores, model_.nap_share] = sim.naps, sim.simulate(strategy), sim.simulate(strategy, delta=False)
    (naps, shared, shared_full), (spare_naps, spare, _), (_, unshared, _) = runs.values()
    assert naps == Naps(mm.nap_first, mm.nap_longest, mm.nap_share) and spare_naps == NO_NAPS
    assert shared.time == shared_full.time and shared.busy == shared_full.busy
    assert shared.time > spare.time and unshared.time == spare.time
    assert shared.busy == pytest.approx(spare.busy)


def test_a_copy_between_ranks_is_in_flight_for_the_message_delay():
    """message_delay lengthens each copy between ranks by that much past its wire time, holding
    nothing: the busy times stay, copies within a rank keep their timing, the iteration grows."""
    model = mlp(batch=16, width=32)
    plain = dataclasses.replace(load_machine("local", nodes=2), devices_per_node=2, send_overhead=0.0,
                                receive_overhead=0.0, message_delay=0.0)
    delayed = dataclasses.replace(plain, message_delay=5e-4)
    strategy = data_parallel(model, plain.to_machine())
    base, result = (Simulator.for_model(model, mm, CostModel(mm, measured=False)).simulate(strategy)
                    for mm in (plain, delayed))
    copies = [(i, n) for i, n in enumerate(result.graph.nodes) if isinstance(n, CopyNode) and n.src != n.dst]
    assert any(n.src.rank != n.dst.rank for _, n in copies) and any(n.src.rank == n.dst.rank for _, n in copies)
    for i, n in copies:
        length = result.timing.end[i] - result.timing.start[i]
        plain_length = base.timing.end[i] - base.timing.start[i]
        extra = 5e-4 if n.src.rank != n.dst.rank else 0.0
        assert length == pytest.approx(plain_length + extra, rel=1e-9, abs=1e-12)
    assert result.busy == pytest.approx(base.busy)
    assert result.time > base.time


def test_every_task_costs_what_the_cost_model_says_of_its_own_phase():
    """The simulator times like tiles once, keyed by what their seconds depend on: a key without
    the phase gave a tile's backward its forward's seconds (or the other way round). Each task
    of a small graph is timed here by a cost model of its own, forward and backward both."""
    mm = dataclasses.replace(load_machine("p100", nodes=1), devices_per_node=2)
    sim = Simulator.for_model(mlp(batch=16, width=64), mm, CostModel(mm, measured=False))
    graph = sim.simulate(data_parallel(mlp(batch=16, width=64), sim.machine)).graph
    _, dur, _, _, _ = sim.node_costs(graph)
    reference = CostModel(mm, measured=False)
    seen = set()
    for i, node in enumerate(graph.nodes):
        tc = None if isinstance(node, CopyNode) else graph.task_cost_at(i)
        if tc is None or tc.op is None:
            continue
        if tc.phase == "update":
            expected = reference.task_time(tc.op, "update", tc.rect, node.proc, tc.param, sim.optimizer)
        else:
            expected = reference.task_time(tc.op, tc.phase, tc.rect, node.proc)
        assert dur[i] == pytest.approx(expected), (node.name, tc.phase)
        seen.add(tc.phase)
    assert {"forward", "backward", "update"} <= seen


def test_the_chunks_of_a_split_sequence_are_costed_by_their_phase():
    m = Model(Runtime(execute=False), weights=False)
    x = m.input((4, 6, 5), name="x")
    y, h, _ = m.lstm(x, 8, name="l1")
    m.dense(h, 3)
    ops, inputs, loss = m.training_graph()
    machine = load_machine("p100", nodes=1).to_machine()
    from ops.lower import TileConfig, default_config
    configs = {op.name: default_config(op, machine) for op in ops}
    lstm = next(op for op in ops if op.name == "l1")
    configs["l1"] = TileConfig(tuple(2 if d == 1 else 1 for d in range(len(lstm.tile_shape))), (1, 2))
    graph = build_iteration(ops, inputs, loss.name, configs, machine)
    phases = {n.name: graph.task_cost(n).phase for n in graph.nodes if isinstance(n, TaskNode)
              and n.name.startswith("l1.") and "[" in n.name}
    assert phases == {"l1.fwd[0]": "forward", "l1.fwd[1]": "forward", "l1.bwd[1]": "backward",
                      "l1.bwd[0]": "backward"}


def test_a_backward_whose_input_gradient_nobody_reads_is_costed_as_the_weight_gradients_alone():
    m = Model(Runtime(execute=False), weights=False)
    x = m.input((8, 3, 8, 8), name="x")
    h = m.pool2d(m.conv2d(m.conv2d(x, 4, 3, padding=1, name="first"), 4, 3, padding=1, name="second"), 2)
    m.dense(m.flat(h), 3)
    ops, inputs, loss = m.training_graph()
    machine = load_machine("p100", nodes=1).to_machine()
    from ops.lower import default_config
    graph = build_iteration(ops, inputs, loss.name, {op.name: default_config(op, machine) for op in ops}, machine)
    phases = {graph.task_cost(n).phase for n in graph.nodes if isinstance(n, TaskNode) and n.name == "first.bwd"}
    assert phases == {"backward_weights"}
    assert {graph.task_cost(n).phase for n in graph.nodes if isinstance(n, TaskNode)
            and n.name == "second.bwd"} == {"backward"}
    cost = CostModel(load_machine("p100", nodes=1), measured=False)
    first = next(op for op in ops if op.name == "first")
    tile = Rect.from_shape(first.tile_shape)
    assert cost.task_time(first, "backward_weights", tile, "gpu") < cost.task_time(first, "backward", tile, "gpu")


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), machine=st.sampled_from(["p100", "k80", "local"]), nodes=st.integers(1, 3))
def test_delta_simulation_equals_full_simulation_exactly(seed, machine, nodes):
    """Random sequences of one-op config changes: the delta simulation (segment caches) gives the
    same iteration time, busy times and peak memory as a full one, to the last bit; so does the
    memory from the plans alone (Simulator.memory), and a result's memory asked for only after
    later simulations (the search asks it of the proposals it would accept)."""
    kind = ("cnn", "rnn", "transformer", "mixer")[seed % 4]
    model = MODELS[kind](Runtime(execute=False))
    mm = load_machine(machine, nodes=nodes)
    sim = Simulator.for_model(model, mm, CostModel(mm, measured=False), loss=data(kind)[2])
    rng = np.random.default_rng(seed)
    configs = {}
    unasked = []
    for step in range(5):
        op = sim.ops[int(rng.integers(len(sim.ops)))]
        configs[op.name] = random_config(op, sim.machine, rng)
        delta, full = sim.simulate(dict(configs)), sim.simulate(dict(configs), delta=False)
        assert delta.time == full.time
        assert delta.busy == full.busy
        if step % 2:
            assert delta.peak_memory == full.peak_memory and delta.fits == full.fits
        else:
            unasked.append((delta, full))
        assert sim.memory(dict(configs)) == (full.peak_memory, full.fits)
        assert len(delta.graph.nodes) == len(full.graph.nodes)
    for delta, full in reversed(unasked):
        assert delta.peak_memory == full.peak_memory and delta.fits == full.fits


def test_copies_costed_without_the_dense_pair_tables_are_costed_the_same(monkeypatch):
    """Past DENSE_PAIRS (machines of tens of thousands of devices) the copies' link figures come
    from a lookup per distinct memory pair: the same times as the dense tables give."""
    import strategies.simulator as simulator
    model = MODELS["cnn"](Runtime(execute=False))
    mm = load_machine("k80", nodes=3)

    def run() -> list:
        sim = Simulator.for_model(model, mm, CostModel(mm, measured=False), loss=data("cnn")[2])
        rng = np.random.default_rng(3)
        configs, out = {}, []
        for _ in range(4):
            op = sim.ops[int(rng.integers(len(sim.ops)))]
            configs[op.name] = random_config(op, sim.machine, rng)
            r = sim.simulate(dict(configs))
            out.append((r.time, r.busy, sim.node_costs(r.graph)[1].tolist()))
        return out, sim._pair_tables is not None
    dense, used_tables = run()
    monkeypatch.setattr(simulator, "DENSE_PAIRS", 0)
    looked_up, used_no_tables = run()
    assert used_tables and not used_no_tables
    assert dense == looked_up


def test_delta_simulation_with_its_caches_dropped_between_proposals_is_unchanged():
    """Dropping the segment caches (a one-byte budget: after every build) changes no result:
    the simulator drops its costs of the old parts with them."""
    model = MODELS["cnn"](Runtime(execute=False))
    mm = load_machine("k80", nodes=2)
    sims = [Simulator.for_model(model, mm, CostModel(mm, measured=False), loss=data("cnn")[2]) for _ in range(2)]
    sims[1].builder.cache_bytes = 1
    rng = np.random.default_rng(5)
    configs = {}
    for _ in range(6):
        op = sims[0].ops[int(rng.integers(len(sims[0].ops)))]
        configs[op.name] = random_config(op, sims[0].machine, rng)
        kept, dropped = (sim.simulate(dict(configs)) for sim in sims)
        assert (kept.time, kept.busy, kept.peak_memory) == (dropped.time, dropped.busy, dropped.peak_memory)
    assert sims[1].builder.stats["cache_flushes"] == 6 and sims[0].builder.stats["cache_flushes"] == 0


def test_the_caches_are_counted_at_about_what_they_hold():
    """CACHE_BYTES bounds what the caches count: for small graphs that was a third of what they
    held (segments' and results' objects, and the simulator's costs of each part, were not
    counted). Held: what tracemalloc sees the memory grow by while they fill (the last graph's
    arrays too: counted 0.56 of it, against 0.24 before)."""
    import gc
    import tracemalloc
    model = MODELS["cnn"](Runtime(execute=False))
    mm = load_machine("k80", nodes=2)
    sim = Simulator.for_model(model, mm, CostModel(mm, measured=False), loss=data("cnn")[2])
    rng = np.random.default_rng(11)
    sim.simulate({})
    counted = -sim.builder._cached_bytes
    tracemalloc.start()
    try:
        for _ in range(40):
            op = sim.ops[int(rng.integers(len(sim.ops)))]
            sim.simulate({op.name: random_config(op, sim.machine, rng)})
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    counted += sim.builder._cached_bytes
    assert sim.builder.stats["cache_flushes"] == 0 and 0.4 * held < counted < 2 * held, (counted, held)


def test_the_configs_of_strategies_in_turn_are_each_strategys_own():
    """Simulator.configs takes the entries a strategy shares (the same objects) with the one before
    from that one's answer, as a search's proposals do: every answer is the strategy's own
    resolution, whatever came before, and a bad entry is still refused."""
    model = MODELS["cnn"](Runtime(execute=False))
    mm = load_machine("k80", nodes=2)
    sim = Simulator.for_model(model, mm, CostModel(mm, measured=False), loss=data("cnn")[2])
    rng = np.random.default_rng(7)
    named = [op for op in sim.ops if op.name != sim.loss]
    strategy = Strategy(sim.fingerprint, {})
    for step in range(16):
        op = named[int(rng.integers(len(named)))]
        strategy = strategy.replace(op.name, random_config(op, sim.machine, rng))
        if step == 8:   # the same entries named in another order
            strategy = Strategy(sim.fingerprint, dict(reversed(strategy.ops.items())))
        expect, _ = strategy.resolve(sim.ops, sim.machine, fingerprint=sim.fingerprint)
        got = sim.configs(strategy)
        assert got == expect and list(got) == list(expect)
    with pytest.raises(StrategyError):
        sim.configs(strategy.replace(named[0].name, TileConfig((1,) * (len(named[0].tile_shape) + 1))))
    assert sim.configs(strategy) == strategy.resolve(sim.ops, sim.machine, fingerprint=sim.fingerprint)[0]


def test_graphs_built_without_costing_in_between_cost_the_same():
    """The cost arena and the peak cache take a graph's delta (the parts and ops changed since the
    builder's last graph) only after that last graph: a graph built but not simulated in between
    (as tasks_to_measure builds them) must cost as in a plain sequence. Strategies changed one op
    at a time, as the search makes them (the unchanged ops keep their config objects)."""
    model = MODELS["mixer"](Runtime(execute=False))
    mm = load_machine("k80", nodes=2)
    plain, other = (Simulator.for_model(model, mm, CostModel(mm, measured=False), loss=data("mixer")[2])
                    for _ in range(2))
    rng = np.random.default_rng(11)
    strategy = data_parallel(model, plain.machine)
    for step in range(10):
        op = plain.ops[int(rng.integers(len(plain.ops)))]
        strategy = strategy.replace(op.name, random_config(op, plain.machine, rng))
        if step % 2:   # a graph with another op changed too, made in between, never simulated
            another = plain.ops[(plain.ops.index(op) + 1) % len(plain.ops)]
            other.graph(strategy.replace(another.name, random_config(another, plain.machine, rng)))
        want, got = plain.simulate(strategy), other.simulate(strategy)
        assert step == 0 or len(got.graph.lowering.delta[2]) <= 2   # (the first graph has none)
        assert (want.time, want.busy, want.peak_memory) == (got.time, got.busy, got.peak_memory)
        assert [a.tolist() for a in plain.node_costs(want.graph, cache=True)[:3]] == \
            [a.tolist() for a in other.node_costs(got.graph, cache=True)[:3]]
