"""The timing core against a plain reference scheduler and hand-computed cases."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from strategies.timing import (Handling, Naps, Successors, _id_pop, _queue_push, _queue_refill, schedule,
                               schedule_successors, successor_lists)


def _csr(preds):
    ptr = np.zeros(len(preds) + 1, np.int64)
    ptr[1:] = np.cumsum([len(p) for p in preds])
    idx = np.array([q for p in preds for q in p], np.int64)
    return ptr, idx


def _reference(res, dur, preds, delay=None):
    """Pick, among nodes whose preds have all run, the one that became ready first (then the
    lowest index); it starts when it is ready and its resource is free, frees the resource
    after its duration and ends its delay later."""
    n = len(res)
    delay = delay or [0.0] * n
    start, end, left, free = [None] * n, [None] * n, set(range(n)), {}
    while left:
        ready = {i: max((end[p] for p in preds[i]), default=0.0) for i in left
                 if all(end[p] is not None for p in preds[i])}
        i = min(ready, key=lambda j: (ready[j], j))
        s = max(ready[i], free.get(res[i], 0.0)) if res[i] >= 0 else ready[i]
        start[i], end[i] = s, s + dur[i] + delay[i]
        if res[i] >= 0:
            free[res[i]] = s + dur[i]
        left.remove(i)
    return np.array(start), np.array(end)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.sampled_from([0.0, 0.0, 1e-9, 3e-6, 0.25, 1.0, 7.5]), st.integers(0, 30)),
                          st.none()), max_size=120))
def test_the_queue_gives_the_least_time_then_the_least_id(steps):
    """Puts (a time no earlier than the last one taken, plus a gap: often none, else of any size,
    id) and takes (None) in any mix: each take is the least pair waiting, as a sorted list says."""
    times = np.empty(31)
    bits, link, ids = times.view(np.int64), np.empty(31, np.int64), np.empty(31, np.int64)
    head = np.full(64, -1, np.int64)
    last, mask, n_ids, waiting, taken = np.int64(0), np.int64(0), 0, [], 0.0
    for step in steps:
        if step is None:
            if waiting:
                if n_ids == 0:
                    last, mask, n_ids = _queue_refill(bits, link, head, ids, mask)
                nid, n_ids = _id_pop(ids, n_ids)
                assert (times[nid], nid) == min(waiting)
                waiting.remove((times[nid], nid))
                taken = times[nid]
        elif all(step[1] != nid for _, nid in waiting):   # (an id waits once at a time)
            times[step[1]] = taken + step[0]
            mask, n_ids = _queue_push(bits, link, head, ids, last, mask, n_ids, step[1])
            waiting.append((times[step[1]], step[1]))
    assert n_ids + sum(1 for b in range(64) for _ in _bucket(head, link, b)) == len(waiting)


def _bucket(head, link, b):
    nid = head[b]
    while nid >= 0:
        yield nid
        nid = link[nid]


def test_a_chain_adds_up_and_one_resource_serializes():
    ptr, idx = _csr([[], [0], [1]])
    t = schedule(np.array([0, 1, 0]), np.array([1.0, 2.0, 3.0]), ptr, idx, 2)
    assert t.time == 6.0 and list(t.start) == [0.0, 1.0, 3.0]
    ptr, idx = _csr([[], [], []])
    t = schedule(np.array([0, 0, 1]), np.array([1.0, 2.0, 3.0]), ptr, idx, 2)
    assert list(t.end) == [1.0, 3.0, 3.0] and list(t.busy) == [3.0, 3.0]


def test_a_resource_takes_nodes_in_the_order_they_became_ready():
    # node 2 (ready at 1) and node 3 (ready at 0.5) both want resource 0 while node 0 holds it
    ptr, idx = _csr([[], [], [1], []])
    t = schedule(np.array([0, 1, 0, 0]), np.array([4.0, 1.0, 1.0, 1.0]), ptr, idx, 2)
    assert t.start[3] == 4.0 and t.start[2] == 5.0


def test_nodes_without_a_resource_take_no_turn():
    ptr, idx = _csr([[], [0], [0]])
    t = schedule(np.array([0, -1, 0]), np.array([1.0, 0.0, 1.0]), ptr, idx, 1)
    assert t.end[1] == 1.0 and t.time == 2.0


def test_bad_graphs_are_refused():
    ptr, idx = _csr([[1], [0]])
    with pytest.raises(ValueError, match="cycle: 2 of 2 nodes never became ready"):
        schedule(np.array([0, 0]), np.array([1.0, 1.0]), ptr, idx, 1)
    ptr, idx = _csr([[]])
    with pytest.raises(ValueError, match="resource ids must be in -1..0"):
        schedule(np.array([3]), np.array([1.0]), ptr, idx, 1)


def test_a_latency_is_in_flight_the_link_sends_the_next_copy_meanwhile():
    # two copies on one link (1 s of bytes each, 5 s of latency), each feeding a task on its own processor
    ptr, idx = _csr([[], [], [0], [1]])
    t = schedule(np.array([0, 0, 1, 2]), np.array([1.0, 1.0, 1.0, 1.0]), ptr, idx, 3, np.array([5.0, 5.0, 0.0, 0.0]))
    np.testing.assert_array_equal(t.start, [0.0, 1.0, 6.0, 7.0])
    np.testing.assert_array_equal(t.end, [6.0, 7.0, 7.0, 8.0])
    assert t.busy.tolist() == [2.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="negative duration or delay at node 1"):
        schedule(np.array([0, 0]), np.array([1.0, 1.0]), *_csr([[], []]), 1, np.array([0.0, -1.0]))


@st.composite
def graphs(draw):
    n = draw(st.integers(1, 30))
    resources = draw(st.integers(1, 4))
    res = [draw(st.integers(-1, resources - 1)) for _ in range(n)]
    dur = [draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0])) for _ in range(n)]
    preds = [sorted(draw(st.sets(st.integers(0, i - 1), max_size=3))) if i else [] for i in range(n)]
    delay = [draw(st.sampled_from([0.0, 0.0, 0.25, 1.5])) for _ in range(n)]
    return res, dur, preds, resources, delay


@settings(max_examples=200, deadline=None)
@given(graphs())
def test_schedule_equals_the_reference(g):
    res, dur, preds, resources, delay = g
    ptr, idx = _csr(preds)
    t = schedule(np.array(res), np.array(dur), ptr, idx, resources, np.array(delay))
    want_start, want_end = _reference(res, dur, preds, delay)
    np.testing.assert_array_equal(t.start, want_start)
    np.testing.assert_array_equal(t.end, want_end)


@settings(max_examples=100, deadline=None)
@given(graphs(), st.randoms(use_true_random=False))
def test_successor_lists_in_any_order_and_with_repeated_edges_time_alike(g, rnd):
    res, dur, preds, resources, delay = g
    edges = [(p, i) for i, ps in enumerate(preds) for p in ps]
    edges += [rnd.choice(edges) for _ in range(len(edges) // 2)] if edges else []
    rnd.shuffle(edges)
    n = len(res)
    succs = [[d for s, d in edges if s == i] for i in range(n)]
    ptr, idx = _csr(succs)
    indegree = np.bincount([d for _, d in edges], minlength=n).astype(np.int64)
    t = schedule_successors(np.array(res), np.array(dur), Successors(indegree, ptr, idx), resources, np.array(delay))
    want_start, want_end = _reference(res, dur, preds, delay)
    np.testing.assert_array_equal(t.start, want_start)
    np.testing.assert_array_equal(t.end, want_end)
    made = Successors.of_preds(*_csr(preds))
    np.testing.assert_array_equal(made.indegree, [len(p) for p in preds])
    assert sorted(zip(np.repeat(np.arange(n), np.diff(made.ptr)).tolist(), made.idx.tolist())) == sorted(set(edges))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=40))),
    st.sampled_from(["as drawn", "by destination", "by source"]), st.sampled_from([np.int32, np.int64]))
def test_successor_lists_are_a_stable_counting_sort_by_source(g, arrangement, dtype):
    # runs of one destination or one source (as an assembled graph's edges come) and none alike
    n, edges = g
    if arrangement != "as drawn":
        edges = sorted(edges, key=lambda e: e[0 if arrangement == "by destination" else 1])
    dst = np.array([d for d, _ in edges], dtype)
    src = np.array([s for _, s in edges], dtype)
    indeg, ptr, idx = successor_lists(dst, src, n)
    assert indeg.dtype == ptr.dtype == idx.dtype == dtype
    np.testing.assert_array_equal(indeg, np.bincount(dst, minlength=n))
    np.testing.assert_array_equal(ptr, np.concatenate([[0], np.cumsum(np.bincount(src, minlength=n))]))
    np.testing.assert_array_equal(idx, dst[np.argsort(src, kind="stable")])


def test_bad_successor_arrays_are_refused_by_name():
    ok = Successors(np.array([0, 1]), np.array([0, 1, 1]), np.array([1]))
    schedule_successors(np.array([0, 0]), np.array([1.0, 1.0]), ok, 1)
    with pytest.raises(ValueError, match="successor indices must be in 0..1"):
        schedule_successors(np.array([0, 0]), np.array([1.0, 1.0]),
                            Successors(np.array([0, 1]), np.array([0, 1, 1]), np.array([2])), 1)
    with pytest.raises(ValueError, match="add up to the 1 successor entries, got 2"):
        schedule_successors(np.array([0, 0]), np.array([1.0, 1.0]),
                            Successors(np.array([1, 1]), np.array([0, 1, 1]), np.array([1])), 1)
    with pytest.raises(ValueError, match="2 indegrees and 2 successor offsets"):
        schedule_successors(np.array([0, 0]), np.array([1.0, 1.0]),
                            Successors(np.array([0, 1]), np.array([0, 1]), np.array([1])), 1)


def test_a_receipt_waits_half_the_nap_in_effect_at_its_receivers_quiet_time():
    """Copy 1 arrives 1.5 ms after the start at a receiver quiet since then: naps of 0.1, 0.2, 0.4,
    0.8 ms have passed and a 1 ms one is on (capped), so it waits 0.5 ms (share 1) before its
    10 us receipt. Copy 3 arrives 0.16 ms after that wait ended, in the second nap (0.2 ms): it
    waits 0.1 ms, its receipt shared beside task 2 as any part after is."""
    res, dur = np.array([0, 2, 1, 2]), np.array([1e-3, 0.0, 1e-3, 0.0])
    delay = np.array([0.0, 0.5e-3, 0.0, 0.15e-3])
    ptr, idx = _csr([[], [0], [1], [1]])
    handling = Handling(np.full(4, -1), np.zeros(4), np.array([-1, 1, -1, 1]), np.array([0.0, 1e-5, 0.0, 1e-5]))
    naps = Naps(1e-4, 1e-3, 1.0)
    t = schedule(res, dur, ptr, idx, 3, delay, handling, naps)
    np.testing.assert_allclose(t.end, [1e-3, 2.01e-3, 3.01e-3, 2.27e-3], rtol=0, atol=1e-12)
    assert t.time == pytest.approx(3.01e-3, abs=1e-12)
    np.testing.assert_allclose(t.busy, [1e-3, 1.02e-3, 0.0], atol=1e-12)   # a wait holds nothing
    half = schedule(res, dur, ptr, idx, 3, delay, handling, Naps(1e-4, 1e-3, 0.5))
    assert half.end[1] == pytest.approx(1.5e-3 + 0.25e-3 + 1e-5, abs=1e-12)
    plain = schedule(res, dur, ptr, idx, 3, delay, handling)
    for none in (Naps(1e-4, 1e-3, 0.0), Naps(0.0, 0.0, 1.0)):
        np.testing.assert_array_equal(schedule(res, dur, ptr, idx, 3, delay, handling, none).end, plain.end)
    np.testing.assert_allclose(plain.end, [1e-3, 1.51e-3, 2.51e-3, 1.67e-3], atol=1e-12)
    with pytest.raises(ValueError, match="Naps: the longest nap"):
        Naps(1e-3, 1e-4, 1.0)
    with pytest.raises(ValueError, match="Naps: share must be a finite number >= 0, got -1"):
        Naps(1e-4, 1e-3, -1)


def _reference_with_handling(res, dur, preds, delay, pre, post):
    """_reference where node i may first hold pre[i] = (resource, seconds) and last post[i]: every
    part is an item of its own, picked by (time it became ready, code), code i for a node's
    first part, n + i for its own resource after a part before, 2n + i for its part after. A
    part before or after starts when it is ready and makes its resource's work end that much
    later."""
    n = len(res)
    start, end, free = [None] * n, [None] * n, {}
    items = {}   # code -> ready time, for items whose turn can come

    def take(r, t, seconds):
        s = max(t, free.get(r, 0.0)) if r >= 0 else t
        if r >= 0:
            free[r] = s + seconds
        return s

    def share(r, t, seconds):
        if r >= 0:
            free[r] = max(t, free.get(r, 0.0)) + seconds
        return t

    left = set(range(n))
    while left or items:
        for i in list(left):
            if all(end[p] is not None for p in preds[i]):
                items[i] = max((end[p] for p in preds[i]), default=0.0)
                left.remove(i)
        code = min(items, key=lambda c: (items[c], c))
        t = items.pop(code)
        i, step = code % n, code // n
        if step == 0 and pre[i][0] >= 0:
            items[n + i] = share(pre[i][0], t, pre[i][1]) + pre[i][1]
        elif step < 2:
            start[i] = take(res[i], t, dur[i])
            e = start[i] + dur[i] + delay[i]
            if post[i][0] >= 0:
                items[2 * n + i] = e
            else:
                end[i] = e
        else:
            end[i] = share(post[i][0], t, post[i][1]) + post[i][1]
    return np.array(start), np.array(end)


@st.composite
def handled_graphs(draw):
    res, dur, preds, resources, delay = draw(graphs())
    part = st.tuples(st.integers(-1, resources - 1), st.sampled_from([0.0, 0.25, 0.75, 2.0]))
    pre = [draw(part) for _ in res]
    post = [draw(part) for _ in res]
    return res, dur, preds, resources, delay, pre, post


@settings(max_examples=200, deadline=None)
@given(handled_graphs())
def test_handling_parts_share_their_resources_as_the_reference_says(g):
    res, dur, preds, resources, delay, pre, post = g
    ptr, idx = _csr(preds)
    handling = Handling(np.array([r for r, _ in pre]), np.array([d for _, d in pre]),
                        np.array([r for r, _ in post]), np.array([d for _, d in post]))
    t = schedule(np.array(res), np.array(dur), ptr, idx, resources, np.array(delay), handling)
    want_start, want_end = _reference_with_handling(res, dur, preds, delay, pre, post)
    np.testing.assert_array_equal(t.start, want_start)
    np.testing.assert_array_equal(t.end, want_end)
    busy = np.zeros(resources)
    for r, d in [*zip(res, dur), *pre, *post]:
        if r >= 0:
            busy[r] += d
    np.testing.assert_allclose(t.busy, busy)


def test_a_copy_between_ranks_shares_both_processors():
    # node 0 a task on processor 0; node 1 a copy on link 2 that processor 0 sends (1 s) and
    # processor 1 receives (2 s); node 2 a task on processor 1 after it; node 3 a task on
    # processor 1 ready at 0, running when the message arrives
    ptr, idx = _csr([[], [0], [1], []])
    handling = Handling(np.array([-1, 0, -1, -1]), np.array([0.0, 1.0, 0.0, 0.0]),
                        np.array([-1, 1, -1, -1]), np.array([0.0, 2.0, 0.0, 0.0]))
    t = schedule(np.array([0, 2, 1, 1]), np.array([1.0, 0.5, 1.0, 3.0]), ptr, idx, 3,
                 np.array([0.0, 0.25, 0.0, 0.0]), handling)
    # send 1-2, wire 2-2.5, latency to 2.75, receive 2.75-4.75 beside node 3 (0-3), which
    # keeps its end but leaves processor 1 free at 3 + 2 = 5 rather than 3: node 2 5-6
    assert list(t.start) == [0.0, 2.0, 5.0, 0.0] and list(t.end) == [1.0, 4.75, 6.0, 3.0]
    assert list(t.busy) == [2.0, 6.0, 0.5]


def test_bad_handling_is_refused():
    ptr, idx = _csr([[], []])
    with pytest.raises(ValueError, match="handling.post_res"):
        schedule(np.array([0, 0]), np.array([1.0, 1.0]), ptr, idx, 1, None,
                 Handling(np.array([-1, -1]), np.zeros(2), np.array([-1, 5]), np.zeros(2)))
    with pytest.raises(ValueError, match="handling.pre_dur has shape"):
        schedule(np.array([0, 0]), np.array([1.0, 1.0]), ptr, idx, 1, None,
                 Handling(np.array([-1, -1]), np.zeros(3), np.array([-1, -1]), np.zeros(2)))


@settings(max_examples=200, deadline=None)
@given(handled_graphs(), st.integers(3, 8))
def test_dropping_edges_that_two_others_imply_changes_no_time(g, width):
    """u -> v goes where u -> w -> v stays (what the search's graphs leave out: RegionResult.timed):
    v ends no earlier than w, which ends no earlier than u, and v still waits for w."""
    res, dur, preds, resources, delay, pre, post = g
    assume(len(res) >= 3)   # then node 2 waits for 0 and 1, and 1 for 0
    rng = np.random.default_rng(len(res) * width)
    preds = [sorted(set(p) | set(rng.choice(i, size=min(i, width), replace=False).tolist())) if i else []
             for i, p in enumerate(preds)]
    kept = [[u for u in p if not any(u in preds[w] for w in p)] for p in preds]
    assert sum(map(len, kept)) < sum(map(len, preds)), "no edge implied: the test tests nothing"
    handling = Handling(np.array([r for r, _ in pre]), np.array([d for _, d in pre]),
                        np.array([r for r, _ in post]), np.array([d for _, d in post]))
    full, reduced = (schedule(np.array(res), np.array(dur), *_csr(p), resources, np.array(delay), handling)
                     for p in (preds, kept))
    np.testing.assert_array_equal(full.start, reduced.start)
    np.testing.assert_array_equal(full.end, reduced.end)
