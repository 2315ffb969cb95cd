"""Parts' arrays laid end to end, made from the last such join when only a few parts changed.

A search proposal changes one op's config, so the iteration graph it assembles is made of the
same cached parts as the last one (segments, region results) but for a few. Concatenating
every part's arrays afresh (about a thousand small arrays at 64 devices) cost more than the
rest of the assembly. A `Joiner` keeps its last join: the parts in order and their arrays end
to end. The next join copies each part's columns from there when the part was in it, and
joins only the new parts' arrays, in one compiled pass.

    joiner = Joiner(rows=5, dtype=np.int64)
    joined, counts = joiner.join(parts, lambda part: part.columns)   # rows x total, columns per part
"""
from __future__ import annotations

from itertools import repeat
from typing import Callable, Sequence

import numba
import numpy as np


class Joiner:
    """Joins the (rows x k) arrays of a sequence of parts along their columns (see the module
    doc). A part is known by identity: the joiner holds the last join's parts, so no id is
    reused while it is looked up."""

    def __init__(self, rows: int, dtype):
        self.rows = rows
        self.dtype = np.dtype(dtype)
        self._parts: list = []
        self._index: dict[int, int] = {}
        self._joined = np.zeros((rows, 0), self.dtype)
        self._starts = np.zeros(1, np.int64)

    def __repr__(self) -> str:
        return f"Joiner({self.rows} rows of {self.dtype}, last join {len(self._parts)} parts, {self._joined.shape[1]} columns)"

    def join(self, parts: Sequence, arrays_of: Callable) -> tuple[np.ndarray, np.ndarray]:
        """(the parts' arrays end to end, rows x total; each part's column count). `arrays_of(part)`
        gives a part's rows x k array; it is asked only of parts the last join did not have."""
        ids = list(map(id, parts))
        old = np.fromiter(map(self._index.get, ids, repeat(-1)), np.int64, len(ids))
        fresh = [arrays_of(p) for p, i in zip(parts, old.tolist()) if i < 0]
        for a in fresh:
            if a.ndim != 2 or a.shape[0] != self.rows:
                raise ValueError(f"Joiner: a part's arrays must be {self.rows} x k, got shape {a.shape}")
        new_counts = np.array([a.shape[1] for a in fresh], np.int64)
        new = (np.concatenate(fresh, axis=1).astype(self.dtype, copy=False) if fresh
               else np.zeros((self.rows, 0), self.dtype))
        joined, counts = _splice(self._joined, self._starts, new, new_counts, old)
        self._parts = list(parts)
        self._index = dict(zip(ids, range(len(ids))))
        self._joined = joined
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        return joined, counts


@numba.njit(cache=True, nogil=True)
def _splice(old, old_starts, new, new_counts, which):
    """Columns of part i: old[:, old_starts[which[i]]:old_starts[which[i] + 1]] where which[i] >= 0,
    else the next new_counts entry's columns of `new`; end to end."""
    n = which.shape[0]
    counts = np.empty(n, np.int64)
    k = 0
    for i in range(n):
        w = which[i]
        if w >= 0:
            counts[i] = old_starts[w + 1] - old_starts[w]
        else:
            counts[i] = new_counts[k]
            k += 1
    out = np.empty((old.shape[0], counts.sum()), old.dtype)
    at = 0
    taken = 0
    for i in range(n):
        w = which[i]
        c = counts[i]
        if w >= 0:
            a = old_starts[w]
            out[:, at:at + c] = old[:, a:a + c]
        else:
            out[:, at:at + c] = new[:, taken:taken + c]
            taken += c
        at += c
    return out, counts
