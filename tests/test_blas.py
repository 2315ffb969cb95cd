"""ops/blas.py: numpy's BLAS GEMM called from a numba kernel, against numpy's matmul."""
from __future__ import annotations

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ops import blas, cpu_pool


@numba.njit(cache=True)
def _gemm_in_numba(gemm, trans_a, a, b, beta, c):
    """c = op(a) @ b + beta c through `gemm`, called from compiled code (ops/winograd.py's way)."""
    m, n = c.shape
    k = a.shape[0] if trans_a else a.shape[1]
    gemm(blas.ROW_MAJOR, blas.TRANS if trans_a else blas.NO_TRANS, blas.NO_TRANS, m, n, k, c.dtype.type(1),
         a.ctypes.data, a.shape[1], b.ctypes.data, n, beta, c.ctypes.data, n)


def _numpy_bundles_openblas() -> bool:
    """Whether numpy's BLAS is the OpenBLAS its wheels bundle (ILP64, `64_` symbols)."""
    return any("openblas64" in lib.filepath.replace("-", "") or "scipy_openblas" in lib.filepath
               for lib in cpu_pool.blas_libraries())


def test_found_where_numpy_bundles_openblas():
    found = {dtype: blas.gemm(dtype) is not None for dtype in (np.float32, np.float64)}
    assert found == {np.float32: _numpy_bundles_openblas(), np.float64: _numpy_bundles_openblas()}


def test_other_dtypes_have_none():
    assert blas.gemm(np.int64) is None and blas.gemm(np.float16) is None and blas.gemm(np.complex64) is None


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 9), n=st.integers(1, 9), k=st.integers(1, 9), trans_a=st.booleans(),
       beta=st.sampled_from([0.0, 1.0, 0.5]), dtype=st.sampled_from([np.float32, np.float64]),
       seed=st.integers(0, 2**16))
def test_gemm_matches_matmul(m, n, k, trans_a, beta, dtype, seed):
    gemm = blas.gemm(dtype)
    if gemm is None:
        assert not _numpy_bundles_openblas()
        return
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(dtype)
    b, c = rng.standard_normal((k, n)).astype(dtype), rng.standard_normal((m, n)).astype(dtype)
    expected = (a.T if trans_a else a).astype(np.float64) @ b + beta * c
    _gemm_in_numba(gemm, trans_a, a, b, dtype(beta), c)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(c, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_found_once(dtype):
    assert blas.gemm(dtype) is blas.gemm(np.dtype(dtype))
