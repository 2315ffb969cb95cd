"""Parts' arrays kept side by side in one growing array, so that a graph's parts are found by
where they stand in it instead of being copied end to end for each graph.

A search proposal changes one op's config, so the iteration graph it assembles is made of the
same cached parts as the last one (segments, region results) but for a few. Joining every
part's arrays into one array a graph (the splice this replaced) copied all of them each time:
about a seventh of a proposal at 64 devices. An `Arena` places each part's columns once, when
it first meets the part; a graph's parts are then its (start, count) per part, and the
compiled passes that walk them (the layout, the cost gather) read the store in place.

When a part does not fit, the store is remade with only the parts of the placement that asked
(in place while it has room for KEEP times their columns, else anew with room for GROWTH
times): the parts of earlier graphs that no graph uses any more go, and the copying stays a
small share of what is placed.

    arena = Arena(rows=5, dtype=np.int64)
    start, count = arena.place(parts, lambda part: part.columns)   # part i: arena.store[:, start[i]:start[i] + count[i]]
"""
from __future__ import annotations

from itertools import chain, repeat
from operator import is_not
from typing import Callable, Sequence

import numba
import numpy as np

#: the store's least capacity, in columns
MIN_COLUMNS = 1 << 12
#: a store made anew has room for GROWTH times the columns of the parts it keeps; a store is
#: kept (the parts moved down in it) while it has room for KEEP times them and no more than
#: twice GROWTH times (a store grown for a large graph goes when the graphs are small again)
GROWTH, KEEP = 4, 2


