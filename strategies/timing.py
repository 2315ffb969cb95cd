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
handles the message on the cores that the workers use): the part before when the node is
ready, the node's own resource when that part is done, the part after when the node's delay
has passed; the node ends with it. A part does not wait for its resource: another thread of
the rank runs it at once, sharing the core, and whatever the resource runs or has queued then
finishes that much later (the node running keeps its end; the next one starts later). Waiting
behind the task the worker had started had put a message's send after a 3 ms convolution in
alexnet's model parallelism, 42% too long (docs/accuracy.md, session 37).

A message's receipt may also wait for the receiving rank to look (`Naps`): where a node's cores
are shared, the runtime's MPI progress thread naps while nothing ends, each nap twice the last
up to a longest, and takes a message that arrived meanwhile when its nap is over. So a node
with a part after waits, once its delay has passed, `share` times half the nap in effect at
how long its part-after resource has been quiet (since the last such node there ended its
wait; the nap in effect is the first while that is under one nap, the second under three, and
so on), before its part after. (tools.trace messages shows the flights growing with that quiet
time; docs/accuracy.md, session 47.)

`schedule` returns the start (on its own resource) and end of every node; `Timing` adds the
iteration time and each resource's busy time. `schedule_successors` does the same for a
graph given by its successor lists and indegrees (`Successors`), which is how the core walks
it and how an assembled graph comes (strategies/segments.py). The loop is compiled with
numba (nogil, cached), because the search calls it tens of thousands of times.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numba
import numpy as np
from numba.cpython.unsafe.numbers import leading_zeros, trailing_zeros


# ---- the queue of ready nodes -------------------------------------------------------------------
# The schedule takes nodes in order of (time ready, id), and no node becomes ready before the one
# taken last: a monotone priority queue, kept as a radix heap. Times are non-negative doubles,
# whose bits order as int64s do; a waiting node sits in the bucket of the highest bit in which
# its time differs from the last time taken (bucket 0: the same time, there in a binary heap of
# ids, since ties go by id). Taking the least empties the lowest bucket into lower ones, so a node
# moves a few times (3.6 on average in an Inception-v3 step on 64 devices, whose schedule took
# 2.9 ms rather than 3.7 with one binary heap of all the waiting nodes, 1,600 on average).

@numba.njit(cache=True, nogil=True)
def _id_push(heap, size, nid):
    """Add nid to the binary min-heap of the first `size` ids; the new size."""
    i = size
    while i > 0:
        parent = (i - 1) >> 1
        if heap[parent] <= nid:
            break
        heap[i] = heap[parent]
        i = parent
    heap[i] = nid
    return size + 1


@numba.njit(cache=True, nogil=True)
def _id_pop(heap, size):
    """(the least id, the new size) of the binary min-heap of the first `size` ids."""
    least = heap[0]
    size -= 1
    last = heap[size]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        if child + 1 < size and heap[child + 1] < heap[child]:
            child += 1
        if last <= heap[child]:
            break
        heap[i] = heap[child]
        i = child
    heap[i] = last
    return least, size


@numba.njit(cache=True, nogil=True)
def _queue_push(bits, link, head, ids, last, mask, n_ids, nid):
    """Put nid, whose time's bits are bits[nid] (at least `last`, the bits of the time taken
    last), in its bucket; the new (mask of non-empty buckets, size of bucket 0's heap)."""
    d = bits[nid] ^ last
    if d == 0:
        return mask, _id_push(ids, n_ids, nid)
    b = 64 - leading_zeros(d)
    link[nid] = head[b]
    head[b] = nid
    return mask | (np.int64(1) << b), n_ids


@numba.njit(cache=True, nogil=True)
def _queue_refill(bits, link, head, ids, mask):
    """Bucket 0 is empty and `mask` is not: take the least time of the lowest non-empty bucket as
    the last, and share that bucket out below it. Returns (last, mask, size of bucket 0's heap)."""
    b = trailing_zeros(mask)
    nid = head[b]
    last = bits[nid]
    while nid >= 0:
        if bits[nid] < last:
            last = bits[nid]
        nid = link[nid]
    nid = head[b]
    head[b] = -1
    mask &= ~(np.int64(1) << b)
    n_ids = 0
    while nid >= 0:
        after = link[nid]
        mask, n_ids = _queue_push(bits, link, head, ids, last, mask, n_ids, nid)
        nid = after
    return last, mask, n_ids


@numba.njit(cache=True, nogil=True, inline="always")
def _add_runs(keys, out, shift):
    """out[key + shift] += how often each key comes, counted in a local while the same key comes
    again: an assembled graph's edges and copies come in runs of one node, and adding one to the
    same array entry item after item waited for each store in turn."""
    if keys.shape[0] == 0:
        return
    key, run = keys[0], 0
    for k in range(keys.shape[0]):
        if keys[k] != key:
            out[key + shift] += run
            key, run = keys[k], 0
        run += 1
    out[key + shift] += run


