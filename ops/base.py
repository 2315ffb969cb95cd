"""The operator contract: shapes, SOAP split rules, tile requirements, kernels and costs.

An operator is one node of a model graph. It knows only local facts about itself;
lowering (ops/lower.py) turns it into taskrt index launches, and the simulator
derives its tasks from the very same methods, so what a tile needs is defined once.

Layout conventions (PyTorch's): dim 0 of every activation is the sample (batch)
dimension; images are NCHW; sequences are [batch, seq, features].

Kernels work on *tiles*: `tile` is a Rect of the op's tile space (output 0's shape, or
larger: dense adds its input features, attention its heads, and `output_rects` projects
a tile onto the outputs), `in_rects` are the rects returned by `input_rects(tile)` and
the arrays passed in hold exactly those rects. `xp` is numpy or cupy.

Three kinds of split need more than independent tiles, and each is declared here so that
lowering (ops/lower.py) and the tiled check (tests/opcheck.py) treat every op alike:
- a *partial* split dim: tiles along it sum into the same output rects (REDUCE), and only
  the tile leading the group gets the op's `bias_weights`;
- an *ordered* split dim: tiles along it run one after another, each handing its
  `carry_shapes` state on to the next (an LSTM's time chunks);
- *sums*: statistics over more than one tile (batch norm's per-channel mean), which the
  tiles sharing them add up (`partial_sum`) before the kernels read the totals.
"""
from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import numpy as np

from taskrt.geometry import Rect, as_int, pairwise_disjoint

SAMPLE, ATTRIBUTE, PARAMETER, REDUCE = "sample", "attribute", "parameter", "reduce"
#: the split kinds: the paper's Sample, Attribute and Parameter, and `reduce`, a split of a
#: reduction dimension whose tiles produce partial outputs summed by the runtime
#: (DTensor's Partial, Unity's Reduction)
SOAP_KINDS = (SAMPLE, ATTRIBUTE, PARAMETER, REDUCE)


class ShapeError(ValueError):
    """Inputs that don't fit an operator; the message names the op and the shapes."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and name of a tensor in a model graph (no data)."""

    shape: tuple[int, ...]
    dtype: str
    name: str

    def __repr__(self) -> str:
        return f"TensorSpec({self.name}: {self.dtype}{list(self.shape)})"


@dataclass(frozen=True)
class SplitDim:
    """Dimension `dim` of the tile space may be split; `kind` is its SOAP dimension.

    `partial`: tiles that differ only along this dim produce partial sums of the same
    output rects (always so for kind `reduce`; also for a head split whose output
    projection sums over heads). Lowering then REDUCEs (sum) the outputs instead of
    writing them.

    `ordered`: tiles that differ only along this dim run in index order, each starting
    from the op's carry as the one before it left it (backward: in reverse order).
    """

    dim: int
    kind: str
    partial: bool = False
    ordered: bool = False

    def __post_init__(self):
        if self.kind not in SOAP_KINDS:
            raise ValueError(f"SplitDim kind must be one of {SOAP_KINDS}, got {self.kind!r}")
        if self.kind == REDUCE:
            object.__setattr__(self, "partial", True)

    def __str__(self) -> str:
        marks = ("+" if self.partial and self.kind != REDUCE else "") + (">" if self.ordered else "")
        return f"{self.kind[0].upper()}({self.dim}){marks}"


OP_REGISTRY: dict[str, type["Op"]] = {}


def register_op(cls: type["Op"]) -> type["Op"]:
    """Class decorator: make an operator findable by its `kind` (used by Model.load and tools)."""
    if not cls.kind:
        raise ValueError(f"{cls.__name__} has no kind")
    known = OP_REGISTRY.get(cls.kind)
    if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"operator kind {cls.kind!r} registered twice: by {known.__module__}.{known.__qualname__} "
                         f"and {cls.__module__}.{cls.__qualname__}")
    OP_REGISTRY[cls.kind] = cls   # (the same class again, from a reloaded module, replaces it)
    return cls


