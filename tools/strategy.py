"""Look at strategy files: a table of their configs, a drawing of the graph by device, a diff,
what each device holds at its peak.

    python -m tools.strategy show FILE [--app NAME [--tiny] [--batch-size N]]
    python -m tools.strategy draw FILE --app NAME [--tiny] [--batch-size N] -o out.png [--engine auto|dot|matplotlib]
    python -m tools.strategy diff A B
    python -m tools.strategy memory FILE --app NAME [--tiny] [--batch-size N] [--machine M] [--nodes N] [--top K]
                                   [--optimizer sgd|adam] [--dtype float32|float64]

`show` lists each op's degrees, named by SOAP kind when the app gives the op (S sample,
A attribute, P parameter, R reduce: "S2 P2"), its devices and, given the app, its kind and
output shape. `draw` lays the app's ops out in layers of their topological order, an edge
from each producer to its consumers, each op coloured by the set of devices its tiles run
on (graphviz's `dot` when it is on PATH, else matplotlib). `diff` prints the ops whose
configs differ and exits 1 if any do, like diff(1). `memory` prints, per device of the
machine model (default `local`), the peak bytes a training step holds there under the
strategy against the device's memory, where in the step the peak falls and the `--top`
largest regions held then (strategies/memory.py; exit 1 where a device is over), the app
trained as it trains by default (its batch and optimizer, float32) unless the flags say. A
missing or malformed file, an unknown app or a strategy that does not fit the app gives one
line on stderr and exit 2.
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Sequence

from ops.base import Op
from ops.lower import ConfigError, TileConfig, check_degrees, compute_devices, compute_processors
from ops.strategy import Strategy, StrategyError, is_fingerprint, load, model_fingerprint
from strategies.memory import place_name, step_holdings
from taskrt.outputs import output_problem
from tools import LineParser, exit_with, fail, png_problem

#: one letter per SOAP kind, as in SplitDim's str
LETTERS = {"sample": "S", "attribute": "A", "parameter": "P", "reduce": "R"}
#: inches per layer (down) and per op in the widest layer (across), and the figure's dpi
LAYER_IN, COLUMN_IN, DPI = 0.9, 1.8, 100
#: the legend's entries and a device set's characters there, at most (the rest is said, not drawn)
LEGEND_ENTRIES, LEGEND_CHARS = 12, 24
DEFAULT = "default"


class ToolError(Exception):
    """A problem with the command's input; its message is the one line printed."""


# ---- reading ------------------------------------------------------------------------------------
def read(path: str) -> Strategy:
    """The strategy in `path`; ToolError with its problems on one line."""
    try:
        return load(path)
    except StrategyError as e:
        raise ToolError(_named_once(e, path)) from None


def _named_once(e: StrategyError, path: str | None) -> str:
    """A StrategyError's line with the file named once, first."""
    line = e.one_line(path)
    return line if not path or line.startswith(path) else f"{path}: {line}"


def app_ops(app: str, tiny: bool = False, batch: int | None = None) -> tuple[list[Op], str]:
    """(the ops app `app` trains, its loss op last, built without weights; the fingerprint of
    its graph, which has no loss op)."""
    from apps.cli import APPS, app_named
    from strategies.search import app_graph
    if app not in APPS:
        raise ToolError(f"--app {app}: unknown app; the apps are {', '.join(APPS)}")
    if batch is not None and batch < 1:
        raise ToolError(f"--batch-size {batch}: must be at least 1")
    model, output = app_graph(app, batch, tiny)
    return model.training_graph(app_named(app).loss, output)[0], model_fingerprint(model.ops)


def check_fits(strategy: Strategy, ops: Sequence[Op], fingerprint: str, app: str) -> None:
    """The strategy was made for this app (its name or `fingerprint`), names only its ops (`ops`,
    the loss op among them), and gives each a degree per tile dim; ToolError naming the first
    problem."""
    where = strategy.source or "strategy"
    if is_fingerprint(strategy.model):
        if strategy.model != fingerprint:
            raise ToolError(f"{where}: made for model {strategy.model}, but --app {app} is "
                            f"{fingerprint} (try --tiny or --batch-size)")
    elif strategy.model != app:
        raise ToolError(f"{where}: made for model {strategy.model!r}, not --app {app}")
    by_name = {op.name: op for op in ops}
    for name, config in strategy.ops.items():
        op = by_name.get(name)
        if op is None:
            raise ToolError(f"{where}: op {name!r} is not in --app {app}")
        if len(config.degrees) != len(op.tile_shape):
            raise ToolError(f"{where}: op {name!r} ({op.kind}) has {len(op.tile_shape)} tile dims, "
                            f"the strategy gives {len(config.degrees)} degrees")
        try:
            check_degrees(op, config)
        except ConfigError as e:
            raise ToolError(f"{where}: {e}") from None


