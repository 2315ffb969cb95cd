"""Operators that only move data: concat, split, flat, reshape, transpose.

They compute nothing, so `flops` is 0 and their cost is the bytes they move
(Op.bytes_moved). Rects along a concat/split axis are mapped between the pieces'
coordinates; a piece that a tile does not overlap gets an *empty* rect (extent 0
along the axis), and the kernels take and return arrays with a 0 in their shape.
"""
from __future__ import annotations

import math

import numpy as np

from ops.base import ATTRIBUTE, SAMPLE, Op, SplitDim, batch_rect, register_op, sample_split_dims
from taskrt.geometry import Rect


def _normalize_axis(op: Op, axis, ndim: int) -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise op.fail(f"axis must be an int, got {type(axis).__name__} {axis!r}")
    if not -ndim <= axis < ndim:
        raise op.fail(f"axis={axis!r} is out of range for {ndim} dims")
    return int(axis) % ndim


def _piece_rect(tile: Rect, axis: int, start: int, size: int) -> Rect:
    """The part of `tile` inside [start, start + size) along `axis`, in the piece's own coordinates.

    Empty when the tile doesn't reach the piece: then the rect has lo == hi inside
    [0, size] along `axis`, so that its slices select nothing (never a negative index).
    """
    lo = min(max(tile.lo[axis] - start, 0), size)
    hi = max(min(tile.hi[axis] - start, size), lo)
    return Rect(tile.lo[:axis] + (lo,) + tile.lo[axis + 1:], tile.hi[:axis] + (hi,) + tile.hi[axis + 1:])


@register_op
class Concat(Op):
    """torch.cat(inputs, axis): N inputs equal in every dim but `axis`.

    Every output dim may be split, the concat axis too: a tile reads from each input
    only the part it overlaps (an empty rect for inputs it doesn't reach).
    """

    kind = "concat"

    def __init__(self, name, inputs, axis: int):
        super().__init__(name, inputs, axis=axis)

    def infer_shapes(self, in_shapes):
        if not in_shapes:
            raise self.fail("needs at least 1 input")
        first = in_shapes[0]
        if len(first) < 1:
            raise self.fail("inputs need at least 1 dim")
        self._axis = _normalize_axis(self, self.axis, len(first))
        for i, s in enumerate(in_shapes):
            if len(s) != len(first) or any(a != b for d, (a, b) in enumerate(zip(s, first)) if d != self._axis):
                raise self.fail(f"input {i} has shape {s}, which doesn't match input 0's {first} "
                                f"outside axis {self._axis}")
        self._offsets = [0]
        for s in in_shapes:
            self._offsets.append(self._offsets[-1] + s[self._axis])
        out = list(first)
        out[self._axis] = self._offsets[-1]
        return [tuple(out)]

    def output_dtypes(self):
        return [np.result_type(*(np.dtype(t.dtype) for t in self.inputs)).name]

    def split_dims(self):
        return sample_split_dims(len(self.tile_shape))

    def input_rects(self, tile: Rect) -> list[Rect]:
        return [_piece_rect(tile, self._axis, start, t.shape[self._axis])
                for start, t in zip(self._offsets, self.inputs)]

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        return [xp.concatenate(inputs, axis=self._axis)], None

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        (g,) = grad_outputs
        grads, at = [], 0
        for x, r in zip(inputs, in_rects):
            n = r.shape[self._axis]
            index = (slice(None),) * self._axis + (slice(at, at + n),)
            grads.append(g[index].astype(x.dtype, copy=False) if x.dtype.kind == "f" else None)
            at += n
        return grads, {}

    def flops(self, tile: Rect) -> int:
        return 0


@register_op
class Split(Op):
    """torch.split(x, sizes, axis): one output per entry of `sizes`, which must sum to x.shape[axis].

    The tile space is the *input's* shape (`tile_shape` is overridden to return
    inputs[0].shape rather than outputs[0].shape): a tile is a box of the input, it
    reads exactly that box, and `output_rects(tile)` gives, for each output, the part
    of the box that falls in it, in that output's coordinates. A tile that doesn't
    reach an output gets an empty rect for it (extent 0 along `axis`). So the tile
    space may be split along every dim, `axis` included (0 sample, others attribute).
    """

    kind = "split"

    def __init__(self, name, inputs, sizes, axis: int):
        super().__init__(name, inputs, sizes=[int(s) for s in sizes] if _is_int_list(sizes) else sizes, axis=axis)

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 1:
            raise self.fail(f"takes 1 input, got {len(in_shapes)}")
        (shape,) = in_shapes
        if len(shape) < 1:
            raise self.fail("input needs at least 1 dim")
        self._axis = _normalize_axis(self, self.axis, len(shape))
        if not _is_int_list(self.sizes) or not self.sizes or any(s <= 0 for s in self.sizes):
            raise self.fail(f"sizes must be a non-empty list of positive ints, got {self.sizes!r}")
        if sum(self.sizes) != shape[self._axis]:
            raise self.fail(f"sizes {self.sizes} sum to {sum(self.sizes)}, but dim {self._axis} "
                            f"of the input is {shape[self._axis]}")
        self._offsets = [0]
        for s in self.sizes:
            self._offsets.append(self._offsets[-1] + s)
        return [shape[:self._axis] + (s,) + shape[self._axis + 1:] for s in self.sizes]

    @property
    def tile_shape(self) -> tuple[int, ...]:
        return self.inputs[0].shape

    def split_dims(self):
        return sample_split_dims(len(self.tile_shape))

    def output_rects(self, tile: Rect) -> list[Rect]:
        return [_piece_rect(tile, self._axis, start, size) for start, size in zip(self._offsets, self.sizes)]

    def input_rects(self, tile: Rect) -> list[Rect]:
        return [tile]

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        (x,) = inputs
        outs, at = [], 0
        for r in self.output_rects(tile):
            n = r.shape[self._axis]
            outs.append(x[(slice(None),) * self._axis + (slice(at, at + n),)])
            at += n
        return outs, None

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        (x,) = inputs
        # an output nobody used may come back without a gradient: it contributes zeros
        parts = [xp.zeros(r.shape, dtype=x.dtype) if g is None else g.astype(x.dtype, copy=False)
                 for g, r in zip(grad_outputs, self.output_rects(tile))]
        return [xp.concatenate(parts, axis=self._axis)], {}

    def flops(self, tile: Rect) -> int:
        return 0


