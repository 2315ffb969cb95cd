"""Regions across ranks: ordering through remote nodes, issuing far ahead, reductions,
read-back, halos, replay.

Every rank runs this program (mpiexec -n N, N >= 2) and checks what it reads back against
numpy; prints "OK rank R" at the end.
"""
from __future__ import annotations

import sys
import threading
from contextlib import nullcontext

import numpy as np

from taskrt import READ, READ_WRITE, WRITE, Partition, Rect, Reduce, Runtime, req
from taskrt.mpi import FRONTIER_MAX


def host(rt, r):
    return rt.machine.host_processor(r % rt.num_ranks)


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def war_through_a_remote_reader(rt):
    """W (rank 0) -WAR-> R (rank 1) -> copy 0->1: W must wait for the send to finish,
    though its only path to the send runs through a node of another rank."""
    n = 1 << 21
    big = rt.region((n,), "float64", "big")
    for k in range(1, 6):
        rt.fill(big, float(k))
        seen = rt.launch(lambda v: float(v.sum()), req(big, READ), proc=host(rt, 1), name="remote_reader")
        rt.launch(lambda v: v.fill(-1.0), req(big, WRITE), proc=host(rt, 0), name="overwriter")
        check(seen.get() == k * n, f"the reader on rank 1 saw {seen.get()}, not {k * n}: the overwrite on rank 0 "
                                   "did not wait for the send")
    check((rt.read(big) == -1.0).all(), "overwrite lost")


def reductions_across_ranks(rt):
    n = rt.num_ranks
    acc = rt.region((3,), "int64", "acc")
    rt.attach(acc, np.array([1, 2, 3]))
    points = 3 * n
    placement = {(i,): host(rt, i) for i in range(points)}
    rt.index_launch(lambda ctx, buf: buf.__iadd__(ctx.point[0] + 1), points, req(acc, Reduce("+")),
                    placement=placement, name="contribute")
    want = np.array([1, 2, 3]) + sum(range(1, points + 1))
    got = rt.read(acc)
    check(np.array_equal(got, want), f"sum across ranks: {got} != {want}")
    last = rt.read(acc, rank=n - 1)
    if rt.rank == n - 1:
        check(np.array_equal(last, want), f"read on rank {n - 1}: {last} != {want}")
    else:
        check(last is None, f"read(rank={n - 1}) gave {last!r} on rank {rt.rank}")
    # max into a sub-rect that lives on the last rank, from every rank
    rt.launch(lambda v: v.fill(0), req(acc, WRITE, Rect.make((1,), (3,))), proc=host(rt, n - 1))
    rt.index_launch(lambda ctx, buf: np.maximum(buf, 10 * ctx.point[0], out=buf), points,
                    req(acc, Reduce("max"), Rect.make((1,), (3,))), placement=placement, name="maximum")
    got = rt.read(acc, rank=0)
    if rt.rank == 0:
        check(np.array_equal(got, [want[0], 10 * (points - 1), 10 * (points - 1)]), f"max across ranks: {got}")
    # a float reduction folded on one rank, read everywhere as a Future
    f = rt.region((4, 4), "float64", "f")
    rt.fill(f, 0.5)
    rt.index_launch(lambda buf: buf.__iadd__(1.0), points, req(f, Reduce("+")), placement=placement)
    fut = rt.read(f, wait=False)
    check(np.array_equal(fut.get(), np.full((4, 4), 0.5 + points)), "float sum")


def smooth(a):
    p = np.pad(a, 1, mode="edge")
    return (p[:-2] + p[1:-1] + p[2:]) / 3


