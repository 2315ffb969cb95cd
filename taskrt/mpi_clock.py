"""Clock offsets between ranks, measured once at start-up so that traces share rank 0's clock.

Rank 0 ping-pongs each other rank `rounds` times and keeps the round with the smallest
round trip: the peer's `perf_counter` read in the middle of it, minus the midpoint of rank
0's, is the peer's offset (error at most half that round trip). Rank 0 then sends each
rank its offset, round trip and trace origin, and the wall-clock time its trace began, which
every rank's trace names as its run (`run` in the meta: tools.trace will not merge the ranks of
two runs). Owns no state after it returns; a ClockSync holds the result.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from .mpi_progress import wait_request

PING_TAG = 7
RESULT_TAG = 8


@dataclass(frozen=True)
class ClockSync:
    """This rank's perf_counter minus rank 0's (`offset_s`) and the round trip it was measured over."""

    offset_s: float = 0.0
    rtt_s: float = 0.0
    rounds: int = 0


def sync_clocks(comm, tracer, rounds: int = 8) -> ClockSync:
    """Measure this rank's offset against rank 0 on `comm` (collective) and set `tracer`'s
    clock offset and clock-sync metadata from it when there is a tracer."""
    clock = time.perf_counter
    msg = np.zeros(4)
    sync = ClockSync(rounds=rounds)
    run = tracer.wall_origin if tracer is not None else 0.0
    if comm.rank == 0:
        origin0 = tracer.origin if tracer is not None else 0.0
        for r in range(1, comm.size):
            best = (float("inf"), 0.0)
            for _ in range(rounds):
                t0 = clock()
                wait_request(comm.Isend(msg, r, PING_TAG))
                wait_request(comm.Irecv(msg, r, PING_TAG))
                t1 = clock()
                if t1 - t0 < best[0]:
                    best = (t1 - t0, msg[0] - (t0 + t1) / 2)
            wait_request(comm.Isend(np.array([best[1], best[0], origin0, run]), r, RESULT_TAG))
    else:
        for _ in range(rounds):
            wait_request(comm.Irecv(msg, 0, PING_TAG))
            msg[0] = clock()
            wait_request(comm.Isend(msg, 0, PING_TAG))
        wait_request(comm.Irecv(msg, 0, RESULT_TAG))
        sync = ClockSync(float(msg[0]), float(msg[1]), rounds)
        origin0, run = float(msg[2]), float(msg[3])
        if tracer is not None:
            # an event at perf_counter t here is at t - offset on rank 0's clock
            tracer.clock_offset = (tracer.origin - sync.offset_s - origin0) * 1e6
    if tracer is not None:
        tracer.meta.update({"num_ranks": comm.size, "run": run, "clock_sync": {
            "reference_rank": 0, "offset_us": round(sync.offset_s * 1e6, 3),
            "min_rtt_us": round(sync.rtt_s * 1e6, 3), "rounds": rounds}})
    return sync
