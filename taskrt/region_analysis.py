"""The analysis of one region's accesses in one go, compiled: what Analyzer.add_task makes of them.

The simulator's segment builder (strategies/segments.py) analyzes one region at a time: the
requirements that a list of tasks has on it, in program order, become copies, folds and
edges. `analyze_region` does that with the algorithm of taskrt/analysis.py, step for step
(users and whether their rects are disjoint, pieces with the memories holding them in
insertion order, pending reductions folded per sub-rect in program order, a whole piece's
copy moving it last), on arrays in one numba loop. The Python Analyzer stays what the
runtime runs, and the reference tests/test_region_analysis.py compares this with. Pieces
and users are found through an index (a hash by rect, a grid of cells over the two dims
that best tell the accesses' rects apart; see "an index of a table's slots"), so that an
access costs about the slots it meets rather than all of them.

Inputs: the region's rank (dims); per task (access, in program order) its memory number and
its first row in the requirement arrays (access_first has one more entry, the end); per
requirement row its rect ([lo..., hi...]) and privilege code (`privilege_code`).
Output (`RegionAnalysis`): nodes numbered as the Analyzer numbers them (copies, folds and
tasks, in the order made); per copy its node, rect, source and destination memory, reduction
operator (-1: a copy), fold buffer (the reducing task's node and the requirement's index
among its task's rows here; -1: none) and the access that made it; per access its task's
node; every edge (node, pred), a pred once per node.

State, each a table of slots in insertion order (a key given a new value keeps its slot,
one moved last gets a new slot, a deleted one is marked dead):
- users: rect, alive, and the heads and tails of its readers and of its other users
  ((privilege, node) pairs), linked lists in shared arrays; and `disjoint`;
- pieces: rect, alive, and its valid memories as a block of (memory, producer) rows in the
  value arrays (producer -1: valid before any node), never changed once written;
- pending: a doubly linked list in program order of (rect, operator, buffer, memory, node);
  a partly folded entry's rest takes its place in the list. An index like the other tables'
  finds the entries a rect overlaps, and order labels put them in the list's order.

Speed (the measurements behind each choice: docs/search.md, sessions 31-33). Numba counts a
reference to an array, atomically, wherever one is bound to a name: a helper's arguments, a
view, a table handed back. So:
- the helpers an access calls (_physical, _record_user, _set_valid, _new_piece, _over, _find,
  _edges) are inlined into the loop, and rows of a table are read in place (_overlaps_at,
  _equal_at), not as views;
- every table has a fixed room for the whole run, so none is handed back: a table that runs
  out stops the run, and the driver (_analyze) runs it again with that room doubled; the
  rooms are learnt across calls (ROOM_FACTORS);
- the driver makes the tables (_tables) and holds them, and the run works on borrowed views of
  them and of its inputs (_borrowed: no meminfo, so the count updates do nothing); no view
  leaves the run, what it returns is copied out;
- the tables are laid out in a scratch array kept per thread (at most SCRATCH_MAX entries),
  not made afresh per region, and only what is read before it is written is set.
Overlap queries deduplicate their few hits in place.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numba
import numpy as np
from numba.core import cgutils, types
from numba.extending import intrinsic

from .privilege import REDUCTION_OPS, Privilege

#: privilege codes: R, WD, RW, then Reduce of each operator in REDUCTION_OPS' order
READ_CODE, WRITE_CODE, READ_WRITE_CODE, REDUCE_BASE = 0, 1, 2, 3
_REDOPS = tuple(REDUCTION_OPS)


def privilege_code(p: Privilege) -> int:
    if p.mode == "R":
        return READ_CODE
    if p.mode == "WD":
        return WRITE_CODE
    if p.mode == "RW":
        return READ_WRITE_CODE
    return REDUCE_BASE + _REDOPS.index(p.redop)


def redop_name(code: int) -> str | None:
    """The reduction operator of a copy's code (-1: a plain copy)."""
    return None if code < 0 else _REDOPS[code]


@dataclass(frozen=True)
class RegionAnalysis:
    """What analyze_region made (see the module doc). `copies` has a row per copy: (node, src,
    dst, redop, buffer node, buffer requirement, access); `copy_rects` its [lo..., hi...]."""

    copies: np.ndarray
    copy_rects: np.ndarray
    task_node: np.ndarray
    edges: np.ndarray   # rows (node, pred)


#: the columns of RegionAnalysis.copies
NODE, SRC, DST, REDOP, BUFFER_NODE, BUFFER_REQ, ACCESS = range(7)


def analyze_region(ndim: int, access_mem, access_first, req_rects, req_priv, keep_from: int = 0) -> RegionAnalysis:
    """The accesses' analysis (see the module doc): access a's requirements are rows
    access_first[a] .. access_first[a + 1] - 1 of req_rects ([lo..., hi...]) and req_priv.
    Edges are listed only between the nodes that accesses from `keep_from` on make (the
    simulator keeps a program's second step: the first's edges would be dropped, and looking
    for them was most of its analysis); the nodes, copies and edges among those are as for
    keep_from 0."""
    rects = np.ascontiguousarray(req_rects, np.int64).reshape(-1, 2 * ndim)
    copies, copy_rects, tasks, edges, _scratch.array = _analyze(
        ndim, np.ascontiguousarray(access_mem, np.int64), np.ascontiguousarray(access_first, np.int64), rects,
        np.ascontiguousarray(req_priv, np.int64), ROOM_FACTORS, getattr(_scratch, "array", _NO_SCRATCH), SCRATCH_MAX,
        keep_from)
    return RegionAnalysis(copies, copy_rects, tasks, edges)


#: each thread's scratch array, where a run lays out its tables (_tables), kept from call to call
_scratch = threading.local()
_NO_SCRATCH = np.empty(0, np.int64)


# ---- rects, as [lo..., hi...] rows -------------------------------------------------------------------
@numba.njit(cache=True, nogil=True, inline="always")
def _empty(r, nd):
    for d in range(nd):
        if r[nd + d] <= r[d]:
            return True
    return False


@numba.njit(cache=True, nogil=True, inline="always")
def _contains(a, b, nd):
    """a holds every point of b (an empty b is held)."""
    if _empty(b, nd):
        return True
    for d in range(nd):
        if b[d] < a[d] or a[nd + d] < b[nd + d]:
            return False
    return True


