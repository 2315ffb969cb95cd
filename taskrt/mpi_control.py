"""Control messages between ranks: small frozen values, pickled on the `ctl` communicator.

Each message names its sender (`src`) and carries named fields; a rank hands every message
it reads to one `Dispatch`, a table from message type to handler, which the transport
(taskrt/mpi.py) fills from the units that own each job. A table that misses a type, or a
message of a type it does not know (another version of taskrt on some rank), is an error
that names the type.

| message | sent by | handled by |
|---|---|---|
| Checkpoint | every rank at `wait()`, at a stalled wait, at shutdown | ReplicationCheck; the ShutdownBarrier |
| Get, Value | a rank that wants a task's value; the task's rank | RemoteValues (taskrt/mpi_futures.py) |
| Push | the rank of a task whose Future is an argument elsewhere | RemoteValues |
| Query, Launches | a rank that found a divergence; the peer it asks | Divergence (taskrt/mpi_divergence.py) |
| Release | rank 0, once every rank has shut down | the ShutdownBarrier |
| Alive | a busy rank, every HEARTBEAT_S | the Watchdog (any message counts as heard) |
| Exited | a rank whose program ends with its runtime open | the Watchdog |

No state: a Dispatch is built once and only read. No mpi4py here, so that the messages and
the table can be tested in a process that is not an MPI process.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True, slots=True)
class Message:
    """A control message from rank `src`. Pickled as its type and its fields in order."""

    src: int

    def __reduce__(self):
        return type(self), tuple(getattr(self, name) for name in self.__match_args__)


@dataclass(frozen=True, slots=True)
class Checkpoint(Message):
    """Rank `src` had made `count` launches with running hash `hash` at a checkpoint of
    kind `what` ('wait', 'stall' or 'shutdown')."""

    what: str
    count: int
    hash: int


@dataclass(frozen=True, slots=True)
class Get(Message):
    """Rank `src` asks for the values of the tasks `ids` (all run by the receiver), having made
    `count` launches with running hash `hash` (so that a receiver holding no such task can tell
    a divergence from a dropped Future)."""

    ids: tuple[int, ...]
    count: int
    hash: int


@dataclass(frozen=True, slots=True)
class Value(Message):
    """The answer to a Get for task `task`: its value, or with `ok` false why there is none."""

    task: int
    ok: bool
    value: object


@dataclass(frozen=True, slots=True)
class Push(Message):
    """The value of task `producer`, sent unasked for task `consumer` on the receiver."""

    producer: int
    consumer: int
    value: object


@dataclass(frozen=True, slots=True)
class Query(Message):
    """Rank `src` found a divergence and asks for the receiver's launches in [lo, hi)."""

    lo: int
    hi: int


@dataclass(frozen=True, slots=True)
class Launches(Message):
    """The answer to a Query: (first launch number, [(running hash, signature)])."""

    window: tuple[int, list]


@dataclass(frozen=True, slots=True)
class Release(Message):
    """Rank 0 has seen every rank shut down with the same launches: leave the barrier."""


@dataclass(frozen=True, slots=True)
class Alive(Message):
    """Rank `src` is busy computing: its peers' no-progress guards keep waiting."""


@dataclass(frozen=True, slots=True)
class Exited(Message):
    """Rank `src`'s program ended with its runtime open (never shut down): it answers nothing more."""


#: every control message type, each of which a Dispatch must handle
MESSAGES: tuple[type[Message], ...] = (Checkpoint, Get, Value, Push, Query, Launches, Release, Alive, Exited)


class UnknownControlMessage(TypeError):
    """A message whose type has no handler: the ranks do not run the same taskrt."""


class Dispatch:
    """Calls the handler of a message's type; built from a table that covers MESSAGES."""

    def __init__(self, handlers: dict[type, Callable[[Message], None]]):
        missing = [t.__name__ for t in MESSAGES if t not in handlers]
        extra = [getattr(t, "__name__", repr(t)) for t in handlers if t not in MESSAGES]
        if missing or extra:
            raise ValueError(f"a control Dispatch needs one handler per message type: missing {missing}, "
                             f"not messages {extra}")
        self.handlers = dict(handlers)

    def __call__(self, msg) -> None:
        handler = self.handlers.get(type(msg))
        if handler is None:
            text = repr(msg)
            text = text if len(text) <= 200 else text[:200] + "..."
            raise UnknownControlMessage(
                f"a control message of unknown type {type(msg).__qualname__}: {text} (known: "
                f"{', '.join(t.__name__ for t in MESSAGES)})")
        handler(msg)
