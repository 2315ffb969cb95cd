"""Matrix products: a dense (fully connected) layer with a fused activation, and batched matmul.

Both are plain BLAS calls on contiguous-or-strided 2-D views: no transposed copies
are made (numpy and cupy pass transposes and row strides to GEMM themselves). The one
exception is dense's forward on the CPU with few rows against a large weight, which BLAS would
repack at every call: ops/thin_gemm.py's dot kernel.

The tile space of both is the output's shape plus the reduction dimension (dense's input
features, batch matmul's inner dimension), split as kind `reduce`: a tile multiplies one
slice of it and makes a partial output, and the tiles' partial outputs are summed. With the
output-feature split before it, this is the column-then-row parallel MLP of tensor-parallel
training.
"""
from __future__ import annotations

import math

import numpy as np

from ops.base import (ATTRIBUTE, PARAMETER, REDUCE, SAMPLE, Op, SplitDim, bool_attr, given_out, is_count, register_op,
                      weight_target)
from ops.functions import ACTIVATIONS, activation_backward, activation_forward
from ops.thin_gemm import thin_matmul
from taskrt.geometry import Rect

#: rough forward flops per element of each fused activation, for the analytic cost model
_ACT_FLOPS = {None: 0, "relu": 1, "sigmoid": 4, "tanh": 6, "gelu": 10}


def torch_linear_init(rng: np.random.Generator, shape, fan_in: int, dtype) -> np.ndarray:
    """nn.Linear's default for weight and bias: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

    (kaiming_uniform with a=sqrt(5) on the weight reduces to the same bound.)
    """
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return rng.uniform(-bound, bound, size=shape).astype(dtype)


@register_op
class Dense(Op):
    """y = act(x @ weight.T + bias) over the last dim: PyTorch's nn.Linear plus a fused activation.

    x is [batch, ..., in] and y is [batch, ..., out]; the tile space is [batch, ..., out, in].
    Dim 0 is the sample dim, the middle dims are attributes, out features are the parameter
    dim, and in features (the last) a reduce dim when there is no activation (an activation
    of partial sums is not the activation of their sum): a tile with out features [a, b) and
    in features [k0, k1) reads the block [a:b, k0:k1] of weight, the rows [a, b) of the bias
    (on the tile leading its in-feature group only) and the columns [k0, k1) of its input rows.
    """

    kind = "dense"
    float_inputs = True
    writes_out = True
    writes_weight_out = True

    def __init__(self, name, inputs, out_features: int, use_bias: bool = True, activation: str | None = None):
        super().__init__(name, inputs, out_features=out_features,
                         use_bias=bool_attr(self.kind, name, "use_bias", use_bias), activation=activation)

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 1:
            raise self.fail(f"takes 1 input, got {len(in_shapes)}")
        (shape,) = in_shapes
        if len(shape) < 2:
            raise self.fail(f"needs at least 2 dims [batch, ..., in], got shape {shape}")
        if not is_count(self.out_features):
            raise self.fail(f"out_features must be a positive int, got {self.out_features!r}")
        if self.activation is not None and self.activation not in ACTIVATIONS:
            raise self.fail(f"unknown activation {self.activation!r}; expected None or one of {ACTIVATIONS}")
        return [tuple(shape[:-1]) + (int(self.out_features),)]

    @property
    def in_features(self) -> int:
        return self.inputs[0].shape[-1]

    @property
    def tile_shape(self) -> tuple[int, ...]:
        return self.outputs[0].shape + (self.in_features,)

    def weight_shapes(self):
        shapes = {"weight": (int(self.out_features), self.in_features)}
        if self.use_bias:
            shapes["bias"] = (int(self.out_features),)
        return shapes

    def init_weights(self, rng):
        return {k: torch_linear_init(rng, s, self.in_features, self.weight_dtype(k))
                for k, s in self.weight_shapes().items()}

    def split_dims(self):
        n = len(self.tile_shape)
        dims = (SplitDim(0, SAMPLE),) + tuple(SplitDim(d, ATTRIBUTE) for d in range(1, n - 2)) + (
            SplitDim(n - 2, PARAMETER),)
        return dims + ((SplitDim(n - 1, REDUCE),) if self.activation is None else ())

    def output_rects(self, tile: Rect) -> list[Rect]:
        return [Rect(tile.lo[:-1], tile.hi[:-1])]

    def input_rects(self, tile: Rect) -> list[Rect]:
        return [Rect(tile.lo[:-2] + tile.lo[-1:], tile.hi[:-2] + tile.hi[-1:])]

    def weight_rects(self, tile: Rect) -> dict[str, Rect]:
        a, b = tile.lo[-2], tile.hi[-2]
        rects = {"weight": Rect((a, tile.lo[-1]), (b, tile.hi[-1]))}
        if self.use_bias:
            rects["bias"] = Rect((a,), (b,))
        return rects

    def bias_weights(self):
        return ("bias",) if self.use_bias else ()

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None, out=None):
        (x,) = inputs
        w = weights["weight"]
        if w.shape[1] != x.shape[-1]:
            raise self.fail(f"in features mismatch: input has {x.shape[-1]}, weight is {tuple(w.shape)}")
        x2 = x.reshape(-1, x.shape[-1])
        given = given_out(out, 0)[0] if self.activation in (None, "relu") else None  # gelu saves z
        if given is not None:
            z = given.reshape(-1, w.shape[0])
            z = thin_matmul(x2, w, z) if xp is np else xp.matmul(x2, w.T, out=z)
            if "bias" in weights:
                z += weights["bias"]
            if self.activation == "relu":
                xp.maximum(z, 0, out=z)
            return [given], None
        z = thin_matmul(x2, w) if xp is np else x2 @ w.T
        if "bias" in weights:
            z += weights["bias"]
        y = activation_forward(xp, self.activation, z)
        # gelu's derivative needs the pre-activation; the others are functions of y
        saved = z if self.activation == "gelu" else None
        return [y.reshape(x.shape[:-1] + (w.shape[0],))], saved

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved, out=None, weight_out=None):
        (x,), (y,), (dy,) = inputs, outputs, grad_outputs
        w = weights["weight"]
        n_out = w.shape[0]
        y2, dy2 = y.reshape(-1, n_out), dy.reshape(-1, n_out)
        dz = activation_backward(xp, self.activation, saved, y2, dy2)
        x2 = x.reshape(-1, x.shape[-1])
        given, wanted = given_out(out, 0)
        if not wanted:  # the model's input: no one reads dx
            dx = None
        elif given is not None:
            dx = given
            xp.matmul(dz, w, out=dx.reshape(-1, w.shape[1]))
        else:
            dx = (dz @ w).reshape(x.shape)
        grads = {"weight": xp.matmul(dz.T, x2, out=weight_target(weight_out, "weight"))}
        if "bias" in weights:
            grads["bias"] = dz.sum(axis=0, out=weight_target(weight_out, "bias"))
        return [dx], grads

    def flops(self, tile: Rect) -> int:
        outputs = tile.volume // max(1, tile.shape[-1])
        bias = int(self.use_bias and self.leads_partial_group(tile))
        return outputs * (2 * tile.shape[-1] + bias + _ACT_FLOPS[self.activation])


