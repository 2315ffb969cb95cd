"""The runtime against a sequential reference: random programs, reductions, futures, errors."""
from __future__ import annotations

import math
import sys
import threading
import time
import warnings
from contextlib import nullcontext, suppress

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taskrt import (READ, READ_WRITE, WRITE, Machine, Partition, Rect, Reduce, Region, ReplayMismatch, Runtime,
                    TaskError, req)
from taskrt.program import Launch

# ---- random programs --------------------------------------------------------------------
# A program is a list of steps over a few int64 regions. Each step is an index launch over
# one partition; it may read a second region through a partition with as many colors
# (paired by order through a projection). Kernels are exact integer arithmetic, so any
# parallel order that respects the dependences gives the sequential result bit for bit.


class ByIndex:
    """Projection pairing the i-th color of one partition with the i-th color of another."""

    def __init__(self, src: Partition, dst: Partition):
        self.map = dict(zip(src.colors(), dst.colors()))

    def __call__(self, point):
        return self.map[point]


@st.composite
def programs(draw):
    shapes = draw(st.lists(st.sampled_from([(6,), (9,), (5, 4), (8, 3)]), min_size=1, max_size=3))
    parts = []
    for shape in shapes:
        region_parts = []
        for _ in range(draw(st.integers(1, 2))):
            if draw(st.booleans()):
                degrees = tuple(draw(st.integers(1, min(3, s))) for s in shape)
                region_parts.append(("equal", degrees))
            else:
                rects = []
                for _ in range(draw(st.integers(2, 3))):
                    lo = [draw(st.integers(0, s - 1)) for s in shape]
                    hi = [draw(st.integers(l + 1, s)) for l, s in zip(lo, shape)]
                    rects.append((tuple(lo), tuple(hi)))
                region_parts.append(("rects", rects))
        parts.append(region_parts)
    steps = []
    for k in range(draw(st.integers(2, 9))):
        r = draw(st.integers(0, len(shapes) - 1))
        p = draw(st.integers(0, len(parts[r]) - 1))
        kind = draw(st.sampled_from(["write", "rw", "reduce", "read"]))
        src = None
        if draw(st.booleans()):
            sr = draw(st.integers(0, len(shapes) - 1))
            src = (sr, draw(st.integers(0, len(parts[sr]) - 1)))
        steps.append((kind, r, p, src, k + 1))
    return shapes, parts, steps


def build(rt_region, shapes, parts):
    regions = [rt_region(s) for s in shapes]
    partitions = []
    for region, region_parts in zip(regions, parts):
        ps = []
        for kind, spec in region_parts:
            if kind == "equal":
                ps.append(region.partition(spec))
            else:
                ps.append(Partition.from_rects(region, [Rect.make(lo, hi) for lo, hi in spec]))
        partitions.append(ps)
    return regions, partitions


def kernel_value(k, point, src_sum):
    return (k * 7 + sum(point) * 3 + src_sum) % 1001


def step_kernel(kind):
    def write(ctx, out, *rest):
        k = rest[-1]
        src_sum = int(rest[0].sum()) if len(rest) == 2 else 0
        v = kernel_value(k, ctx.point, src_sum)
        if kind == "write":
            out[...] = v
        elif kind == "rw":
            out[...] = (out * 3 + v) % 100003
        elif kind == "reduce":
            out += v
        return int(out.sum()) if kind != "reduce" else v

    def read(ctx, view, *rest):
        k = rest[-1]
        src_sum = int(rest[0].sum()) if len(rest) == 2 else 0
        return int(view.sum()) * 31 + kernel_value(k, ctx.point, src_sum)

    return read if kind == "read" else write


KERNELS = {kind: step_kernel(kind) for kind in ("write", "rw", "reduce", "read")}
PRIVS = {"write": WRITE, "rw": READ_WRITE, "reduce": Reduce("+"), "read": READ}


def run_sequential(shapes, parts, steps):
    arrays = [np.arange(np.prod(s), dtype=np.int64).reshape(s) % 13 for s in shapes]
    _, partitions = build(lambda s: Region(s, "int64"), shapes, parts)
    results = []
    for kind, r, p, src, k in steps:
        part = partitions[r][p]
        out = {}
        src_part = partitions[src[0]][src[1]] if src else None
        colors = part.colors()
        if src_part is not None and len(src_part.colors()) != len(colors):
            src_part = None
        for i, color in enumerate(colors):
            rect = part.rects[color]
            src_sum = int(arrays[src[0]][src_part.rects[src_part.colors()[i]].slices()].sum()) if src_part else 0
            v = kernel_value(k, color, src_sum)
            view = arrays[r][rect.slices()]
            if kind == "write":
                view[...] = v
                out[color] = int(view.sum())
            elif kind == "rw":
                view[...] = (view * 3 + v) % 100003
                out[color] = int(view.sum())
            elif kind == "reduce":
                view += v
                out[color] = v
            else:
                out[color] = int(view.sum()) * 31 + v
        results.append(out)
    return arrays, results


def run_runtime(rt, shapes, parts, steps, repeat=1, replay=False, wait=False):
    """The program on a runtime: `repeat` times over, each time in a replay block if asked
    (replay="program": as one Runtime.issue_program of the same launch list each time), and
    waiting for each step to finish before the next is issued if `wait` (so every instance a
    step touches is made before the next step may ask its memory for more).
    `steps` come through `_same_steps`, so no step reads the region it writes."""
    regions, partitions = build(lambda s: rt.region(s, "int64"), shapes, parts)
    for region, shape in zip(regions, shapes):
        rt.attach(region, np.arange(np.prod(shape), dtype=np.int64).reshape(shape) % 13)
    launches = []
    for kind, r, p, src, k in steps:
        part = partitions[r][p]
        reqs = [req(part, PRIVS[kind])]
        if src is not None:
            src_part = partitions[src[0]][src[1]]
            if len(src_part.colors()) == len(part.colors()):
                reqs.append(req(src_part, READ, projection=ByIndex(part, src_part)))
        launches.append((KERNELS[kind], part, reqs, k))
    futures = []
    program = tuple(Launch(fn, tuple(part.colors()), tuple(reqs), f"step{k}", returns=True)
                    for fn, part, reqs, k in launches)
    for _ in range(repeat):
        if replay == "program":
            futures += rt.issue_program("program", program, [(k,) for _, _, _, k in launches])
            continue
        with (rt.replay("program") if replay else nullcontext()):
            for fn, part, reqs, k in launches:
                futures.append(rt.index_launch(fn, part, *reqs, args=(k,)))
                if wait:
                    rt.wait()
    arrays = [rt.read(region) for region in regions]
    return arrays, [fm.get() for fm in futures]


def _same_steps(steps):
    """Drop the source of steps that would read the region they write (a task may not
    read and write overlapping data of one region)."""
    out = []
    for kind, r, p, src, k in steps:
        if src is not None and src[0] == r and kind != "read":
            src = None
        out.append((kind, r, p, src, k))
    return out


def check_program(rt, prog, repeat: int = 1, replay: bool = False, where: str = "", wait: bool = False) -> None:
    """Run a drawn program on `rt` (`repeat` times, in a replay block if asked, each step waited
    for if `wait`) and compare the arrays read back and every point task's result with the
    sequential reference."""
    shapes, parts, steps = prog
    steps = _same_steps(steps)
    want_arrays, want_results = run_sequential(shapes, parts, steps * repeat)
    got_arrays, got_results = run_runtime(rt, shapes, parts, steps, repeat, replay, wait)
    for i, (got, want) in enumerate(zip(got_arrays, want_arrays)):
        np.testing.assert_array_equal(got, want, err_msg=f"{where}region {i} of program {prog}")
    assert got_results == want_results, f"{where}point results of program {prog}"


@pytest.mark.parametrize("cpus,separate", [(1, False), (2, False), (4, False), (2, True), (4, True)])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prog=programs())
def test_random_programs_match_sequential(cpus, separate, prog):
    with Runtime(cpus=cpus, separate_memories=separate) as rt:
        check_program(rt, prog)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prog=programs())
def test_random_programs_waited_for_step_by_step_match_sequential(prog):
    """Each step finished before the next is issued: a memory's instance is made for what the
    steps so far asked of it, and grows (its data kept) when a later step asks for more."""
    with Runtime(cpus=4, separate_memories=True) as rt:
        check_program(rt, prog, wait=True)


