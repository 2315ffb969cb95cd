"""MCMC search over SOAP strategies on simulated iteration time (FlexFlow's Metropolis-Hastings).

A proposal gives one random operator a random valid config (strategies.random.proposal_config:
any split kind it declares, a tile count that fits the machine's nodes, on consecutive
devices drawn from the machine, and now and then any config at all), or, three times in
four, the config of an op next to it in the graph where that config fits the op and is not the
op's own (a proposal that changes nothing is not made); the simulator times the new strategy, and
the chain moves there with probability min(1, exp(beta * (old - new))). Strategies that do
not fit a device's memory are rejected. Chains start from data parallelism, the expert
strategy and a random strategy (a proposal config for every op) in turn, sharing a tenth of
the budget (BURN_IN); the chain that then stands lowest goes on with the rest. A chain stops
at its proposals or the deadline, or when its best has not improved for half of its
proposals. The whole search is reproducible for a seed.

    result = search(Simulator.for_model(model, load_machine("p100")), budget=1000, seed=0)
    result.best, result.best_time, result.baselines

`python -m strategies.search --app NAME --machine M --budget N -o strategy.json` does the
same from the command line (see main), for the app as it trains: at its batch, with its
optimizer, in float32 (`app_simulator`), unless --batch-size, --optimizer or --dtype say otherwise.
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from ops.lower import ConfigError, resolve_config
from ops.strategy import Strategy
from strategies.baselines import BASELINES
from strategies.random import proposal_config, random_strategy
from strategies.simulator import Simulator

STARTS = ("data", "expert", "random")
#: the default inverse temperature, over the best baseline's time: a proposal 0.2% slower than
#: that time is taken with probability 1/e. Most proposals change the time by a few percent, so
#: at 5 (20%) nine in ten were taken and the chains wandered off into strategies with more and
#: more copies; at 500, 150 proposals found 1.5-1.6x over the best baseline for the tiny AlexNet
#: on 16 K80s against 1.23-1.28x, 1.25-1.42x against 1.0-1.19x for the tiny RNN text
#: classifier (two seeds each)
BETA = 500.0
#: the share of proposals that give the op the config of one of its neighbours (an op it reads
#: from or one that reads it) instead of a drawn one, where that config fits the op and differs
#: from its own: the tensors between the two then need no copies, which a drawn config rarely
#: achieves. Tiny Inception-v3 on 64 K80s, 10,000 proposals, seeds 0 and 1: 5.24 and 5.16 ms
#: found at three in four, 6.58 ms (seed 0) at one in four, and no slower a proposal (a
#: neighbour's config often has its segments cached); 1,500 proposals: 9.27 and 8.67 ms against
#: 9.09 and 9.93 (docs/search.md, session 50)
NEIGHBOUR_SHARE = 0.75
#: the share of the budget that the chains from every start take in turn before the one that
#: stands lowest goes on alone: tiny Inception-v3 on 64 K80s, 4,500 proposals, found 8.58 ms
#: in three equal chains and 6.61-7.22 ms in one chain from any single start (two seeds each)
BURN_IN = 0.1


@dataclass
class SearchResult:
    """The best strategy found, its predicted iteration time (s), the baselines' predicted times,
    and the search's counts: proposals made, accepted, rejected for memory (of those that their
    time would have had accepted), seconds spent."""

    best: Strategy
    best_time: float
    baselines: dict[str, float]
    proposals: int = 0
    accepted: int = 0
    infeasible: int = 0
    seconds: float = 0.0
    history: list[tuple[int, float]] = field(default_factory=list)

    def __repr__(self) -> str:
        return (f"SearchResult(best {self.best_time * 1e3:.3f} ms after {self.proposals} proposals, "
                f"{self.accepted} accepted, {self.seconds:.1f} s)")

    def speedup_over_baselines(self) -> float:
        """The best baseline's predicted time over the searched one's."""
        feasible = [t for t in self.baselines.values() if math.isfinite(t)]
        return min(feasible) / self.best_time if feasible else math.inf


def finite_or_none(x: float) -> float | None:
    """x, or None where it is not finite (a strategy that fits no device): JSON has no infinity."""
    return x if math.isfinite(x) else None


def nothing_fits(result: SearchResult, sim: Simulator) -> str | None:
    """Why a search has no strategy to offer, or None: every strategy it tried (the baselines and
    its proposals) needs more memory than a device of the machine has, or takes forever there
    (figures so extreme that a time overflows)."""
    if math.isfinite(result.best_time):
        return None
    mm = sim.machine_model
    best = sim.simulate(result.best)
    if best.fits:
        return (f"every strategy's predicted time is infinite on {mm.source or mm.name}: its figures (bandwidths, "
                f"latencies, overheads) make a time overflow")
    kinds = {sim.machine.processors[i].kind for i, peak in best.peak_memory.items() if peak > best.capacity[i]}
    memories = [f"{mm.device.kind} devices ({mm.device.mem_bytes / 2**30:.3g} GiB each)"] if mm.device.kind in kinds else []
    if mm.device.kind != "cpu" and "cpu" in kinds:   # (the CPUs of a GPU machine are its hosts)
        memories.append(f"hosts ({mm.host.mem_bytes / 2**30:.3g} GiB each)")
    return (f"no strategy fits the memory of {mm.name}'s {' and '.join(memories)}: not the baselines, nor any of "
            f"{result.proposals} proposals; a smaller batch, more devices or a bigger budget")


class _Bar:
    """One line, rewritten in place on a terminal (every 1% otherwise), with the best time so far."""

    def __init__(self, stream, total: int):
        self.stream, self.total = stream, max(1, total)
        self.tty = stream is not None and hasattr(stream, "isatty") and stream.isatty()
        self.shown = -1

    def show(self, done: int, best: float) -> None:
        if self.stream is None:
            return
        pct = 100 * done // self.total
        if not self.tty and (pct == self.shown or pct % 10):
            return
        self.shown = pct
        bar = "#" * (pct // 5) + "." * (20 - pct // 5)
        line = f"search [{bar}] {done}/{self.total} proposals, best {best * 1e3:.3f} ms"
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None and self.tty:
            self.stream.write("\n")
            self.stream.flush()


class _Memo:
    """The predicted time of every strategy simulated so far in a search, and whether it fits
    where that was asked, by its configs in op order: the chains often propose one again (a
    neighbour's config that the op already has, a move back; a sixth of the proposals on tiny
    Inception-v3), and a simulation is deterministic. Whether a strategy fits is asked only of
    those a chain would accept on their time: its peak memory was a sixteenth of a proposal,
    and about half of the proposals are turned down for their time alone."""

    def __init__(self, sim: Simulator):
        self.sim = sim
        self.times: dict[_Configs, float] = {}
        self.fit: dict[_Configs, bool] = {}
        self._last: tuple | None = None   # (key, SimResult) of the last simulation
        self.place = {op.name: i for i, op in enumerate(sim.ops)}

    def key(self, strategy: Strategy) -> "_Configs":
        return _Configs(tuple([strategy.ops[op.name] for op in self.sim.ops]))

    def time(self, key: "_Configs", strategy: Strategy) -> float:
        """Predicted seconds of one iteration, whether or not the strategy fits the memory."""
        t = self.times.get(key)
        if t is None:
            result = self.sim.simulate(strategy)
            t = self.times[key] = result.time
            self._last = (key, result)
        return t

    def fits(self, key: "_Configs", strategy: Strategy) -> bool:
        """Whether the strategy fits every device's memory: from the last simulation's result
        where it is that strategy's, else from its plans."""
        f = self.fit.get(key)
        if f is None:
            last = self._last
            f = self.fit[key] = last[1].fits if last is not None and last[0] is key else self.sim.memory(strategy)[1]
        return f

    def feasible_time(self, strategy: Strategy) -> float:
        """Predicted seconds of one iteration; infinite when the strategy does not fit the memory."""
        key = self.key(strategy)
        t = self.time(key, strategy)
        return t if self.fits(key, strategy) else math.inf