# ---- a table's row s against a rect r, read in place: a row view (rects[s]) costs two atomic
# reference-count updates, and in the overlap queries' loops those were most of an analysis
@numba.njit(cache=True, nogil=True, inline="always")
def _overlaps_at(rects, s, r, nd):
    """Row s and r share a point (neither is empty)."""
    for d in range(nd):
        lo, hi = rects[s, d], rects[s, nd + d]
        if not (lo < hi and r[d] < r[nd + d] and lo < r[nd + d] and r[d] < hi):
            return False
    return True


@numba.njit(cache=True, nogil=True, inline="always")
def _equal_at(rects, s, r, nd):
    """Row s is the rect r."""
    for d in range(2 * nd):
        if rects[s, d] != r[d]:
            return False
    return True


@numba.njit(cache=True, nogil=True)
def _intersect(a, b, nd):
    out = np.empty(2 * nd, np.int64)
    for d in range(nd):
        out[d] = max(a[d], b[d])
        out[nd + d] = min(a[nd + d], b[nd + d])
    return out


@numba.njit(cache=True, nogil=True)
def _subtract(a, b, nd):
    """Rect.subtract: the disjoint boxes covering a minus b, in its order, as rows."""
    inter = _intersect(a, b, nd)
    out = np.empty((2 * nd + 1, 2 * nd), np.int64)
    if _empty(inter, nd):
        if _empty(a, nd):
            return out[:0]
        out[0] = a
        return out[:1]
    cur = a.copy()
    k = 0
    for d in range(nd):
        if cur[d] < inter[d]:
            out[k] = cur
            out[k, nd + d] = inter[d]
            k += 1
            cur[d] = inter[d]
        if inter[nd + d] < cur[nd + d]:
            out[k] = cur
            out[k, d] = inter[nd + d]
            k += 1
            cur[nd + d] = inter[nd + d]
    return out[:k]


@numba.njit(cache=True, nogil=True, inline="always")
def _conflicts(a, b):
    """Privilege.conflicts by code."""
    if a == READ_CODE:
        return b != READ_CODE
    if a >= REDUCE_BASE:
        return b < REDUCE_BASE or a != b
    return True


# ---- the state (see the module doc) -------------------------------------------------------------------
_U_ALIVE, _U_RHEAD, _U_RTAIL, _U_OHEAD, _U_OTAIL = range(5)
_P_ALIVE, _P_VSTART, _P_VLEN = range(3)
_E_REDOP, _E_BUFNODE, _E_BUFREQ, _E_MEM, _E_NODE, _E_PREV, _E_NEXT = range(7)


# ---- an index of a table's slots ---------------------------------------------------------------------
# Pieces and users are looked up by exact rect and by overlap with a rect, once or more an
# access. Scanning every slot made an access cost O(slots): at 1,024 devices, where a region
# has thousands of tiles, a region's analysis took a quarter of a second. A table's index is
# one int64 array:
# - a hash of rect -> the last slot given that rect (open addressing, a power of two of
#   buckets, -1 empty). Live rects are distinct within a table (pieces are disjoint, a user's
#   rect has one slot), so that slot is the live one with that rect if any is;
# - a grid of cells over the two dims that best tell the accesses' rects apart (see
#   _split_bounds; at most MAX_CELLS cells): each cell a list of the live slots whose
#   rect reaches into it; a rect that spans more than SPAN_BIG cells is on a list of its own
#   that every query reads. A query spanning more than SPAN_SCAN cells scans the slots
#   instead. (Buckets along one dim alone left a query of a region tiled along two dims
#   checking the hundreds of tiles of the other dim in each bucket.)
# Dead slots stay listed until the table is compacted (_compact rebuilds the index).
_H_COUNT, _H_SIZE, _DIM, _BUCKETS, _DIM2, _BUCKETS2, _NODES, _NODE_CAP, _BIG, _BIG_CAP = range(10)
_HEADER = 10
MAX_CELLS = 4096
SPAN_BIG = 16
SPAN_SCAN = 64


@numba.njit(cache=True, nogil=True)
def _thin(bounds, most):
    """The sorted boundaries `bounds`, every k-th (the last kept) where they make more than
    `most` buckets; [0, 0] (one bucket) where they make none."""
    if bounds.shape[0] > most + 1:
        step = (bounds.shape[0] + most - 1) // most
        kept = bounds[::step]
        if kept[-1] != bounds[-1]:
            out = np.empty(kept.shape[0] + 1, np.int64)
            out[:-1] = kept
            out[-1] = bounds[-1]
            kept = out
        bounds = kept
    if bounds.shape[0] < 2:   # no rect, or empty ones only: one bucket
        bounds = np.zeros(2, np.int64)
    return bounds


@numba.njit(cache=True, nogil=True)
def _boundaries(req_rect, nd, d):
    """The distinct lo and hi coordinates along dim d of the non-empty rects, sorted."""
    values = np.empty(2 * req_rect.shape[0], np.int64)
    k = 0
    for row in range(req_rect.shape[0]):
        if not _empty(req_rect[row], nd):
            values[k] = req_rect[row, d]
            values[k + 1] = req_rect[row, nd + d]
            k += 2
    return _unique(values[:k])


