"""How close the simulator's predictions come to real runs: strategies of two tiny apps on 2 ranks.

    python bench/sim_accuracy.py [--apps mlp alexnet] [--calibrate-on transformer] [--iterations 20]
                                 [--budget 40] [--rounds 5] [--random-seeds 1 2 3 4] [--fit]
                                 [--save DIR | --rescore DIR [DIR ...]]

For each app (tiny, on 2 MPI ranks of one CPU worker each, the `local` machine model with one
device a node, as apps/demo.py sets up): the four baselines, a searched strategy and a
random one for each of `--random-seeds` are trained for real (`mpiexec -n 2 python -m apps.NAME --strategy
FILE`) `--rounds` times each, taking turns (a strategy another of them already is, as when the
search ends at data parallelism, once: it says which), and simulated with the cost model (the local
model's runtime figures; kernels and batch source as measured here during the bench). A
strategy's measured time is the fastest of its runs, each run's time its median iteration after
the warm-up (apps.calibrate.measured_time: other work here only adds time). This machine's
speed drifts by up to two times within an hour, so a shared cost cache would hold kernels
timed in another hour: before each round the bench measures every kernel of the strategies
and the batch source afresh, and predicts with each one's median over the rounds (a cost
cache of the run's own). It also probes the runtime's own speed then (strategies.probe: an
empty task of a chain, a hop between the ranks, the main thread's issue of a replayed step a
node) and prints it beside the errors, with the
median message flight between the ranks in the runs' traces (tools.trace messages; what the
model's message_delay stands for) and a task's mean wait for its idle worker there (tools.trace
waits; a part of what launch_overhead stands for). Printed per strategy: measured (and each run) and
predicted iteration time and the relative error, and where its simulation is furthest from the
run's trace (tools.trace compare: the operator's phase furthest off, and a task's mean wait for
its idle worker in both); per app the mean error and Kendall's tau of
the two orderings, and how well the run's measured ordering agrees with itself (the fastest of
half the rounds against the other half's, over the ways to split them: split_half_ceiling, about
the most a simulator's tau can reach against the run). Targets: mean error at most 10%, tau at
least 0.8.

The runtime's own costs on this VM move with its phase (docs/accuracy.md), as the kernels'
do, so the bench also calibrates them now: it trains the strategies of `--calibrate-on` apps
too (default: the tiny transformer; first, in the same rounds), fits the local model's runtime
figures to those runs alone on the --fit grid (the kernel slowdown and surcharge held at the
machine file's: those runs do not tell them from a message's flight), and scores the other
apps, held out, with them as well as with the shipped figures.

`--fit` then fits the local model's runtime figures (launch_overhead, send_overhead,
receive_overhead, message_delay and the kernel figures: see strategies/machines/README.md) to
these runs, on a grid, minimizing the mean error less ORDER_WEIGHT times Kendall's tau summed
over the apps (strategies.overheads.best_point); it prints the best figures
with their error in sample and, so that the fit's own error shows, fitted on half the
strategies of each app and scored on the other half (two folds; with several saved runs, on
all but one and scored on that one).

`--save DIR` keeps the runs in DIR: each strategy's file and trace, `runs.json` (each run's
median iteration, the probes and the measured source, per app) and `costs.json` (the kernels).
`--rescore DIR` trains nothing: it scores (and with --fit fits) the simulator as it is now
on the runs saved there, so that a change to the simulator or the machine model is judged on
the same runs as the code before it. With several DIRs it scores each (and prints, per app,
how well each run's measured ordering agrees with the median of the other runs': about the
most a simulator's tau can reach against one run), and fits them pooled, the folds then
holding out one bench run at a time. Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT

from apps.calibrate import (COSTS_FILE, calibration_strategies, figures_text, measure_strategies,  # noqa: E402
                            measured_time, simulate)
from apps.cli import APPS, at_least  # noqa: E402
from apps.demo import machine_setup, search_strategy  # noqa: E402
from ops.strategy import Strategy, load as load_strategy  # noqa: E402
from strategies.overheads import (KERNEL_FIGURES, LinearTimes, best_point, extended_fit, grid_times,  # noqa: E402
                                  held_kernel, ordering_ceiling, score, split_half_ceiling)
from strategies.probe import measure_overheads  # noqa: E402
from strategies.search import app_graph, app_optimizer  # noqa: E402
from tools import trace as trace_tools  # noqa: E402

#: what --save writes beside the strategies' files and traces: the runs, and the kernels' median
#: times over the rounds (a cost cache; each round's own is there too, costs.APP.roundR.json)
RUNS_FILE = "runs.json"


#: the published simulators' relative errors of predicted iteration times: FlexFlow's under 30%,
#: Proteus's 3% (mean_error_over_flexflow divides ours by FlexFlow's bound)
PEERS = {"flexflow_mean_error_under": 0.30, "proteus_mean_error": 0.03}


def strategies_for(app: str, batch: int, setup, budget: int, seeds) -> tuple[dict[str, Strategy], dict[str, str]]:
    """(the four baselines, a searched strategy and a random one for each of `seeds`, each distinct
    strategy once; name -> the earlier name of the same strategy, for those left out). The
    search often ends where data parallelism is, and a strategy trained and scored twice
    would count twice in the mean error and tie with itself in Kendall's tau."""
    made = calibration_strategies(app, batch, setup, seeds)
    searched, _, _ = search_strategy(app, batch, setup, budget)
    baselines = {name: s for name, s in made.items() if not name.startswith("random")}
    ordered = {**baselines, "searched": searched, **{name: s for name, s in made.items() if name not in baselines}}
    kept: dict[str, Strategy] = {}
    same: dict[str, str] = {}
    for name, strategy in ordered.items():
        twin = next((k for k, t in kept.items() if t.ops == strategy.ops), None)
        if twin is None:
            kept[name] = strategy
        else:
            same[name] = twin
    return kept, same


