"""The main demo: search a strategy for a tiny app, train with it and with data parallelism,
and set the measured throughputs beside the simulator's predictions.

0. On CPU runs, the machine model's runtime figures (a task's launch, a message's handling,
   the kernels' slowdown in a run) are fitted to one round of real runs of another tiny app's
   strategies (`--calibrate-on`, default the transformer; apps/calibrate.py): on a shared
   machine they move from hour to hour, as kernel times do (docs/accuracy.md).
1. The MCMC search (strategies.search) times proposals on the simulator for the machine the
   runs will have: `ranks` MPI ranks of one CPU worker each (the `local` machine model, one
   device a node), or one GPU a rank where cupy sees enough of them (the `h100` model, one
   device a node). The searched strategy is saved, named after the app.
2. The app trains under `mpiexec -n RANKS` twice, with the searched strategy and with the
   data-parallel baseline, each writing a trace; their JSON reports give samples/s and the
   mean iteration time.
3. A table shows both, measured and predicted; the searched run's traces become a Chrome
   trace (chrome://tracing, Perfetto) and a timeline PNG (tools/trace.py).

    python -m apps.demo [--app mlp] [--ranks 2] [--budget 300] [--iterations 30] [--out traces]
                        [--calibrate-on transformer|none]
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path

from apps.cli import APPS, DefaultsHelp, at_least
from ops.strategy import Strategy
from strategies.baselines import data_parallel
from strategies.machine_model import MachineModel, load_machine
from strategies.search import SearchResult, app_graph, app_simulator, search
from strategies.simulator import Simulator
from taskrt.cores import cores_problem
from taskrt.machine import count_gpus
from taskrt.mpiexec import run_module_json
from taskrt.outputs import folder_problem
from taskrt.tracing import rank_trace_path
from tools import LineParser


@dataclass(frozen=True)
class Setup:
    """What the runs use: ranks, GPUs per rank (0: CPU only) and the machine model that matches them."""

    ranks: int
    gpus_per_rank: int
    machine_model: MachineModel

    def flags(self) -> list[str]:
        """The app flags that give each rank the processors the machine model has."""
        return ["--cpus-per-rank", "1", "--gpus-per-rank", str(self.gpus_per_rank)]

    def describe(self) -> str:
        each = "1 GPU" if self.gpus_per_rank else "1 CPU worker"
        return f"{self.ranks} MPI rank{'s' * (self.ranks != 1)} of {each} each"


def machine_setup(ranks: int, gpus: int | None = None) -> Setup:
    """One GPU a rank when `gpus` (default: those cupy sees) is at least one, on min(ranks, gpus)
    ranks; else `ranks` ranks of one CPU worker. Machine.build's numbering for one device a node
    (CPU: rank r's worker is processor r) is what the apps' Machine.discover makes under mpiexec."""
    gpus = count_gpus() if gpus is None else gpus
    if gpus > 0:
        ranks = min(ranks, gpus)
        return Setup(ranks, 1, dataclasses.replace(load_machine("h100", nodes=ranks), devices_per_node=1))
    return Setup(ranks, 0, dataclasses.replace(load_machine("local", nodes=ranks), devices_per_node=1,
                                               nodes_per_host=ranks))


def search_strategy(app: str, batch: int, setup: Setup, budget: int, seed: int = 0,
                    progress=None) -> tuple[Strategy, SearchResult, Simulator]:
    """(the best strategy for the tiny `app` at `batch` on the setup's machine, named after the app;
    the search's result, whose baselines hold the data-parallel prediction; the simulator it used)."""
    model, sim = app_simulator(app, setup.machine_model, batch, tiny=True, source=True)
    result = search(sim, budget, seed, model=model, progress=progress)
    return Strategy(app, {op.name: result.best.ops[op.name] for op in model.ops}), result, sim


def is_data_parallel(app: str, batch: int, setup: Setup, strategy: Strategy) -> bool:
    """Whether `strategy` (of the tiny app's ops) is its data parallelism on the setup's machine,
    where a search often ends."""
    model, _ = app_graph(app, batch, tiny=True)
    data = data_parallel(model, setup.machine_model.to_machine())
    return all(data.ops[name] == config for name, config in strategy.ops.items())


def train_mpi(app: str, setup: Setup, batch: int, iterations: int, which: list[str], trace: str,
              timeout: float = 600) -> dict:
    """Train the tiny app under mpiexec with `which` (--strategy FILE or --baseline NAME) and
    return rank 0's JSON report; a failed run raises RuntimeError with its last output."""
    return run_module_json(setup.ranks, f"apps.{app}", ["--tiny", "--batch-size", str(batch), "--iterations",
                                                        str(iterations), *which, *setup.flags(), "--trace", trace],
                           timeout)


def table(rows: list[dict]) -> str:
    """Strategy, measured samples/s and ms per iteration (the median: a shared machine has slow
    outliers), predicted ms and measured over predicted."""
    head = f"{'strategy':10s} {'samples/s':>10s} {'iter ms':>9s} {'predicted ms':>13s} {'measured/pred':>14s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        ms = r["median_iteration_s"] * 1e3
        lines.append(f"{r['name']:10s} {r['samples_per_s']:10.1f} {ms:9.2f} {r['predicted_ms']:13.2f} "
                     f"{ms / r['predicted_ms']:14.2f}")
    return "\n".join(lines)


def where_off(compare: dict, most: int = 3) -> str:
    """One line from tools.trace's comparison of the searched run with its simulation: the
    iteration's time, a task's mean wait for its idle worker (the runtime's hand-off) where the
    traces tell it, and the operators' phases (`fc1 backward`) whose task time is furthest off
    (at least 10 us)."""
    it = compare["iteration"]
    ops = sorted((r for r in compare["phases"] if r["error"] is not None and r["measured_us"] >= 10),
                 key=lambda r: -abs(r["simulated_us"] - r["measured_us"]))[:most]
    what = "median iteration" if compare["per_iteration"] else "mean iteration"
    w = compare["task_wait"]
    wait = "" if w is None else f"a task's wait for its worker {w['simulated_us']:.0f} against {w['measured_us']:.0f} us; "
    return (f"searched, simulated against traced ({what}): {it['simulated_us'] / 1e3:.2f} ms against "
            f"{it['measured_us'] / 1e3:.2f} ms; {wait}furthest off: "
            + ", ".join(f"{r['name']} {r['simulated_us'] / 1e3:.2f} against {r['measured_us'] / 1e3:.2f} ms"
                        for r in ops))


def run_demo(budget: int, iterations: int, out_dir: str, app: str = "mlp", ranks: int = 2, seed: int = 0,
             gpus: int | None = None, say=print, calibrate_on: str | None = None) -> dict:
    """Search, train both ways, print the table and write the trace files; returns the rows,
    the search's result and the paths written (strategy, per-rank traces, chrome, timeline).
    With `calibrate_on` (an app) on CPUs, the machine model's runtime figures are first fitted
    to real runs of that tiny app's strategies (apps/calibrate.py), and the search and the
    predictions use them."""
    from tools.trace import load, write_chrome, write_compare, write_timeline

    for what, name in (("app", app), ("calibration app", calibrate_on)):
        if name is not None and name not in APPS:
            raise ValueError(f"demo: {what} {name!r} is not one of {', '.join(APPS)}")
    batch = 16
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    setup = machine_setup(ranks, gpus)
    say(f"demo: the tiny {app} (batch {batch}) on {setup.describe()}, "
        f"machine model {setup.machine_model.name!r} with {setup.machine_model.num_devices} "
        f"device{'s' * (setup.machine_model.num_devices != 1)}")
    t0 = time.perf_counter()
    if calibrate_on is not None and setup.gpus_per_rank == 0 and setup.ranks > 1:
        setup = _calibrated(setup, calibrate_on, say)
    strategy, result, sim = search_strategy(app, batch, setup, budget, seed, progress=None)
    path = str(out / f"demo.{app}.strategy.json")
    strategy.save(path)
    say(f"search: {result.proposals} proposals in {result.seconds:.1f} s, predicted {result.best_time * 1e3:.2f} ms "
        f"an iteration ({result.speedup_over_baselines():.2f}x the best baseline); saved {path}")
    if is_data_parallel(app, batch, setup, strategy):
        say("the searched strategy is data parallelism: both runs below train it, so how far apart they "
            "measure is this machine's own noise")
    rows, files = [], {"strategy": path}
    for name, which in (("searched", ["--strategy", path]), ("data", ["--baseline", "data"])):
        trace = str(out / f"demo.{name}.jsonl")
        report = train_mpi(app, setup, batch, iterations, which, trace)
        predicted = result.best_time if name == "searched" else result.baselines["data"]
        rows.append({"name": name, "samples_per_s": report["samples_per_s"],
                     "median_iteration_s": report["median_iteration_s"], "predicted_ms": predicted * 1e3,
                     "final_loss": report["final_loss"]})
        files[f"{name}_traces"] = [report["trace"]] + [rank_trace_path(trace, r) for r in range(1, setup.ranks)]
        say(f"trained {name}: {iterations} iterations, loss {report['first_loss']:.3f} -> {report['final_loss']:.3f}")
    say("")
    say(table(rows))
    trace = load(files["searched_traces"])
    files["chrome"] = str(out / "demo.searched.chrome.json")
    files["timeline"] = str(out / "demo.searched.timeline.png")
    write_chrome(trace, files["chrome"])
    write_timeline(trace, files["timeline"], title=f"{app} (tiny), searched strategy, {setup.describe()}")
    files["simulated"] = sim.simulate(dict(strategy.ops)).write_trace(str(out / "demo.searched.simulated.jsonl"))
    files["compare"] = str(out / "demo.searched.compare.png")
    say("")
    say(where_off(write_compare(load(files["simulated"]), trace, files["compare"])))
    say("")
    say(f"files ({time.perf_counter() - t0:.0f} s in all):")
    say(f"  strategy        {files['strategy']}")
    for name in ("searched", "data"):
        say(f"  {name + ' traces':15s} {', '.join(files[name + '_traces'])}")
    say(f"  chrome trace    {files['chrome']}  (chrome://tracing or ui.perfetto.dev)")
    say(f"  timeline        {files['timeline']}")
    say(f"  simulated trace {files['simulated']}")
    say(f"  compare         {files['compare']}  (simulated above, the median measured iteration below)")
    return {"rows": rows, "search": result, "files": files, "setup": setup}


def _calibrated(setup: Setup, app: str, say) -> Setup:
    """The setup with its machine model's runtime figures fitted to one round of runs of the
    tiny `app`'s baselines and two random strategies (apps/calibrate.py)."""
    import tempfile

    from apps.calibrate import calibrate, figures_text
    from strategies.overheads import with_figures
    with tempfile.TemporaryDirectory() as tmp:
        fit = calibrate(app, setup, rounds=1, iterations=20, seeds=(1, 2), out_dir=tmp, say=say)
    shipped = fit["shipped"]
    say(f"calibrated: {figures_text(fit['figures'])} (mean error {fit['mean_error']:.1%} over the "
        f"{app}'s {len(fit['measured'])} strategies; the file's own figures: {shipped['mean_error']:.1%})")
    return dataclasses.replace(setup, machine_model=with_figures(setup.machine_model, fit["figures"]))


def out_problem(out: str) -> str | None:
    """Why the folder `out` cannot take the demo's files (made here if missing), or None."""
    if os.path.exists(out) and not os.path.isdir(out):
        return "is a file, not a folder"
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        return f"cannot be made: {e.strerror}"
    return folder_problem(out)


def main(argv=None) -> None:
    p = LineParser(prog="python -m apps.demo", description=__doc__.split("\n\n")[0].replace("\n", " "),
                   formatter_class=DefaultsHelp)
    p.add_argument("--app", default="mlp", choices=APPS, help="the benchmark app, run --tiny")
    p.add_argument("--ranks", type=at_least(1), default=2, help="MPI ranks")
    p.add_argument("--budget", type=at_least(1), default=300, help="search proposals")
    p.add_argument("--iterations", type=at_least(2), default=30,
                   help="training iterations of each run (the comparison leaves out the first)")
    p.add_argument("--seed", type=at_least(0), default=0, help="the search's seed")
    p.add_argument("--out", default="traces", help="folder for the strategy, traces and timeline")
    p.add_argument("--calibrate-on", default="transformer", choices=[*APPS, "none"],
                   help="fit the runtime figures to runs of this tiny app first (CPU runs only; none: the "
                        "machine file's figures)")
    args = p.parse_args(argv)
    problem = cores_problem(args.ranks) if count_gpus() == 0 else None   # (with GPUs: one a rank)
    if problem is not None:
        p.error(f"--ranks {args.ranks}: {problem}")
    problem = out_problem(args.out)
    if problem is not None:
        p.error(f"--out {args.out}: {problem}")
    run_demo(args.budget, args.iterations, args.out, args.app, args.ranks, args.seed,
             calibrate_on=None if args.calibrate_on == "none" else args.calibrate_on)


if __name__ == "__main__":
    main()
