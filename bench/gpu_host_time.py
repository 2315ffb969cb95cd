"""Whether our GPU steps are host-bound: for bench/ops.py cases (whole tile or a tile variant),
the host time to enqueue one forward + backward (no synchronize), cupyx's CPU and GPU times of
it, and a cProfile of a few steps (the calls with the most host time). Needs cupy.
Usage: python bench/gpu_host_time.py [--cases NAME[@PARTS] ...] [--profile N].
Last line: one JSON object (ms).
"""
from __future__ import annotations

import argparse
import cProfile
import importlib.util
import io
import json
import os
import pstats
import sys
import time

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path[0] = os.path.dirname(BENCH)  # the ops package, not bench/ops.py

#: case name @ tile variant label (bench/ops.py's), as the ops benchmark prints them
DEFAULT_CASES = ("conv_small_16", "conv_3x1", "conv_resnet3x3", "lstm_1024x40@batch/4", "batch_norm")


def _bench_ops():
    """bench/ops.py as a module (its cases and step builders)."""
    spec = importlib.util.spec_from_file_location("bench_ops", os.path.join(BENCH, "ops.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_ops"] = module
    spec.loader.exec_module(module)
    return module


def measure(bench, case, label: str | None, profile: int) -> dict:
    import cupy as cp
    from cupyx.profiler import benchmark
    inputs = [cp.asarray(x) for x in case.inputs]
    weights = {k: cp.asarray(v) for k, v in case.weights.items()}
    state = None if case.state is None else {k: cp.asarray(v) for k, v in case.state.items()}
    tile = None if label is None else bench.tile_rect(case.op, case.variants[label])
    step = bench.ours_fwd_bwd(cp, case.op, inputs, weights, state, tile)
    for _ in range(3):
        step()
    cp.cuda.Device().synchronize()
    enqueue = []
    for _ in range(10):
        t0 = time.perf_counter()
        step()
        enqueue.append(time.perf_counter() - t0)
        cp.cuda.Device().synchronize()
    timed = benchmark(step, n_repeat=20, n_warmup=2)
    out = {"enqueue": min(enqueue) * 1e3, "cpu": float(np.median(timed.cpu_times)) * 1e3,
           "gpu": float(np.median(timed.gpu_times)) * 1e3}
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(profile):
            step()
        cp.cuda.Device().synchronize()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
        print(text.getvalue(), file=sys.stderr)
    return {k: round(v, 3) for k, v in out.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES), help="NAME or NAME@VARIANT of bench/ops.py")
    parser.add_argument("--profile", type=int, default=10, help="steps under cProfile (0: none; default 10)")
    args = parser.parse_args(argv)
    if args.profile < 0:
        sys.exit(f"bench/gpu_host_time.py --profile: must be at least 0, got {args.profile}")
    from taskrt.machine import count_gpus
    if count_gpus() == 0:  # (make bench runs every benchmark; this one has nothing to time here)
        print(json.dumps({"bench": "gpu_host_time", "skipped": "no GPU visible through cupy"}))
        return
    from taskrt.heap import keep_freed_memory
    keep_freed_memory()
    bench = _bench_ops()
    by_name = {case.name: case for case in bench.cases(False)}
    results = {}
    for wanted in args.cases:
        name, _, label = wanted.partition("@")
        case = by_name.get(name)
        if case is None or (label and label not in case.variants):
            sys.exit(f"bench/gpu_host_time.py --cases: no case {wanted!r} in bench/ops.py "
                     f"(cases: {', '.join(by_name)}; variants as NAME@LABEL)")
        results[wanted] = measure(bench, case, label or None, args.profile)
        print(f"== {wanted}: {results[wanted]}", file=sys.stderr, flush=True)
    print(json.dumps({"bench": "gpu_host_time", "unit": "ms per forward + backward: enqueue (host, no sync), "
                      "cupyx cpu and gpu (medians)", "cases": results}))


if __name__ == "__main__":
    main()