def run_apps(args, setup, out_dir: str) -> dict:
    """Train every strategy of each app in `out_dir` (apps.calibrate.measure_strategies, the runtime
    probe taken before each round): app -> {"strategies", "runs", "probes", "per_sample",
    "costs"}; RUNS_FILE in `out_dir` records the runs."""
    saved = {}
    for app in args.apps:
        strategies, same = strategies_for(app, args.batch_size, setup, args.budget, args.random_seeds)
        measured = measure_strategies(app, args.batch_size, args.iterations, strategies, setup, args.rounds, out_dir,
                                      before_round=lambda: measure_overheads(2))
        saved[app] = {"strategies": strategies, "runs": measured["runs"], "probes": measured["before"],
                      "per_sample": measured["per_sample"], "costs": measured["costs"], "same_as": same}
        with open(os.path.join(out_dir, RUNS_FILE), "w") as f:
            json.dump({"batch_size": args.batch_size, "apps": {
                a: {k: s[k] for k in ("runs", "probes", "per_sample", "same_as")} for a, s in saved.items()}}, f,
                      indent=1)
    return saved


def load_runs(directory: str, apps: list[str]) -> tuple[int, dict]:
    """(the batch size, what run_apps saved in `directory` for `apps`): each strategy read back
    from its file."""
    path = os.path.join(directory, RUNS_FILE)
    try:
        with open(path) as f:
            data = json.load(f)
        batch, recorded = int(data["batch_size"]), data["apps"]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"bench/sim_accuracy.py --rescore: cannot read the runs in {path}: {e}")
    missing = [app for app in apps if app not in recorded]
    if missing:
        sys.exit(f"bench/sim_accuracy.py --rescore: {path} has no runs of {missing} (it has {sorted(recorded)})")
    costs = os.path.join(directory, COSTS_FILE)
    return batch, {app: {"strategies": {name: load_strategy(os.path.join(directory, f"{app}.{name}.json"))
                                        for name in recorded[app]["runs"]},
                         "runs": recorded[app]["runs"], "probes": recorded[app].get("probes", []),
                         "same_as": recorded[app].get("same_as", {}),
                         "per_sample": recorded[app]["per_sample"],
                         "costs": costs if os.path.exists(costs) else None} for app in apps}


def _linear(apps: dict, base) -> dict:
    """A LinearTimes of each label's strategies (strategies/overheads.py), on its run's kernels."""
    linear = {}
    for label, a in apps.items():
        model, output = app_graph(a["app"], a["batch"], tiny=True)
        linear[label] = LinearTimes(model, output, a["strategies"], base, a["costs"], a["per_sample"],
                                    optimizer=app_optimizer(a["app"], tiny=True))
    return linear


def run_traces(a: dict) -> list:
    """The traces an app's strategies left in its run's folder, each read once (a strategy whose
    trace was not kept has none)."""
    traces = []
    for name in a["strategies"]:
        try:
            traces.append(trace_tools.load(os.path.join(a["run"], f"{a['app']}.{name}.jsonl")))
        except trace_tools.TraceError:
            continue
    return traces


