"""Values of tasks across ranks: what `Future.get()` does for a task another rank ran.

A task's value stays on the rank that ran it. Two ways it travels (control messages,
pickled):

- pulled: `get()` on another rank sends Get(ids, with its launch count and hash) to the
  owner, whose progress thread answers Value(task, ok, value) once the task has finished
  (an owner that holds no Future of an id, and whose launches differ from the asker's at
  that count, reports the divergence instead). FutureMap.get asks for all
  its points in one message. The owner finds the Future through `local` (weak: the
  program holds it) or `kept`: when the owner itself gets one of its own values, every
  other rank of a replicated program will ask too, so it holds the value until size - 1
  requests came, or KEEP_S seconds;
- pushed: a Future passed as an argument to a task on another rank goes there without
  being asked: FutureSend (a node after the producer, on the owner) sends
  Push(producer, consumer, value); FutureRecv (a node before the consumer) waits for it.
  One message per consumer task, so both sides know from the graph alone what to expect.

State, under `RemoteValues.cond` (a Condition of its own, notified when a value arrives):
`values` (arrived, by id for pulled and (producer, consumer) for pushed ones), `requested`
(id -> owner), `expected` (FutureRecv nodes waiting), `kept`; `deferred` requests waiting
for their task (progress thread only).
"""
from __future__ import annotations

import threading
import time
import weakref

from .executor import PENDING
from .launch import Future
from .mpi_control import Get, Push, Value
from .mpi_progress import Op
from .taskgraph import TaskNode

#: how long a rank holds a value it got for peers that have not asked for it yet
KEEP_S = 30.0


class FutureSend:
    """Sends the value of a local task to the rank of the remote task `consumer`."""

    __slots__ = ("id", "future", "consumer", "peer", "where", "owner")
    kind = "future-send"
    op = ""
    nbytes = 0
    point = None

    def __init__(self, owner: "RemoteValues", future: Future, consumer: TaskNode, where):
        self.owner = owner
        self.id = f"fsend:{future.node_id}:{consumer.id}"
        self.future = future
        self.consumer = consumer
        self.peer = consumer.proc.rank
        self.where = where

    name = property(lambda self: f"future:{self.consumer.name}")
    src = property(lambda self: self.where)
    dst = property(lambda self: f"r{self.peer}")

    def run(self):
        return self.owner.push(self)


class FutureRecv:
    """Waits for the value of remote task `future.node_id`, pushed for local task `consumer`."""

    __slots__ = ("id", "key", "future", "consumer", "where", "start", "owner")
    kind = "future-recv"
    op = ""
    nbytes = 0
    point = None

    def __init__(self, owner: "RemoteValues", future: Future, consumer: TaskNode, where):
        self.owner = owner
        self.key = (future.node_id, consumer.id)
        self.id = f"frecv:{future.node_id}:{consumer.id}"
        self.future = future
        self.consumer = consumer
        self.where = where
        self.start = 0.0

    name = property(lambda self: f"future:{self.consumer.name}")
    src = property(lambda self: f"r{self.future.rank}")
    dst = property(lambda self: self.where)

    def run(self):
        return self.owner.take(self)


