"""Bandwidth of the runtime's cross-rank copy against raw mpi4py Send/Recv, same run.

    mpiexec -n 2 python bench/copy_bandwidth.py [--max-mib 64] [--trials 3] [--tiles 4]

(`python bench/copy_bandwidth.py` alone, as `make bench` runs it, starts itself that way
with the mpiexec next to the Python.)

For each tile size, regions of that many bytes live on rank 0. One repetition is a task
on rank 0 that writes a tile (touching one byte, so the writer costs nothing) and a task
on rank 1 that reads it: the runtime copies the whole tile from rank 0 to rank 1 every
repetition, through a replayed block (`with rt.replay(...)`). Two ways:

- chain: one tile, so repetition i+1's write waits for repetition i's send to finish
  (write -> copy -> read -> write ...): one copy in flight, latency-bound;
- stream: `--tiles` tiles in turn, so up to that many copies are in flight, as when a
  program moves many tiles (the usual case): the copy path's bandwidth.

All repetitions are issued first, behind a gate task on rank 0; after a barrier the gate
opens, and the time runs until rank 1's last reader is done, so it is copies and their
dependences, not issuing. Times run from the first rank's start to the last rank's end on
rank 0's clock (the runtime measures each rank's offset at start-up): a rank that leaves
the starting barrier late, as rank 1 sometimes does while copies run, does not shorten them. The raw peer is mpi4py's blocking Send/Recv of numpy buffers of
the same size, repeated as often, through as many buffers in turn as the runtime uses
tiles (one for the chain, `--tiles` for the stream: from 4 MiB up, four buffers no longer
fit the caches the way one does, and that slows the copy itself). Best of `--trials` for
each. Rank 0 prints a table and, as the last line, one JSON object: `ratio_*` are stream /
raw through `--tiles` buffers, `chain_ratio_*` chain / raw through one.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from contextlib import nullcontext

import numpy as np

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # (bench/apps.py is not the apps)

from apps.cli import at_least  # noqa: E402
from taskrt import READ, READ_WRITE, Runtime, req  # noqa: E402
from taskrt.machine import mpi_world_size_from_env  # noqa: E402


def relaunch_on_two_ranks() -> None:
    """Started alone (as `make bench` does): run again under mpiexec -n 2 and exit. Importing
    mpi4py first would make this process an MPI singleton, so main() imports it."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    mpiexec = mpiexec if os.path.exists(mpiexec) else shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("bench/copy_bandwidth.py needs mpiexec (pip install mpich mpi4py)")
    sys.exit(subprocess.call([mpiexec, "-n", "2", sys.executable, os.path.abspath(__file__), *sys.argv[1:]]))

KiB, MiB = 1 << 10, 1 << 20


def label(size: int) -> str:
    return f"{size // MiB}MiB" if size >= MiB else f"{size // KiB}KiB"