@pytest.mark.parametrize("cpus,separate", [(2, False), (4, True)])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prog=programs())
def test_replayed_random_programs_match_sequential(cpus, separate, prog):
    """Repeating a random program in a replay block gives the same arrays and futures as
    running it that many times in program order on one thread."""
    with Runtime(cpus=cpus, separate_memories=separate) as rt:
        check_program(rt, prog, repeat=4, replay=True)
        assert rt.replay_stats["mismatches"] == 0


@pytest.mark.parametrize("cpus,separate", [(1, False), (2, False), (4, True)])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prog=programs())
def test_reissued_random_programs_match_sequential(cpus, separate, prog):
    """A random program issued again and again with issue_program (the recorded nodes made
    anew in one go once the block replays) gives the sequential arrays and futures."""
    with Runtime(cpus=cpus, separate_memories=separate) as rt:
        check_program(rt, prog, repeat=5, replay="program")
        stats = dict(rt.replay_stats)
    assert stats["mismatches"] == 0
    assert stats["reissued"] == stats["replayed"], stats


# ---- reductions ---------------------------------------------------------------------------
@pytest.mark.parametrize("op,ufunc", [("sum", np.add), ("prod", np.multiply), ("max", np.maximum),
                                      ("min", np.minimum)])
@pytest.mark.parametrize("separate", [False, True])
def test_reductions_fold_every_contribution(op, ufunc, separate):
    values = np.arange(1, 9, dtype=np.int64).reshape(4, 2) % 5 + 1
    with Runtime(cpus=4, separate_memories=separate) as rt:
        acc = rt.region((2,), "int64", "acc")
        rt.attach(acc, np.array([3, 2]))

        def contribute(ctx, buf):
            getattr(np, {"sum": "add", "prod": "multiply", "max": "maximum", "min": "minimum"}[op])(
                buf, values[ctx.point[0]], out=buf)

        rt.index_launch(contribute, 4, req(acc, Reduce(op)))
        got = rt.read(acc)
    want = ufunc.reduce(np.vstack([[3, 2], values]), axis=0)
    np.testing.assert_array_equal(got, want)


def test_reductions_into_halo_partition_add_overlaps():
    with Runtime(cpus=2, separate_memories=True) as rt:
        r = rt.region((10,), "float64")
        halo = Partition.from_rects(r, [Rect.make((0,), (6,)), Rect.make((4,), (10,))])
        rt.index_launch(lambda buf: buf.__iadd__(1.0), halo, req(halo, Reduce("+")))
        got = rt.read(r)
    np.testing.assert_array_equal(got, [1, 1, 1, 1, 2, 2, 1, 1, 1, 1])


# ---- futures --------------------------------------------------------------------------------
def test_futures_carry_values_and_feed_later_tasks():
    with Runtime(cpus=2) as rt:
        x = rt.region((6,), "float64")
        rt.attach(x, np.arange(6.0))
        total = rt.launch(lambda v: float(v.sum()), req(x, READ))
        scaled = rt.launch(lambda v, t: v.__imul__(t), req(x, READ_WRITE), args=(total,))
        fm = rt.index_launch(lambda ctx, v: ctx.point[0] * 10 + float(v.sum()), x.partition((3,)),
                             req(x.partition((3,)), READ))
        assert total.get() == 15.0
        scaled.wait()
        assert fm.get() == {(0,): 15.0, (1,): 10 + 75.0, (2,): 20 + 135.0}
        assert fm[1].done()
        np.testing.assert_array_equal(rt.read(x), np.arange(6.0) * 15)


# ---- parallelism -----------------------------------------------------------------------------
def test_tasks_that_release_the_gil_run_in_parallel():
    with Runtime(cpus=2) as rt:
        rt.index_launch(lambda: time.sleep(0.01), 2)
        rt.wait()
        t0 = time.perf_counter()
        rt.index_launch(lambda: time.sleep(0.3), 2)
        rt.wait()
        elapsed = time.perf_counter() - t0
    assert elapsed < 0.5, f"two 0.3 s tasks on 2 processors took {elapsed:.2f} s"


def test_a_read_waits_for_the_earlier_write():
    order = []
    lock = threading.Lock()

    def log(tag):
        def fn(view):
            with lock:
                order.append(tag)
        return fn

    with Runtime(cpus=2) as rt:
        a = rt.region((4,))

        def slow_writer(v):
            time.sleep(0.1)
            v[...] = 7
            with lock:
                order.append("write")

        rt.launch(slow_writer, req(a, WRITE))
        rt.launch(log("read"), req(a, READ))
        rt.wait()
    assert order == ["write", "read"]


# ---- bad input -------------------------------------------------------------------------------
def test_errors_at_launch_name_the_problem():
    with Runtime(cpus=1) as rt:
        r = rt.region((4, 4), name="grid")
        with pytest.raises(ValueError, match=r"outside Region\('grid'"):
            req(r, READ, Rect.make((0, 0), (5, 1)))
        with pytest.raises(ValueError, match=r"is 1-d but Region\('grid'"):
            req(r, READ, Rect.make((0,), (1,)))
        with pytest.raises(ValueError, match="unknown privilege 'X'"):
            req(r, "X")
        with pytest.raises(ValueError, match="unknown reduction operator 'xor'"):
            Reduce("xor")
        with pytest.raises(TypeError, match="requirement 0 must be a Requirement"):
            rt.launch(lambda v: None, r)
        with pytest.raises(TypeError, match="must be callable"):
            rt.launch(42)
        part = r.partition((2, 1))
        with pytest.raises(ValueError, match="projects to color \\(5,\\)"):
            rt.index_launch(lambda v: None, part, req(part, READ, projection=lambda p: (5,)))
        with pytest.raises(ValueError, match="overlap .* conflicting privileges"):
            rt.launch(lambda a, b: None, req(r, READ), req(r, WRITE))
        with pytest.raises(ValueError, match="attach: array of shape \\(3,\\) does not fit"):
            rt.attach(r, np.zeros(3))
        with pytest.raises(ValueError, match="processor index 9 out of range"):
            rt.index_launch(lambda: None, 2, placement={(0,): 9})
        # points are tuples: int keys were ignored, the mapper placing every point
        with pytest.raises(ValueError, match=r"placement keys \[0, 1\] are not points of its domain "
                                             r"\(points are tuples of 1, such as \(0,\)\)"):
            rt.index_launch(lambda: None, 2, placement={0: 1, 1: 0})
        with pytest.raises(ValueError, match=r"placement keys \[\(0, 0\)\]"):
            rt.index_launch(lambda: None, 2, placement={(0, 0): 0})
        with pytest.raises(TypeError, match=r"launch 'f': placement maps points to processors \(a dict\), got list "
                                            r"\[0, 1\]"):
            rt.index_launch(lambda: None, 2, placement=[0, 1], name="f")
        assert rt._next_id == 0, "nothing may be issued by a launch that fails its checks"
        # a processor index from numpy (np.arange, argsort) is an index too
        done = rt.index_launch(lambda: 7, 2, placement={(0,): np.int64(0), (1,): np.int64(0)})
        assert done.get() == {(0,): 7, (1,): 7}


def test_a_region_of_a_runtime_that_has_shut_down_is_not_read_as_zeros():
    """Its data went with that runtime; a new one read zeros silently (a notebook's second `with Runtime()`)."""
    with Runtime(cpus=1) as rt:
        x = rt.region((4,), "float32", "x")
        rt.attach(x, np.ones(4))
        rt.read(x)
    with Runtime(cpus=1) as rt:
        with pytest.raises(ValueError, match=r"held its data in a Runtime that has been shut down, and its data went "
                                             r"with it: attach or fill it in this runtime before reading it"):
            rt.read(x)
        rt.attach(x, np.full(4, 2.0))
        np.testing.assert_array_equal(rt.read(x), np.full(4, 2.0, "float32"))


def test_writing_a_read_argument_fails():
    with Runtime(cpus=1) as rt:
        r = rt.region((3,))
        rt.fill(r, 1.0)

        def bad(v):
            v[0] = 5

        rt.launch(bad, req(r, READ))
        with pytest.raises(TaskError, match="read-only"):
            rt.wait()


def test_task_error_surfaces_with_name_and_traceback_and_nothing_hangs():
    rt = Runtime(cpus=2)
    r = rt.region((8,))

    def explode(ctx, v):
        if ctx.point == (1,):
            raise ZeroDivisionError("boom in tile 1")

    rt.index_launch(explode, r.partition((2,)), req(r.partition((2,)), WRITE))
    later = rt.launch(lambda v: 1, req(r, READ))
    t0 = time.perf_counter()
    with pytest.raises(TaskError) as info:
        rt.wait(timeout=10)
    message = str(info.value)
    assert "'explode' point [1]" in message and "boom in tile 1" in message
    assert "Traceback" in message and "raise ZeroDivisionError" in message
    with pytest.raises(TaskError):
        later.get(timeout=10)
    with pytest.raises(RuntimeError, match="stopped after a task failed"):
        rt.launch(lambda: None)
    rt.shutdown()
    assert time.perf_counter() - t0 < 10
    assert all(not t.is_alive() for t in rt.executor.threads)


