"""numpy's own BLAS GEMM as a function that numba kernels call, passed in as an argument.

A kernel that alternates compiled loops with np.matmul gives up and takes back the GIL at every
call; two parts of a batch on two threads then wait for each other at each handoff (tens of
microseconds a wakeup on this VM, as long as a small convolution's whole step). With the GEMM
callable from numba, a part is one nogil call from start to end.

The GEMM is cblas_sgemm / cblas_dgemm of the OpenBLAS that numpy's wheels bundle, found by
its ILP64 symbol names (64-bit integers, the `64_` suffix, with or without numpy 2's `scipy_`
prefix). Where numpy links another BLAS (Accelerate, MKL, a distribution's LP64 OpenBLAS)
`gemm` returns None and the kernels keep np.matmul: a wrong guess at the integer width would
crash, so no other name is tried. Passed as an argument, the function is not baked into the
kernel, and the kernel stays cacheable (cache=True).
"""
from __future__ import annotations

import ctypes

import numpy as np

from ops import cpu_pool

#: CBLAS's enums: row-major storage, a matrix as it is or transposed
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112

#: the ILP64 symbol names tried, as (prefix, suffix) around cblas_?gemm
_NAMES = (("scipy_", "64_"), ("", "64_"))

_found: dict = {}


def _load(library, dtype: np.dtype):
    """cblas_?gemm of `library` (a threadpoolctl controller) for dtype, typed for ctypes, or None."""
    letter = {np.dtype(np.float32): "s", np.dtype(np.float64): "d"}[dtype]
    scalar = ctypes.c_float if letter == "s" else ctypes.c_double
    try:
        handle = ctypes.CDLL(library.filepath)
    except OSError:
        return None
    for prefix, suffix in _NAMES:
        function = getattr(handle, f"{prefix}cblas_{letter}gemm{suffix}", None)
        if function is not None:
            i64, ptr, enum = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
            function.restype = None
            function.argtypes = [enum, enum, enum, i64, i64, i64, scalar, ptr, i64, ptr, i64, scalar, ptr, i64]
            return function
    return None


def gemm(dtype):
    """C = alpha A B + beta C through numpy's BLAS for float32 or float64, as
    gemm(ROW_MAJOR, trans_a, trans_b, m, n, k, alpha, a_ptr, lda, b_ptr, ldb, beta, c_ptr, ldc)
    (pointers as ints: array.ctypes.data), or None where numpy's BLAS has no ILP64 CBLAS
    symbols or dtype is another type."""
    dtype = np.dtype(dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        return None
    if dtype not in _found:
        _found[dtype] = next((f for f in (_load(lib, dtype) for lib in cpu_pool.blas_libraries())
                              if f is not None), None)
    return _found[dtype]
