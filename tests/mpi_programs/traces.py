"""Per-rank traces: mpiexec -n N python traces.py PATH writes PATH.rank<r>.jsonl on every
rank (clock offsets against rank 0 in the meta); also checks the discovered machine.
Prints "OK rank R".
"""
from __future__ import annotations

import socket
import sys

import numpy as np
from mpi4py import MPI

from taskrt import READ, READ_WRITE, Machine, Runtime, req


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def main():
    comm = MPI.COMM_WORLD
    machine = Machine.discover(comm, cpus_per_rank=2)
    check(machine.num_ranks == comm.size and len(machine.processors) == 2 * comm.size,
          f"discovered {machine!r} on {comm.size} ranks")
    check(machine.hosts == tuple(socket.gethostname() for _ in range(comm.size)), f"hosts {machine.hosts}")
    check(all(p.kind == "cpu" for p in machine.processors), "no GPU without cupy")
    with Runtime.from_mpi(comm, cpus=1, trace=sys.argv[1]) as rt:
        n = rt.num_ranks
        x = rt.region((4 * n, 1000), "float64", "x")
        rt.fill(x, 1.0)
        part = x.partition((n, 1))
        for _ in range(3):
            rt.index_launch(lambda v: v.__iadd__(1.0), part, req(part, READ_WRITE), name="bump",
                            placement={(r, 0): rt.machine.host_processor(r) for r in range(n)})
        total = rt.launch(lambda v: float(v.sum()), req(x, READ), proc=rt.machine.host_processor(n - 1))
        check(total.get() == 4.0 * 4 * n * 1000, f"total {total.get()}")
        check(np.array_equal(rt.read(x), np.full((4 * n, 1000), 4.0)), "read back")
    print(f"OK rank {rt.rank}", flush=True)


if __name__ == "__main__":
    main()