# ---- replay ---------------------------------------------------------------------------------
def _jacobi_program(rt, steps, use_replay, mutate_at=None):
    """A 1-d stencil with halos on 4 tiles: a real dependence pattern for replay."""
    n = 32
    a, b = rt.region((n,), "float64", "a"), rt.region((n,), "float64", "b")
    rt.attach(a, np.sin(np.arange(n)))
    rt.fill(b, 0.0)
    tiles = a.partition((4,))
    halo_a = Partition(a, {c: Rect.make((max(0, r.lo[0] - 1),), (min(n, r.hi[0] + 1),)) for c, r in tiles.rects.items()})
    halo_b = Partition(b, halo_a.rects)
    out_a, out_b = tiles, b.partition((4,))

    def stencil(ctx, src, dst):
        lo = ctx.rects[1].lo[0] - ctx.rects[0].lo[0]
        padded = np.pad(src, 1, mode="edge")
        smooth = (padded[:-2] + padded[1:-1] + padded[2:]) / 3
        dst[...] = smooth[lo:lo + dst.shape[0]]

    program = (Launch(stencil, tuple(out_b.colors()), (req(halo_a, READ), req(out_b, WRITE)), "stencil:b"),
               Launch(stencil, tuple(out_a.colors()), (req(halo_b, READ), req(out_a, WRITE)), "stencil:a"))
    for step in range(steps):
        if use_replay == "program":
            assert rt.issue_program("step", program, [(), ()]) == [None, None]
            continue
        block = rt.replay("step") if use_replay else nullcontext()
        with block:
            rt.index_launch(stencil, out_b, req(halo_a, READ), req(out_b, WRITE))
            if mutate_at == step:
                rt.launch(lambda v: v.__iadd__(1.0), req(b, READ_WRITE))
            rt.index_launch(stencil, out_a, req(halo_b, READ), req(out_a, WRITE))
    return rt.read(a)


@pytest.mark.parametrize("separate", [False, True])
def test_replay_gives_the_dynamic_result(separate):
    with Runtime(cpus=4, separate_memories=separate) as rt:
        want = _jacobi_program(rt, 8, use_replay=False)
    with Runtime(cpus=4, separate_memories=separate) as rt:
        got = _jacobi_program(rt, 8, use_replay=True)
        stats = dict(rt.replay_stats)
    np.testing.assert_array_equal(got, want)
    assert stats["replayed"] >= 5 and stats["mismatches"] == 0


@pytest.mark.parametrize("cpus,separate", [(1, False), (4, True)])
def test_a_reissued_program_gives_the_dynamic_result(cpus, separate):
    """issue_program of the same launch list: recorded twice (the first entry starts from the
    attached state), then reissued whole every time, with the dynamic run's result."""
    with Runtime(cpus=cpus, separate_memories=separate) as rt:
        want = _jacobi_program(rt, 8, use_replay=False)
    with Runtime(cpus=cpus, separate_memories=separate) as rt:
        got = _jacobi_program(rt, 8, use_replay="program")
        stats = dict(rt.replay_stats)
    np.testing.assert_array_equal(got, want)
    assert stats == {"recorded": 2, "replayed": 6, "mismatches": 0, "reissued": 6}


def test_a_reissued_program_takes_each_issue_s_args_and_returns_only_what_is_asked():
    """Each reissue runs its tasks with that issue's args; only launches marked `returns` get a
    FutureMap, the others None."""
    def scale(ctx, view, factor):
        view *= factor
        return float(view.sum())

    def total(view):
        return float(view.sum())

    with Runtime(cpus=2) as rt:
        a = rt.region((8,), "float64", "a")
        rt.attach(a, np.ones(8))
        parts = a.partition((2,))
        program = (Launch(scale, tuple(parts.colors()), (req(parts, READ_WRITE),), "scale"),
                   Launch(total, ((),), (req(a, READ),), "total", returns=True))
        sums = []
        for factor in (2.0, 3.0, 0.5, 4.0, 1.0):
            scaled, fm = rt.issue_program("p", program, [(factor,), ()])
            assert scaled is None
            sums.append(fm[()].get())
        assert rt.replay_stats["reissued"] == 3
        np.testing.assert_array_equal(rt.read(a), np.full(8, 12.0))
    assert sums == [16.0, 48.0, 24.0, 96.0, 96.0]


def test_a_program_equal_launch_by_launch_is_reissued_from_its_next_issue():
    """A new list of the same launches replays launch by launch once (keys compared), then is
    reissued whole."""
    def inc(view):
        view += 1

    with Runtime(cpus=2) as rt:
        a = rt.region((4,), "int64", "a")
        rt.fill(a, 0)

        def program():
            return (Launch(inc, ((0,), (1,)), (req(a.partition((2,)), READ_WRITE),), "inc"),)
        for _ in range(3):
            rt.issue_program("p", program(), [()])
        assert rt.replay_stats["reissued"] == 0   # recorded, recorded, replayed launch by launch
        same = program()
        for _ in range(3):
            rt.issue_program("p", same, [()])
        assert rt.replay_stats["reissued"] == 2
        np.testing.assert_array_equal(rt.read(a), np.full(4, 6))


def test_issue_program_refuses_bad_programs_before_issuing_anything():
    with Runtime(cpus=1) as rt:
        a = rt.region((4,), "float64", "a")
        rt.fill(a, 0.0)
        launch = Launch(lambda v, x: None, ((),), (req(a, READ_WRITE),), "f")
        before = rt._next_id
        with pytest.raises(ValueError, match="1 args tuples for 2 launches"):
            rt.issue_program("p", (launch, launch), [(1,)])
        with pytest.raises(ValueError, match="2 args tuples for 1 launches"):
            rt.issue_program("p", (launch,), [(1,), (2,)])
        with pytest.raises(TypeError, match="args of launch 0 .'f'. must be a tuple, got list"):
            rt.issue_program("p", (launch,), [[1]])
        fut = rt.launch(lambda: 1)
        after = rt._next_id
        with pytest.raises(TypeError, match="hold a Future"):
            rt.issue_program("p", (launch,), [(fut,)])
        with pytest.raises(TypeError, match="launch 0 must be a taskrt Launch, got tuple"):
            rt.issue_program("p", ((None, (), ()),), [()])
        assert rt._next_id == after and before + 1 == after
    with pytest.raises(ValueError, match="launch 'g': empty launch domain"):
        Launch(None, (), (), "g")
    with pytest.raises(TypeError, match="launch 'g': requirement 0 must be a Requirement"):
        Launch(None, ((),), (a,), "g")


def test_a_replayed_launch_larger_than_an_emit_batch_runs_every_point_in_order():
    """A launch of more points than replay emits at a time (EMIT_BATCH) replays them all, each
    after the point it reads from the launch before."""
    from taskrt.replay import EMIT_BATCH
    n = 2 * EMIT_BATCH + 3
    with Runtime(cpus=2, separate_memories=True) as rt:
        a = rt.region((n,), "float64", name="a")
        rt.fill(a, 0.0)
        tiles = a.partition((n,))

        def bump(v):
            v += 1.0
        for _ in range(4):
            with rt.replay("bumps"):
                rt.index_launch(bump, tiles, req(tiles, READ_WRITE))
                rt.index_launch(bump, tiles, req(tiles, READ_WRITE))
        got, stats = rt.read(a), dict(rt.replay_stats)
    np.testing.assert_array_equal(got, np.full(n, 8.0))
    assert stats["replayed"] >= 2 and stats["mismatches"] == 0


def test_replay_mismatch_warns_and_falls_back_correctly():
    with Runtime(cpus=4, separate_memories=True) as rt:
        want = _jacobi_program(rt, 6, use_replay=False, mutate_at=4)
    with Runtime(cpus=4, separate_memories=True) as rt:
        with pytest.warns(ReplayMismatch, match="launch #1 .* does not match the recording, which has "
                                                "'stencil' with another task function, name"):
            got = _jacobi_program(rt, 6, use_replay=True, mutate_at=4)
        assert rt.replay_stats["mismatches"] == 1
    np.testing.assert_array_equal(got, want)


