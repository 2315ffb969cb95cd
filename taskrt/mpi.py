"""Control replication over MPI: what one rank does with the task graph every rank builds.

Every rank runs the same program, so every rank makes the same launches and builds the
same graph with the same node ids. `submit(node, preds)` (from Runtime._emit) decides
what this rank does with each node:

- a local node (a task on one of this rank's processors, a copy between its memories)
  goes to the executor;
- a copy or fold from here to another rank becomes a SendHalf, one from another rank to
  here a RecvHalf: executor nodes with the copy's id, so whatever waits for the copy here
  waits for its half. A fold's reduction buffer travels and is folded on the dst rank;
- a remote node is not run, but may carry ordering that local nodes need: a local writer
  W may reach a local send only through a remote reader R (W -WAR-> R -> copy). So a pred
  is replaced by its local frontier: a local pred stays; a remote pred stands for the
  local nodes it waits for through remote nodes (`frontier`), so W waits for the send.
  A remote node that stands for many local nodes becomes one executor Join node (a merged
  event), so that frontiers stay small however far the program runs ahead.
  A fence (a task that runs nothing) is remote on every rank.

Messages. Copies between ranks a -> b are numbered in graph order on both sides
(`sends_to[b]` on a, `recvs_from[a]` on b); the tag is that number modulo TAG_UB. A copy
is two messages with that tag: a 4-int header on `hdr` (copy id, launch number, running
launch hash, bytes), checked on receipt (taskrt/replication.py), and the payload on
`data`, sent from the instance itself when the rect is contiguous (else from a packed
copy) and received in place when it can be. A half posts its requests from whichever
thread makes it ready and returns PENDING. A large receive is posted and tested by a
compiled loop that holds no GIL (taskrt/mpi_native.py), which makes MPI's copy while
the workers run Python; where that loop cannot run, by the progress thread. (Sends stay
with the progress thread: through the loop they measured slower, 16 cores or 2.) A small
message that has already ended (an eager one) finishes at once, the others through the
progress engine (taskrt/mpi_progress.py), whose thread waits inside MPI while receives
are in flight.
Future values travel as control messages (taskrt/mpi_futures.py).

Control messages (pickled, on `ctl`, one tag): checkpoints, value requests and values,
pushed arguments, log queries for divergence reports, heartbeats, the shutdown release.

Failure: a task that raises prints its rank, name and traceback and calls Abort, which
ends every rank; so does an exception out of `with Runtime()` or an uncaught one. A wait
that sees no progress on this rank and no heartbeat from a busy peer for `timeout`
seconds (TASKRT_MPI_TIMEOUT, default 60; 0: never) aborts too, naming what it waited for.

Run state (main thread): `frontier` (remote id -> unfinished local ids), `sends_to` and
`recvs_from`; the LaunchLog and ReplicationCheck; `progress` and `values` keep their own.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import traceback

import numpy as np
from mpi4py import MPI

from .backends import gpu
from .executor import PENDING, Join
from . import mpi_native
from .mpi_futures import RemoteValues
from .mpi_native import NativeReceives
from .mpi_progress import Op, Progress, wait_request
from .replication import LaunchLog, ReplicationCheck, launch_signature
from .taskgraph import TaskNode

TAG_CTL = 1
#: a wait that has blocked this long sends a checkpoint (so a stuck rank is compared)
STALL_S = 0.25
#: a busy rank tells its peers so this often (so that their no-progress guard waits)
HEARTBEAT_S = 2.0
#: between printing a fatal error and MPI_Abort, so that mpiexec forwards the message
ABORT_GRACE_S = 0.2
DEFAULT_TIMEOUT_S = 60.0
#: a receive at least this large goes to the receive loop (or, without it, the progress
#: thread): MPI makes its copy (CMA reads it from the sender) inside the receiver's calls,
#: posting included, and a worker that made it would hold up its tasks for the whole copy
COPY_IN_PROGRESS_BYTES = 64 * 1024
#: a remote node standing for more unfinished local nodes than this becomes a Join
FRONTIER_MAX = 4


class _Half:
    """One rank's half of a copy between ranks: an executor node with the copy's id.
    `inline`: cheap enough to post from whichever thread makes it ready; `pending` holds
    the Op of a receive whose data must still be unpacked or folded on its worker."""

    __slots__ = ("id", "copy", "where", "peer", "tag", "check", "transport", "inline", "pending")
    point = None

    def __init__(self, transport, copy, where, peer: int, tag: int, check: tuple[int, int], inline: bool):
        self.transport = transport
        self.id = copy.id
        self.copy = copy
        self.where = where
        self.peer = peer
        self.tag = tag
        self.check = check
        self.inline = inline
        self.pending = None

    name = property(lambda self: self.copy.name)
    op = property(lambda self: self.copy.op)
    src = property(lambda self: self.copy.src)
    dst = property(lambda self: self.copy.dst)
    nbytes = property(lambda self: self.copy.nbytes)
    proc = property(lambda self: self.where)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.copy!r}, tag {self.tag})"


class SendHalf(_Half):
    kind = "send"

    def run(self):
        return self.transport.post_send(self)


class RecvHalf(_Half):
    kind = "recv"

    def run(self):
        if self.pending is None:
            return self.transport.post_recv(self)
        return self.transport.unpack_recv(self)


class MPITransport:
    """The runtime's link to the other ranks (see the module doc). Made before the Runtime,
    bound to it by `bind` (collective: duplicates the communicator, syncs clocks)."""

    def __init__(self, comm=None, timeout: float | None = None):
        self.world = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.world.rank
        self.size = self.world.size
        if timeout is None:
            timeout = float(os.environ.get("TASKRT_MPI_TIMEOUT", DEFAULT_TIMEOUT_S))
        self.timeout = timeout
        self.rt = None
        self.executor = None
        self.store = None
        self.frontier: dict[int, set] = {}
        self._remembered = 0
        self._sweep_at = 4096
        self.sends_to = [0] * self.size
        self.recvs_from = [0] * self.size
        self.progress = Progress(f"taskrt-mpi-r{self.rank}", self._tick, self._request_failed, self._fatal)
        self.values: RemoteValues | None = None
        self.vlock = threading.Condition()
        self.last_heard = time.monotonic()
        self._next_beat = 0.0
        self.main_waiting = False
        self.log = LaunchLog()
        self.check = ReplicationCheck(self.log, self.rank, self.size, self._diverged)
        self._last_checkpoint = -1
        self._shutdown_from: set[int] = set()
        self._released = False
        self._replies: dict[int, tuple] = {}
        self._reporting = False
        self._dying = False
        self.clock_offset_s = 0.0
        self.clock_rtt_s = 0.0

    def __repr__(self) -> str:
        return f"MPITransport(rank {self.rank} of {self.size})"

    # ---- start-up ----------------------------------------------------------------------------
    def bind(self, runtime) -> None:
        """Attach to the runtime (collective: every rank calls it while making its Runtime)."""
        if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            raise RuntimeError("taskrt needs MPI_THREAD_MULTIPLE (mpi4py.rc.thread_level = 'multiple' before "
                               f"importing mpi4py.MPI); this MPI gives level {MPI.Query_thread()}")
        self.rt = runtime
        self.executor = runtime.executor
        self.store = runtime.store
        self.data = self.world.Dup()
        self.hdr = self.world.Dup()
        self.ctl = self.world.Dup()
        self.tag_ub = int(self.world.Get_attr(MPI.TAG_UB) or 32767)
        self._sync_clocks(runtime.tracer)
        self.values = RemoteValues(self.rank, self.size, self.executor, self.progress, self._send_ctl, self._block,
                                   self.vlock)
        self.executor.on_error = self._task_failed
        self.executor.inline_types = frozenset({SendHalf, RecvHalf})
        # the receive loop spins only where the node has a core for it and for every worker
        self.native = None if mpi_native.available() else NativeReceives(
            f"taskrt-mpi-r{self.rank}", self.hdr, self.data, self.progress.finish, self._op_failed, self._fatal,
            spin=runtime.machine.threads_fit_node(self.rank, extra_per_rank=1))
        self.progress.start()

    def _sync_clocks(self, tracer, rounds: int = 8) -> None:
        """Offset of this rank's perf_counter against rank 0's: ping-pongs, minimum round trip kept."""
        comm, clock = self.ctl, time.perf_counter
        msg = np.zeros(3)
        if self.rank == 0:
            origin0 = tracer.origin if tracer is not None else 0.0
            for r in range(1, self.size):
                best = (float("inf"), 0.0)
                for _ in range(rounds):
                    t0 = clock()
                    wait_request(comm.Isend(msg, r, 7))
                    wait_request(comm.Irecv(msg, r, 7))
                    t1 = clock()
                    if t1 - t0 < best[0]:
                        best = (t1 - t0, msg[0] - (t0 + t1) / 2)
                wait_request(comm.Isend(np.array([best[1], best[0], origin0]), r, 8))
        else:
            for _ in range(rounds):
                wait_request(comm.Irecv(msg, 0, 7))
                msg[0] = clock()
                wait_request(comm.Isend(msg, 0, 7))
            wait_request(comm.Irecv(msg, 0, 8))
            self.clock_offset_s, self.clock_rtt_s, origin0 = float(msg[0]), float(msg[1]), float(msg[2])
            if tracer is not None:
                # an event at perf_counter t here is at t - offset on rank 0's clock
                tracer.clock_offset = (tracer.origin - self.clock_offset_s - origin0) * 1e6
        if tracer is not None:
            tracer.meta.update({"num_ranks": self.size, "clock_sync": {
                "reference_rank": 0, "offset_us": round(self.clock_offset_s * 1e6, 3),
                "min_rtt_us": round(self.clock_rtt_s * 1e6, 3), "rounds": rounds}})

    # ---- launches and nodes (main thread) ------------------------------------------------------
    def on_launch(self, spec) -> None:
        self.log.add(launch_signature(spec))
        if self.log.count >= self.check.next_check:
            self.check.reached()

    def submit(self, node, preds) -> None:
        me = self.rank
        ex = self.executor
        local_preds = self._localize(preds)
        if type(node) is TaskNode:
            if node.fn is None:
                # a fence runs nothing: on every rank it only stands for its local preds
                self._remember(node.id, local_preds)
            elif node.proc.rank == me:
                self.values.submit_task(node, True, local_preds, self.host_memory)
                ex.submit(node, local_preds)
            else:
                self.values.submit_task(node, False, local_preds, self.host_memory)
                self._remember(node.id, local_preds)
        else:
            src, dst = node.src.rank, node.dst.rank
            if src == dst:
                if dst == me:
                    ex.submit(node, local_preds)
                else:
                    self._remember(node.id, local_preds)
            elif src == me:
                seq = self.sends_to[dst]
                self.sends_to[dst] = seq + 1
                cheap = node.src.kind == "sys" and (node.redop is not None or
                                                    _contiguous(node.rect, node.region.shape))
                ex.submit(SendHalf(self, node, node.src, dst, seq % self.tag_ub, (node.launch, self.log.hash),
                                   cheap), local_preds)
            elif dst == me:
                seq = self.recvs_from[src]
                self.recvs_from[src] = seq + 1
                ex.submit(RecvHalf(self, node, node.dst, src, seq % self.tag_ub, (node.launch, self.log.hash),
                                   True), local_preds)
            else:
                self._remember(node.id, local_preds)
        self.values.max_submitted = node.id

    @property
    def host_memory(self):
        return self.rt.machine.host_memory(self.rank)

    def _localize(self, preds) -> list:
        """Local preds stay; a remote pred becomes the local nodes it still waits for."""
        unfinished = self.executor.unfinished
        frontier = self.frontier
        out = []
        for p in preds:
            if p in unfinished:
                out.append(p)
            else:
                f = frontier.get(p)
                if f is not None:
                    out.extend(f)
        return out

    def _remember(self, node_id: int, local_preds: list) -> None:
        """Note the unfinished local nodes a remote node waits for. More than FRONTIER_MAX
        become one Join with the remote node's id: a chain of remote nodes issued ahead of
        the run would otherwise carry every frontier before it into the next (a frontier
        growing with the program, and quadratic work)."""
        if not local_preds:
            return
        unfinished = self.executor.unfinished
        live = {p for p in local_preds if p in unfinished}
        if len(live) > FRONTIER_MAX:
            self.executor.submit(Join(node_id), live)
        elif live:
            self.frontier[node_id] = live
            self._remembered += 1
            if self._remembered >= self._sweep_at:
                self._sweep()

    def _sweep(self) -> None:
        """Forget remote nodes whose local ancestors have all finished."""
        unfinished = self.executor.unfinished
        for nid, f in list(self.frontier.items()):
            live = {p for p in f if p in unfinished}
            if live:
                self.frontier[nid] = live
            else:
                del self.frontier[nid]
        self._remembered = 0
        self._sweep_at = max(4096, 2 * len(self.frontier))

    def is_done(self, node_id) -> bool:
        """Done as far as this rank can tell: a remote node is done once its local ancestors are."""
        unfinished = self.executor.unfinished
        if node_id in unfinished:
            return False
        f = self.frontier.get(node_id)
        if f is None:
            return True
        if any(p in unfinished for p in f):
            return False
        self.frontier.pop(node_id, None)
        return True

    # ---- copies between ranks (workers post; the progress thread or receive loop completes) --
    def post_send(self, half: SendHalf):
        start = time.perf_counter()
        node = half.copy
        if node.redop is None:
            data = self.store.instance(node.region, node.src)[node.rect.slices()]
        else:
            data = self.store.take_buffer(node.buffer, node.rect)
        data = _host_contiguous(data)
        header = np.array([node.id, half.check[0], half.check[1], data.nbytes], np.int64)
        requests = (self.hdr.Isend([header, MPI.INT64_T], half.peer, half.tag),
                    self.data.Isend([data, MPI.BYTE], half.peer, half.tag))
        if MPI.Request.Testall(requests):
            return None  # sent eagerly: done in this thread, the progress engine never sees it
        self.progress.post(Op(half, start, (header, data), self._sent), *requests)
        return PENDING

    def _sent(self, op: Op) -> None:
        self.executor.complete(op.node, op.start)

    def post_recv(self, half: RecvHalf):
        start = time.perf_counter()
        node = half.copy
        target = None
        if node.redop is None and node.dst.kind == "sys":
            view = self.store.instance(node.region, node.dst)[node.rect.slices()]
            if view.flags.c_contiguous:
                target = view
        in_place = target is not None
        if target is None:
            target = np.empty(node.rect.shape, node.region.dtype)
        header = np.zeros(4, np.int64)
        op = Op(half, start, (header, target, in_place), self._received, receives=True)

        def post():
            return (self.hdr.Irecv([header, MPI.INT64_T], half.peer, half.tag),
                    self.data.Irecv([target, MPI.BYTE], half.peer, half.tag))

        if node.nbytes >= COPY_IN_PROGRESS_BYTES:
            native = self.native
            if native is None or not self.progress.post_outside(
                    op, lambda: native.receive(op, header, target, half.peer, half.tag)):
                self.progress.post_later(op, post)
            return PENDING
        requests = post()
        if MPI.Request.Testall(requests):
            # the message was here already (sent eagerly): finish in this thread
            if not self._header_ok(half, header):
                return PENDING  # never finishes: the divergence report aborts
            if not in_place:
                self._unpack(node, target)
            return None
        self.progress.post(op, *requests)
        return PENDING

    def _header_ok(self, half: RecvHalf, header) -> bool:
        node = half.copy
        want = (node.id, half.check[0], half.check[1], node.nbytes)
        got = tuple(int(x) for x in header)
        if got == want:
            return True
        self._diverged(half.peer, self.check.agreed.get(half.peer, 0), max(got[1], want[1]) + 1,
                       f"copy #{node.id} ({node.name} {node.rect!r}) from rank {half.peer} came with header "
                       f"(copy #{got[0]}, launch #{got[1]}, hash {got[2]:#x}, {got[3]} bytes); rank "
                       f"{self.rank} expected (copy #{want[0]}, launch #{want[1]}, hash {want[2]:#x}, "
                       f"{want[3]} bytes)")
        return False

    def _received(self, op: Op) -> None:
        half, (header, _, in_place) = op.node, op.keep
        try:
            if not self._header_ok(half, header):
                return
            if in_place:
                self.executor.complete(half, op.start)
            else:
                half.pending = op
                self.executor.resume(half)
        except BaseException as exc:
            self.executor.fail(half, exc, traceback.format_exc())

    def _unpack(self, node, target) -> None:
        if node.redop is not None:
            self.store.fold_array(node.region, node.rect, node.dst, target, node.redop)
        else:
            self.store.put(node.region, node.rect, node.dst, target)

    def unpack_recv(self, half: RecvHalf):
        """On the dst memory's worker: fold the received buffer, or copy it into place."""
        op = half.pending
        self._unpack(half.copy, op.keep[1])
        self.executor.complete(half, op.start)
        return PENDING

    # ---- control messages --------------------------------------------------------------------
    def _send_ctl(self, dest: int, obj, op: Op | None = None) -> None:
        self.progress.post(op or Op(None, 0.0), self.ctl.isend(obj, dest, TAG_CTL))

    def fetch_future(self, future) -> None:
        self.values.fetch(future)

    def prefetch(self, futures) -> None:
        self.values.prefetch(futures)

    def _on_control(self, msg) -> None:
        kind, src = msg[0], msg[1]
        self.last_heard = time.monotonic()
        if kind == "check":
            _, _, what, count, h = msg
            self.check.received(src, what, count, h)
            if what == "shutdown":
                with self.vlock:
                    self._shutdown_from.add(src)
                    self.vlock.notify_all()
        elif kind == "get":
            self.values.on_get(src, msg[2])
        elif kind == "value":
            self.values.on_value(*msg[2:])
        elif kind == "fut":
            self.values.on_push(*msg[2:])
        elif kind == "query":
            _, _, lo, hi = msg
            self._send_ctl(src, ("log", self.rank, self.log.window(lo, hi)))
        elif kind == "log":
            with self.vlock:
                self._replies[src] = msg[2]
                self.vlock.notify_all()
        elif kind == "release":
            with self.vlock:
                self._released = True
                self.vlock.notify_all()
        elif kind != "alive":  # a heartbeat only refreshes last_heard, above
            self._fatal(f"taskrt: rank {self.rank} got an unknown control message {kind!r} from rank {src}")

    def checkpoint(self, kind: str) -> None:
        """Send (launch count, running hash) to the checkpoint peers (main thread)."""
        count = self.log.count
        if kind != "shutdown" and count == self._last_checkpoint:
            return
        self._last_checkpoint = count
        for p in self.check.peers:
            self._send_ctl(p, ("check", self.rank, kind, count, self.log.hash))

    # ---- the progress thread's turn ------------------------------------------------------------
    def _tick(self) -> bool:
        """Control messages, answers to value requests, heartbeats (progress thread)."""
        busy = False
        for _ in range(64):
            msg = self.ctl.improbe(MPI.ANY_SOURCE, TAG_CTL)
            if msg is None:
                break
            busy = True
            self._on_control(msg.recv())
        if self.values.deferred and self.values.serve():
            busy = True
        now = time.monotonic()
        if now >= self._next_beat:
            self._next_beat = now + HEARTBEAT_S
            if self.values.kept:
                self.values.expire(now)
            if self._busy():
                for p in range(self.size):
                    if p != self.rank:
                        self._send_ctl(p, ("alive", self.rank))
        return busy

    def _request_failed(self, reqs, ops) -> None:
        """An MPI error on some request (a message longer than its receive: the graphs differ)."""
        for r, op in zip(reqs, ops):
            try:
                r.Test()
            except MPI.Exception as exc:
                self._op_failed(op, exc.Get_error_code())
                return
        self._fatal(f"taskrt: rank {self.rank}: MPI error while testing {len(reqs)} requests")

    def _op_failed(self, op: Op, code: int) -> None:
        """MPI error `code` ended `op`: a copy's message did not fit (the graphs differ), or worse."""
        node, text = op.node, MPI.Get_error_string(code)
        if isinstance(node, _Half):
            self._diverged(node.peer, self.check.agreed.get(node.peer, 0), node.check[0] + 1,
                           f"the message for copy #{node.id} ({node.name} {node.copy.rect!r}, "
                           f"{node.nbytes} bytes) from rank {node.peer} did not fit: {text}")
        else:
            self._fatal(f"taskrt: rank {self.rank}: MPI error on {node!r}: {text}")

    def _busy(self) -> bool:
        """Running something itself (not only waiting for messages)."""
        ex = self.executor
        waiting_for_messages = self.progress.in_flight + len(self.values.expected)
        return not self.main_waiting or len(ex.unfinished) - len(ex.waiting) > waiting_for_messages

    # ---- waiting (main thread) ---------------------------------------------------------------
    def wait_local(self, wait_fn, timeout: float | None, what: str) -> None:
        """Run an executor wait in slices, checkpointing when it stalls and aborting when
        nothing at all moves for `self.timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._guarded(lambda t: _ran(wait_fn, t), deadline, what)

    def _block(self, ready, what: str) -> None:
        def step(t):
            with self.vlock:
                if not ready():
                    self.vlock.wait(t)
                return ready()
        self._guarded(step, None, what)

    def _guarded(self, step, deadline, what: str) -> None:
        if step(0):
            return
        self.main_waiting = True
        try:
            start = last = time.monotonic()
            seen = self._progress_marks()
            checked = False
            while True:
                now = time.monotonic()
                slice_s = STALL_S if deadline is None else max(0.0, min(STALL_S, deadline - now))
                if step(slice_s):
                    return
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise TimeoutError(f"rank {self.rank}: {what} not done after {deadline - start:.3g} s")
                if not checked:
                    self.checkpoint("stall")
                    checked = True
                marks = self._progress_marks()
                if marks != seen:
                    seen, last = marks, now
                idle = now - max(last, self.last_heard)
                if self.timeout and idle > self.timeout:
                    self._fatal(self._stuck_report(what, idle))
        finally:
            self.main_waiting = False

    def _progress_marks(self) -> tuple:
        return (self.progress.completions, len(self.executor.unfinished), len(self.values.values))

    def _stuck_report(self, what: str, idle: float) -> str:
        ex = self.executor
        waiting = [f"copy #{node.id} from rank {node.peer}" for node in list(ex.unfinished.values())
                   if isinstance(node, RecvHalf) and node.id not in ex.waiting]
        waiting += self.values.waiting_for()
        listing = "; ".join(waiting[:8]) + (" ..." if len(waiting) > 8 else "") if waiting else "nothing posted"
        return (f"taskrt: rank {self.rank} waited {idle:.0f} s for {what} with no progress on this rank and no "
                f"busy peer (TASKRT_MPI_TIMEOUT={self.timeout:g}); messages it waits for: {listing}. "
                f"The ranks' task graphs probably differ, or a rank is stuck outside taskrt.")

    # ---- divergence and failure --------------------------------------------------------------
    def _diverged(self, peer: int, lo: int, hi: int, how: str) -> None:
        """Report a divergence (once): ask `peer` for its launches in [lo, hi), name the first
        that differs, abort. On its own thread, so the progress thread keeps answering."""
        with self.vlock:
            if self._reporting:
                return
            self._reporting = True
        threading.Thread(target=self._report_divergence, args=(peer, lo, hi, how), daemon=True,
                         name="taskrt-divergence").start()

    def _report_divergence(self, peer: int, lo: int, hi: int, how: str) -> None:
        lo = max(0, min(lo, hi - 1))
        self._send_ctl(peer, ("query", self.rank, lo, hi))
        deadline = time.monotonic() + 3.0
        with self.vlock:
            while peer not in self._replies and time.monotonic() < deadline:
                self.vlock.wait(0.05)
            theirs = self._replies.get(peer)
        self._fatal(self.check.describe(peer, lo, hi, theirs, how))

    def _hold_if_diverged(self) -> None:
        """Checkpoints were compared on receipt; a rank that found a divergence never passes
        the shutdown barrier (its report ends in Abort)."""
        if self._reporting:
            while True:
                time.sleep(1.0)

    def _task_failed(self, error) -> None:
        self._fatal(f"taskrt: rank {self.rank}: a task failed; aborting all {self.size} ranks\n{error}")

    def _fatal(self, text: str) -> None:
        """Print `text` and end every rank. Only the first caller prints; later ones (another
        thread that saw the same failure) wait for the abort to land."""
        with self.vlock:
            first = not self._dying
            self._dying = True
        if first:
            sys.stderr.write(text.rstrip("\n") + "\n")
            sys.stderr.flush()
            time.sleep(ABORT_GRACE_S)  # mpiexec may stop forwarding output as soon as a rank aborts
            self.world.Abort(1)
        while True:
            time.sleep(1.0)

    def abort_on_exception(self, exc_type, exc, tb) -> None:
        """The program raised on this rank inside `with Runtime()`: the other ranks would wait forever."""
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        self._fatal(f"taskrt: rank {self.rank}: the program raised; aborting all {self.size} ranks\n{text}")

    # ---- shutting down -----------------------------------------------------------------------
    def close(self) -> None:
        """After this rank's work is done: final checkpoint, a barrier through rank 0 (which
        compares every rank's final launch count and hash), then stop (collective)."""
        self.check.finish()
        self.checkpoint("shutdown")
        if self.rank == 0:
            others = set(range(1, self.size))
            self._block(lambda: others <= self._shutdown_from, "every rank to shut down")
            self._hold_if_diverged()
            for p in others:
                self._send_ctl(p, ("release", 0))
        else:
            self._block(lambda: self._released, "rank 0 to release the shutdown")
        self._hold_if_diverged()
        if self.native is not None:
            self.native.stop()
        self.progress.stop()
        for c in (self.data, self.hdr, self.ctl):
            c.Free()


