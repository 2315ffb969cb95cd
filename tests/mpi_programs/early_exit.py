"""Rank 1's program ends with its runtime open (never shut down) while rank 0 goes on: rank 0
must stop within seconds, naming rank 1, not after its no-progress timeout.

mpiexec -n N (N >= 2) early_exit.py MODE, MODE one of
- read: rank 0 then reads a region whose tiles rank 1 was to write;
- shutdown: rank 0 shuts down (the barrier waits for every rank).
Never prints "OK".
"""
from __future__ import annotations

import sys

from taskrt import WRITE, Runtime, req


def main(mode: str):
    rt = Runtime.from_mpi(cpus=1)
    x = rt.region((4 * rt.num_ranks,), "float64", "x")
    rt.fill(x, 1.0)
    rt.wait()
    if rt.rank == 1:
        return   # the program ends here on rank 1, its runtime open
    if mode == "read":
        part = x.partition((rt.num_ranks,))
        rt.index_launch(lambda tile: tile.fill(2.0), part, req(part, WRITE),
                        placement={(r,): rt.machine.host_processor(r) for r in range(rt.num_ranks)})
        print(f"rank {rt.rank} read {rt.read(x).sum()} without rank 1", flush=True)
    rt.shutdown()
    print(f"SHOULD NOT GET HERE rank {rt.rank}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
