"""The simulator's timing core: list scheduling of a task graph on resources, in arrays.

A graph here is compact: node i has a resource `res[i]` (a processor or a link; -1 for a
node that occupies nothing, such as a fence), a duration `dur[i]` in seconds, an optional
`delay[i]` after it (a message's latency: in flight, it occupies nothing, so a link sends
the next message meanwhile, as networks pipeline), and its predecessors
`pred_idx[pred_ptr[i]:pred_ptr[i + 1]]` (node indices, any order). A node ends `delay`
after its resource is done with it, and is ready when its last predecessor ends; every
resource runs one node at a time, in the order in which its nodes became ready (ties by
index, so the result is deterministic). This is how the executor behaves too: one worker
per processor and one per memory's copies, each taking ready nodes first come, first served.

A node may also occupy a resource just before and one just after its own (`handling`: the
sending and the receiving processor of a copy between ranks, where their runtime's Python
handles the message on the cores that the workers use). Each part waits its turn like a
node of its own: the part before when the node is ready, the node's own resource when that
part is done, the part after when the node's delay has passed; the node ends with it.

`schedule` returns the start (on its own resource) and end of every node; `Timing` adds the
iteration time and each resource's busy time. `schedule_successors` does the same for a
graph given by its successor lists and indegrees (`Successors`), which is how the core walks
it and how an assembled graph comes (strategies/segments.py). The loop is compiled with
numba (nogil, cached), because the search calls it tens of thousands of times.
"""
from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def _heap_push(keys, ids, size, key, nid):
    """Add (key, nid) to the binary heap of the first `size` entries (least key first, ties by
    id); the new size."""
    _rise(keys, ids, size, key, nid)
    return size + 1


@numba.njit(cache=True, nogil=True)
def _rise(keys, ids, i, key, nid):
    """Put (key, nid) in the heap's hole at i, moving parents down into the hole until one is
    less. Moving rather than swapping: with a swap, numba counted two references to the
    arrays each call, atomically, in the schedule's loop."""
    while i > 0:
        parent = (i - 1) >> 1
        pk = keys[parent]
        pid = ids[parent]
        if pk < key or (pk == key and pid < nid):
            break
        keys[i] = pk
        ids[i] = pid
        i = parent
    keys[i] = key
    ids[i] = nid


@numba.njit(cache=True, nogil=True)
def _heap_pop(keys, ids, size):
    """(key, nid, size) of the heap's least entry, removed. Bottom-up: the hole goes down to a
    leaf along the lesser children (one comparison a level), and the last entry rises from
    there; it belongs near the leaves, so this compares about half as often as sinking it."""
    key, nid = keys[0], ids[0]
    size -= 1
    last_key, last_id = keys[size], ids[size]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        right = child + 1
        if right < size:   # the lesser child by arithmetic, not a branch (which one is a coin toss)
            kr = keys[right]
            kc = keys[child]
            child += np.int64((kr < kc) | ((kr == kc) & (ids[right] < ids[child])))
        keys[i] = keys[child]
        ids[i] = ids[child]
        i = child
    _rise(keys, ids, i, last_key, last_id)
    return key, nid, size


@numba.njit(cache=True, nogil=True)
def successor_lists(dst, src, n):
    """(indegree, succ_ptr, succ_idx) of the n-node graph whose edge k runs from src[k] to
    dst[k]: a counting sort by source (a repeated edge stays repeated), in dst's integer type."""
    indeg = np.zeros(n, dst.dtype)
    count = np.zeros(n + 1, dst.dtype)
    for k in range(dst.shape[0]):
        indeg[dst[k]] += 1
        count[src[k] + 1] += 1
    ptr = np.cumsum(count).astype(dst.dtype)
    idx = np.empty(dst.shape[0], dst.dtype)
    fill = ptr[:n].copy()
    for k in range(dst.shape[0]):
        idx[fill[src[k]]] = dst[k]
        fill[src[k]] += 1
    return indeg, ptr, idx


@numba.njit(cache=True, nogil=True, inline="always")
def _occupy(free, r, t, seconds):
    """The start of a part ready at t on resource r (-1: none), which it then holds for
    `seconds`: when r is free, in turn."""
    if r < 0:
        return t
    s = t if free[r] <= t else free[r]
    free[r] = s + seconds
    return s


