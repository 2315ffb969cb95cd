"""What the search finds: predicted iteration times of the baselines and of the searched strategy.

    python bench/search_quality.py [--quick] [--budget N] [--only APP ...] [--machines M ...]

For the six networks of the FlexFlow paper (AlexNet, Inception-v3, ResNet-101, RNN text
classification, RNN language model, NMT) on 4, 8 and 16 P100s (1, 2 and 4 nodes of the p100
model) and 16, 32 and 64 K80s (4, 8 and 16 nodes of the k80 model), batch 64 per GPU
(AlexNet 256): the simulated iteration time of every baseline (data parallel with sharded
weight synchronization, model, expert and tensor parallel), of the strategy the MCMC search
finds with `--budget` proposals, and the speedup of the searched over the best baseline,
beside the paper's range (1.3 to 3.3 times over data parallel and expert on five of six
networks; ResNet-101 about equal to data parallel). Each network trained with its app's
optimizer (SGD with momentum; Adam for the recurrent apps: `app_simulator`), analytic costs
(these devices are not here). `--quick` runs the tiny configurations on the smallest machine of each cluster.
Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT

from apps.cli import at_least  # noqa: E402
from strategies.baselines import BASELINES  # noqa: E402
from strategies.cost import CostModel  # noqa: E402
from strategies.machine_model import load_machine  # noqa: E402
from strategies.search import app_simulator, finite_or_none, search  # noqa: E402

APPS = ("alexnet", "inception_v3", "resnet101", "rnntc", "rnnlm", "nmt")
#: (machine model, nodes): the paper's clusters at three sizes each
MACHINES = (("p100", 1), ("p100", 2), ("p100", 4), ("k80", 4), ("k80", 8), ("k80", 16))
#: proposals a search: at 200 (until session 57) the recurrent networks' searches stopped short
#: (RNN-LM at most 1.11x the best baseline, 1.20x at 1,000; NMT 1.42x, 1.44x); all 36 searches
#: at 1,000 take about 9 minutes on the 2-core VM (docs/search.md, session 57)
BUDGET = 1000
PAPER = "1.3x to 3.3x over data parallel and expert on five of six networks; ResNet-101 about equal to data parallel"
PAPER_RANGE = (1.3, 3.3)   # the searched strategy's speedup over data parallelism in the paper


def _rounded(x: float, digits: int) -> float | None:
    """x rounded for the JSON line; None where it is not finite (a strategy that fits no device)."""
    x = finite_or_none(x)
    return None if x is None else round(x, digits)


def one(app: str, machine: str, nodes: int, budget: int, tiny: bool, seed: int) -> dict:
    mm = load_machine(machine, nodes=nodes)
    per_gpu = 256 if app == "alexnet" else 64
    batch = (16 if tiny else per_gpu) * mm.num_devices
    model, sim = app_simulator(app, mm, batch, tiny, CostModel(mm, measured=False))
    t0 = time.perf_counter()
    result = search(sim, budget, seed=seed, model=model)
    row = {"app": app, "machine": f"{machine}x{nodes}", "devices": mm.num_devices, "batch": batch,
           "optimizer": sim.optimizer.kind,
           "baselines_ms": {k: _rounded(v * 1e3, 4) for k, v in result.baselines.items()},
           "searched_ms": _rounded(result.best_time * 1e3, 4),
           "speedup_over_best_baseline": _rounded(result.speedup_over_baselines(), 3),
           "speedup_over_data": _rounded(result.baselines["data"] / result.best_time, 3),
           "proposals": result.proposals, "accepted": result.accepted, "seconds": round(time.perf_counter() - t0, 1)}
    if not math.isfinite(result.best_time):   # why: what data parallelism would need of each device
        peak, _ = sim.memory(BASELINES["data"](model, sim.machine))
        row["data_parallel_peak_gib"] = round(max(peak.values()) / 2**30, 2)
        row["device_gib"] = round(mm.device.mem_bytes / 2**30, 2)
    return row


def _cell(ms: float | None, width: int) -> str:
    return f"{ms:>{width}.3f}" if ms is not None else f"{'-':>{width}}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny configurations, the smallest machine of each cluster")
    p.add_argument("--budget", type=at_least(1), default=None,
                   help=f"proposals per search (default {BUDGET}; 20 with --quick)")
    p.add_argument("--only", nargs="*", choices=APPS, default=None, help="networks")
    p.add_argument("--machines", nargs="*", default=None, help="entries like p100x2 or k80x16")
    p.add_argument("--seed", type=at_least(0), default=0)
    args = p.parse_args(argv)
    budget = args.budget or (20 if args.quick else BUDGET)
    machines = MACHINES
    if args.machines:
        try:
            machines = tuple((m.split("x")[0], int(m.split("x")[1])) for m in args.machines)
        except (IndexError, ValueError):
            sys.exit(f"bench/search_quality.py --machines: entries look like p100x2, got {args.machines}")
    elif args.quick:
        machines = (("p100", 1), ("k80", 4))
    for machine, nodes in machines:   # every machine checked before the first search
        try:
            load_machine(machine, nodes=nodes)
        except ValueError as e:   # (MachineError among them)
            sys.exit(f"bench/search_quality.py --machines: {machine}x{nodes}: {e}")
    rows = []
    print(f"{'network':<14}{'machine':<10}{'data':>10}{'model':>10}{'expert':>10}{'tensor':>10}{'searched':>10}"
          f"{'speedup':>9}  (ms, - where it does not fit; speedup over the best baseline)", file=sys.stderr)
    for app in args.only or APPS:
        for machine, nodes in machines:
            row = one(app, machine, nodes, budget, args.quick, args.seed)
            rows.append(row)
            b = row["baselines_ms"]
            speedup = row["speedup_over_best_baseline"]
            line = (f"{app:<14}{row['machine']:<10}" + "".join(_cell(b.get(k), 10) for k in ("data", "model", "expert",
                                                                                           "tensor"))
                    + _cell(row["searched_ms"], 10) + (f"{speedup:>8.2f}x" if speedup is not None else f"{'-':>9}"))
            if "data_parallel_peak_gib" in row:
                line += (f"  nothing fits: data parallelism needs {row['data_parallel_peak_gib']:.1f} GiB a device "
                         f"of {row['device_gib']:.1f}")
            print(line, file=sys.stderr, flush=True)
    over_data = [r["speedup_over_data"] for r in rows if r["speedup_over_data"] is not None]
    out = {"bench": "search_quality", "budget": budget, "tiny": args.quick, "paper": PAPER,
           "paper_speedup_over_data": list(PAPER_RANGE),
           "in_paper_range": sum(PAPER_RANGE[0] <= x <= PAPER_RANGE[1] for x in over_data),
           "above_paper_range": sum(x > PAPER_RANGE[1] for x in over_data), "results": rows}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
