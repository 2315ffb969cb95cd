"""A task raises on rank 1 while the other ranks wait for its data: every rank must exit
non-zero within seconds, with rank 1's message and traceback on stderr.

mpiexec -n N (N >= 2). Never prints "OK".
"""
from __future__ import annotations

import time

import numpy as np

from taskrt import WRITE, Runtime, req


def explode_on_rank_1(ctx, tile):
    tile[...] = 1.0
    if ctx.processor.rank == 1:
        time.sleep(0.2)  # the other ranks are waiting for this tile by now
        raise ZeroDivisionError(f"boom in tile {ctx.point} on purpose")


def main():
    with Runtime.from_mpi(cpus=1) as rt:
        x = rt.region((8 * rt.num_ranks,), "float64", "x")
        part = x.partition((rt.num_ranks,))
        rt.index_launch(explode_on_rank_1, part, req(part, WRITE),
                        placement={(r,): rt.machine.host_processor(r) for r in range(rt.num_ranks)})
        got = rt.read(x)
        print(f"rank {rt.rank} read {np.asarray(got).sum()} although a task failed", flush=True)
    print(f"SHOULD NOT GET HERE rank {rt.rank}", flush=True)


if __name__ == "__main__":
    main()
