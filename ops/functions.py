"""Element-wise activation functions and their derivatives, shared by every op that fuses one.

Each works on numpy or cupy arrays (`xp`). gelu is the exact erf form, PyTorch's default.
"""
from __future__ import annotations

import math

import numba
import numpy as np

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


def erf(xp, x):
    if xp is np:
        return _erf_cpu()(x)
    from cupyx.scipy.special import erf as cupy_erf
    return cupy_erf(x)


def activation_forward(xp, name: str, x):
    """y = f(x) for f in ACTIVATIONS; None means identity."""
    if name is None:
        return x
    if name == "relu":
        return xp.maximum(x, 0)
    if name == "sigmoid":
        return 1 / (1 + xp.exp(-x))
    if name == "tanh":
        return xp.tanh(x)
    if name == "gelu":
        return 0.5 * x * (1 + erf(xp, x * x.dtype.type(1 / math.sqrt(2))))
    raise ValueError(f"unknown activation {name!r}; expected one of {ACTIVATIONS} or None")


def activation_backward(xp, name: str, x, y, dy):
    """dL/dx from the input x, output y and dL/dy (gelu alone reads x)."""
    if name is None:
        return dy
    if name == "relu":
        return dy * (y > 0)  # y > 0 exactly where x > 0
    if name == "sigmoid":
        return dy * y * (1 - y)
    if name == "tanh":
        return dy * (1 - y * y)
    if name == "gelu":
        cdf = 0.5 * (1 + erf(xp, x * x.dtype.type(1 / math.sqrt(2))))
        pdf = xp.exp(-0.5 * x * x) * x.dtype.type(1 / math.sqrt(2 * math.pi))
        return dy * (cdf + x * pdf)
    raise ValueError(f"unknown activation {name!r}; expected one of {ACTIVATIONS} or None")
