"""Activations as operators: softmax over the last dimension and element-wise unary functions.

Both keep the input's shape, so a tile reads exactly the same rect of its input.
The element-wise math lives in ops.functions, shared with ops that fuse an activation.

On the CPU softmax runs fused numba row kernels (one pass forward, one backward, rows shared
out over the task's cores: as many threads as BLAS has, which the runtime sets to each CPU
worker's share) on the rows as `row_starts` hands them over: a tile's view, whatever its
strides, without a copy. Forward's float32 exp is a polynomial that LLVM vectorizes (numba
has no vector exp without SVML). MultiHeadAttention uses the same kernels for its scores.
Elsewhere (cupy) it is plain array code.
"""
from __future__ import annotations

import numba
import numpy as np

from ops import cuda_kernels
from ops.base import Op, register_op, sample_split_dims
from ops.cpu_layout import row_starts
from ops.cpu_threads import RowKernel, row_split
from ops.functions import ACTIVATIONS, activation_backward, activation_forward
from ops.vector_math import exp_shifted_row, row_max
from taskrt.geometry import Rect

#: rough forward flops per element of each activation, for the analytic cost model
_UNARY_FLOPS = {"relu": 1, "sigmoid": 4, "tanh": 6, "gelu": 10}


# ---- row kernels on the CPU ------------------------------------------------------------------
@RowKernel
def _softmax_rows_cpu(x, xs, n, y, ys, period, first, fast, chunks):
    """Row r of y = softmax of row r of x ((flat, starts) pairs, rows of n; y may be x), with
    the polynomial exp if `fast` (float32). Causal when period > 0: row r sees its first
    min(n, first + r % period + 1) values, the rest of its y is 0."""
    rows = xs.size
    for c in numba.prange(chunks):
        bits = np.empty(n, np.int32)
        e = np.empty(n, y.dtype)   # exp's values, apart from x so that its loops vectorize
        for r in range(c * rows // chunks, (c + 1) * rows // chunks):
            seen = n if period == 0 else min(n, first + r % period + 1)
            xr, yr = x[xs[r]:xs[r] + seen], y[ys[r]:ys[r] + n]
            m = row_max(xr)
            inv = yr.dtype.type(1.0 / exp_shifted_row(xr, m, e, bits, fast))
            for i in range(seen):
                yr[i] = e[i] * inv
            for i in range(seen, n):
                yr[i] = 0


@RowKernel
def _softmax_grad_rows_cpu(y, ys, dy, dys, n, dx, dxs, chunks):
    """Rows dx = y * (dy - sum(dy * y)), the sum per row in float64 ((flat, starts) pairs,
    rows of n; dx may be dy)."""
    rows = ys.size
    for c in numba.prange(chunks):
        for r in range(c * rows // chunks, (c + 1) * rows // chunks):
            yr, gr, dr = y[ys[r]:ys[r] + n], dy[dys[r]:dys[r] + n], dx[dxs[r]:dxs[r] + n]
            s = 0.0
            for i in range(n):
                s += np.float64(gr[i]) * yr[i]
            t = gr.dtype.type(s)
            for i in range(n):
                dr[i] = yr[i] * (gr[i] - t)


def softmax_rows_(xp, x, out, causal_first: int | None = None) -> None:
    """out = softmax(x) over the last axis; out is x itself or an array of x's shape whose rows
    are contiguous.
    causal_first q0: x is [..., Lq, Lk] scores of queries q0.. and query q0 + i sees keys 0..q0 + i
    only (the others get 0). Fused numba kernels on the CPU, one CUDA kernel on a GPU."""
    if cuda_kernels.on_gpu(xp) and cuda_kernels.supports(x, out):
        cuda_kernels.softmax_rows_(x, out, causal_first)
        return
    if xp is np and x.dtype in (np.float32, np.float64) and x.size:
        flat, xs = row_starts(x, writable=out is x)
        yflat, ys = (flat, xs) if out is x else row_starts(out, writable=True)
        period, first = (0, 0) if causal_first is None else (x.shape[-2], causal_first)
        threads, chunks = row_split(xs.size, x.shape[-1])
        _softmax_rows_cpu.on(threads)(flat, xs, x.shape[-1], yflat, ys, period, first, x.dtype == np.float32,
                                      chunks)
        return
    if causal_first is not None:
        lq, lk = x.shape[-2:]
        hidden = xp.arange(lk)[None, :] > (causal_first + xp.arange(lq))[:, None]
        x = xp.where(hidden, x.dtype.type(-xp.inf), x)
    xp.subtract(x, x.max(axis=-1, keepdims=True), out=out)
    xp.exp(out, out=out)
    out *= xp.reciprocal(out.sum(axis=-1, keepdims=True))


def softmax_grad_rows(xp, y, dy, out=None):
    """dx = y * (dy - rowsum(dy * y)) over the last axis, into `out` (dy itself, an array of y's
    shape whose rows are contiguous, or None: a new array)."""
    if cuda_kernels.on_gpu(xp) and cuda_kernels.supports(y, dy):
        return cuda_kernels.softmax_grad_rows(y, dy, out)
    if xp is np and y.dtype in (np.float32, np.float64) and y.dtype == dy.dtype and y.size:
        out = np.empty(y.shape, y.dtype) if out is None else out
        yflat, ys = row_starts(y)
        gflat, gs = row_starts(dy, writable=out is dy)
        oflat, os_ = (gflat, gs) if out is dy else row_starts(out, writable=True)
        threads, chunks = row_split(ys.size, y.shape[-1])
        _softmax_grad_rows_cpu.on(threads)(yflat, ys, gflat, gs, y.shape[-1], oflat, os_, chunks)
        return out
    dx = dy - (dy * y).sum(axis=-1, keepdims=True)
    dx *= y
    if out is None:
        return dx
    out[...] = dx
    return out


@register_op
class Softmax(Op):
    """y = exp(x - max) / sum(exp(x - max)) over the last dimension (PyTorch's torch.softmax(x, -1)).

    Every dimension but the softmax one may be split: a row is never cut, so a tile
    reads exactly its own rect of the input.
    """

    kind = "softmax"
    float_inputs = True

    def __init__(self, name, inputs, axis: int = -1):
        super().__init__(name, inputs, axis=axis)

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 1:
            raise self.fail(f"takes 1 input, got {len(in_shapes)}")
        (shape,) = in_shapes
        if len(shape) < 2:
            raise self.fail(f"needs at least 2 dims (dim 0 is the batch), got shape {shape}")
        if (not isinstance(self.axis, (int, np.integer)) or isinstance(self.axis, bool)
                or self.axis not in (-1, len(shape) - 1)):
            raise self.fail(f"axis={self.axis!r} is not supported; only the last dim (axis=-1) is")
        return [shape]

    def split_dims(self):
        return sample_split_dims(len(self.tile_shape) - 1)

    def input_rects(self, tile: Rect) -> list[Rect]:
        return [tile]

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        (x,) = inputs
        y = xp.empty(x.shape, x.dtype)
        softmax_rows_(xp, x, y)
        return [y], None

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        (y,), (dy,) = outputs, grad_outputs
        return [softmax_grad_rows(xp, y, dy)], {}

    def flops(self, tile: Rect) -> int:
        # max, subtract, exp, sum, divide
        return 5 * tile.volume


@register_op
class ElementUnary(Op):
    """y = fn(x) element-wise for fn in ops.functions.ACTIVATIONS; every dimension may be split."""

    kind = "unary"
    float_inputs = True

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

    def backward_reads(self):
        gelu = self.fn == "gelu"   # gelu's gradient reads x, the others' y
        return (gelu,), (not gelu,)

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        return [activation_backward(xp, self.fn, inputs[0], outputs[0], grad_outputs[0])], {}

    def flops(self, tile: Rect) -> int:
        return _UNARY_FLOPS[self.fn] * tile.volume