def median_over(traces: list, figure) -> float | None:
    """The median over `traces` of `figure(trace)` (microseconds), in seconds; traces it refuses
    (tools.trace.TraceError: nothing of what it measures) left out; None where it refuses all."""
    values = []
    for trace in traces:
        try:
            values.append(figure(trace))
        except trace_tools.TraceError:
            continue
    return float(np.median(values)) * 1e-6 if values else None


def message_flight(trace) -> float:
    """A trace's median message flight between the ranks (tools.trace messages: a send's post to
    its receipt's completion), us: what the machine model's message_delay stands for."""
    return trace_tools.messages(trace)["flight_us"]["median"]


def task_wait(trace) -> float:
    """A trace's mean wait of a task that found its processor idle, from its last pred's end to its
    start (tools.trace waits, each task's first run left out: the first iteration compiles), us:
    the runtime's hand-off to a worker, a part of what the model's launch_overhead stands for."""
    return trace_tools.waits(trace, skip=1)["wait_us"]["mean"]


def furthest_off(result, run_trace: str, tmp: str) -> dict | None:
    """Where a strategy's simulation (with the machine file's figures) is furthest from its run's
    trace (tools.trace compare, median iteration): the operator's phase whose task time is
    furthest off, and a task's mean wait for its idle worker in both (the model's launch and
    message handling against the runtime's hand-off); None where the run left no trace that
    compares (not kept, or not cut into iterations)."""
    try:
        measured = trace_tools.load(run_trace)
        c = trace_tools.compare(trace_tools.load(result.write_trace(os.path.join(tmp, "simulated.jsonl"))), measured)
    except trace_tools.TraceError:
        return None
    if not c["per_iteration"] or c["task_wait"] is None or not c["phases"]:
        return None
    row = max(c["phases"], key=lambda r: abs(r["simulated_us"] - r["measured_us"]))
    wait = c["task_wait"]
    return {"phase": row["name"], "simulated_ms": round(row["simulated_us"] / 1e3, 3),
            "measured_ms": round(row["measured_us"] / 1e3, 3),
            "task_wait_us": [round(wait["simulated_us"], 1), round(wait["measured_us"], 1)]}


def calibrate(apps: dict, on: list[str], grid: tuple, linear: dict, machine_model) -> tuple[dict, dict]:
    """(the FIT_GRID point best_point picks over the calibration labels `on`, the grid extended
    past a figure's largest value where that point takes it (extended_fit), and each label's
    predicted times at it): the runtime figures as they are now, fitted on some apps' runs and
    then used, held out, on the others. `grid`: grid_times of every label, `linear` their
    LinearTimes.

    The kernel figures (slowdown and surcharge) are held at the grid's values nearest the machine
    file's: the transformer's runs are mostly the runtime's own time, where a message's flight
    and the kernels' slowdown trade off, and fitted free the slowdown came out at 1.0, which made
    alexnet's kernel-bound strategies 20-27% short (docs/accuracy.md, session 36)."""
    points, predictions = grid
    kept = held_kernel(machine_model)
    keep = [k for k, point in enumerate(points) if all(point[f] in kept[f] for f in KERNEL_FIGURES)]
    return extended_fit(linear, {label: apps[label]["measured"] for label in on}, kept,
                        [points[k] for k in keep], [predictions[k] for k in keep])


def fit(apps: dict, grid: tuple) -> dict:
    """The FIT_GRID point best_point picks over `apps` (label -> a saved app's runs), in
    sample and in folds: with runs of one bench run, fitted on the strategies at even places of
    each app and scored on the odd ones, and the other way; with several, fitted on all runs
    but one and scored on that one, for each. `grid`: grid_times of every label."""
    points, predictions = grid
    measured = {label: a["measured"] for label, a in apps.items()}

    def best(names_of) -> int:
        return best_point(points, predictions, measured, names_of)

    def scored(k: int, names_of) -> dict:
        return {label: dict(zip(("mean_error", "kendall_tau"),
                                score(a["measured"], predictions[k][label], names_of(label))))
                for label, a in apps.items() if names_of(label) != []}

    everything = best(lambda label: None)
    out = {"figures": points[everything], "in_sample": scored(everything, lambda label: None), "folds": []}
    runs = sorted({a["run"] for a in apps.values()})
    if len(runs) > 1:
        folds = [(f"the runs but {run}", lambda label, run=run: [] if apps[label]["run"] == run else None,
                  lambda label, run=run: None if apps[label]["run"] == run else []) for run in runs]
    else:
        folds = [(f"the strategies at {'even' if fold == 0 else 'odd'} places",
                  lambda label, fold=fold: list(apps[label]["measured"])[fold::2],
                  lambda label, fold=fold: list(apps[label]["measured"])[1 - fold::2]) for fold in (0, 1)]
    for fitted_on, train, test in folds:
        k = best(train)
        out["folds"].append({"fitted_on": fitted_on, "figures": points[k], "held_out": scored(k, test)})
    return out