@numba.njit(cache=True, nogil=True)
def _schedule(res, dur, delay, indegree, succ_ptr, succ_idx, num_resources, pre_res, pre_dur, post_res, post_dur):
    n = res.shape[0]
    phases = pre_res.shape[0] == n   # else no node has handling parts (empty arrays)
    indeg = indegree.copy()
    ready = np.zeros(n)
    start = np.zeros(n)
    end = np.zeros(n)
    free = np.zeros(num_resources)
    # the nodes ready from the start (often a third of them) wait in id order in `roots`, the rest
    # in a heap as they become ready: the same order as one heap of all, on a smaller heap
    roots = np.empty(n, np.int64)
    n_roots = 0
    for i in range(n):
        if indeg[i] == 0:
            roots[n_roots] = i
            n_roots += 1
    # a heap entry is a node's code: i when it became ready, n + i when its part before is done
    # (its own resource next), 2n + i when its delay has passed (its part after next)
    keys = np.empty(n)
    ids = np.empty(n, np.int64)
    size = 0
    next_root = 0
    done = 0
    while size > 0 or next_root < n_roots:
        if next_root < n_roots and (size == 0 or keys[0] > 0.0 or ids[0] > roots[next_root]):
            t, code = 0.0, roots[next_root]
            next_root += 1
        else:
            t, code, size = _heap_pop(keys, ids, size)
        i = code % n
        step = code // n
        if step == 0 and (res[i] < -1 or res[i] >= num_resources or dur[i] < 0 or delay[i] < 0):
            return start, end, done, False   # (checked here rather than in a pass of their own)
        if step == 0 and phases and pre_res[i] >= 0:
            s = _occupy(free, pre_res[i], t, pre_dur[i])
            size = _heap_push(keys, ids, size, s + pre_dur[i], n + i)
            continue
        if step < 2:
            s = _occupy(free, res[i], t, dur[i])
            e = s + dur[i] + delay[i]
            start[i] = s
            if phases and post_res[i] >= 0:
                size = _heap_push(keys, ids, size, e, 2 * n + i)
                continue
        else:
            e = _occupy(free, post_res[i], t, post_dur[i]) + post_dur[i]
        end[i] = e
        done += 1
        for k in range(succ_ptr[i], succ_ptr[i + 1]):
            j = succ_idx[k]
            if j < 0 or j >= n or indeg[j] <= 0:
                return start, end, done, False
            if e > ready[j]:
                ready[j] = e
            indeg[j] -= 1
            if indeg[j] == 0:
                size = _heap_push(keys, ids, size, ready[j], j)
    return start, end, done, True


#: the integer types the core takes a graph's arrays in as they are (others are made int64)
_INDEX_TYPES = (np.dtype(np.int32), np.dtype(np.int64))


@dataclass(frozen=True)
class Successors:
    """A graph as the timing core walks it: each node's predecessor count (`indegree`, an edge
    given twice counts twice) and its successors idx[ptr[i]:ptr[i + 1]] (any order; a
    repeated edge changes no time); int32 or int64 arrays."""

    indegree: np.ndarray
    ptr: np.ndarray
    idx: np.ndarray

    @staticmethod
    def of_preds(pred_ptr: np.ndarray, pred_idx: np.ndarray) -> "Successors":
        ptr = np.ascontiguousarray(pred_ptr, np.int64)
        dst = np.repeat(np.arange(ptr.shape[0] - 1, dtype=np.int64), np.diff(ptr))
        return Successors(*successor_lists(dst, np.ascontiguousarray(pred_idx, np.int64), ptr.shape[0] - 1))

    def __repr__(self) -> str:
        return f"Successors({self.indegree.shape[0]} nodes, {self.idx.shape[0]} edges)"


@dataclass(frozen=True)
class Handling:
    """The parts of nodes before and after their own resource (see the module docstring):
    resource index (-1: none) and seconds, one entry a node."""

    pre_res: np.ndarray
    pre_dur: np.ndarray
    post_res: np.ndarray
    post_dur: np.ndarray


@dataclass(frozen=True)
class Timing:
    """The simulated run of one graph: when each node ran, the iteration time (the last end) and
    each resource's busy seconds."""

    start: np.ndarray
    end: np.ndarray
    busy: np.ndarray

    @property
    def time(self) -> float:
        return float(self.end.max()) if self.end.size else 0.0

    def __repr__(self) -> str:
        return f"Timing({self.time * 1e3:.3f} ms over {self.end.size} nodes, {self.busy.size} resources)"


def schedule(res: np.ndarray, dur: np.ndarray, pred_ptr: np.ndarray, pred_idx: np.ndarray,
             num_resources: int, delay: np.ndarray | None = None, handling: Handling | None = None) -> Timing:
    """Simulate the graph (see the module docstring); raises ValueError on a cycle or bad index."""
    pred_ptr = np.ascontiguousarray(pred_ptr, np.int64)
    pred_idx = np.ascontiguousarray(pred_idx, np.int64)
    n = np.shape(res)[0]
    if pred_ptr.shape != (n + 1,):
        raise ValueError(f"schedule: {n} resources and {pred_ptr.shape[0]} pred offsets (need n + 1)")
    if pred_idx.size and (pred_idx.min() < 0 or pred_idx.max() >= n):
        raise ValueError(f"schedule: predecessor indices must be in 0..{n - 1}")
    return schedule_successors(res, dur, Successors.of_preds(pred_ptr, pred_idx), num_resources, delay, handling)


