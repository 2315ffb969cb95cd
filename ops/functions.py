"""Element-wise activation functions and their derivatives, shared by every op that fuses one.

Each works on numpy or cupy arrays (`xp`). gelu is the exact erf form, PyTorch's default. On
the CPU it is one numba kernel each way: numpy's form made five passes and called erf one
value at a time (16k values: 116 us forward, 246 us backward). In float32 the kernels' erf is
a rational function that LLVM vectorizes, within 5e-7 of erf over the whole line, and the
backward's exp Cephes' polynomial (ops/vector_math.py); float64 calls math.erf and np.exp.
Arrays of PARALLEL_MIN_VALUES or more are shared out over the task's cores (ops/cpu_threads.py).
On a GPU each activation is one fused cupy kernel each way (ops/cuda_kernels.py).
"""
from __future__ import annotations

import math

import numba
import numpy as np

from ops import cuda_kernels
from ops.cpu_threads import RowKernel, row_split
from ops.vector_math import erf_value, exp_shifted_row, is_float32

ACTIVATIONS = ("relu", "sigmoid", "tanh", "gelu")


_KERNELS: dict = {}


def _erf_scalar(x):
    return math.erf(x)


def _erf_cpu():
    """numba's vectorized erf, made on first use: made at import, it cost every process that
    imports ops 0.2 s, and only gelu needs it."""
    kernel = _KERNELS.get("erf")
    if kernel is None:
        kernel = _KERNELS["erf"] = numba.vectorize(["float32(float32)", "float64(float64)"], nopython=True,
                                                   cache=True)(_erf_scalar)
    return kernel


_f32 = np.float32
_HALF, _ONE, _NEG_HALF, _ZERO = _f32(0.5), _f32(1.0), _f32(-0.5), _f32(0.0)
#: gelu's constants, cast to each array's dtype where used
_INV_SQRT2, _INV_SQRT_2PI = 1 / math.sqrt(2), 1 / math.sqrt(2 * math.pi)
#: the backward kernel makes exp(-x^2 / 2) this many values at a time (its scratch stays in cache)
_BLOCK = 2048


@RowKernel
def _gelu_forward_cpu(x, y, inv_sqrt2, chunks):
    """y = x * Phi(x), Phi(x) = (1 + erf(x / sqrt 2)) / 2, on flat arrays cut into `chunks`;
    1 / sqrt 2 in their dtype."""
    fast = is_float32(x)
    n = x.size
    for c in numba.prange(chunks):
        # a chunk's slices, indexed from 0: an index LLVM cannot prove non-negative keeps
        # numba's wraparound check in the loop, which then does not vectorize (4.5x slower)
        xc, yc = x[c * n // chunks:(c + 1) * n // chunks], y[c * n // chunks:(c + 1) * n // chunks]
        for i in range(xc.size):
            v = xc[i]
            yc[i] = _HALF * v * (_ONE + erf_value(v * inv_sqrt2, fast))


@RowKernel
def _gelu_backward_cpu(x, dy, dx, inv_sqrt2, inv_sqrt_2pi, chunks):
    """dx = dy * (Phi(x) + x * phi(x)), phi(x) = exp(-x^2 / 2) / sqrt(2 pi), on flat arrays cut
    into `chunks`, a block at a time (the exp's values in scratch that stays in cache); the
    constants in their dtype."""
    fast = is_float32(x)
    n = x.size
    for c in numba.prange(chunks):
        t = np.empty(_BLOCK, x.dtype)
        e = np.empty(_BLOCK, x.dtype)
        bits = np.empty(_BLOCK, np.int32)
        hi = (c + 1) * n // chunks
        for a in range(c * n // chunks, hi, _BLOCK):
            b = min(a + _BLOCK, hi)
            xb, gb, db = x[a:b], dy[a:b], dx[a:b]   # indexed from 0, as in _gelu_forward_cpu
            for i in range(xb.size):
                t[i] = _NEG_HALF * xb[i] * xb[i]
            exp_shifted_row(t[:xb.size], _ZERO, e, bits, fast)
            for i in range(xb.size):
                v = xb[i]
                db[i] = gb[i] * (_HALF * (_ONE + erf_value(v * inv_sqrt2, fast)) + v * e[i] * inv_sqrt_2pi)


def _cpu_kernels(*arrays) -> bool:
    """Whether gelu's numba kernels take these numpy arrays: one float dtype, the kernels' two."""
    return all(a.dtype == arrays[0].dtype for a in arrays) and arrays[0].dtype in (np.float32, np.float64)


def _flat(a):
    """a as a contiguous 1-D array (a view when it is contiguous)."""
    return np.ascontiguousarray(a).reshape(-1)


def erf(xp, x):
    if xp is np:
        return _erf_cpu()(x)
    from cupyx.scipy.special import erf as cupy_erf
    return cupy_erf(x)


def activation_forward(xp, name: str, x):
    """y = f(x) for f in ACTIVATIONS; None means identity."""
    if name is None:
        return x
    if name in ACTIVATIONS and cuda_kernels.on_gpu(xp) and x.dtype.kind == "f":
        return cuda_kernels.activation_forward(name, x)
    if name == "relu":
        return xp.maximum(x, 0)
    if name == "sigmoid":
        return 1 / (1 + xp.exp(-x))
    if name == "tanh":
        return xp.tanh(x)
    if name == "gelu":
        if xp is np and _cpu_kernels(x):
            y = np.empty(x.shape, x.dtype)
            threads, chunks = row_split(x.size, 1)
            _gelu_forward_cpu.on(threads)(_flat(x), y.reshape(-1), x.dtype.type(_INV_SQRT2), chunks)
            return y
        return 0.5 * x * (1 + erf(xp, x * x.dtype.type(_INV_SQRT2)))
    raise ValueError(f"unknown activation {name!r}; expected one of {ACTIVATIONS} or None")


def activation_backward(xp, name: str, x, y, dy):
    """dL/dx from the input x, output y and dL/dy (gelu alone reads x)."""
    if name is None:
        return dy
    read = x if name == "gelu" else y
    if name in ACTIVATIONS and cuda_kernels.on_gpu(xp) and read.dtype.kind == "f" and dy.dtype == read.dtype:
        return cuda_kernels.activation_backward(name, x, y, dy)
    if name == "relu":
        return dy * (y > 0)  # y > 0 exactly where x > 0
    if name == "sigmoid":
        return dy * y * (1 - y)
    if name == "tanh":
        return dy * (1 - y * y)
    if name == "gelu":
        if xp is np and _cpu_kernels(x, dy):
            dx = np.empty(x.shape, x.dtype)
            threads, chunks = row_split(x.size, 1)
            _gelu_backward_cpu.on(threads)(_flat(x), _flat(dy), dx.reshape(-1), x.dtype.type(_INV_SQRT2),
                                           x.dtype.type(_INV_SQRT_2PI), chunks)
            return dx
        cdf = 0.5 * (1 + erf(xp, x * x.dtype.type(_INV_SQRT2)))
        pdf = xp.exp(-0.5 * x * x) * x.dtype.type(_INV_SQRT_2PI)
        return dy * (cdf + x * pdf)
    raise ValueError(f"unknown activation {name!r}; expected one of {ACTIVATIONS} or None")