def measured_ordering(apps: dict, scored: dict) -> dict:
    """Per app rescored from several bench runs: each run's measured ordering against the median of
    the others' (strategies.overheads.ordering_ceiling: about the most a simulator's tau can reach
    against one run), printed beside the simulator's tau on those runs."""
    out = {}
    for app in dict.fromkeys(a["app"] for a in apps.values()):
        labels = [label for label, a in apps.items() if a["app"] == app]
        ceiling = ordering_ceiling([apps[label]["measured"] for label in labels])
        mean, simulated = float(np.mean(ceiling)), float(np.mean([scored[label]["kendall_tau"] for label in labels]))
        out[app] = {"runs_against_the_others": [round(t, 3) for t in ceiling], "mean": round(mean, 3),
                    "simulator_mean": round(simulated, 3)}
        print(f"{app}: the measured ordering, each run against the median of the other runs: Kendall tau "
              f"{', '.join(f'{t:.2f}' for t in ceiling)} (mean {mean:.2f}); the simulator's against "
              f"each run: mean {simulated:.2f}", flush=True)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--apps", nargs="+", default=["mlp", "alexnet"], choices=APPS, metavar="APP")
    p.add_argument("--batch-size", type=at_least(1), default=16)
    p.add_argument("--iterations", type=at_least(2), default=20)
    p.add_argument("--budget", type=at_least(1), default=40, help="search proposals for the searched strategy")
    p.add_argument("--rounds", type=at_least(1), default=5,
                   help="runs of each strategy, taking turns (its time the fastest)")
    p.add_argument("--random-seeds", type=at_least(0), nargs="*", default=[1, 2, 3, 4],
                   help="a random strategy of each app for each seed")
    p.add_argument("--calibrate-on", nargs="*", default=["transformer"], choices=APPS, metavar="APP",
                   help="apps whose runs fit the runtime figures that then predict the others (none: no calibration)")
    p.add_argument("--fit", action="store_true", help="fit the local model's runtime figures to the runs")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--save", metavar="DIR", help="keep the strategies, traces and runs.json in DIR")
    where.add_argument("--rescore", metavar="DIR", nargs="+",
                       help="train nothing: score the runs that --save kept in DIR (several: fit them pooled)")
    args = p.parse_args(argv)
    both = sorted(set(args.apps) & set(args.calibrate_on))
    if both:
        p.error(f"--calibrate-on {' '.join(both)}: scored by --apps as well (the calibration apps are held out of the score)")
    args.apps = args.calibrate_on + args.apps   # the calibration apps run first
    if args.save:
        os.makedirs(args.save, exist_ok=True)
    setup = machine_setup(2, gpus=0)
    out = {"bench": "sim_accuracy", "ranks": 2, "targets": {"mean_error": 0.1, "kendall_tau": 0.8},
           "peers": PEERS, "apps": {}}
    with tempfile.TemporaryDirectory() as tmp:   # the runs' files unless --save
        saved = {}   # label (the app, and its run where several are rescored) -> its runs
        if args.rescore:
            for run in args.rescore:
                batch, apps = load_runs(run, args.apps)
                for app, a in apps.items():
                    label = app if len(args.rescore) == 1 else f"{app}@{os.path.basename(os.path.normpath(run))}"
                    saved[label] = {**a, "app": app, "batch": batch, "run": run}
        else:
            saved = {app: {**a, "app": app, "batch": args.batch_size, "run": args.save or tmp}
                     for app, a in run_apps(args, setup, args.save or tmp).items()}
        for a in saved.values():
            a["measured"] = {name: measured_time(r) for name, r in a["runs"].items()}
        on = [label for label, a in saved.items() if a["app"] in args.calibrate_on]
        # every label at every grid point, once, for the calibration and --fit alike
        linear = _linear(saved, setup.machine_model) if on or args.fit else None
        grid = grid_times(linear) if linear is not None else None
        calibrated = {}
        if on:
            figures, calibrated = calibrate(saved, on, grid, linear, setup.machine_model)
            out["calibration"] = {"on": on, "figures": figures}
            print(f"calibrated on {', '.join(on)}: {figures_text(figures)}", flush=True)
        for label, a in saved.items():
            app, strategies, runs, per_sample, measured = (a["app"], a["strategies"], a["runs"], a["per_sample"],
                                                           a["measured"])
            simulated = simulate(app, a["batch"], strategies, setup.machine_model, per_sample, a["costs"])
            predicted = {name: r.time for name, r in simulated.items()}
            held_out = calibrated.get(label) if label not in on else None
            rows = {}
            for name in strategies:
                m, q = measured[name], predicted[name]
                rows[name] = {"measured_ms": round(m * 1e3, 3), "runs_ms": [round(t * 1e3, 3) for t in runs[name]],
                              "predicted_ms": round(q * 1e3, 3), "error": round(abs(q - m) / m, 4)}
                line = (f"{label:8s} {name:9s} measured {m * 1e3:8.2f} ms (runs "
                        f"{', '.join(f'{t * 1e3:.1f}' for t in runs[name])})  predicted {q * 1e3:8.2f} ms  "
                        f"error {rows[name]['error']:6.1%}")
                if held_out is not None:
                    c = held_out[name]
                    rows[name].update(calibrated_ms=round(c * 1e3, 3), calibrated_error=round(abs(c - m) / m, 4))
                    line += f"  calibrated {c * 1e3:8.2f} ms  error {rows[name]['calibrated_error']:6.1%}"
                off = furthest_off(simulated[name], os.path.join(a["run"], f"{app}.{name}.jsonl"), tmp)
                if off is not None:
                    rows[name]["furthest_off"] = off
                    line += (f"  (a task's wait {off['task_wait_us'][0]:.0f} against {off['task_wait_us'][1]:.0f} us; "
                             f"furthest off: {off['phase']} {off['simulated_ms']:.2f} against {off['measured_ms']:.2f} ms)")
                print(line, flush=True)
            for name, twin in a["same_as"].items():
                print(f"{label:8s} {name:9s} the same strategy as {twin} (trained and scored once)", flush=True)
            error, tau = score(measured, predicted)
            probes = {k: float(np.median([p[k] for p in a["probes"]])) for k in ("issue", "chain", "pingpong")
                      if a["probes"] and all(k in p for p in a["probes"])}
            traces = run_traces(a)
            for key, figure in (("message_flight", median_over(traces, message_flight)),
                                ("task_wait", median_over(traces, task_wait))):
                if figure is not None:
                    probes[key] = figure
            try:
                itself = split_half_ceiling({name: runs[name] for name in strategies})
            except ValueError:   # one round (--rounds 1), or rounds missing: no split
                itself = None
            out["apps"][label] = {"strategies": rows, "mean_error": round(error, 4), "kendall_tau": round(tau, 3),
                                  "mean_error_over_flexflow": round(error / PEERS["flexflow_mean_error_under"], 3),
                                  "split_half_tau": None if itself is None else round(itself, 3),
                                  "source_us_per_sample": round(per_sample * 1e6, 2),
                                  "probe_us": {k: round(v * 1e6, 1) for k, v in probes.items()},
                                  "role": "calibration" if label in on else "scored", "same_as": a["same_as"]}
            summary = f"{label}: mean error {error:.1%}, Kendall tau {tau:.2f}"
            if held_out is not None:
                c_error, c_tau = score(measured, held_out)
                out["apps"][label]["calibrated"] = {"mean_error": round(c_error, 4), "kendall_tau": round(c_tau, 3)}
                summary += f"; calibrated on {', '.join(on)}: mean error {c_error:.1%}, Kendall tau {c_tau:.2f}"
            elif label in on:
                summary += " (a calibration app: not scored)"
            if itself is not None:
                summary += f"; the run against itself, half its rounds against the other half: Kendall tau {itself:.2f}"
            print(f"{summary} (its batch source {per_sample * 1e6:.1f} us a sample; the runtime probe: "
                  f"{', '.join(f'{k} {v * 1e6:.0f} us' for k, v in probes.items()) or 'not taken'})", flush=True)
        if args.rescore and len(args.rescore) > 1:
            out["measured_ordering"] = measured_ordering(saved, out["apps"])
        if args.fit:
            out["fit"] = fit(saved, grid)
            f = out["fit"]
            print(f"fit: {figures_text(f['figures'])}", flush=True)
            for app, s in f["in_sample"].items():
                print(f"  in sample, {app}: mean error {s['mean_error']:.1%}, Kendall tau {s['kendall_tau']:.2f}")
            for fold in f["folds"]:
                for label, s in fold["held_out"].items():
                    print(f"  fitted on {fold['fitted_on']} ({fold['figures']}), held out, {label}: "
                          f"mean error {s['mean_error']:.1%}, Kendall tau {s['kendall_tau']:.2f}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
