"""Control replication over MPI: what one rank does with the task graph every rank builds.

Every rank runs the same program, so every rank makes the same launches and builds the
same graph with the same node ids. `submit(node, preds)` (from Runtime._emit) routes each
node (taskrt/mpi_routing.py): a local one goes to the executor, a copy that crosses this
rank's boundary becomes its send or receive half (taskrt/mpi_copies.py), and a remote one
is not run but stands for the local nodes it waits for. MPITransport is the composition of
one unit per job, each owning its state and its lock:

| job | unit | state, lock |
|---|---|---|
| routing nodes, frontiers, Joins | Router (mpi_routing) | main thread only |
| sends and receives of copies | Copies (mpi_copies) | none shared; the receive loop's own lock |
| requests in flight | Progress (mpi_progress) | its deque, lists, `count_lock` |
| task values across ranks | RemoteValues (mpi_futures) | `RemoteValues.cond` |
| control messages | Dispatch (mpi_control) | none: a table built once |
| checkpoints, divergence reports | Divergence (mpi_divergence) | `Divergence.replied` |
| the shutdown barrier | ShutdownBarrier (mpi_divergence) | `ShutdownBarrier.cond` |
| heartbeats, the no-progress guard | Watchdog (mpi_watchdog) | single-writer values, no lock |
| abort | Abort (mpi_watchdog) | `Abort.lock` |
| clock offsets | sync_clocks (mpi_clock) | a ClockSync, set once |

The transport itself keeps only these units and the three communicators it duplicates
from `world` in `bind` (`data` and `hdr` for copies, `ctl` for control messages) and
frees in `close`. The progress thread's turn (`_tick`) reads control messages, answers
value requests and lets the watchdog send heartbeats.

Failure: a task that raises prints its rank, name and traceback and calls Abort, which
ends every rank; so does an exception out of `with Runtime()` or an uncaught one. A wait
that sees no progress on this rank and no heartbeat from a busy peer for `timeout`
seconds (TASKRT_MPI_TIMEOUT, default 60; 0: never) aborts too, naming what it waited for.
A program that ends with the runtime open (never shut down) tells the peers at exit
(`at_exit`), so that one waiting for this rank aborts at once, naming it.
"""
from __future__ import annotations

import atexit
import time

from mpi4py import MPI

from . import mpi_native
from .executor import Join
from .mpi_clock import ClockSync, sync_clocks
from .mpi_control import (Alive, Checkpoint, Dispatch, Exited, Get, Launches, Push, Query, Release,
                          UnknownControlMessage, Value)
from .mpi_copies import COPY_IN_PROGRESS_BYTES, Copies, RecvHalf, SendHalf
from .mpi_divergence import Divergence, ShutdownBarrier
from .mpi_futures import RemoteValues
from .mpi_progress import SHARED_CORE_NAP_S, SHARED_CORE_SPIN_S, SPIN_NAP_S, SPIN_S, Op, Progress
from .mpi_routing import FRONTIER_MAX, Route, Router, route
from .mpi_watchdog import (ABORT_GRACE_S, DEFAULT_TIMEOUT_S, HEARTBEAT_S, STALL_S, Abort, Watchdog,
                           abort_on_uncaught_exceptions, checked_timeout, timeout_from_env)
from .replication import LaunchLog
from .taskgraph import TaskNode

__all__ = ["MPITransport", "connect", "SendHalf", "RecvHalf", "TAG_CTL", "CONTROL_PER_TURN", "FRONTIER_MAX",
           "COPY_IN_PROGRESS_BYTES", "STALL_S", "HEARTBEAT_S", "ABORT_GRACE_S", "DEFAULT_TIMEOUT_S"]

TAG_CTL = 1
#: control messages read in one turn of the progress thread at most
CONTROL_PER_TURN = 64
#: how long a rank that exits with its runtime open tries to tell its peers so
EXIT_SEND_S = 1.0


