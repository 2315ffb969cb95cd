"""GPU tiles across ranks: copies, reductions and a model whose tiles live on GPUs and CPUs of
different ranks give the sequential (or one-process) numbers.

Local rank 0 of the node takes GPU 0 (Machine.discover's default, one GPU per local rank
where cupy sees one), so on a one-GPU machine rank 0 has a GPU and the others only CPUs.
A mapper that deals point i to processor i mod P puts neighbouring tiles in GPU memory on
one rank and host memory on another: every copy between them goes GPU -> host -> MPI ->
host (-> GPU). Run by tests/test_gpu.py; needs a GPU.

mpiexec -n N (N >= 2); prints "OK rank R" at the end.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ops import TileConfig
from taskrt import Runtime
from tests import test_runtime as tr
from tests.mpi_programs.model import assert_matches_one_process, build_and_train
from tests.mpi_programs.random_programs import draw_programs
from tests.test_gpu import Spread


def main() -> None:
    comm = MPI.COMM_WORLD
    programs = comm.bcast(draw_programs(12) if comm.rank == 0 else None, root=0)
    with Runtime.from_mpi(cpus=1, separate_memories=True, mapper=Spread()) as rt:
        kinds = [(p.rank, p.kind) for p in rt.machine.processors]
        assert (0, "gpu") in kinds, f"rank 0 has no GPU: {rt.machine!r} {kinds}"
        for prog in programs:
            tr.check_program(rt, prog, where=f"rank {rt.rank}: ")

        rng = np.random.default_rng(7)
        images = rng.standard_normal((32, 1, 8, 8)).astype(np.float32)
        labels = rng.integers(0, 3, 32)
        n = len(rt.machine.processors)
        # tile i of each split op on processor i mod P: GPU and CPU tiles on different ranks
        configs = {name: TileConfig(degrees, tuple(i % n for i in range(int(np.prod(degrees)))))
                   for name, degrees in [("conv1", (2, 1, 2, 1)), ("conv2", (2, 1, 2, 1)), ("fc", (1, 3, 1))]}
        losses, params = build_and_train(rt, configs, images, labels, iterations=4)
        rank = rt.rank
    if rank == 0:
        assert_matches_one_process(losses, params, {}, images, labels, 4, loss_tol=(1e-4, 1e-6),
                                   param_tol=(1e-3, 1e-5))
    print(f"OK rank {rank}", flush=True)


if __name__ == "__main__":
    main()
