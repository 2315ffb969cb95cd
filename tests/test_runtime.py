"""The runtime against a sequential reference: random programs, reductions, futures, errors."""
from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from taskrt import (READ, READ_WRITE, WRITE, Machine, Partition, Rect, Reduce, ReplayMismatch, Runtime,
                    TaskError, req)

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
    _, partitions = build(lambda s: _FakeRegion(s), shapes, parts)
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


class _FakeRegion:
    """Just enough of a Region for building partitions in the sequential reference."""

    _uid = 10**9

    def __init__(self, shape):
        from taskrt import Region
        self._r = Region(shape, "int64")

    def __getattr__(self, name):
        return getattr(self._r, name)


def run_runtime(rt, shapes, parts, steps, replay_twice=False):
    regions, partitions = build(lambda s: rt.region(s, "int64"), shapes, parts)
    for region, shape in zip(regions, shapes):
        rt.attach(region, np.arange(np.prod(shape), dtype=np.int64).reshape(shape) % 13)
    futures = []
    for kind, r, p, src, k in steps:
        part = partitions[r][p]
        reqs = [req(part, PRIVS[kind])]
        if src is not None:
            src_part = partitions[src[0]][src[1]]
            if len(src_part.colors()) == len(part.colors()):
                reqs.append(req(src_part, READ, projection=ByIndex(part, src_part)))
        if len(reqs) == 2 and reqs[1].region is reqs[0].region and PRIVS[kind] is not READ:
            # a task may not read and write overlapping data of one region: read a copy instead
            reqs = reqs[:1]
        futures.append(rt.index_launch(KERNELS[kind], part, *reqs, args=(k,)))
    arrays = [rt.read(region) for region in regions]
    return arrays, [fm.get() for fm in futures]


def _same_steps(steps, shapes, parts):
    """Drop the source of steps whose reference would pair colors the runtime would not."""
    out = []
    for kind, r, p, src, k in steps:
        if src is not None and src[0] == r and kind != "read":
            src = None
        out.append((kind, r, p, src, k))
    return out


@pytest.mark.parametrize("cpus,separate", [(1, False), (2, False), (4, False), (2, True), (4, True)])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prog=programs())
def test_random_programs_match_sequential(cpus, separate, prog):
    shapes, parts, steps = prog
    steps = _same_steps(steps, shapes, parts)
    want_arrays, want_results = run_sequential(shapes, parts, steps)
    with Runtime(cpus=cpus, separate_memories=separate) as rt:
        got_arrays, got_results = run_runtime(rt, shapes, parts, steps)
    for got, want in zip(got_arrays, want_arrays):
        np.testing.assert_array_equal(got, want)
    assert got_results == want_results
