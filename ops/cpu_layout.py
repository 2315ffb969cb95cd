"""Tiles as numba kernels like them: rows contiguous, one specialization per dtype.

A tile of a bigger array is a strided view; handing it to a numba kernel as is makes one
compiled specialization per layout and slow, non-contiguous inner loops. `flat_rows` hands
it over as a flat view plus element strides instead, with no copy.
"""
from __future__ import annotations

import numba
import numpy as np


def flat_rows(a, writable: bool = False):
    """`a` for a numba kernel as (flat, s0, ..., s[d-2]): a 1-D contiguous view that starts at
    a's first element, and the element strides of all dims but the last, so that
    a[i, j, ..., :] is flat[i*s0 + j*s1 + ...:][:a.shape[-1]].

    A tile of a bigger array (its rows contiguous, its other dims not) then runs contiguous,
    vectorized inner loops, and a kernel has one specialization per dtype whatever the layout
    of its arguments. Inputs come read-only (as the runtime passes them), outputs writable.
    An array whose last dim is not contiguous is copied (an output cannot be)."""
    item = a.itemsize
    if a.flags.c_contiguous:
        # most tiles (whole tensors, batch tiles) are: a reshape is a view, and costs a tenth of
        # as_strided, which tiny kernels called thousands of times a step would notice
        flat = a.reshape(-1)
        if flat.flags.writeable and not writable:
            flat = flat.view()
            flat.flags.writeable = False
        return (flat, *(s // item for s in a.strides[:-1]))
    if min(a.strides, default=0) < 0 or (a.shape[-1] > 1 and a.strides[-1] != item):
        if writable:
            raise ValueError(f"flat_rows: output of shape {a.shape} has strides {a.strides}, its rows are "
                             f"not contiguous")
        a = np.ascontiguousarray(a)
    strides = tuple(s // item for s in a.strides[:-1])
    span = sum((n - 1) * s for n, s in zip(a.shape, strides)) + a.shape[-1] if a.size else 0
    return (np.lib.stride_tricks.as_strided(a, (span,), (item,), writeable=writable), *strides)


@numba.njit(nogil=True, inline="always")
def flat_row(rows, start, length):
    """The contiguous row of `length` elements at element offset `start` of flat_rows' view."""
    return rows[0][start:start + length]


#: row_starts' offsets by (leading dims, their strides): a step asks for the same few every time
_STARTS: dict[tuple, np.ndarray] = {}
_STARTS_KEPT = 4096


def row_starts(a, writable: bool = False):
    """`a`'s rows (its last dim) for a numba kernel as (flat, starts): flat_rows' 1-D view and
    the element offset of every row in C order, so that row r is flat[starts[r]:][:a.shape[-1]]
    whatever the strides of the leading dims (a tile of a bigger array is not copied). The
    offsets are made once per layout (read-only, shared)."""
    flat, *strides = flat_rows(a, writable)
    key = (a.shape[:-1], tuple(strides))
    starts = _STARTS.get(key)
    if starts is None:
        starts = np.zeros(1, np.int64)
        for n, s in zip(a.shape[:-1], strides):
            starts = (starts[:, None] + np.arange(n, dtype=np.int64) * s).reshape(-1)
        starts.flags.writeable = False
        if len(_STARTS) >= _STARTS_KEPT:
            _STARTS.clear()
        _STARTS[key] = starts
    return flat, starts