@register_op
class BatchMatmul(Op):
    """c = a @ b over the last two dims: a [batch, ..., m, k] and b [batch, ..., k, n] give [batch, ..., m, n].

    The leading dims must match exactly; the tile space is [batch, ..., m, n, k]. Dim 0
    is the sample dim, other leading dims and m are attributes, n is the parameter dim
    and k a reduce dim: a tile reads its rows of a and its columns of b over its slice
    of k, and makes a partial product.
    """

    kind = "batch_matmul"
    float_inputs = True

    def __init__(self, name, inputs):
        super().__init__(name, inputs)

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 2:
            raise self.fail(f"takes 2 inputs (a, b), got {len(in_shapes)}")
        a, b = in_shapes
        if len(a) < 3 or len(a) != len(b):
            raise self.fail(f"needs a [batch, ..., m, k] and b [batch, ..., k, n] of equal rank >= 3, "
                            f"got {a} and {b}")
        if a[:-2] != b[:-2]:
            raise self.fail(f"batch dims differ: a has {a[:-2]}, b has {b[:-2]}")
        if a[-1] != b[-2]:
            raise self.fail(f"inner dims differ: a {a} has k={a[-1]}, b {b} has k={b[-2]}")
        if self.inputs[0].dtype != self.inputs[1].dtype:
            raise self.fail(f"dtypes differ: {self.inputs[0].dtype} and {self.inputs[1].dtype}")
        return [tuple(a[:-1]) + (b[-1],)]

    @property
    def tile_shape(self) -> tuple[int, ...]:
        return self.outputs[0].shape + (self.inputs[0].shape[-1],)

    def split_dims(self):
        n = len(self.tile_shape)
        return (SplitDim(0, SAMPLE),) + tuple(SplitDim(d, ATTRIBUTE) for d in range(1, n - 2)) + (
            SplitDim(n - 2, PARAMETER), SplitDim(n - 1, REDUCE))

    def output_rects(self, tile: Rect) -> list[Rect]:
        return [Rect(tile.lo[:-1], tile.hi[:-1])]

    def input_rects(self, tile: Rect) -> list[Rect]:
        (m0, n0, k0), (m1, n1, k1) = tile.lo[-3:], tile.hi[-3:]
        a = Rect(tile.lo[:-3] + (m0, k0), tile.hi[:-3] + (m1, k1))
        b = Rect(tile.lo[:-3] + (k0, n0), tile.hi[:-3] + (k1, n1))
        return [a, b]

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        a, b = inputs
        if a.shape[-1] != b.shape[-2]:
            raise self.fail(f"inner dims differ: a tile {a.shape}, b tile {b.shape}")
        return [xp.matmul(a, b)], None

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        (a, b), (dc,) = inputs, grad_outputs
        da = xp.matmul(dc, xp.swapaxes(b, -1, -2))
        db = xp.matmul(xp.swapaxes(a, -1, -2), dc)
        return [da, db], {}

    def flops(self, tile: Rect) -> int:
        return 2 * tile.volume