@numba.njit(cache=True, nogil=True)
def stable_sort_by(keys, values, n):
    """(ptr, out): `values` sorted stably by their `keys` (ints in 0..n-1), key v's values at
    out[ptr[v]:ptr[v + 1]]; a counting sort, in values' integer type, each run of one key
    counted and filled in a local (_add_runs)."""
    ptr = np.zeros(n + 1, values.dtype)
    _add_runs(keys, ptr, 1)
    for v in range(n):
        ptr[v + 1] += ptr[v]
    out = np.empty(values.shape[0], values.dtype)
    fill = ptr[:n].copy()
    key, at = -1, 0
    for k in range(keys.shape[0]):
        if keys[k] != key:
            if key >= 0:
                fill[key] = at
            key = keys[k]
            at = fill[key]
        out[at] = values[k]
        at += 1
    return ptr, out


@numba.njit(cache=True, nogil=True)
def successor_lists(dst, src, n):
    """(indegree, succ_ptr, succ_idx) of the n-node graph whose edge k runs from src[k] to
    dst[k]: a counting sort by source (a repeated edge stays repeated), in dst's integer type.
    An assembled graph's edges come mostly grouped by destination, which the counts by runs
    make use of (an Inception-v3 step on 64 devices, 154k edges: 1.9 -> 1.3 ms)."""
    indeg = np.zeros(n, dst.dtype)
    _add_runs(dst, indeg, 0)
    ptr, idx = stable_sort_by(src, dst, n)
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


@numba.njit(cache=True, nogil=True, inline="always")
def _share(free, r, t, seconds):
    """A handling part ready at t on resource r (-1: none) runs at once (it starts at t): r's work
    is then done `seconds` later than it would have been (see the module docstring)."""
    if r >= 0:
        free[r] = (t if free[r] <= t else free[r]) + seconds


@numba.njit(cache=True, nogil=True, inline="always")
def _nap_wait(quiet, first, longest, share):
    """`share` times half the nap in effect `quiet` seconds after a resource's last receipt: naps
    of first, 2 first, 4 first, ... up to `longest`, one after another (see the module docstring)."""
    nap = first
    end = first
    while quiet >= end and nap < longest:
        nap = min(longest, 2.0 * nap)
        end += nap
    return share * 0.5 * nap


