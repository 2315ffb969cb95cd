"""Each rank's threads on its share of the node's cores while its Runtime runs, and back on
every core after: prints one JSON line a rank ({"rank", "during", "after", "node_cores"}; the
distinct core sets of the process's threads), then "OK rank R".

mpiexec -n N (N >= 2).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

from taskrt import READ_WRITE, Runtime, req
from taskrt.cores import node_cores


def threads_cores() -> list[list[int]]:
    """The distinct core sets of this process's threads, as sorted lists."""
    return sorted({tuple(sorted(os.sched_getaffinity(int(tid)))) for tid in os.listdir("/proc/self/task")})


def main():
    with Runtime(cpus=1) as rt:
        x = rt.region((4,), "float64", "x")
        rt.attach(x, np.zeros(4))
        rt.launch(lambda v: v.__iadd__(1.0), req(x, READ_WRITE), proc=rt.machine.host_processor(rt.num_ranks - 1))
        rt.wait()
        during = threads_cores()
        cores = node_cores()
        rank = rt.rank
    # both lines in one write: print writes the newline apart, and mpiexec may put another
    # rank's output between a line and its newline
    report = json.dumps({"rank": rank, "during": during, "after": threads_cores(), "node_cores": cores})
    sys.stdout.write(f"{report}\nOK rank {rank}\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
