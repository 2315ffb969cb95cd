"""The main demo on the local CPU: a tiled computation and a small network, both traced.

1. A 2-d heat-diffusion stencil on a grid split into tiles with one-cell halos (an aliased
   partition), run as index launches on several CPU processors with separate memories,
   so the runtime moves halos between memories by itself; the time loop is replayed; the
   result is checked against plain NumPy and the trace is written and summarized.
2. A small CNN (conv, batch norm, relu, pool, dense, softmax) learns a synthetic task
   through the model API: every operator runs as index launches, convolutions split
   over the batch and the image height (tiles with halos), each iteration replayed.

    python -m apps.demo [--cpus 4] [--size 512] [--steps 40] [--trace traces/demo.trace.jsonl]
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from taskrt import READ, WRITE, Partition, Rect, Runtime, req
from tools.trace_summary import format_summary, summarize
from taskrt.tracing import read_trace


def heat_step_numpy(u: np.ndarray) -> np.ndarray:
    p = np.pad(u, 1, mode="edge")
    return u + 0.2 * (p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4 * u)


def stencil(ctx, src, dst):
    """One step on a tile: `src` is the tile with its halo (rects[0]), `dst` the tile (rects[1])."""
    halo, tile = ctx.rects
    full = heat_step_numpy(src)
    off = [t - h for t, h in zip(tile.lo, halo.lo)]
    dst[...] = full[off[0]:off[0] + dst.shape[0], off[1]:off[1] + dst.shape[1]]


def halo_partition(region, tiles: Partition) -> Partition:
    rects = {}
    for color, r in tiles.rects.items():
        lo = [max(0, a - 1) for a in r.lo]
        hi = [min(s, b + 1) for b, s in zip(r.hi, region.shape)]
        rects[color] = Rect.make(lo, hi)
    return Partition(region, rects, name=f"{region.name}.halo")


def run(cpus: int, size: int, steps: int, trace: str) -> dict:
    rng = np.random.default_rng(0)
    u0 = rng.random((size, size))
    os.makedirs(os.path.dirname(trace) or ".", exist_ok=True)
    t0 = time.perf_counter()
    with Runtime(cpus=cpus, separate_memories=True, trace=trace) as rt:
        a, b = rt.region((size, size), "float64", "a"), rt.region((size, size), "float64", "b")
        rt.attach(a, u0)
        grid = (cpus, 2) if cpus > 1 else (2, 2)
        ta, tb = a.partition(grid), b.partition(grid)
        ha, hb = halo_partition(a, ta), halo_partition(b, tb)
        for _ in range(steps // 2):
            with rt.replay("two-steps"):
                rt.index_launch(stencil, ta, req(ha, READ), req(tb, WRITE), name="stencil_ab")
                rt.index_launch(stencil, tb, req(hb, READ), req(ta, WRITE), name="stencil_ba")
        result = rt.read(a)
        stats = dict(rt.replay_stats)
        rank, ranks, path = rt.rank, rt.num_ranks, rt.trace_path
        processors = describe_processors(rt.machine, rank)
    elapsed = time.perf_counter() - t0
    want = u0
    for _ in range(2 * (steps // 2)):
        want = heat_step_numpy(want)
    err = float(np.abs(result - want).max())
    _, events = read_trace(path)
    return {"elapsed_s": elapsed, "max_error": err, "replay": stats, "events": events, "trace": path,
            "rank": rank, "ranks": ranks, "processors": processors}


def describe_processors(machine, rank: int) -> str:
    """'4 CPU processors', or '4 CPU processors and 1 GPU' where the rank has GPUs (tiles go to those)."""
    procs = machine.rank_processors(rank)
    cpus, gpus = sum(p.kind == "cpu" for p in procs), sum(p.kind == "gpu" for p in procs)
    text = f"{cpus} CPU processor{'s' * (cpus != 1)}"
    return text + (f" and {gpus} GPU{'s' * (gpus != 1)}" if gpus else "")


def train_cnn(cpus: int, iterations: int, trace: str) -> dict:
    """A small CNN on synthetic images: class = which quadrant holds a bright blob."""
    from ops import Model, SGD, TileConfig

    rng = np.random.default_rng(1)
    n, batch = 512, 32
    labels = rng.integers(0, 4, n)
    images = rng.normal(0, 0.5, (n, 1, 16, 16)).astype(np.float32)
    for i, c in enumerate(labels):
        r, q = divmod(int(c), 2)
        images[i, 0, r * 8 + 2:r * 8 + 6, q * 8 + 2:q * 8 + 6] += 0.6
    rt = Runtime(cpus=cpus, trace=trace)
    m = Model(runtime=rt, seed=0)
    x = m.input((batch, 1, 16, 16), name="images")
    h = m.conv2d(x, 8, 3, padding=1, name="conv1")
    h = m.pool2d(m.relu(m.batch_norm(h, name="bn1")), 2, name="pool1")
    h = m.relu(m.conv2d(h, 16, 3, padding=1, name="conv2"))
    m.softmax(m.dense(m.flat(h), 4, name="fc"))
    split = min(cpus, 2)
    configs = {"conv1": TileConfig((split, 1, 2, 1)), "conv2": TileConfig((split, 1, 2, 1))}
    m.compile(optimizer=SGD(lr=0.1, momentum=0.9), loss="sparse_categorical_crossentropy",
              metrics=["accuracy"], configs=configs)
    t0 = time.perf_counter()
    history = m.fit(images, labels, iterations=iterations, verbose=False)
    elapsed = time.perf_counter() - t0
    stats = dict(rt.replay_stats)
    m.close()
    rt.shutdown()
    return {"loss_first": history.loss[0], "loss_last": history.loss[-1], "accuracy": history.accuracy[-1],
            "elapsed_s": elapsed, "replay": stats, "iterations": iterations,
            "trace": rt.trace_path}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="taskrt demo: a traced, replayed, tiled stencil")
    parser.add_argument("--cpus", type=int, default=4)
    parser.add_argument("--size", type=int, default=512)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--trace", default="traces/demo.trace.jsonl")
    parser.add_argument("--iterations", type=int, default=40, help="CNN training iterations")
    args = parser.parse_args(argv)
    out = run(args.cpus, args.size, args.steps, args.trace)
    # under mpiexec every rank runs the demo; rank 0 reports (its own rank's trace)
    say = print if out["rank"] == 0 else (lambda *a, **k: None)
    tasks = sum(e["kind"] == "task" for e in out["events"])
    copies = sum(e["kind"] != "task" for e in out["events"])
    where = out["processors"] + (f" on each of {out['ranks']} ranks" if out["ranks"] > 1 else "")
    say(f"heat stencil {args.size}x{args.size}, {args.steps} steps on {where} with separate memories: "
        f"{out['elapsed_s']:.2f} s")
    say(f"max |runtime - numpy| = {out['max_error']:.2e}; {tasks} tasks, {copies} copies; replay {out['replay']}")
    say(format_summary(summarize(out["events"])))
    say(f"trace written to {out['trace']}")
    if out["max_error"] > 1e-12:
        raise SystemExit("demo result differs from NumPy")
    cnn_trace = args.trace.replace(".trace.jsonl", "") + ".cnn.trace.jsonl"
    cnn = train_cnn(args.cpus, args.iterations, cnn_trace)
    say(f"\nsmall CNN, {cnn['iterations']} iterations of batch 32 on {where}: "
        f"{cnn['elapsed_s']:.2f} s; loss {cnn['loss_first']:.3f} -> {cnn['loss_last']:.3f}, "
        f"accuracy {cnn['accuracy']:.2f}; replay {cnn['replay']}")
    _, events = read_trace(cnn["trace"])
    say(format_summary(summarize(events)))
    say(f"trace written to {cnn['trace']}")
    if not cnn["loss_last"] < 0.5 * cnn["loss_first"]:
        raise SystemExit("the CNN did not learn")


if __name__ == "__main__":
    main()