def test_a_placed_launch_is_mapped_once_and_a_conflicting_one_still_refused():
    with Runtime(cpus=2, execute=False) as rt:
        r = rt.region((4, 2), "float32", "r")
        part = r.partition((2, 1))

        def kernel(v):
            v += 1

        placement = {(0, 0): 1, (1, 0): 0}
        first = rt._make_spec(kernel, part.colors(), [req(part, READ_WRITE)], (), None, "k", placement, "")
        again = rt._make_spec(kernel, part.colors(), [req(part, READ_WRITE)], (), None, "k", placement, "")
        assert again.rects is first.rects and [str(p) for p in again.procs] == ["r0.cpu1", "r0.cpu0"]
        assert len(rt._mapped_launches) == 1
        swapped = rt._make_spec(kernel, part.colors(), [req(part, READ_WRITE)], (), None, "k",
                                {(0, 0): 0, (1, 0): 1}, "")
        assert [str(p) for p in swapped.procs] == ["r0.cpu0", "r0.cpu1"]
        with pytest.raises(ValueError, match="overlap .* conflicting privileges"):
            rt.index_launch(kernel, part, req(part, READ), req(r, WRITE), placement=placement)


def test_replay_compares_only_the_regions_touched_since_it_last_replayed(monkeypatch):
    """Entering a replay block compares the region states at entry with the recording's only
    where the analysis touched a region since the last replay installed its state; a write
    from outside the block in between (here: one that leaves the data in another memory) is
    still seen, and the block is recorded again, with the dynamic run's result."""
    import taskrt.replay as replay

    compared = []
    original = replay._abstract
    monkeypatch.setattr(replay, "_abstract", lambda rt, uid: compared.append(uid) or original(rt, uid))

    def program(rt, use_replay):
        r = rt.region((8,), "float64", "r")
        rt.fill(r, 1.0)
        parts = r.partition((2,))
        counts = []

        def double(v):
            v *= 2.0

        for step in range(6):
            before = len(compared)
            with rt.replay("double") if use_replay else nullcontext():
                rt.index_launch(double, parts, req(parts, READ_WRITE))
            counts.append(len(compared) - before)
            if step == 3:
                rt.launch(lambda v: v.__iadd__(1.0), req(r, READ_WRITE), proc=3)
        return rt.read(r), counts

    with Runtime(cpus=4, separate_memories=True) as rt:
        want, _ = program(rt, use_replay=False)
    with Runtime(cpus=4, separate_memories=True) as rt:
        got, counts = program(rt, use_replay=True)
        stats = dict(rt.replay_stats)
    np.testing.assert_array_equal(got, want)
    # entries 0 and 1 record (the data starts on the home processor); entry 2 compares and
    # replays, entry 3 follows that replay with nothing in between: no comparison; entry 4
    # follows the outside write: compared, differs, recorded again (and so is entry 5, whose
    # state is no longer that recording's start)
    assert counts[2] == 1 and counts[3] == 0 and counts[4] == 1
    assert stats == {"recorded": 4, "replayed": 2, "mismatches": 0, "reissued": 0}


def test_replay_of_a_shorter_block_falls_back():
    with Runtime(cpus=2) as rt:
        r = rt.region((4,), "int64")
        rt.fill(r, 0)

        def inc(v):
            v += 1

        for k in range(3):
            with rt.replay("b"):
                rt.launch(inc, req(r, READ_WRITE))
                rt.launch(inc, req(r, READ_WRITE))
        with pytest.warns(ReplayMismatch, match="ended after 1 launches; the recording has 2"):
            with rt.replay("b"):
                rt.launch(inc, req(r, READ_WRITE))
        assert rt.replay_stats["replayed"] == 3
        with rt.replay("b"):
            rt.launch(inc, req(r, READ_WRITE))
        assert rt.read(r).tolist() == [8, 8, 8, 8]


# ---- graphs without execution, traces --------------------------------------------------------
def test_graph_is_built_without_executing():
    ran = []
    rt = Runtime(machine=Machine.build(1, 4, separate_memories=True), execute=False)
    x = rt.region((8, 8))
    part = x.partition((4, 1))
    rt.index_launch(lambda v: ran.append(1), part, req(part, WRITE))
    rt.launch(lambda v: ran.append(1), req(x, READ))
    g = rt.graph
    assert not ran
    assert len(g.tasks()) == 5 and len(g.copies()) == 3
    assert all(p < n for p, n in g.edges())
    assert g.critical_path_length() == 3
    with pytest.raises(RuntimeError, match="execute=False"):
        rt.read(x)


def test_a_trace_that_could_not_be_written_is_refused_before_any_work(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"Runtime: the trace /no/such/folder/t.jsonl: the folder /no/such/folder "
                                         r"does not exist"):
        Runtime(cpus=1, trace="/no/such/folder/t.jsonl")
    monkeypatch.setenv("TASKRT_TRACE", str(tmp_path))
    with pytest.raises(ValueError, match="is a folder, not a file"):
        Runtime(cpus=1)


def test_trace_file_records_tasks_and_copies(tmp_path):
    path = tmp_path / "run.trace.jsonl"
    with Runtime(cpus=2, separate_memories=True, trace=str(path)) as rt:
        x = rt.region((8,), "float32", "x")
        rt.fill(x, 2.0)
        part = x.partition((2,))
        rt.index_launch(lambda v: None, part, req(part, READ), name="look")
    from taskrt.tracing import read_trace
    meta, events = read_trace(str(path))
    assert meta["unit"] == "us" and meta["rank"] == 0
    kinds = {e["kind"] for e in events}
    assert kinds == {"task", "copy"}
    look = [e for e in events if e["name"] == "look"]
    assert len(look) == 2 and all(e["bytes"] == 16 for e in look)
    copy = [e for e in events if e["kind"] == "copy"][0]
    assert copy["proc"] == "r0.sys0->r0.sys1" and copy["bytes"] == 16
    for e in events:
        assert e["end"] >= e["start"] >= 0
        assert set(e) >= {"name", "kind", "op", "rank", "proc", "start", "end", "bytes", "preds"}
    # the graph's edges: the copy waits for the fill, each look for the fill and (one of them) the copy
    fill = next(e for e in events if e["name"] == "fill:x")
    assert copy["preds"] == [fill["id"]]
    assert all(fill["id"] in e["preds"] for e in look) and any(copy["id"] in e["preds"] for e in look)


def test_empty_rects_order_nothing_and_leave_no_pending_reduction():
    with Runtime(cpus=2) as rt:
        r = rt.region((4,), "int64")
        rt.fill(r, 1)
        empty = Partition.from_rects(r, [Rect.make((2,), (2,)), Rect.make((0,), (4,))])
        rt.index_launch(lambda buf: buf.__iadd__(5), empty, req(empty, Reduce("+")))
        assert rt.read(r).tolist() == [6, 6, 6, 6]
        assert not rt.analyzer.state(r).pending
        assert not rt.store.buffers


# ---- bad input found by trying the API (each used to hang, run wrongly or fail deep inside) --------
def test_a_task_that_launches_or_waits_fails_at_once_rather_than_waiting_on_itself():
    with Runtime(cpus=2) as rt:
        with pytest.raises(TaskError, match=r"a launch from inside a task \(on worker taskrt-r0.cpu\d\): tasks "
                                            r"cannot launch tasks"):
            rt.launch(lambda: rt.launch(lambda: 5).get()).get(timeout=30)
        rt.recover()
        r = rt.region((4,))
        rt.fill(r, 1.0)
        with pytest.raises(TaskError, match=r"a launch from inside a task"):
            rt.launch(lambda: rt.read(r)).get(timeout=30)
        rt.recover()
        assert rt.read(r).tolist() == [1.0] * 4   # and the runtime goes on


def test_after_a_failure_only_what_depends_on_it_is_skipped():
    """A failed task's dependents are skipped; work that does not need it runs, whenever it comes
    to run (Model's last step's updates, queued when the next step's source failed, were lost
    at random); recover says which nodes were lost."""
    with Runtime(cpus=2) as rt:
        a, b = rt.region((4,), "int64"), rt.region((4,), "int64")
        rt.fill(a, 1)
        rt.fill(b, 1)
        gate = threading.Event()

        def fail_late(buf):
            gate.wait(30)
            raise ValueError("late")
        first = rt.issued
        rt.launch(fail_late, req(a, READ_WRITE), name="fails")
        rt.launch(lambda buf: buf.__iadd__(5), req(a, READ_WRITE), name="needs_a")
        for _ in range(3):   # queued behind the failure on either worker, needing none of it
            rt.launch(lambda buf: buf.__iadd__(1), req(b, READ_WRITE), name="b")
        after = rt.issued
        gate.set()
        with pytest.raises(TaskError, match="late"):
            rt.wait()
        lost = rt.recover()
        assert rt.read(b).tolist() == [4] * 4
        assert lost == [first, first + 1] and after > first + 2
        assert rt.recover() == []   # nothing more to forget
        rt.fill(a, 2)
        assert rt.read(a).tolist() == [2] * 4


