"""ops/thin_gemm.py: the dot kernel and thin_matmul against numpy, and where each path is taken."""
from __future__ import annotations

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from threadpoolctl import threadpool_limits

import ops.thin_gemm as thin_gemm
from ops.linear import Dense
from ops.thin_gemm import thin_matmul, uses_dots
from tests.opcheck import check_tiled, run_whole, spec


@pytest.mark.parametrize("kernel", [thin_gemm._dots_4x4, thin_gemm._dots_4x2])
@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 13), k=st.integers(1, 40), batch=st.integers(1, 11), steps=st.integers(1, 3),
       add=st.booleans(), dtype=st.sampled_from([np.float32, np.float64]), data=st.data())
def test_dots_is_the_matrix_product_of_any_rows(kernel, m, k, batch, steps, add, dtype, data):
    """Both tilings of dots (4 x 4 and 4 x 2, and their remainders) on rows lo..hi of a against
    numpy in float64, writing or adding into one step of a 3-D out, touching nothing else."""
    lo = data.draw(st.integers(0, m))
    hi = data.draw(st.integers(lo, m))
    s, so = data.draw(st.integers(0, steps - 1)), data.draw(st.integers(0, steps - 1))
    rng = np.random.default_rng(m * 1000 + k)
    a = rng.standard_normal((m, k)).astype(dtype)
    x = rng.standard_normal((batch, steps, k)).astype(dtype)
    out = rng.standard_normal((batch, steps, m)).astype(dtype)
    expect = out.astype(np.float64)
    product = x[:, s].astype(np.float64) @ a[lo:hi].astype(np.float64).T
    expect[:, so, lo:hi] = product + (expect[:, so, lo:hi] if add else 0)
    kernel(a, x, s, out, so, lo, hi, add)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, expect, rtol=tol, atol=tol)


@pytest.mark.parametrize("features, wide", [("+avx512f,+avx2", True), ("+avx2,+fma", False), ("", False)])
def test_tiles_follow_the_target_numba_is_told(monkeypatch, features, wide):
    """With NUMBA_CPU_NAME set, numba compiles for NUMBA_CPU_FEATURES, whatever the host has."""
    monkeypatch.setattr(numba.config, "CPU_NAME", "generic")
    monkeypatch.setattr(numba.config, "CPU_FEATURES", features)
    assert thin_gemm._compiles_for_avx512() is wide


@pytest.fixture
def small_weights_take_dots(monkeypatch):
    """Any weight takes the dots kernel (its size threshold at 0)."""
    monkeypatch.setattr(thin_gemm, "THIN_MIN_WEIGHT", 0)


@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 70), n_out=st.integers(1, 37), n_in=st.integers(1, 29), threads=st.integers(1, 3),
       dtype=st.sampled_from([np.float32, np.float64]), strided_out=st.booleans(), seed=st.integers(0, 99))
def test_thin_matmul_is_x_times_w_transposed(rows, n_out, n_in, threads, dtype, strided_out, seed):
    """thin_matmul against numpy on one to three cores, into a new array or a strided out, the
    dots kernel where uses_dots and BLAS past THIN_MAX_ROWS."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, n_in)).astype(dtype)
    w = rng.standard_normal((n_out, n_in)).astype(dtype)
    expect = x.astype(np.float64) @ w.astype(np.float64).T
    with pytest.MonkeyPatch.context() as patch, threadpool_limits(threads, user_api="blas"):
        patch.setattr(thin_gemm, "THIN_MIN_WEIGHT", 0)
        assert uses_dots(x, w) == (rows <= thin_gemm.THIN_MAX_ROWS)
        if strided_out:
            buf = np.full((rows, 2 * n_out), np.nan, dtype)
            got = thin_matmul(x, w, buf[:, ::2])
            assert got.base is buf and np.isnan(buf[:, 1::2]).all()
        else:
            got = thin_matmul(x, w)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, expect, rtol=tol, atol=tol)


def test_uses_dots_only_where_the_kernel_applies():
    """Few rows against a large contiguous weight of one float type: dots; anything else: BLAS."""
    w = np.zeros((1024, 1024), np.float32)
    assert uses_dots(np.zeros((16, 1024), np.float32), w)
    assert not uses_dots(np.zeros((thin_gemm.THIN_MAX_ROWS + 1, 1024), np.float32), w)
    assert not uses_dots(np.zeros((16, 1024), np.float64), w)               # mixed types
    assert not uses_dots(np.zeros((16, 512), np.float32), np.zeros((512, 512), np.float32))  # small weight
    assert not uses_dots(np.zeros((16, 512), np.float32), w[:, ::2])        # a strided weight tile
    assert not uses_dots(np.zeros((16, 1024), np.int32), w.astype(np.int32))


@pytest.mark.parametrize("use_bias, activation", [(True, None), (False, "relu"), (True, "gelu")])
def test_dense_forward_through_dots_matches_blas_on_every_tiling(small_weights_take_dots, use_bias, activation):
    """Dense with its forward on the dots kernel (every weight large enough): the whole op against
    the BLAS path to rounding, and every tiling of it (weight tiles that are strided views go
    to BLAS) against the whole, float64."""
    op = Dense("fc", [spec((6, 3, 10), "float64")], out_features=9, use_bias=use_bias, activation=activation)
    rng = np.random.default_rng(0)
    w = {k: v.astype(np.float64) for k, v in op.init_weights(rng).items()}
    x = rng.standard_normal(op.inputs[0].shape)
    g = rng.standard_normal(op.outputs[0].shape)
    assert uses_dots(x.reshape(-1, 10), w["weight"])
    outs, gin, gw, _ = run_whole(op, [x], w, grad_outputs=[g])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(thin_gemm, "THIN_MAX_ROWS", -1)    # BLAS everywhere
        ref_outs, ref_gin, ref_gw, _ = run_whole(op, [x], w, grad_outputs=[g])
    for a, b in zip(outs + gin + list(gw.values()), ref_outs + ref_gin + list(ref_gw.values())):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    check_tiled(op, [x], w, [g])
