"""The graph assembled from cached segments equals the graph the runtime builds for that iteration:
task for task (processor, rects, privileges, memories), copy for copy (source, destination,
rect, bytes, fold buffer) and edge for edge, under random strategies on random machines of
1 to 16 ranks, also after a sequence of changes that the caches answer in part, and under
permutations of the devices, which the canonical region cache answers by renaming memories."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ops.lower import TileConfig, compute_processors, default_config
from ops.optimizers import Adam
from strategies.graph import build_iteration
from strategies.random import random_config
from strategies.segments import SegmentBuilder
from taskrt import Machine, Runtime, TaskNode
from tests.test_soap_models import MODELS, data

LOSS = {kind: data(kind)[2] for kind in MODELS}


def _graph_of(kind: str):
    m = MODELS[kind](Runtime(execute=False))
    ops, inputs, loss = m.training_graph(LOSS[kind])
    return ops, inputs, loss.name


def canonical(nodes, preds, buffer_index) -> list[tuple]:
    """Each node as what it does (regions by name, so two lowerings compare) with its preds."""
    out = []
    for i, n in enumerate(nodes):
        if isinstance(n, TaskNode):
            what = ("task", n.name, n.proc, n.point,
                    tuple((r.region.name, r.rect, r.privilege, r.memory) for r in n.reqs))
        else:
            what = ("copy", n.region.name, n.rect, n.src, n.dst, n.nbytes, n.redop, buffer_index(i, n))
        out.append((what, tuple(preds[i])))
    return out


def runtime_graph(ops, inputs, loss, configs, machine, optimizer=None) -> list[tuple]:
    ref = build_iteration(ops, inputs, loss, configs, machine, optimizer)
    pos = {n.id: i for i, n in enumerate(ref.nodes)}
    return canonical(ref.nodes, ref.preds, lambda i, n: None if n.buffer is None else pos.get(n.buffer[0]))


def assembled_graph(builder: SegmentBuilder, configs) -> list[tuple]:
    g = builder.build(configs)
    return canonical(g.nodes, g.preds, lambda i, n: g.buffers[i])


def _machine(ranks: int, per_rank: int) -> Machine:
    return Machine.build(ranks, per_rank, separate_memories=True)


def _configs(ops, machine, rng, random_share=1.0):
    return {op.name: random_config(op, machine, rng) if rng.random() < random_share else default_config(op, machine)
            for op in ops}


def assert_same(expected: list, got: list) -> None:
    assert len(got) == len(expected), f"{len(got)} nodes assembled, the runtime made {len(expected)}"
    for i, (a, b) in enumerate(zip(expected, got)):
        assert a == b, f"node {i} differs:\n runtime   {a}\n assembled {b}"


@pytest.mark.parametrize("kind", sorted(MODELS))
@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(1, 16), per_rank=st.integers(1, 2))
def test_random_strategies_assemble_the_runtimes_graph(kind, seed, ranks, per_rank):
    ops, inputs, loss = _graph_of(kind)
    machine = _machine(ranks, per_rank)
    rng = np.random.default_rng(seed)
    configs = _configs(ops, machine, rng, random_share=0.8)
    builder = SegmentBuilder(ops, inputs, loss, machine)
    assert_same(runtime_graph(ops, inputs, loss, configs, machine), assembled_graph(builder, configs))


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(1, 4))
def test_a_sequence_of_changes_answered_from_the_caches_stays_exact(seed, ranks):
    kind = ("cnn", "rnn", "transformer", "mixer")[seed % 4]
    ops, inputs, loss = _graph_of(kind)
    machine = _machine(ranks, 2)
    rng = np.random.default_rng(seed)
    builder = SegmentBuilder(ops, inputs, loss, machine)
    configs = {op.name: default_config(op, machine) for op in ops}
    for _ in range(4):
        op = ops[int(rng.integers(len(ops)))]
        configs[op.name] = random_config(op, machine, rng)
        assert_same(runtime_graph(ops, inputs, loss, configs, machine), assembled_graph(builder, configs))


@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(1, 4))
def test_caches_dropped_after_every_build_still_give_the_runtimes_graph(seed, ranks):
    """A cache budget of one byte drops the recorded segments and region analyses after every
    build; the next one records and analyzes again (no region key from before a flush may
    match one after) and is still the runtime's graph."""
    kind = ("cnn", "rnn", "transformer", "mixer")[seed % 4]
    ops, inputs, loss = _graph_of(kind)
    machine = _machine(ranks, 2)
    rng = np.random.default_rng(seed)
    builder = SegmentBuilder(ops, inputs, loss, machine)
    builder.cache_bytes = 1
    configs = {op.name: default_config(op, machine) for op in ops}
    for _ in range(4):
        op = ops[int(rng.integers(len(ops)))]
        configs[op.name] = random_config(op, machine, rng)
        assert_same(runtime_graph(ops, inputs, loss, configs, machine), assembled_graph(builder, configs))
    assert builder.stats["cache_flushes"] == 4