class Arena:
    """Parts' (rows x k) arrays, each placed once in `store` (see the module doc). A part is known
    by identity: the arena holds the parts it placed, so no id is reused while it is looked up."""

    def __init__(self, rows: int, dtype, min_columns: int = MIN_COLUMNS):
        self.rows = rows
        self.dtype = np.dtype(dtype)
        self.min_columns = min_columns
        self.store = np.zeros((rows, min_columns), self.dtype)
        self.used = 0
        self.rebuilds = 0
        self._slot: dict[int, int] = {}      # id(part) -> its slot
        self._parts: list = []               # slot -> part
        self._start = np.zeros(64, np.int64)   # slot -> first column in store
        self._count = np.zeros(64, np.int64)   # slot -> columns
        self._last: tuple | None = None      # the last placement's parts (None: not kept) and their slots
        self._last_name = None               # and its name (place's delta)

    def __repr__(self) -> str:
        return (f"Arena({self.rows} rows of {self.dtype}, {len(self._parts)} parts in {self.used} of "
                f"{self.store.shape[1]} columns, made {self.rebuilds + 1} times)")

    def place(self, parts: Sequence, arrays_of: Callable,
              delta: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(each part's first column in `store`, its column count). `arrays_of(part)` gives a
        part's rows x k array; it is asked only of parts not in the store. May make the store
        again (so read `store` after this call). `delta`, where the caller knows what changed:
        (a name of the placement these parts differ from, a name of this one, the indices where
        they may differ; past that placement's length all are new). It is used when the last
        placement had that name; else the parts are compared."""
        if delta is not None and self._last is not None and self._last_name == delta[0] \
                and len(parts) >= len(self._last[1]):
            slots = self._changed_slots(parts, delta[2])
            kept = None
        else:
            parts = kept = tuple(parts)
            slots = self._known_slots(parts)
        self._last_name = None if delta is None else delta[1]
        missing = np.flatnonzero(slots < 0).tolist()
        fresh = {}   # id -> array, each part once however often it appears
        for i in missing:
            if id(parts[i]) not in fresh:
                fresh[id(parts[i])] = self._checked(arrays_of(parts[i]))
        if fresh:
            need = sum(a.shape[1] for a in fresh.values())
            if self.used + need > self.store.shape[1]:
                self._rebuild(parts, fresh)
                slots = np.fromiter(map(self._slot.__getitem__, map(id, parts)), np.int64, len(parts))
            else:
                for i in missing:
                    if self._slot.get(id(parts[i]), -1) < 0:
                        self._add(parts[i], fresh[id(parts[i])])
                    slots[i] = self._slot[id(parts[i])]
        self._last = (kept, slots)
        return self._start[slots], self._count[slots]

    def _known_slots(self, parts: tuple) -> np.ndarray:
        """Each part's slot, -1 where it is not in the store. A placement of as many parts as the
        last takes the last one's slots where the same part stands at the same place (a search's
        graphs differ in a few parts: comparing list entries reads no part and no dict, where
        looking each part up was a third of a placement in a search's large process)."""
        last = self._last
        if last is None or last[0] is None or len(last[0]) != len(parts):
            return np.fromiter(map(self._slot.get, map(id, parts), repeat(-1)), np.int64, len(parts))
        slots = last[1].copy()
        for i in np.flatnonzero(np.fromiter(map(is_not, last[0], parts), bool, len(parts))).tolist():
            slots[i] = self._slot.get(id(parts[i]), -1)
        return slots

    def _changed_slots(self, parts: Sequence, changed) -> np.ndarray:
        """Each part's slot (-1 where not in the store), of parts that differ from the last
        placement's only at the indices `changed` and past its length."""
        before = self._last[1]
        slots = np.empty(len(parts), np.int64)
        slots[:len(before)] = before
        for i in chain(changed, range(len(before), len(parts))):
            slots[i] = self._slot.get(id(parts[i]), -1)
        return slots

    def _checked(self, a: np.ndarray) -> np.ndarray:
        if a.ndim != 2 or a.shape[0] != self.rows:
            raise ValueError(f"Arena: a part's arrays must be {self.rows} x k, got shape {a.shape}")
        return a

    def _add(self, part, a: np.ndarray) -> None:
        """Place one part's array after the last (there is room)."""
        slot = len(self._parts)
        if slot == self._start.shape[0]:
            self._start = np.concatenate([self._start, np.zeros_like(self._start)])
            self._count = np.concatenate([self._count, np.zeros_like(self._count)])
        k = a.shape[1]
        self.store[:, self.used:self.used + k] = a
        self._start[slot], self._count[slot] = self.used, k
        self.used += k
        self._slot[id(part)] = slot
        self._parts.append(part)

    def _rebuild(self, parts: Sequence, fresh: dict) -> None:
        """Keep only `parts` (each once): the placed ones moved down to the front of the store in
        the order they stand in it (compiled, run by run), the fresh ones after them. The store
        is kept while it has room for KEEP times their columns (and not over twice GROWTH
        times), else made anew with room for GROWTH times: a new store's pages fault one by
        one when first written, which made a rebuild of 40k columns into a new store take 10 ms
        and more here, against 1 ms in place."""
        unique = list(dict(zip(map(id, parts), parts)).values())
        old = np.fromiter(map(self._slot.get, map(id, unique), repeat(-1)), np.int64, len(unique))
        placed = np.flatnonzero(old >= 0)
        placed = placed[np.argsort(self._start[old[placed]], kind="stable")]   # by where they stand
        order = [unique[k] for k in placed.tolist()] + [unique[k] for k in np.flatnonzero(old < 0).tolist()]
        ids = list(map(id, order))
        counts = np.concatenate([self._count[old[placed]],
                                 np.array([fresh[ids[k]].shape[1] for k in range(len(placed), len(ids))], np.int64)])
        starts = np.cumsum(counts) - counts
        total = int(counts.sum())
        if KEEP * total <= self.store.shape[1] <= max(self.min_columns, 2 * GROWTH * total):
            store = self.store
        else:
            store = np.empty((self.rows, max(self.min_columns, GROWTH * total)), self.dtype)
        _copy_runs(self.store, self._start[old[placed]], counts[:len(placed)], store, starts[:len(placed)])
        for k in range(len(placed), len(ids)):
            store[:, starts[k]:starts[k] + counts[k]] = fresh[ids[k]]
        size = max(64, self._start.shape[0])
        while size < len(order):
            size *= 2
        self._start, self._count = np.zeros(size, np.int64), np.zeros(size, np.int64)
        self._start[:len(order)], self._count[:len(order)] = starts, counts
        self.store, self.used = store, total
        self._slot, self._parts = dict(zip(ids, range(len(order)))), order
        self.rebuilds += 1


@numba.njit(cache=True, nogil=True)
def _copy_runs(src: np.ndarray, src_starts: np.ndarray, counts: np.ndarray, dst: np.ndarray,
               dst_starts: np.ndarray) -> None:
    """dst[:, dst_starts[p]:dst_starts[p] + counts[p]] = src[:, src_starts[p]:...] for each part p,
    in order: dst may be src where every run moves down and the runs come in ascending order."""
    for r in range(src.shape[0]):
        for p in range(counts.shape[0]):
            a, b = src_starts[p], dst_starts[p]
            for k in range(counts[p]):
                dst[r, b + k] = src[r, a + k]


@numba.njit(cache=True, nogil=True)
def columns_of(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The store column of each of the parts' columns, part after part: what joining them end to
    end would have laid out, as indices."""
    out = np.empty(counts.sum(), np.int64)
    at = 0
    for p in range(starts.shape[0]):
        for k in range(counts[p]):
            out[at] = starts[p] + k
            at += 1
    return out
