"""An app run whose flags differ on rank 1: every rank must stop at once with one line naming the
flag, instead of training a model no rank asked for (another --lr) or waiting in MPI's start for a
rank that ended alone (a flag only rank 1 cannot parse).

mpiexec -n N python app_flags.py MODE (N >= 2), MODE one of:
  lr   - rank 1 trains with --lr 2.0;
  bad  - rank 1 is given --iterations abc.
Never prints "OK".
"""
from __future__ import annotations

import sys

from apps import mlp
from taskrt.machine import mpi_rank_from_env

extra = {"lr": ["--lr", "2.0"], "bad": ["--iterations", "abc"]}[sys.argv[1]]
mlp.main(["--tiny", "--iterations", "2"] + (extra if mpi_rank_from_env() == 1 else []))
print("SHOULD NOT GET HERE", flush=True)
