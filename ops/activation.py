"""Activations as operators: softmax over the last dimension and element-wise unary functions.

Both keep the input's shape, so a tile reads exactly the same rect of its input.
The element-wise math lives in ops.functions, shared with ops that fuse an activation.
"""
from __future__ import annotations

from ops.base import Op, register_op, sample_split_dims
from ops.functions import ACTIVATIONS, activation_backward, activation_forward
from taskrt.geometry import Rect

#: rough forward flops per element of each activation, for the analytic cost model
_UNARY_FLOPS = {"relu": 1, "sigmoid": 4, "tanh": 6, "gelu": 10}


@register_op
class Softmax(Op):
    """y = exp(x - max) / sum(exp(x - max)) over the last dimension (PyTorch's torch.softmax(x, -1)).

    Every dimension but the softmax one may be split: a row is never cut, so a tile
    reads exactly its own rect of the input.
    """

    kind = "softmax"

    def __init__(self, name, inputs, axis: int = -1):
        super().__init__(name, inputs, axis=axis)

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 1:
            raise self.fail(f"takes 1 input, got {len(in_shapes)}")
        (shape,) = in_shapes
        if len(shape) < 2:
            raise self.fail(f"needs at least 2 dims (dim 0 is the batch), got shape {shape}")
        if self.axis not in (-1, len(shape) - 1):
            raise self.fail(f"axis={self.axis!r} is not supported; only the last dim (axis=-1) is")
        return [shape]

    def split_dims(self):
        return sample_split_dims(len(self.tile_shape) - 1)

    def input_rects(self, tile: Rect) -> list[Rect]:
        return [tile]

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        (x,) = inputs
        e = xp.exp(x - x.max(axis=-1, keepdims=True))
        return [e / e.sum(axis=-1, keepdims=True)], None

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        (y,), (dy,) = outputs, grad_outputs
        return [y * (dy - (dy * y).sum(axis=-1, keepdims=True))], {}

    def flops(self, tile: Rect) -> int:
        # max, subtract, exp, sum, divide
        return 5 * tile.volume


@register_op
class ElementUnary(Op):
    """y = fn(x) element-wise for fn in ops.functions.ACTIVATIONS; every dimension may be split."""

    kind = "unary"

    def __init__(self, name, inputs, fn: str = "relu"):
        super().__init__(name, inputs, fn=fn)

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 1:
            raise self.fail(f"takes 1 input, got {len(in_shapes)}")
        if self.fn not in ACTIVATIONS:
            raise self.fail(f"unknown fn {self.fn!r}; expected one of {ACTIVATIONS}")
        if len(in_shapes[0]) < 1:
            raise self.fail("needs at least 1 dim (dim 0 is the batch)")
        return [in_shapes[0]]

    def split_dims(self):
        return sample_split_dims(len(self.tile_shape))

    def input_rects(self, tile: Rect) -> list[Rect]:
        return [tile]

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        return [activation_forward(xp, self.fn, inputs[0])], None

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        return [activation_backward(xp, self.fn, inputs[0], outputs[0], grad_outputs[0])], {}

    def flops(self, tile: Rect) -> int:
        return _UNARY_FLOPS[self.fn] * tile.volume