def test_the_future_of_a_lost_task_says_so_after_recover():
    """It returned None after recover, and a task given it as an argument later failed with
    whatever error was current: get() raises, and a launch taking it is refused before it runs."""
    with Runtime(cpus=2) as rt:
        f = rt.launch(lambda: 1 // 0, name="div")
        with pytest.raises(TaskError, match="ZeroDivisionError"):
            f.get(timeout=30)
        rt.recover()
        with pytest.raises(RuntimeError, match=r"the value of task 'div' \(node #\d+\) is lost: the task failed"):
            f.get(timeout=30)
        issued = rt.issued
        with pytest.raises(ValueError, match=r"launch 'uses_f': an argument is the future of task 'div' .* lost"):
            rt.launch(lambda x: x, args=(f,), name="uses_f")
        assert rt.issued == issued and rt.launch(lambda: 7).get(timeout=30) == 7


def test_a_future_keeps_the_value_a_task_returned_as_a_view_of_its_region():
    """The future held the view: a later fill of the region changed a value already returned."""
    with Runtime(cpus=1) as rt:
        x = rt.region((4,), "int64")
        rt.fill(x, 101)
        head = rt.launch(lambda v: v[:2], req(x, READ))
        whole = rt.launch(lambda v: v, req(x, READ))
        total = rt.launch(lambda v: v.sum(), req(x, READ))   # (a scalar: kept as it is)
        rt.fill(x, -5)
        rt.wait()
        assert head.get().tolist() == [101, 101] and whole.get().tolist() == [101] * 4 and total.get() == 404


def test_a_future_of_another_runtime_is_refused_as_an_argument():
    """The runtime took its node id for one of its own nodes: the task got None (the value of
    whatever node had that id), or waited forever where the id was its own."""
    with Runtime(cpus=1) as a, Runtime(cpus=1) as b:
        f = a.launch(lambda: 42)
        issued = b.issued
        for point_args in (None, {(): (f,)}):
            with pytest.raises(ValueError, match=r"launch 'echo': an argument is a Future of another Runtime "
                                                 r"\(node #\d+ there\): pass its value"):
                b.index_launch(lambda v: v, Rect((), ()), args=() if point_args else (f,), point_args=point_args,
                               name="echo")
        assert b.issued == issued
        assert b.launch(lambda v: v, args=(f.get(timeout=30),)).get(timeout=30) == 42


def test_a_launch_whose_instance_grows_as_a_task_fails_goes_in_whole():
    """An instance that must grow waits for what was issued before; a task failing meanwhile made
    that wait raise halfway through the launch, whose nodes were never submitted, and the region
    stayed unreadable on that memory after recover."""
    with Runtime(cpus=2, separate_memories=True) as rt:
        r, b = rt.region((8,), "int64"), rt.region((4,), "int64")
        rt.fill(r, 1)
        rt.fill(b, 0)
        rt.launch(lambda v: int(v.sum()), req(r, READ, Rect((0,), (4,))), proc=1).get(timeout=30)

        def fails_later(v):
            time.sleep(0.3)
            raise ValueError("boom")
        rt.launch(fails_later, req(b, READ_WRITE), proc=0)
        with suppress(TaskError):   # r needs none of it; its instance on cpu1 grows (the
            # launch goes in whole, and get() may raise the failure that came meanwhile)
            rt.launch(lambda v: int(v.sum()), req(r, READ), proc=1).get(timeout=30)
        rt.recover()
        assert rt.launch(lambda v: v.tolist(), req(r, READ), proc=1).get(timeout=30) == [1] * 8


def test_a_reduction_skipped_after_a_failure_is_folded_as_nothing_after_recover():
    # the skipped tasks' folds are issued only when r is read, after recover(): they used to
    # miss their buffers (KeyError in a fold), as train_on did about 1 time in 60
    with Runtime(cpus=2) as rt:
        r = rt.region((4,), "int64")
        rt.fill(r, 1)
        gate = threading.Event()

        def fail_late(buf):
            gate.wait(30)
            raise ValueError("late")
        failed = rt.launch(fail_late, req(r, READ_WRITE))
        halves = Partition.equal(r, (2,))
        rt.index_launch(lambda buf: buf.__iadd__(5), halves, req(halves, Reduce("+")))
        gate.set()
        with pytest.raises(TaskError, match="late"):
            failed.get(timeout=30)
        rt.recover()
        assert rt.read(r).tolist() == [1] * 4 and not rt.store.buffers
        rt.index_launch(lambda buf: buf.__iadd__(5), halves, req(halves, Reduce("+")))
        assert rt.read(r).tolist() == [6] * 4 and not rt.store.buffers


def test_what_reads_a_reduction_missing_a_failed_part_is_lost_with_it():
    """A failed contributor's fold once folded nothing and let the folds after it and the readers
    run: a model's activation gradient summed over tiles, missing one, drove every backward and
    update above it (momentum-only updates on a zero gradient)."""
    with Runtime(cpus=2) as rt:
        r, out = rt.region((4,), "int64"), rt.region((4,), "int64")
        rt.fill(r, 1)
        rt.fill(out, 0)

        def add(buf, point):
            if point == 1:
                raise ValueError("point 1")
            buf += 10 ** point

        def copy(dst, src):
            dst[...] = src
        rt.index_launch(add, 4, req(r, Reduce("+")), point_args={(p,): (p,) for p in range(4)})
        reader = rt.launch(copy, req(out, WRITE), req(r, READ))
        with pytest.raises(TaskError, match="point 1"):
            rt.wait()
        lost = rt.recover()
        assert reader.node_id in lost and rt.read(out).tolist() == [0] * 4 and not rt.store.buffers


def test_a_reduction_task_that_fails_before_or_after_its_buffers_ends_in_its_error_not_a_hang(monkeypatch):
    from taskrt.instances import InstanceStore
    with Runtime(cpus=2) as rt:
        r = rt.region((4,), "int64")
        rt.fill(r, 1)

        def add_then_fail(buf):
            buf += 5
            raise ValueError("after")
        rt.launch(add_then_fail, req(r, Reduce("+")))
        with pytest.raises(TaskError, match="after"):
            rt.read(r)
        rt.recover()
        assert not rt.store.buffers
        # a task that fails making its buffer: its fold, skipped, once killed the memory's worker
        monkeypatch.setattr(InstanceStore, "new_buffer", lambda *a: 1 / 0)
        rt.launch(lambda buf: None, req(r, Reduce("+")))
        with pytest.raises(TaskError, match="ZeroDivisionError"):
            rt.read(r)
        monkeypatch.undo()
        rt.recover()
        rt.fill(r, 2)
        assert rt.read(r).tolist() == [2] * 4 and not rt.store.buffers
        # failed after adding to its buffer, folded only after recover: the failed task gives
        # nothing (its 5 was folded in)
        rt.launch(add_then_fail, req(r, Reduce("+")))
        with pytest.raises(TaskError, match="after"):
            rt.wait()
        rt.recover()
        assert rt.read(r).tolist() == [2] * 4 and not rt.store.buffers


def test_a_reduction_pending_through_a_replayed_block_is_folded_once():
    """A block that leaves a reduction made before it pending cannot replay: its exit state
    named the fence as the reduction's buffer (a KeyError in the fold, or a worker lost)."""
    with Runtime(cpus=2) as rt:
        x = rt.region((9,), "int64")
        rt.fill(x, 0)
        spans = Partition.from_rects(x, [Rect.make((0,), (2,)), Rect.make((1,), (4,))])
        rt.index_launch(lambda buf: buf.__iadd__(1), spans, req(spans, Reduce("+")))
        for _ in range(3):
            with rt.replay("read"):   # reads [3, 6): folds a part of the pending sum
                total = rt.launch(lambda v: int(v.sum()), req(x, READ, Rect.make((3,), (6,))))
            assert total.get(timeout=30) == 1
        assert rt.read(x).tolist() == [1, 2, 1, 1, 0, 0, 0, 0, 0] and not rt.store.buffers
        assert rt.replay_stats["replayed"] == 0


def test_waiting_for_what_a_shutdown_without_waiting_left_unrun_raises_rather_than_hangs():
    rt = Runtime(cpus=1)
    x = rt.region((4,), "int64")
    rt.fill(x, 0)
    rt.wait()
    rt.launch(lambda v: time.sleep(0.3), req(x, READ_WRITE))
    total = rt.launch(lambda v: int(v.sum()), req(x, READ))   # ready only once the worker has stopped
    rt.shutdown(wait=False)
    with pytest.raises(RuntimeError, match=r"node #\d+: shutdown\(wait=False\) left it unrun"):
        total.get(timeout=10)
    with pytest.raises(RuntimeError, match=r"Runtime.wait: shutdown\(wait=False\) left 1 nodes unrun"):
        rt.wait(timeout=10)


@pytest.mark.parametrize("separate", [False, True])
def test_a_0d_region_holds_one_number(separate):
    # a task saw a numpy scalar, so every fill, attach and write failed inside it
    with Runtime(cpus=2, separate_memories=separate) as rt:
        z = rt.region((), "float64")
        rt.fill(z, 3.0)
        assert rt.read(z).shape == () and float(rt.read(z)) == 3.0
        rt.attach(z, np.array(5.0))
        rt.launch(lambda v: v.__iadd__(1), req(z, READ_WRITE))
        for _ in range(2):
            rt.launch(lambda v: v.__iadd__(2), req(z, Reduce("+")), proc=rt.machine.processors[1])
        assert rt.launch(lambda v: float(v), req(z, READ)).get(timeout=30) == 10.0


def test_attach_and_fill_refuse_numbers_the_region_would_change():
    with Runtime(cpus=2) as rt:
        small = rt.region((3,), "int8")
        with pytest.raises(ValueError, match=r"attach: 1000 at \(0,\) is beyond what .*'s int8 holds \(-128 to "
                                             r"127\): it would wrap around"):
            rt.attach(small, np.array([1000, 2, 3]))   # (it stored -24)
        rt.attach(small, np.array([100, -2, 3]))
        assert rt.read(small).tolist() == [100, -2, 3]
        floats = rt.region((2,), "float32")
        with pytest.raises(ValueError, match=r"fill: 1e\+300 \(float\) is not a number that .* \(float32\) can "
                                             r"hold"):
            rt.fill(floats, 1e300)   # (it stored inf, with numpy's warning)
        rt.fill(floats, float("inf"))
        assert rt.read(floats).tolist() == [float("inf")] * 2


def test_the_ends_of_each_type_fill_exactly_and_what_would_overflow_is_refused_before_any_work():
    """int64's and uint64's largest were refused (compared through a float, 2**63 - 1 rounded to
    2**63); ints attached to float16, complex parts beyond complex64 and a complex fill of a
    real region went in (as inf, or failing inside the task and stopping the runtime)."""
    with Runtime(cpus=1) as rt:
        for dtype, value in (("int64", 2**63 - 1), ("int64", -2**63), ("uint64", 2**64 - 1), ("float16", 65504),
                             ("complex64", complex(2.0**127, -2.0**126)), ("int8", np.float64(-128.0))):
            r = rt.region((2,), dtype)
            rt.fill(r, value)
            assert rt.read(r).tolist() == [value] * 2
        issued = rt.issued
        for dtype, value in (("int64", 2**63), ("uint64", -1), ("float16", 65520), ("float32", 1 + 0j),
                             ("float64", np.complex64(2)), ("complex64", 1e300), ("complex64", 1j * 1e39),
                             ("float64", 10**400), ("bool", 2)):
            with pytest.raises(ValueError, match=rf"fill: .* \({type(value).__name__}\) is not a number that .* "
                                                 rf"\({dtype}\) can hold"):
                rt.fill(rt.region((2,), dtype), value)
        for dtype, array, said in (("float16", np.array([1, 100000]), r"100000 at \(1,\) .* float16 holds \(at most "
                                                                       r"6.55e\+04\): it would become inf"),
                                   ("complex64", np.array([1, 1e300j]), r"1e\+300j at \(1,\) .* complex64 holds "
                                                                       r"\(at most 3.403e\+38 a part\)"),
                                   ("complex64", np.array([-1e39, 1.0]), r"-1e\+39 at \(0,\)")):
            with pytest.raises(ValueError, match="attach: " + said):
                rt.attach(rt.region((2,), dtype), array)
        assert rt.issued == issued
        r = rt.region((2,), "float16")
        rt.attach(r, np.array([-32768, 32767], np.int16))   # (an int16 always fits: not even looked at)
        assert rt.read(r).tolist() == [-32768.0, 32768.0]


def test_a_replay_that_falls_back_after_a_release_re_analyzes_around_it():
    """The launches replayed before a mismatch are analyzed again, each before or after the
    block's releases as they came (they were all analyzed after them: a false 'that data is gone')."""
    def total_of(v):
        return int(v.sum())
    with Runtime(cpus=2) as rt:
        x = rt.region((9,), "int64")
        for i in range(4):
            with rt.replay("step"), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                rt.fill(x, i)
                total = rt.launch(total_of, req(x, READ))
                rt.release(x)
                if i == 3:
                    rt.fill(x, 7)   # one more launch than the recording: ReplayMismatch
            assert total.get(timeout=30) == 9 * i
            assert any(issubclass(w.category, ReplayMismatch) for w in caught) == (i == 3)
        assert rt.read(x).tolist() == [7] * 9
        assert rt.replay_stats["replayed"] == 2 and rt.replay_stats["mismatches"] == 1


def test_a_block_that_reads_a_region_released_since_its_last_run_is_analyzed_again():
    """A replay reads without analysis: after a release since it was recorded (between runs, or
    inside the block) it read the gone data (a fresh zeroed instance) where analysis refuses."""
    def total_of(v):
        return int(v.sum())
    with Runtime(cpus=2) as rt:
        x = rt.region((9,), "int64")
        rt.fill(x, 2)
        for _ in range(3):
            with rt.replay("sum"):
                total = rt.launch(total_of, req(x, READ))
            assert total.get(timeout=30) == 18
        assert rt.replay_stats["replayed"] == 2
        rt.release(x)
        with pytest.raises(RuntimeError, match=r"is read by .* after its Runtime.release .* that data is gone"):
            with rt.replay("sum"):
                rt.launch(total_of, req(x, READ))
        rt.fill(x, 1)   # written again: the block records and then replays
        for _ in range(3):
            with rt.replay("sum"):
                total = rt.launch(total_of, req(x, READ))
            assert total.get(timeout=30) == 9
        assert rt.replay_stats["replayed"] == 4
        with rt.replay("sum and release"):   # recorded: it reads the data and then lets it go
            total = rt.launch(total_of, req(x, READ))
            rt.release(x)
        assert total.get(timeout=30) == 9
        with pytest.raises(RuntimeError, match=r"that data is gone"):
            with rt.replay("sum and release"):   # a replay read the gone data: 0
                rt.launch(total_of, req(x, READ))


def _sum(v):
    return int(v.sum())


def test_a_block_that_reads_data_from_before_it_and_then_releases_it_is_never_replayed():
    """Its replay would read the data without analysis, and the next entry's data may be gone: a
    recording that reads what came before it and then lets it go is analyzed every time (the
    analysis notes the reads; with the notes dropped it replayed)."""
    with Runtime(cpus=1) as rt:
        x = rt.region((4,), "int64")
        for i in range(3):
            rt.fill(x, i)
            with rt.replay("sum and release"):
                total = rt.launch(_sum, req(x, READ))
                rt.release(x)
            assert total.get(timeout=30) == 4 * i
        assert rt.replay_stats["recorded"] == 3 and rt.replay_stats["replayed"] == 0


def _slow_add_one(v):
    time.sleep(0.2)
    v += 1


def test_a_replayed_block_that_raises_leaves_its_launches_analyzed():
    """A replay issues its launches without analysis and installs their state at the block's
    end: a block that raised left the launches it had replayed out of the analysis, so a fill
    after it did not wait for them (and the slow add landed on the fill's 100)."""
    with Runtime(cpus=2) as rt, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = rt.region((4,), "float64")
        rt.fill(x, 0.0)
        for i in range(4):
            with pytest.raises(ValueError) if i == 3 else nullcontext():
                with rt.replay("step"):
                    rt.launch(_slow_add_one, req(x, READ_WRITE))
                    if i == 3:
                        raise ValueError("the user's code failed")
        assert rt.read(x).tolist() == [4.0] * 4
        rt.fill(x, 100.0)
        assert rt.read(x).tolist() == [100.0] * 4
        assert rt.replay_stats["replayed"] == 3
        assert "replay 'step': the block raised ValueError" in str(caught[-1].message)
        for _ in range(2):   # recorded again, then replayed
            with rt.replay("step"):
                rt.launch(_slow_add_one, req(x, READ_WRITE))
        assert rt.read(x).tolist() == [102.0] * 4 and rt.replay_stats["replayed"] == 4


def _add_one(acc):
    acc += 1


def test_a_block_replays_only_where_its_releases_and_the_releases_around_it_are_as_recorded():
    """Found by a fuzzer of replayed blocks against plain analysis, each a silent wrong answer:
    a region released before the block and written there in part read as zeros after it (the
    replay named its unwritten part as written at the block's fence); a release the recording
    did not make was not noticed (the read after it gave 0); a region the block only releases,
    with a reduction pending from before, kept it (and its buffer)."""
    with Runtime(cpus=1) as rt:
        x = rt.region((4,), "int64")
        rt.fill(x, 5)
        for i in range(4):
            if i == 3:
                rt.release(x)
            with rt.replay("half"):
                rt.fill(x, 1, Rect.make((0,), (2,)))
        with pytest.raises(RuntimeError, match=r"Rect\(2:4\) is read by .* that data is gone"):
            rt.read(x)
    with Runtime(cpus=1) as rt, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x = rt.region((4,), "int64")
        rt.fill(x, 5)
        for i in range(3):
            with rt.replay("sum"):
                if i == 2:
                    rt.release(x)   # not in the recording
                if i < 2:
                    assert rt.launch(_sum, req(x, READ)).get(timeout=30) == 20
                else:
                    with pytest.raises(RuntimeError, match=r"that data is gone"):
                        rt.launch(_sum, req(x, READ))
        assert "a release of 'region" in str(caught[-1].message) and "recording does not make there" in \
            str(caught[-1].message)
    with Runtime(cpus=1) as rt:
        x, y = rt.region((4,), "int64"), rt.region((4,), "int64")
        rt.fill(x, 5)
        for i in range(3):
            if i == 2:
                rt.launch(_add_one, req(x, Reduce("+")))   # pending at the block's release of x
            with rt.replay("fill and release"):
                rt.fill(y, i)
                rt.release(x)
            rt.fill(x, 7)
            assert rt.read(x).tolist() == [7] * 4
        rt.wait()
        assert not rt.store.buffers


def test_a_program_that_matches_its_recording_launch_by_launch_but_not_in_releases_is_not_adopted():
    """issue_program took a new launch list that matched the recorded one launch by launch as the
    recording's, releases and all: the first list's release of z was reissued every step after."""
    def total_into(dst, src):
        dst[...] = int(src.sum())
    with Runtime(cpus=1) as rt, warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplayMismatch)
        y, z = rt.region((4,), "int64"), rt.region((4,), "int64")
        rt.fill(y, 1)
        rt.fill(z, 2)
        add = Launch(_add_one, ((),), (req(y, Reduce("+")),), "add")
        total = Launch(total_into, ((),), (req(z, WRITE), req(y, READ)), "total")
        releasing = Launch(total_into, ((),), (req(z, WRITE), req(y, READ)), "total", releases=(z,))
        first, then = (add, releasing), (add, total)   # (the same list each time: reissued once adopted)
        for i in range(4):
            rt.issue_program("step", first if i == 0 else then, [(), ()])
            if i == 0:
                with pytest.raises(RuntimeError, match=r"that data is gone"):
                    rt.read(z)
            else:
                assert rt.read(z).tolist() == [4 * (i + 2)] * 4


