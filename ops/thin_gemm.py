"""x @ w.T for a few rows of x against a large weight w, on the CPU: register-tiled dot products.

BLAS packs all of w into its panels at every call (OpenBLAS has no interface to pack it once),
which a few rows of x do not pay back: a dense layer's 4096 x 4096 weight against 16 rows ran
at 48 GFLOP/s on this VM's two cores, an LSTM's 4096 x 1024 recurrent weight against 16
samples at 55-115. `dots` reads w's rows once per tile of four rows of x (two without
AVX-512) and keeps the tile's sums in registers: 122 and 110-170 GFLOP/s there (at 4 rows 60
against 16).

    thin_matmul(x2, w, out)     # out = x2 @ w.T, rows of w over the task's cores, on the pool
    dots(a, x, s, out, so, lo, hi, add)   # the kernel, for callers that run it in their own loops

uses_dots(x2, w) says where the kernel wins: float32 or float64 on the CPU, contiguous operands,
at most THIN_MAX_ROWS rows of x and a weight of at least THIN_MIN_WEIGHT entries.
"""
from __future__ import annotations

import llvmlite.binding as llvm
import numba
import numpy as np

from ops import cpu_pool

#: the kernel's flags: the sums reassociated so that LLVM vectorizes them, contracted
#: multiply-adds, and no division check (error_model "numpy")
_OPTIONS = dict(nogil=True, error_model="numpy", fastmath={"reassoc", "contract"})
#: the most rows of x for which dots beats BLAS. The product alone, dense 4096 x 4096 on two cores:
#: 4 rows 2.2 against 8.6 ms, 16 rows 4.4 against 11.2, 64 rows 16.1 against 18.2. Inside the
#: operator, its forward beside a backward on BLAS's threads (which spin on after it), forward +
#: backward, medians: 16 rows 39.4 against 44.6 ms, 32 rows 50.6 against 49.8, 48 and 64 rows
#: 73.8 and 77.9 against 69.6 and 62.9
THIN_MAX_ROWS = 32
#: the fewest weight entries for which the kernel on the pool (about 0.1 ms a handoff) beats
#: BLAS: against 16 rows, medians, 512 x 512 195 against 171 us, 1024 x 1024 454 against 650,
#: 2048 x 2048 1.97 against 2.73 ms
THIN_MIN_WEIGHT = 1 << 20


@numba.njit(inline="always", **_OPTIONS)
def _put(row, m, v, add):
    """row[m] = v, or row[m] += v if `add`."""
    if add:
        row[m] += v
    else:
        row[m] = v


@numba.njit(inline="always", **_OPTIONS)
def _put4(row, m, v0, v1, v2, v3, add):
    """row[m:m + 4] = (v0, v1, v2, v3), or += if `add`."""
    _put(row, m, v0, add)
    _put(row, m + 1, v1, add)
    _put(row, m + 2, v2, add)
    _put(row, m + 3, v3, add)


def _compiles_for_avx512() -> bool:
    """Whether numba compiles for a CPU with AVX-512: the features numba is told to target
    (NUMBA_CPU_NAME and NUMBA_CPU_FEATURES), else the host's as LLVM sees them."""
    if numba.config.CPU_NAME:
        return "+avx512f" in (numba.config.CPU_FEATURES or "")
    try:
        return bool(llvm.get_host_cpu_features().get("avx512f", False))
    except RuntimeError:   # LLVM could not read the host's features
        return False


#: whether the kernels have 32 vector registers (AVX-512) or 16 (AVX2 and older): a tile's sums
#: stay in registers only if they fit. One core of a first-generation EPYC (AVX2), 2048 x 1024
#: against 64 samples: 4 x 4 tiles 24.3 GFLOP/s (its 16 sums and 8 operands spill), 4 x 2 tiles
#: 35.6, 3 x 3 34.0, OpenBLAS 23.8; with AVX-512 the 4 x 4 tiles ran at 93-101 (sessions 31-39)
WIDE_REGISTERS = _compiles_for_avx512()


@numba.njit(inline="always", **_OPTIONS)
def _four_rows(a0, a1, a2, a3, xb, n_k, row, m, add):
    """row[m:m + 4] = (a0 . xb, ..., a3 . xb), or += if `add`: four rows of a against one sample."""
    s0 = s1 = s2 = s3 = a0.dtype.type(0)
    for k in range(n_k):
        q = xb[k]
        s0 += a0[k] * q
        s1 += a1[k] * q
        s2 += a2[k] * q
        s3 += a3[k] * q
    _put4(row, m, s0, s1, s2, s3, add)


@numba.njit(inline="always", **_OPTIONS)
def _rows_left(a, x, s, out, so, m, hi, add):
    """The rows m..hi-1 of a (fewer than four) against every sample, one at a time."""
    n_k, n_b = a.shape[1], x.shape[0]
    for mm in range(m, hi):
        am = a[mm]
        for bb in range(n_b):
            xb = x[bb, s]
            s0 = a.dtype.type(0)
            for k in range(n_k):
                s0 += am[k] * xb[k]
            _put(out[bb, so], mm, s0, add)