# ---- show ---------------------------------------------------------------------------------------
def split_text(config: TileConfig | None, op: Op | None = None) -> str:
    """Degrees named by SOAP kind ("S2 P2") given the op, else "2x1x1"; "1" for one tile."""
    if config is None:
        return DEFAULT
    if op is None:
        return "x".join(map(str, config.degrees))
    kinds = {s.dim: LETTERS[s.kind] for s in op.split_dims()}
    parts = [f"{kinds.get(d, '?')}{n}" for d, n in enumerate(config.degrees) if n > 1]
    return " ".join(parts) or "1"


def devices_text(config: TileConfig | None) -> str:
    if config is None or config.devices is None:
        return DEFAULT
    return number_ranges(config.devices)


def number_ranges(numbers: Sequence[int]) -> str:
    """The numbers in their order, three or more consecutive ones as a range: 0-3,8,10,11 (a
    strategy on 1,024 devices listed each of them)."""
    parts, start = [], 0
    for i in range(1, len(numbers) + 1):
        if i == len(numbers) or numbers[i] != numbers[i - 1] + 1:
            run = numbers[start:i]
            parts += [f"{run[0]}-{run[-1]}"] if len(run) >= 3 else [str(n) for n in run]
            start = i
    return ",".join(parts)


@dataclass(frozen=True)
class Row:
    """One line of `show`: the op's name, kind, split, devices and output shape ('' when unknown)."""

    name: str
    kind: str
    split: str
    devices: str
    shape: str


def rows(strategy: Strategy, ops: Sequence[Op] | None = None) -> list[Row]:
    """The strategy's ops in file order, or, given the app's ops, every op in graph order."""
    if ops is None:
        return [Row(name, "", split_text(c), devices_text(c), "") for name, c in strategy.ops.items()]
    out = []
    for op in ops:
        config = strategy.ops.get(op.name)
        shape = " ".join("x".join(map(str, t.shape)) for t in op.outputs)
        out.append(Row(op.name, op.kind, split_text(config, op), devices_text(config), shape))
    return out


def format_table(table: list[Row]) -> str:
    """Columns padded to their widest cell; columns empty in every row left out."""
    heads = ("op", "kind", "split", "devices", "output")
    cols = [[h] + [getattr(r, f) for r in table] for h, f in zip(heads, Row.__dataclass_fields__)]
    cols = [c for c in cols if any(c[1:])]
    widths = [max(map(len, c)) for c in cols]
    lines = ["  ".join(c[i].ljust(w) for c, w in zip(cols, widths)).rstrip() for i in range(len(table) + 1)]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths)] + lines[1:])


# ---- draw ---------------------------------------------------------------------------------------
def edges(ops: Sequence[Op]) -> list[tuple[str, str]]:
    """(producer, consumer) for every op input made by another op, in graph order."""
    producer = {t.name: op.name for op in ops for t in op.outputs}
    return [(producer[t.name], op.name) for op in ops for t in op.inputs if t.name in producer]


def layers(ops: Sequence[Op]) -> list[list[str]]:
    """Ops by their longest path from a model input (graph order within a layer)."""
    depth: dict[str, int] = {}
    into: dict[str, list[str]] = {op.name: [] for op in ops}
    for a, b in edges(ops):
        into[b].append(a)
    for op in ops:  # model.ops is in topological order: producers come first
        depth[op.name] = 1 + max((depth[a] for a in into[op.name]), default=-1)
    out: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for op in ops:
        out[depth[op.name]].append(op.name)
    return out


