"""How close the simulator's predictions come to real runs: strategies of two tiny apps on 2 ranks.

    python bench/sim_accuracy.py [--apps mlp alexnet] [--iterations 12] [--budget 40] [--rounds 3]

For each app (tiny, on 2 MPI ranks of one CPU worker each, the `local` machine model with one
device a node, as apps/demo.py sets up): the four baselines, a searched strategy and two random
ones are trained for real (`mpiexec -n 2 python -m apps.NAME --strategy FILE`) `--rounds` times
each, taking turns, and simulated with the cost model as it is (measured kernels on this
machine, the local model's link and launch figures). A strategy's measured time is the median
over its runs of each run's median iteration after the warm-up: this machine's speed drifts
by a third within minutes. Printed per strategy: measured (and each run) and predicted
iteration time and the relative error; per app the mean error and Kendall's tau of the two
orderings. Targets: mean error at most 10%, tau at least 0.8. Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT

from apps.demo import machine_setup, search_strategy, train_mpi  # noqa: E402
from ops.strategy import Strategy  # noqa: E402
from strategies.baselines import BASELINES  # noqa: E402
from strategies.random import random_strategy  # noqa: E402
from strategies.search import app_graph  # noqa: E402
from strategies.simulator import Simulator  # noqa: E402


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a of two equally long lists: (concordant - discordant pairs) / pairs."""
    pairs = list(itertools.combinations(range(len(a)), 2))
    if not pairs:
        return 1.0
    score = sum((a[i] - a[j]) * (b[i] - b[j]) > 0 for i, j in pairs) - sum(
        (a[i] - a[j]) * (b[i] - b[j]) < 0 for i, j in pairs)
    return score / len(pairs)


def strategies_for(app: str, batch: int, setup, budget: int) -> dict[str, Strategy]:
    model, _ = app_graph(app, batch, tiny=True)
    machine = setup.machine_model.to_machine()
    out = {name: Strategy(app, dict(fn(model, machine).ops)) for name, fn in BASELINES.items()}
    out["searched"], _ = search_strategy(app, batch, setup, budget)
    for seed in (1, 2):
        out[f"random{seed}"] = Strategy(app, dict(random_strategy(model, machine, seed).ops))
    return out


def measure_app(app: str, batch: int, iterations: int, budget: int, rounds: int, out_dir: str) -> dict:
    """Each strategy trained `rounds` times, the strategies taking turns (forward, then backward, ...)
    so that the machine's drift falls on all of them alike; a strategy's measured time is the
    median over its runs of each run's median iteration."""
    setup = machine_setup(2, gpus=0)
    model, output = app_graph(app, batch, tiny=True)
    sim = Simulator.for_model(model, setup.machine_model, output=output)
    strategies = strategies_for(app, batch, setup, budget)
    paths = {}
    for name, strategy in strategies.items():
        paths[name] = os.path.join(out_dir, f"{app}.{name}.json")
        strategy.save(paths[name])
    runs: dict[str, list[float]] = {name: [] for name in strategies}
    for r in range(rounds):
        for name in (list(strategies) if r % 2 == 0 else list(strategies)[::-1]):
            report = train_mpi(app, setup, batch, iterations, ["--strategy", paths[name]],
                               os.path.join(out_dir, f"{app}.{name}.jsonl"))
            runs[name].append(report["median_iteration_s"])
    rows = {}
    for name, strategy in strategies.items():
        measured = float(np.median(runs[name]))
        predicted = sim.simulate(strategy).time
        rows[name] = {"measured_ms": round(measured * 1e3, 3), "runs_ms": [round(t * 1e3, 3) for t in runs[name]],
                      "predicted_ms": round(predicted * 1e3, 3),
                      "error": round(abs(predicted - measured) / measured, 4)}
        print(f"{app:8s} {name:9s} measured {measured * 1e3:8.2f} ms (runs {', '.join(f'{t * 1e3:.1f}' for t in runs[name])})"
              f"  predicted {predicted * 1e3:8.2f} ms  error {rows[name]['error']:6.1%}", flush=True)
    names = list(rows)
    tau = kendall_tau([rows[n]["measured_ms"] for n in names], [rows[n]["predicted_ms"] for n in names])
    mean_error = sum(r["error"] for r in rows.values()) / len(rows)
    return {"strategies": rows, "mean_error": round(mean_error, 4), "kendall_tau": round(tau, 3)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--apps", nargs="+", default=["mlp", "alexnet"])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--iterations", type=int, default=12)
    p.add_argument("--budget", type=int, default=40, help="search proposals for the searched strategy")
    p.add_argument("--rounds", type=int, default=3, help="runs of each strategy, taking turns")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: must be at least 1")
    out = {"bench": "sim_accuracy", "ranks": 2, "targets": {"mean_error": 0.1, "kendall_tau": 0.8}, "apps": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for app in args.apps:
            out["apps"][app] = measure_app(app, args.batch_size, args.iterations, args.budget, args.rounds, tmp)
            print(f"{app}: mean error {out['apps'][app]['mean_error']:.1%}, "
                  f"Kendall tau {out['apps'][app]['kendall_tau']:.2f}", flush=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
