"""The command line every benchmark app shares: flags, checks before any work, training, report.

An app module gives a builder, its full and tiny sizes and a synthetic batch maker, together
with its training defaults as its `APP`, and its `main` calls `run(APP, argv)`:

    from apps.cli import App, run

    FULL = {"features": 784, "hidden": 1024, "classes": 10}       # the paper's configuration
    TINY = {"features": 64, "hidden": 64, "classes": 10}          # same network, seconds on a CPU

    def build(model, batch_size, dtype="float32", features=784, hidden=1024, classes=10):
        x = model.input((batch_size, features), dtype, name="x")  # names are what strategies use
        return model.softmax(model.dense(model.dense(x, hidden, activation="relu"), classes))

    def make_batch(rng, model, batch_size, sizes):                # labels must follow the inputs
        x = rng.standard_normal((batch_size, sizes["features"])).astype(np.float32)
        return x, (x[:, :sizes["classes"]].argmax(1))

    APP = App("mlp", build, FULL, TINY, make_batch, batch_size=64, lr=0.05)

    def main(argv=None):
        return run(APP, argv)

Whatever simulates an app's training (its search, its prediction, strategies.search, the demo,
the calibration) takes the batch and the optimizer from `APP` (`app_named`).

Contracts:
- `build(model, batch_size, dtype=..., **sizes)` adds the network to a Model (its inputs of
  batch `batch_size`, floats in `dtype`) and returns the tensor the loss applies to. It must
  build the same graph every time: the checks run it on a graph-only model first.
- `make_batch(rng, model, batch_size, sizes)` returns (inputs, labels) for `batch_size`
  samples drawn from `rng`: inputs as Model.fit takes them (one array, a list in input order,
  or a dict by input name). Anything fixed across samples (class templates, a teacher) must
  come from `model.seed` and `sizes`, never from `rng`. The runs call it for blocks of
  SAMPLES_PER_DRAW samples with rng = default_rng([seed, step, block]), on the rank that needs
  them, so the data of a seed is the same on any number of ranks.

Flags (`--help` lists them with defaults): --batch-size, --iterations, --warmup, --tiny,
--strategy FILE | --baseline {data,model,expert,tensor} | --search-budget N, --machine M,
--export-strategy FILE, --trace, --seed, --cpus-per-rank, --gpus-per-rank, --dtype,
--optimizer, --lr. A bad flag gives one line on stderr,
`error: --FLAG VALUE: what is wrong`, and exit status 2 on every rank, before any rank
computes: every check whose answer could differ between ranks (files, devices) is agreed
over MPI first, so no rank is left waiting. Rank 0 shows a progress line per iteration (a
bar on a terminal) and prints one JSON object last (`RESULT_FIELDS`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable, NoReturn

import numpy as np

from ops.base import SAMPLE, training_error
from ops.lower import compute_processors
from ops.model import Model
from ops.optimizers import SGD, Adam
from ops.strategy import Strategy, StrategyError, model_fingerprint
from ops.strategy import load as load_strategy
from taskrt import Runtime
from taskrt.machine import (Machine, count_from_env, count_gpus, cpus_from_env, gpus_from_env, mpi_rank_from_env,
                            mpi_world_size_from_env, physical_memory, switched_off)
from taskrt.mpi_watchdog import timeout_from_env
from taskrt.outputs import output_problem
from taskrt.tracing import rank_trace_path

#: the benchmark apps, each a module apps.NAME with its APP (an App) and a main() that calls run(APP)
APPS = ("mlp", "alexnet", "resnet101", "inception_v3", "transformer", "rnntc", "rnnlm", "nmt")
BASELINE_NAMES = ("data", "model", "expert", "tensor")
DTYPES = ("float32", "float64")
OPTIMIZERS = {"sgd": lambda lr: SGD(lr=lr, momentum=0.9), "adam": lambda lr: Adam(lr=lr)}
#: the first iterations left out of the timing unless --warmup says (fewer where the run has fewer)
WARMUP = 2
#: what the last line of a run (one JSON object) holds
RESULT_FIELDS = ("app", "ranks", "devices", "batch_size", "iterations", "warmup", "samples_per_s",
                 "mean_iteration_s", "median_iteration_s", "predicted_iteration_s", "first_loss", "final_loss",
                 "strategy", "tiny", "dtype", "seed", "optimizer", "lr", "parameters", "trace")


class FlagError(ValueError):
    """A flag whose value cannot run; the message names the flag and the value."""


@dataclass(frozen=True)
class App:
    """What an app gives the command line: its name (the model name strategy files use),
    builder, sizes, batch maker and training defaults."""

    name: str
    build: Callable
    full: dict
    tiny: dict
    make_batch: Callable
    batch_size: int = 64
    tiny_batch_size: int = 8
    optimizer: str = "sgd"
    lr: float = 0.01
    tiny_lr: float | None = None   # the learning rate with --tiny, where it differs
    loss: str = "sparse_categorical_crossentropy"
    description: str = ""

    def sizes_for(self, tiny: bool) -> dict:
        return dict(self.tiny if tiny else self.full)

    def lr_for(self, tiny: bool) -> float:
        return self.tiny_lr if tiny and self.tiny_lr is not None else self.lr

    def batch_for(self, tiny: bool) -> int:
        return self.tiny_batch_size if tiny else self.batch_size

    def optimizer_for(self, tiny: bool, kind: str | None = None, lr: float | None = None):
        """The optimizer a run trains with: `kind` ('sgd', 'adam'; default the app's) at `lr`
        (default the app's rate)."""
        return OPTIMIZERS[kind or self.optimizer](self.lr_for(tiny) if lr is None else lr)


def app_named(name: str) -> App:
    """The App of the app module apps.`name`."""
    import importlib
    if name not in APPS:
        raise ValueError(f"no app named {name!r}; the apps are {', '.join(APPS)}")
    return importlib.import_module(f"apps.{name}").APP


def run(app: App, argv=None) -> dict:
    """Parse `argv` (default sys.argv[1:]), check it, train, print the report; returns the report
    (on every rank)."""
    try:
        args, problem = parser(app).parse_args(argv), None
    except FlagError as e:   # agreed below: a rank that ended here alone left the others waiting in MPI's start
        args, problem = None, str(e)
    ranks = _world_size()
    _agree(problem, ranks)
    if args.lr is None:
        args.lr = app.lr_for(args.tiny)
    _agree(_differing_flag(vars(args), ranks), ranks)
    return train(app, args, check(app, args))


def fail(message: str) -> NoReturn:
    """One line on stderr and exit status 2. Every rank calls it with the same message (the same
    flags, or the problem the ranks agreed on), so only rank 0 prints it."""
    try:
        rank = mpi_rank_from_env()
    except ValueError:   # TASKRT_MPI itself is what is wrong: every rank says so
        rank = 0
    if rank == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


# ---- flags --------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as a FlagError (run agrees on it over the ranks, then
    prints one line, no usage block, and exits 2)."""

    def error(self, message):
        raise FlagError(message)


def at_least(least: int):
    """An argparse type: an integer of at least `least` (argparse then names the flag)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} must be >= {least}")
        return value
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} must be a positive number")
    return value


