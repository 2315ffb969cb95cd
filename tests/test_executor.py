"""The executor alone: nodes run once their preds have finished; a Join runs nothing."""
from __future__ import annotations

import threading

import pytest

from hypothesis import given, settings, strategies as st

from taskrt.executor import Executor, Join, TaskError


class Step:
    """A node that records that it ran, after waiting for `gate` if it has one."""

    def __init__(self, node_id: int, log: list, gate: threading.Event | None = None):
        self.id = node_id
        self.where = "w0"
        self.log = log
        self.gate = gate


def run(node) -> None:
    if node.gate is not None:
        assert node.gate.wait(5), f"node {node.id}'s gate never opened"
    node.log.append(node.id)


def make_executor(hooked: list | None = None) -> Executor:
    hooks = [lambda node, start, end: hooked.append(node.id)] if hooked is not None else []
    return Executor(["w0"], run_task=run, run_copy=run, hooks=hooks)


def test_a_join_finishes_when_its_last_pred_does_and_orders_its_dependents():
    log, hooked = [], []
    ex = make_executor(hooked)
    gate = threading.Event()
    ex.submit(Step(1, log), [])
    ex.wait_node(1, timeout=5)
    ex.submit(Step(2, log, gate), [])
    ex.submit(Join(3), [1, 2])
    ex.submit(Step(4, log), [3])
    assert not ex.is_done(3), "the join finished before its blocked pred"
    gate.set()
    ex.wait_node(4, timeout=5)
    assert log == [1, 2, 4]
    assert 3 not in hooked, "a join runs nothing and is not traced"
    assert hooked == [1, 2, 4]
    ex.shutdown()


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 5000))
def test_a_long_chain_of_joins_finishes_without_recursion(length):
    """Joins readied by the finish of other joins finish in a loop, not recursively."""
    log = []
    ex = make_executor()
    gate = threading.Event()
    ex.submit(Step(0, log, gate), [])
    for i in range(1, length + 1):
        ex.submit(Join(i), [i - 1])
    ex.submit(Step(length + 1, log), [length])
    gate.set()
    ex.wait_all(timeout=10)
    assert log == [0, length + 1]
    ex.shutdown()


def test_a_join_of_finished_preds_finishes_at_once():
    log = []
    ex = make_executor()
    ex.submit(Step(0, log), [])
    ex.wait_node(0, timeout=5)
    ex.submit(Join(1), [0])
    assert ex.is_done(1)
    ex.wait_node(1, timeout=1)
    ex.shutdown()


class Post(Step):
    """An inline node (like a message's send): it runs in the thread that readies it."""

    inline = True


def test_inline_nodes_a_join_readies_run_in_the_order_they_were_submitted():
    """First come, first served, as the simulator times it: the sends a block's fence readies
    are posted in graph order (the first needed first), not last first."""
    log = []
    ex = make_executor()
    ex.inline_types = frozenset({Post})
    gate = threading.Event()
    ex.submit(Step(0, log, gate), [])
    ex.submit(Join(1), [0])
    for i in range(2, 12):
        ex.submit(Post(i, log), [1])
    gate.set()
    ex.wait_all(timeout=5)
    assert log == [0, *range(2, 12)]
    ex.shutdown()


class Touch(Step):
    """A node on worker `where` that touches `memories` (what the runtime tracks: its instances)."""

    def __init__(self, node_id: int, log: list, where: str, memories: tuple, gate: threading.Event | None = None):
        super().__init__(node_id, log, gate)
        self.where = where
        self.memories = memories


def _fired(log: list, name: str):
    return lambda: log.append(name)


def test_a_callback_for_one_thing_waits_only_for_the_nodes_below_it_that_touch_it():
    """Node 0 (memory m0) is held up; node 1 (m1) runs, node 2 (m1 to m0, a copy) waits for node 0.
    Below 2, m1's nodes are done at once; below 3 they wait for the copy, as m0's do for node 0,
    and a callback for every node for node 0 too."""
    log, fired = [], []
    ex = Executor(["w0", "w1"], run_task=run, run_copy=run)
    ex.track_touches(0, lambda node: node.memories)
    gate = threading.Event()
    ex.submit(Touch(0, log, "w0", ("m0",), gate), [])
    ex.submit(Touch(1, log, "w1", ("m1",)), [])
    ex.submit(Touch(2, log, "w1", ("m1", "m0")), [0])
    ex.wait_node(1, timeout=5)
    for threshold, memory in ((2, "m1"), (3, "m1"), (1, "m0"), (1, None)):
        ex.when_done_below(threshold, _fired(fired, f"{memory}<{threshold}"), memory)
    assert fired == ["m1<2"]
    gate.set()
    ex.wait_all(timeout=5)
    assert sorted(fired) == sorted(["m1<2", "m1<3", "m0<1", "None<1"])
    ex.shutdown()


def test_nodes_submitted_before_touches_are_tracked_hold_up_every_callback():
    """What ids below track_touches' start touch is not known: a callback for anything waits for
    all of them (node 0 touches m0 only, yet m1's callback waits for it)."""
    log, fired = [], []
    ex = Executor(["w0", "w1"], run_task=run, run_copy=run)
    gate = threading.Event()
    ex.submit(Touch(0, log, "w0", ("m0",), gate), [])
    ex.track_touches(1, lambda node: node.memories)
    ex.submit(Touch(1, log, "w1", ("m1",)), [])
    ex.wait_node(1, timeout=5)
    ex.when_done_below(2, _fired(fired, "m1"), "m1")
    assert fired == []
    gate.set()
    ex.wait_all(timeout=5)
    assert fired == ["m1"]
    ex.shutdown()


def test_a_callback_for_one_thing_before_touches_are_tracked_is_refused():
    ex = make_executor()
    with pytest.raises(RuntimeError, match=r"when_done_below\(\.\.\., touched=m0\) before track_touches"):
        ex.when_done_below(1, lambda: None, "m0")
    ex.shutdown()


class Fails(Step):
    """A node whose run raises."""

    @property
    def name(self) -> str:
        return f"fails{self.id}"


def run_or_fail(node) -> None:
    if isinstance(node, Fails):
        node.log.append(node.id)
        raise ValueError(f"node {node.id} failed")
    run(node)


def test_a_node_submitted_after_its_pred_was_lost_is_lost_too_and_the_first_failure_is_the_error():
    """A node whose pred failed before it was submitted ran all the same (its pred counted as
    finished), on the lost pred's missing results; and a second failure replaced the first as the
    error the waits raise."""
    log = []
    ex = Executor(["w0"], run_task=run_or_fail, run_copy=run_or_fail)
    ex.submit(Fails(1, log), [])
    with pytest.raises(TaskError, match="'fails1'"):
        ex.wait_node(1, timeout=5)
    ex.submit(Step(2, log), [1])
    ex.submit(Step(3, log), [2])
    ex.submit(Fails(4, log), [])   # (independent: it runs, and fails too)
    with pytest.raises(TaskError, match=r"'fails1' .* raised ValueError: node 1 failed"):
        ex.wait_all(timeout=5)
    assert log == [1, 4] and ex.forget_failure() == [1, 2, 3, 4]
    ex.shutdown()
