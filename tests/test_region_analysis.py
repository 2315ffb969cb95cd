"""The compiled analysis of one region's accesses (taskrt/region_analysis.py) against the runtime's
Analyzer (taskrt/analysis.py) on the same accesses: the same nodes in the same order, the same
copies and folds, the same edges."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from hypothesis import given, settings, strategies as st

from taskrt import READ, READ_WRITE, WRITE, Machine, Reduce, Region
from taskrt.analysis import Analyzer
from taskrt.geometry import Rect
from taskrt import region_analysis
from taskrt.region_analysis import (ACCESS, BUFFER_NODE, BUFFER_REQ, DST, NODE, REDOP, SRC, analyze_region,
                                    privilege_code, redop_name)
from taskrt.taskgraph import CopyNode

MACHINE = Machine.build(2, cpus_per_rank=2, separate_memories=True)
PRIVILEGES = [READ, WRITE, READ_WRITE, Reduce("sum"), Reduce("max")]


def reference(region: Region, accesses) -> tuple:
    """(copies as (node, rect, src, dst, redop, buffer, access), task nodes, edges as a set of
    (node, pred)) from the Python Analyzer; memories as numbers, by first appearance."""
    ids = iter(range(1 << 30))
    copies, tasks, edges, current = [], [], set(), [0]

    def emit(node, preds):
        edges.update((node.id, p) for p in preds)
        if isinstance(node, CopyNode):
            copies.append((node.id, node.rect, node.src, node.dst, node.redop,
                           None if node.buffer is None else node.buffer, current[0]))

    analyzer = Analyzer(lambda: next(ids), emit)
    for a, (proc, reqs) in enumerate(accesses):
        current[0] = a
        tasks.append(analyzer.add_task("t", proc, None, [(region, r, p) for r, p in reqs]).id)
    return copies, tasks, edges


def _analyzed(region: Region, accesses, keep_from: int = 0) -> tuple:
    """(analyze_region of the accesses, the memories by their numbers there)."""
    numbers: dict = {}
    mems, first, rects, privs = [], [0], [], []
    for proc, reqs in accesses:
        mems.append(numbers.setdefault(proc.memory, len(numbers)))
        for r, p in reqs:
            rects.append(r.lo + r.hi)
            privs.append(privilege_code(p))
        first.append(len(privs))
    out = analyze_region(region.ndim, mems, first, np.array(rects, np.int64).reshape(len(rects), -1), privs,
                         keep_from)
    return out, list(numbers)


def compiled(region: Region, accesses) -> tuple:
    out, memory = _analyzed(region, accesses)
    nd = region.ndim
    copies = [(int(c[NODE]), Rect(tuple(map(int, r[:nd])), tuple(map(int, r[nd:]))), memory[c[SRC]], memory[c[DST]],
               redop_name(int(c[REDOP])), None if c[BUFFER_NODE] < 0 else (int(c[BUFFER_NODE]), int(c[BUFFER_REQ])),
               int(c[ACCESS])) for c, r in zip(out.copies, out.copy_rects)]
    edges = {(int(n), int(p)) for n, p in out.edges}
    assert len(edges) == len(out.edges), "an edge twice"
    return copies, [int(t) for t in out.task_node], edges


@st.composite
def access_lists(draw):
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    region = Region(shape, "float32", "r")

    def rect():
        if draw(st.integers(0, 9)) == 0:   # a whole-region access now and then
            return region.rect
        lo = [draw(st.integers(0, n - 1)) for n in shape]
        hi = [draw(st.integers(a, n)) for a, n in zip(lo, shape)]   # empty sometimes
        return Rect(tuple(lo), tuple(hi))

    # tiles of a few fixed partitions, so that accesses repeat rects as programs do
    tiles = [rect() for _ in range(draw(st.integers(1, 6)))]
    procs = draw(st.lists(st.sampled_from(MACHINE.processors), min_size=1, max_size=4, unique=True))
    accesses = []
    for _ in range(draw(st.integers(1, 25))):
        reqs = []
        for _ in range(draw(st.integers(1, 2))):
            r = draw(st.sampled_from(tiles)) if draw(st.booleans()) else rect()
            reqs.append((r, draw(st.sampled_from(PRIVILEGES))))
        # one task's requirements on one region must not conflict where they overlap
        if len(reqs) == 2 and reqs[0][0].overlaps(reqs[1][0]) and reqs[0][1].conflicts(reqs[1][1]):
            reqs = reqs[:1]
        accesses.append((draw(st.sampled_from(procs)), reqs))
    return region, accesses


@settings(max_examples=400, deadline=None)
@given(access_lists())
def test_the_compiled_analysis_makes_what_the_analyzer_makes(case):
    region, accesses = case
    want_copies, want_tasks, want_edges = reference(region, accesses)
    got_copies, got_tasks, got_edges = compiled(region, accesses)
    assert got_tasks == want_tasks
    assert got_copies == want_copies
    assert got_edges == want_edges



BIG_MACHINE = Machine.build(2, cpus_per_rank=4, separate_memories=True)


@st.composite
def tiled_access_lists(draw):
    """Long programs over the tiles of several partitions of a long region: enough tiles that
    rects fall in many of the index's buckets (one rect spanning more than SPAN_BIG, a query
    more than SPAN_SCAN) and enough accesses that dead slots are compacted away."""
    n0, n1 = draw(st.integers(64, 200)), draw(st.integers(1, 6))
    region = Region((n0, n1), "float32", "r")
    partitions = []
    for parts in draw(st.lists(st.sampled_from([1, 2, 3, 20, 70, n0]), min_size=1, max_size=3)):
        cuts = [n0 * i // parts for i in range(parts + 1)]
        partitions.append([Rect((a, 0), (b, n1)) for a, b in zip(cuts, cuts[1:]) if b > a])
    if n1 > 1:
        partitions.append([Rect((0, j), (n0, j + 1)) for j in range(n1)])
    accesses = []
    for _ in range(draw(st.integers(40, 160))):
        tiles = draw(st.sampled_from(partitions))
        r = tiles[draw(st.integers(0, len(tiles) - 1))]
        accesses.append((draw(st.sampled_from(BIG_MACHINE.processors)), [(r, draw(st.sampled_from(PRIVILEGES)))]))
    return region, accesses


@settings(max_examples=40, deadline=None)
@given(tiled_access_lists())
def test_long_tiled_programs_match_too(case):
    region, accesses = case
    assert compiled(region, accesses) == reference(region, accesses)


@settings(max_examples=40, deadline=None)
@given(tiled_access_lists())
def test_tables_that_run_out_of_room_are_made_again_larger(case):
    """Every table starts with the least room, so that most run out and the analysis runs again
    with more: the same nodes, copies and edges, and the rooms it needed are kept."""
    region, accesses = case
    saved = region_analysis.ROOM_FACTORS.copy()
    region_analysis.ROOM_FACTORS[:] = 0.0
    try:
        got = compiled(region, accesses)
        grown = region_analysis.ROOM_FACTORS.copy()
    finally:
        region_analysis.ROOM_FACTORS[:] = saved
    assert got == reference(region, accesses)
    assert grown[region_analysis._R_CELLS] >= 1   # (no slot fits an index of no cells)


@settings(max_examples=20, deadline=None)
@given(tiled_access_lists(), st.integers(-3, 3))
def test_what_a_scratch_held_before_changes_nothing(case, junk):
    """A run lays its tables out in the thread's scratch array, kept from call to call: one full
    of another run's leftovers (here, junk everywhere) gives the same analysis."""
    region, accesses = case
    region_analysis._scratch.array = np.full(1 << 20, junk, np.int64)
    assert compiled(region, accesses) == reference(region, accesses)