def device_groups(strategy: Strategy, ops: Sequence[Op]) -> dict[str, str]:
    """op name -> its device set's label ("0,1", or 'default' where the file leaves it out)."""
    out = {}
    for op in ops:
        config = strategy.ops.get(op.name)
        devs = None if config is None or config.devices is None else sorted(set(config.devices))
        out[op.name] = DEFAULT if devs is None else number_ranges(devs)
    return out


def colours(groups: dict[str, str]) -> dict[str, str]:
    """A hex colour per device-set label, in order of first use, each its own: matplotlib's tab10
    (tab20 for up to 20 sets, else turbo at as many points); grey for 'default'."""
    from matplotlib import colormaps
    from matplotlib.colors import to_hex
    labels = list(dict.fromkeys(groups.values()))
    picked = [lab for lab in labels if lab != DEFAULT]
    n = len(picked)
    cmap = colormaps["tab10"] if n <= 10 else colormaps["tab20"] if n <= 20 else colormaps["turbo"].resampled(n)
    out = {lab: to_hex(cmap(i)) for i, lab in enumerate(picked)}
    if DEFAULT in labels:
        out[DEFAULT] = "#bbbbbb"
    return out


def legend_entries(colour: dict[str, str]) -> list[tuple[str, str]]:
    """(label, colour) of each entry of the drawing's legend: a device set cut at LEGEND_CHARS,
    at most LEGEND_ENTRIES entries, the last saying how many sets are left out."""
    entries = [(f"devices {lab if len(lab) <= LEGEND_CHARS else lab[:LEGEND_CHARS] + ' ...'}", c)
               for lab, c in colour.items()]
    if len(entries) <= LEGEND_ENTRIES:
        return entries
    return entries[:LEGEND_ENTRIES - 1] + [(f"and {len(entries) - LEGEND_ENTRIES + 1} more device sets", "white")]


def figure_size(ops: Sequence[Op]) -> tuple[float, float]:
    """(width, height) in inches of the matplotlib drawing: a column per op of the widest layer
    (and one for the legend), a row per layer."""
    ls = layers(ops)
    return COLUMN_IN * (max(map(len, ls), default=1) + 1), LAYER_IN * max(len(ls), 1) + 0.6