def parser(app: App) -> argparse.ArgumentParser:
    """The app's flags, with its defaults in --help."""
    p = _Parser(prog=f"python -m apps.{app.name}", description=app.description or None)
    p.add_argument("--batch-size", type=at_least(1), default=None, metavar="N",
                   help=f"samples per iteration (default: {app.batch_size}; {app.tiny_batch_size} with --tiny)")
    p.add_argument("--iterations", type=at_least(1), default=10, metavar="N",
                   help="training iterations (default: %(default)s)")
    p.add_argument("--warmup", type=at_least(0), default=None, metavar="N",
                   help=f"first iterations left out of the timing, fewer than --iterations (default: {WARMUP}, "
                        f"at most iterations - 1)")
    p.add_argument("--tiny", action="store_true",
                   help="a scaled-down configuration of the same architecture, seconds on a CPU")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--strategy", metavar="FILE", default=None,
                       help="a strategy file for this model (default: data parallel)")
    which.add_argument("--baseline", choices=BASELINE_NAMES, default=None,
                       help="a baseline strategy (default: data)")
    which.add_argument("--search-budget", type=at_least(1), default=None, metavar="N",
                       help="search a strategy first, N proposals of the MCMC search on the simulator "
                            "(strategies.search), and train with it (default: no search)")
    p.add_argument("--machine", metavar="M", default=None,
                   help="the machine model the search simulates: p100, k80, h100, local or a file; a gpu "
                        "model as it is, which must have as many devices as this run has GPUs, a cpu model "
                        "shaped as the run (default: this machine, as the 'local' model); without "
                        "--search-budget, the strategy trained with is simulated on it, its predicted "
                        "iteration time reported beside the measured one")
    p.add_argument("--export-strategy", metavar="FILE", default=None,
                   help="write the strategy trained with (searched or not) to FILE")
    p.add_argument("--trace", metavar="FILE", default=None,
                   help="write a trace (under MPI one file per rank, the rank in its name; default: none)")
    p.add_argument("--seed", type=at_least(0), default=0, metavar="N",
                   help="seed of the weights and of the synthetic data (default: %(default)s)")
    p.add_argument("--cpus-per-rank", type=at_least(1), default=None, metavar="N",
                   help="CPU processors per rank (default: TASKRT_CPUS, else the node's cores shared by its ranks)")
    p.add_argument("--gpus-per-rank", type=at_least(0), default=None, metavar="N",
                   help="GPUs per rank (default: TASKRT_GPUS, else those cupy sees, one a rank under MPI)")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="floating-point type of the network (default: %(default)s)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=app.optimizer,
                   help="SGD with momentum 0.9, or Adam (default: %(default)s)")
    tiny_lr = "" if app.tiny_lr is None else f"; {app.tiny_lr} with --tiny"
    p.add_argument("--lr", type=_positive_float, default=None, metavar="RATE",
                   help=f"learning rate (default: {app.lr}{tiny_lr})")
    return p


