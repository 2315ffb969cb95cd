"""Fit the local machine model's runtime figures to real runs here: python -m apps.calibrate.

The simulator charges the runtime's own costs (a task's launch, a message's handling and its
time in flight, kernels slowed by the rank's other threads) from five figures of the machine
model, and on a shared machine those move from hour to hour (docs/accuracy.md). This measures
them now:

1. A tiny app's four baselines and `--random` random strategies are trained for real, under
   mpiexec on `--ranks` ranks of one CPU worker each, taking turns for `--rounds` rounds.
   Before each round, every kernel of the strategies and the batch source are measured afresh.
2. strategies/overheads.py fits the five figures to the runs: the grid point whose simulated
   iteration times come closest to the measured ones, the grid going on past a figure's largest
   value where the best point takes it (a slow machine's runtime). The kernel slowdown is held at the
   machine file's unless `--fit-slowdown`: the transformer's runs are mostly the runtime's own
   time and do not tell it from a message's flight (docs/accuracy.md, session 36).
3. It prints the fitted figures with their mean error and Kendall tau, beside the machine
   file's own figures' error. With `--write`, it writes the fitted figures into the machine
   file (`runtime_fitted` says what they were fitted on).

    python -m apps.calibrate [--app transformer] [--ranks 2] [--rounds 2] [--iterations 20]
                             [--random 2] [--machine local] [--fit-slowdown] [--write]
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from datetime import date
from pathlib import Path

import numpy as np

from apps.cli import APPS, DefaultsHelp, at_least
from apps.demo import Setup, train_mpi
from ops.strategy import Strategy
from strategies.baselines import BASELINES
from strategies.cost import CostModel, read_cache, write_cache
from strategies.machine_model import MachineError, load_machine, write_fields, write_problem
from strategies.overheads import FIT_GRID, LinearTimes, figures_of, fit_figures, held_kernel, score
from strategies.random import random_strategy
from strategies.search import app_graph, app_optimizer, app_simulator, app_source
from strategies.simulator import SimResult
from taskrt.cores import cores_problem
from taskrt.outputs import output_problem
from tools import LineParser

#: the batch of the calibration runs (the tiny apps' own)
BATCH = 16
#: the cost cache measure_strategies leaves in its folder: each kernel's median over the rounds
COSTS_FILE = "costs.json"


def calibration_strategies(app: str, batch: int, setup: Setup, seeds) -> dict[str, Strategy]:
    """The tiny app's four baselines and a random strategy for each of `seeds`, by name."""
    model, _ = app_graph(app, batch, tiny=True)
    machine = setup.machine_model.to_machine()
    out = {name: Strategy(app, dict(fn(model, machine).ops)) for name, fn in BASELINES.items()}
    for seed in seeds:
        out[f"random{seed}"] = Strategy(app, dict(random_strategy(model, machine, seed).ops))
    return out


def predict(app: str, batch: int, strategies: dict[str, Strategy], machine_model, per_sample: float,
            costs: str | None = None) -> dict[str, float]:
    """The simulated iteration time of each strategy of the tiny app on `machine_model`, its source
    tasks taking `per_sample` seconds a sample, its kernels' times from the cost cache file `costs`
    (default: the shared one), measured into it where missing."""
    return {name: r.time for name, r in simulate(app, batch, strategies, machine_model, per_sample, costs).items()}


def simulate(app: str, batch: int, strategies: dict[str, Strategy], machine_model, per_sample: float,
             costs: str | None = None) -> dict[str, SimResult]:
    """predict's simulations themselves (their traces compare with the runs')."""
    cost = CostModel(machine_model, cache_path=costs)
    cost.source_per_sample = per_sample
    _, sim = app_simulator(app, machine_model, batch, tiny=True, cost=cost)
    return {name: sim.simulate(strategy) for name, strategy in strategies.items()}