class _Configs:
    """A strategy's configs in op order, as a key of _Memo's dicts. Its hash is the sum of a term
    per op (its place and its config), so that a proposal's key, which differs from its chain's
    in one op, is made by changing one term (`replaced`): hashing the hundred configs, each a
    Python call, was a fortieth of a proposal."""

    __slots__ = ("configs", "_hash")

    def __init__(self, configs: tuple, hash_: int | None = None):
        self.configs = configs
        self._hash = sum(map(_term, range(len(configs)), configs)) & _MASK if hash_ is None else hash_

    def replaced(self, i: int, config) -> "_Configs":
        """This key with the config at place i replaced by `config`."""
        configs = self.configs
        return _Configs(configs[:i] + (config,) + configs[i + 1:],
                        (self._hash - _term(i, configs[i]) + _term(i, config)) & _MASK)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return isinstance(other, _Configs) and self.configs == other.configs


_MASK = (1 << 64) - 1


def _term(i: int, config) -> int:
    return hash((i, config))


def search(sim: Simulator, budget: int, seed: int = 0, seconds: float | None = None, beta: float | None = None,
           starts=STARTS, model=None, progress=None) -> SearchResult:
    """Search `budget` proposals (and at most `seconds`) over `sim`'s graph; `beta` in 1/seconds
    (default: BETA over the best baseline's time). `model` is what the baselines take (default:
    the simulator's ops)."""
    if not isinstance(sim, Simulator):
        raise TypeError(f"search: sim must be a Simulator (Simulator.for_model(model, machine_model)), got "
                        f"{type(sim).__name__}")
    if not isinstance(budget, (int, np.integer)) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"search: budget must be a positive int (proposals), got {budget!r}")
    budget = int(budget)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"search: seed must be an int >= 0, got {seed!r}")
    if beta is not None and (isinstance(beta, bool) or not isinstance(beta, (int, float, np.integer, np.floating))
                             or not 0 < beta < math.inf):
        raise ValueError(f"search: beta must be a positive finite number (1/seconds), got {beta!r}")
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float, np.number))
                                or not seconds > 0):
        raise ValueError(f"search: seconds must be more than 0 (or None), got {seconds!r}")
    if progress is not None and not callable(getattr(progress, "write", None)):
        raise TypeError(f"search: progress must be a stream with write (sys.stderr, say), got "
                        f"{type(progress).__name__} {progress!r}")
    if model is not None and not hasattr(model, "ops"):
        raise TypeError(f"search: model must be the simulator's ops.Model (what the baselines take) or None, got "
                        f"{type(model).__name__} {model!r}")
    if isinstance(starts, str):   # one start (a name used to be taken letter by letter)
        starts = (starts,)
    unknown = [s for s in starts if s not in STARTS]
    if unknown or not starts:
        raise ValueError(f"search: starts must be some of {list(STARTS)}, got {list(starts)}")
    t0 = time.perf_counter()
    with _collector_paused():
        result = _search(sim, budget, seed, seconds, beta, starts, model, progress, t0)
    result.seconds = time.perf_counter() - t0
    return result