def connect(comm=None, *, cpus: int | None = None, gpus: int | None = None, separate_memories: bool = False,
            timeout: float | None = None):
    """(machine, transport) for a Runtime on every rank of `comm` (collective)."""
    from .machine import Machine
    transport = MPITransport(comm, timeout)
    machine = Machine.discover(transport.world, cpus, gpus, separate_memories)
    if transport.size > 1:
        _abort_on_uncaught_exceptions(transport.world)
    return machine, transport


def _abort_on_uncaught_exceptions(world) -> None:
    """An uncaught exception on one rank would leave the others waiting: print it and Abort."""
    previous = sys.excepthook
    if getattr(previous, "_taskrt", False):
        return

    def hook(exc_type, exc, tb):
        sys.stderr.write(f"taskrt: rank {world.rank}: uncaught exception; aborting all {world.size} ranks\n")
        previous(exc_type, exc, tb)
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_S)
        world.Abort(1)

    hook._taskrt = True
    sys.excepthook = hook


def _contiguous(rect, shape) -> bool:
    """Whether `rect` of a C-ordered array of `shape` is one contiguous run of memory."""
    d, n = 0, len(shape)
    while d < n and rect.hi[d] - rect.lo[d] == 1:
        d += 1
    return all(rect.lo[k] == 0 and rect.hi[k] == shape[k] for k in range(d + 1, n))


def _host_contiguous(a) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a if a.flags.c_contiguous else np.ascontiguousarray(a)
    return gpu.to_numpy(a)


def _ran(wait_fn, t: float) -> bool:
    try:
        wait_fn(t)
        return True
    except TimeoutError:
        return False
