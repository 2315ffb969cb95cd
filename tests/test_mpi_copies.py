"""taskrt/mpi_copies.py's helpers that need no second rank (the copies themselves: tests/test_mpi.py)."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from taskrt import Rect
from taskrt.mpi_copies import contiguous


@st.composite
def rect_in_shape(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    lo = [draw(st.integers(0, e - 1)) for e in shape]
    hi = [draw(st.integers(a + 1, e)) for a, e in zip(lo, shape)]
    return Rect(tuple(lo), tuple(hi)), shape


@settings(max_examples=300)
@given(rect_in_shape())
def test_a_rect_is_contiguous_where_numpy_says_its_slice_is(case):
    """One run of memory (sent as it lies) exactly where numpy's view of it is C-contiguous: one
    dim too few looked at took (0:1, 0:2, 0:2) of a (1, 4, 4) array for one run."""
    rect, shape = case
    assert contiguous(rect, shape) == np.zeros(shape)[rect.slices()].flags.c_contiguous
