"""A program whose launches depend on the rank: every rank must stop with an error that
names where the ranks diverged, instead of waiting for each other forever.

mpiexec -n N python divergence.py MODE (N >= 2), MODE one of:
  extra   - rank 1 makes one launch more, in the middle of the program;
  fewer   - rank 1 stops launching early (its last launches are missing);
  other   - rank 1 makes a different launch (same number of launches);
  wait    - rank 1 makes an extra launch that moves no data, then every rank calls wait();
  end     - rank 1 makes an extra launch that moves no data just before shutting down;
  late    - rank 0 makes an extra launch that moves no data after rank 1 has shut down (rank 0
            went on with its program past the shutdown: it had compared rank 1's final count
            when it had made as many launches, and never again);
  size    - rank 1 makes its region half as long: the tiles rank 0 sends it (64 KiB and
            more, so through the compiled receive loop) do not fit;
  small   - the same with tiles of a few bytes, which MPI sends at once (a receive that finds
            its message there already raised MPI's error from the issuing thread);
  get     - rank 1 makes an extra launch, then rank 0 gets the value of a task on rank 1: the
            task numbers differ, so rank 1 holds no Future of the one asked for;
  lr      - the same model on every rank, compiled with another learning rate on rank 1: the
            same launches with other values, which trained a mix of both rates.
Never prints "OK".
"""
from __future__ import annotations

import sys
import time

import numpy as np

from taskrt import READ, READ_WRITE, Runtime, req


def double(v):
    v *= 2


def only_on_rank_1(v):
    v += 100


def everyone(v):
    v += 1


def only_on_rank_0(v):
    v += 10


def quiet(mode):
    """Divergences no copy header can show: only the checkpoints at wait() and shutdown do."""
    with Runtime.from_mpi(cpus=1) as rt:
        mine = rt.region((4,), "float64", "mine")
        here = rt.machine.host_processor(1)
        rt.launch(everyone, req(mine, READ_WRITE), proc=here)
        if rt.rank == 1 and mode != "late":
            rt.launch(only_on_rank_1, req(mine, READ_WRITE), proc=here)
        if mode == "wait":
            rt.wait()
            rt.launch(everyone, req(mine, READ_WRITE), proc=here)
            rt.wait()
        if mode == "late" and rt.rank == 0:
            time.sleep(1.0)   # rank 1's shutdown checkpoint arrives first
            rt.launch(only_on_rank_0, req(mine, READ_WRITE), proc=here)
    print(f"SHOULD NOT GET HERE rank {rt.rank}", flush=True)


def pulled():
    """A value asked of a rank whose launches differ: its divergence report, not 'no longer holds'."""
    with Runtime.from_mpi(cpus=1) as rt:   # (tasks that move no data: no copy header shows it)
        if rt.rank == 1:
            rt.launch(lambda: "only on rank 1", proc=rt.machine.host_processor(0))
        value = rt.launch(lambda: 42, proc=rt.machine.host_processor(1)).get()
        print(f"rank {rt.rank} got {value}", flush=True)
    print(f"SHOULD NOT GET HERE rank {rt.rank}", flush=True)


def hyperparameters():
    """An optimizer whose learning rate depends on the rank: its update launches say so."""
    from ops.model import Model
    from ops.optimizers import SGD
    with Runtime.from_mpi(cpus=1) as rt:
        m = Model(rt, seed=0)
        m.dense(m.input((4, 3), name="x"), 2)
        m.compile(SGD(lr=0.1 * (1 + rt.rank)))
        m.fit({"x": np.ones((4, 3), "float32")}, np.zeros(4, "int64"), iterations=2, verbose=False)
    print(f"SHOULD NOT GET HERE rank {rt.rank}", flush=True)


def main():
    mode = sys.argv[1]
    if mode in ("wait", "end", "late"):
        return quiet(mode)
    if mode == "get":
        return pulled()
    if mode == "lr":
        return hyperparameters()
    with Runtime.from_mpi(cpus=1) as rt:
        n = rt.num_ranks
        length = {"size": (8192 if rt.rank == 1 else 16384) * n, "small": (4 if rt.rank == 1 else 8) * n}.get(mode, 4 * n)
        x = rt.region((length,), "float64", "x")
        rt.attach(x, np.arange(float(length)))
        part = x.partition((n,))
        rt.index_launch(double, part, req(part, READ_WRITE))
        if mode == "extra" and rt.rank == 1:
            rt.launch(only_on_rank_1, req(x, READ_WRITE))
        if mode == "other" and rt.rank == 1:
            rt.index_launch(only_on_rank_1, part, req(part, READ_WRITE))
        else:
            rt.index_launch(everyone, part, req(part, READ_WRITE))
        if not (mode == "fewer" and rt.rank == 1):
            rt.launch(lambda v: float(v.sum()), req(x, READ), proc=rt.machine.host_processor(n - 1))
            rt.index_launch(everyone, part, req(part, READ_WRITE))
        got = rt.read(x)
        print(f"rank {rt.rank} read {got}", flush=True)
    print(f"SHOULD NOT GET HERE rank {rt.rank}", flush=True)


if __name__ == "__main__":
    main()
