"""flat_rows and row_starts: a kernel's rows of any tile are the tile's rows, read-only unless asked."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ops.cpu_layout import flat_rows, row_starts


@st.composite
def tiles(draw):
    """A C-contiguous array and a tile of it: a box cut along its leading dims (rows whole)."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    whole = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    cut = []
    for n in shape[:-1]:
        lo = draw(st.integers(0, n - 1))
        cut.append(slice(lo, draw(st.integers(lo + 1, n))))
    return whole, whole[tuple(cut)]


@settings(max_examples=80, deadline=None)
@given(tiles(), st.booleans())
def test_every_row_of_a_tile_is_found_at_its_start(case, writable):
    _, tile = case
    flat, starts = row_starts(tile, writable=writable)
    rows = tile.reshape(-1, tile.shape[-1])
    assert len(starts) == len(rows)
    for r, start in enumerate(starts):
        np.testing.assert_array_equal(flat[start:start + tile.shape[-1]], rows[r])
    assert flat.flags.writeable == writable


@settings(max_examples=40, deadline=None)
@given(tiles())
def test_a_writable_tile_writes_through_to_the_array(case):
    whole, tile = case
    flat, *_ = flat_rows(tile, writable=True)
    flat[0] = -1.0
    assert tile.reshape(-1)[0] == -1.0 and (whole == -1.0).sum() == 1


def test_rows_that_are_not_contiguous_are_copied_for_inputs_and_refused_for_outputs():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    flat, *strides = flat_rows(a)
    np.testing.assert_array_equal(flat.reshape(3, 2), a)
    with pytest.raises(ValueError, match="not contiguous"):
        flat_rows(a, writable=True)