def draw_matplotlib(strategy: Strategy, ops: Sequence[Op], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    groups = device_groups(strategy, ops)
    colour = colours(groups)
    by_name = {op.name: op for op in ops}
    ls = layers(ops)
    width = max(map(len, ls), default=1)
    pos = {name: ((i + 0.5) * width / len(layer), -depth) for depth, layer in enumerate(ls)
           for i, name in enumerate(layer)}
    fig, ax = plt.subplots(figsize=figure_size(ops), dpi=DPI)
    for a, b in edges(ops):
        ax.annotate("", xy=pos[b], xytext=pos[a],
                    arrowprops=dict(arrowstyle="->", color="#555555", shrinkA=12, shrinkB=12))
    for name, (x, y) in pos.items():
        text = f"{name}\n{by_name[name].kind} {split_text(strategy.ops.get(name), by_name[name])}"
        ax.text(x, y, text, ha="center", va="center", fontsize=7,
                bbox=dict(boxstyle="round", facecolor=colour[groups[name]], edgecolor="#333333"))
    ax.set_xlim(-0.2, width + 0.2)
    ax.set_ylim(-len(ls) + 0.4, 0.6)
    ax.axis("off")
    ax.set_title(title, fontsize=9)
    ax.legend(handles=[Patch(facecolor=c, label=label) for label, c in legend_entries(colour)],
              loc="upper right", fontsize=7, frameon=False)
    fig.subplots_adjust(left=0.01, right=0.99, top=0.92, bottom=0.01)
    fig.savefig(path, dpi=DPI, format="png")
    plt.close(fig)


def dot_source(strategy: Strategy, ops: Sequence[Op], title: str) -> str:
    """The graph in graphviz's language, top to bottom, filled boxes coloured by device set."""
    groups = device_groups(strategy, ops)
    colour = colours(groups)
    lines = ["digraph strategy {", f"  label={_quote(title)}; labelloc=t; rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fontsize=10];']
    for op in ops:
        label = f"{op.name}\\n{op.kind} {split_text(strategy.ops.get(op.name), op)}\\ndevices {groups[op.name]}"
        lines.append(f'  {_quote(op.name)} [label="{label}", fillcolor="{colour[groups[op.name]]}"];')
    lines += [f"  {_quote(a)} -> {_quote(b)};" for a, b in edges(ops)]
    return "\n".join(lines + ["}"]) + "\n"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def draw(strategy: Strategy, ops: Sequence[Op], path: str, title: str, engine: str = "auto") -> str:
    """Write the drawing to `path` (PNG); returns the engine used ('dot' or 'matplotlib')."""
    if engine == "auto":
        engine = "dot" if shutil.which("dot") else "matplotlib"
    if engine == "dot":
        if not shutil.which("dot"):
            raise ToolError("--engine dot: graphviz's dot is not on PATH")
        with tempfile.NamedTemporaryFile("w", suffix=".dot") as f:
            f.write(dot_source(strategy, ops, title))
            f.flush()
            done = subprocess.run(["dot", "-Tpng", "-o", path, f.name], capture_output=True, text=True)
        if done.returncode != 0:
            raise ToolError(f"dot exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    else:
        draw_matplotlib(strategy, ops, path, title)
    return engine


# ---- diff ---------------------------------------------------------------------------------------
def differences(a: Strategy, b: Strategy) -> list[str]:
    """One line per op whose config differs (or that only one strategy names), in A's order then B's;
    first a line saying so where the two are for different models."""
    out = [] if a.model == b.model else [f"model: {a.model} -> {b.model}"]
    for name in dict.fromkeys([*a.ops, *b.ops]):
        ca, cb = a.ops.get(name), b.ops.get(name)
        if ca != cb:
            out.append(f"{name}: {ca if ca is not None else '(not named)'} -> {cb if cb is not None else '(not named)'}")
    return out


# ---- memory -------------------------------------------------------------------------------------
def memory_report(strategy: Strategy, app: str, tiny: bool, batch: int | None, machine: str, nodes: int | None,
                  top: int, optimizer: str | None = None, dtype: str = "float32") -> tuple[list[str], bool]:
    """(the lines `memory` prints, whether every device fits), the app trained with `optimizer`
    ('sgd', 'adam'; default the app's), whose state the weights' shards keep, in `dtype`."""
    from apps.cli import dtype_problem
    from strategies.cost import CostModel
    from strategies.machine_model import _si as si, load_machine
    from strategies.search import app_graph, simulator_for
    try:
        model_machine = load_machine(machine, nodes=nodes)
    except ValueError as e:   # (MachineError among them)
        raise ToolError(f"--machine {machine}: {e}") from None
    model, output = app_graph(app, batch, tiny, dtype)
    problem = dtype_problem(model, dtype, app)
    if problem is not None:
        raise ToolError(f"--dtype {dtype}: {problem}")
    sim = simulator_for(app, model, output, model_machine, tiny, CostModel(model_machine, measured=False), optimizer)
    try:
        view = sim.builder.plan_view(sim.configs(strategy))
    except StrategyError as e:
        lacking = any(d >= len(compute_devices(sim.machine)) for c in strategy.ops.values() for d in c.devices or ())
        hint = f" (is it for another machine than --machine {machine}?)" if lacking else ""
        raise ToolError(_named_once(e, strategy.source) + hint) from None
    except (ConfigError, ValueError) as e:
        raise ToolError(f"{strategy.source or 'strategy'}: {e}") from None
    regions, held, buffers, _ = step_holdings(view, sim.machine)
    first = {}
    for i, p in enumerate(sim.machine.processors):
        first.setdefault(p.memory, i)
    device_of = {proc: k for k, proc in enumerate(compute_processors(sim.machine))}   # the strategy's numbers
    lines, fits = [], True
    for memory, proc in sorted(first.items(), key=lambda kv: kv[1]):
        timeline = held.get(memory)
        if timeline is None or not (timeline.any() or buffers[memory].any()):   # (a host that holds nothing)
            continue
        timeline = timeline + buffers[memory]
        place = int(timeline.argmax())
        peak = int(timeline[place])
        capacity = model_machine.device_of(sim.machine.processors[proc]).mem_bytes
        over = peak > capacity
        fits = fits and not over
        when = ("everything kept for the whole step" if timeline.min() == timeline.max()
                else f"at the {place_name(place, view.ops)}")
        where = (f"device {device_of[proc]}" if proc in device_of
                 else f"host of node {sim.machine.processors[proc].rank}")
        lines.append(f"{where}: {si(peak, 'B')} of {si(capacity, 'B')}{'  OVER' if over else ''}, {when} "
                     f"(reduction buffers {si(int(buffers[memory][place]), 'B')})")
        live = sorted(((nbytes, name) for name, (nbytes, lo, hi) in regions[memory].items() if lo <= place <= hi),
                      reverse=True)
        for nbytes, name in live[:top]:
            lines.append(f"    {si(nbytes, 'B'):>9}  {name}")
    return lines, fits


# ---- command line -------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    from apps.cli import DTYPES, OPTIMIZERS
    p = LineParser(prog="python -m tools.strategy", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=LineParser)

    def app_flags(q, required):
        q.add_argument("--app", required=required, help="the benchmark app the strategy is for")
        q.add_argument("--tiny", action="store_true", help="the app's tiny sizes")
        q.add_argument("--batch-size", type=int, default=None, help="the app's batch (default: the app's own)")

    show = sub.add_parser("show", help="a table of the strategy's configs")
    show.add_argument("file")
    app_flags(show, False)
    drw = sub.add_parser("draw", help="the app's graph coloured by devices, as a PNG")
    drw.add_argument("file")
    app_flags(drw, True)
    drw.add_argument("-o", "--output", required=True, help="the PNG to write")
    drw.add_argument("--engine", choices=("auto", "dot", "matplotlib"), default="auto")
    diff = sub.add_parser("diff", help="the ops whose configs differ")
    diff.add_argument("a")
    diff.add_argument("b")
    mem = sub.add_parser("memory", help="what each device holds at its peak in a training step")
    mem.add_argument("file")
    app_flags(mem, True)
    mem.add_argument("--machine", default="local", help="a machine model: p100, k80, h100, local or a file")
    mem.add_argument("--nodes", type=int, default=None, help="the machine model's nodes (default: its own)")
    mem.add_argument("--top", type=int, default=3, help="the largest regions to list per device (default 3)")
    mem.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=None,
                     help="the optimizer the app trains with (default: the app's): its state is held too")
    mem.add_argument("--dtype", choices=DTYPES, default="float32", help="the app's floats (its --dtype)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "diff":
            lines = differences(read(args.a), read(args.b))
            print("\n".join(lines) if lines else "no differences")
            return 1 if lines else 0
        if args.command == "memory" and args.top < 0:
            raise ToolError(f"--top {args.top}: must be at least 0")
        if args.command == "memory" and args.nodes is not None and args.nodes < 1:
            raise ToolError(f"--nodes {args.nodes}: must be at least 1")
        if args.app is None and (args.tiny or args.batch_size is not None):
            flag = "--tiny" if args.tiny else f"--batch-size {args.batch_size}"
            raise ToolError(f"{flag}: sizes the app given with --app, and none is")
        strategy = read(args.file)
        unwritable = (output_problem(args.output) or png_problem(args.output)) if args.command == "draw" else None
        if unwritable is not None:
            raise ToolError(f"-o {args.output}: {unwritable}")
        ops = None
        if args.app is not None:
            ops, fingerprint = app_ops(args.app, args.tiny, args.batch_size)
            check_fits(strategy, ops, fingerprint, args.app)
        if args.command == "show":
            print(f"{args.file}: model {strategy.model}, {len(strategy.ops)} ops")
            print(format_table(rows(strategy, ops)))
            return 0
        if args.command == "memory":
            lines, fits = memory_report(strategy, args.app, args.tiny, args.batch_size, args.machine, args.nodes,
                                        args.top, args.optimizer, args.dtype)
            print("\n".join(lines))
            return 0 if fits else 1
        engine = draw(strategy, ops, args.output, f"{args.file} ({args.app})", args.engine)
        print(f"wrote {args.output} ({engine})")
        return 0
    except ToolError as e:
        fail(str(e))
    except OSError as e:
        if e.filename is None:   # not a file of ours: stdout's reader gone (exit_with), or worse
            raise
        fail(f"{e.filename}: {e.strerror}")


if __name__ == "__main__":
    exit_with(main)
