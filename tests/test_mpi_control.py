"""Control messages without MPI (taskrt/mpi_control.py): every message survives pickling,
reaches the handler of its type through a Dispatch, and anything else is refused by name.
Nothing here imports mpi4py."""
from __future__ import annotations

import dataclasses
import pickle

import pytest
from hypothesis import given, strategies as st

from taskrt.mpi_control import (MESSAGES, Alive, Checkpoint, Dispatch, Exited, Get, Launches, Message, Push,
                                Query, Release, UnknownControlMessage, Value)

SAMPLES = [
    Checkpoint(1, "shutdown", 12, 0xDEADBEEF),
    Get(2, (3, 5, 8), 12, 0xC0FFEE),
    Value(0, 5, True, {"loss": [0.5, 0.25]}),
    Value(0, 6, False, "rank 0 no longer holds its Future"),
    Push(3, 17, 21, (1.5, "x")),
    Query(1, 4, 9),
    Launches(0, (4, [(123, "'f' fn=m.f points=2"), (456, "'g' fn=m.g points=1")])),
    Release(0),
    Alive(2),
    Exited(1),
]

values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                      lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                      max_leaves=12)


def test_the_samples_cover_every_message_type_and_every_type_is_listed():
    assert {type(m) for m in SAMPLES} == set(MESSAGES)
    # by name: a slotted dataclass replaces its class, and the first one may linger as a subclass
    assert {c.__name__ for c in Message.__subclasses__()} == {t.__name__ for t in MESSAGES}


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_pickle(msg):
    for protocol in (2, pickle.HIGHEST_PROTOCOL):
        back = pickle.loads(pickle.dumps(msg, protocol))
        assert type(back) is type(msg) and back == msg, f"{msg!r} came back as {back!r}"


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_messages_are_frozen(msg):
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.src = 99


@given(st.integers(0, 1 << 20), st.integers(0, 1 << 40), st.integers(0, 1 << 40), values)
def test_pushed_and_answered_values_round_trip(src, producer, consumer, value):
    for msg in (Push(src, producer, consumer, value), Value(src, producer, bool(consumer & 1), value)):
        assert pickle.loads(pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)) == msg


def recording_dispatch() -> tuple[Dispatch, list]:
    seen = []
    return Dispatch({t: (lambda msg, t=t: seen.append((t, msg))) for t in MESSAGES}), seen


def test_each_message_goes_to_the_handler_of_its_type():
    dispatch, seen = recording_dispatch()
    for msg in SAMPLES:
        dispatch(pickle.loads(pickle.dumps(msg)))
    assert seen == [(type(m), m) for m in SAMPLES]


@pytest.mark.parametrize("unknown", [("check", 1, "wait", 3, 0), "alive", Message(1)],
                         ids=["old-tuple", "str", "base-class"])
def test_a_message_of_unknown_type_is_refused_naming_its_type(unknown):
    dispatch, seen = recording_dispatch()
    with pytest.raises(UnknownControlMessage) as err:
        dispatch(unknown)
    assert type(unknown).__qualname__ in str(err.value) and repr(unknown)[:20] in str(err.value)
    assert "Checkpoint" in str(err.value), "the error lists the known types"
    assert not seen


def test_a_dispatch_needs_a_handler_for_every_type_and_only_those():
    handlers = {t: (lambda msg: None) for t in MESSAGES}
    del handlers[Query]
    with pytest.raises(ValueError, match=r"missing \['Query'\]"):
        Dispatch(handlers)
    with pytest.raises(ValueError, match=r"not messages \['tuple'\]"):
        Dispatch({**{t: (lambda msg: None) for t in MESSAGES}, tuple: lambda msg: None})
