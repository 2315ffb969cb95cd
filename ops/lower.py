"""Lowering: an operator graph under parallel configs becomes taskrt launches.

A TileConfig is a tiling plus a placement: `degrees` cut an op's tile space
(`op.tile_shape`) into a grid of tiles, and `devices` name the compute device of each
tile in row-major color order. Lowering gives every tensor a Region and builds, for
every op, partitions whose colors are the tile grid's colors, from the op's own rect
rules (`input_rects`, `weight_rects`, `output_rects`), so what a tile needs is
defined once, in the op; the simulator reads the same launches.

A lowered graph (class Lowering) holds:
- values: tensor name -> Region        every model input, label and activation;
- grads:  tensor name -> Region        float activations on the gradient path (to the loss);
- params: "op.weight" -> ParamRegions  value, gradient and optimizer-state regions;
- stats:  "op.running_mean" -> Region  state an op updates in training (batch_norm's running stats);
- plans:  op name -> OpPlan            the op's config, tiles, partitions and requirement lists;
- saved:  (op name, tile color) -> [x]  the side store: what a tile's forwards keep for their backwards.

Splits beyond independent tiles (ops/base.py declares them, OpPlan lowers them the same way
for every op): the tiles of a split partial dim REDUCE (sum) into zero-filled outputs, and
only the leader of each partial group gets the biases; statistics that tiles share (batch
norm's) are summed through REDUCE into small float64 regions by launches of their own
before the kernels read them; tiles along a split ordered dim (an LSTM's time chunks) are
one launch per position, chained through a small carry region (a carry-grad region in
backward), so that the dependence analysis alone orders them.

Saved tensors: a forward task appends the op's `saved` object to `saved` under its op name
and tile color; the backward task of the same tile pops the oldest (a backward sum's task
reads it before). All of a tile's launches place it on the same processor (the config's
device), so on many ranks the entry is always on the rank that needs it. Backward reads what
forward wrote or what came of it (its outputs, their gradients), so it runs after it; but it
may read neither the outputs nor the inputs (Op.backward_reads: an add), so the next step's
forward of the op can run before it, hence a queue: forwards append in order (they write the
same outputs) and so do backwards pop (they write the same gradients).

Gradients: at the start of a backward pass every grad region is filled with zeros where its
producer's tiles will read it, on their devices (the loss's output grad with ones: the loss
ops' backward then gives the gradient of the mean loss over the batch). Each backward task
REDUCEs (sum) into its inputs' grad regions at its input rects, so the halos of neighbouring
tiles and the consumers of a tensor used twice add up, and into the weight-grad regions at
its weight rects, so sample-split tiles add up. One exception: a tensor used by one op only,
whose tiles' input rects tile it exactly (no halo, no gap, no two tiles reading the same
part), has its gradient WRITTEN by that op's backward, with no fill before it and no folds
(PyTorch's autograd does the same: a gradient with one contribution is not accumulated).
So has a weight whose tiles' weight rects tile it exactly (one tile, or a split that cuts
the weight rather than replicating it): `OpPlan.writes_weight_grads`.
The optimizer update is an index launch over a disjoint tiling of each weight.

Replay: one training iteration (forward, fills, backward, updates) is one program
(taskrt/program.py): its launches, made once with the markers STEP and VALID in their args
(`Lowering._program`), issued by `rt.issue_program("train_step:<tag>", ...)` with the step's
values in place of the markers. The runtime analyzes it once (twice: the first entry finds
the weights in host memory only) and afterwards makes the recorded nodes again in one go.
Inputs and labels are attached before the block, so the block always starts from the same
state; or the block starts with the batch source's launch (`train_step(source=...)`, what
Model.train_on issues), so that the step's weight copies do not wait for its batch: issued
before the block, the source would be among what the replay's fence stands for. Inference
(`infer_step`) is a program too.
"""
from __future__ import annotations

import collections
import functools
import itertools
import math
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ops.base import SAMPLE, Op, TensorSpec
from taskrt import READ, READ_WRITE, WRITE, Partition, Reduce, Region, req
from taskrt.program import Launch
from taskrt.geometry import Rect, disjoint_cover, shard_degrees
from taskrt.geometry import equal_rects as tile_rects  # the tile of each color: Partition.equal's rule
from taskrt.machine import Machine

SUM = Reduce("sum")


class ConfigError(ValueError):
    """A parallel config that does not fit its op or the machine; the message names both."""


# ---- parallel configs ----------------------------------------------------------------------
@dataclass(frozen=True)
class TileConfig:
    """How an op runs: `degrees` tiles per dim of its tile space, and the processor of each tile.

    `devices[i]` is the compute device of the i-th tile in row-major color order: device k is
    the k-th of `compute_processors` (the k-th GPU, else the k-th CPU), so a config means the
    same on a machine model and on a run whatever their host CPUs; None means tile i of n on
    device i*D//n (see `default_devices`). `str` is short for logs: "2x1x1x1 on [0, 1]".
    """

    degrees: tuple[int, ...]
    devices: tuple[int, ...] | None = None
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        degrees = _int_tuple("degrees", self.degrees)
        if any(d < 1 for d in degrees):
            raise ConfigError(f"TileConfig degrees must all be >= 1, got {degrees}")
        object.__setattr__(self, "degrees", degrees)
        if self.devices is not None:
            devices = _int_tuple("devices", self.devices)
            if len(devices) != self.num_tiles:
                raise ConfigError(f"TileConfig {degrees} has {self.num_tiles} tiles but {len(devices)} devices "
                                  f"{devices}")
            if any(d < 0 for d in devices):
                raise ConfigError(f"TileConfig devices must be device numbers >= 0, got {devices}")
            object.__setattr__(self, "devices", devices)
        # a key of the simulator's caches, hashed thousands of times a proposal: once
        object.__setattr__(self, "_hash", hash((self.degrees, self.devices)))

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        grid = "x".join(str(d) for d in self.degrees) or "scalar"
        return grid if self.devices is None else f"{grid} on {list(self.devices)}"

    @property
    def num_tiles(self) -> int:
        return math.prod(self.degrees)

    def colors(self) -> list[tuple[int, ...]]:
        """Tile colors in row-major order (the order of `devices`)."""
        return list(itertools.product(*(range(d) for d in self.degrees)))

    def to_dict(self) -> dict:
        return {"degrees": list(self.degrees), "devices": None if self.devices is None else list(self.devices)}

    @staticmethod
    def from_dict(d: dict) -> "TileConfig":
        return TileConfig(tuple(d["degrees"]), None if d.get("devices") is None else tuple(d["devices"]))


def _int_tuple(what: str, value) -> tuple[int, ...]:
    try:
        items = tuple(value)
    except TypeError:
        raise ConfigError(f"TileConfig {what} must be a sequence of ints, got {value!r}") from None
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in items):
        raise ConfigError(f"TileConfig {what} must be ints, got {items!r}")
    return tuple(int(v) for v in items)


@functools.lru_cache(maxsize=16)
def compute_processors(machine: Machine) -> tuple[int, ...]:
    """Global indices of the processors tiles run on, device k the k-th: the GPUs if any, else
    every CPU."""
    gpus = tuple(i for i, p in enumerate(machine.processors) if p.kind == "gpu")
    return gpus or tuple(range(len(machine.processors)))


def compute_devices(machine: Machine) -> range:
    """The device numbers of TileConfig.devices on `machine`: 0..D-1, one a compute processor."""
    return range(len(compute_processors(machine)))


