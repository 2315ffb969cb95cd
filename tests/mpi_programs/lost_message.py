"""A copy whose message never comes (rank 0 drops its first send to rank 1, as a stand-in
for a runtime or MPI bug): the waiting ranks must give up after the no-progress timeout
with a message naming what they waited for, instead of hanging.

mpiexec -n N python lost_message.py TIMEOUT_S (N >= 2). Never prints "OK".
"""
from __future__ import annotations

import sys

import numpy as np

import taskrt.mpi_copies
from taskrt import READ, Runtime, req

_post_send = taskrt.mpi_copies.Copies.post_send
dropped = []


def drop_first_send(self, half):
    if not dropped and half.peer == 1:
        dropped.append(half.id)
        return None  # "sent": finishes at once, and rank 1 never gets it
    return _post_send(self, half)


taskrt.mpi_copies.Copies.post_send = drop_first_send


def main():
    with Runtime.from_mpi(cpus=1, timeout=float(sys.argv[1])) as rt:
        x = rt.region((16,), "float64", "x")
        rt.attach(x, np.arange(16.0))
        total = rt.launch(lambda v: float(v.sum()), req(x, READ), proc=rt.machine.host_processor(1))
        print(f"rank {rt.rank} got {total.get()}", flush=True)
    print(f"SHOULD NOT GET HERE rank {rt.rank}", flush=True)


if __name__ == "__main__":
    main()
