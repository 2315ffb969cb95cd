"""The runtime's own overheads on this machine now: a probe of empty tasks under mpiexec.

The local machine model's runtime figures (a task's launch overhead, a message's handling)
are the runtime's Python and its threads' wake-ups, whose speed moves on a shared VM. The
probe measures them as they are, so that a run's times can be read beside them
(bench/sim_accuracy.py takes one before each round):

- `chain`: seconds a task of a dependent chain of empty tasks on each rank's worker, every
  rank running its own chain at once (what a task of a data-parallel step costs besides its
  kernel);
- `pingpong`: seconds a hop of one chain of empty tasks that alternates between the ranks,
  each task waiting on the previous one's write on the other rank (a task plus a message
  between ranks and its handling);
- `issue`: seconds of a rank's main thread a node of its share of a program issued again
  (Runtime.issue_program, as the apps issue each training step), from a program of CHAIN
  launches of one empty task on each rank. The main thread issues the step after next on a
  core the rank's worker uses, so a step's issue is time the worker loses (docs/accuracy.md,
  session 46).

Each is the median over blocks of CHAIN tasks, issued as replay blocks as the apps' steps
are (`issue`: each rank's median, the slowest rank's taken). `python -m strategies.probe
[--ranks R]` (or `measure_overheads`) runs it under mpiexec and prints the JSON.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from taskrt.cores import cores_problem
from taskrt.mpiexec import run_module_json

#: tasks a block (per rank for the chain, in all for the ping-pong), blocks timed, blocks of warm-up
CHAIN, BLOCKS, WARMUP = 50, 10, 2


def _empty(v):
    return None


def probe(rt) -> dict[str, float]:
    """Run the probes on runtime `rt` (every rank calls it): {'issue': s, 'chain': s, 'pingpong': s}."""
    from taskrt import READ_WRITE, req

    ranks = rt.num_ranks
    procs = [rt.machine.host_processor(r) for r in range(ranks)]
    own = [rt.region((4,), "float32", f"probe_chain{r}") for r in range(ranks)]
    shared = rt.region((4,), "float32", "probe_pingpong")
    launches = {
        "chain": lambda k: [rt.launch(_empty, req(own[r], READ_WRITE), proc=procs[r]) for r in range(ranks)],
        "pingpong": lambda k: rt.launch(_empty, req(shared, READ_WRITE), proc=procs[k % ranks]),
    }
    out = {}
    out["issue"] = _issue(rt, procs)
    for name, launch in launches.items():
        times = []
        for block in range(WARMUP + BLOCKS):
            rt.wait()
            t0 = time.perf_counter()
            with rt.replay(f"probe_{name}"):
                for k in range(CHAIN):
                    launch(k)
            rt.wait()
            if block >= WARMUP:
                times.append((time.perf_counter() - t0) / CHAIN)
        out[name] = float(np.median(times))
    return out


def _issue(rt, procs) -> float:
    """The `issue` probe: main-thread seconds a node of this rank's share of a program of CHAIN
    launches (one empty task on each rank each), issued again after its recording; the largest
    over the ranks."""
    from taskrt import READ_WRITE, req
    from taskrt.program import Launch

    ranks = rt.num_ranks
    own = rt.region((4 * ranks,), "float32", "probe_issue").partition((ranks,))
    placement = {color: procs[color[0]] for color in own.colors()}
    program = tuple(Launch(_empty, tuple(own.colors()), (req(own, READ_WRITE),), f"probe_issue{k}", placement)
                    for k in range(CHAIN))
    args = [()] * CHAIN
    times = []
    for block in range(WARMUP + BLOCKS):
        rt.wait()
        t0 = time.thread_time()
        rt.issue_program("probe_issue", program, args)
        if block >= WARMUP:
            times.append((time.thread_time() - t0) / CHAIN)
    rt.wait()
    mine = float(np.median(times))
    return max(rt.transport.world.allgather(mine)) if rt.transport is not None else mine


def measure_overheads(ranks: int = 2, timeout: float = 120) -> dict[str, float]:
    """The probe on `ranks` MPI ranks of one CPU worker each (as the apps run under
    apps.demo.machine_setup), run under this environment's mpiexec; RuntimeError with its
    output if it fails."""
    if ranks < 2:
        raise ValueError(f"measure_overheads: the ping-pong needs at least 2 ranks, got ranks={ranks}")
    return run_module_json(ranks, "strategies.probe", ["--ranks", str(ranks), "--child"], timeout)


def main(argv=None) -> None:
    from tools import LineParser
    p = LineParser(prog="python -m strategies.probe", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2, help="MPI ranks (one CPU worker each)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ranks < 2:
        p.error(f"argument --ranks: {args.ranks} must be >= 2 (the ping-pong runs between two ranks)")
    too_few_cores = None if args.child else cores_problem(args.ranks)
    if too_few_cores is not None:   # it measures ranks on cores of their own, as the apps run
        p.error(f"argument --ranks: {too_few_cores}")
    if not args.child:
        print(json.dumps(measure_overheads(args.ranks)))
        return
    from taskrt import Runtime

    with Runtime.from_mpi(cpus=1) as rt:
        if rt.num_ranks != args.ranks:
            raise SystemExit(f"strategies.probe: --ranks {args.ranks} but mpiexec started {rt.num_ranks}")
        found = probe(rt)
        if rt.rank == 0:
            print(json.dumps(found), flush=True)


if __name__ == "__main__":
    main()
