"""The timing core against a plain reference scheduler and hand-computed cases."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from strategies.timing import schedule


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