class RemoteValues:
    """The futures side of the transport (see the module doc). `send(dest, msg)` posts a
    control message; `block(cond, ready, what)` waits on `cond`, guarded, on the main thread."""

    def __init__(self, rank: int, size: int, executor, progress, send, block, log, diverged):
        self.rank = rank
        #: this rank's LaunchLog, and Divergence.found(peer, hi, how)
        self.log = log
        self.diverged = diverged
        self.size = size
        self.executor = executor
        self.progress = progress
        self.send = send
        self.block = block
        self.cond = threading.Condition()
        self.local: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self.values: dict = {}
        self.requested: dict[int, int] = {}
        self.expected: dict[tuple[int, int], FutureRecv] = {}
        self.kept: dict[int, list] = {}
        self.deferred: list[tuple[int, Get]] = []
        self.max_submitted = -1

    # ---- nodes (main thread at submit, workers at run) -------------------------------------
    def submit_task(self, node: TaskNode, local: bool, local_preds: list, memory) -> None:
        """Before `node` goes to the executor (local) or is remembered (remote): its Future
        may be asked for, and Futures among its args may have to travel."""
        ex = self.executor
        if local:
            if node.future is not None:
                self.local[node.id] = node.future
                for a in node.args:
                    if type(a) is Future and a.rank != self.rank:
                        recv = FutureRecv(self, a, node, memory)
                        ex.submit(recv, ())
                        local_preds.append(recv.id)
        else:
            for a in node.args:
                if type(a) is Future and a.rank == self.rank:
                    ex.submit(FutureSend(self, a, node, memory), (a.node_id,))

    def push(self, fs: FutureSend):
        msg = Push(self.rank, fs.future.node_id, fs.consumer.id, fs.future._value)
        self.send(fs.peer, msg, Op(fs, time.perf_counter(), done=lambda op: self.executor.complete(op.node, op.start)))
        return PENDING

    def take(self, fr: FutureRecv):
        with self.cond:
            if fr.key in self.values:
                fr.future._set(self.values.pop(fr.key))
                return None
            fr.start = time.perf_counter()
            self.expected[fr.key] = fr
        return PENDING

    def on_push(self, msg: Push) -> None:
        """A pushed value arrived (progress thread)."""
        key = (msg.producer, msg.consumer)
        with self.cond:
            fr = self.expected.pop(key, None)
            if fr is None:
                self.values[key] = msg.value
        if fr is not None:
            fr.future._set(msg.value)
            self.progress.completions += 1
            self.executor.complete(fr, fr.start)

    # ---- pulling (main thread) ----------------------------------------------------------------
    def prefetch(self, futures) -> None:
        """Ask the owners of remote futures for their values, one message per owner."""
        asks: dict[int, list[int]] = {}
        with self.cond:
            for f in futures:
                if not f._has_value and f.rank != self.rank and f.node_id is not None \
                        and f.node_id not in self.requested:
                    self.requested[f.node_id] = f.rank
                    asks.setdefault(f.rank, []).append(f.node_id)
        count, h = self.log.position()
        for owner, ids in asks.items():
            self.send(owner, Get(self.rank, tuple(ids), count, h))

    def fetch(self, future: Future) -> None:
        """After `get()` waited: bring a remote value here, or hold a local one for the others."""
        if future.rank == self.rank:
            if future._has_value:
                self.keep(future)
            return
        if future._has_value:
            return
        nid = future.node_id
        self.prefetch([future])
        self.block(self.cond, lambda: nid in self.values, f"the value of task #{nid} from rank {future.rank}")
        self._take_value(future)

    def arrived(self, future: Future) -> bool:
        """Future.done() for a remote task: ask for the value, say whether it is here."""
        self.prefetch([future])
        return self._take_value(future)

    def _take_value(self, future: Future) -> bool:
        """Set `future` from the answer to its request, if that has come (else False); an
        answer that the owner could not give raises here."""
        with self.cond:
            answer = self.values.pop(future.node_id, None)
            if answer is None:
                return False
            self.requested.pop(future.node_id, None)
        ok, value = answer
        if not ok:
            raise RuntimeError(value)
        future._set(value)
        return True

    def keep(self, future: Future) -> None:
        if self.size > 1 and future._replicated and future.node_id not in self.kept:
            with self.cond:
                self.kept[future.node_id] = [future, self.size - 1, time.monotonic() + KEEP_S]

    # ---- answering (progress thread) ---------------------------------------------------------
    def on_value(self, msg: Value) -> None:
        with self.cond:
            self.values[msg.task] = (msg.ok, msg.value)
            self.cond.notify_all()

    def on_get(self, msg: Get) -> None:
        self.deferred.extend((nid, msg) for nid in msg.ids)

    def serve(self) -> bool:
        """Answer the requests whose task has finished; True if any was answered."""
        keep, answered = [], False
        for nid, ask in self.deferred:
            who = ask.src
            if nid > self.max_submitted:
                keep.append((nid, ask))
                continue
            with self.cond:
                entry = self.kept.get(nid)
                if entry is not None:
                    entry[1] -= 1
                    if entry[1] <= 0:
                        del self.kept[nid]
            fut = entry[0] if entry is not None else self.local.get(nid)
            if fut is None and self.log.hash_at(ask.count) not in (None, ask.hash):
                # the ranks' launches differ, and so do their task numbers: report where they differ
                self.diverged(who, max(ask.count, self.log.count) + 1,
                              f"rank {who} asked for the value of task #{nid}, of which rank {self.rank} has no "
                              f"Future")
            elif fut is None:
                self.send(who, Value(self.rank, nid, False,
                                     f"rank {who} asked rank {self.rank} for the value of task #{nid}, but rank "
                                     f"{self.rank} no longer holds its Future (a program that drops a Future on "
                                     f"one rank and gets it on another is not replicated)"))
            elif fut._has_value:
                try:
                    self.send(who, Value(self.rank, nid, True, fut._value))
                except Exception as exc:
                    self.send(who, Value(self.rank, nid, False,
                                         f"the value of task #{nid} on rank {self.rank} cannot be sent to rank "
                                         f"{who}: {type(exc).__name__}: {exc}"))
            else:
                keep.append((nid, ask))
                continue
            answered = True
        self.deferred = keep
        return answered

    def expire(self, now: float) -> None:
        with self.cond:
            for nid in [n for n, e in self.kept.items() if e[2] < now]:
                del self.kept[nid]

    def waiting_for(self) -> list[str]:
        """What this rank waits for, for the stuck report."""
        with self.cond:
            out = [f"the value of task #{fr.future.node_id} from rank {fr.future.rank}" for fr in self.expected.values()]
            out += [f"the value of task #{nid} from rank {owner}" for nid, owner in self.requested.items()
                    if nid not in self.values]
        return out
