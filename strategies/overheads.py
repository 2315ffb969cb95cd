"""A cpu machine model's runtime figures, fitted to real runs on the machine at hand.

`launch_overhead`, `send_overhead`, `receive_overhead`, `message_delay`, `kernel_slowdown`,
`kernel_surcharge` and `kernel_surcharge_cap` (strategies/machines/README.md) are the
runtime's own costs around the kernels: its Python per task, its MPI handling per message on
the workers' cores, the hand-offs between its threads that hold a message in flight, and how
much slower a kernel runs among the rank's other threads than alone (short ones more so).
They are not figures of the hardware. They move with the machine, its load and, on a shared
VM, its phase (docs/accuracy.md), as kernel times do. So they are fitted to runs measured
here, as the efficiencies are (strategies.cost calibrate).
`fit_figures` takes strategies with their measured iteration times and returns the point of
a grid (FIT_GRID) whose simulated times come closest: the least mean relative error less
ORDER_WEIGHT times Kendall's tau of the two orderings, summed over the apps. Where that point
takes a figure's largest value, the grid goes on past it (`extended_fit`): a slow machine's
runtime is slower than any grid fixed in advance foresees.

Simulating every strategy at each of a thousand grid points would take minutes.
`LinearTimes` builds and costs each strategy's graph three times instead, then times any
point with one schedule:

    times = LinearTimes(model, output, strategies, machine_model, cache_path=costs)
    figures, error = fit_figures({"mlp": (times, measured)})
    fitted = with_figures(machine_model, figures)

`python -m apps.calibrate` measures such runs and writes the fit into a machine file.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import random
import statistics
from typing import Mapping, Sequence

from strategies.cost import CostModel
from strategies.machine_model import MachineModel, kernel_seconds
from strategies.simulator import Simulator
from strategies.timing import Handling, schedule_successors

#: the figures a fit tries: each runtime figure of the machine model and its values (a point
#: with no surcharge is tried with the first cap only: the cap changes nothing there)
FIT_GRID = {
    "launch_overhead": (20e-6, 30e-6, 40e-6, 55e-6, 70e-6, 100e-6, 130e-6),
    "send_overhead": (0.0, 50e-6, 100e-6, 200e-6),
    "receive_overhead": (0.0, 50e-6, 100e-6, 200e-6),
    "message_delay": (0.0, 50e-6, 100e-6, 150e-6, 200e-6),
    "kernel_slowdown": (1.0, 1.1, 1.2, 1.4, 1.6, 1.8),
    "kernel_surcharge": (0.0, 0.5, 1.0, 1.5),
    "kernel_surcharge_cap": (100e-6, 200e-6, 400e-6),
}
FIGURES = tuple(FIT_GRID)
#: what a fit weighs an app's Kendall tau against its mean error by (it minimizes the error less
#: this times tau): a search ranks strategies, so their order counts as well as their times. Fitted
#: on seven bench runs and held out one at a time, 0.2 kept every error under 10% and raised
#: alexnet's tau from 0.62 to 0.70 and the transformer's from 0.83 to 0.93 (docs/accuracy.md,
#: session 41); 0 fits the times alone
ORDER_WEIGHT = 0.2
#: where a fit picks a figure's largest grid value, the values tried next: that value times these
#: (rounded to whole microseconds), for at most EXTENSIONS rounds. On a 2 GHz first-generation EPYC
#: the demo's calibration took the grid's largest launch, send, receive and in-flight figures and
#: still came out 12% off the transformer's runs (26% off the mlp's); past them, 2.8% and 4.3%
#: (docs/accuracy.md, session 43)
EXTEND_BY = (1.3, 1.7, 2.2)
EXTENSIONS = 4
#: the most points an extension simulates with every value of the figures not extended
EXTEND_POINTS = 8000
#: the figures that turn a kernel's seconds alone into its seconds in a run, in the order machine_model.kernel_seconds takes them
KERNEL_FIGURES = ("kernel_slowdown", "kernel_surcharge", "kernel_surcharge_cap")


def held(figure: str, value: float, grid: Mapping[str, tuple] = FIT_GRID) -> dict[str, tuple]:
    """`grid` with `figure` held at its grid value nearest `value`: for fits on runs that cannot
    tell that figure from the others (the kernel slowdown on the transformer's runs, which are
    mostly the runtime's own time: docs/accuracy.md, session 36)."""
    if figure not in grid:
        raise ValueError(f"held: {figure!r} is not a figure of the grid (those are {list(grid)})")
    return {**grid, figure: (min(grid[figure], key=lambda v: abs(v - value)),)}


def held_kernel(machine_model: MachineModel, grid: Mapping[str, tuple] = FIT_GRID) -> dict[str, tuple]:
    """`grid` with the kernel figures (KERNEL_FIGURES) held at the grid values nearest the
    machine model's."""
    for figure in KERNEL_FIGURES:
        grid = held(figure, getattr(machine_model, figure), grid)
    return grid


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a of two equally long lists: (concordant - discordant pairs) / pairs."""
    pairs = list(itertools.combinations(range(len(a)), 2))
    if not pairs:
        return 1.0
    sign = sum((a[i] - a[j]) * (b[i] - b[j]) > 0 for i, j in pairs) - sum(
        (a[i] - a[j]) * (b[i] - b[j]) < 0 for i, j in pairs)
    return sign / len(pairs)


def score(measured: Mapping[str, float], predicted: Mapping[str, float], names=None) -> tuple[float, float]:
    """(mean relative error, Kendall's tau) of the predictions of `names` (default: all measured)."""
    names = list(measured) if names is None else list(names)
    error = sum(abs(predicted[n] - measured[n]) / measured[n] for n in names) / len(names)
    return error, kendall_tau([measured[n] for n in names], [predicted[n] for n in names])


def ordering_ceiling(runs: Sequence[Mapping[str, float]]) -> list[float]:
    """Kendall's tau of each run's measured times against the median, strategy by strategy, of
    the other runs' (over the strategies every run has): about what a predictor that knew each
    strategy's true time would score against one run, so the most that the measurement's own
    noise leaves for a simulator's tau."""
    if len(runs) < 2:
        raise ValueError(f"ordering_ceiling: needs at least 2 runs of the same strategies, got {len(runs)}")
    names = [name for name in runs[0] if all(name in run for run in runs[1:])]
    if len(names) < 2:
        raise ValueError(f"ordering_ceiling: the runs have {len(names)} strategies in common, need at least 2 "
                         f"(their strategies: {[sorted(run) for run in runs]})")
    taus = []
    for k, run in enumerate(runs):
        others = [r for i, r in enumerate(runs) if i != k]
        median = [statistics.median(r[name] for r in others) for name in names]
        taus.append(kendall_tau([run[name] for name in names], median))
    return taus


#: split_half_ceiling takes every split of a run's rounds in two where there are at most this many
#: (14 rounds: 1,716), else this many drawn with a fixed seed
SPLITS = 2000


def split_half_ceiling(runs: Mapping[str, Sequence[float]]) -> float:
    """How well one bench run's measurement agrees with itself: Kendall's tau of the strategies'
    fastest times over half of its rounds against their fastest over the other half (`runs`:
    strategy -> each round's time, every strategy as many rounds), the mean over the ways of
    splitting the rounds (an odd count: the larger half second): about the most a simulator's tau
    against that run can be expected to reach, from the run alone (ordering_ceiling needs several
    runs). The fastest of all the rounds is steadier than of half, so it is a little under what
    the whole run's noise leaves."""
    names = list(runs)
    counts = {len(times) for times in runs.values()}
    if len(names) < 2 or len(counts) != 1 or min(counts) < 2:
        raise ValueError(f"split_half_ceiling: needs at least 2 strategies with the same number (at least 2) of "
                         f"rounds each, got {({name: len(times) for name, times in runs.items()})}")
    rounds = counts.pop()
    splits = math.comb(rounds, rounds // 2) // (1 if rounds % 2 else 2)   # even: each way of choosing met twice
    if splits <= SPLITS:
        # each split once: the first round always in the first half where the halves are alike
        firsts = [c for c in itertools.combinations(range(rounds), rounds // 2) if rounds % 2 or c[0] == 0]
    else:
        rng = random.Random(0)
        firsts = [rng.sample(range(rounds), rounds // 2) for _ in range(SPLITS)]
    taus = []
    for first in firsts:
        second = [k for k in range(rounds) if k not in first]
        taus.append(kendall_tau([min(runs[n][k] for k in first) for n in names],
                                [min(runs[n][k] for k in second) for n in names]))
    return statistics.fmean(taus)


def figures_of(machine_model: MachineModel) -> dict[str, float]:
    """The machine model's runtime figures (FIGURES), by name."""
    return {name: getattr(machine_model, name) for name in FIGURES}


def with_figures(machine_model: MachineModel, figures: Mapping[str, float]) -> MachineModel:
    """The machine model with its runtime figures replaced by `figures` (some of FIGURES)."""
    unknown = set(figures) - set(FIGURES)
    if unknown:
        raise ValueError(f"with_figures: {sorted(unknown)} are not runtime figures (those are {list(FIGURES)})")
    return dataclasses.replace(machine_model, **figures)


class LinearTimes:
    """The simulated iterations of some strategies of one graph at any runtime figures, each graph
    built and costed once. A node's seconds are its kernel's seconds alone k put through
    kernel_seconds (k times kernel_slowdown, plus the surcharge) plus launch_overhead (a task: its
    kernel or source; a fill or fold: bytes over bandwidth, no kernel; a copy: neither), and a copy
    between ranks holds its processors for send_overhead and receive_overhead and is in flight
    message_delay longer. So three costings, (slowdown, launch) = (0, 0), (1, 0) and (0, 1) with
    no surcharge, send and receive 1 and no message delay, give every point's costs (k is the
    second less the first; the copies between ranks are those whose receipt then costs 1), and
    only the schedule runs per point. `base` must be a cpu machine model (the
    one whose figures are fitted); kernels come from the cost cache `cache_path` (measured into
    it where missing), the batch source's seconds a sample from `source_per_sample` (default:
    the cost model's own)."""

    def __init__(self, model, output, strategies: Mapping[str, object], base: MachineModel,
                 cache_path: str | None = None, source_per_sample: float | None = None, loss: str | None = None,
                 optimizer=None):
        if base.device.kind != "cpu":
            raise ValueError(f"LinearTimes: the runtime figures are fitted on cpu machines, {base.name!r} has "
                             f"{base.device.kind} devices")
        # every kernel measured into the cache first: the three costings below then read the same
        # seconds (each measuring what its own copy of the cache lacked, they timed a kernel thrice)
        self.base = base
        first = Simulator.for_model(model, base, CostModel(base, cache_path=cache_path), loss=loss,
                                    optimizer=optimizer, output=output)
        first.cost.measure_all([task for strategy in strategies.values() for task in first.tasks_to_measure(strategy)])
        unit = dataclasses.replace(base, send_overhead=1.0, receive_overhead=1.0, message_delay=0.0,
                                   kernel_surcharge=0.0, kernel_surcharge_cap=0.0)
        sims = []
        for slowdown, launch in ((0.0, 0.0), (1.0, 0.0), (0.0, 1.0)):
            mm = dataclasses.replace(unit, kernel_slowdown=slowdown, launch_overhead=launch)
            cost = CostModel(mm, cache_path=cache_path)
            if source_per_sample is not None:
                cost.source_per_sample = source_per_sample
            sims.append(Simulator.for_model(model, mm, cost, loss=loss, optimizer=optimizer, output=output))
        self.naps = sims[0].naps   # the base's, held: the receivers' naps are the runtime's constants
        self.parts = {}
        for name, strategy in strategies.items():
            graph = sims[0].graph(strategy)   # one graph, costed by each simulator
            (res, fixed, delay, resources, handling), *others = (sim.node_costs(graph) for sim in sims)
            kernel, per_launch = (c[1] - fixed for c in others)
            self.parts[name] = (graph.successors, res, fixed, kernel, per_launch, delay, len(resources), handling)

    def __repr__(self) -> str:
        return f"LinearTimes({len(self.parts)} strategies: {', '.join(self.parts)})"

    def times(self, figures: Mapping[str, float]) -> dict[str, float]:
        """Each strategy's iteration time (s) at `figures` (a value for each of FIGURES)."""
        out = {}
        kernel_figures = [figures[k] for k in KERNEL_FIGURES]
        for name, (succ, res, fixed, kernel, per_launch, delay, n_res, h) in self.parts.items():
            dur = fixed + kernel_seconds(kernel, *kernel_figures) + per_launch * figures["launch_overhead"]
            send, receive = figures["send_overhead"], figures["receive_overhead"]
            # (with neither, the simulator makes no handling parts: a part of 0 s still waits its turn)
            handling = Handling(h.pre_res, h.pre_dur * send, h.post_res, h.post_dur * receive) if send or receive else None
            in_flight = delay + h.post_dur * figures["message_delay"]   # post_dur: 1 between ranks, else 0
            out[name] = schedule_successors(res, dur, succ, n_res, in_flight, handling, self.naps).time
        return out


def grid_times(linear: Mapping[str, LinearTimes], grid: Mapping[str, tuple] = FIT_GRID,
               done: set | None = None) -> tuple[list, list]:
    """(every point of `grid`, and at each point every label's times): the whole grid simulated
    once, for fits over several subsets of the same runs. With `done` (the points simulated
    before, each as the tuple of its values in the grid's order), those are left out."""
    points = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    if "kernel_surcharge" in grid and "kernel_surcharge_cap" in grid:   # the cap matters only with a surcharge
        first_cap = grid["kernel_surcharge_cap"][0]
        points = [p for p in points if p["kernel_surcharge"] or p["kernel_surcharge_cap"] == first_cap]
    if done is not None:
        points = [p for p in points if tuple(p.values()) not in done]
    return points, [{label: t.times(point) for label, t in linear.items()} for point in points]


def extended_fit(linear: Mapping[str, LinearTimes], measured: Mapping[str, Mapping[str, float]],
                 grid: Mapping[str, tuple], points: list, predictions: list) -> tuple[dict, dict]:
    """(the best point, each label's times there): best_point over `points` (all of `grid`,
    with their `predictions`), and while it takes a figure's largest
    value (of two or more: a held figure stays), that figure's values go on past it (EXTEND_BY)
    and the new points are simulated and weighed with the rest: the whole grid so extended where
    it has at most EXTEND_POINTS points, else the best's value and those past it of the figures
    extended, and the best's and its neighbours' of the others (the kernel figures' values
    multiply FIT_GRID's points by 60: minutes a round)."""
    points, predictions = list(points), list(predictions)
    done = {tuple(p[f] for f in grid) for p in points}
    k = best_point(points, predictions, measured)
    for _ in range(EXTENSIONS):
        best = points[k]
        edge = [f for f, values in grid.items() if len(values) > 1 and 0 < best[f] == max(values)]
        if not edge:
            break
        past = {f: tuple(round(best[f] * x, 6) for x in EXTEND_BY) for f in edge}
        around = {f: values + past.get(f, ()) for f, values in grid.items()}
        if math.prod(map(len, around.values())) > EXTEND_POINTS:
            around = {f: (best[f],) + past[f] if f in past else _neighbours(values, best[f])
                      for f, values in grid.items()}
        more, more_predictions = grid_times(linear, around, done=done)
        done.update(tuple(p.values()) for p in more)
        points += more
        predictions += more_predictions
        grid = {f: tuple(sorted(set(values) | set(around[f]))) for f, values in grid.items()}
        k = best_point(points, predictions, measured)
    return points[k], predictions[k]


def _neighbours(values: tuple, value: float) -> tuple:
    """`value` and the values next to it among `values` (sorted)."""
    ordered = sorted(values)
    i = ordered.index(value)
    return tuple(ordered[max(0, i - 1):i + 2])


def best_point(points: list, predictions: list, measured: Mapping[str, Mapping[str, float]],
               names_of=lambda label: None, order_weight: float = ORDER_WEIGHT) -> int:
    """The index of the point with the least sum over the labels of `measured` of their mean
    error less `order_weight` times their Kendall tau (over the strategies names_of(label) gives;
    None: all, []: the label is left out)."""
    labels = [label for label in measured if names_of(label) != []]
    if not labels:
        raise ValueError("best_point: no measured strategies to fit on")

    def objective(k: int) -> float:
        scores = [score(measured[label], predictions[k][label], names_of(label)) for label in labels]
        return sum(error - order_weight * tau for error, tau in scores)

    return min(range(len(points)), key=objective)


def fit_figures(cases: Mapping[str, tuple[LinearTimes, Mapping[str, float]]],
                grid: Mapping[str, tuple] = FIT_GRID) -> tuple[dict, float]:
    """(the grid point whose times come closest to the measured ones, by best_point: the least
    mean error less ORDER_WEIGHT times Kendall's tau, the grid extended past a figure's largest
    value where the best point takes it (extended_fit); its mean error over the cases): `cases`
    maps a label to (its LinearTimes, its strategies' measured seconds)."""
    for label, (linear, measured) in cases.items():
        missing = set(measured) - set(linear.parts)
        if missing:
            raise ValueError(f"fit_figures: {label!r} has measured times for {sorted(missing)}, which its "
                             f"LinearTimes does not simulate")
    linear = {label: linear for label, (linear, _) in cases.items()}
    measured = {label: m for label, (_, m) in cases.items()}
    point, predicted = extended_fit(linear, measured, grid, *grid_times(linear, grid))
    error = sum(score(m, predicted[label])[0] for label, m in measured.items()) / len(measured)
    return point, error