@pytest.mark.parametrize("wait_first", [False, True])
def test_a_reduction_pending_at_a_release_is_dropped_with_the_data(wait_first):
    """Writing a region released with a reduction pending was refused: the write folded the
    reduction first, reading the data the release had let go. Its buffer goes, whether or not
    its task has run."""
    with Runtime(cpus=2) as rt:
        x = rt.region((6,), "int64")
        rt.fill(x, 5)
        rt.launch(lambda acc: acc.__iadd__(1), req(x, Reduce("+")))
        if wait_first:
            rt.wait()
        rt.release(x)
        rt.fill(x, 3)
        assert rt.read(x).tolist() == [3] * 6
        rt.wait()
        assert not rt.store.buffers and not rt.store._discarded
        # a reduction partly folded (into a sum on [1, 2)) when it is dropped: the issued fold keeps its part
        rt.launch(lambda acc: np.minimum(acc, 5, out=acc), req(x, Reduce("min")))
        rt.launch(lambda acc: acc.__iadd__(1), req(x, Reduce("+"), Rect.make((1,), (2,))))
        rt.release(x)
        rt.fill(x, 7)
        assert rt.read(x).tolist() == [7] * 6
        rt.wait()
        assert not rt.store.buffers and not rt.store._discarded
        with rt.replay("step"):   # a block that drops a pending reduction records again each time
            rt.launch(lambda acc: acc.__iadd__(1), req(x, Reduce("+")))
            rt.release(x)
        assert rt.analyzer.abstract(x.uid)[1] == () and not rt._recordings["step"].replayable


