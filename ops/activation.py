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

import types

import numba
import numpy as np

from ops import cpu_pool
from ops.base import Op, register_op, sample_split_dims
from ops.cpu_layout import row_starts
from ops.functions import ACTIVATIONS, activation_backward, activation_forward
from taskrt.geometry import Rect

#: rough forward flops per element of each activation, for the analytic cost model
_UNARY_FLOPS = {"relu": 1, "sigmoid": 4, "tanh": 6, "gelu": 10}


# ---- row kernels on the CPU ------------------------------------------------------------------
def task_threads() -> int:
    """The cores the running task has: the threads BLAS may use now (the runtime limits BLAS to
    each CPU worker's share of the cores), at most numba's."""
    return max(1, min(cpu_pool.threads(), numba.config.NUMBA_NUM_THREADS))


#: values below which a row kernel runs on one thread: one core does them in a few tenths of a
#: millisecond, about what waking a second thread can cost while other processes hold the
#: cores (at 2M, a quarter-batch tile of BERT-base's layer norm, 786k values, ran on one
#: thread in 1.8 ms; on two it takes 0.8, PyTorch 1.3)
PARALLEL_MIN_VALUES = 1 << 19


def use_task_threads(values: int) -> int:
    """How many of the task's cores a kernel over `values` values uses (one for fewer than
    PARALLEL_MIN_VALUES), this thread's numba kernels set to them where that is more than one."""
    threads = task_threads() if values >= PARALLEL_MIN_VALUES else 1
    if threads > 1:
        numba.set_num_threads(threads)
    return threads


def row_split(rows: int, length: int) -> tuple[int, int]:
    """(threads, chunks) for a row kernel over `rows` rows of `length`: use_task_threads, and
    how many pieces to cut the rows into, a few per thread so that they even out."""
    threads = use_task_threads(rows * length)
    return threads, max(1, min(rows, 4 * threads))


_ROW_KERNEL_OPTIONS = dict(nogil=True, cache=True, fastmath={"reassoc", "contract"})


class RowKernel:
    """A row kernel whose prange cuts the rows into `chunks` (its last argument), compiled
    twice from one function: parallel, for a task with several cores, and serial, for one. A
    parallel kernel's launch goes through numba's threading layer even on one thread, and two
    workers' launches contend there: an 8k-value layer norm took 10.8 us a call alone and
    26.9 us a call from each of two threads at once; serial, 9.5 and 6.5."""

    def __init__(self, fn):
        self.parallel = numba.njit(parallel=True, **_ROW_KERNEL_OPTIONS)(fn)
        # its own name, so that numba's cache (keyed by name, not by flags) keeps both
        serial = types.FunctionType(fn.__code__, fn.__globals__, f"{fn.__name__}_serial", fn.__defaults__,
                                    fn.__closure__)
        serial.__qualname__ = f"{fn.__qualname__}_serial"
        self.serial = numba.njit(**_ROW_KERNEL_OPTIONS)(serial)
        self.__doc__ = fn.__doc__

    def on(self, threads: int):
        """The compilation to run on `threads` threads (row_split's)."""
        return self.parallel if threads > 1 else self.serial


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 = _LN2_HI + _LN2_LO, _LN2_HI exact in few bits
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_MIN = np.float32(-87.0)  # exp of less is below float32's smallest normal: clamped here


@numba.njit(nogil=True, inline="always", fastmath={"contract"})
def _exp_shifted_row(x, m, y, bits, fast):
    """y = exp(x - m) for x <= m (a NaN stays NaN); returns sum(y) in float64. `fast` (float32):
    Cephes' expf polynomial times 2^k built in the int32 scratch `bits`, two loops that
    vectorize as long as y is not x (LLVM's overlap check then sends them to scalar code,
    three times slower); else np.exp."""
    n = x.size
    total = 0.0
    if fast:
        scale = bits[:n].view(np.float32)
        for i in range(n):
            t = x[i] - m
            t = _EXP_MIN if t < _EXP_MIN else t
            k = np.floor(t * _LOG2E + np.float32(0.5))
            r = t - k * _LN2_HI - k * _LN2_LO
            p = np.float32(1.9875691500e-4)
            p = p * r + np.float32(1.3981999507e-3)
            p = p * r + np.float32(8.3334519073e-3)
            p = p * r + np.float32(4.1665795894e-2)
            p = p * r + np.float32(1.6666665459e-1)
            p = p * r + np.float32(5.0000001201e-1)
            y[i] = p * r * r + r + np.float32(1.0)
            bits[i] = (np.int32(k) + np.int32(127)) << 23
        for i in range(n):
            v = y[i] * scale[i]
            y[i] = v
            total += v
    else:
        for i in range(n):
            v = np.exp(x[i] - m)
            y[i] = v
            total += v
    return total


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
            m = xr[0]
            for i in range(1, seen):
                m = xr[i] if xr[i] > m else m
            inv = yr.dtype.type(1.0 / _exp_shifted_row(xr, m, e, bits, fast))
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
    only (the others get 0). Fused numba kernels on the CPU, array code elsewhere."""
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
