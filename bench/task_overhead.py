"""Per-task overhead of taskrt against dask's threaded scheduler, and parallel speedup.

Three graphs of empty tasks, the same for both systems: independent tasks, a chain, and
repeated index launches of 64 points (each point depending on the same point of the
launch before). taskrt is measured with full dependence analysis and with replay.
Then a tiled single-threaded-BLAS workload on 2 processors against 1.
Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext

import numpy as np
from threadpoolctl import threadpool_limits

from taskrt import READ, READ_WRITE, Runtime, req

N_SINGLE = 4000
LAUNCHES, POINTS = 60, 64
REPEATS = 3


def noop(*args):
    return None


def best(fn, repeats=REPEATS):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


# ---- taskrt -----------------------------------------------------------------------------
def taskrt_graphs(cpus: int, replay: bool):
    rt = Runtime(cpus=cpus, gpus=0)
    chain_region = rt.region((1,), "float64", "chain")
    tiles = rt.region((POINTS, 4), "float64", "tiles")
    part = tiles.partition((POINTS, 1))
    block = 100 if replay else None

    def independent():
        for start in range(0, N_SINGLE, block or N_SINGLE):
            with (rt.replay("independent") if replay else nullcontext()):
                for _ in range(block or N_SINGLE):
                    rt.launch(noop)
        rt.wait()

    def chain():
        for start in range(0, N_SINGLE, block or N_SINGLE):
            with (rt.replay("chain") if replay else nullcontext()):
                for _ in range(block or N_SINGLE):
                    rt.launch(noop, req(chain_region, READ_WRITE))
        rt.wait()

    def index():
        for _ in range(LAUNCHES // 2 if replay else 1):
            with (rt.replay("index") if replay else nullcontext()):
                for _ in range(2 if replay else LAUNCHES):
                    rt.index_launch(noop, part, req(part, READ_WRITE))
        rt.wait()

    out = {
        "independent": best(independent) / N_SINGLE * 1e6,
        "chain": best(chain) / N_SINGLE * 1e6,
        "index64": best(index) / (LAUNCHES * POINTS) * 1e6,
    }
    rt.shutdown()
    return out


# ---- dask -------------------------------------------------------------------------------
def dask_graphs(cpus: int):
    import dask
    from dask.threaded import get

    independent = {f"t{i}": (noop,) for i in range(N_SINGLE)}
    chain = {"c0": (noop,)}
    chain.update({f"c{i}": (noop, f"c{i - 1}") for i in range(1, N_SINGLE)})
    index = {}
    for k in range(LAUNCHES):
        for p in range(POINTS):
            index[f"i{k}_{p}"] = (noop, f"i{k - 1}_{p}") if k else (noop,)
    with dask.config.set(num_workers=cpus):
        return {
            "independent": best(lambda: get(independent, list(independent), num_workers=cpus)) / N_SINGLE * 1e6,
            "chain": best(lambda: get(chain, [f"c{N_SINGLE - 1}"], num_workers=cpus)) / N_SINGLE * 1e6,
            "index64": best(lambda: get(index, [f"i{LAUNCHES - 1}_{p}" for p in range(POINTS)],
                                        num_workers=cpus)) / (LAUNCHES * POINTS) * 1e6,
        }


# ---- parallel speedup -------------------------------------------------------------------
def tiled_matmul_time(cpus: int, tiles: int = 8, rows: int = 1024, n: int = 384, reps: int = 6) -> float:
    rng = np.random.default_rng(0)
    with Runtime(cpus=cpus, gpus=0, blas_threads=1) as rt:
        a = rt.region((tiles * rows, n), "float64", "a")
        c = rt.region((tiles * rows, n), "float64", "c")
        b = rt.region((n, n), "float64", "b")
        rt.attach(a, rng.standard_normal((tiles * rows, n)))
        rt.attach(b, rng.standard_normal((n, n)) / n)
        pa, pc = a.partition((tiles, 1)), c.partition((tiles, 1))

        def kernel(a_tile, b_full, c_tile):
            x = a_tile
            for _ in range(reps):
                x = x @ b_full
            c_tile[...] = x

        rt.index_launch(kernel, pa, req(pa, READ), req(b, READ), req(pc, READ_WRITE))
        rt.wait()

        def run():
            for _ in range(3):
                rt.index_launch(kernel, pa, req(pa, READ), req(b, READ), req(pc, READ_WRITE))
            rt.wait()

        return best(run)


def raw_threads_speedup(tiles: int = 8, rows: int = 1024, n: int = 384, reps: int = 6) -> float:
    """The same work on two plain Python threads: the ceiling this machine allows."""
    import threading
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((tiles * rows, n)), rng.standard_normal((n, n)) / n

    def work(tile_ids):
        for i in tile_ids:
            x = a[i * rows:(i + 1) * rows]
            for _ in range(reps):
                x = x @ b

    def two_threads():
        ts = [threading.Thread(target=work, args=(range(k * tiles // 2, (k + 1) * tiles // 2),)) for k in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

    with threadpool_limits(limits=1, user_api="blas"):
        return best(lambda: work(range(tiles))) / best(two_threads)


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)   # --help; no flags
    cpus = 2
    ours = taskrt_graphs(cpus, replay=False)
    ours_replay = taskrt_graphs(cpus, replay=True)
    theirs = dask_graphs(cpus)
    print(f"{'graph':<14}{'taskrt us/task':>16}{'replayed':>12}{'dask us/task':>15}")
    for g in ours:
        print(f"{g:<14}{ours[g]:>16.1f}{ours_replay[g]:>12.1f}{theirs[g]:>15.1f}")
    t1, t2 = tiled_matmul_time(1), tiled_matmul_time(2)
    raw = raw_threads_speedup()
    print(f"tiled matmul: 1 proc {t1 * 1e3:.1f} ms, 2 procs {t2 * 1e3:.1f} ms, speedup {t1 / t2:.2f} "
          f"(two plain threads on the same work: {raw:.2f})")

    def mean(d):
        return sum(d.values()) / len(d)

    result = {
        "bench": "task_overhead",
        "taskrt_us": round(mean(ours), 2),
        "taskrt_replay_us": round(mean(ours_replay), 2),
        "dask_us": round(mean(theirs), 2),
        "ratio": round(mean(ours) / mean(theirs), 3),
        "replay_ratio": round(mean(ours_replay) / mean(theirs), 3),
        "speedup_2proc": round(t1 / t2, 3),
        "speedup_2threads_raw": round(raw, 3),
        "per_graph": {g: {"taskrt": round(ours[g], 2), "replay": round(ours_replay[g], 2), "dask": round(theirs[g], 2)}
                      for g in ours},
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