def _search(sim: Simulator, budget: int, seed: int, seconds: float | None, beta: float | None, starts, model,
            progress, t0: float) -> SearchResult:
    """search's work, its arguments checked: the baselines, then the chains."""
    rng = np.random.default_rng(seed)
    graph_ops = model if model is not None else [op for op in sim.ops if op.name != sim.loss]
    baselines = {}
    starting = {}
    memo = _Memo(sim)
    for name, make in BASELINES.items():
        s = _complete(sim, make(graph_ops, sim.machine))
        t = time.perf_counter()
        baselines[name] = memo.feasible_time(s)
        starting[name] = s
        if progress is not None:   # a first graph at 64 devices takes seconds: say what is going on
            progress.write(f"search: baseline {name:8s} {baselines[name] * 1e3:10.3f} ms predicted "
                           f"({time.perf_counter() - t:.1f} s to simulate)\n")
            progress.flush()
    starting["random"] = _complete(sim, random_strategy(graph_ops, sim.machine, rng, shaped=True))
    best_name = min(baselines, key=baselines.get)
    best, best_time = starting[best_name], baselines[best_name]
    if beta is None:
        beta = BETA / best_time if math.isfinite(best_time) and best_time > 0 else 1.0
    result = SearchResult(best, best_time, baselines)
    bar = _Bar(progress, budget)
    deadline = None if seconds is None else t0 + seconds
    _chains(sim, result, starting, baselines, starts, budget, rng, beta, deadline, bar, memo)
    bar.close()
    return result


@contextlib.contextmanager
def _collector_paused():
    """No cycle collection while a search runs. The simulator's caches are most of the objects
    alive and grow with every new part, so the collector's passes over them grew too (1.8 ms of
    a 14 ms simulation late in a 64-K80 search; the baselines' first graphs took 4.0 s rather
    than 2.6 in a process that held a million objects already), while a proposal makes no
    reference cycle (tests/test_search.py) and a first graph a few hundred small ones: memory
    is freed by reference counts. At the end, what the search made goes to the oldest
    generation with the rest (frozen, then unfrozen) rather than staying young, where the next
    young collection would walk millions of objects (1.3 s)."""
    enabled = gc.isenabled()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        if enabled:
            gc.enable()