def test_a_change_reanalyzes_only_the_regions_of_the_op_it_changes():
    ops, inputs, loss = _graph_of("cnn")
    machine = _machine(2, 2)
    builder = SegmentBuilder(ops, inputs, loss, machine)
    configs = {op.name: default_config(op, machine) for op in ops}
    builder.build(configs)
    before = dict(builder.stats)
    builder.build(configs)
    assert builder.stats == before, "an unchanged strategy must come entirely from the caches"
    conv = next(op for op in ops if op.kind == "conv2d")
    configs[conv.name] = next(c for c in (random_config(conv, machine, s) for s in range(100))
                              if c != default_config(conv, machine))
    g = builder.build(configs)
    touched = {r.region.uid for rec in g.segments if rec.op == conv.name for t in rec.tasks for r in t.reqs}
    analyzed = builder.stats["regions_analyzed"] - before["regions_analyzed"]
    assert 0 < analyzed <= len(touched)
    recorded = builder.stats["segments_recorded"] - before["segments_recorded"]
    # its forward, gradient fill and backward, and per weight its gradient's zeroing and its update
    assert recorded == 3 + 2 * len(conv.weight_shapes())


def test_a_weight_gradient_written_whole_keeps_an_empty_zeroing_in_its_place():
    """One tile writes its weights' gradients whole: their zeroing segments are empty but there,
    so the step has as many segments as under data parallelism (the caches name segments by
    place); a step of another length is refused before its layout reads the caches wrong."""
    ops, inputs, loss = _graph_of("cnn")
    machine = _machine(2, 2)
    builder = SegmentBuilder(ops, inputs, loss, machine)
    replicated = {op.name: default_config(op, machine) for op in ops}
    one_tile = {op.name: TileConfig((1,) * len(op.tile_shape), (1,)) for op in ops}
    lengths = []
    for configs in (replicated, one_tile, replicated):
        program, second = builder._program(configs)
        lengths.append(len(program) - second)
        zeroing = [rec for rec in program[second:] if rec.phase == "zero_grad" and rec.op]
        assert zeroing and all((rec.n_tasks == 0) == (configs is one_tile) for rec in zeroing)
        assert builds_the_runtimes_graph(builder, configs, ops, inputs, loss, machine)
    assert len(set(lengths)) == 1
    builder._step_length += 1
    with pytest.raises(RuntimeError, match="segments must not come and go with its config"):
        builder.build(replicated)


def test_a_change_in_what_the_ops_fills_cover_makes_the_step_again():
    """A proposal's step is the last one patched where configs changed, unless the gradients the
    ops' own fills cover change: the host then fills another set, and the step is made again.
    No model here has such a change (tiles with equal output rects still cover their output),
    so a stand-in _fill_of makes one: a dense layer split over its reduced dim leaves its output
    to the host. Each program equals a fresh builder's, segment for segment, either way."""
    ops, inputs, loss = _graph_of("mixer")
    machine = _machine(2, 2)
    dense = next(op for op in ops if op.kind == "dense")
    plain = {op.name: default_config(op, machine) for op in ops}
    summed = dict(plain, **{dense.name: TileConfig((1,) * (len(dense.tile_shape) - 1) + (2,), (0, 1))})

    def stand_in(builder):
        fill_of, step = builder._fill_of, builder._step
        builder.steps_made = 0

        def counted_step(parts, fills):
            builder.steps_made += 1
            return step(parts, fills)
        builder._step = counted_step

        def leaving_the_summed_output(op, part, plans):
            written, rec, covered = fill_of(op, part, plans)
            return written, rec, covered - {f"{dense.name}.out"} if part.config is summed[dense.name] else covered
        builder._fill_of = leaving_the_summed_output
        return builder

    def filled(rec):   # the regions the host's fill writes (its key names them by uids, which builders number apart)
        return sorted(region.name for launch in rec.launches for region in launch.regions)

    def what(rec):
        return ("host fill", filled(rec)) if rec.key[:2] == ("graph", "grad_fill") else rec.key

    builder = stand_in(SegmentBuilder(ops, inputs, loss, machine))
    hosts = []
    for configs in (plain, summed, plain, dict(summed), plain):
        program, second = builder._program(configs)
        fresh, _ = stand_in(SegmentBuilder(ops, inputs, loss, machine))._program(configs)
        assert list(map(what, program)) == list(map(what, fresh))
        hosts.append(program[second + 1 + 2 * len(ops)])   # after the batch source, the forwards, the ops' fills
    assert [filled(h) for h in hosts] == [[], [f"{dense.name}.out.grad"]] * 2 + [[]]
    assert builder.steps_made == 5   # the first, then each change made it again
    builder._program(dict(plain))    # a change that leaves the fills as they were: patched
    assert builder.steps_made == 5


