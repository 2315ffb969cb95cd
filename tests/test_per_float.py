"""ops/per_float.py: a kernel compiled once per float type takes any layout and read-only
arrays without compiling again, and gives the same results."""
from __future__ import annotations

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ops.per_float import array, compile_per_float


def _scale_into(x, factor, out):
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            out[i, j] = factor * x[i, j]


def _kernel(layouts: str):
    """A fresh (uncached) dispatcher of _scale_into, compiled per float in these layouts."""
    kernel = numba.njit(_scale_into)
    for dtype in (np.float32, np.float64):
        compile_per_float(kernel, _versions(layouts), dtype)
    return kernel


def _versions(layouts: str):
    return lambda t: [(array(t, 2, layout=lay), numba.from_dtype(t), array(t, 2, True, lay)) for lay in layouts]


@settings(max_examples=20, deadline=None)
@given(dtype=st.sampled_from([np.float32, np.float64]), step_in=st.integers(1, 3), step_out=st.integers(1, 3),
       read_only=st.booleans())
def test_any_layout_and_flag_converts_to_the_compiled_versions(dtype, step_in, step_out, read_only):
    kernel = KERNELS["A"]
    x = np.arange(60, dtype=dtype).reshape(6, 10)[:, ::step_in]
    x.flags.writeable = not read_only
    out = np.zeros((6, 30), dtype)[:, ::step_out][:, :x.shape[1]]
    kernel(x, dtype(2), out)
    np.testing.assert_array_equal(out, 2 * x)
    assert len(kernel.overloads) == 2   # float32 and float64, nothing compiled for this call


def test_two_layouts_each_per_float():
    kernel = KERNELS["CA"]
    x = np.ones((3, 4), np.float32)
    kernel(x, np.float32(3), np.zeros((3, 4), np.float32))
    kernel(x[:, ::2], np.float32(3), np.zeros((3, 2), np.float32))
    assert len(kernel.overloads) == 4


def test_each_float_type_is_compiled_when_first_asked_for():
    kernel = numba.njit(_scale_into)
    compile_per_float(kernel, _versions("A"), np.float32)
    kernel(np.ones((2, 3), np.float32), np.float32(2), np.zeros((2, 3), np.float32))
    assert len(kernel.overloads) == 1
    with pytest.raises(TypeError):   # float64 not compiled yet, and compiling is off
        kernel(np.ones((2, 3)), 2.0, np.zeros((2, 3)))
    compile_per_float(kernel, _versions("A"), np.float64)
    compile_per_float(kernel, _versions("A"), np.float32)   # done before: nothing more
    out = np.zeros((2, 3))
    kernel(np.ones((2, 3))[:, ::1], 2.0, out)
    np.testing.assert_array_equal(out, 2.0)
    assert len(kernel.overloads) == 2
    with pytest.raises(ValueError, match="int64"):
        compile_per_float(kernel, _versions("A"), np.int64)


def test_a_type_it_was_not_compiled_for_is_refused():
    with pytest.raises(TypeError):
        KERNELS["A"](np.ones((2, 2), np.int64), np.int64(2), np.zeros((2, 2), np.int64))


KERNELS = {layouts: _kernel(layouts) for layouts in ("A", "CA")}