@dataclass
class _Chain:
    """One Metropolis-Hastings chain: where it stands, its best time, proposals since that improved."""

    start: str
    current: Strategy
    key: "_Configs"   # the current strategy's (_Memo)
    current_time: float
    best: float
    since: int = 0


def _chains(sim: Simulator, result: SearchResult, starting: dict, baselines: dict, starts, budget: int, rng,
            beta: float, deadline: float | None, bar: "_Bar", memo: _Memo) -> None:
    """The Metropolis-Hastings chains into `result`: one per start for BURN_IN of the budget (shared
    out in turn), then the chain that stands lowest goes on with the rest. A chain's descent is
    long (tiny Inception-v3 on 64 K80s: 3,000-4,000 proposals from any of the three starts), so
    three equal shares left each chain short of the bottom. Proposals change the model's ops,
    not the loss op: a strategy file names the model's ops, and a run gives the loss its default
    config, as _complete does here."""
    ops = [op for op in sim.ops if op.name != sim.loss]
    neighbours = _neighbours(sim.ops)
    burn = max(min(budget, len(starts)), round(budget * BURN_IN))
    shares = [burn // len(starts) + (1 if i < burn % len(starts) else 0) for i in range(len(starts))]
    chains = []
    for start, n in zip(starts, shares):
        if n == 0:   # a budget smaller than the starts: this chain makes no proposal, so is not timed
            continue
        t = baselines.get(start) if start in baselines else memo.feasible_time(starting[start])
        chain = _Chain(start, starting[start], memo.key(starting[start]), t, t)
        chains.append(chain)
        _walk(sim, chain, n, ops, neighbours, result, rng, beta, deadline, bar, memo)
    leader = min(chains, key=lambda c: c.current_time)
    leader.since = 0
    _walk(sim, leader, budget - result.proposals, ops, neighbours, result, rng, beta, deadline, bar, memo)


def _walk(sim: Simulator, chain: _Chain, n: int, ops, neighbours, result: SearchResult, rng, beta: float,
          deadline: float | None, bar: "_Bar", memo: _Memo) -> None:
    """`n` proposals of `chain` (fewer at the deadline, or once its best has not improved for n / 2)."""
    for _ in range(n):
        if deadline is not None and time.perf_counter() > deadline:
            break
        op = ops[int(rng.integers(len(ops)))]
        config = _propose(sim, op, chain.current, neighbours[op.name], rng)
        proposal = chain.current.replace(op.name, config)
        key = chain.key.replaced(memo.place[op.name], config)
        t = memo.time(key, proposal)
        result.proposals += 1
        if t <= chain.current_time or rng.random() < math.exp(beta * (chain.current_time - t)):
            if memo.fits(key, proposal):
                chain.current, chain.key, chain.current_time = proposal, key, t
                result.accepted += 1
            else:
                result.infeasible += 1
        if chain.current_time < chain.best:
            chain.best, chain.since = chain.current_time, 0
        else:
            chain.since += 1
        if chain.current_time < result.best_time:
            result.best, result.best_time = chain.current, chain.current_time
            result.history.append((result.proposals, chain.current_time))
        bar.show(result.proposals, result.best_time)
        if chain.since > n // 2:
            break


def _neighbours(ops) -> dict[str, list[str]]:
    """Op name -> the ops it reads from and the ops that read it, in graph order."""
    producer = {t.name: op.name for op in ops for t in op.outputs}
    out: dict[str, list[str]] = {op.name: [] for op in ops}
    for op in ops:
        for t in op.inputs:
            src = producer.get(t.name)
            if src is not None and src != op.name:
                out[op.name].append(src)
                out[src].append(op.name)
    return out


def _propose(sim: Simulator, op, current: Strategy, neighbours: list[str], rng):
    """A config for `op`: a neighbour's config under `current` where one is drawn (NEIGHBOUR_SHARE of
    the time), fits the op and is not the op's own, else strategies.random.proposal_config's. A
    neighbour's config that the op already has would make a proposal that changes nothing: from
    data parallelism, where every op has the same config, most of them did (answered at once by
    the memo, they made the search look faster and move slower)."""
    if neighbours and rng.random() < NEIGHBOUR_SHARE:
        config = current.ops[neighbours[int(rng.integers(len(neighbours)))]]
        try:
            config = resolve_config(op, config, sim.machine)
        except ConfigError:
            config = None   # another tile space: a drawn config instead
        if config is not None and config != current.ops.get(op.name):
            return config
    return proposal_config(op, sim.machine, rng)


def _complete(sim: Simulator, strategy: Strategy) -> Strategy:
    """The strategy with every op of the simulator's graph named (the loss op included)."""
    configs = sim.configs(strategy)
    return Strategy(sim.fingerprint, configs)


# ---- command line --------------------------------------------------------------------------------
def app_graph(name: str, batch_size: int | None = None, tiny: bool = False, dtype: str = "float32"):
    """(the graph of app `name` built without weights, the tensor its loss applies to), at its full
    or tiny sizes; the app's batch (App.batch_for) unless given; its floats in `dtype`, the apps'
    --dtype (apps.cli.dtype_problem says where an app computes in float32 whatever it is given)."""
    from apps.cli import app_named, build_model
    app = app_named(name)
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"app_graph: batch_size must be at least 1, got {batch_size}")
    return build_model(app.build, app.sizes_for(tiny), batch_size or app.batch_for(tiny), dtype=dtype,
                       weights=False)