# ---- checks before any work ---------------------------------------------------------------------
@dataclass
class Plan:
    """What the checks settled: batch size, sizes, the machine and the strategy to compile with."""

    batch_size: int
    sizes: dict
    machine: Machine
    strategy: Strategy
    strategy_name: str
    parameters: int
    predicted_s: float | None = None


def check(app: App, args) -> Plan:
    """Every check of the flags, on every rank, before a Runtime exists; a problem ends every rank.

    Checks whose answer could differ between ranks (files, devices) are agreed over MPI, then
    the machine is discovered (collective) and the rest follows from it and the same files."""
    ranks = _world_size()
    problem, strategy = None, None
    try:
        if args.lr > float(np.finfo(args.dtype).max):
            raise FlagError(f"--lr {args.lr:g}: beyond the range of {args.dtype}, the network's type")
        if args.warmup is not None and args.warmup >= args.iterations:
            raise FlagError(f"--warmup {args.warmup}: must be less than --iterations ({args.iterations}): "
                            f"no iteration would be timed")
        _check_devices(args, ranks)
        if args.strategy is not None:
            strategy = _load_strategy(args.strategy)
        env_trace = (os.environ.get("TASKRT_TRACE") or None) if args.trace is None else None
        claimed: dict[str, str] = {}   # real path -> the flag that writes it
        for flag, path in (("--trace", args.trace), ("--export-strategy", args.export_strategy),
                           ("TASKRT_TRACE", env_trace)):
            if path is None:
                continue
            written = path if ranks == 1 or flag == "--export-strategy" else rank_trace_path(path, _rank())
            problem = output_problem(written)   # (on many ranks each rank writes a trace of its own)
            if problem is not None:
                raise FlagError(f"{flag} {path}: {'' if written == path else written + ' '}{problem}")
            other = claimed.setdefault(os.path.realpath(written), flag)
            if other != flag:
                raise FlagError(f"{flag} {path}: the same file as {other}'s: one would overwrite the other")
    except FlagError as e:
        problem = str(e)
    _agree(problem, ranks)
    machine = _discover(args, ranks)
    batch = args.batch_size or app.batch_for(args.tiny)
    sizes = app.sizes_for(args.tiny)
    problem, plan = None, None
    try:
        plan = _check_graph(app, args, batch, sizes, machine, strategy)
    except FlagError as e:
        problem = str(e)
    _agree(problem, ranks)
    if args.search_budget is not None:
        plan = _search(app, args, plan, ranks)
    elif args.machine is not None:
        plan = _predict(app, args, plan, ranks)
    if args.export_strategy is not None:
        _on_rank_zero(lambda: _export(app, plan, args.export_strategy), ranks)
    return plan


