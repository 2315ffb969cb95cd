"""A rank that waits a long time for a busy peer's message must not spin a core meanwhile.

Rank 0 computes for WAIT_S (a sleeping task) before it writes a tile that the last rank
reads, so the last rank's receive is in flight the whole time. The progress thread waits
inside MPI (spinning) only while there is activity; after SPIN_S of quiet it polls with
naps. The last rank's whole process may use at most a fraction of the wait in CPU time.

mpiexec -n N (N >= 2); prints "OK rank R" at the end.
"""
from __future__ import annotations

import time

from taskrt import READ, WRITE, Runtime, req

WAIT_S = 1.5
#: CPU seconds per second of waiting allowed to the waiting rank (a spinning thread uses 1)
MAX_CPU_SHARE = 0.3


def compute_then_write(view):
    time.sleep(WAIT_S)
    view[:] = 7.0


def main():
    with Runtime.from_mpi(cpus=1) as rt:
        first, last = rt.machine.host_processor(0), rt.machine.host_processor(rt.num_ranks - 1)
        tile = rt.region((1 << 18,), "float64", "tile")  # 2 MiB: a message MPI moves by CMA
        rt.fill(tile, 0.0)
        rt.wait()
        # wait() is not a barrier: without one, the last rank may start its clock after rank 0's
        # task has begun, and measure less than the task's WAIT_S (seen: 1.33 s for 1.5)
        rt.transport.world.Barrier()
        cpu0, wall0 = time.process_time(), time.monotonic()
        rt.launch(compute_then_write, req(tile, WRITE), proc=first, name="compute_then_write")
        total = rt.launch(lambda v: float(v.sum()), req(tile, READ), proc=last, name="total")
        rt.wait()
        cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
        if rt.rank == rt.num_ranks - 1:
            if total.get() != 7.0 * tile.shape[0]:
                raise AssertionError(f"rank {rt.rank} read {total.get()}, not {7.0 * tile.shape[0]}")
            if wall < WAIT_S * 0.9:
                raise AssertionError(f"rank {rt.rank} waited only {wall:.2f} s for a {WAIT_S} s task")
            if cpu > MAX_CPU_SHARE * wall:
                raise AssertionError(f"rank {rt.rank} used {cpu:.2f} s of CPU while it waited {wall:.2f} s for "
                                     f"rank 0: something spins (allowed {MAX_CPU_SHARE:.0%})")
            print(f"rank {rt.rank}: {cpu:.3f} s of CPU in {wall:.2f} s of waiting", flush=True)
    print(f"OK rank {rt.rank}", flush=True)


if __name__ == "__main__":
    main()