def test_max_and_min_reduce_bools_and_refuse_complex_numbers():
    with Runtime(cpus=2) as rt:
        flags = rt.region((4,), "bool")
        rt.fill(flags, False)
        halves = Partition.equal(flags, (2,))
        rt.index_launch(lambda buf: buf.__setitem__(0, True), halves, req(halves, Reduce("max")))
        assert rt.read(flags).tolist() == [True, False, True, False]
        rt.index_launch(lambda buf: buf.__setitem__(0, False), halves, req(halves, Reduce("min")))
        assert rt.read(flags).tolist() == [False, False, False, False]
        with pytest.raises(ValueError, match=r"Reduce\('max'\) needs an ordered dtype \(bool, ints or floats\), "
                                             r"got complex128"):
            req(rt.region((4,), "complex128"), Reduce("max"))   # (it failed inside the task)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"cpus": 1, "rank": 3}, ValueError, r"Runtime: rank 3 is not a rank of Machine\(1 ranks.*\(ranks 0..0\)"),
    ({"cpus": 1, "rank": True}, ValueError, r"Runtime: rank True is not a rank"),
    ({"machine": "x"}, TypeError, r"Runtime: machine must be a taskrt Machine, got str 'x'"),
    ({"cpus": 1, "mapper": "x"}, TypeError, r"Runtime: mapper must have select_processor"),
    ({"cpus": 2, "blas_threads": 1.5}, TypeError, r"Runtime: blas_threads must be an int, got float 1.5"),
    ({"cpus": 1, "trace": 5}, TypeError, r"Runtime: trace must be a path, True, False or None, got int 5"),
    ({"machine": Machine.build(2, 1)}, ValueError, r"Runtime: Machine\(2 ranks.*\) has 2 ranks, and a run on many ranks "
                                                  r"needs MPI: start it under mpiexec -n 2"),   # (rank 1's tasks hung)
    ({"cpus": 1, "execute": "no"}, TypeError, r"Runtime: execute must be True or False, got str 'no'"),
    ({"cpus": 2, "separate_memories": "yes"}, TypeError, r"Runtime: separate_memories must be True or False"),
    ({"cpus": 1, "keep_graph": 1}, TypeError, r"Runtime: keep_graph must be True or False, got int 1"),
])
def test_runtime_arguments_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        Runtime(**kwargs)


def test_a_gpu_without_cupy_is_refused_when_the_runtime_is_made():
    """GPU workers used to die on a machine without cupy, and tasks mapped there waited forever."""
    import importlib.util
    if importlib.util.find_spec("cupy") is None:
        with pytest.raises(RuntimeError, match=r"a GPU memory needs cupy"):
            Runtime(cpus=1, gpus=1)
    else:
        Runtime(cpus=1, gpus=1).shutdown()


@pytest.mark.parametrize("domain,error,match", [
    ([(0,), (0,)], ValueError, r"a launch domain lists point \(0,\) twice"),
    ([(0,), (0, 1)], TypeError, r"tuples of ints of one length, got \(0, 1\)"),
    ("ab", TypeError, r"a launch domain is a count, a Rect, a Partition or a list of points, got str 'ab'"),
    (True, TypeError, r"got bool True"),
    (2.5, TypeError, r"got float 2.5"),
    (-3, ValueError, r"a launch domain of -3 points: a launch needs at least one point"),   # (it said "empty")
    (10**9, ValueError, r"a launch domain of 1000000000 points: at most 1,048,576 points a launch"),   # (killed)
    (Rect((0, 0), (10**5, 10**5)), ValueError, r"a launch domain of Rect\(0:100000, 0:100000\): at most 1,048,576"),
    (Rect((0.0,), (2.0,)), TypeError, r"a launch domain's Rect has int bounds, got Rect\(0.0:2.0\)"),
])
def test_launch_domains_are_checked(domain, error, match):
    with Runtime(cpus=1) as rt:
        r = rt.region((4,))
        with pytest.raises(error, match=match):
            rt.index_launch(lambda v: 1, domain, req(r, READ))
        assert len(rt.index_launch(lambda v: 1, np.int64(2), req(r, READ)).get()) == 2