def app_source(name: str, model, tiny: bool = False, seed: int = 0):
    """The batch source app `name` trains `model` (app_graph's) on: Model.train_on's source(step, lo,
    hi), for the simulator to time its source tasks (Simulator's `source`)."""
    from apps.cli import app_named, batch_source
    app = app_named(name)
    return batch_source(app.make_batch, model, app.sizes_for(tiny), seed)


def app_optimizer(name: str, tiny: bool = False, kind: str | None = None):
    """The optimizer app `name` trains with (`kind`, 'sgd' or 'adam', default the app's), at the
    app's rate: its updates and state are part of the step the simulator times."""
    from apps.cli import app_named
    return app_named(name).optimizer_for(tiny, kind)


def app_simulator(name: str, machine_model, batch_size: int | None = None, tiny: bool = False, cost=None,
                  optimizer: str | None = None, source: bool = False, dtype: str = "float32") -> tuple:
    """(the graph of app `name` without weights, a Simulator of it on `machine_model` as the app
    trains it): at its batch unless `batch_size`, with its optimizer unless `optimizer` ('sgd',
    'adam'), in `dtype`, timing its batch source where `source`; `cost` as Simulator's."""
    model, output = app_graph(name, batch_size, tiny, dtype)
    return model, simulator_for(name, model, output, machine_model, tiny, cost, optimizer, source)


def simulator_for(name: str, model, output, machine_model, tiny: bool = False, cost=None,
                  optimizer: str | None = None, source: bool = False) -> Simulator:
    """app_simulator's Simulator of a graph `model` of app `name` that app_graph built (the tensor
    `output` its loss applies to), for a caller that checks the graph first."""
    return Simulator.for_model(model, machine_model, cost, optimizer=app_optimizer(name, tiny, optimizer),
                               output=output, source=app_source(name, model, tiny) if source else None)


def _bad_flag(args) -> str | None:
    """What is wrong with the first out-of-range number flag or an output file that could not be
    written ('--flag value: why'), or None: checked before the graph is built."""
    from taskrt.outputs import output_problem
    checks = (("--budget", args.budget, args.budget >= 1, "must be at least 1"),
              ("--nodes", args.nodes, args.nodes is None or args.nodes >= 1, "must be at least 1"),
              ("--batch-size", args.batch_size, args.batch_size is None or args.batch_size >= 1, "must be at least 1"),
              ("--seconds", args.seconds, args.seconds is None or args.seconds > 0, "must be more than 0"),
              ("--seed", args.seed, args.seed >= 0, "must be at least 0"))
    bad = next((f"{flag} {value}: {why}" for flag, value, ok, why in checks if not ok), None)
    unwritable = None if args.output is None else output_problem(args.output)
    if bad is None and unwritable is not None:
        bad = f"-o {args.output}: {unwritable}"
    return bad


#: the most bytes a tensor may have: its regions' rects and byte counts are int64 arrays
MAX_BYTES = 2 ** 62