def builds_the_runtimes_graph(builder, configs, ops, inputs, loss, machine) -> bool:
    """The assembled graph is the runtime's."""
    return assembled_graph(builder, configs) == runtime_graph(ops, inputs, loss, configs, machine)


@settings(max_examples=10, deadline=None)
@given(st.sampled_from(sorted(MODELS)), st.integers(0, 2**16), st.integers(1, 4))
def test_what_timing_reads_of_a_segment_is_what_its_tasks_say(kind, seed, ranks):
    """Timing reads a recorded segment's processors, task count and fill bytes without making its
    TaskNodes; they must be the TaskNodes' own, and each region's access memories those of the
    tasks that touch it."""
    ops, inputs, loss = _graph_of(kind)
    machine = _machine(ranks, 2)
    builder = SegmentBuilder(ops, inputs, loss, machine)
    g = builder.build(_configs(ops, machine, np.random.default_rng(seed)))
    for rec in g.segments:
        assert rec.n_tasks == len(rec.tasks)
        assert rec.procs == tuple(t.proc for t in rec.tasks)
        assert [rec.task_nbytes(i) for i in range(rec.n_tasks)] == [t.nbytes for t in rec.tasks]
        for uid, accesses in rec.access_tasks.items():
            assert [machine.memories[m] for m in rec.memory_ids[uid]] == [rec.tasks[t].proc.memory
                                                                         for t in accesses]


def test_adam_state_and_a_16_rank_machine_match_too():
    ops, inputs, loss = _graph_of("transformer")
    machine = _machine(16, 1)
    configs = _configs(ops, machine, np.random.default_rng(11))
    optimizer = Adam(lr=1e-3)
    builder = SegmentBuilder(ops, inputs, loss, machine, optimizer)
    assert_same(runtime_graph(ops, inputs, loss, configs, machine, optimizer), assembled_graph(builder, configs))


def _permuted(configs, machine, rng):
    """The configs with their devices renamed by one random permutation of the compute processors
    (the ranks' host processors, where host fills and the batch sources run, stay): a bijection
    on the tasks' memories."""
    hosts = {machine.host_processor(r) for r in range(machine.num_ranks)}
    procs = [p for p in compute_processors(machine) if machine.processors[p] not in hosts]
    order = [int(p) for p in rng.permutation(procs)]
    if order == procs:
        order = order[1:] + order[:1]
    perm = dict(zip(procs, order))
    return {name: TileConfig(c.degrees, tuple(perm.get(d, d) for d in c.devices)) for name, c in configs.items()}


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(1, 6), per_rank=st.integers(1, 2))
def test_configs_that_differ_by_a_permutation_of_devices_come_from_the_canonical_cache(seed, ranks, per_rank):
    kind = sorted(MODELS)[seed % len(MODELS)]
    ops, inputs, loss = _graph_of(kind)
    machine = _machine(ranks, per_rank)
    rng = np.random.default_rng(seed)
    builder = SegmentBuilder(ops, inputs, loss, machine)
    configs = _configs(ops, machine, rng, random_share=0.8)
    assert_same(runtime_graph(ops, inputs, loss, configs, machine), assembled_graph(builder, configs))
    for step in range(4):
        if step % 2:
            op = ops[int(rng.integers(len(ops)))]
            configs[op.name] = random_config(op, machine, rng)
            assert_same(runtime_graph(ops, inputs, loss, configs, machine), assembled_graph(builder, configs))
            continue
        permuted = _permuted(configs, machine, rng)
        before = dict(builder.stats)
        assert_same(runtime_graph(ops, inputs, loss, permuted, machine), assembled_graph(builder, permuted))
        assert builder.stats["regions_analyzed"] == before["regions_analyzed"], \
            "a permutation of the devices must need no new region analysis"
        if permuted != configs:
            assert builder.stats["regions_renamed"] > before["regions_renamed"]
        configs = permuted