def _export(app: App, plan: Plan, path: str) -> None:
    """Write the plan's strategy to --export-strategy's file (a write that fails there, as on a full
    disk, is a flag error: every rank ends, none waits for rank 0)."""
    try:
        Strategy(app.name, dict(plan.strategy.ops)).save(path)
    except OSError as e:
        raise FlagError(f"--export-strategy {path}: cannot write: {e.strerror or e}") from None


def _rank() -> int:
    if mpi_world_size_from_env() == 1:
        return 0
    from mpi4py import MPI
    return MPI.COMM_WORLD.rank


def _search(app: App, args, plan: Plan, ranks: int) -> Plan:
    """Rank 0 searches (the cost model may measure kernels, so only one rank decides) and every
    rank takes its strategy; a machine model that does not match this run is a flag error."""
    from strategies.search import nothing_fits, search

    def searched():
        graph, sim = _simulator(app, args, plan)
        result = search(sim, args.search_budget, seed=args.seed, model=graph,
                        progress=sys.stderr if sys.stderr.isatty() else None)
        problem = nothing_fits(result, sim)
        if problem is not None:
            raise FlagError(f"--search-budget {args.search_budget}: {problem}")
        names = {op.name for op in graph.ops}
        return Strategy(app.name, {k: v for k, v in result.best.ops.items() if k in names}).to_json(), result.best_time
    text, predicted = _on_rank_zero(searched, ranks)
    return Plan(plan.batch_size, plan.sizes, plan.machine, Strategy.from_json(text), "searched", plan.parameters,
                predicted)


def _predict(app: App, args, plan: Plan, ranks: int) -> Plan:
    """The plan with its strategy's iteration time predicted on --machine's model (rank 0 simulates)."""
    def simulated():
        _, sim = _simulator(app, args, plan)
        return sim.simulate(dict(plan.strategy.ops)).time
    return dataclasses.replace(plan, predicted_s=_on_rank_zero(simulated, ranks))


def _simulator(app: App, args, plan: Plan):
    """(the app's graph without weights, a Simulator of it on --machine's model, timing its batch source
    and the updates of --optimizer)."""
    from strategies.simulator import Simulator
    mm = _machine_model(args, plan.machine)
    graph, output = build_model(app.build, plan.sizes, plan.batch_size, dtype=args.dtype, weights=False,
                                runtime=Runtime(machine=plan.machine, execute=False))
    return graph, Simulator.for_model(graph, mm, loss=app.loss,
                                      optimizer=app.optimizer_for(args.tiny, args.optimizer, args.lr),
                                      output=output, source=batch_source(app.make_batch, graph, plan.sizes, args.seed))


def _on_rank_zero(work, ranks: int):
    """work() on rank 0 (the cost model may measure kernels, so only one rank decides), its answer
    sent to every rank; a FlagError it raises ends every rank, and so does any other error (rank 0
    raises it, the others exit with status 2) rather than leave them waiting for the answer."""
    problem, answer, crash = None, None, None
    if _rank() == 0:
        try:
            answer = work()
        except FlagError as e:
            problem = str(e)
        except Exception as e:
            crash = e
            problem = f"rank 0 failed ({type(e).__name__}: {e})"
    if crash is not None:
        if ranks > 1:
            from mpi4py import MPI
            MPI.COMM_WORLD.allgather(problem)   # what the other ranks' _agree waits for
        raise crash
    _agree(problem, ranks)
    if ranks > 1:
        from mpi4py import MPI
        answer = MPI.COMM_WORLD.bcast(answer, root=0)
    return answer