@numba.njit(cache=True, **_OPTIONS)
def _dots_4x4(a, x, s, out, so, lo, hi, add):
    """dots in tiles of 4 rows of a by 4 samples: 16 sums in registers (32 vector registers)."""
    n_k, n_b = a.shape[1], x.shape[0]
    zero = a.dtype.type(0)
    m = lo
    while m + 4 <= hi:
        a0, a1, a2, a3 = a[m], a[m + 1], a[m + 2], a[m + 3]
        b = 0
        while b + 4 <= n_b:
            x0, x1, x2, x3 = x[b, s], x[b + 1, s], x[b + 2, s], x[b + 3, s]
            s00 = s01 = s02 = s03 = s10 = s11 = s12 = s13 = zero
            s20 = s21 = s22 = s23 = s30 = s31 = s32 = s33 = zero
            for k in range(n_k):
                p0, p1, p2, p3 = a0[k], a1[k], a2[k], a3[k]
                q0, q1, q2, q3 = x0[k], x1[k], x2[k], x3[k]
                s00 += p0 * q0
                s01 += p0 * q1
                s02 += p0 * q2
                s03 += p0 * q3
                s10 += p1 * q0
                s11 += p1 * q1
                s12 += p1 * q2
                s13 += p1 * q3
                s20 += p2 * q0
                s21 += p2 * q1
                s22 += p2 * q2
                s23 += p2 * q3
                s30 += p3 * q0
                s31 += p3 * q1
                s32 += p3 * q2
                s33 += p3 * q3
            _put4(out[b, so], m, s00, s10, s20, s30, add)
            _put4(out[b + 1, so], m, s01, s11, s21, s31, add)
            _put4(out[b + 2, so], m, s02, s12, s22, s32, add)
            _put4(out[b + 3, so], m, s03, s13, s23, s33, add)
            b += 4
        for bb in range(b, n_b):
            _four_rows(a0, a1, a2, a3, x[bb, s], n_k, out[bb, so], m, add)
        m += 4
    _rows_left(a, x, s, out, so, m, hi, add)


@numba.njit(cache=True, **_OPTIONS)
def _dots_4x2(a, x, s, out, so, lo, hi, add):
    """dots in tiles of 4 rows of a by 2 samples: 8 sums in registers (16 vector registers)."""
    n_k, n_b = a.shape[1], x.shape[0]
    zero = a.dtype.type(0)
    m = lo
    while m + 4 <= hi:
        a0, a1, a2, a3 = a[m], a[m + 1], a[m + 2], a[m + 3]
        b = 0
        while b + 2 <= n_b:
            x0, x1 = x[b, s], x[b + 1, s]
            s00 = s01 = s10 = s11 = s20 = s21 = s30 = s31 = zero
            for k in range(n_k):
                p0, p1, p2, p3 = a0[k], a1[k], a2[k], a3[k]
                q0, q1 = x0[k], x1[k]
                s00 += p0 * q0
                s01 += p0 * q1
                s10 += p1 * q0
                s11 += p1 * q1
                s20 += p2 * q0
                s21 += p2 * q1
                s30 += p3 * q0
                s31 += p3 * q1
            _put4(out[b, so], m, s00, s10, s20, s30, add)
            _put4(out[b + 1, so], m, s01, s11, s21, s31, add)
            b += 2
        if b < n_b:
            _four_rows(a0, a1, a2, a3, x[b, s], n_k, out[b, so], m, add)
        m += 4
    _rows_left(a, x, s, out, so, m, hi, add)


#: dots(a, x, s, out, so, lo, hi, add): out[b, so, m] = a[m] . x[b, s] (or += if `add`) for
#: lo <= m < hi and every sample b; a is [M, K], x [B, ., K] and out [B, ., M], all C-contiguous.
#: Tiles of 4 rows of a by 4 samples (2 without AVX-512): their dot products over K in one loop
#: that LLVM vectorizes, the sums in registers, a's 4 rows read once per tile of samples and
#: from L1 after the first.
dots = _dots_4x4 if WIDE_REGISTERS else _dots_4x2


def uses_dots(x2, w) -> bool:
    """Whether thin_matmul(x2, w) runs the dots kernel: numpy arrays of one float type the kernel
    compiles for, x2 [rows, in] and w [out, in] C-contiguous, few rows and a large weight."""
    return (isinstance(x2, np.ndarray) and isinstance(w, np.ndarray) and x2.dtype == w.dtype
            and x2.dtype in (np.float32, np.float64) and x2.ndim == 2 and w.ndim == 2
            and x2.shape[0] <= THIN_MAX_ROWS and w.size >= THIN_MIN_WEIGHT
            and x2.flags.c_contiguous and w.flags.c_contiguous)


def thin_matmul(x2, w, out=None):
    """x2 @ w.T into out (a new [rows, out] array if None; any strides): the dots kernel over the
    rows of w, one part per core of the task on the pool (whose threads sleep when done, where
    numba's would spin on the cores the next BLAS call needs), where uses_dots; else BLAS."""
    if not uses_dots(x2, w):
        return np.matmul(x2, w.T, out=out)
    target = out if out is not None and out.flags.c_contiguous else np.empty((x2.shape[0], w.shape[0]), x2.dtype)
    x3, t3 = x2.reshape(x2.shape[0], 1, x2.shape[1]), target.reshape(target.shape[0], 1, target.shape[1])
    cpu_pool.in_parts(lambda lo, hi: dots(w, x3, 0, t3, 0, lo, hi, False), w.shape[0])
    if out is None:
        return target
    if target is not out:
        out[...] = target
    return out