def _stack(blocks: int):
    """`blocks` like dense / relu blocks (same shapes, so like regions), then a dense head."""
    from ops import Model
    m = Model(Runtime(execute=False), weights=False)
    h = m.input((8, 12), name="x")
    for _ in range(blocks):
        h = m.relu(m.dense(h, 12))
    m.dense(h, 3)
    ops, inputs, loss = m.training_graph()
    return ops, inputs, loss.name


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(1, 3), per_rank=st.integers(1, 2))
def test_like_layers_share_one_region_analysis(seed, ranks, per_rank):
    """More like blocks add no analysis of regions like those already analyzed: their accesses
    come from the canonical cache, moved to their regions and program positions, and the graph
    still equals the runtime's, also under random configs. (Updates rotate their shards over
    the devices, one step per weight, so middle blocks repeat exactly every P blocks; the first
    block has no input gradient.)"""
    machine = _machine(ranks, per_rank)
    rng = np.random.default_rng(seed)
    devices = len(compute_processors(machine))
    counts = {}
    base, more = 2 + devices, 2 + 2 * devices
    for blocks in (base, more):
        ops, inputs, loss = _stack(blocks)
        builder = SegmentBuilder(ops, inputs, loss, machine)
        configs = {op.name: default_config(op, machine) for op in ops}
        assert_same(runtime_graph(ops, inputs, loss, configs, machine), assembled_graph(builder, configs))
        counts[blocks] = (builder.stats["regions_analyzed"], builder.stats["regions_renamed"])
        like = random_config(ops[0], machine, rng)
        configs.update({op.name: like for op in ops if op.kind == "dense" and op.weight_shapes() == ops[0].weight_shapes()})
        assert_same(runtime_graph(ops, inputs, loss, configs, machine), assembled_graph(builder, configs))
    assert counts[more][0] == counts[base][0], f"(analyzed, renamed) by blocks: {counts}"
    assert counts[more][1] > counts[base][1]


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.lists(st.tuples(st.integers(0, 39), st.integers(0, 39)), max_size=300))
def test_pred_lists_are_each_node_s_distinct_preds_ascending(n, pairs):
    """_pred_lists against sorting the (node, pred) pairs and dropping repeats."""
    from strategies.segments import _pred_lists
    pairs = [(d % n, s % n) for d, s in pairs]
    dst = np.array([d for d, _ in pairs], np.int64)
    src = np.array([s for _, s in pairs], np.int64)
    ptr, idx = _pred_lists(dst, src, n)
    want = sorted(set(pairs))
    assert ptr.tolist() == [sum(1 for d, _ in want if d < v) for v in range(n + 1)]
    assert idx.tolist() == [s for _, s in want]


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 30), st.sets(st.tuples(st.integers(0, 29), st.integers(0, 29)), max_size=200),
       st.randoms(use_true_random=False))
def test_implied_edges_are_those_two_others_make_and_dropping_them_keeps_what_reaches_what(n, pairs, rnd):
    """_implied against a search for u -> w -> v, on some of a DAG's edges (from lower to higher
    node) given as the analysis gives them (rows dst, src, in any order)."""
    from strategies.segments import _implied
    pairs = sorted({(min(a % n, b % n), max(a % n, b % n)) for a, b in pairs if a % n != b % n})
    rnd.shuffle(pairs)
    edges = np.array([(v, u) for u, v in pairs], np.int64).reshape(-1, 2)
    which = np.array([e for e in range(len(pairs)) if rnd.random() < 0.9], np.int64)
    asked = {pairs[e] for e in which}
    got = _implied(edges[which], n).tolist()
    assert got == [any((u, w) in asked and (w, v) in asked for w in range(n)) for u, v in (pairs[e] for e in which)]
    kept = {pairs[e] for e, dropped in zip(which, got) if not dropped}

    def reach(es):
        out = set(es)
        for w in range(n):
            out |= {(u, v) for u, x in out if x == w for y, v in out if y == w}
        return out
    assert reach(kept) == reach(asked)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sets(st.integers(0, 299), max_size=40), st.sets(st.integers(0, 299), max_size=90)),
                min_size=1, max_size=12))
def test_the_result_list_holds_each_live_region_once_and_says_what_changed(steps):
    """_ResultList against a dict of the live regions' results: every live result once, the other
    entries empty, and each entry that differs from the last list among those it says changed
    (or a list made again: None)."""
    from types import SimpleNamespace
    from strategies.segments import RegionResult, _ResultList
    region_of = {uid: SimpleNamespace(ndim=1 + uid % 3) for uid in range(300)}
    results, by_uid = _ResultList(), {}
    results.reset({}, by_uid)
    for come, go in steps:
        gone = [uid for uid in sorted(go) if uid in by_uid and uid not in come]
        for uid in gone:
            del by_uid[uid]
        redo = sorted(come)
        by_uid.update({uid: object() for uid in redo})
        before = list(results.entries)
        changed = results.update(by_uid, redo, gone, region_of)
        live = [e for e in results.entries if not isinstance(e, RegionResult)]
        assert sorted(map(id, live)) == sorted(map(id, by_uid.values()))
        assert all(e.copy_ends.shape[0] == 0 and e.timed == 0 for e in results.entries if isinstance(e, RegionResult))
        if changed is not None:
            assert len(results.entries) >= len(before)
            assert {k for k, e in enumerate(results.entries) if k >= len(before) or e is not before[k]} <= set(changed)
        else:
            assert len(results.entries) == len(by_uid)
