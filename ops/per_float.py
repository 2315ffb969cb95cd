"""Heavy numba kernels compiled once per float type, whatever layouts and flags their arrays have.

numba compiles a function again for each new combination of argument types, and an array's
type holds its layout (contiguous or strided) and whether it is read-only. The runtime hands
kernels contiguous arrays, strided views (a tile of a region) and read-only inputs in every
mix, so a convolution's parallel kernel, 10-15 s to compile, was compiled five to eleven times
by the test suite. `compile_per_float` compiles a kernel for a few named versions a float
type (strided arrays, or contiguous ones where that makes a kernel faster; read-only where it
only reads them), then turns its compiling off: a call with any other mix converts to one of
these (numba's safe conversions: contiguous to strided, writable to read-only) instead of
compiling again. Each float type's versions are compiled when a call first needs them: a
float32 run does not wait for the float64 versions (half of Winograd's and the direct
convolution's 70-140 s of cold compiling on a 2 GHz VM).
"""
from __future__ import annotations

import threading
from typing import Callable

import numba
import numpy as np

FLOATS = (np.dtype(np.float32), np.dtype(np.float64))

_done: set = set()
_lock = threading.Lock()


def array(dtype, ndim: int, written: bool = False, layout: str = "A"):
    """numba's type for an ndim array of dtype: strided ("A") or contiguous ("C": a scratch
    buffer the kernel reshapes, a matrix it hands to BLAS, a version for contiguous arrays),
    read-only unless the kernel writes it."""
    return numba.types.Array(numba.from_dtype(np.dtype(dtype)), ndim, layout, readonly=not written)


def compile_per_float(dispatcher, signatures: Callable, dtype) -> None:
    """Compile `dispatcher` (a numba.njit function) for each of signatures(dtype), a list of
    tuples of numba types, and keep its further compiling off: numba calls the version a call
    converts to with the fewest conversions. Done once per dispatcher and float type (float32
    or float64); later calls return at once. (While a type compiles, another thread's call of
    the dispatcher may compile a version of its own: time lost, not a wrong result.)"""
    dtype = np.dtype(dtype)
    if dtype not in FLOATS:
        raise ValueError(f"compile_per_float: {dispatcher.__name__} is compiled per float type "
                         f"({', '.join(map(str, FLOATS))}), not for {dtype}")
    key = (dispatcher, dtype)
    if key in _done:
        return
    with _lock:
        if key in _done:
            return
        dispatcher.disable_compile(False)
        try:
            for types in signatures(dtype):
                dispatcher.compile(tuple(types))
        finally:
            dispatcher.disable_compile()
        _done.add(key)