def source_per_sample(app: str, batch: int, machine_model, ranks: int = 2) -> float:
    """Seconds a sample of the tiny app's batch source takes here (CostModel.measure_source), at a
    rank's share of the batch over `ranks` ranks."""
    model, _ = app_graph(app, batch, tiny=True)
    return CostModel(machine_model).measure_source(app_source(app, model, tiny=True), -(-batch // ranks))


def merge_median_costs(paths: list[str], out: str) -> None:
    """Add to the cost cache `out` each kernel of the caches `paths` with its median seconds over them."""
    tables = [read_cache(Path(path)) for path in paths]
    write_cache(Path(out), {key: {**entry, "seconds": float(np.median([t[key]["seconds"] for t in tables if key in t]))}
                            for key, entry in tables[0].items()})


def measured_time(runs: list[float]) -> float:
    """A strategy's measured iteration time from its runs (each a run's median iteration): the
    fastest. Other work on a shared machine only ever adds time to a run, and the simulator
    predicts the undisturbed one (the fastest of three fitted four bench runs closer than their
    median did: docs/accuracy.md, session 37)."""
    if not runs:
        raise ValueError("measured_time: no runs to take the time of")
    return float(min(runs))


def measure_strategies(app: str, batch: int, iterations: int, strategies: dict[str, Strategy], setup: Setup,
                       rounds: int, out_dir: str, before_round=None) -> dict:
    """Each strategy trained `rounds` times, the strategies taking turns (forward, then backward, ...)
    so that the machine's drift falls on all of them alike; before each round the batch source
    and every kernel of the strategies measured afresh (and `before_round()` called, its answers
    kept). Each strategy's file and trace are written in `out_dir`. Returns {"runs": name -> each
    run's median iteration (s), "per_sample": the median round's source seconds a sample,
    "costs": a cost cache file of each kernel's median over the rounds, "before": the answers
    of before_round}."""
    paths = {}
    for name, strategy in strategies.items():
        paths[name] = os.path.join(out_dir, f"{app}.{name}.json")
        strategy.save(paths[name])
    runs: dict[str, list[float]] = {name: [] for name in strategies}
    before, sources, kernels = [], [], []
    for r in range(rounds):
        if before_round is not None:
            before.append(before_round())
        sources.append(source_per_sample(app, batch, setup.machine_model, setup.ranks))
        kernels.append(os.path.join(out_dir, f"costs.{app}.round{r}.json"))
        predict(app, batch, strategies, setup.machine_model, sources[-1], kernels[-1])   # measures every kernel
        for name in (list(strategies) if r % 2 == 0 else list(strategies)[::-1]):
            report = train_mpi(app, setup, batch, iterations, ["--strategy", paths[name]],
                               os.path.join(out_dir, f"{app}.{name}.jsonl"))
            runs[name].append(report["median_iteration_s"])
    costs = os.path.join(out_dir, COSTS_FILE)
    merge_median_costs(kernels, costs)
    return {"runs": runs, "per_sample": float(np.median(sources)), "costs": costs, "before": before}


def calibrate(app: str, setup: Setup, rounds: int, iterations: int, seeds, out_dir: str, say=print,
              fit_slowdown: bool = False) -> dict:
    """Measure the app's calibration strategies (measure_strategies) and fit the runtime figures
    to them: {"figures", "mean_error", "kendall_tau", "shipped": the machine model's own figures
    with their mean error and tau, "measured" and "predicted": name -> seconds}. The kernel
    figures (slowdown, surcharge) are held at the machine model's unless `fit_slowdown` (strategies.overheads.held_kernel)."""
    strategies = calibration_strategies(app, BATCH, setup, seeds)
    say(f"calibrate: training {len(strategies)} strategies of the tiny {app} {rounds} time(s) each on "
        f"{setup.describe()}")
    runs = measure_strategies(app, BATCH, iterations, strategies, setup, rounds, out_dir)
    measured = {name: measured_time(r) for name, r in runs["runs"].items()}
    model, output = app_graph(app, BATCH, tiny=True)
    linear = LinearTimes(model, output, strategies, setup.machine_model, runs["costs"], runs["per_sample"],
                         optimizer=app_optimizer(app, tiny=True))
    grid = FIT_GRID if fit_slowdown else held_kernel(setup.machine_model)
    figures, _ = fit_figures({app: (linear, measured)}, grid)
    own = figures_of(setup.machine_model)
    fitted = linear.times(figures)
    error, tau = score(measured, fitted)
    shipped_error, shipped_tau = score(measured, linear.times(own))
    return {"app": app, "figures": figures, "mean_error": error, "kendall_tau": tau,
            "shipped": {"figures": own, "mean_error": shipped_error, "kendall_tau": shipped_tau},
            "measured": measured, "predicted": fitted}


def figures_text(figures: dict) -> str:
    """The runtime figures on one line, overheads and delays in microseconds."""
    return ", ".join(f"{k} {v * 1e6:.0f} us" if k.endswith(("overhead", "delay", "cap")) else f"{k} {v}"
                     for k, v in figures.items())


def main(argv=None) -> int:
    p = LineParser(prog="python -m apps.calibrate", description=__doc__.split("\n\n")[0],
                   formatter_class=DefaultsHelp)
    p.add_argument("--app", default="transformer", choices=APPS, help="the tiny app whose strategies are run")
    p.add_argument("--ranks", type=at_least(2), default=2, help="MPI ranks, one CPU worker each")
    p.add_argument("--rounds", type=at_least(1), default=2, help="runs of each strategy, taking turns")
    p.add_argument("--iterations", type=at_least(2), default=20, help="training iterations a run")
    p.add_argument("--random", type=at_least(0), default=2, help="random strategies besides the four baselines")
    p.add_argument("--machine", default="local", help="the cpu machine model whose figures are fitted: a name or a file")
    p.add_argument("--fit-slowdown", action="store_true",
                   help="fit the kernel figures too (slowdown, surcharge: by default held at the machine file's: the transformer's runs, "
                        "mostly the runtime's own time, do not tell them from a message's flight)")
    p.add_argument("--write", action="store_true", help="write the fitted figures into the machine file")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the result as JSON to FILE")
    args = p.parse_args(argv)
    too_few_cores = cores_problem(args.ranks)
    if too_few_cores is not None:
        p.error(f"--ranks {args.ranks}: {too_few_cores}")
    try:
        mm = load_machine(args.machine, nodes=args.ranks)
    except MachineError as e:
        p.error(f"--machine {args.machine}: {e}")
    if mm.device.kind != "cpu":
        p.error(f"--machine {args.machine}: its devices are {mm.device.kind}s; the runtime figures are fitted "
                f"on cpu machine models")
    unwritable = None if args.json is None else output_problem(args.json)
    if unwritable is not None:
        p.error(f"--json {args.json}: {unwritable}")
    unwritable = write_problem(mm.source) if args.write else None
    if unwritable is not None:
        p.error(f"--write: {unwritable}")
    setup = Setup(args.ranks, 0, dataclasses.replace(mm, devices_per_node=1, nodes_per_host=args.ranks))
    with tempfile.TemporaryDirectory() as tmp:
        result = calibrate(args.app, setup, args.rounds, args.iterations, range(1, args.random + 1), tmp,
                           fit_slowdown=args.fit_slowdown)
    for name, m in result["measured"].items():
        print(f"  {name:9s} measured {m * 1e3:8.2f} ms  fitted {result['predicted'][name] * 1e3:8.2f} ms")
    shipped = result["shipped"]
    print(f"fitted: {figures_text(result['figures'])}: mean error {result['mean_error']:.1%}, "
          f"Kendall tau {result['kendall_tau']:.2f}")
    print(f"{mm.name}'s own: {figures_text(shipped['figures'])}: mean error {shipped['mean_error']:.1%}, "
          f"Kendall tau {shipped['kendall_tau']:.2f}")
    if args.write:
        note = (f"{args.app} (tiny), {len(result['measured'])} strategies x {args.rounds} runs on {args.ranks} ranks, "
                f"mean error {result['mean_error']:.1%}, {date.today().isoformat()}")
        write_fields(mm.source, {**result["figures"], "runtime_fitted": note})
        print(f"wrote the figures into {mm.source}")
    if args.json is not None:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("app", "figures", "mean_error", "kendall_tau", "shipped")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
