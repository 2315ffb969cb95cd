"""MPI progress: the requests in flight, and the thread that waits on them.

MPI moves a message only inside an MPI call, and between ranks of one node MPICH moves a
large message by one copy that the *receiver* makes inside such a call (CMA). So a rank
that receives must be inside MPI as soon as the message is there, while its workers keep
running Python. The progress thread therefore waits in one blocking `Waitsome`, which
runs without the GIL: the copy goes on while workers compute, and the GIL is taken only
to finish what ended. A sender has no copy to make, so it only polls.

- Whoever posts requests hands them over with `post(op, *requests)`, or has the progress
  thread post them with `post_later(op, make)` (a large receive: see there); an Op counts
  its requests and runs `op.done(op)` on the progress thread when the last one ends.
- The progress thread's turn: take what was posted, run the owner's `tick()` (control
  messages, heartbeats), then wait in one of three ways:
  - receives in flight and something happened in the last spin time (SPIN_S; none at all
    where the node has no core to spare, SHARED_CORE_SPIN_S): blocked in Waitsome
    over the requests in flight plus a wake-up receive. A post during the wait sends the
    wake-up (a message to self, on a communicator of its own), so that new requests join
    the wait; the alarm thread sends it once the wait has been quiet for the spin time, so that
    control messages are read and a long wait for a busy peer stops spinning a core;
  - otherwise a Testsome, then a nap that a post cuts short: `nap_s` (SPIN_NAP_S, or
    SHARED_CORE_NAP_S where the node has no core to spare) while there is activity, doubling
    to MAX_NAP_S after the spin time of quiet;
  - with nothing in flight: on an Event, with IDLE_TICK_S turns for control messages.

Run state: `incoming` (a deque the posting threads append to), `reqs` and `ops` (parallel
lists, progress thread only), `receiving` (Ops with a receive among `ops`),
`last_activity`, `blocked` (the progress thread is inside Waitsome); under `count_lock`,
`in_flight` (Ops of nodes posted and not ended) and `completions`.
"""
from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from typing import Callable

import numpy as np
from mpi4py import MPI

#: after a message, the progress thread waits inside MPI this long for the next one (a core's
#: polling in MPICH); SHARED_CORE_SPIN_S where the node has no core to spare for it, since
#: there that polling takes the workers' time: a 2-core node running 2 ranks, with a message
#: every 2-3 ms, spent 37-42 ms of a CNN step's CPU in this thread at 2 ms, 12-19 ms at
#: 0.2 ms, and 6-9 ms never blocking (only Testsome and naps), with steps no slower
SPIN_S = 0.002
SHARED_CORE_SPIN_S = 0.0
#: the first nap after activity, and SHARED_CORE_NAP_S where the node has no core to spare:
#: each wake-up takes the GIL from the workers. With 100 us rather than 5 us, bench/scaling.py's
#: 2-rank steps on a 2-core VM were 6% (CNN, data parallel), 9% (CNN, expert) and 21% (MLP,
#: tensor parallel) shorter, in 9 of 9 interleaved pairs, and this thread's CPU a step fell
#: from 6.8-8.5 ms to 5.0-6.6 ms; an isolated chain of copies (bench/copy_bandwidth.py) pays
#: for it, 95 -> 207 us a 16 KiB hop
SPIN_NAP_S = 5e-6
SHARED_CORE_NAP_S = 1e-4
MAX_NAP_S = 0.001
IDLE_TICK_S = 0.002
WAKE_TAG = 0


class Op:
    """Requests in flight for one thing (`node`, or None for a control message);
    `done(op)` runs in the progress thread when all of them have ended. `receives`: some
    of them are receives (the progress thread then waits inside MPI, see the module doc)."""

    __slots__ = ("node", "start", "left", "keep", "done", "receives")

    def __init__(self, node, start: float, keep=(), done: Callable | None = None, receives: bool = False):
        self.node = node
        self.start = start
        self.left = 0
        self.keep = keep
        self.done = done
        self.receives = receives