def _is_int_list(v) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(s, (int, np.integer)) and not isinstance(s, bool)
                                                for s in v)


class _BatchRowReshape(Op):
    """A row-major reshape that keeps dim 0: sample rows map to sample rows, so only the
    batch may be split, and a tile reads the same rows of the input."""

    def split_dims(self):
        return (SplitDim(0, SAMPLE),)

    def input_rects(self, tile: Rect) -> list[Rect]:
        return [batch_rect(tile, self.inputs[0].shape)]

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        return [inputs[0].reshape(tile.shape)], None

    def backward_reads(self):
        return (False,), (False,)

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        return [grad_outputs[0].reshape(in_rects[0].shape)], {}

    def flops(self, tile: Rect) -> int:
        return 0


@register_op
class Flat(_BatchRowReshape):
    """[N, d1, d2, ...] -> [N, d1 * d2 * ...] (torch.flatten(x, 1)); only the batch may be split."""

    kind = "flat"

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 1:
            raise self.fail(f"takes 1 input, got {len(in_shapes)}")
        (shape,) = in_shapes
        if len(shape) < 2:
            raise self.fail(f"needs at least 2 dims [N, ...], got shape {shape}")
        return [(shape[0], math.prod(shape[1:]))]


@register_op
class Reshape(_BatchRowReshape):
    """x.reshape(shape) that keeps dim 0 (the batch): shape[0] must resolve to N.

    One entry of `shape` may be -1 (inferred, as in NumPy). Only the batch may be
    split, since a row-major reshape that keeps dim 0 maps sample rows to sample rows.
    """

    kind = "reshape"

    def __init__(self, name, inputs, shape):
        super().__init__(name, inputs, shape=list(shape) if isinstance(shape, (list, tuple)) else shape)

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 1:
            raise self.fail(f"takes 1 input, got {len(in_shapes)}")
        (src,) = in_shapes
        if len(src) < 1:
            raise self.fail("input needs at least 1 dim")
        want = self.shape
        if not _is_int_list(want) or not want or any(s < -1 for s in want):
            raise self.fail(f"shape must be a non-empty list of ints >= -1, got {want!r}")
        if list(want).count(-1) > 1:
            raise self.fail(f"shape {list(want)} has more than one -1")
        total = math.prod(src)
        out = [int(s) for s in want]
        if -1 in out:
            known = math.prod(s for s in out if s != -1)
            if known == 0 or total % known:
                raise self.fail(f"can't reshape {tuple(src)} -> {tuple(want)}: "
                                f"{total} elements don't divide by {known}")
            out[out.index(-1)] = total // known
        if math.prod(out) != total:
            raise self.fail(f"can't reshape {tuple(src)} ({total} elements) -> {tuple(want)} "
                            f"({math.prod(out)} elements)")
        if out[0] != src[0]:
            raise self.fail(f"reshape must keep dim 0 (the batch, {src[0]}), but {tuple(want)} "
                            f"gives {out[0]}")
        return [tuple(out)]


@register_op
class Transpose(Op):
    """x.permute(perm): output dim i is input dim perm[i].

    Every dim may be split; a tile reads the input box whose dim perm[i] spans the
    tile's dim i. The output dim that carries input dim 0 is the sample dim, the
    others are attributes.
    """

    kind = "transpose"

    def __init__(self, name, inputs, perm):
        super().__init__(name, inputs, perm=list(perm) if isinstance(perm, (list, tuple)) else perm)

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 1:
            raise self.fail(f"takes 1 input, got {len(in_shapes)}")
        (shape,) = in_shapes
        if not _is_int_list(self.perm) or sorted(self.perm) != list(range(len(shape))):
            raise self.fail(f"perm {self.perm!r} is not a permutation of the {len(shape)} input dims")
        self.perm = [int(p) for p in self.perm]
        return [tuple(shape[p] for p in self.perm)]

    def split_dims(self):
        return tuple(SplitDim(d, SAMPLE if p == 0 else ATTRIBUTE) for d, p in enumerate(self.perm))

    def input_rects(self, tile: Rect) -> list[Rect]:
        lo, hi = [0] * len(self.perm), [0] * len(self.perm)
        for i, p in enumerate(self.perm):
            lo[p], hi[p] = tile.lo[i], tile.hi[i]
        return [Rect(tuple(lo), tuple(hi))]

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        return [xp.transpose(inputs[0], tuple(self.perm))], None

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        inverse = tuple(int(i) for i in np.argsort(self.perm))
        return [xp.transpose(grad_outputs[0], inverse)], {}

    def flops(self, tile: Rect) -> int:
        return 0