def repetitions(size: int) -> int:
    return int(min(1000, max(20, (256 * MiB) // size)))


def span_seconds(comm, offset: float, t0: float, t1: float) -> float:
    """From the first rank's t0 to the last rank's t1, on rank 0's clock (`offset`: this
    rank's perf_counter minus rank 0's); the same on every rank."""
    spans = comm.allgather((t0 - offset, t1 - offset))
    return max(end for _, end in spans) - min(start for start, _ in spans)


def raw_seconds(comm, offset: float, bufs: list, reps: int) -> float:
    """Blocking Send/Recv from rank 0 to rank 1 of `bufs` in turn, `reps` times."""
    comm.Barrier()
    t0 = time.perf_counter()
    for i in range(reps):
        buf = bufs[i % len(bufs)]
        if comm.rank == 0:
            comm.Send(buf, 1, 11)
        elif comm.rank == 1:
            comm.Recv(buf, 0, 11)
    return span_seconds(comm, offset, t0, time.perf_counter())


def touch(view):
    view[:1] += 1  # an array op: wraps around silently


def look(view):
    return int(view[0])


def make_tiles(rt, size: int, ntiles: int) -> list:
    tiles = [rt.region((size,), "uint8", f"tile{size}_{k}") for k in range(ntiles)]
    for tile in tiles:
        rt.fill(tile, 0)
    return tiles


def runtime_seconds(rt, comm, tiles: list, reps: int, stream: bool) -> float:
    """Time `reps` write-on-rank-0 / read-on-rank-1 repetitions over `tiles` in turn
    (replayed blocks for the chain; plain launches for the stream, since a replay fence
    would order each block after everything before it)."""
    rank0, rank1 = rt.machine.host_processor(0), rt.machine.host_processor(1)
    rt.wait()
    comm.Barrier()
    gate = threading.Event()
    rt.launch(lambda *views: gate.wait(), *[req(t, READ_WRITE) for t in tiles], proc=rank0, name="gate")
    before = {k: None for k in range(len(tiles))}
    last = {}
    for i in range(reps):
        k = i % len(tiles)
        if k not in last:
            before[k] = rt.launch(look, req(tiles[k], READ), proc=rank1, name="start_value")
        block = nullcontext() if stream else rt.replay(f"chain{tiles[0].name}")
        with block:
            rt.launch(touch, req(tiles[k], READ_WRITE), proc=rank0, name="write_on_rank0")
            last[k] = rt.launch(look, req(tiles[k], READ), proc=rank1, name="read_on_rank1")
    comm.Barrier()
    t0 = time.perf_counter()
    gate.set()
    rt.wait()
    t = span_seconds(comm, rt.transport.clock_offset_s, t0, time.perf_counter())
    if rt.rank == 1:
        for k, fut in last.items():
            writes = len(range(k, reps, len(tiles)))
            want = (before[k].get() + writes) % 256
            assert fut.get() == want, f"rank 1 saw {fut.get()} after {writes} writes of tile {k}, not {want}"
    comm.Barrier()
    return t


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, checked (before the relaunch under mpiexec, so a bad one stops it at once)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-mib", type=at_least(1), default=64, help="the largest copy, in MiB")
    ap.add_argument("--trials", type=at_least(1), default=3)
    ap.add_argument("--tiles", type=at_least(1), default=4, help="tiles in turn in the stream measurement")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.size != 2:
        raise SystemExit(f"run with mpiexec -n 2 (got {comm.size} ranks)")
    sizes = [KiB << (2 * k) for k in range(12) if KiB << (2 * k) <= args.max_mib * MiB]
    results = {}
    with Runtime.from_mpi(comm, cpus=1) as rt:
        for size in sizes:
            reps = repetitions(size)
            tiles = make_tiles(rt, size, max(1, args.tiles))
            bufs = [np.ones(size, np.uint8) for _ in tiles]
            offset = rt.transport.clock_offset_s
            raw_seconds(comm, offset, bufs, len(bufs))  # warm up: touch every page once
            runtime_seconds(rt, comm, tiles, len(tiles), stream=True)
            raw1, raw, chain, stream = [], [], [], []
            for t in range(args.trials):  # interleaved, so that slow spells of the machine hit all four
                raw1.append(raw_seconds(comm, offset, bufs[:1], reps))
                raw.append(raw_seconds(comm, offset, bufs, reps))
                chain.append(runtime_seconds(rt, comm, tiles[:1], reps, stream=False))
                stream.append(runtime_seconds(rt, comm, tiles, reps, stream=True))
            raw1, raw, chain, stream = min(raw1), min(raw), min(chain), min(stream)  # the same on every rank

            def gbps(sec):
                return round(size * reps / sec / 1e9, 4)

            results[label(size)] = {"bytes": size, "reps": reps, "raw_GBps": gbps(raw), "raw_1buf_GBps": gbps(raw1),
                                    "stream_GBps": gbps(stream), "chain_GBps": gbps(chain),
                                    "ratio": round(raw / stream, 3), "chain_ratio": round(raw1 / chain, 3)}
    if comm.rank == 0:
        print(f"{'tile':>7} {'reps':>5} {'raw GB/s':>9} {'stream GB/s':>12} {'ratio':>6} "
              f"{'raw 1 buf':>10} {'chain GB/s':>11} {'ratio':>6}")
        for name, r in results.items():
            print(f"{name:>7} {r['reps']:>5} {r['raw_GBps']:>9.3f} {r['stream_GBps']:>12.3f} {r['ratio']:>6.2f} "
                  f"{r['raw_1buf_GBps']:>10.3f} {r['chain_GBps']:>11.3f} {r['chain_ratio']:>6.2f}")
        summary = {"bench": "copy_bandwidth", "ranks": comm.size, "stream_tiles": args.tiles,
                   "ratio_1MiB": results.get("1MiB", {}).get("ratio"),
                   "ratio_64MiB": results.get("64MiB", {}).get("ratio"),
                   "chain_ratio_1MiB": results.get("1MiB", {}).get("chain_ratio"),
                   "chain_ratio_64MiB": results.get("64MiB", {}).get("chain_ratio"), "sizes": results}
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    if mpi_world_size_from_env() == 1:
        parse_args()
        relaunch_on_two_ranks()
    main()