@numba.njit(cache=True, nogil=True)
def _schedule(res, dur, delay, indegree, succ_ptr, succ_idx, num_resources, pre_res, pre_dur, post_res, post_dur,
              nap_first, nap_longest, nap_share):
    n = res.shape[0]
    phases = pre_res.shape[0] == n   # else no node has handling parts (empty arrays)
    naps = phases and nap_share > 0.0 and nap_first > 0.0
    quiet_since = np.zeros(num_resources if naps else 0)   # per part-after resource: its last receipt's wait's end
    indeg = indegree.copy()
    start = np.zeros(n)
    end = np.zeros(n)
    free = np.zeros(num_resources)
    # the nodes ready from the start (often a third of them) wait in id order in `roots`, the rest
    # in the queue as they become ready: the same order as one queue of all, on a smaller queue
    roots = np.empty(n, np.int64)
    n_roots = 0
    for i in range(n):
        if indeg[i] == 0:
            roots[n_roots] = i
            n_roots += 1
    # a queue entry is a node's code: i when it became ready, n + i when its part before is done
    # (its own resource next), 2n + i when its delay has passed (its part after next, or a nap's
    # wait), 3n + i when that wait is over (its part after next); times[code]
    # is when (for i: `ready`, the latest end of its predecessors so far), and bits its float's
    # bits (the same memory)
    times = np.zeros((4 if naps else 3) * n if phases else n)
    ready = times[:n]
    bits = times.view(np.int64)
    link = np.empty(times.shape[0], np.int64)
    head = np.full(64, -1, np.int64)
    ids = np.empty(n, np.int64)
    last, mask, n_ids = np.int64(0), np.int64(0), 0
    next_root = 0
    done = 0
    while True:
        # while roots wait, the last time taken is 0: bucket 0 holds the queue's nodes ready at 0,
        # and any others are later than every root
        if next_root < n_roots and (n_ids == 0 or ids[0] > roots[next_root]):
            t, code = 0.0, roots[next_root]
            next_root += 1
        else:
            if n_ids == 0:
                if mask == 0:
                    break
                last, mask, n_ids = _queue_refill(bits, link, head, ids, mask)
            code, n_ids = _id_pop(ids, n_ids)
            t = times[code]
        step = 0 if code < n else (1 if code < 2 * n else (2 if code < 3 * n else 3))   # (not code // n)
        i = code - step * n
        if step == 0 and (res[i] < -1 or res[i] >= num_resources or dur[i] < 0 or delay[i] < 0):
            return start, end, done, False   # (checked here rather than in a pass of their own)
        if step == 0 and phases and pre_res[i] >= 0:
            _share(free, pre_res[i], t, pre_dur[i])
            times[n + i] = t + pre_dur[i]
            mask, n_ids = _queue_push(bits, link, head, ids, last, mask, n_ids, n + i)
            continue
        if step < 2:
            s = _occupy(free, res[i], t, dur[i])
            e = s + dur[i] + delay[i]
            start[i] = s
            if phases and post_res[i] >= 0:
                times[2 * n + i] = e
                mask, n_ids = _queue_push(bits, link, head, ids, last, mask, n_ids, 2 * n + i)
                continue
        else:
            if naps:
                r = post_res[i]
                if step == 2:
                    wait = _nap_wait(t - quiet_since[r], nap_first, nap_longest, nap_share)
                    if wait > 0.0:
                        times[3 * n + i] = t + wait
                        mask, n_ids = _queue_push(bits, link, head, ids, last, mask, n_ids, 3 * n + i)
                        continue
                if t > quiet_since[r]:
                    quiet_since[r] = t
            _share(free, post_res[i], t, post_dur[i])
            e = t + post_dur[i]
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
                mask, n_ids = _queue_push(bits, link, head, ids, last, mask, n_ids, j)
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
class Naps:
    """A receiving rank's naps (see the module docstring): the first and the longest, in seconds,
    and the share of half the nap in effect that a receipt waits (0: none)."""

    first: float
    longest: float
    share: float

    def __post_init__(self):
        for name in ("first", "longest", "share"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Naps: {name} must be a finite number >= 0, got {value!r}")
        if self.longest < self.first:
            raise ValueError(f"Naps: the longest nap ({self.longest}) is shorter than the first ({self.first})")


NO_NAPS = Naps(0.0, 0.0, 0.0)


@dataclass(frozen=True)
class Timing:
    """The simulated run of one graph: when each node ran, the iteration time (the last end) and
    each resource's busy seconds (summed when first asked for, from `parts`: the arguments of
    _busy; a search reads only the time)."""

    start: np.ndarray
    end: np.ndarray
    parts: tuple = field(repr=False, compare=False)

    @functools.cached_property
    def busy(self) -> np.ndarray:
        return _busy(*self.parts)

    @property
    def time(self) -> float:
        return float(self.end.max()) if self.end.size else 0.0

    def __repr__(self) -> str:
        return f"Timing({self.time * 1e3:.3f} ms over {self.end.size} nodes, {self.busy.size} resources)"


def schedule(res: np.ndarray, dur: np.ndarray, pred_ptr: np.ndarray, pred_idx: np.ndarray,
             num_resources: int, delay: np.ndarray | None = None, handling: Handling | None = None,
             naps: Naps = NO_NAPS) -> Timing:
    """Simulate the graph (see the module docstring); raises ValueError on a cycle or bad index."""
    pred_ptr = np.ascontiguousarray(pred_ptr, np.int64)
    pred_idx = np.ascontiguousarray(pred_idx, np.int64)
    n = np.shape(res)[0]
    if pred_ptr.shape != (n + 1,):
        raise ValueError(f"schedule: {n} resources and {pred_ptr.shape[0]} pred offsets (need n + 1)")
    if pred_idx.size and (pred_idx.min() < 0 or pred_idx.max() >= n):
        raise ValueError(f"schedule: predecessor indices must be in 0..{n - 1}")
    return schedule_successors(res, dur, Successors.of_preds(pred_ptr, pred_idx), num_resources, delay, handling,
                               naps)


def schedule_successors(res: np.ndarray, dur: np.ndarray, successors: Successors, num_resources: int,
                        delay: np.ndarray | None = None, handling: Handling | None = None,
                        naps: Naps = NO_NAPS) -> Timing:
    """`schedule` of a graph given by its Successors (what an assembled graph keeps: the search
    times one a proposal, and making them from pred lists was a third of the schedule). `naps`
    apply to nodes with a part after (`handling`)."""
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
    start, end, done, ok = _schedule(res, dur, delay, indeg, ptr, idx, num_resources, *parts,
                                     float(naps.first), float(naps.longest), float(naps.share))
    if (not ok or done != n) and not _well_formed(res, dur, delay, indeg, idx, num_resources):
        _refuse(res, dur, delay, indeg, idx, num_resources)
    if done != n:
        raise ValueError(f"schedule: the graph has a cycle: {n - done} of {n} nodes never became ready")
    return Timing(start, end, (num_resources, res, dur, *parts))


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
