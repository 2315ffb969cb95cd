"""The GIL-free receive loop (taskrt/mpi_native.py) on its own, between ranks 0 and 1.

1. Rank 0 sends messages of many sizes (header + payload, as the transport does), more
   at once than the loop has slots; rank 1 hands each to the loop (or, when every slot is
   taken, receives it with mpi4py, as the transport falls back) and checks every byte and
   that each message finished exactly once.
2. A message longer than its receive (the loop napping between tests, as on a node
   without a core to spare): the loop stops on MPI's error, and `failed` gets the Op it
   belongs to and the error, as the transport's divergence report needs.
3. A receive whose message comes late: while waiting, the loop naps rather than spins.
Also: TASKRT_MPI_NATIVE=0 turns the loop off, and `available()` says so.

mpiexec -n 2; prints "OK rank R" at the end.
"""
from __future__ import annotations

import os
import threading
import time

import numpy as np
from mpi4py import MPI

from taskrt import mpi_native
from taskrt.mpi_native import SLOTS, NativeReceives

comm = MPI.COMM_WORLD
hdr, data = comm.Dup(), comm.Dup()
SIZES = [1, 8, 1000, 4096, 65536, 1 << 20, 3 << 20]
COUNT = 3 * SLOTS


def payload(i: int) -> np.ndarray:
    size = SIZES[i % len(SIZES)]
    return (np.arange(size, dtype=np.int64) * 7 + i).astype(np.uint8)


class Finished:
    def __init__(self):
        self.ops = []
        self.failures = []
        self.fatal = []
        self.cv = threading.Condition()

    def finish(self, op):
        with self.cv:
            self.ops.append(op)
            self.cv.notify_all()

    def failed(self, op, code):
        self.failures.append((op, MPI.Get_error_class(code)))

    def died(self, text):
        self.fatal.append(text)

    def wait(self, n, timeout=30.0):
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.ops) >= n, timeout), f"{len(self.ops)} of {n} finished"


def many_sizes() -> None:
    if comm.rank == 0:
        reqs = []
        for i in range(COUNT):
            body = payload(i)
            reqs += [hdr.Isend([np.array([i, 0, 0, body.nbytes], np.int64), MPI.INT64_T], 1, i),
                     data.Isend([body, MPI.BYTE], 1, i)]
        MPI.Request.Waitall(reqs)
        return
    seen = Finished()
    loop = NativeReceives("test", hdr, data, seen.finish, seen.failed, seen.died)
    buffers, fallback = {}, 0
    for i in range(COUNT):
        header, target = np.zeros(4, np.int64), np.empty(SIZES[i % len(SIZES)], np.uint8)
        buffers[i] = (header, target)
        if not loop.receive(i, header, target, 0, i):
            fallback += 1
            hdr.Recv([header, MPI.INT64_T], 0, i)
            data.Recv([target, MPI.BYTE], 0, i)
            seen.finish(i)
    seen.wait(COUNT)
    loop.stop()
    assert sorted(seen.ops) == list(range(COUNT)), "some message finished twice or never"
    assert 0 < fallback < COUNT - SLOTS + 1, f"{fallback} receives fell back; the loop has {SLOTS} slots"
    for i, (header, target) in buffers.items():
        assert list(header) == [i, 0, 0, target.nbytes], (i, header)
        assert np.array_equal(target, payload(i)), f"message {i} ({target.nbytes} bytes) differs"
    assert not seen.failures and not seen.fatal, (seen.failures, seen.fatal)


def too_long() -> None:
    if comm.rank == 0:
        big = np.ones(1 << 20, np.uint8)
        MPI.Request.Waitall([hdr.Isend([np.zeros(4, np.int64), MPI.INT64_T], 1, 7),
                             data.Isend([big, MPI.BYTE], 1, 7)])
        return
    seen = Finished()
    loop = NativeReceives("test", hdr, data, seen.finish, seen.failed, seen.died, spin=False)
    assert loop.receive("the short one", np.zeros(4, np.int64), np.empty(1 << 10, np.uint8), 0, 7)
    deadline = time.monotonic() + 20
    while not seen.failures and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.stop()
    assert not seen.fatal, seen.fatal
    assert [op for op, _ in seen.failures] == ["the short one"], seen.failures
    assert seen.failures[0][1] == MPI.ERR_TRUNCATE, seen.failures


def naps_while_waiting() -> None:
    if comm.rank == 0:
        time.sleep(1.5)
        MPI.Request.Waitall([hdr.Isend([np.zeros(4, np.int64), MPI.INT64_T], 1, 9),
                             data.Isend([np.ones(1 << 21, np.uint8), MPI.BYTE], 1, 9)])
        return
    seen = Finished()
    loop = NativeReceives("test", hdr, data, seen.finish, seen.failed, seen.died)
    target = np.zeros(1 << 21, np.uint8)
    cpu = time.process_time()
    assert loop.receive("late", np.zeros(4, np.int64), target, 0, 9)
    seen.wait(1)
    cpu = time.process_time() - cpu
    loop.stop()
    assert target.all() and seen.ops == ["late"]
    assert cpu < 0.45, f"waiting 1.5 s for one message took {cpu:.2f} s of CPU: the loop spins"


def main() -> None:
    assert comm.size == 2, "run on 2 ranks"
    why = mpi_native.available()
    assert why is None, f"the native loop cannot run here: {why}"
    os.environ["TASKRT_MPI_NATIVE"] = "0"
    assert mpi_native.available() == "TASKRT_MPI_NATIVE=0", "turning it off is not reported"
    del os.environ["TASKRT_MPI_NATIVE"]
    for case in (many_sizes, too_long, naps_while_waiting):
        case()
        comm.Barrier()
    print(f"OK rank {comm.rank}", flush=True)


if __name__ == "__main__":
    main()
