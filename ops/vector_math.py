"""Float32 math that LLVM vectorizes inside numba loops, for the CPU kernels.

numba's np.exp and math.erf are one value at a time (it has no vector math library without
SVML). Here: exp as Cephes' expf polynomial times a power of two built in integer bits, and
erf as Eigen's rational function. Float64 keeps numpy's and math's exact functions.
"""
from __future__ import annotations

import math

import numba
import numpy as np
from numba.extending import overload

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)  # ln 2 = _LN2_HI + _LN2_LO, _LN2_HI exact in few bits
_LN2_LO = np.float32(-2.12194440e-4)
#: exp of less is below float32's smallest normal, and 0 from here (2^k's bits 0: +0.0), as np.exp's nearly
_EXP_MIN = np.float32(-88.0)


@numba.njit(nogil=True, inline="always", fastmath={"contract"})
def exp_shifted_row(x, m, y, bits, fast):
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


@numba.njit(nogil=True, inline="always")
def row_max(x):
    """The largest value of the 1-D array x (size >= 1), NaNs after x[0] ignored (as a running
    `v if v > m else m` does). Eight running maxima, each over every eighth value: LLVM does
    not vectorize a float max reduction without function-wide no-NaN math, which numba's
    fastmath flags do not set, and one chain of compares waits on itself (3.1 against 1.1 ms
    for 6.3M float32 values, as the softmax's rows)."""
    n = x.size
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = x[0]
    blocks = n // 8
    for b in range(blocks):
        v = x[8 * b:8 * b + 8]
        m0 = v[0] if v[0] > m0 else m0
        m1 = v[1] if v[1] > m1 else m1
        m2 = v[2] if v[2] > m2 else m2
        m3 = v[3] if v[3] > m3 else m3
        m4 = v[4] if v[4] > m4 else m4
        m5 = v[5] if v[5] > m5 else m5
        m6 = v[6] if v[6] > m6 else m6
        m7 = v[7] if v[7] > m7 else m7
    m = m0
    for v in (m1, m2, m3, m4, m5, m6, m7):
        m = v if v > m else m
    tail = x[8 * blocks:]
    for i in range(tail.size):
        m = tail[i] if tail[i] > m else m
    return m


# erf(x) ~ x p(x^2) / q(x^2) on [-4, 4] and +-1 beyond (float32 rounds erf(4) to 1)
_f32 = np.float32
_ERF_CLAMP = _f32(4.0)
_EA1, _EA3, _EA5, _EA7, _EA9, _EA11, _EA13 = (
    _f32(-1.60960333262415e-02), _f32(-2.95459980854025e-03), _f32(-7.34990630326855e-04),
    _f32(-5.69250639462346e-05), _f32(-2.10102402082508e-06), _f32(2.77068142495902e-08),
    _f32(-2.72614225801306e-10))
_EB0, _EB2, _EB4, _EB6, _EB8 = (_f32(-1.42647390514189e-02), _f32(-7.37332916720468e-03),
                                _f32(-1.68282697438203e-03), _f32(-2.13374055278905e-04),
                                _f32(-1.45660718464996e-05))


@numba.njit(inline="always", error_model="numpy", fastmath={"contract"})
def erf_value(x, fast):
    """erf(x): the rational approximation if `fast` (float32, within 5e-7), else math.erf."""
    if fast:
        x = _ERF_CLAMP if x > _ERF_CLAMP else x
        x = -_ERF_CLAMP if x < -_ERF_CLAMP else x
        x2 = x * x
        p = x2 * _EA13 + _EA11
        p = p * x2 + _EA9
        p = p * x2 + _EA7
        p = p * x2 + _EA5
        p = p * x2 + _EA3
        p = p * x2 + _EA1
        q = x2 * _EB8 + _EB6
        q = q * x2 + _EB4
        q = q * x2 + _EB2
        q = q * x2 + _EB0
        return x * p / q
    return math.erf(x)


def is_float32(a) -> bool:
    """Whether array `a` is float32: the `fast` flag of the functions above. Inside numba it is a
    compile-time constant (the overload below), so that a kernel's branches on it are folded
    away: passed in as an argument, the flag kept gelu's backward loop, with exp and erf inlined
    into it, from vectorizing (81 against 24 us for 16k values)."""
    return a.dtype == np.float32


@overload(is_float32)
def _is_float32(a):
    flag = a.dtype == numba.types.float32
    return lambda a: flag
