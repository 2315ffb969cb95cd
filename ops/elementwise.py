"""Element-wise binary operators with NumPy broadcasting.

The output has the broadcast shape of the two inputs. Input dims line up with the
output's trailing dims; where an input has size 1 (or lacks the dim) against a
larger output dim, every tile reads that input's rect 0:1 there, so tiles along a
broadcast dim overlap on the input and their gradient contributions are summed by
the runtime.
"""
from __future__ import annotations

import numpy as np

from ops.base import Op, register_op, sample_split_dims
from taskrt.geometry import Rect

BINARY_FNS = ("add", "subtract", "multiply")


def broadcast_rect(tile: Rect, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> Rect:
    """The rect of an input of `in_shape` that an output tile of a broadcast op reads."""
    lead = len(out_shape) - len(in_shape)
    lo, hi = [], []
    for j, size in enumerate(in_shape):
        d = lead + j
        if size == 1 and out_shape[d] != 1:
            lo.append(0)
            hi.append(1)
        else:
            lo.append(tile.lo[d])
            hi.append(tile.hi[d])
    return Rect(tuple(lo), tuple(hi))


def unbroadcast(g, shape: tuple[int, ...]):
    """Sum a gradient of the broadcast shape down to `shape` (the reverse of broadcasting)."""
    lead = g.ndim - len(shape)
    if lead:
        g = g.sum(axis=tuple(range(lead)))
    axes = tuple(j for j, size in enumerate(shape) if size == 1 and g.shape[j] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g


@register_op
class ElementBinary(Op):
    """y = a (+|-|*) b with NumPy broadcasting; every output dim may be split (0 sample, rest attribute)."""

    kind = "binary"

    def __init__(self, name, inputs, fn: str = "add"):
        super().__init__(name, inputs, fn=fn)

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 2:
            raise self.fail(f"takes 2 inputs, got {len(in_shapes)}")
        if self.fn not in BINARY_FNS:
            raise self.fail(f"unknown fn {self.fn!r}; expected one of {BINARY_FNS}")
        a, b = in_shapes
        if len(a) == 0 or len(b) == 0:
            raise self.fail(f"inputs need at least 1 dim, got shapes {a} and {b}")
        n = max(len(a), len(b))
        pa, pb = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
        out = []
        for d, (x, y) in enumerate(zip(pa, pb)):
            if x != y and 1 not in (x, y):
                raise self.fail(f"shapes {a} and {b} don't broadcast: dim {d} of the output is {x} vs {y}")
            out.append(y if x == 1 else x)
        return [tuple(out)]

    def output_dtypes(self):
        return [np.result_type(*(np.dtype(t.dtype) for t in self.inputs)).name]

    def split_dims(self):
        return sample_split_dims(len(self.tile_shape))

    def input_rects(self, tile: Rect) -> list[Rect]:
        return [broadcast_rect(tile, t.shape, self.tile_shape) for t in self.inputs]

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        a, b = inputs
        if self.fn == "add":
            y = a + b
        elif self.fn == "subtract":
            y = a - b
        else:
            y = a * b
        # every output dim longer than 1 is read whole-tile from some input, so y has the tile's shape;
        # its dtype follows the arrays (NumPy promotion), as output_dtypes does for the specs
        return [y], None

    def backward_reads(self):
        product = self.fn == "multiply"   # a sum's gradient needs neither input
        return (product, product), (False,)

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        a, b = inputs
        (g,) = grad_outputs
        if self.fn == "add":
            ga, gb = g, g
        elif self.fn == "subtract":
            ga, gb = g, -g
        else:
            ga, gb = g * b, g * a
        grads = []
        for spec, r, gx in ((self.inputs[0], in_rects[0], ga), (self.inputs[1], in_rects[1], gb)):
            # integer inputs (indices, masks) get no gradient, as the contract asks
            dtype = np.dtype(spec.dtype)
            grads.append(unbroadcast(gx, r.shape).astype(dtype, copy=False) if dtype.kind == "f" else None)
        return grads, {}

    def flops(self, tile: Rect) -> int:
        return tile.volume