class Progress:
    """Waits on the requests posted to it (see the module doc). `tick()` runs on the progress
    thread every turn and returns whether it did something; `failed(reqs, ops)` is called
    when an MPI call on the requests raises; `fatal(text)` when the thread itself breaks."""

    def __init__(self, name: str, tick: Callable[[], bool], failed: Callable, fatal: Callable[[str], None],
                 spin_s: float = SPIN_S, nap_s: float = SPIN_NAP_S):
        self.name = name
        self.spin_s = spin_s
        self.nap_s = nap_s
        self.tick = tick
        self.failed = failed
        self.fatal = fatal
        self.incoming: deque = deque()
        self.reqs: list = []
        self.ops: list[Op] = []
        self.wake = threading.Event()
        self.last_activity = time.monotonic()
        self.blocked = False
        self.receiving = 0
        self.in_flight = 0
        self.count_lock = threading.Lock()
        self.completions = 0
        self.stopping = False
        self._wake_comm = MPI.COMM_SELF.Dup()
        self._wake_out = np.zeros(1, np.uint8)
        self._wake_in = np.zeros(1, np.uint8)
        self._wake_req = self._wake_comm.Irecv(self._wake_in, 0, WAKE_TAG)
        self._armed = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for target, suffix in ((self._run, ""), (self._alarm, "-alarm")):
            t = threading.Thread(target=target, name=self.name + suffix, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        """Return once everything posted has ended and the threads are gone."""
        self.stopping = True
        self.wake.set()
        self._armed.set()
        self._interrupt()
        for t in self._threads:
            t.join()
        self._wake_req.Cancel()
        self._wake_req.Wait()
        while self._wake_comm.Iprobe(0, WAKE_TAG):  # wake-ups sent after the last wait ended
            self._wake_comm.Recv(self._wake_in, 0, WAKE_TAG)
        self._wake_comm.Free()

    def post(self, op: Op, *requests) -> None:
        """Hand over `requests`, posted already, for `op`."""
        self._hand_over(op, requests)

    def post_later(self, op: Op, make: Callable[[], tuple]) -> None:
        """Have the progress thread post `op`'s requests (`make()` returns them): a receive
        whose message is already there does MPI's copy inside the very call that posts it,
        and that copy belongs on this thread, not on a worker."""
        self._hand_over(op, make)

    def post_outside(self, op: Op, hand_over: Callable[[], bool]) -> bool:
        """Count `op` in flight and give it to another engine (taskrt/mpi_native.py), which
        calls `finish(op)` when it ends; False, with nothing counted, if `hand_over()` declines."""
        with self.count_lock:
            self.in_flight += 1
        if hand_over():
            return True
        with self.count_lock:
            self.in_flight -= 1
        return False

    def finish(self, op: Op) -> None:
        """An Op given away by `post_outside` has ended (on that engine's thread)."""
        self.last_activity = time.monotonic()
        self._done(op)

    def _done(self, op: Op) -> None:
        """`op` has ended: count it (a node's), then run its callback."""
        if op.node is not None:
            with self.count_lock:
                self.in_flight -= 1
                self.completions += 1
        if op.done is not None:
            op.done(op)

    def _hand_over(self, op: Op, requests) -> None:
        if op.node is not None:
            with self.count_lock:
                self.in_flight += 1
        self.incoming.append((op, requests))
        self.last_activity = time.monotonic()
        if self.blocked:
            self._interrupt()
        else:
            self.wake.set()

    def _interrupt(self) -> None:
        """End the progress thread's Waitsome (a message to self)."""
        self._wake_comm.Isend(self._wake_out, 0, WAKE_TAG).Free()

    # ---- the progress thread -----------------------------------------------------------------
    def _run(self) -> None:
        precise_sleeps()
        try:
            self._loop()
        except BaseException:
            self.fatal(f"taskrt: the MPI progress thread {self.name} failed\n{traceback.format_exc()}")

    def _loop(self) -> None:
        nap = self.nap_s
        while True:
            self.wake.clear()
            self._take_posted()
            busy = self.tick()
            if not self.reqs:
                if self.stopping and not self.incoming:
                    return
                if not busy and not self.incoming:
                    self.wake.wait(IDLE_TICK_S)
                continue
            recent = time.monotonic() - self.last_activity < self.spin_s
            if recent and self.receiving and not self.stopping:
                self._wait_blocked()
            elif self._test() or busy:
                nap = self.nap_s
            else:
                self.wake.wait(nap)
                if not recent:
                    nap = min(MAX_NAP_S, nap * 2)

    def _take_posted(self) -> None:
        incoming, reqs, ops = self.incoming, self.reqs, self.ops
        while incoming:
            op, rs = incoming.popleft()
            if callable(rs):
                rs = rs()
            op.left = len(rs)
            reqs.extend(rs)
            ops.extend([op] * len(rs))
            self.receiving += op.receives

    def _wait_blocked(self) -> None:
        """Waitsome over the requests in flight and the wake-up receive, without the GIL."""
        self.blocked = True
        if not self._armed.is_set():
            self._armed.set()
        if self.incoming or self.stopping:  # posted before `blocked` was seen: take it first
            self.blocked = False
            return
        reqs = self.reqs
        reqs.append(self._wake_req)
        try:
            idx = MPI.Request.Waitsome(reqs)
        except MPI.Exception:
            idx = None
        finally:
            self.blocked = False
            reqs.pop()
        if idx is None:
            self.failed(reqs, self.ops)
            return
        if idx and idx[-1] == len(reqs):  # Waitsome gives indices in increasing order
            idx.pop()
            self._wake_req = self._wake_comm.Irecv(self._wake_in, 0, WAKE_TAG)
        if idx:
            self._ended(idx)

    def _test(self) -> bool:
        """One Testsome over the requests in flight; whether some ended."""
        try:
            idx = MPI.Request.Testsome(self.reqs)
        except MPI.Exception:
            self.failed(self.reqs, self.ops)
            return False
        if not idx:
            return False
        self._ended(idx)
        return True

    def _ended(self, idx: list[int]) -> None:
        """Drop the ended requests; run the done callbacks of the Ops whose last one ended."""
        ops = self.ops
        finished = []
        for i in idx:
            op = ops[i]
            op.left -= 1
            if op.left == 0:
                finished.append(op)
        done = set(idx)
        self.reqs = [r for i, r in enumerate(self.reqs) if i not in done]
        self.ops = [o for i, o in enumerate(ops) if i not in done]
        self.last_activity = time.monotonic()
        for op in finished:
            self.receiving -= op.receives
            self._done(op)

    # ---- the alarm thread --------------------------------------------------------------------
    def _alarm(self) -> None:
        """End a blocked wait that has been quiet for the spin time (`spin_s`: the progress
        thread enters one only within that time of the last activity, and MPICH polls a core
        inside it). It checks every spin time while the progress thread spins, and parks once
        it has stopped spinning."""
        precise_sleeps()
        spin = self.spin_s
        while not self.stopping:
            quiet = time.monotonic() - self.last_activity
            if self.blocked and quiet >= spin:
                self._interrupt()
                time.sleep(spin)
            elif quiet < spin:
                time.sleep(spin - quiet)
            else:
                self._armed.clear()
                if not self.blocked:
                    self._armed.wait()


def precise_sleeps() -> None:
    """Cut this thread's timer slack to 1 us (Linux prctl PR_SET_TIMERSLACK), so that a 5 us
    sleep is not a 55 us one; elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes
        try:
            libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            return
        prctl = getattr(libc, "prctl", None)
        if prctl is not None:
            prctl(29, 1000, 0, 0, 0)


def wait_request(request) -> None:
    """Wait for one request without holding the core (other ranks may share it)."""
    while not request.Test():
        time.sleep(0)