def _too_big(model) -> str | None:
    """Which tensor of `model` has more bytes than the simulator's int64 arrays count, or None."""
    for op in model.ops:
        for t in (*op.inputs, *op.outputs):
            if math.prod(t.shape) * np.dtype(t.dtype).itemsize > MAX_BYTES:
                return (f"{op.kind} {op.name!r}'s tensor {t.name!r} of shape {tuple(t.shape)} has too many bytes "
                        f"to count")
    return None


def main(argv=None) -> int:
    """python -m strategies.search --app NAME --machine M --budget N -o FILE: search, print the best
    strategy's predicted time beside the baselines', write the strategy file the apps take."""
    from apps.cli import APPS, DTYPES, OPTIMIZERS, DefaultsHelp, dtype_problem
    from strategies.machine_model import MachineError, load_machine
    from tools import LineParser

    p = LineParser(prog="python -m strategies.search", description=main.__doc__,
                   formatter_class=DefaultsHelp)
    p.add_argument("--app", required=True, choices=sorted(APPS), help="the network to search for")
    p.add_argument("--tiny", action="store_true", help="its scaled-down configuration")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default: the app's)")
    p.add_argument("--machine", default="local", help="a machine model: p100, k80, h100, local, or a file")
    p.add_argument("--nodes", type=int, default=None, help="nodes of the machine model (default: its own)")
    p.add_argument("--budget", type=int, default=1000, help="proposals")
    p.add_argument("--seconds", type=float, default=None, help="stop after this long")
    p.add_argument("--seed", type=int, default=0, help="the random seed of the chains")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=None,
                   help="the optimizer the app will train with (its --optimizer; default: the app's): its "
                        "updates and state are part of the step")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="the app's floats (its --dtype)")
    p.add_argument("-o", "--output", default=None, help="write the best strategy here")
    args = p.parse_args(argv)
    from taskrt.machine import mpi_world_size_from_env
    try:
        under_mpiexec = mpi_world_size_from_env() > 1
    except ValueError as e:   # TASKRT_MPI itself
        print(f"error: {e}", file=sys.stderr)
        return 2
    if under_mpiexec:   # every rank searched alone and wrote the same -o
        print("error: python -m strategies.search runs in one process, not under mpiexec: it simulates the "
              "machine model's ranks itself (the apps' --search-budget searches before an MPI run)", file=sys.stderr)
        return 2
    bad = _bad_flag(args)
    if bad is not None:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    try:
        mm = load_machine(args.machine, nodes=args.nodes)
    except MachineError as e:
        print(f"error: --machine {args.machine}: {e}", file=sys.stderr)
        return 2
    model, output = app_graph(args.app, args.batch_size, args.tiny, args.dtype)
    problems = (("--batch-size", args.batch_size, _too_big(model)),
                ("--dtype", args.dtype, dtype_problem(model, args.dtype, args.app)))
    for flag, value, problem in problems:
        if problem is not None:
            print(f"error: {flag} {value}: {problem}", file=sys.stderr)
            return 2
    sim = simulator_for(args.app, model, output, mm, args.tiny, optimizer=args.optimizer, source=True)
    result = search(sim, args.budget, args.seed, args.seconds, model=model, progress=sys.stderr)
    problem = nothing_fits(result, sim)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    named = Strategy(args.app, {op.name: result.best.ops[op.name] for op in model.ops})
    if args.output:
        named.save(args.output)
    for name, t in sorted(result.baselines.items(), key=lambda kv: kv[1]):
        print(f"  {name:8s} {t * 1e3:10.3f} ms")
    print(f"  {'searched':8s} {result.best_time * 1e3:10.3f} ms  ({result.speedup_over_baselines():.2f}x the best "
          f"baseline, {result.proposals} proposals in {result.seconds:.1f} s)")
    print(json.dumps({"app": args.app, "machine": mm.name, "devices": mm.num_devices,
                      "batch_size": model.inputs[0].shape[0], "optimizer": sim.optimizer.kind, "dtype": args.dtype,
                      "proposals": result.proposals,
                      "seconds": round(result.seconds, 3), "best_ms": result.best_time * 1e3,
                      "baselines_ms": {k: finite_or_none(v * 1e3) for k, v in result.baselines.items()},
                      "speedup_over_best_baseline": finite_or_none(result.speedup_over_baselines()),
                      "strategy": args.output}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
