"""Futures of tasks that ran on other ranks: get() everywhere, as arguments, in FutureMaps.
Uses a plain Runtime(), which detects mpiexec by itself.

mpiexec -n N (N >= 2); prints "OK rank R" at the end.
"""
from __future__ import annotations

import time

import numpy as np

from taskrt import READ, READ_WRITE, Runtime, req


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def main():
    # a plain Runtime() under mpiexec with more than one rank is a replicated one
    with Runtime(cpus=1) as rt:
        n = rt.num_ranks
        check(rt.transport is not None and n >= 2, f"Runtime() under mpiexec: {rt!r}")
        host = [rt.machine.host_processor(r) for r in range(n)]
        last = host[n - 1]
        x = rt.region((6,), "float64", "x")
        rt.attach(x, np.arange(6.0))

        # a value computed on the last rank, read on every rank
        total = rt.launch(lambda v: float(v.sum()), req(x, READ), proc=last, name="total")
        check(total.get() == 15.0, f"total on rank {rt.rank}: {total.get()}")

        # got at once, the Future dropped at once (the owner must keep the value for the others)
        for k in range(5):
            got = rt.launch(lambda ctx, k: (ctx.processor.rank, k * k), args=(k,), proc=host[k % n]).get()
            check(got == (k % n, k * k), f"chained get {k}: {got}")

        # a Future as the argument of tasks on other ranks (pushed to them)
        rt.launch(lambda v, t: v.__imul__(t), req(x, READ_WRITE), args=(total,), proc=host[0], name="scale")
        fm = rt.index_launch(lambda ctx, t: (ctx.processor.rank, t + ctx.point[0]), n, args=(total,),
                             placement={(r,): host[r] for r in range(n)}, name="everyone_gets_total")
        check(fm.get() == {(r,): (r, 15.0 + r) for r in range(n)}, f"futures as arguments: {fm.get()}")
        check(np.array_equal(rt.read(x), np.arange(6.0) * 15.0), "scaled by a remote future")

        # array values, a chain of futures hopping across ranks
        arr = rt.launch(lambda: np.arange(5) * 2, proc=last)
        hop = arr
        for k in range(2 * n):
            hop = rt.launch(lambda a, k: a + k, args=(hop, k), proc=host[k % n], name=f"hop{k}")
        check(np.array_equal(hop.get(), np.arange(5) * 2 + sum(range(2 * n))), f"hops: {hop.get()}")
        check(np.array_equal(arr.get(), np.arange(5) * 2), "array future")

        # done() of a remote task's future turns true once its value has arrived
        late = rt.launch(lambda: "late", proc=last, name="late")
        while not late.done():
            time.sleep(0.001)
        check(late.get() == "late", "done() then get()")

        # a FutureMap over every rank, asked for all at once
        sums = rt.index_launch(lambda ctx, v: float(v.sum()) + ctx.point[0], x.partition((n,)),
                               req(x.partition((n,)), READ), placement={(r,): host[r] for r in range(n)})
        scaled = np.arange(6.0) * 15.0
        want = {c: float(scaled[rect.slices()].sum()) + c[0] for c, rect in x.partition((n,)).rects.items()}
        check(sums.get() == want, f"FutureMap: {sums.get()} != {want}")
        check(all(sums[r].done() for r in range(n)), "a fetched future is done")
    print(f"OK rank {rt.rank}", flush=True)


if __name__ == "__main__":
    main()