def _machine_model(args, machine: Machine):
    """--machine's model (default: this machine, as the 'local' model). A cpu model describes this
    machine's CPU workers, so it is shaped as this run is (a node a rank, its processors the
    node's devices); any other model's devices must be this run's: of its kind, as many a rank."""
    from strategies.machine_model import MachineError, load_machine
    computing = compute_processors(machine)
    devices, kind = len(computing), machine.processors[computing[0]].kind
    name = "local" if args.machine is None else args.machine
    try:
        mm = load_machine(name)
    except MachineError as e:
        raise FlagError(f"--machine {name}: {e}") from None
    if mm.device.kind != kind:
        hint = ("give a gpu machine model (h100, p100, k80 or a file of this machine's GPUs)" if kind == "gpu" else
                "search for this run with '--machine local' (a strategy for another machine: python -m "
                "strategies.search)")
        raise FlagError(f"--machine {name}: its model's devices are {mm.device.kind}s, but this run computes on "
                        f"{devices} {kind}{'s' * (devices != 1)}; {hint}")
    if kind == "cpu":
        return dataclasses.replace(mm.with_nodes(machine.num_ranks), devices_per_node=devices // machine.num_ranks,
                                   nodes_per_host=max(1, len(machine.ranks_on_host(0))))
    if (mm.nodes, mm.devices_per_node) != (machine.num_ranks, devices // machine.num_ranks):
        raise FlagError(f"--machine {name}: its model has {mm.nodes} node(s) of {mm.devices_per_node} gpus, this run "
                        f"{machine.num_ranks} rank(s) of {devices // machine.num_ranks}; train on a machine that has "
                        f"them (a strategy for another machine: python -m strategies.search)")
    return mm


def _check_devices(args, ranks: int) -> None:
    """GPUs and CPU workers that this node has, for its ranks (all ranks of a one-node run), and the
    TASKRT_ settings of the environment."""
    from strategies.cost import cache_problem, default_cache_path
    local = _ranks_on_this_host(ranks)
    cores = os.cpu_count() or 1
    problem = cache_problem(default_cache_path())
    if problem is not None:
        raise FlagError(problem)
    try:
        env_gpus = gpus_from_env()
        env_cpus = cpus_from_env()
        count_from_env("TASKRT_BLAS_THREADS", "BLAS threads", 1)
        timeout_from_env()
        for switch in ("TASKRT_KEEP_HEAP", "TASKRT_MPI", "TASKRT_MPI_NATIVE", "TASKRT_BIND_CORES"):
            switched_off(switch)
    except ValueError as e:
        raise FlagError(str(e)) from None
    cpus, said = ((args.cpus_per_rank, f"--cpus-per-rank {args.cpus_per_rank}") if args.cpus_per_rank is not None
                  else (env_cpus, f"TASKRT_CPUS={env_cpus}"))
    if cpus is not None and cpus * local > cores:
        on = f"{local} ranks on {socket.gethostname()} need" if local > 1 else f"{socket.gethostname()} would need"
        raise FlagError(f"{said}: {on} {cpus * local} cores, it has {cores}")
    gpus, said = ((args.gpus_per_rank, f"--gpus-per-rank {args.gpus_per_rank}") if args.gpus_per_rank is not None
                  else (env_gpus, f"TASKRT_GPUS={env_gpus}"))
    if gpus:
        visible = count_gpus()
        if gpus * local > visible:
            raise FlagError(f"{said}: {local} rank(s) on {socket.gethostname()} need {gpus * local} GPUs, "
                            f"cupy sees {visible}")


def _ranks_on_this_host(ranks: int) -> int:
    if ranks == 1:
        return 1
    from mpi4py import MPI
    return MPI.COMM_WORLD.allgather(socket.gethostname()).count(socket.gethostname())


def _load_strategy(path: str) -> Strategy:
    try:
        return load_strategy(path)
    except StrategyError as e:
        raise FlagError(f"--strategy {path}: {e.one_line(path)}") from None


def _world_size() -> int:
    """The ranks of this run (mpiexec's), or exit 2 where TASKRT_MPI itself is wrong (every rank says so)."""
    try:
        return mpi_world_size_from_env()
    except ValueError as e:   # before anything can be agreed between ranks
        fail(str(e))


def _agree(problem: str | None, ranks: int) -> None:
    """Exit on every rank if any rank found a problem (the lowest rank's message, naming the rank
    where rank 0 had none), else return."""
    if ranks > 1:
        from mpi4py import MPI
        found = MPI.COMM_WORLD.allgather(problem)
        first = next((r for r, p in enumerate(found) if p is not None), None)
        problem = None if first is None else found[first] + (f" (on rank {first})" if first else "")
    if problem is not None:
        fail(problem)


def _differing_flag(flags: dict, ranks: int) -> str | None:
    """The first flag whose value differs between the ranks, named with each rank's value, or None:
    every rank runs the same program, so a rank given another --lr or --seed trained a model none
    of them asked for (and another strategy failed in MPI's receives)."""
    if ranks == 1:
        return None
    from mpi4py import MPI
    every = MPI.COMM_WORLD.allgather(flags)
    for name in flags:
        values = [f.get(name) for f in every]
        if any(v != values[0] for v in values):
            said = ", ".join(f"{v!r} on rank {r}" for r, v in enumerate(values))
            return f"--{name.replace('_', '-')} differs between the ranks ({said}): every rank takes the same flags"
    return None


def _discover(args, ranks: int) -> Machine:
    """The machine a Runtime made with these flags will have (collective under MPI)."""
    if ranks == 1:
        return Machine.local(args.cpus_per_rank, args.gpus_per_rank)
    return Machine.discover(None, args.cpus_per_rank, args.gpus_per_rank)


def dtype_problem(graph, dtype: str, name: str) -> str | None:
    """Why app `name`'s graph, built in `dtype`, does not compute in it (the recurrent apps and the
    transformer take token ids and compute in float32), or None."""
    floats = {t.dtype for op in graph.ops for t in op.outputs if np.dtype(t.dtype).kind == "f"}
    if floats - {dtype}:
        return f"{name} computes in {', '.join(sorted(floats))} (its inputs are not floats)"
    return None


def _check_graph(app: App, args, batch: int, sizes: dict, machine: Machine, strategy: Strategy | None) -> Plan:
    """Build the graph alone (no weights) and check the dtype, the strategy and the batch against it."""
    graph, output = build_model(app.build, sizes, batch, dtype=args.dtype, weights=False,
                                runtime=Runtime(machine=machine, execute=False))
    cannot_train = training_error(graph.ops)
    if cannot_train is not None:
        raise FlagError(f"--batch-size {batch}: {cannot_train}")
    too_big = _inputs_memory_problem(graph, machine)
    if too_big is not None:
        raise FlagError(f"--batch-size {batch}: {too_big}")
    problem = dtype_problem(graph, args.dtype, app.name)
    if problem is not None:
        raise FlagError(f"--dtype {args.dtype}: {problem}")
    if args.baseline is not None or strategy is None:
        from strategies.baselines import BASELINES
        name = args.baseline or "data"
        strategy = BASELINES[name](graph, machine)
    else:
        name = args.strategy
        _check_batch(graph, strategy, batch, args.strategy)
        try:   # against the ops compile resolves it against: the loss op too (search() names it)
            strategy.resolve(graph.training_graph(app.loss, output)[0], machine, name=app.name,
                             fingerprint=model_fingerprint(graph.ops))
        except StrategyError as e:
            raise FlagError(f"--strategy {args.strategy}: {e.one_line(args.strategy)}") from None
    return Plan(batch, sizes, machine, strategy, name, count_parameters(graph))


def _inputs_memory_problem(graph: Model, machine: Machine) -> str | None:
    """Why this node could not even hold its ranks' shares of the input batch (a lower bound on
    what a step needs, whatever the strategy), or None; None too where the memory is not known."""
    node = physical_memory()
    if node is None:
        return None
    inputs = sum(np.dtype(t.dtype).itemsize * math.prod(t.shape) for t in graph.inputs)
    ranks_here = len(machine.ranks_on_host(mpi_rank_from_env()))
    need = inputs * ranks_here / machine.num_ranks
    if need <= node:
        return None
    return (f"the input batch alone needs {need / 2**30:.1f} GiB on {socket.gethostname()} "
            f"({ranks_here} of {machine.num_ranks} ranks' shares), which has {node / 2**30:.1f} GiB")


def _check_batch(graph: Model, strategy: Strategy, batch: int, path: str) -> None:
    """A strategy that splits an op's samples more ways than the batch has samples."""
    by_name = {op.name: op for op in graph.ops}
    for name, config in strategy.ops.items():
        op = by_name.get(name)
        if op is None or len(config.degrees) != len(op.tile_shape):
            continue
        for s in op.split_dims():
            if s.kind == SAMPLE and config.degrees[s.dim] > batch:
                raise FlagError(f"--strategy {path}: splits {op.kind} {name!r} {config.degrees[s.dim]} ways "
                                f"along the batch, which has {batch} samples (--batch-size)")


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """--help with each flag's default, but for flags whose default is None: their help says what
    happens then ("(default: None)" beside "the app's" said nothing)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


# ---- building and data --------------------------------------------------------------------------
def build_model(build: Callable, sizes: dict, batch_size: int, dtype: str = "float32", seed: int = 0,
                weights: bool = True, runtime: Runtime | None = None) -> tuple[Model, object]:
    """(a Model with the network `build` adds at these sizes, the tensor its loss applies to);
    weights=False builds the graph alone (shapes and weight shapes: counting parameters at full
    size allocates nothing)."""
    model = Model(runtime, seed=seed, weights=weights)
    return model, build(model, batch_size, dtype=dtype, **sizes)


def count_parameters(model: Model) -> int:
    """Trainable weights of a model (built with or without weights), from their shapes."""
    return sum(math.prod(s) for op in model.ops for s in op.weight_shapes().values())


#: samples a batch source draws from one generator (a block): sample i is sample i % BLOCK of the
#: block default_rng([seed, step, i // BLOCK]) makes, so it is the same on any number of ranks. A
#: generator and a make_batch call a sample had cost 90 us a sample in the tiny mlp, 300 in alexnet.
SAMPLES_PER_DRAW = 8


def batch_source(make_batch: Callable, model: Model, sizes: dict, seed: int) -> Callable:
    """source(step, lo, hi) for Model.train_on: samples lo..hi-1 of a step, drawn a block of
    SAMPLES_PER_DRAW at a time by make_batch from default_rng([seed, step, block]), so a sample
    is the same wherever it is made."""
    names = [t.name for t in model.inputs]
    block = SAMPLES_PER_DRAW

    def source(step: int, lo: int, hi: int):
        first = lo // block   # (an empty share draws a block too, for its arrays' shapes)
        parts = [make_batch(np.random.default_rng([seed, step, b]), model, block, sizes)
                 for b in range(first, max(-(-hi // block), first + 1))]
        inputs = [_as_list(p[0], names) for p in parts]
        keep = slice(lo - first * block, hi - first * block)
        stacked = {name: np.concatenate([row[k] for row in inputs])[keep] for k, name in enumerate(names)}
        return stacked, np.concatenate([np.asarray(p[1]) for p in parts])[keep]

    return source


def _as_list(inputs, names: list[str]) -> list:
    if isinstance(inputs, dict):
        return [inputs[name] for name in names]
    if isinstance(inputs, (list, tuple)):
        return list(inputs)
    return [inputs]


# ---- training and the report --------------------------------------------------------------------
def train(app: App, args, plan: Plan) -> dict:
    """Build the model on a Runtime for these flags, train it and report (rank 0 prints)."""
    rt = Runtime(cpus=args.cpus_per_rank, gpus=args.gpus_per_rank, trace=args.trace)
    with rt:
        model, output = build_model(app.build, plan.sizes, plan.batch_size, dtype=args.dtype, seed=args.seed,
                                    runtime=rt)
        model.compile(app.optimizer_for(args.tiny, args.optimizer, args.lr), loss=app.loss, output=output,
                      strategy=plan.strategy)
        source = batch_source(app.make_batch, model, plan.sizes, args.seed)
        progress = Progress(app.name, args.iterations, sys.stdout if rt.rank == 0 else None)
        losses, times = [], []
        start = time.perf_counter()
        for loss in model.train_on(source, args.iterations):
            losses.append(loss)
            times.append(time.perf_counter() - start)
            progress.show(len(losses), loss, times)
            if not math.isfinite(loss):   # (every rank has the same loss, so every rank stops here)
                break
        rank, trace = rt.rank, rt.trace_path
    if not math.isfinite(losses[-1]):
        if rank == 0:
            print(f"error: {app.name}: the loss is {losses[-1]} at iteration {len(losses)} of {args.iterations} "
                  f"({args.optimizer}, --lr {args.lr:g}): training diverged (a smaller --lr may help)", file=sys.stderr,
                  flush=True)
        sys.exit(1)
    warmup = min(WARMUP, args.iterations - 1) if args.warmup is None else args.warmup
    span = times[-1] - (times[warmup - 1] if warmup else 0.0)
    measured = args.iterations - warmup
    steps = np.diff([times[warmup - 1] if warmup else 0.0, *times[warmup:]])
    report = {"app": app.name, "ranks": plan.machine.num_ranks, "devices": len(compute_processors(plan.machine)),
              "batch_size": plan.batch_size, "iterations": args.iterations, "warmup": warmup,
              "samples_per_s": plan.batch_size * measured / span, "mean_iteration_s": span / measured,
              "median_iteration_s": float(np.median(steps)),
              "predicted_iteration_s": plan.predicted_s,
              "first_loss": losses[0], "final_loss": losses[-1], "strategy": plan.strategy_name,
              "tiny": bool(args.tiny), "dtype": args.dtype, "seed": args.seed, "optimizer": args.optimizer,
              "lr": args.lr, "parameters": plan.parameters, "trace": trace}
    if rank == 0:
        if plan.predicted_s is not None:
            median = report["median_iteration_s"]
            print(f"{app.name}: {median * 1e3:.3f} ms an iteration measured (median), {plan.predicted_s * 1e3:.3f} ms "
                  f"predicted ({median / plan.predicted_s:.2f}x)", flush=True)
        print(json.dumps(report), flush=True)
    return report


class Progress:
    """A line per iteration on rank 0: a bar redrawn in place on a terminal, plain lines otherwise."""

    WIDTH = 24

    def __init__(self, name: str, total: int, stream):
        self.name, self.total, self.stream = name, total, stream
        self.bar = stream is not None and stream.isatty()
        self.width = 0

    def show(self, done: int, loss: float, times: list[float]) -> None:
        if self.stream is None:
            return
        took = times[-1] - (times[-2] if len(times) > 1 else 0.0)
        if self.bar:
            filled = self.WIDTH * done // self.total
            line = f"\r{self.name} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{self.total}  " \
                   f"loss {loss:.4f}  {took:.3f} s/it"
            self.width = max(self.width, len(line))
            self.stream.write(line.ljust(self.width) + ("\n" if done == self.total else ""))
        else:
            self.stream.write(f"{self.name} iteration {done}/{self.total}  loss {loss:.4f}  {took:.3f} s\n")
        self.stream.flush()