def halo_stencil(rt, steps, use_replay):
    """A 1-d stencil whose neighbouring tiles live on different ranks: every halo crosses."""
    n_tiles, size = 2 * rt.num_ranks, 40
    a, b = rt.region((size,), "float64", "a"), rt.region((size,), "float64", "b")
    start = np.sin(np.arange(size) * 0.37)
    rt.attach(a, start)
    rt.fill(b, 0.0)
    tiles_a, tiles_b = a.partition((n_tiles,)), b.partition((n_tiles,))
    halo = {c: Rect.make((max(0, r.lo[0] - 1),), (min(size, r.hi[0] + 1),)) for c, r in tiles_a.rects.items()}
    halo_a, halo_b = Partition(a, halo, "halo_a"), Partition(b, halo, "halo_b")
    check(halo_a.aliased, "the halo partition must be aliased")
    placement = {c: host(rt, c[0]) for c in tiles_a.colors()}

    def stencil(ctx, src, dst):
        lo = ctx.rects[1].lo[0] - ctx.rects[0].lo[0]
        dst[...] = smooth(src)[lo:lo + dst.shape[0]]

    for _ in range(steps):
        with (rt.replay("stencil") if use_replay else nullcontext()):
            rt.index_launch(stencil, tiles_b, req(halo_a, READ), req(tiles_b, WRITE), placement=placement)
            rt.index_launch(stencil, tiles_a, req(halo_b, READ), req(tiles_a, WRITE), placement=placement)
    want = start
    for _ in range(2 * steps):
        want = smooth(want)
    got = rt.read(a)
    check(np.array_equal(got, want), f"stencil (replay={use_replay}) differs by {np.abs(got - want).max()}")


def issued_far_ahead(rt, reps=400, ntiles=4):
    """Writes on rank 0 and reads on rank 1 of a few tiles in turn, all issued behind a closed
    gate: every remote node's local frontier must stay small (a remote node standing for
    many local ones is a Join), not grow with the chain issued before it, and the reads
    must still see every write."""
    tiles = [rt.region((64,), "int64", f"ahead{k}") for k in range(ntiles)]
    for t in tiles:
        rt.fill(t, 0)
    gate = threading.Event()
    rt.launch(lambda *views: gate.wait(), *[req(t, WRITE) for t in tiles], proc=host(rt, 0), name="gate")
    seen = []
    for i in range(reps):
        t = tiles[i % ntiles]
        rt.launch(lambda v: v.__iadd__(1), req(t, READ_WRITE), proc=host(rt, 0), name="write_ahead")
        seen.append(rt.launch(lambda v: int(v[0]), req(t, READ), proc=host(rt, 1), name="read_ahead"))
    transport, ex = rt.transport, rt.executor
    largest = max((len(f) for f in transport.router.frontier.values()), default=0)
    with ex.lock:  # the executor's threads (the MPI progress thread's submissions) change it too
        edges = sum(len(d) for d in ex.dependents.values())
    gate.set()
    check(largest <= FRONTIER_MAX, f"rank {rt.rank}: a remote node stands for {largest} local nodes")
    check(edges <= 8 * reps, f"rank {rt.rank}: {edges} executor edges for {reps} repetitions (quadratic?)")
    got = [f.get() for f in seen]
    want = [i // ntiles + 1 for i in range(reps)]
    check(got == want, f"reads issued ahead saw {got[:8]}..., not {want[:8]}...")


def main():
    with Runtime.from_mpi(cpus=1) as rt:
        check(rt.num_ranks >= 2, "run with mpiexec -n 2 or more")
        war_through_a_remote_reader(rt)
        issued_far_ahead(rt)
        reductions_across_ranks(rt)
        halo_stencil(rt, 6, use_replay=False)
        halo_stencil(rt, 6, use_replay=True)
        check(rt.replay_stats["replayed"] >= 4 and rt.replay_stats["mismatches"] == 0,
              f"replay stats {rt.replay_stats}")
    with Runtime.from_mpi(cpus=2, separate_memories=True) as rt:
        reductions_across_ranks(rt)
        halo_stencil(rt, 4, use_replay=True)
    print(f"OK rank {rt.rank}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
