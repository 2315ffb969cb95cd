"""The random-program property of tests/test_runtime.py on every rank of an MPI run.

Rank 0 draws a fixed set of programs with the same hypothesis strategy (derandomized, so
every run checks the same programs) and broadcasts them; every rank runs each program on
a replicated Runtime and compares the arrays it reads back (whole, on every rank) and
every point task's result (fetched from the rank that ran it) with the sequential
reference, and ten of them again issued three times over as one program (Runtime.issue_program).
Prints "OK rank R" when all match.

Usage: mpiexec -n N python random_programs.py [examples]
"""
from __future__ import annotations

import sys

from hypothesis import HealthCheck, Phase, given, settings
from mpi4py import MPI

from taskrt import Runtime
from tests import test_runtime as tr  # the program generator and the sequential reference


def draw_programs(count: int) -> list:
    drawn = []

    @settings(max_examples=count, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(prog=tr.programs())
    def collect(prog):
        drawn.append(prog)

    collect()
    return drawn


def main() -> None:
    comm = MPI.COMM_WORLD
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    programs = comm.bcast(draw_programs(count) if comm.rank == 0 else None, root=0)
    checked = 0
    for cpus, separate in [(1, False), (2, True)]:
        with Runtime.from_mpi(cpus=cpus, separate_memories=separate) as rt:
            for prog in programs:
                tr.check_program(rt, prog, where=f"rank {rt.rank} (cpus={cpus}, separate={separate}): ")
                checked += 1
    with Runtime.from_mpi(cpus=2, separate_memories=True) as rt:
        for prog in programs[:10]:   # issued again and again as one program (reissued whole)
            tr.check_program(rt, prog, repeat=3, replay="program", where=f"rank {rt.rank} (program): ")
            checked += 1
        if rt.replay_stats["reissued"] == 0:
            raise AssertionError(f"rank {rt.rank}: no program was reissued: {rt.replay_stats}")
    print(f"OK rank {comm.rank}: {checked} programs on {comm.size} ranks", flush=True)


if __name__ == "__main__":
    main()