class Op(ABC):
    """Base class. Subclasses set `kind` and implement the abstract methods.

    Construction validates the inputs (raise ShapeError naming the op and shapes)
    and stores plain attributes; `attrs()` returns them so that graphs can be saved
    and rebuilt. An op never holds weight values: those live in the model's regions.
    """

    kind: ClassVar[str] = ""
    #: True for ops whose forward differs between training and inference (dropout, batch_norm)
    has_training_mode: ClassVar[bool] = False
    #: True for ops whose forward takes `step=` (the training iteration), so that their
    #: randomness changes from one iteration to the next (dropout)
    uses_step: ClassVar[bool] = False
    #: True for ops whose forward and backward take `out=` (see forward): lowering then hands
    #: them the output (gradient) views to write into rather than copying their results in, and
    #: their backward skips an input gradient that nothing reads
    writes_out: ClassVar[bool] = False
    #: True for ops whose backward takes `weight_out=` (see backward): lowering then hands them
    #: the weight gradients' views to write into rather than copying their results in
    writes_weight_out: ClassVar[bool] = False
    #: True for ops whose arithmetic needs floating-point inputs (every input; the ops that take
    #: integers somewhere, embedding's indices or a loss's labels, check their own)
    float_inputs: ClassVar[bool] = False

    def __init__(self, name: str, inputs: Sequence[TensorSpec], **attrs: Any):
        self.name = name
        self.inputs = list(inputs)
        self._attrs = dict(attrs)
        for k, v in attrs.items():
            setattr(self, k, v)
        if self.float_inputs:
            for t in self.inputs:
                if np.dtype(t.dtype).kind != "f":
                    raise self.fail(f"input {t.name} must be floating point, got {t.dtype}")
        shapes = self.infer_shapes([t.shape for t in self.inputs])
        self._num_outputs = len(shapes)
        dtypes = self.output_dtypes()
        self.outputs = [
            TensorSpec(tuple(int(s) for s in shp), dt, f"{name}.out{i}" if len(shapes) > 1 else f"{name}.out")
            for i, (shp, dt) in enumerate(zip(shapes, dtypes))
        ]

    def __repr__(self) -> str:
        ins = ", ".join(repr(t) for t in self.inputs)
        return f"{type(self).__name__}({self.name!r}, [{ins}], {self._attrs})"

    def attrs(self) -> dict[str, Any]:
        return dict(self._attrs)

    def fail(self, message: str) -> ShapeError:
        """A ShapeError naming this op and its input shapes."""
        shapes = [t.shape for t in self.inputs]
        return ShapeError(f"{self.kind} {self.name!r}: {message} (input shapes {shapes})")

    # ---- shapes and parameters -------------------------------------------------
    @abstractmethod
    def infer_shapes(self, in_shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Output shapes from input shapes; raise self.fail(...) if they don't fit."""

    def output_dtypes(self) -> list[str]:
        """Dtype of each output; by default that of input 0."""
        return [self.inputs[0].dtype] * self._num_outputs

    def index_bound(self, i: int) -> int | None:
        """For an integer input that indexes something (embedding rows, class labels): the exclusive
        upper bound of its values, so the model API can check data before any work; else None."""
        return None

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Trainable parameters: short name ('weight', 'bias') to shape. Default: none."""
        return {}

    def training_problem(self) -> str | None:
        """Why this op cannot train at its shapes (a batch norm over one value a channel), for the
        model API to refuse before any work; None where it can (the default)."""
        return None

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """Non-trained state updated in training forward (batch_norm's running stats)."""
        return {}

    def init_weights(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Initial values of weights and state (PyTorch's default initializers)."""
        return {}

    # ---- SOAP split rules and tile requirements -----------------------------------
    @property
    def tile_shape(self) -> tuple[int, ...]:
        """The space that tiles partition: output 0's shape."""
        return self.outputs[0].shape

    @abstractmethod
    def split_dims(self) -> tuple[SplitDim, ...]:
        """The dimensions of the tile space that may be split, with their SOAP kind."""

    def output_rects(self, tile: Rect) -> list[Rect]:
        """The rect of each output that a tile produces (one output: the tile itself)."""
        return [tile]

    @abstractmethod
    def input_rects(self, tile: Rect) -> list[Rect]:
        """For each input, the rect a tile reads (a conv tile: with its halo)."""

    def weight_rects(self, tile: Rect) -> dict[str, Rect]:
        """For each weight and state, the rect a tile uses (empty: the tile does without it).
        Default: all of every weight."""
        shapes = {**self.weight_shapes(), **self.state_shapes()}
        return {k: Rect.from_shape(s) for k, s in shapes.items()}

    # ---- partial, ordered and summed splits -----------------------------------------
    def bias_weights(self) -> tuple[str, ...]:
        """Weights added once to each output element (biases): under a partial split only the
        tile leading its partial group gets them, so that the group's sum adds them once."""
        return ()

    def leads_partial_group(self, tile: Rect) -> bool:
        """Whether `tile` is the first of the tiles summing into its output rects: it starts at 0
        along every partial split dim (always so when no partial dim is split)."""
        return all(tile.lo[s.dim] == 0 for s in self.split_dims() if s.partial)

    def tile_weight_rects(self, tile: Rect) -> dict[str, Rect]:
        """weight_rects(tile) with each bias weight cut to an empty rect on a tile that does not
        lead its partial group: what lowering and the tiled check give a tile."""
        rects = self.weight_rects(tile)
        if self.leads_partial_group(tile):
            return rects
        biases = self.bias_weights()
        return {k: Rect(r.lo, r.lo) if k in biases else r for k, r in rects.items()}

    def ordered_dim(self) -> int | None:
        """The tile dim declared ordered (at most one), or None."""
        dims = [s.dim for s in self.split_dims() if s.ordered]
        if len(dims) > 1:
            raise ValueError(f"{self.kind} {self.name!r} declares {len(dims)} ordered split dims {dims}; "
                             f"at most one is supported")
        return dims[0] if dims else None

    def carry_shapes(self) -> dict[str, tuple[int, ...]]:
        """State handed from tile to tile along the ordered dim (an LSTM's h and c): name -> shape
        of the small region it passes through. Default: none."""
        return {}

    def carry_rects(self, tile: Rect) -> dict[str, Rect]:
        """For each carry, the rect a tile reads from the tile before it and writes for the next."""
        return {k: Rect.from_shape(s) for k, s in self.carry_shapes().items()}

    def sum_shapes(self) -> dict[str, tuple[int, ...]]:
        """Statistics a tile needs over more than its own data (batch norm's per-channel mean):
        name -> shape. Where tiles share a sum's rect, lowering adds up their `partial_sum`s
        (REDUCE) and the kernels read the totals as `sums=`; elsewhere `sums` is None and each
        kernel computes them from its own tile. Default: none."""
        return {}

    def sum_rects(self, tile: Rect) -> dict[str, Rect]:
        """For each sum, the rect a tile adds to and reads."""
        return {k: Rect.from_shape(s) for k, s in self.sum_shapes().items()}

    def shares_sums(self, tiles: Sequence[Rect]) -> bool:
        """Whether two of `tiles` share a sum rect, so that their sums must be added up first."""
        return any(not pairwise_disjoint([self.sum_rects(t)[k] for t in tiles]) for k in self.sum_shapes())

    def forward_sums(self, training: bool) -> tuple[str, ...]:
        """The sums forward reads, in the order they are made (a later one may read earlier ones)."""
        return ()

    def backward_sums(self) -> tuple[str, ...]:
        """The sums backward reads, in the order they are made."""
        return ()

    def partial_sum(self, xp, name: str, tile: Rect, inputs: list, sums: dict, outputs: list | None = None,
                    grad_outputs: list | None = None, saved: Any = None):
        """This tile's part of sum `name`, shaped as sum_rects(tile)[name], in float64. Forward sums
        see the inputs and the sums made before them; backward sums also the outputs, the output
        grads and what the tile's forward saved."""
        raise ValueError(f"{self.kind} {self.name!r} declares no sums, so it has no partial sum {name!r}")

    # ---- kernels -----------------------------------------------------------------
    @abstractmethod
    def forward(self, xp, tile: Rect, inputs: list, in_rects: list[Rect], weights: dict,
                training: bool = True, state: dict | None = None) -> tuple[list, Any]:
        """Compute output tiles.

        Returns (outputs, saved): `outputs` is a list of arrays, one per output rect (None
        for an empty rect); `saved` is anything backward needs (or None). `state` holds
        mutable state tiles (running stats) to update in place when training. `weights`
        and `state` leave out what has an empty rect for this tile. Ops with `uses_step`
        also take `step=` (the training iteration); ops with sums take `sums=` (the totals,
        or None: see `sum_shapes`); ops with a carry take `carry=`: None when the ordered
        dim is not split, else views of the carry rects that hold what the tile before left
        (unless the tile is first) and that the kernel overwrites with what it leaves.
        Ops with `writes_out` take `out=`: per output, a C-contiguous array of its rect's
        shape that the kernel may write the output into and return as that output (the
        same object), or None where there is none to use.
        """

    def backward_reads(self) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
        """(per input, per output) whether backward and its sums read it; the others come to them
        as None, and a training step need not keep them for backward (ops/lower.py, Runtime.release)."""
        return (True,) * len(self.inputs), (True,) * len(self.outputs)

    @abstractmethod
    def backward(self, xp, tile: Rect, inputs: list, in_rects: list[Rect], weights: dict,
                 outputs: list, grad_outputs: list, saved: Any) -> tuple[list, dict]:
        """Gradients of a tile: (grad_inputs, grad_weights).

        grad_inputs[i] has the shape of in_rects[i] (None for integer inputs such as
        labels or indices, or for an empty rect); grad_weights[k] has the shape of
        weight_rects(tile)[k], for the weights the tile was given. Contributions of
        overlapping tiles are summed by the runtime (REDUCE sum). `sums=` and `carry=` as in
        forward; backward's carry runs the other way: on entry the gradient of what this
        tile left (unless it is last), on exit the gradient of what it started from.
        `out=` (ops with `writes_out`): per input, an array to write its gradient into and
        return, as in forward, None, or False where nothing reads that gradient (a model
        input's): the kernel then skips it and returns None (see `given_out`).
        `weight_out=` (ops with `writes_weight_out`): weight name -> a C-contiguous array of its
        gradient's shape to write the gradient into (overwriting it) and return, or None
        (see `weight_target`). A large table's gradient is then neither allocated (zeroed) nor
        copied each step.
        """

    # ---- costs for the analytic model ----------------------------------------------
    def flops(self, tile: Rect) -> int:
        """Floating-point operations of forward on this tile (backward is taken as ~2x)."""
        return sum(r.volume for r in self.output_rects(tile))

    def bytes_moved(self, tile: Rect) -> int:
        """Bytes a tile's forward reads and writes: inputs, weights, outputs."""
        inputs, weights, outputs = self._itemsizes
        total = 0
        for size, r in zip(inputs, self.input_rects(tile)):
            total += r.volume * size
        for k, r in self.weight_rects(tile).items():
            total += r.volume * weights.get(k, 0)
        for size, r in zip(outputs, self.output_rects(tile)):
            total += r.volume * size
        return total

    @functools.cached_property
    def _itemsizes(self) -> tuple[tuple[int, ...], dict[str, int], tuple[int, ...]]:
        """(each input's itemsize, each weight's and state's by name, each output's), made once:
        a search asks bytes_moved of every new tile it meets."""
        names = {**self.weight_shapes(), **self.state_shapes()}
        return (tuple(np.dtype(spec.dtype).itemsize for spec in self.inputs),
                {k: np.dtype(self.weight_dtype(k)).itemsize for k in names},
                tuple(np.dtype(spec.dtype).itemsize for spec in self.outputs))

    def weight_dtype(self, name: str) -> str:
        """Dtype of a weight: the float dtype of the op's first float input."""
        for t in self.inputs:
            if np.dtype(t.dtype).kind == "f":
                return t.dtype
        return "float32"


def given_out(out, i: int):
    """What a `writes_out` kernel was given for result i: (the array to write it into or None,
    whether it is wanted at all: False only for an input gradient that nothing reads)."""
    if not out:
        return None, True
    return (None if out[i] is False else out[i]), out[i] is not False


def training_error(ops) -> "ShapeError | None":
    """The ShapeError of the first of `ops` that cannot train at its shapes (Op.training_problem),
    or None: what the model API and the apps refuse before any work."""
    for op in ops:
        problem = op.training_problem()
        if problem is not None:
            return op.fail(problem)
    return None


def weight_target(weight_out, name: str):
    """What a `writes_weight_out` kernel was given for weight `name`'s gradient: an array of its
    shape to write it into and return, or None (the kernel allocates it)."""
    return None if not weight_out else weight_out.get(name)


def is_count(value) -> bool:
    """A positive int (a bool is not one: True would pass for a size of 1)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1


def int_attr(kind: str, name: str, attr: str, value, least: int = 1) -> int:
    """An int attribute of op `name` (taskrt.geometry.as_int's rule: floats, even 3.0, bools and
    strings are refused, not truncated), or a ShapeError naming the op, the attribute and the value."""
    try:
        return as_int(f"{kind} {name!r}: {attr}", value, least)
    except (TypeError, ValueError) as e:
        raise ShapeError(str(e)) from None


def bool_attr(kind: str, name: str, attr: str, value) -> bool:
    """A yes/no attribute of op `name`: True or False (a string such as "False" is true to bool()),
    or a ShapeError naming the op, the attribute and the value."""
    if not isinstance(value, (bool, np.bool_)):
        raise ShapeError(f"{kind} {name!r}: {attr} must be True or False, got {type(value).__name__} {value!r}")
    return bool(value)


def float_attr(kind: str, name: str, attr: str, value, lo: float | None = None, hi: float | None = None,
               lo_open: bool = False) -> float:
    """A finite real attribute of op `name` in [lo, hi] ((lo, hi] with lo_open), or a ShapeError."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not np.isfinite(value):
        raise ShapeError(f"{kind} {name!r}: {attr} must be a finite number, got {type(value).__name__} {value!r}")
    if (lo is not None and (value <= lo if lo_open else value < lo)) or (hi is not None and value > hi):
        low, high = ("-inf" if lo is None else f"{lo:g}"), ("inf" if hi is None else f"{hi:g}")
        bounds = f"{'(' if lo_open else '['}{low}, {high}]"
        raise ShapeError(f"{kind} {name!r}: {attr} must be in {bounds}, got {value!r}")
    return float(value)


def sample_split_dims(count: int) -> tuple[SplitDim, ...]:
    """Dims 0..count-1 splittable: dim 0 is the sample dimension, the others attributes."""
    return tuple(SplitDim(d, SAMPLE if d == 0 else ATTRIBUTE) for d in range(count))


def batch_rect(tile: Rect, shape: Sequence[int]) -> Rect:
    """Rows tile.lo[0]:tile.hi[0] of a tensor of `shape`, all of every other dim."""
    return Rect((tile.lo[0],) + (0,) * (len(shape) - 1), (tile.hi[0],) + tuple(shape[1:]))