class MPITransport:
    """The runtime's link to the other ranks (see the module doc). Made before the Runtime,
    bound to it by `bind` (collective: duplicates the communicator, syncs clocks)."""

    def __init__(self, comm=None, timeout: float | None = None):
        timeout = timeout_from_env() if timeout is None else checked_timeout(timeout)
        self.world = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.world.rank
        self.size = self.world.size
        self.abort = Abort(self.world)
        self.router = Router(self.rank, self.size)
        self.log = LaunchLog()
        self.divergence = Divergence(self.rank, self.size, self.log, self._send_ctl, self.abort.fatal)
        self.watchdog = Watchdog(self.rank, self.size, timeout, self._send_ctl, lambda: self.checkpoint("stall"),
                                 self._progress_marks, self._working, self._waiting_for, self.abort.fatal)
        self.barrier = ShutdownBarrier(self.rank, self.size, self._send_ctl, self.watchdog.block)
        self.clock = ClockSync()

    def __repr__(self) -> str:
        return f"MPITransport(rank {self.rank} of {self.size})"

    @property
    def clock_offset_s(self) -> float:
        """This rank's perf_counter minus rank 0's, measured in `bind`."""
        return self.clock.offset_s

    # ---- start-up ----------------------------------------------------------------------------
    def bind(self, runtime) -> None:
        """Attach to the runtime (collective: every rank calls it while making its Runtime)."""
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError("taskrt needs MPI_THREAD_MULTIPLE (mpi4py.rc.thread_level = 'multiple' before "
                               f"importing mpi4py.MPI); this MPI gives level {MPI.Query_thread()}")
        rank, fatal = self.rank, self.abort.fatal
        self.executor = ex = runtime.executor
        self.host_memory = runtime.machine.host_memory(rank)
        self.data = self.world.Dup()
        self.hdr = self.world.Dup()
        self.ctl = self.world.Dup()
        self.clock = sync_clocks(self.ctl, runtime.tracer)
        # a blocking wait is MPICH polling: only where the node has a core for it does it wait long
        fits = runtime.machine.threads_fit_node(rank, extra_per_rank=1)
        self.progress = Progress(f"taskrt-mpi-r{rank}", self._tick, self._request_failed, fatal,
                                 spin_s=SPIN_S if fits else SHARED_CORE_SPIN_S,
                                 nap_s=SPIN_NAP_S if fits else SHARED_CORE_NAP_S)
        self.values = RemoteValues(rank, self.size, ex, self.progress, self._send_ctl, self.watchdog.block, self.log,
                                   self.divergence.found)
        self.dispatch = Dispatch({
            Checkpoint: self._on_checkpoint,
            Get: self.values.on_get,
            Value: self.values.on_value,
            Push: self.values.on_push,
            Query: self.divergence.on_query,
            Launches: self.divergence.on_launches,
            Release: self.barrier.on_release,
            Alive: self.watchdog.heard,
            Exited: self.watchdog.peer_exited,
        })
        ex.on_error = self.abort.task_failed
        ex.inline_types = frozenset({SendHalf, RecvHalf})
        # the receive loop spins only where the node has a core for it and for every worker
        self.copies = Copies(rank, ex, runtime.store, self.progress, self.hdr, self.data,
                             int(self.world.Get_attr(MPI.TAG_UB) or 32767), self.divergence.found, fatal,
                             native=mpi_native.available() is None,
                             spin=fits)
        self.progress.start()
        atexit.register(self.at_exit)

    # ---- launches and nodes (main thread) ------------------------------------------------------
    def on_launch(self, spec) -> None:
        self.divergence.on_launch(spec)

    def on_signatures(self, signatures) -> None:
        """Launches made again without specs (ReplayBlock.reissue), by their signatures."""
        self.divergence.on_signatures(signatures)

    def submit(self, node, preds) -> None:
        ex = self.executor
        local_preds = self.router.localize(preds, ex.unfinished)
        how = route(node, self.rank)
        if how is Route.LOCAL:
            if type(node) is TaskNode:
                self.values.submit_task(node, True, local_preds, self.host_memory)
            ex.submit(node, local_preds)
        elif how is Route.SEND:
            self.copies.send(node, self.router.next_send(node.dst.rank), self.log.hash, local_preds)
        elif how is Route.RECV:
            self.copies.receive(node, self.router.next_recv(node.src.rank), self.log.hash, local_preds)
        else:
            if type(node) is TaskNode and node.fn is not None:
                self.values.submit_task(node, False, local_preds, self.host_memory)
            join = self.router.stand_in(node.id, local_preds, ex.unfinished)
            if join is not None:
                ex.submit(Join(node.id), join)
        self.values.max_submitted = node.id

    def submit_rows(self, rows, routed, base: int, fence: int, make, tracer=None) -> None:
        """A reissued program block (ReplayBlock.reissue): this rank's rows as `routed`
        (mpi_routing.route_rows) says, row i's node made by make(i) with id base + i, handed to
        the executor in batches; remote rows get frontiers (Router.take_block)."""
        ex, router, log_hash = self.executor, self.router, self.log.hash
        fence_local = tuple(router.localize((fence,), ex.unfinished))
        sends, recvs = router.take_block(routed, base, fence_local, ex.unfinished)
        items = []
        for i, how, preds, waits_fence, seq in routed.submitted:
            wait = tuple([base + j for j in preds])
            if waits_fence:
                wait += fence_local
            if how is Route.JOIN:
                items.append((Join(base + i), wait))
                continue
            node = make(i)
            if how is Route.LOCAL:
                if type(node) is TaskNode and node.future is not None:
                    self.values.submit_task(node, True, [], self.host_memory)
                item = node
            elif how is Route.SEND:
                item = self.copies.send_half(node, sends[node.dst.rank] + seq, log_hash)
            else:
                item = self.copies.recv_half(node, recvs[node.src.rank] + seq, log_hash)
            if tracer is not None:
                inner, external = rows[i][1], rows[i][2]
                tracer.preds[node.id] = tuple([base + j for j in inner]) + ((fence,) if external else ())
            items.append((item, wait))
            if len(items) >= 256:
                ex.submit_many(items)
                items = []
        ex.submit_many(items)
        self.values.max_submitted = base + len(rows) - 1

    def is_done(self, node_id) -> bool:
        """Done as far as this rank can tell: a remote node is done once its local ancestors are."""
        return self.router.is_done(node_id, self.executor.unfinished)

    def fetch_future(self, future) -> None:
        self.values.fetch(future)

    def prefetch(self, futures) -> None:
        self.values.prefetch(futures)

    def checkpoint(self, kind: str) -> None:
        """Send (launch count, running hash) to the checkpoint peers (main thread)."""
        self.divergence.checkpoint(kind)

    def wait_local(self, wait_fn, timeout: float | None, what: str) -> None:
        """Run an executor wait under the watchdog's no-progress guard."""
        self.watchdog.wait_local(wait_fn, timeout, what)

    def abort_on_exception(self, exc_type, exc, tb) -> None:
        """The program raised on this rank inside `with Runtime()`: end every rank."""
        self.abort.program_raised(exc_type, exc, tb)

    # ---- control messages and the progress thread's turn ---------------------------------------
    def _send_ctl(self, dest: int, msg, op: Op | None = None) -> None:
        self.progress.post(op or Op(None, 0.0), self.ctl.isend(msg, dest, TAG_CTL))

    def _tick(self) -> bool:
        """Control messages, answers to value requests, heartbeats (progress thread)."""
        busy = self._read_control()
        if self.values.deferred and self.values.serve():
            busy = True
        now = time.monotonic()
        if self.watchdog.tick(now) and self.values.kept:
            self.values.expire(now)
        return busy

    def _read_control(self) -> bool:
        """Hand up to CONTROL_PER_TURN waiting control messages to their handlers."""
        read = False
        for _ in range(CONTROL_PER_TURN):
            msg = self.ctl.improbe(MPI.ANY_SOURCE, TAG_CTL)
            if msg is None:
                break
            read = True
            self.watchdog.heard()
            try:
                self.dispatch(msg.recv())
            except UnknownControlMessage as exc:
                self.abort.fatal(f"taskrt: rank {self.rank} got {exc}")
        return read

    def _on_checkpoint(self, msg: Checkpoint) -> None:
        self.divergence.on_checkpoint(msg)
        self.barrier.on_checkpoint(msg)

    def _request_failed(self, reqs, ops) -> None:
        self.copies.request_failed(reqs, ops)

    # ---- what the watchdog watches -------------------------------------------------------------
    def _progress_marks(self) -> tuple:
        return (self.progress.completions, len(self.executor.unfinished), len(self.values.values))

    def _working(self) -> bool:
        """Some node is unfinished that neither waits for its preds nor for a message."""
        ex = self.executor
        return len(ex.unfinished) - len(ex.waiting) > self.progress.in_flight + len(self.values.expected)

    def _waiting_for(self) -> list[str]:
        return self.copies.waiting_for() + self.values.waiting_for()

    # ---- shutting down -----------------------------------------------------------------------
    def close(self) -> None:
        """After this rank's work is done: final checkpoint, a barrier through rank 0 (which
        compares every rank's final launch count and hash), then stop (collective)."""
        atexit.unregister(self.at_exit)
        self.divergence.finish()
        self.barrier.wait(self.divergence.hold_if_diverged)
        self.divergence.hold_if_diverged()
        self.copies.stop()
        self.progress.stop()
        for c in (self.data, self.hdr, self.ctl):
            c.Free()

    def at_exit(self) -> None:
        """The program ends with this rank's runtime open: tell the peers, so that one waiting
        for this rank aborts at once, naming it (instead of after its no-progress timeout)."""
        if MPI.Is_finalized():
            return
        sends = [self.ctl.isend(Exited(self.rank), p, TAG_CTL) for p in range(self.size) if p != self.rank]
        deadline = time.monotonic() + EXIT_SEND_S
        while not MPI.Request.Testall(sends) and time.monotonic() < deadline:
            time.sleep(SPIN_NAP_S)


def connect(comm=None, *, cpus: int | None = None, gpus: int | None = None, separate_memories: bool = False,
            timeout: float | None = None):
    """(machine, transport) for a Runtime on every rank of `comm` (collective)."""
    from .machine import Machine
    transport = MPITransport(comm, timeout)
    machine = Machine.discover(transport.world, cpus, gpus, separate_memories)
    if transport.size > 1:
        abort_on_uncaught_exceptions(transport.world)
    return machine, transport