def schedule_successors(res: np.ndarray, dur: np.ndarray, successors: Successors, num_resources: int,
                        delay: np.ndarray | None = None, handling: Handling | None = None) -> Timing:
    """`schedule` of a graph given by its Successors (what an assembled graph keeps: the search
    times one a proposal, and making them from pred lists was a third of the schedule)."""
    res = np.ascontiguousarray(res, np.int64)
    dur = np.ascontiguousarray(dur, np.float64)
    delay = np.zeros(dur.shape) if delay is None else np.ascontiguousarray(delay, np.float64)
    indeg, ptr, idx = (np.ascontiguousarray(a, a.dtype if a.dtype in _INDEX_TYPES else np.int64) for a in
                       (successors.indegree, successors.ptr, successors.idx))
    n = res.shape[0]
    if dur.shape != (n,) or indeg.shape != (n,) or ptr.shape != (n + 1,) or ptr[-1] != idx.shape[0]:
        raise ValueError(f"schedule: {n} resources, {dur.shape[0]} durations, {indeg.shape[0]} indegrees and "
                         f"{ptr.shape[0]} successor offsets (need n, n, n and n + 1, the last the edge count)")
    if delay.shape != dur.shape:
        raise ValueError(f"schedule: {n} durations but {delay.shape[0]} delays")
    parts = _handling_arrays(handling, n, num_resources)
    start, end, done, ok = _schedule(res, dur, delay, indeg, ptr, idx, num_resources, *parts)
    if (not ok or done != n) and not _well_formed(res, dur, delay, indeg, idx, num_resources):
        _refuse(res, dur, delay, indeg, idx, num_resources)
    if done != n:
        raise ValueError(f"schedule: the graph has a cycle: {n - done} of {n} nodes never became ready")
    return Timing(start, end, _busy(num_resources, res, dur, *parts))


@numba.njit(cache=True, nogil=True)
def _well_formed(res, dur, delay, indeg, idx, num_resources):
    """The checks of _refuse, in one compiled pass over each array: asked when _schedule, which
    checks each node and edge as it meets them, found one wrong or did not reach every node."""
    n = res.shape[0]
    total = 0
    for i in range(n):
        if res[i] < -1 or res[i] >= num_resources or indeg[i] < 0 or dur[i] < 0 or delay[i] < 0:
            return False
        total += indeg[i]
    for k in range(idx.shape[0]):
        if idx[k] < 0 or idx[k] >= n:
            return False
    return total == idx.shape[0]


def _refuse(res, dur, delay, indeg, idx, num_resources) -> None:
    """Raise the error that names what is wrong with a graph that _well_formed refused."""
    n = res.shape[0]
    if n and (res.max() >= num_resources or res.min() < -1):
        raise ValueError(f"schedule: resource ids must be in -1..{num_resources - 1}, got {res.min()}..{res.max()}")
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        raise ValueError(f"schedule: successor indices must be in 0..{n - 1}")
    if n and (indeg.min() < 0 or indeg.sum() != idx.shape[0]):
        raise ValueError(f"schedule: the indegrees must be >= 0 and add up to the {idx.shape[0]} successor "
                         f"entries, got {indeg.sum()}")
    bad = np.flatnonzero((dur < 0) | (delay < 0))
    raise ValueError(f"schedule: negative duration or delay at node {int(bad[0])}")


@numba.njit(cache=True, nogil=True)
def _busy(num_resources, res, dur, pre_res, pre_dur, post_res, post_dur):
    """Each resource's busy seconds: its nodes' own parts, then their parts before, then after,
    each summed in node order (as np.bincount sums)."""
    busy = np.zeros(num_resources)
    for r, d in ((res, dur), (pre_res, pre_dur), (post_res, post_dur)):
        part = np.zeros(num_resources)
        for i in range(r.shape[0]):
            if r[i] >= 0:
                part[r[i]] += d[i]
        busy += part
    return busy


def _handling_arrays(handling: Handling | None, n: int, num_resources: int) -> tuple:
    """(pre_res, pre_dur, post_res, post_dur) as the core takes them, checked; empty without handling."""
    if handling is None:
        none_i, none_f = np.empty(0, np.int64), np.empty(0)
        return none_i, none_f, none_i, none_f
    out = []
    for name in ("pre_res", "pre_dur", "post_res", "post_dur"):
        a = np.ascontiguousarray(getattr(handling, name), np.int64 if name.endswith("res") else np.float64)
        if a.shape != (n,):
            raise ValueError(f"schedule: handling.{name} has shape {a.shape}, need ({n},)")
        out.append(a)
    for name, r in (("pre_res", out[0]), ("post_res", out[2])):
        if n and (r.max() >= num_resources or r.min() < -1):
            raise ValueError(f"schedule: handling.{name} must be in -1..{num_resources - 1}, got {r.min()}..{r.max()}")
    if (out[1] < 0).any() or (out[3] < 0).any():
        raise ValueError("schedule: negative handling seconds")
    return tuple(out)