@numba.njit(cache=True, nogil=True)
def _split_bounds(req_rect, nd):
    """(dim, its boundaries, second dim, its boundaries) of the grid: the pair of dims whose
    cells a query would share with the fewest rects. Along a dim with B buckets, where the
    rects cover a mean share m of the span of all of them, a rect and a query meet with odds
    of about 2m + 1/B; the pair with the least product wins. The boundaries are the rects'
    distinct ones, sorted and thinned to at most MAX_CELLS cells in all (the second dim gets
    what the first leaves; a region of one dim has one bucket along the second)."""
    lo = np.full(nd, np.iinfo(np.int64).max, np.int64)
    hi = np.full(nd, np.iinfo(np.int64).min, np.int64)
    count = 0
    for row in range(req_rect.shape[0]):
        if not _empty(req_rect[row], nd):
            count += 1
            for d in range(nd):
                lo[d] = min(lo[d], req_rect[row, d])
                hi[d] = max(hi[d], req_rect[row, nd + d])
    share = np.zeros(nd)
    for row in range(req_rect.shape[0]):
        if not _empty(req_rect[row], nd):
            for d in range(nd):
                share[d] += (req_rect[row, nd + d] - req_rect[row, d]) / max(1, hi[d] - lo[d])
    bounds = [_boundaries(req_rect, nd, d) for d in range(nd)]
    if nd == 1:
        return 0, _thin(bounds[0], MAX_CELLS), 0, np.zeros(2, np.int64)
    best, first, second = np.inf, 0, 1
    for d1 in range(nd):
        n1 = min(max(1, bounds[d1].shape[0] - 1), MAX_CELLS)
        for d2 in range(nd):
            if d2 != d1:
                n2 = min(max(1, bounds[d2].shape[0] - 1), max(1, MAX_CELLS // n1))
                odds = (2 * share[d1] / max(1, count) + 1 / n1) * (2 * share[d2] / max(1, count) + 1 / n2)
                if odds < best:
                    best, first, second = odds, d1, d2
    b1 = _thin(bounds[first], MAX_CELLS)
    return first, b1, second, _thin(bounds[second], max(1, MAX_CELLS // (b1.shape[0] - 1)))


@numba.njit(cache=True, nogil=True)
def _index_size(bounds, bounds2, slots, cells):
    """(hash size, int64 entries) of an index for `slots` slots listed in at most `cells` cells."""
    hash_size = 64
    while hash_size < 2 * (slots + 1):
        hash_size *= 2
    buckets, buckets2 = bounds.shape[0] - 1, bounds2.shape[0] - 1
    return hash_size, (_HEADER + hash_size + bounds.shape[0] + bounds2.shape[0] + buckets * buckets2 + 2 * cells
                       + slots)


@numba.njit(cache=True, nogil=True)
def _init_index(ix, dim, bounds, dim2, bounds2, hash_size, node_cap, big_cap):
    """Make `ix` (_index_size's entries) an empty index: its header, boundaries, and no slot in
    the hash or the cells (the cells' nodes and the list of big rects are written before read)."""
    buckets, buckets2 = bounds.shape[0] - 1, bounds2.shape[0] - 1
    ix[_H_SIZE] = hash_size
    ix[_DIM] = dim
    ix[_BUCKETS] = buckets
    ix[_DIM2] = dim2
    ix[_BUCKETS2] = buckets2
    ix[_NODE_CAP] = node_cap
    ix[_BIG_CAP] = big_cap
    start = _HEADER + hash_size
    ix[start:start + bounds.shape[0]] = bounds
    ix[start + bounds.shape[0]:start + bounds.shape[0] + bounds2.shape[0]] = bounds2
    _clear(ix)


@numba.njit(cache=True, nogil=True)
def _clear(ix):
    """No slot in the index: counts at zero, the hash and the cells' heads empty (its layout,
    boundaries and capacities stay)."""
    ix[_H_COUNT] = 0
    ix[_NODES] = 0
    ix[_BIG] = 0
    ix[_HEADER:_HEADER + ix[_H_SIZE]] = -1
    heads = _heads_at(ix)
    ix[heads:heads + ix[_BUCKETS] * ix[_BUCKETS2]] = -1


@numba.njit(cache=True, nogil=True, inline="always")
def _bounds_at(ix):
    return _HEADER + ix[_H_SIZE]


@numba.njit(cache=True, nogil=True, inline="always")
def _bounds2_at(ix):
    return _bounds_at(ix) + ix[_BUCKETS] + 1


@numba.njit(cache=True, nogil=True, inline="always")
def _heads_at(ix):
    return _bounds2_at(ix) + ix[_BUCKETS2] + 1


@numba.njit(cache=True, nogil=True, inline="always")
def _nodes_at(ix):
    return _heads_at(ix) + ix[_BUCKETS] * ix[_BUCKETS2]


@numba.njit(cache=True, nogil=True, inline="always")
def _big_at(ix):
    return _nodes_at(ix) + 2 * ix[_NODE_CAP]


@numba.njit(cache=True, nogil=True, inline="always")
def _hash(r, nd):
    h = np.uint64(14695981039346656037)
    for d in range(2 * nd):
        h = (h ^ np.uint64(r[d])) * np.uint64(1099511628211)
    # the low bits pick the bucket: mix the high ones in (splitmix64's finish)
    h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


@numba.njit(cache=True, nogil=True)
def _bucket(ix, lo, n, x):
    """The bucket holding coordinate x among the n buckets whose boundaries start at ix[lo]
    (clamped to the ends)."""
    a, b = 0, n - 1
    while a < b:   # the last bucket whose lower bound is <= x
        m = (a + b + 1) // 2
        if ix[lo + m] <= x:
            a = m
        else:
            b = m - 1
    return a


@numba.njit(cache=True, nogil=True)
def _span(ix, r, nd):
    """(first, last bucket along the first dim, first, last along the second) that r reaches."""
    d, d2 = ix[_DIM], ix[_DIM2]
    lo, lo2, n, n2 = _bounds_at(ix), _bounds2_at(ix), ix[_BUCKETS], ix[_BUCKETS2]
    return (_bucket(ix, lo, n, r[d]), _bucket(ix, lo, n, r[nd + d] - 1),
            _bucket(ix, lo2, n2, r[d2]), _bucket(ix, lo2, n2, r[nd + d2] - 1))


@numba.njit(cache=True, nogil=True, inline="always")
def _find(tab, rects, info, r, nd):
    """The live slot whose rect equals r, or -1."""
    mask = tab[_H_SIZE] - 1
    i = np.int64(_hash(r, nd) & np.uint64(mask))
    while True:
        s = tab[_HEADER + i]
        if s < 0:
            return -1
        if _equal_at(rects, s, r, nd):
            return s if info[s, 0] else -1
        i = (i + 1) & mask


@numba.njit(cache=True, nogil=True)
def _add(ix, rects, s, nd):
    """Enter slot s in the index, which has room for it."""
    r = rects[s]
    mask = ix[_H_SIZE] - 1
    i = np.int64(_hash(r, nd) & np.uint64(mask))
    while True:
        t = ix[_HEADER + i]
        if t < 0:
            ix[_HEADER + i] = s
            ix[_H_COUNT] += 1
            break
        if _equal_at(rects, t, r, nd):
            ix[_HEADER + i] = s
            break
        i = (i + 1) & mask
    if _empty(r, nd):
        return
    b0, b1, c0, c1 = _span(ix, r, nd)
    if (b1 - b0 + 1) * (c1 - c0 + 1) > SPAN_BIG:
        ix[_big_at(ix) + ix[_BIG]] = s
        ix[_BIG] += 1
        return
    heads, nodes, n2 = _heads_at(ix), _nodes_at(ix), ix[_BUCKETS2]
    for b in range(b0, b1 + 1):
        for c in range(c0, c1 + 1):
            k = ix[_NODES]
            ix[nodes + 2 * k] = s
            ix[nodes + 2 * k + 1] = ix[heads + b * n2 + c]
            ix[heads + b * n2 + c] = k
            ix[_NODES] = k + 1


@numba.njit(cache=True, nogil=True)
def _has_room(ix, r, nd):
    """The index has room for one more slot of rect r (counting a rect listed in cells as
    many nodes as cells, or one on the list of its own)."""
    need = 1
    if not _empty(r, nd):
        b0, b1, c0, c1 = _span(ix, r, nd)
        need = (b1 - b0 + 1) * (c1 - c0 + 1)
    return (2 * (ix[_H_COUNT] + 1) <= ix[_H_SIZE] and ix[_NODES] + need <= ix[_NODE_CAP]
            and ix[_BIG] + 1 <= ix[_BIG_CAP])


@numba.njit(cache=True, nogil=True)
def _reindex(ix, rects, info, n, nd):
    """Index the live slots below n afresh, in place (dead ones dropped); False when they do not
    fit its room."""
    _clear(ix)
    for s in range(n):
        if info[s, 0]:
            if not _has_room(ix, rects[s], nd):
                return False
            _add(ix, rects, s, nd)
    return True


@numba.njit(cache=True, nogil=True)
def _put(ix, rects, info, s, nd):
    """Enter slot s; False when the index has no room for it, or when dropping the dead slots
    would not free half of its cells (a run that indexed again at every slot would take time
    quadratic in the slots: better to run again with more cells)."""
    if not _has_room(ix, rects[s], nd):
        if not _reindex(ix, rects, info, s, nd) or 2 * ix[_NODES] > ix[_NODE_CAP] or not _has_room(ix, rects[s], nd):
            return False
    _add(ix, rects, s, nd)
    return True


@numba.njit(cache=True, nogil=True)
def _compact(tab, rects, info, n, nd):
    """The slot count with the dead slots dropped, the live ones kept in their order and
    indexed again (-1: the index has no room for them): when more than half are dead (pieces
    copied to another memory move last, leaving one behind each time), so that lookups stay
    linear in what is live."""
    alive = 0
    for s in range(n):
        if info[s, 0]:
            alive += 1
    if 2 * alive >= n:
        return n
    k = 0
    for s in range(n):
        if info[s, 0]:
            rects[k] = rects[s]
            info[k] = info[s]
            k += 1
    return k if _reindex(tab, rects, info, k, nd) else -1


@numba.njit(cache=True, nogil=True)
def _overlapping(tab, rects, info, n, r, nd):
    """The live slots whose rect shares a point with r, in insertion order."""
    if _empty(r, nd):
        return np.empty(0, np.int64)
    b0, b1, c0, c1 = _span(tab, r, nd)
    if (b1 - b0 + 1) * (c1 - c0 + 1) > SPAN_SCAN:
        out = np.empty(n, np.int64)
        k = 0
        for s in range(n):
            if info[s, 0] and _overlaps_at(rects, s, r, nd):
                out[k] = s
                k += 1
        return out[:k]
    heads, nodes, big, n2 = _heads_at(tab), _nodes_at(tab), _big_at(tab), tab[_BUCKETS2]
    count = tab[_BIG]
    for b in range(b0, b1 + 1):
        for c in range(c0, c1 + 1):
            x = tab[heads + b * n2 + c]
            while x >= 0:
                count += 1
                x = tab[nodes + 2 * x + 1]
    found = np.empty(count, np.int64)
    k = 0
    for q in range(tab[_BIG]):
        s = tab[big + q]
        if info[s, 0] and _overlaps_at(rects, s, r, nd):
            found[k] = s
            k += 1
    for b in range(b0, b1 + 1):
        for c in range(c0, c1 + 1):
            x = tab[heads + b * n2 + c]
            while x >= 0:
                s = tab[nodes + 2 * x]
                if info[s, 0] and _overlaps_at(rects, s, r, nd):
                    found[k] = s
                    k += 1
                x = tab[nodes + 2 * x + 1]
    return _unique(found[:k])


@numba.njit(cache=True, nogil=True, inline="always")
def _over(tab, rects, info, n, r, nd, exact_first):
    """The slot keyed r alone when `exact_first` and there is one, else every overlap: the
    Analyzer's _overlapping_pieces (always) and _overlapping_users (when users are disjoint)."""
    if exact_first:
        s = _find(tab, rects, info, r, nd)
        if s >= 0:
            out = np.empty(1, np.int64)
            out[0] = s
            return out
    return _overlapping(tab, rects, info, n, r, nd)


@numba.njit(cache=True, nogil=True)
def _pairwise_disjoint(u_tab, u_rect, u_info, n_u, nd):
    """No two live users' rects overlap (each user's overlaps found through the index: a live
    non-empty rect overlaps itself, so more than one is another)."""
    for i in range(n_u):
        if u_info[i, _U_ALIVE] and not _empty(u_rect[i], nd):
            if _overlapping(u_tab, u_rect, u_info, n_u, u_rect[i], nd).shape[0] > 1:
                return False
    return True


@numba.njit(cache=True, nogil=True)
def _unique(a):
    """The distinct values of a 1-D scratch array, sorted in `a` itself; a view of it. An overlap
    query meets a few slots: an insertion sort, where np.sort, a mask and a gather made three
    allocations a query."""
    if a.shape[0] > 32:
        a.sort()
    else:
        for i in range(1, a.shape[0]):
            x = a[i]
            j = i - 1
            while j >= 0 and a[j] > x:
                a[j + 1] = a[j]
                j -= 1
            a[j + 1] = x
    m = min(1, a.shape[0])
    for i in range(1, a.shape[0]):
        if a[i] != a[m - 1]:
            a[m] = a[i]
            m += 1
    return a[:m]


# ---- the analysis ------------------------------------------------------------------------------------
#: accesses between looks at how many slots are dead (_compact)
COMPACT_EVERY = 32
#: the gap between the order labels of pending reductions appended to the list: the list is
#: in program order, and a partly folded entry's rests take its place, so an overlap query
#: over the index sorts its hits by label (order maintenance; _relabel when a gap runs out)
LABEL_GAP = 1 << 20
#: the tables of a run, each with a fixed room (see the module doc): the room of each is
#: ROOM_FACTORS[table] rows per requirement row of the region, and MIN_ROOM; for the indexes'
#: cells, cells per slot. A table that runs out has its factor doubled, kept for later calls.
_R_USERS, _R_LINKS, _R_PIECES, _R_VALS, _R_PENDING, _R_COPIES, _R_EDGES, _R_PREDS, _R_CELLS = range(9)
ROOM_FACTORS = np.array([2.0, 4.0, 4.0, 32.0, 2.0, 4.0, 16.0, 4.0, 4.0])
#: the least room of a table
MIN_ROOM = 16
#: the most int64 entries a thread's scratch array keeps from run to run (64 MiB; _tables)
SCRATCH_MAX = 1 << 23


@numba.njit(cache=True, nogil=True)
def _analyze(nd, access_mem, access_first, req_rect, req_priv, factors, scratch, scratch_max, keep_from):
    """(copies, copy_rects, tasks, edges, scratch) of the accesses: a run with each table's room
    from `factors`, again with more room for a table that ran out (`factors` keeps it); the
    tables are laid out in `scratch`, or in a larger one (returned, for the next call)."""
    dim, bounds, dim2, bounds2 = _split_bounds(req_rect, nd)
    room = np.empty(factors.shape[0], np.int64)
    while True:
        for t in range(_R_CELLS):
            room[t] = int(factors[t] * req_rect.shape[0]) + MIN_ROOM
        room[_R_CELLS] = int(factors[_R_CELLS])   # (cells per slot of a table)
        tables, scratch = _tables(nd, dim, bounds, dim2, bounds2, room, access_mem.shape[0], scratch, scratch_max)
        full, copies, copy_rects, tasks, edges = _run(nd, access_mem, access_first, req_rect, req_priv, tables,
                                                      keep_from)
        if full < 0:
            return copies, copy_rects, tasks, edges, scratch
        factors[full] = max(2 * factors[full], 1.0)


@numba.njit(cache=True, nogil=True)
def _tables(nd, dim, bounds, dim2, bounds2, room, n_access, scratch, scratch_max):
    """(the tables of a run, each with room[table] rows, laid out in `scratch`; the scratch: a
    larger one when it was too small). A search analyzes thousands of regions: tables made
    afresh for each were a sixth of its time in page faults and clearing. Tables that would
    need a scratch of more than `scratch_max` entries (SCRATCH_MAX) are made for their run
    alone: the rooms are learnt over all regions, so a scratch sized for the largest would
    stay resident at gigabytes on a thousand devices, where tables made afresh touch only
    what they use."""
    w = 2 * nd
    users, pieces, pending, copies = room[_R_USERS], room[_R_PIECES], room[_R_PENDING], room[_R_COPIES]
    cells = room[_R_CELLS]
    u_hash, u_ix = _index_size(bounds, bounds2, users, cells * users)
    p_hash, p_ix = _index_size(bounds, bounds2, pieces, cells * pieces)
    e_hash, e_ix = _index_size(bounds, bounds2, pending, cells * pending)
    # (rows, columns) of each table, in _run's order; columns 0: a 1-D table
    shapes = np.array([(users, w), (users, 5), (u_ix, 0), (room[_R_LINKS], 3), (pieces, w), (pieces, 3), (p_ix, 0),
                       (room[_R_VALS], 2), (pending, w), (pending, 7), (pending, 1), (pending, 0), (e_ix, 0),
                       (copies, 7), (copies, w), (room[_R_EDGES], 2), (room[_R_PREDS], 0), (copies + n_access, 0),
                       (len(_REDOPS), 0)])
    ends = np.cumsum(shapes[:, 0] * np.maximum(shapes[:, 1], 1))
    area = scratch
    if scratch.shape[0] < ends[-1]:
        if 2 * ends[-1] <= scratch_max:
            scratch = area = np.empty(2 * ends[-1], np.int64)
        else:   # (a large region's tables, made for it alone)
            area = np.empty(ends[-1], np.int64)
    tables = (_rows(area, ends, shapes, 0), _rows(area, ends, shapes, 1), _part(area, ends, 2),
              _rows(area, ends, shapes, 3), _rows(area, ends, shapes, 4), _rows(area, ends, shapes, 5),
              _part(area, ends, 6), _rows(area, ends, shapes, 7), _rows(area, ends, shapes, 8),
              _rows(area, ends, shapes, 9), _rows(area, ends, shapes, 10), _part(area, ends, 11),
              _part(area, ends, 12), _rows(area, ends, shapes, 13), _rows(area, ends, shapes, 14),
              _rows(area, ends, shapes, 15), _part(area, ends, 16), _part(area, ends, 17), _part(area, ends, 18))
    _init_index(tables[2], dim, bounds, dim2, bounds2, u_hash, cells * users, users)
    _init_index(tables[6], dim, bounds, dim2, bounds2, p_hash, cells * pieces, pieces)
    _init_index(tables[12], dim, bounds, dim2, bounds2, e_hash, cells * pending, pending)
    tables[17][:] = -1
    tables[18][:] = 0
    return tables, scratch


@numba.njit(cache=True, nogil=True)
def _part(scratch, ends, k):
    """Part k of the scratch as _tables lays it out: from where part k - 1 ends to ends[k]."""
    return scratch[ends[k - 1] if k else 0:ends[k]]


@numba.njit(cache=True, nogil=True)
def _rows(scratch, ends, shapes, k):
    """Part k as a 2-D table of its shape."""
    return _part(scratch, ends, k).reshape((shapes[k, 0], shapes[k, 1]))


@intrinsic
def _borrowed(typingctx, arrays):
    """Views of a tuple's arrays that carry no reference count (a null meminfo), so that numba's
    count updates on them do nothing (see Speed in the module doc). Whoever calls the function
    that borrows must hold the arrays until it returns, and no view may be returned or kept."""
    if not (isinstance(arrays, types.BaseTuple) and all(isinstance(t, types.Array) for t in arrays)):
        return None

    def codegen(context, builder, sig, args):
        views = []
        for ty, value in zip(sig.args[0], cgutils.unpack_tuple(builder, args[0])):
            view = context.make_array(ty)(context, builder, value=value)
            view.meminfo = cgutils.get_null_value(view.meminfo.type)
            view.parent = cgutils.get_null_value(view.parent.type)
            views.append(view._getvalue())
        return context.make_tuple(builder, sig.return_type, views)
    return arrays(arrays), codegen


@numba.njit(cache=True, nogil=True)
def _run(nd, access_mem, access_first, req_rect, req_priv, tables, keep_from):
    """The analysis with the tables of _tables (held by the caller: borrowed here): (-1, copies,
    copy_rects, tasks, edges), or (the table that ran out, empty arrays). Edges only among the
    nodes from access keep_from's on (analyze_region)."""
    access_mem, access_first, req_rect, req_priv = _borrowed((access_mem, access_first, req_rect, req_priv))
    (u_rect, u_info, u_tab,     # users: rect; alive and the heads and tails of their lists; index
     links,                     # a user list's entries: (node, privilege, next)
     p_rect, p_info, p_tab,     # pieces: rect; alive, first and count of its memories in vals; index
     vals,                      # (memory, producer) blocks of the pieces
     e_rect, e_info, e_live, e_label, e_tab,   # pending reductions (their index: alive, in the list; labels)
     copies, copy_rects, edges, preds,
     last_edge,                 # see _edges (a node is a copy or a task)
     pending_by_op) = _borrowed(tables)        # the pending entries of each operator
    w = 2 * nd
    n_u = 0
    n_l = 0
    disjoint = True
    n_p = 0
    n_v = 0
    n_e = 0
    e_head, e_tail, n_pending = -1, -1, 0
    e_dead_listed = 0
    n_c = 0
    n_access = access_mem.shape[0]
    tasks = np.empty(n_access, np.int64)
    n_ed = 0
    next_id = 0
    none = (np.empty((0, 7), np.int64), np.empty((0, w), np.int64), np.empty(0, np.int64), np.empty((0, 2), np.int64))

    first = 1 << 62   # the first node that accesses from keep_from on make: edges only among those
    for a in range(n_access):
        if a == keep_from:
            first = next_id
        if a % COMPACT_EVERY == 0:
            n_p = _compact(p_tab, p_rect, p_info, n_p, nd)
            if n_p < 0:
                return (_R_CELLS,) + none
            n_u = _compact(u_tab, u_rect, u_info, n_u, nd)
            if n_u < 0:
                return (_R_CELLS,) + none
            if e_dead_listed > n_pending:   # (list entries are linked by slot: reindexed, not compacted)
                if not _reindex(e_tab, e_rect, e_live, n_e, nd):
                    return (_R_CELLS,) + none
                e_dead_listed = 0
        mem = access_mem[a]
        r0, r1 = access_first[a], access_first[a + 1]
        n_preds = 0
        for row in range(r0, r1):
            rect, priv = req_rect[row], req_priv[row]
            if _empty(rect, nd):
                continue
            # ---- fold the pending reductions that overlap and do not commute (Analyzer._flush)
            # (a reduction commutes with the pending ones of its operator: when all are of it, none
            # folds, and the scan is skipped; n reductions in a row would otherwise cost n^2 / 2)
            if n_pending and not (priv >= REDUCE_BASE and pending_by_op[priv - REDUCE_BASE] == n_pending):
                hits = _overlapping(e_tab, e_rect, e_live, n_e, rect, nd)
                if hits.shape[0] > 1:   # in the list's order
                    hits = hits[np.argsort(e_label[hits])]
                for h in range(hits.shape[0]):
                    e = hits[h]
                    if priv >= REDUCE_BASE and priv == REDUCE_BASE + e_info[e, _E_REDOP]:
                        continue
                    part = _intersect(e_rect[e], rect, nd)
                    fpreds = np.empty(1 + 2 * (n_p + 1), np.int64)
                    fpreds[0] = e_info[e, _E_NODE]
                    # the fold target reads (RW): what part needs in mem, copied in where missing
                    n_p, n_v, n_c, n_ed, next_id, n_f, full = _physical(
                        p_tab, p_rect, p_info, n_p, vals, n_v, copies, copy_rects, n_c, edges, n_ed, next_id, fpreds,
                        1, part, True, mem, a, nd, first)
                    if full >= 0:
                        return (full,) + none
                    if n_c + 1 > copies.shape[0]:
                        return (_R_COPIES,) + none
                    fid = next_id
                    next_id += 1
                    copies[n_c, 0] = fid
                    copies[n_c, 1] = e_info[e, _E_MEM]
                    copies[n_c, 2] = mem
                    copies[n_c, 3] = e_info[e, _E_REDOP]
                    copies[n_c, 4] = e_info[e, _E_BUFNODE]
                    copies[n_c, 5] = e_info[e, _E_BUFREQ]
                    copies[n_c, 6] = a
                    copy_rects[n_c] = part
                    n_c += 1
                    if n_ed + n_f > edges.shape[0]:
                        return (_R_EDGES,) + none
                    n_ed = _edges(edges, n_ed, fid, fpreds, n_f, last_edge, first)
                    n_p, n_v, full = _set_valid(p_tab, p_rect, p_info, n_p, vals, n_v, part, mem, fid, nd)
                    if full >= 0:
                        return (full,) + none
                    if a >= keep_from:   # (users serve only to find edges)
                        n_u, n_l, disjoint, full = _record_user(u_tab, u_rect, u_info, n_u, links, n_l, disjoint,
                                                                part, READ_WRITE_CODE, fid, nd)
                        if full >= 0:
                            return (full,) + none
                    if n_preds + 1 > preds.shape[0]:
                        return (_R_PREDS,) + none
                    preds[n_preds] = fid
                    n_preds += 1
                    # the rest of the entry stays pending, in its place in program order
                    rests = _subtract(e_rect[e], part, nd)
                    before, after = e_info[e, _E_PREV], e_info[e, _E_NEXT]
                    if n_e + rests.shape[0] > e_rect.shape[0]:
                        return (_R_PENDING,) + none
                    # labels for the rests, in e's place: from e's own up to the next entry's
                    k = rests.shape[0]
                    upper = e_label[after] if after >= 0 else e_label[e] + LABEL_GAP
                    if (upper - e_label[e]) // (k + 1) == 0:
                        _relabel(e_label, e_info, e_head)
                        upper = e_label[after] if after >= 0 else e_label[e] + LABEL_GAP
                    step = (upper - e_label[e]) // (k + 1)
                    e_live[e, 0] = 0
                    e_dead_listed += 1
                    for q in range(k):
                        x = n_e
                        n_e += 1
                        e_rect[x] = rests[q]
                        e_info[x] = e_info[e]
                        e_label[x] = e_label[e] + q * step
                        e_live[x, 0] = 1
                        if not _put(e_tab, e_rect, e_live, x, nd):
                            return (_R_CELLS,) + none
                        e_head = _link(e_info, x, before, e_head)
                        before = x
                        n_pending += 1
                        pending_by_op[e_info[e, _E_REDOP]] += 1
                    if before >= 0:
                        e_info[before, _E_NEXT] = after
                    else:
                        e_head = after
                    if after >= 0:
                        e_info[after, _E_PREV] = before
                    else:
                        e_tail = before
                    n_pending -= 1
                    pending_by_op[e_info[e, _E_REDOP]] -= 1
            # ---- logical dependences (Analyzer._logical_preds): only where edges are kept
            if a >= keep_from:
                reading = priv == READ_CODE
                over = _over(u_tab, u_rect, u_info, n_u, rect, nd, disjoint)
                for q in range(over.shape[0]):
                    s = over[q]
                    for head in (_U_RHEAD, _U_OHEAD):
                        x = u_info[s, head]
                        while x >= 0:
                            if (head == _U_RHEAD and not reading) or (head == _U_OHEAD
                                                                      and _conflicts(links[x, 1], priv)):
                                if n_preds + 1 > preds.shape[0]:
                                    return (_R_PREDS,) + none
                                preds[n_preds] = links[x, 0]
                                n_preds += 1
                            x = links[x, 2]
            # ---- where the data is (Analyzer._physical_preds), not for reductions
            if priv < REDUCE_BASE:
                reads = priv == READ_CODE or priv == READ_WRITE_CODE
                n_p, n_v, n_c, n_ed, next_id, n_preds, full = _physical(
                    p_tab, p_rect, p_info, n_p, vals, n_v, copies, copy_rects, n_c, edges, n_ed, next_id, preds,
                    n_preds, rect, reads, mem, a, nd, first)
                if full >= 0:
                    return (full,) + none
        # ---- the task, then what it leaves behind
        tid = next_id
        next_id += 1
        tasks[a] = tid
        if n_ed + n_preds > edges.shape[0]:
            return (_R_EDGES,) + none
        n_ed = _edges(edges, n_ed, tid, preds, n_preds, last_edge, first)
        for row in range(r0, r1):
            rect, priv = req_rect[row], req_priv[row]
            if _empty(rect, nd):
                continue
            if a >= keep_from:   # (users serve only to find edges: a user before keep_from gives none kept)
                n_u, n_l, disjoint, full = _record_user(u_tab, u_rect, u_info, n_u, links, n_l, disjoint, rect, priv,
                                                        tid, nd)
                if full >= 0:
                    return (full,) + none
            if priv == WRITE_CODE or priv == READ_WRITE_CODE:
                n_p, n_v, full = _set_valid(p_tab, p_rect, p_info, n_p, vals, n_v, rect, mem, tid, nd)
                if full >= 0:
                    return (full,) + none
            elif priv >= REDUCE_BASE:
                if n_e + 1 > e_rect.shape[0]:
                    return (_R_PENDING,) + none
                x = n_e
                n_e += 1
                e_rect[x] = rect
                e_label[x] = e_label[e_tail] + LABEL_GAP if e_tail >= 0 else 0
                e_live[x, 0] = 1
                if not _put(e_tab, e_rect, e_live, x, nd):
                    return (_R_CELLS,) + none
                e_info[x, _E_REDOP] = priv - REDUCE_BASE
                e_info[x, _E_BUFNODE] = tid
                e_info[x, _E_BUFREQ] = row - r0
                e_info[x, _E_MEM] = mem
                e_info[x, _E_NODE] = tid
                e_info[x, _E_NEXT] = -1
                e_head = _link(e_info, x, e_tail, e_head)
                e_tail = x
                n_pending += 1
                pending_by_op[priv - REDUCE_BASE] += 1
    return -1, copies[:n_c].copy(), copy_rects[:n_c].copy(), tasks, edges[:n_ed].copy()


@numba.njit(cache=True, nogil=True)
def _relabel(e_label, e_info, head):
    """Space the pending list's labels LABEL_GAP apart again, in its order (when a split found
    no room between two neighbours' labels)."""
    e = head
    label = 0
    while e >= 0:
        e_label[e] = label
        label += LABEL_GAP
        e = e_info[e, _E_NEXT]


@numba.njit(cache=True, nogil=True)
def _link(e_info, x, before, head):
    """Put pending entry x after entry `before` (-1: first) in the list; the list's head."""
    e_info[x, _E_PREV] = before
    if before >= 0:
        e_info[before, _E_NEXT] = x
        return head
    return x


@numba.njit(cache=True, nogil=True, inline="always")
def _edges(edges, n_ed, node, preds, n_preds, last, first):
    """Add an edge to `node` from each distinct pred of preds[:n_preds], in the order given
    (`edges` has room for them), where both are `first` or later. `last[p]` is the last node
    given an edge from p: a node gets all its edges in one call, with an id above its preds',
    so a pred seen in this call is marked by the node itself, and nothing is reset or sorted
    (sorting each node's preds was a tenth of a redistribution's analysis). Returns the edge
    count."""
    if node < first:
        return n_ed
    for i in range(n_preds):
        p = preds[i]
        if p >= first and last[p] != node:
            last[p] = node
            edges[n_ed, 0] = node
            edges[n_ed, 1] = p
            n_ed += 1
    return n_ed


@numba.njit(cache=True, nogil=True, inline="always")
def _new_piece(p_tab, p_rect, p_info, n_p, rect, vstart, vlen, nd):
    """The piece count with a new piece of `rect` (its memories vals[vstart:vstart + vlen]), and
    the table that had no room for it (-1: none)."""
    if n_p + 1 > p_rect.shape[0]:
        return n_p, _R_PIECES
    p_rect[n_p] = rect
    p_info[n_p, _P_ALIVE] = 1
    p_info[n_p, _P_VSTART] = vstart
    p_info[n_p, _P_VLEN] = vlen
    if not _put(p_tab, p_rect, p_info, n_p, nd):
        return n_p, _R_CELLS
    return n_p + 1, -1


@numba.njit(cache=True, nogil=True, inline="always")
def _physical(p_tab, p_rect, p_info, n_p, vals, n_v, copies, copy_rects, n_c, edges, n_ed, next_id, preds,
              n_preds, rect, reads, mem, access, nd, first):
    """Analyzer._physical_preds: depend on whoever made `rect`'s pieces valid in `mem`; where
    one is valid elsewhere only and the access reads, copy it (or its overlap) in first.
    Returns the counts (n_p, n_v, n_c, n_ed, next_id, n_preds) and the table that ran out of
    room (-1: none). A copy's edge is listed where both ends are `first` or later (_edges)."""
    for s in _over(p_tab, p_rect, p_info, n_p, rect, nd, True):
        vs, vl = p_info[s, _P_VSTART], p_info[s, _P_VLEN]
        found = -1
        for q in range(vs, vs + vl):
            if vals[q, 0] == mem:
                found = q
                break
        if found >= 0:
            if vals[found, 1] >= 0:
                if n_preds + 1 > preds.shape[0]:
                    return n_p, n_v, n_c, n_ed, next_id, n_preds, _R_PREDS
                preds[n_preds] = vals[found, 1]
                n_preds += 1
            continue
        if not reads:
            continue
        if n_c + 1 > copies.shape[0]:
            return n_p, n_v, n_c, n_ed, next_id, n_preds, _R_COPIES
        if n_ed + 1 > edges.shape[0]:
            return n_p, n_v, n_c, n_ed, next_id, n_preds, _R_EDGES
        if n_v + vl + 1 > vals.shape[0]:
            return n_p, n_v, n_c, n_ed, next_id, n_preds, _R_VALS
        if n_preds + 1 > preds.shape[0]:
            return n_p, n_v, n_c, n_ed, next_id, n_preds, _R_PREDS
        whole = _contains(rect, p_rect[s], nd)
        inter = p_rect[s].copy() if whole else _intersect(p_rect[s], rect, nd)
        cid = next_id
        next_id += 1
        copies[n_c, 0] = cid
        copies[n_c, 1] = vals[vs, 0]   # the piece's first valid memory (choose_source)
        copies[n_c, 2] = mem
        copies[n_c, 3] = -1
        copies[n_c, 4] = -1
        copies[n_c, 5] = -1
        copies[n_c, 6] = access
        copy_rects[n_c] = inter
        n_c += 1
        if vals[vs, 1] >= first:   # (>= 0: made by a node; first >= 0)
            edges[n_ed, 0] = cid
            edges[n_ed, 1] = vals[vs, 1]
            n_ed += 1
        # the piece's memories and mem, made valid there by the copy
        vals[n_v:n_v + vl] = vals[vs:vs + vl]
        vals[n_v + vl, 0] = mem
        vals[n_v + vl, 1] = cid
        p_info[s, _P_ALIVE] = 0
        full = -1
        if not whole:   # the rest keeps its memories, before the copied part (Analyzer's order)
            rests = _subtract(p_rect[s], inter, nd)
            for q in range(rests.shape[0]):
                n_p, full = _new_piece(p_tab, p_rect, p_info, n_p, rests[q], vs, vl, nd)
                if full >= 0:
                    return n_p, n_v, n_c, n_ed, next_id, n_preds, full
        n_p, full = _new_piece(p_tab, p_rect, p_info, n_p, inter, n_v, vl + 1, nd)
        if full >= 0:
            return n_p, n_v, n_c, n_ed, next_id, n_preds, full
        n_v += vl + 1
        preds[n_preds] = cid
        n_preds += 1
    return n_p, n_v, n_c, n_ed, next_id, n_preds, -1


@numba.njit(cache=True, nogil=True, inline="always")
def _set_valid(p_tab, p_rect, p_info, n_p, vals, n_v, rect, mem, node, nd):
    """Analyzer._set_valid: `rect` is valid in `mem` alone, made so by `node`. Returns (n_p, n_v)
    and the table that ran out of room (-1: none)."""
    if n_v + 1 > vals.shape[0]:
        return n_p, n_v, _R_VALS
    vals[n_v, 0] = mem
    vals[n_v, 1] = node
    s = _find(p_tab, p_rect, p_info, rect, nd)
    if s >= 0:
        p_info[s, _P_VSTART] = n_v
        p_info[s, _P_VLEN] = 1
        return n_p, n_v + 1, -1
    full = -1
    for t in _overlapping(p_tab, p_rect, p_info, n_p, rect, nd):
        p_info[t, _P_ALIVE] = 0
        rests = _subtract(p_rect[t], rect, nd)
        for q in range(rests.shape[0]):
            n_p, full = _new_piece(p_tab, p_rect, p_info, n_p, rests[q], p_info[t, _P_VSTART], p_info[t, _P_VLEN], nd)
            if full >= 0:
                return n_p, n_v, full
    n_p, full = _new_piece(p_tab, p_rect, p_info, n_p, rect, n_v, 1, nd)
    return n_p, n_v + 1, full


@numba.njit(cache=True, nogil=True, inline="always")
def _record_user(u_tab, u_rect, u_info, n_u, links, n_l, disjoint, rect, priv, node, nd):
    """Analyzer._record_user: `node` touched `rect` with `priv`. Returns (n_u, n_l, disjoint) and
    the table that ran out of room (-1: none)."""
    if n_l + 1 > links.shape[0]:
        return n_u, n_l, disjoint, _R_LINKS
    is_read = priv == READ_CODE
    if priv == WRITE_CODE or priv == READ_WRITE_CODE:
        over = _over(u_tab, u_rect, u_info, n_u, rect, nd, disjoint)
        doomed = 0
        for s in over:
            if not _equal_at(u_rect, s, rect, nd) and _contains(rect, u_rect[s], nd):
                u_info[s, _U_ALIVE] = 0   # a writer orders everything after it: forget what it covers
                doomed += 1
        if doomed and not disjoint:
            disjoint = _pairwise_disjoint(u_tab, u_rect, u_info, n_u, nd)
        overlaps_others = over.shape[0] > doomed
    else:
        s = _find(u_tab, u_rect, u_info, rect, nd)
        if s >= 0:
            links[n_l, 0] = node
            links[n_l, 1] = priv
            links[n_l, 2] = -1
            head, tail = (_U_RHEAD, _U_RTAIL) if is_read else (_U_OHEAD, _U_OTAIL)
            if u_info[s, tail] >= 0:
                links[u_info[s, tail], 2] = n_l
            else:
                u_info[s, head] = n_l
            u_info[s, tail] = n_l
            return n_u, n_l + 1, disjoint, -1
        overlaps_others = False
        if disjoint:
            overlaps_others = _overlapping(u_tab, u_rect, u_info, n_u, rect, nd).shape[0] > 0
    s = _find(u_tab, u_rect, u_info, rect, nd)
    if s < 0:
        if disjoint and overlaps_others:
            disjoint = False
        if n_u + 1 > u_rect.shape[0]:
            return n_u, n_l, disjoint, _R_USERS
        s = n_u
        n_u += 1
        u_rect[s] = rect
        u_info[s, _U_ALIVE] = 1
        if not _put(u_tab, u_rect, u_info, s, nd):
            return n_u, n_l, disjoint, _R_CELLS
    # a new user list (a key given a new value keeps its slot)
    links[n_l, 0] = node
    links[n_l, 1] = priv
    links[n_l, 2] = -1
    u_info[s, _U_RHEAD] = n_l if is_read else -1
    u_info[s, _U_RTAIL] = n_l if is_read else -1
    u_info[s, _U_OHEAD] = -1 if is_read else n_l
    u_info[s, _U_OTAIL] = -1 if is_read else n_l
    return n_u, n_l + 1, disjoint, -1