def default_devices(machine: Machine, num_tiles: int) -> tuple[int, ...]:
    """Tile i of n on device i*D//n: neighbouring tiles share a device."""
    count = len(compute_processors(machine))
    return tuple(i * count // num_tiles for i in range(num_tiles))


def default_config(op: Op, machine: Machine) -> TileConfig:
    """Data parallelism: the op's sample dim (if it declares one) split over the compute
    processors, min(#processors, batch) ways; otherwise one tile."""
    shape = op.tile_shape
    degrees = [1] * len(shape)
    sample = [s.dim for s in op.split_dims() if s.kind == SAMPLE]
    if sample:
        d = sample[0]
        degrees[d] = max(1, min(len(compute_processors(machine)), shape[d]))
    n = math.prod(degrees)
    return TileConfig(tuple(degrees), default_devices(machine, n))


def resolve_config(op: Op, config: TileConfig, machine: Machine) -> TileConfig:
    """`config` checked against the op and the machine, with its devices filled in."""
    check_degrees(op, config)
    where = f"{op.kind} {op.name!r}"
    devices = config.devices if config.devices is not None else default_devices(machine, config.num_tiles)
    procs = compute_processors(machine)
    for i, dev in enumerate(devices):
        if dev >= len(procs):
            kind = machine.processors[procs[0]].kind
            raise ConfigError(f"{where}: config {config} places tile {i} on device {dev}, but {machine!r} computes on "
                              f"{len(procs)} {kind}{'s' * (len(procs) != 1)}: devices 0..{len(procs) - 1}")
    return TileConfig(config.degrees, devices)


def check_degrees(op: Op, config: TileConfig) -> None:
    """`config`'s degrees checked against the op alone (a degree per tile dim, splitting only
    dims that may be split, no more ways than a dim's extent); ConfigError naming the first
    problem."""
    where = f"{op.kind} {op.name!r}"
    if not isinstance(config, TileConfig):
        raise ConfigError(f"{where}: a config must be a TileConfig, got {type(config).__name__}: {config!r}")
    shape = op.tile_shape
    if len(config.degrees) != len(shape):
        raise ConfigError(f"{where}: config {config} has {len(config.degrees)} degrees but the op's tile space "
                          f"{tuple(shape)} has {len(shape)} dims")
    kinds = {s.dim: s.kind for s in op.split_dims()}
    splittable = ", ".join(f"dim {d} ({k})" for d, k in sorted(kinds.items())) or "none"
    for d, deg in enumerate(config.degrees):
        if deg > 1 and d not in kinds:
            raise ConfigError(f"{where}: config {config} splits dim {d} {deg} ways, but dim {d} may not be split; "
                              f"splittable dims: {splittable}")
        if deg > max(shape[d], 1):
            raise ConfigError(f"{where}: config {config} splits dim {d} ({kinds[d]}) {deg} ways, more than its "
                              f"extent {shape[d]}")


def _is_float(spec: TensorSpec) -> bool:
    return np.dtype(spec.dtype).kind == "f"


# ---- per-op and per-parameter plans ---------------------------------------------------------
@dataclass
class ParamRegions:
    """A trainable weight: its value, its gradient (None off the gradient path) and optimizer state."""

    name: str
    value: Region
    grad: Region | None
    state: dict[str, Region]


class ProgramArg:
    """A marker in the args of a cached program's launches, replaced by its value at each
    issue (Lowering._issue_program): STEP, the training iteration; VALID, the real samples;
    SOURCE, the batch source a step's program makes its batch with."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name.upper()


STEP, VALID, SOURCE_ARG = ProgramArg("step"), ProgramArg("valid"), ProgramArg("source")


def _step_arg(step):
    """A launch's step argument: an int, or the STEP marker of a program."""
    return step if step is STEP else int(step)


@dataclass(frozen=True)
class PlanLaunch:
    """One index launch of an op's plan: `fn` over `colors` with `reqs` and `args`."""

    name: str
    fn: Callable
    colors: list
    reqs: list
    placement: dict
    args: tuple = ()


FORWARD_PHASE, GRAD_FILL_PHASE, ZERO_GRAD_PHASE, BACKWARD_PHASE, UPDATE_PHASE, SOURCE_PHASE = (
    "forward", "grad_fill", "zero_grad", "backward", "update", "source")
#: the name of the launch that makes a step's batch where it is used (Lowering.source_segment)
SOURCE = "source"


@dataclass(frozen=True)
class Segment:
    """The launches of one op in one phase of a step (op None: the graph's own fills), in issue
    order; `fills` names the activation gradients a grad_fill segment fills."""

    op: str | None
    phase: str
    launches: tuple[PlanLaunch, ...]
    fills: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"Segment({self.op or 'graph'} {self.phase}, {len(self.launches)} launches)"


class OpPlan:
    """One op under one config: tiles, partitions, requirement lists and the task kernels.

    A plan issues its op's forward and backward as lists of launches (`forward_launches`,
    `backward_launches`), all driven by what the op declares (ops/base.py):
    - usually one kernel launch over every tile;
    - a config that splits a partial dim makes the tiles REDUCE (sum) their outputs, so a zero
      fill of each output rect (on the device of its first tile) comes first;
    - sums that tiles share: per sum, a zero fill and a launch where every tile REDUCEs its
      `partial_sum`, in the op's order, before the kernel launch reads the totals;
    - a split ordered dim: one kernel launch per position along it, in order (backward: in
      reverse), each tile reading and writing its carry rect (WRITE at the first position), so
      the runtime's dependences chain the positions and nothing else.
    A state rect that several tiles share is updated (READ_WRITE in training) by the first of
    them only; the others read it in inference.

    A kernel gets its requirements' views in the order of the requirement list, then the
    launch args. Forward: inputs, weights, states, sums, carry, outputs | (training, valid,
    step). Backward: inputs, weights, outputs, output grads (those with regions), sums, carry
    grads, then the REDUCE buffers of input grads (inputs with regions) and weight grads.
    `fwd_reqs[training]` and `bwd_reqs` are the kernel launch's lists (at the first position
    along an ordered dim; bwd_reqs None off the gradient path).
    """

    def __init__(self, low: "Lowering", op: Op, config: TileConfig, backward: bool,
                 summarize: Callable | None, like: "OpPlan | None" = None, twin: "OpPlan | None" = None):
        self.op = op
        self.config = config
        self.saved, self._saved_lock = low.saved, low.saved_lock
        self.summarize = summarize
        if like is None:
            if twin is not None and not _twins(twin, op, config):
                raise ValueError(f"OpPlan: {twin!r} is not a plan of an op like {op.kind} {op.name!r} (its kind, "
                                 f"attributes and input shapes) with degrees {config.degrees}")
            before = set(self.__dict__)
            self._shape(low, backward, twin)
            #: the attributes _shape set (what a plan made `like` this one shares)
            self._shaped = tuple(k for k in self.__dict__ if k not in before)
        else:   # (the simulator's search makes a plan per proposal, a third of them of degrees seen before)
            if (like.op is not op or like.config.degrees != config.degrees
                    or ("grad_inputs" in like.__dict__) != backward):
                raise ValueError(f"OpPlan: {like!r} is not a plan of {op.kind} {op.name!r} with degrees "
                                 f"{config.degrees} and backward {backward}")
            self.__dict__.update({k: like.__dict__[k] for k in like._shaped})
            self._shaped = like._shaped
        procs = compute_processors(low.rt.machine)
        self.placement = {color: procs[d] for color, d in zip(self.colors, config.devices)}
        self._zero_outs = _zero_launches(self._outs, self.colors, self.placement) if self.partial else []
        self._zero_sums = {k: _zero_launches([p], self.colors, self.placement) for k, p in self._sums.items()}
        # launches are pure functions of the plan (and of a few flags): made once, issued every
        # step (a step's Python cost is the runtime's budget, and new partitions every step
        # would miss the runtime's cache of mapped launches)
        self._made: dict[tuple, list] = {}

    def _shape(self, low: "Lowering", backward: bool, twin: "OpPlan | None" = None) -> None:
        """What a plan's tiles fix whatever their devices: tiles, rects, partitions and requirement
        lists (a plan of the op with the same degrees, `like`, shares them). A `twin`, a plan of
        another op of the same kind, attributes, input shapes and degrees, gives its tiles and
        rects, and its partitions' checked pieces for this op's regions."""
        if twin is None:
            self._tile_rects(low)
        else:
            self._twin_rects(low, twin)
        self._region_reqs(low, backward)

    def _tile_rects(self, low: "Lowering") -> None:
        """_shape's tiles, their rects and the partitions of the op's regions into them."""
        op, config = self.op, self.config
        self.colors = config.colors()
        self.tiles = tile_rects(op.tile_shape, config.degrees)
        self.in_rects = {c: op.input_rects(t) for c, t in self.tiles.items()}
        self.out_rects = {c: op.output_rects(t) for c, t in self.tiles.items()}
        self.partial = any(s.partial and config.degrees[s.dim] > 1 for s in op.split_dims())
        # with no partial dim split every tile leads its partial group: its weight rects are the op's
        tile_weights = op.tile_weight_rects if self.partial else op.weight_rects
        w_rects = {c: tile_weights(t) for c, t in self.tiles.items()}
        self.weight_names = list(op.weight_shapes())
        self.state_names = list(op.state_shapes())
        self.weight_rects = {c: {k: r[k] for k in self.weight_names} for c, r in w_rects.items()}
        self.state_rects = {c: {k: r[k] for k in self.state_names} for c, r in w_rects.items()}
        self.updated_state_rects = first_users(self.colors, self.state_rects)
        ordered = op.ordered_dim()
        self.ordered = ordered if ordered is not None and config.degrees[ordered] > 1 else None
        self.sum_names = list(op.sum_shapes()) if op.shares_sums(list(self.tiles.values())) else []
        self.carry_names = list(op.carry_shapes()) if self.ordered is not None else []
        name = op.name

        def part(region: Region, rects: dict, label: str) -> Partition:
            return Partition.from_rects(region, rects, name=f"{name}.{label}")

        values = low.values
        self._ins = [part(values[t.name], {c: r[i] for c, r in self.in_rects.items()}, f"in{i}")
                     for i, t in enumerate(op.inputs)]
        self._outs = [part(values[t.name], {c: r[i] for c, r in self.out_rects.items()}, f"out{i}")
                      for i, t in enumerate(op.outputs)]
        self._weights = [part(low.params[f"{name}.{k}"].value, {c: r[k] for c, r in self.weight_rects.items()}, k)
                         for k in self.weight_names]
        self._states = {training: [part(low.stats[f"{name}.{k}"], {c: r[k] for c, r in rects.items()}, k)
                                   for k in self.state_names]
                        for training, rects in ((True, self.updated_state_rects), (False, self.state_rects))}
        sum_shapes, carry_shapes = op.sum_shapes(), op.carry_shapes()
        sum_rects = {c: op.sum_rects(t) for c, t in self.tiles.items()} if self.sum_names else {}
        self._sums = {k: part(Region(sum_shapes[k], "float64", f"{name}.{k}.sum"),
                              {c: r[k] for c, r in sum_rects.items()}, f"sum.{k}")
                      for k in self.sum_names}
        carry_dtype = op.outputs[0].dtype
        carry_rects = {c: op.carry_rects(t) for c, t in self.tiles.items()} if self.carry_names else {}
        self._carries = [part(Region(carry_shapes[k], carry_dtype, f"{name}.{k}.carry"),
                              {c: r[k] for c, r in carry_rects.items()}, f"carry.{k}") for k in self.carry_names]

    def _twin_rects(self, low: "Lowering", twin: "OpPlan") -> None:
        """_tile_rects from a twin's: the same tiles and rects, its partitions' pieces (checked when
        the twin was made) on this op's regions of the same bounds."""
        for k in _TILE_GEOMETRY:
            setattr(self, k, getattr(twin, k))
        op, name, values = self.op, self.op.name, low.values
        self._ins = [p.alike(values[t.name], f"{name}.in{i}") for i, (p, t) in enumerate(zip(twin._ins, op.inputs))]
        self._outs = [p.alike(values[t.name], f"{name}.out{i}")
                      for i, (p, t) in enumerate(zip(twin._outs, op.outputs))]
        self._weights = [p.alike(low.params[f"{name}.{k}"].value, f"{name}.{k}")
                         for p, k in zip(twin._weights, self.weight_names)]
        self._states = {training: [p.alike(low.stats[f"{name}.{k}"], f"{name}.{k}")
                                   for p, k in zip(parts, self.state_names)]
                        for training, parts in twin._states.items()}
        self._sums = {k: p.alike(Region(p.region.shape, "float64", f"{name}.{k}.sum"), f"{name}.sum.{k}")
                      for k, p in twin._sums.items()}
        carry_dtype = op.outputs[0].dtype
        self._carries = [p.alike(Region(p.region.shape, carry_dtype, f"{name}.{k}.carry"), f"{name}.carry.{k}")
                         for p, k in zip(twin._carries, self.carry_names)]

    def _region_reqs(self, low: "Lowering", backward: bool) -> None:
        """_shape's requirement lists, and the gradients' partitions where the op is on the
        gradient path."""
        op, name = self.op, self.op.name
        self.fwd_reqs = {training: self._forward_reqs(training, 0) for training in (True, False)}
        self.bwd_reqs = None
        #: (per input, per output) whether backward reads it (Op.backward_reads)
        self.bwd_reads = op.backward_reads()
        self.writes_grads = [False] * len(op.inputs)   # off the gradient path nothing is written
        self.writes_weight_grads = {k: False for k in self.weight_names}
        if not backward:
            return
        grads = low.grads
        self.grad_outputs = [t.name in grads for t in op.outputs]
        self.grad_inputs = [t.name in grads for t in op.inputs]
        self._gouts = [self._outs[i].alike(grads[t.name], f"{name}.gout{i}")
                       for i, t in enumerate(op.outputs) if t.name in grads]
        self._gins = [self._ins[i].alike(grads[t.name], f"{name}.gin{i}")
                      for i, t in enumerate(op.inputs) if t.name in grads]
        # an input gradient that only this op (at this input) contributes to, and that its tiles
        # cover without overlap, is WRITTEN by them: no zero fill, no reduction buffers, no folds
        gin_parts = iter(self._gins)
        self.writes_grads = [t.name in grads and _written_whole(next(gin_parts), low.sole_consumers.get(t.name),
                                                                (name, i))
                             for i, t in enumerate(op.inputs)]
        self._gws = [w.alike(low.params[f"{name}.{k}"].grad, f"{name}.{k}.grad")
                     for k, w in zip(self.weight_names, self._weights)]
        # a weight gradient whose tiles' rects tile the weight exactly (no two tiles share a block:
        # no replicas, no chunks of an ordered dim) is WRITTEN by them: no zero fill, no folds
        self.writes_weight_grads = {k: disjoint_cover(list(p.rects.values()), p.region.rect)
                                    for k, p in zip(self.weight_names, self._gws)}
        self._carry_grads = [p.alike(Region(p.region.shape, p.region.dtype, f"{p.region.name}.grad"),
                                     f"{name}.carry.{k}.grad") for k, p in zip(self.carry_names, self._carries)]
        self.bwd_reqs = self._backward_reqs(self._positions()[-1][0])

    def __repr__(self) -> str:
        return f"OpPlan({self.op.kind} {self.op.name!r}, {self.config})"

    def own_regions(self) -> list[Region]:
        """The regions this plan made: its tiles' shared sums, an ordered dim's carries and their gradients."""
        return [p.region for p in (*self._sums.values(), *self._carries, *self._carry_grads)]

    def _fail(self, color, message: str) -> RuntimeError:
        return RuntimeError(f"{self.op.kind} {self.op.name!r} tile {color} ({self.tiles[color]!r}): {message}")

    # ---- launches --------------------------------------------------------------------------
    def _positions(self) -> list[tuple[int, list[tuple]]]:
        """(position, its colors) along the split ordered dim, in order; one position of every
        color when the ordered dim (if any) is not split."""
        if self.ordered is None:
            return [(0, self.colors)]
        d = self.ordered
        return [(k, [c for c in self.colors if c[d] == k]) for k in range(self.config.degrees[d])]

    @property
    def skips_input_grads(self) -> bool:
        """Whether the op's backward computes its weight gradients alone: no one reads any of its
        inputs' gradients, and its kernel is told so (out=False, Op.writes_out) and skips them."""
        return self.op.writes_out and not any(self.grad_inputs)

    def _forward_sum_names(self, training: bool) -> list[str]:
        return list(self.op.forward_sums(training)) if self.sum_names else []

    def _backward_sum_names(self) -> list[str]:
        return list(self.op.backward_sums()) if self.sum_names else []

    def _forward_reqs(self, training: bool, position: int) -> list:
        states = self._states[training]
        return ([req(p, READ) for p in self._ins + self._weights]
                + [req(p, READ_WRITE if training else READ) for p in states]
                + [req(self._sums[k], READ) for k in self._forward_sum_names(training)]
                + [req(p, WRITE if position == 0 else READ_WRITE) for p in self._carries]
                + [req(p, SUM if self.partial else WRITE) for p in self._outs])

    def _backward_read(self) -> tuple[list, list]:
        """(the input partitions, the output partitions) that backward reads."""
        ins, outs = self.bwd_reads
        return ([p for p, r in zip(self._ins, ins) if r], [p for p, r in zip(self._outs, outs) if r])

    def _backward_reqs(self, position: int) -> list:
        last = self._positions()[-1][0]
        ins, outs = self._backward_read()
        return ([req(p, READ) for p in ins + self._weights + outs + self._gouts]
                + [req(self._sums[k], READ) for k in self._backward_sum_names()]
                + [req(p, WRITE if position == last else READ_WRITE) for p in self._carry_grads]
                + [req(p, WRITE if whole else SUM)
                   for p, whole in zip(self._gins, [w for w, has in zip(self.writes_grads, self.grad_inputs) if has])]
                + [req(p, WRITE if self.writes_weight_grads[k] else SUM) for k, p in zip(self.weight_names, self._gws)])

    def _sum_launches(self, names: list[str], backward: bool) -> list[PlanLaunch]:
        """Per sum in `names`: its zero fill, then every tile REDUCEs its part of it."""
        launches = []
        if backward:
            ins, outs = self._backward_read()
            reads = ins + outs + self._gouts
        else:
            reads = self._ins
        for i, k in enumerate(names):
            reqs = ([req(p, READ) for p in reads] + [req(self._sums[j], READ) for j in names[:i]]
                    + [req(self._sums[k], SUM)])
            launches += self._zero_sums[k]
            launches.append(PlanLaunch(f"{self.op.name}.sum.{k}", self._sum_task, self.colors, reqs, self.placement,
                                       (k, tuple(names[:i]), backward)))
        return launches

    def _once(self, key: tuple, make: Callable) -> list:
        """make()'s list, made on the first call for `key` and kept (see __init__)."""
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = make()
        return made

    def training_launches(self) -> list[tuple[str, list, dict, list]]:
        """(phase, colors, placement, requirements) of the op's launches in a training step but
        its gradient fills and its weights' updates: the forward's (zero fills of partial outputs,
        shared sums, kernels) and the backward's (shared sums, kernels); what strategies/memory.py
        counts."""
        return ([(FORWARD_PHASE, launch.colors, launch.placement, launch.reqs)
                 for launch in self.forward_launches(True)]
                + [(BACKWARD_PHASE, launch.colors, launch.placement, launch.reqs)
                   for launch in self.backward_launches()])

    def forward_launches(self, training: bool, valid: int | None = None, step: int = 0) -> list[PlanLaunch]:
        """The op's forward: zero fills of partial outputs, shared sums, then the kernel launches."""
        training = bool(training)

        def make():
            name = f"{self.op.name}.{'fwd' if training else 'infer'}"
            before = list(self._zero_outs) + self._sum_launches(self._forward_sum_names(training), backward=False)
            kernels = [(name if self.ordered is None else f"{name}[{k}]", colors, self._forward_reqs(training, k))
                       for k, colors in self._positions()]
            return [before, kernels]
        before, kernels = self._once(("forward", training), make)
        args = (training, valid, _step_arg(step))
        return before + [PlanLaunch(name, self._forward_task, colors, reqs, self.placement, args)
                         for name, colors, reqs in kernels]

    def grad_fill_launches(self, ones: str | None, written: frozenset = frozenset()) -> dict[str, list[PlanLaunch]]:
        """Output tensor name -> the launches that fill its gradient on this plan's tiles (ones for
        the tensor named `ones`, zeros for the others), for each output whose tiles cover it
        without overlap and whose consumer does not write it whole (`written`); none off the
        gradient path."""
        if self.bwd_reqs is None:
            return {}

        def make():
            out = {}
            outputs = [t for t, has in zip(self.op.outputs, self.grad_outputs) if has]
            for t, part in zip(outputs, self._gouts):
                if t.name not in written and disjoint_cover(set(part.rects.values()), part.region.rect):
                    out[t.name] = _zero_launches([part], self.colors, self.placement, 1.0 if t.name == ones else 0.0)
            return [out]
        return dict(self._once(("grad_fill", ones, frozenset(written)), make)[0])

    def backward_launches(self) -> list[PlanLaunch]:
        """The op's backward (none off the gradient path): shared sums, then the kernel launches,
        along an ordered dim from the last position to the first."""
        if self.bwd_reqs is None:
            return []

        def make():
            name = f"{self.op.name}.bwd"
            launches = self._sum_launches(self._backward_sum_names(), backward=True)
            for k, colors in reversed(self._positions()):
                launches.append(PlanLaunch(name if self.ordered is None else f"{name}[{k}]", self._backward_task,
                                           colors, self._backward_reqs(k), self.placement))
            return launches
        return list(self._once(("backward",), make))

    # ---- kernels (run on worker threads) ---------------------------------------------------
    @staticmethod
    def _given(views: dict, rects: dict) -> dict:
        """The views whose rect is not empty: what a tile's kernel is given."""
        return {k: v for k, v in views.items() if not rects[k].empty}

    def _saved_of(self, color, pop: bool):
        """What the oldest training forward of tile `color` not yet taken saved (taken if `pop`)."""
        key = (self.op.name, color)
        with self._saved_lock:
            queue = self.saved.get(key)
            if queue:
                if not pop:
                    return queue[0]
                saved = queue.popleft()
                if not queue:
                    del self.saved[key]
                return saved
        raise self._fail(color, "backward ran without a training forward before it "
                                "(call forward with training=True first)")

    @property
    def replication_key(self) -> str:
        """What every MPI rank's tasks of this op must agree on besides their launches: the op's
        attributes (a dropout's seed among them; taskrt.replication.launch_signature)."""
        return f"{self.op.kind}{self.op.attrs()}"

    def _forward_task(self, ctx, *views):
        op, color = self.op, ctx.point
        *views, training, valid, step = views
        it = iter(views)
        inputs = [next(it) for _ in op.inputs]
        weights = self._given({k: next(it) for k in self.weight_names}, self.weight_rects[color])
        state_rects = (self.updated_state_rects if training else self.state_rects)[color]
        state = self._given({k: next(it) for k in self.state_names}, state_rects) or None
        sums = {k: next(it) for k in self._forward_sum_names(training)} or None
        carry = {k: next(it) for k in self.carry_names} or None
        out_views = list(it)
        tile = self.tiles[color]
        extra = self._extra(sums, carry)
        if op.uses_step:
            extra["step"] = step
        if op.writes_out:
            extra["out"] = [_target(v, r) for v, r in zip(out_views, self.out_rects[color])]
        outputs, saved = op.forward(ctx.xp, tile, inputs, self.in_rects[color], weights, training=training,
                                    state=state, **extra)
        if len(outputs) != len(out_views):
            raise self._fail(color, f"forward returned {len(outputs)} outputs, the op has {len(out_views)}")
        for i, (view, arr, rect) in enumerate(zip(out_views, outputs, self.out_rects[color])):
            if rect.empty or arr is view:
                continue
            if arr is None or tuple(arr.shape) != view.shape:
                raise self._fail(color, f"output {i} has shape {None if arr is None else tuple(arr.shape)}, its "
                                        f"rect {rect!r} has shape {view.shape}")
            view[...] = arr
        if training:
            with self._saved_lock:
                self.saved.setdefault((op.name, color), collections.deque()).append(saved)
        if self.summarize is not None:
            return self.summarize(ctx.xp, tile, inputs, outputs, valid)
        return None

    def _extra(self, sums, carry) -> dict:
        """The keyword arguments of the op's kernels that only some ops take."""
        extra = {}
        if self.op.sum_shapes():
            extra["sums"] = sums
        if self.op.carry_shapes():
            extra["carry"] = carry
        return extra

    def _sum_task(self, ctx, *views):
        op, color = self.op, ctx.point
        *views, name, before, backward = views
        it = iter(views)
        outputs = grad_outputs = saved = None
        if backward:
            reads_in, reads_out = self.bwd_reads
            inputs = [next(it) if r else None for r in reads_in]
            outputs = [next(it) if r else None for r in reads_out]
            grad_outputs = [next(it) if has else None for has in self.grad_outputs]
            saved = self._saved_of(color, pop=False)
        else:
            inputs = [next(it) for _ in op.inputs]
        sums = {k: next(it) for k in before}
        buf = next(it)
        part = op.partial_sum(ctx.xp, name, self.tiles[color], inputs, sums, outputs, grad_outputs, saved)
        if tuple(part.shape) != buf.shape:
            raise self._fail(color, f"partial sum {name!r} has shape {tuple(part.shape)}, its rect has shape "
                                    f"{buf.shape}")
        buf[...] = part

    def _backward_task(self, ctx, *views):
        op, color = self.op, ctx.point
        it = iter(views)
        reads_in, reads_out = self.bwd_reads
        inputs = [next(it) if r else None for r in reads_in]
        weights = self._given({k: next(it) for k in self.weight_names}, self.weight_rects[color])
        outputs = [next(it) if r else None for r in reads_out]
        grad_outputs = [next(it) if has else None for has in self.grad_outputs]
        sums = {k: next(it) for k in self._backward_sum_names()} or None
        carry = {k: next(it) for k in self.carry_names} or None
        grad_in_bufs = [next(it) if has else None for has in self.grad_inputs]
        grad_w_bufs = self._given({k: next(it) for k in self.weight_names}, self.weight_rects[color])
        saved = self._saved_of(color, pop=True)
        in_rects = self.in_rects[color]
        extra = self._extra(sums, carry)
        if op.writes_out:
            extra["out"] = [False if buf is None else _target(buf, r) for buf, r in zip(grad_in_bufs, in_rects)]
        if op.writes_weight_out:
            rects = self.weight_rects[color]
            extra["weight_out"] = {k: _target(buf, rects[k]) for k, buf in grad_w_bufs.items()}
        grad_inputs, grad_weights = op.backward(ctx.xp, self.tiles[color], inputs, in_rects, weights, outputs,
                                                grad_outputs, saved, **extra)
        for i, buf in enumerate(grad_in_bufs):
            g = grad_inputs[i]
            if buf is None or in_rects[i].empty or g is buf:
                continue
            if g is None:
                if self.writes_grads[i]:  # written, not summed: no contribution is a zero one
                    buf[...] = 0
                continue
            if tuple(g.shape) != in_rects[i].shape:
                raise self._fail(color, f"grad of input {i} has shape {tuple(g.shape)}, its rect "
                                        f"{in_rects[i]!r} has shape {in_rects[i].shape}")
            buf[...] = g
        for k, buf in grad_w_bufs.items():
            if k not in grad_weights:
                raise self._fail(color, f"backward returned no gradient for weight {k!r}")
            g = grad_weights[k]
            if g is buf:
                continue
            if tuple(g.shape) != buf.shape:
                raise self._fail(color, f"grad of weight {k!r} has shape {tuple(g.shape)}, its rect has "
                                        f"shape {buf.shape}")
            buf[...] = g


def _target(view, rect: Rect):
    """What a kernel with `writes_out` may write a result into: the runtime's view of it, where
    that is C-contiguous and not empty (else None: the kernel allocates, lowering copies)."""
    return None if rect.empty or not view.flags.c_contiguous else view


#: what OpPlan._tile_rects sets besides the partitions: a twin's are taken as they are
_TILE_GEOMETRY = ("colors", "tiles", "in_rects", "out_rects", "partial", "weight_names", "state_names",
                  "weight_rects", "state_rects", "updated_state_rects", "ordered", "sum_names", "carry_names")


def geometry(op: Op) -> tuple:
    """What fixes every rect of op's tiles under given degrees: its class, attributes and input
    shapes and dtypes. Ops of one geometry are twins: their plans of one degrees share tiles."""
    return type(op), repr(sorted(op.attrs().items())), tuple((t.shape, str(t.dtype)) for t in op.inputs)


def _twins(plan: OpPlan, op: Op, config: TileConfig) -> bool:
    """Whether `plan` can give its tiles and rects to a plan of `op` under `config`."""
    return plan.config.degrees == config.degrees and geometry(plan.op) == geometry(op)


def first_users(colors: list, rects: dict) -> dict:
    """Per color, its rects (name -> Rect) with each cut to empty unless the color is the first
    (in `colors` order) to have it: who updates a state rect that several tiles share."""
    seen, out = set(), {}
    for c in colors:
        out[c] = {}
        for k, r in rects[c].items():
            first = not r.empty and (k, r) not in seen
            seen.add((k, r))
            out[c][k] = r if first else Rect(r.lo, r.lo)
    return out


def _written_whole(part: Partition, sole_consumer: tuple | None, consumer: tuple) -> bool:
    """Whether `consumer` (op name, input index) is the only use of the tensor behind the input
    gradient partition `part`, and its tiles' rects tile the tensor exactly."""
    return sole_consumer == consumer and disjoint_cover(list(part.rects.values()), part.region.rect)


def _zero_launches(parts: list[Partition], colors: list, placement: dict, value: float = 0.0) -> list[PlanLaunch]:
    """One launch per partition writing zeros (or `value`) into its distinct rects, each on the
    processor of the first color that has it."""
    launches = []
    for p in parts:
        pieces: dict[Rect, int] = {}
        for c in colors:
            r = p.rects[c]
            if not r.empty and r not in pieces:
                pieces[r] = placement[c]
        if not pieces:
            continue
        zcolors = [(i,) for i in range(len(pieces))]
        zero = Partition.from_rects(p.region, dict(zip(zcolors, pieces)), name=f"{p.name}.zero")
        launches.append(PlanLaunch(f"fill:{p.region.name}", _fill_kernel, zcolors, [req(zero, WRITE)],
                                   dict(zip(zcolors, pieces.values())), (value,)))
    return launches


def releases_by_default(machine: Machine) -> bool:
    """Whether a training step on `machine` releases its activations unless told (Lowering's
    `release`): where its compute processors are GPUs, whose memory is what limits a strategy and
    whose allocator (cupy's pool) hands freed memory back at once. On CPUs a released instance
    comes back through malloc, zeroed, with its views made again: a quarter of tiny alexnet's
    step on this project's 2-core machine (26 against 34 ms), for memory a CPU node has plenty of."""
    return any(p.kind == "gpu" for p in machine.processors)


#: a replicated weight is cut into shards of at least this many bytes (so at most its bytes over
#: this many shards): below it, a shard's messages cost more than the bytes they save
MIN_SHARD_BYTES = 1024


class UpdatePlan:
    """The optimizer update of one weight, sharded over the devices that hold its replicas.

    The weight's blocks are the distinct weight rects of the op's tiles. A block used by k
    tiles on k devices (a replicated weight: data parallelism, or any split that does not
    cut the weight) is cut into k shards, one per device (`shard_degrees`); a block used by
    one device is one piece. Each shard's update READs its shard of the gradient, so the
    runtime folds the replicas' partial gradients of that shard into that device alone (a
    reduce-scatter), and the next forward's reads gather the updated shards (an
    all-gather): no device moves more than about 2(P-1)/P of the weight per step, and the
    optimizer state lives only in the shards (ZeRO stage 1). A small weight gets fewer shards
    (MIN_SHARD_BYTES each at least; a bias is one piece). When the op's weight rects
    overlap without being equal, the whole weight is one block over all its devices.
    `rotate` turns which device takes which shard, so that weights with fewer shards than
    devices spread their shards over different devices.
    """

    def __init__(self, param: ParamRegions, plan: OpPlan, short: str, optimizer, rotate: int = 0):
        self.param = param
        self.op_name = plan.op.name
        #: whether the op's backward WRITES the whole gradient (OpPlan.writes_weight_grads): no zero fill then
        self.grad_written = plan.writes_weight_grads[short]
        self.optimizer = optimizer
        self.state_names = list(optimizer.state_names())
        shards = {}
        for block, devices in _weight_blocks(param.value.rect, plan, short).items():
            nbytes = block.volume * np.dtype(param.value.dtype).itemsize
            degrees = shard_degrees(block.shape, max(1, min(len(devices), nbytes // MIN_SHARD_BYTES)))
            pieces = [r.translate(block.lo) for r in tile_rects(block.shape, degrees).values()]
            for i, r in enumerate(pieces):
                if not r.empty:
                    shards[r] = devices[(i + rotate) % len(devices)]
        self.colors = [(i,) for i in range(len(shards))]
        rects = dict(zip(self.colors, shards))
        self.placement = dict(zip(self.colors, shards.values()))
        name = param.name

        value = Partition.from_rects(param.value, rects, name=f"{name}.update.value")

        def part(region: Region, label: str) -> Partition:
            return value.alike(region, f"{name}.update.{label}")

        self.reqs = ([req(value, READ_WRITE), req(part(param.grad, "grad"), READ)]
                     + [req(part(param.state[s], s), READ_WRITE) for s in self.state_names])
        self.grad_fill = req(part(param.grad, "grad"), WRITE)
        self.fn = self._update_task

    def _update_task(self, ctx, value, grad, *rest):
        *states, step = rest
        self.optimizer.update(ctx.xp, value, grad, dict(zip(self.state_names, states)), step)

    @property
    def replication_key(self) -> str:
        """What every MPI rank's update must agree on besides its launch (its optimizer and
        hyperparameters: taskrt.replication.launch_signature)."""
        return repr(self.optimizer)


def _weight_blocks(whole: Rect, plan: OpPlan, short: str) -> dict[Rect, list[int]]:
    """Distinct weight rects of a plan's tiles -> the devices using each (in tile order, once
    each); the whole weight over every device using it when the rects overlap or leave gaps."""
    blocks: dict[Rect, list[int]] = {}
    for color in plan.colors:
        r = plan.weight_rects[color][short]
        if not r.empty:
            devices = blocks.setdefault(r, [])
            if plan.placement[color] not in devices:
                devices.append(plan.placement[color])
    if disjoint_cover(blocks, whole):
        return blocks
    devices = list(dict.fromkeys(d for ds in blocks.values() for d in ds))
    return {whole: devices or [plan.placement[plan.colors[0]]]}


def _fill_kernel(view, value) -> None:
    view[...] = value


def rank_shares(shape: tuple, ranks: int) -> dict[int, Rect]:
    """Each rank's share of a batch of `shape` (rank r of R: samples [r*B//R, (r+1)*B//R), all
    of the other dims), where it is not empty: what a batch source writes on the rank's host
    (Lowering.source_segment)."""
    batch, rest = shape[0], tuple(shape[1:])
    cuts = [r * batch // ranks for r in range(ranks + 1)]
    return {r: Rect.make((cuts[r],) + (0,) * len(rest), (cuts[r + 1],) + rest)
            for r in range(ranks) if cuts[r] < cuts[r + 1]}


# ---- the lowered graph --------------------------------------------------------------------------
class Lowering:
    """A graph of ops (in topological order) lowered onto one runtime under one config per op.

    `inputs` are the graph's source tensors (model inputs and labels); `loss` names the op
    whose per-sample output is the loss (None: forward only); `summarize(xp, tile, inputs,
    outputs, valid)` runs in the loss op's forward tasks and their futures carry its result.
    """

    def __init__(self, rt, ops: Sequence[Op], inputs: Sequence[TensorSpec], configs: dict[str, TileConfig],
                 optimizer=None, loss: str | None = None, summarize: Callable | None = None, tag: str = "model",
                 release: bool | None = None):
        self.rt = rt
        #: whether a training step releases its activations and their gradients after their last
        #: segment (release_points; None: releases_by_default)
        self.release = releases_by_default(rt.machine) if release is None else bool(release)
        if self.release:
            rt.expect_releases()
        self.ops = list(ops)
        self.optimizer = optimizer
        self.loss = loss
        self.tag = tag
        self.saved: dict[tuple[str, tuple], collections.deque] = {}
        self.saved_lock = threading.Lock()
        self.values: dict[str, Region] = {}
        self.grads: dict[str, Region] = {}
        self.params: dict[str, ParamRegions] = {}
        self.stats: dict[str, Region] = {}
        for t in inputs:
            self.values[t.name] = Region(t.shape, t.dtype, t.name)
        self.input_names = [t.name for t in inputs]
        self._source_reqs: tuple | None = None
        by_name = {op.name: op for op in self.ops}
        if loss is not None and loss not in by_name:
            raise ValueError(f"loss op {loss!r} is not in the graph; ops are {sorted(by_name)}")
        self.loss_output = None if loss is None else by_name[loss].outputs[0].name
        backward = self._gradient_path()
        for op in self.ops:
            for t in op.outputs:
                self.values[t.name] = Region(t.shape, t.dtype, t.name)
                if backward[op.name] and _is_float(t):
                    self.grads[t.name] = Region(t.shape, t.dtype, f"{t.name}.grad")
            for k, shape in op.weight_shapes().items():
                full = f"{op.name}.{k}"
                dtype = op.weight_dtype(k)
                grad = Region(shape, dtype, f"{full}.grad") if backward[op.name] else None
                state = {}
                if grad is not None and optimizer is not None:
                    state = {s: Region(shape, dtype, f"{full}.{s}") for s in optimizer.state_names()}
                self.params[full] = ParamRegions(full, Region(shape, dtype, full), grad, state)
            for k, shape in op.state_shapes().items():
                self.stats[f"{op.name}.{k}"] = Region(shape, op.weight_dtype(k), f"{op.name}.{k}")
        uses: dict[str, list[tuple[str, int]]] = {}
        for op in self.ops:
            for i, t in enumerate(op.inputs):
                uses.setdefault(t.name, []).append((op.name, i))
        #: tensor name -> (op name, input index) of its only use, for tensors used once
        self.sole_consumers = {t: u[0] for t, u in uses.items() if len(u) == 1}
        #: program name -> (its launches, their args with markers, which args hold markers)
        self._programs: dict[str, tuple] = {}
        self.plans: dict[str, OpPlan] = {}
        for op in self.ops:
            self.plans[op.name] = OpPlan(self, op, configs[op.name], backward[op.name],
                                         summarize if op.name == loss else None)
        self.updates: list[UpdatePlan] = []
        if optimizer is not None:
            for op in self.ops:
                for k in op.weight_shapes():
                    p = self.params[f"{op.name}.{k}"]
                    if p.grad is not None:
                        self.updates.append(UpdatePlan(p, self.plans[op.name], k, optimizer,
                                                       rotate=len(self.updates)))

    def updates_of(self, op_name: str) -> list["UpdatePlan"]:
        """The update plans of op `op_name`'s weights, in `updates`' order."""
        return [u for u in self.updates if u.op_name == op_name]

    def __repr__(self) -> str:
        return f"Lowering({self.tag!r}, {len(self.ops)} ops, {len(self.params)} params)"

    def _gradient_path(self) -> dict[str, bool]:
        """op name -> whether its backward runs: it leads to the loss and has weights or inputs that
        need a gradient (a float activation downstream of a weight)."""
        needs = set()  # tensor names that carry a gradient
        for op in self.ops:
            if op.weight_shapes() or any(t.name in needs for t in op.inputs):
                needs.update(t.name for t in op.outputs if _is_float(t))
        reaches = set()  # tensor names the loss depends on
        runs = {op.name: False for op in self.ops}
        if self.loss is None:
            return runs
        for op in reversed(self.ops):
            if op.name == self.loss or any(t.name in reaches for t in op.outputs):
                reaches.update(t.name for t in op.inputs)
                runs[op.name] = any(t.name in needs for t in op.outputs)
        return runs

    # ---- launches, in segments ------------------------------------------------------------
    # One training step is an ordered list of segments, one per (op, phase), each a list of
    # plan launches that depends only on that op's plan (its config): the runtime issues them
    # in order, and the simulator (strategies/segments.py) caches them by op and config.
    def forward_segment(self, plan: "OpPlan", training: bool = True, valid: int | None = None,
                        step: int = 0) -> Segment:
        return Segment(plan.op.name, FORWARD_PHASE, tuple(plan.forward_launches(training, valid, step)))

    def grad_fill_segment(self, plan: "OpPlan", written: frozenset = frozenset()) -> Segment:
        """The fills of the activation gradients of `plan`'s outputs (ones for the loss's output,
        zeros elsewhere) where its backward reads them: each output tile's rect on that tile's
        device, so that the folds of the consumers' contributions find it there and no memory
        serves them all. Gradients in `written` (see `written_grads`) need none."""
        fills = plan.grad_fill_launches(self.loss_output, written)
        return Segment(plan.op.name, GRAD_FILL_PHASE, tuple(l for ls in fills.values() for l in ls),
                       tuple(fills))

    def written_grads(self, plans: dict[str, "OpPlan"], op: Op) -> frozenset:
        """The names of `op`'s outputs whose gradient its only consumer WRITES under `plans` (op
        name -> plan): its tiles cover it exactly, so no fill comes before."""
        out = []
        for t in op.outputs:
            use = self.sole_consumers.get(t.name)
            if use is not None and t.name in self.grads and plans[use[0]].writes_grads[use[1]]:
                out.append(t.name)
        return frozenset(out)

    def zero_grad_segment(self, update: "UpdatePlan") -> Segment:
        """The zero fill of a sharded weight gradient, each shard on its own device; none (an empty
        segment, so that a program's segments keep their places) where the op's backward writes
        the whole gradient."""
        if update.grad_written:
            return Segment(update.op_name, ZERO_GRAD_PHASE, ())
        launch = PlanLaunch(f"fill:{update.param.grad.name}", _fill_kernel, update.colors, [update.grad_fill],
                            update.placement, (0.0,))
        return Segment(update.op_name, ZERO_GRAD_PHASE, (launch,))

    def backward_segment(self, plan: "OpPlan") -> Segment:
        return Segment(plan.op.name, BACKWARD_PHASE, tuple(plan.backward_launches()))

    def update_segment(self, update: "UpdatePlan", step: int) -> Segment:
        launch = PlanLaunch(f"{update.param.name}.update", update.fn, update.colors, update.reqs, update.placement,
                            (_step_arg(step),))
        return Segment(update.op_name, UPDATE_PHASE, (launch,))

    def source_segment(self, fn: Callable | None, args: tuple = ()) -> Segment:
        """Every rank writes its equal share of each graph input (rank r of R: samples
        [r*B//R, (r+1)*B//R)) in one task on its host processor, `fn(ctx, *views, *args)` with a
        view of each input in `inputs` order: how Model.train_on makes a step's batch where it
        is used, so that with the batch split over the ranks no rank makes or receives another
        rank's samples. The simulator times the same launch (fn None: nothing runs)."""
        if self._source_reqs is None:
            self._source_reqs = self._source_shares()
        reqs, colors, placement = self._source_reqs
        return Segment(None, SOURCE_PHASE, (PlanLaunch(SOURCE, fn, colors, reqs, placement, tuple(args)),))

    def _source_shares(self) -> tuple[list, list, dict]:
        """(WRITE requirements on each input's rank shares, the ranks' colors, their host processors)."""
        if not self.input_names:
            raise ValueError(f"{self!r}: a batch source needs graph inputs, and this graph has none")
        regions = [self.values[name] for name in self.input_names]
        batch = regions[0].shape[0] if regions[0].shape else 0
        for r in regions:
            if not r.shape or r.shape[0] != batch:
                raise ValueError(f"batch source: input {r.name!r} has shape {r.shape}, but every input needs the "
                                 f"batch ({batch}) as its first dim, as {regions[0].name!r} has")
        ranks = self.rt.num_ranks
        colors = [(r,) for r in rank_shares(regions[0].shape, ranks)]
        reqs = []
        for region in regions:
            rects = {(r,): rect for r, rect in rank_shares(region.shape, ranks).items()}
            reqs.append(req(Partition.from_rects(region, rects, name=f"{region.name}.ranks"), WRITE))
        placement = {c: self.rt.machine.host_processor(c[0]) for c in colors}
        return reqs, colors, placement

    def host_fill_segment(self, phase: str, fills: Sequence[tuple[Region, float]]) -> Segment:
        """Fills of whole regions on the runtime's home processor (what Runtime.fill issues)."""
        home = self.rt.home
        return Segment(None, phase, tuple(PlanLaunch(f"fill:{r.name}", _fill_kernel, [()], [req(r, WRITE)],
                                                     {(): home}, (value,)) for r, value in fills))

    def backward_segments(self) -> list[Segment]:
        """Fill every activation gradient (on its producer's tiles where they cover it, else on the
        host), zero the weight gradients (sharded ones shard by shard on the shards' devices),
        then every op's backward in reverse order."""
        if self.loss is None:
            raise RuntimeError("this graph was lowered without a loss: there is nothing to differentiate")
        written = {op.name: self.written_grads(self.plans, op) for op in self.ops}
        segments = [self.grad_fill_segment(self.plans[op.name], written[op.name]) for op in self.ops]
        filled = {t for seg in segments for t in seg.fills}.union(*written.values())
        segments.append(self.host_fill_segment(GRAD_FILL_PHASE, [
            (region, 1.0 if name == self.loss_output else 0.0) for name, region in self.grads.items()
            if name not in filled]))
        segments += [self.zero_grad_segment(u) for u in self.updates]
        sharded = {u.param.name for u in self.updates}
        segments.append(self.host_fill_segment(ZERO_GRAD_PHASE, [
            (p.grad, 0.0) for p in self.params.values() if p.grad is not None and p.name not in sharded]))
        segments += [self.backward_segment(self.plans[op.name]) for op in reversed(self.ops)]
        return segments

    def update_segments(self, step: int) -> list[Segment]:
        return [self.update_segment(u, step) for u in self.updates]

    def issue(self, segment: Segment):
        """Issue a segment's launches; the FutureMap of the last one (None if it has none)."""
        fm = None
        for launch in segment.launches:
            fm = self._issue(launch, segment.op or "")
        return fm

    def forward(self, training: bool = True, ops: Sequence[str] | None = None, valid: int | None = None,
                step: int = 0):
        """Issue the forward launches of each op (all, or those named, in graph order); `step` is the
        training iteration (dropout draws a new mask each one). Returns the loss op's FutureMap
        (its summaries) when the loss ran, else None."""
        result = None
        names = None if ops is None else set(ops)
        for op in self.ops:
            if names is not None and op.name not in names:
                continue
            fm = self.issue(self.forward_segment(self.plans[op.name], training, valid, step))
            if op.name == self.loss:
                result = fm
        return result

    def backward(self) -> None:
        """Fill every gradient (ones for the loss), then issue backward launches in reverse order."""
        for segment in self.backward_segments():
            self.issue(segment)

    def _issue(self, launch: PlanLaunch, op: str):
        """One of a plan's launches on the runtime; its FutureMap."""
        return self.rt.index_launch(launch.fn, launch.colors, *launch.reqs, args=launch.args, name=launch.name,
                                    placement=launch.placement, op=op)

    def update(self, step: int) -> None:
        """The optimizer update of every trained weight; `step` is 1-based."""
        for segment in self.update_segments(step):
            self.issue(segment)

    def release_all(self) -> None:
        """Free what this lowering holds on its runtime (a model closed on a runtime it shares):
        the instances of every region it made, once the nodes issued so far have run, and the
        recordings of its programs."""
        params = [r for p in self.params.values() for r in (p.value, p.grad, *p.state.values()) if r is not None]
        regions = [*self.values.values(), *self.grads.values(), *self.stats.values(), *params,
                   *(r for plan in self.plans.values() for r in plan.own_regions())]
        self.rt.release(*regions)
        for name in self._programs:
            self.rt.forget_replay(name)

    def forget_saved(self) -> None:
        """Drop what training forwards kept for backwards that will not run: after a failure, once
        every task issued has run or been lost (Runtime.recover), each entry left is a lost
        backward's, and the next step's backward would take it for its own forward's."""
        with self.saved_lock:
            self.saved.clear()

    def train_step(self, step: int, valid: int | None = None, source: tuple | None = None):
        """One iteration (forward, backward, update) as one program; returns the loss FutureMap
        (None without a loss). `source` = (fn, source): the program starts with the batch
        source's launch (source_segment(fn, (source, step))), so that the replayed step's roots,
        the source's tasks among them, wait only for the steps before it: its weight copies do
        not wait for its batch, as they did with the source issued before the step (the replay's
        fence waits for everything issued before it). A program is made once per name, so `fn`
        must be the same at every step (Model.train_on's task)."""
        def make():
            first = [] if source is None else [self.source_segment(source[0], (SOURCE_ARG, STEP))]
            return (first + [self.forward_segment(self.plans[op.name], True, VALID, STEP) for op in self.ops]
                    + self.backward_segments() + self.update_segments(STEP))
        name = f"train_step{'' if source is None else '+source'}:{self.tag}"
        return self._issue_program(name, make, int(step), valid, None if source is None else source[1],
                                   release=self.release)

    def infer_step(self, valid: int | None = None, with_loss: bool = False):
        """Inference forward of the graph (with or without the loss op) as one program; the loss
        FutureMap (None without the loss)."""
        def make():
            return [self.forward_segment(self.plans[op.name], False, VALID) for op in self.ops
                    if with_loss or op.name != self.loss]
        return self._issue_program(f"infer{'+loss' if with_loss else ''}:{self.tag}", make, 0, valid)

    def transient(self) -> set[Region]:
        """What a training step makes and needs no more once it is over: every activation and
        activation gradient, not the graph's inputs and labels (attached or made by a batch
        source before the step), weights, their gradients and optimizer state, or statistics."""
        made = {r for name, r in self.values.items() if name not in self.input_names}
        return made | set(self.grads.values())

    def release_points(self, segments: Sequence[Segment]) -> dict[int, tuple[Region, ...]]:
        """segment index -> the transient regions that it is the last of `segments` to touch
        (in the order the step first touches them): what a training step releases after it,
        so that each activation lives from its forward to its op's backward (strategies/memory.py
        counts the same)."""
        transient = self.transient()
        last: dict[Region, int] = {}
        for s, segment in enumerate(segments):
            for launch in segment.launches:
                for r in launch.reqs:
                    if r.region in transient:
                        last[r.region] = s
        out: dict[int, list[Region]] = {}
        for region, s in last.items():
            out.setdefault(s, []).append(region)
        return {s: tuple(regions) for s, regions in out.items()}

    def _issue_program(self, name: str, make: Callable[[], list[Segment]], step: int, valid: int | None,
                       source=None, release: bool = False):
        """Issue the program `make()` gives (made once per name) with STEP, VALID and SOURCE_ARG
        replaced by `step`, `valid` and `source`; the FutureMap of the loss op's forward kernel, or
        None. `release`: each transient region is released after its last segment."""
        launches, templates, marked = self._program(name, make, release)
        values = {STEP: step, VALID: valid, SOURCE_ARG: source}
        made: dict[tuple, tuple] = {}   # markers replaced once per distinct args tuple
        args = []
        for t, has_marker in zip(templates, marked):
            if has_marker:
                a = made.get(t)
                if a is None:
                    a = made[t] = tuple(values[x] if type(x) is ProgramArg else x for x in t)
                t = a
            args.append(t)
        futures = self.rt.issue_program(name, launches, args)
        return next((fm for fm in futures if fm is not None), None)

    def _program(self, name: str, make: Callable[[], list[Segment]], release: bool = False) -> tuple:
        """(launches, their args with markers, whether each args tuple holds a marker) of program
        `name`, made from its segments once: the same launch list every time is what lets the
        runtime reissue it whole. With `release`, each segment's last launch releases the
        transient regions that no later segment touches (Runtime.release)."""
        program = self._programs.get(name)
        if program is None:
            segments = make()
            releases = self.release_points(segments) if release else {}
            launches, templates = [], []
            for s, segment in enumerate(segments):
                last = len(segment.launches) - 1
                for i, launch in enumerate(segment.launches):
                    returns = segment.op == self.loss and segment.phase == FORWARD_PHASE and i == last
                    launches.append(Launch(launch.fn, tuple(launch.colors), tuple(launch.reqs), launch.name,
                                           launch.placement, segment.op or "", returns,
                                           releases.get(s, ()) if i == last else ()))
                    templates.append(tuple(launch.args))
            marked = [any(type(a) is ProgramArg for a in t) for t in templates]
            program = self._programs[name] = (tuple(launches), templates, marked)
        return program

    # ---- data in and out (host arrays) -----------------------------------------------------------
    def attach(self, region: Region, array) -> None:
        self.rt.attach(region, array)

    def read(self, region: Region, wait: bool = True):
        return self.rt.read(region, wait=wait)

    def init_values(self, values: dict) -> None:
        """Attach initial weights and running stats (by name); optimizer state starts from
        optimizer.init_state."""
        for name, p in self.params.items():
            self.attach(p.value, values[name])
            if p.state:
                init = self.optimizer.init_state(np, np.asarray(values[name]))
                for s, region in p.state.items():
                    self.attach(region, init[s])
        for name, region in self.stats.items():
            self.attach(region, values[name])