@settings(max_examples=20, deadline=None)
@given(tiled_access_lists())
def test_tables_too_large_to_keep_are_made_for_their_run_alone(case):
    """With no scratch allowed to grow, every run makes its own tables: the same analysis, and
    the thread's scratch is left as it was."""
    region, accesses = case
    kept = np.full(16, 7, np.int64)
    region_analysis._scratch.array = kept
    saved = region_analysis.SCRATCH_MAX
    region_analysis.SCRATCH_MAX = 0
    try:
        got = compiled(region, accesses)
    finally:
        region_analysis.SCRATCH_MAX = saved
    assert got == reference(region, accesses)
    assert region_analysis._scratch.array is kept and (kept == 7).all()


@settings(max_examples=5, deadline=None)
@given(st.lists(tiled_access_lists(), min_size=4, max_size=8))
def test_threads_analyzing_at_once_each_get_their_own_answer(cases):
    """The analysis releases the GIL and each thread has its own scratch: regions analyzed on
    four threads at once come out as analyzed one after another."""
    alone = [compiled(region, accesses) for region, accesses in cases]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda case: compiled(*case), cases * 3))
    assert together == alone * 3


def test_a_data_parallel_weight_gradient_reduce_scatters_and_gathers():
    """Four devices reduce a weight's gradient, four shard readers fold it, four whole readers
    gather it: the hand-countable case, both ways."""
    region = Region((8, 4), "float32", "w.grad")
    procs = MACHINE.processors[:4]
    shards = [Rect((2 * i, 0), (2 * i + 2, 4)) for i in range(4)]
    accesses = ([(p, [(s, WRITE)]) for p, s in zip(procs, shards)]
                + [(p, [(region.rect, Reduce("sum"))]) for p in procs]
                + [(p, [(s, READ_WRITE)]) for p, s in zip(procs, shards)]
                + [(p, [(region.rect, READ)]) for p in procs])
    want = reference(region, accesses)
    got = compiled(region, accesses)
    assert got == want
    folds = [c for c in got[0] if c[4] == "sum"]
    gathers = [c for c in got[0] if c[4] is None]
    assert len(folds) == 16 and len(gathers) == 12


@settings(max_examples=200, deadline=None)
@given(access_lists(), st.integers(0, 40))
def test_edges_kept_from_an_access_on_are_the_full_analysis_edges_among_its_nodes(case, keep_from):
    """keep_from (the simulator's second step): the same nodes and copies, and of the edges those
    among the nodes that accesses from keep_from on make."""
    _check_kept(*case, keep_from)


@settings(max_examples=40, deadline=None)
@given(tiled_access_lists(), st.integers(0, 160))
def test_edges_kept_from_an_access_on_in_long_tiled_programs_too(case, keep_from):
    _check_kept(*case, keep_from)


def _check_kept(region: Region, accesses, keep_from: int) -> None:
    keep_from = keep_from % (len(accesses) + 1)
    full, kept = ((out.copies, out.copy_rects, out.task_node, out.edges)
                  for out, _ in (_analyzed(region, accesses, k) for k in (0, keep_from)))
    assert all(np.array_equal(a, b) for a, b in zip(full[:3], kept[:3]))
    first = min([int(full[2][keep_from])] + [int(c[NODE]) for c in full[0] if c[ACCESS] >= keep_from]) \
        if keep_from < len(accesses) else 1 << 62
    assert sorted(map(tuple, kept[3].tolist())) == sorted(
        (n, p) for n, p in map(tuple, full[3].tolist()) if n >= first and p >= first)