def _add_one_slowly_read(v):
    """v += 1 as a read, a switch and a write: a task that overlaps another on v loses an add."""
    old = v.copy()
    time.sleep(0)
    v[...] = old + 1


def _in_threads(*fns, timeout=60):
    """Run each fn in a thread of its own, Python's switch interval shortened so that they
    interleave finely; the errors they raised (None each where none)."""
    errors = [None] * len(fns)

    def run(i):
        try:
            fns[i]()
        except BaseException as e:   # (reported to the test)
            errors[i] = e
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in threads), "a thread hung"
    finally:
        sys.setswitchinterval(switch)
    return errors


def test_threads_that_issue_at_once_each_keep_their_program_order():
    """Two threads' launches on one region were analyzed against each other half done: of 2 x 400
    increments on two processors about a third were lost, silently; a replay block that fell back
    swapped the analyzer's id source under the other thread's launches (StopIteration, values
    wrong). Each launch is now issued whole under a lock, and a replay block holds it throughout."""
    with Runtime(cpus=2) as rt, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        x, y = rt.region((1,), "int64"), rt.region((1,), "int64")
        rt.fill(x, 0)
        rt.fill(y, 0)

        def adds(start):
            for k in range(400):
                rt.launch(_add_one_slowly_read, req(x, READ_WRITE), proc=(start + k) % 2)

        def blocks():
            for i in range(40):
                with rt.replay("y step"):
                    rt.launch(_add_one_slowly_read, req(y, READ_WRITE), proc=i % 2)
                    rt.launch(_add_one_slowly_read, req(x, READ_WRITE), proc=(i + 1) % 2)
                    if i % 3 == 2:   # one more launch than recorded: the block falls back
                        rt.launch(_add_one_slowly_read, req(y, READ_WRITE))
        assert _in_threads(lambda: adds(0), lambda: adds(1), blocks) == [None] * 3
        assert rt.read(x).tolist() == [840] and rt.read(y).tolist() == [53]
        assert all(issubclass(w.category, ReplayMismatch) for w in caught)


def test_a_thread_waiting_is_woken_by_a_shutdown_that_leaves_work_unrun():
    """shutdown(wait=False) from another thread stopped the workers under a waiting thread, which
    then waited forever."""
    rt = Runtime(cpus=1)
    x = rt.region((1,), "int64")
    rt.fill(x, 0)
    rt.launch(lambda v: time.sleep(0.5), req(x, READ_WRITE))
    rt.launch(_add_one_slowly_read, req(x, READ_WRITE))   # (left unrun)

    def shut():
        time.sleep(0.1)
        rt.shutdown(wait=False)
    waited, _ = _in_threads(lambda: rt.wait(), shut)
    assert isinstance(waited, RuntimeError) and "shutdown(wait=False) left 1 nodes unrun" in str(waited)


def test_a_task_function_that_cannot_take_its_views_and_args_is_refused_before_issue():
    """It failed in the worker, and the runtime stopped until recover."""
    with Runtime(cpus=1) as rt:
        r = rt.region((4,))
        rt.fill(r, 1.0)
        issued = rt.issued
        for fn, args, said in ((lambda v: 1, (2,), r"'<lambda>'\(v\) is given 1 region view\(s\) and 1 argument\(s\): "
                                                   r"too many positional arguments"),
                               (lambda v, scale: 1, (), r".*is given 1 region view\(s\) and 0 argument\(s\): missing a "
                                                        r"required argument: 'scale'"),
                               (lambda ctx, v, k: 1, (), r".*is given a context, 1 region view\(s\) and 0 argument")):
            with pytest.raises(TypeError, match=r"launch 'f': its task function " + said):
                rt.launch(fn, req(r, READ), args=args, name="f")
        with pytest.raises(TypeError, match=r"given 1 region view\(s\) and 2 argument"):   # (per point)
            rt.index_launch(lambda v, a: a, 2, req(r, READ), point_args={(0,): (1,), (1,): (1, 2)}, name="f")
        assert rt.issued == issued
        assert rt.launch(lambda *views_and_args: len(views_and_args), req(r, READ), args=(1, 2)).get(timeout=30) == 3
        assert rt.launch(lambda ctx, v, k=5: k + int(v.sum()), req(r, READ)).get(timeout=30) == 9


class _NamingMapper:
    """A mapper that answers with a processor's name."""

    def select_processor(self, machine, launch_name, point, domain, index):
        return "r0.cpu0"


def test_a_mapper_that_answers_with_no_processor_is_named():
    """It failed with AttributeError: 'str' object has no attribute 'rank', from deep inside."""
    with Runtime(cpus=1, mapper=_NamingMapper()) as rt:
        with pytest.raises(TypeError, match=r"launch 'f': the mapper _NamingMapper chose 'r0.cpu0' for point \(\): "
                                            r"select_processor returns one of the machine's Processors"):
            rt.launch(lambda: None, name="f")


def test_launch_arguments_and_timeouts_are_checked():
    with Runtime(cpus=1) as rt:
        r = rt.region((4,))
        for point_args, match in (({(0,): (1,)}, r"point_args has no arguments for points \[\(1,\)\]"),
                                  ({0: (1,), 1: (2,)}, r"no arguments for points \[\(0,\), \(1,\)\]"),
                                  ({(0,): 1, (1,): 2}, r"point_args\[\(0,\)\] must be a tuple of arguments")):
            with pytest.raises((TypeError, ValueError), match=match):
                rt.index_launch(lambda v, a: a, 2, req(r, READ), point_args=point_args)
        for args in (5, "xy"):   # "xy" used to be split into two arguments
            with pytest.raises(TypeError, match=rf"args must be a tuple of arguments, got {type(args).__name__}"):
                rt.launch(lambda v, a, b=0: a, req(r, READ), args=args)
        for timeout in ("1", -1, float("nan")):
            with pytest.raises(ValueError, match=r"timeout must be seconds >= 0 or None"):
                rt.launch(lambda: 1).get(timeout=timeout)
        assert rt.launch(lambda: 1).get(timeout=float("inf")) == 1   # (OverflowError from threading's wait)
        rt.launch(lambda: time.sleep(0.1))
        rt.wait(timeout=math.inf)
        with pytest.raises(TypeError, match=r"a projection maps a launch point to a color .*: a function, got int 5"):
            req(r.partition((2,)), READ, projection=5)


def test_data_calls_name_what_is_not_a_region():
    with Runtime(cpus=1) as rt:
        r = rt.region((4,))
        for call, what in ((lambda: rt.read(np.zeros(3)), "read"), (lambda: rt.fill("r", 0.0), "fill"),
                           (lambda: rt.attach("r", np.zeros(3)), "attach")):
            with pytest.raises(TypeError, match=rf"{what}: takes a Region, got"):
                call()
        with pytest.raises(TypeError, match=r"read: takes a Region \(a partition's pieces"):
            rt.read(r.partition((2,)))
        with pytest.raises(ValueError, match=r"read: rank '0' is not a rank of Machine"):
            rt.read(r, rank="0")
        with pytest.raises(ValueError, match=r"attach: the data for Region\('region\d+', float32\[4\]\) is not an "
                                             r"array of numbers: .*inhomogeneous"):
            rt.attach(r, [[1, 2], [3]])
    for call in (lambda: rt.release(r), lambda: rt.replay("step")):   # (both did nothing, silently)
        with pytest.raises(RuntimeError, match=r"Runtime.re(lease|play): the runtime has been shut down"):
            call()


def test_a_region_whose_data_another_open_runtime_holds_is_refused():
    """It used to read as zeros there, with no error."""
    with Runtime(cpus=1) as rt1, Runtime(cpus=1) as rt2:
        r = rt1.region((3,))
        rt1.fill(r, 7.0)
        with pytest.raises(ValueError, match=r"Region\('region\d+', float32\[3\]\) belongs to another Runtime that "
                                             r"is still open"):
            rt2.read(r)
        assert rt1.read(r).tolist() == [7.0] * 3
