"""The float32 math that LLVM vectorizes (ops/vector_math.py) against math's and numpy's float64."""
from __future__ import annotations

import math

import numba
import numpy as np
import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from ops.vector_math import erf_value, exp_shifted_row, row_max


@numba.njit
def _erf_all(x, fast):
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = erf_value(x[i], fast)
    return out


@numba.njit
def _exp_all(x, m, fast):
    y = np.empty_like(x)
    total = exp_shifted_row(x, m, y, np.empty(x.size, np.int32), fast)
    return y, total


GRID = np.concatenate([np.linspace(-7, 7, 400_001), [-1e-30, 0.0, 1e-30, 1e-6, 40.0, -40.0]])


def test_erf_is_within_5e_7_of_erf_everywhere():
    """The rational erf on a dense grid past its clamp at 4 (float32 inputs, compared in float64;
    4.2e-7 at most compiled as here, 3.4e-7 with the kernels' fused multiply-adds)."""
    x = GRID.astype(np.float32)
    got = _erf_all(x, True)
    assert got.dtype == np.float32
    assert np.abs(got - [math.erf(v) for v in x.astype(np.float64)]).max() < 5e-7


def test_erf_in_float64_is_math_erf():
    np.testing.assert_array_equal(_erf_all(GRID, False), [math.erf(v) for v in GRID])


@pytest.mark.parametrize("m", [0.0, 3.5])
def test_exp_is_within_2_ulp_and_its_sum_is_the_sum(m):
    """exp(x - m) for x <= m: within 2 ulp down to -87, within float32's smallest normal below
    (subnormal), 0 below -88 (it gave 1.6e-38 from -87 on, which a softmax's cross-entropy
    took as a probability, where float64's was 0), and the float64 sum it returns. (Compared
    with the exp of the float32 difference, whose own rounding is not the exp's.)"""
    x = (m - np.abs(np.linspace(-1e4, 0, 200_001) ** 3 / 1e8)).astype(np.float32)
    y, total = _exp_all(x, np.float32(m), True)
    diff = (x - np.float32(m)).astype(np.float64)
    assert y.dtype == np.float32
    normal = diff >= -87.0
    np.testing.assert_allclose(y[normal], np.exp(diff[normal]), rtol=2.5e-7, atol=0)
    np.testing.assert_allclose(y[~normal], np.exp(diff[~normal]), rtol=0, atol=np.finfo(np.float32).tiny)
    assert not y[diff < -88].any() and y[diff < -88].size
    assert total == pytest.approx(float(y.astype(np.float64).sum()), rel=1e-12)
    y64, _ = _exp_all(x.astype(np.float64), m, False)
    np.testing.assert_allclose(y64, np.exp(x.astype(np.float64) - m), rtol=1e-15)


@numba.njit
def _row_max_of(x):
    return row_max(x)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.floats(-1e6, 1e6, width=32), st.just(math.nan)), min_size=1, max_size=40),
       st.sampled_from([np.float32, np.float64]))
def test_row_max_is_the_running_max(values, dtype):
    """row_max's eight running maxima give what one running `v if v > m else m` gives: the max,
    NaNs after the first value skipped, NaN when the first value is NaN (any size, tail included)."""
    x = np.array(values, dtype)
    m = x[0]
    for v in x[1:]:
        m = v if v > m else m
    got = _row_max_of(x)
    assert (math.isnan(got) and math.isnan(m)) or got == m



def test_row_max_finds_the_max_at_every_position():
    """Each of the eight running maxima and the tail: the max at each position of rows of 1-19."""
    for n in range(1, 20):
        for p in range(n):
            x = -np.arange(n, dtype=np.float32)
            x[p] = 5.0
            assert _row_max_of(x) == 5.0, (n, p)
