"""MPI progress: the requests in flight, and the threads that test them.

MPI moves a message only inside MPI calls, and Python threads that spin on the GIL starve
each other (a thread that drops and retakes the GIL at once keeps a woken worker waiting
for up to the 5 ms switch interval). So:

- whoever posts requests hands them over with `post(op, *requests)`; an Op counts its
  requests and runs `op.done(op)` when the last one ends;
- `poll()` tests every request in flight once (Testsome) and runs the done callbacks, in
  the calling thread. Only one thread polls at a time (a lock, never waited for);
- an idle worker calls `idle()` between tasks: while something happened in the last
  SPIN_S it polls, so that a message that ends and the task it unblocks run in one thread;
- the progress thread polls too (unless a worker polled in the last BACKUP_S), runs the
  owner's `tick()` (control messages, heartbeats), and naps with real sleeps: SPIN_NAP_S
  right after activity (timer slack cut to 1 us), doubling to MAX_NAP_S after SPIN_S of
  quiet, and waits on an Event when nothing is in flight.

Run state, under `lock` while polling: `reqs` and `ops` (parallel lists), `incoming` (a
deque the posting threads append to), `last_activity`; under `count_lock`: `in_flight`
(Ops of nodes posted and not ended) and `completions`.
"""
from __future__ import annotations

import sys
import threading
import time
import traceback
from collections import deque
from typing import Callable

from mpi4py import MPI

SPIN_NAP_S = 5e-6
SPIN_S = 0.002
MAX_NAP_S = 0.001
BACKUP_S = 1e-4
IDLE_POLL_S = 0.002


class Op:
    """Requests in flight for one thing (`node`, or None for a control message);
    `done(op)` runs in the polling thread when all of them have ended."""

    __slots__ = ("node", "start", "left", "keep", "done")

    def __init__(self, node, start: float, keep=(), done: Callable | None = None):
        self.node = node
        self.start = start
        self.left = 0
        self.keep = keep
        self.done = done


class Progress:
    """Tests the requests posted to it (see the module doc). `tick()` runs on the progress
    thread every turn and returns whether it did something; `failed(reqs, ops)` is called
    when Testsome raises; `fatal(text)` when the thread itself breaks."""

    def __init__(self, name: str, tick: Callable[[], bool], failed: Callable, fatal: Callable[[str], None]):
        self.name = name
        self.tick = tick
        self.failed = failed
        self.fatal = fatal
        self.lock = threading.Lock()
        self.incoming: deque = deque()
        self.reqs: list = []
        self.ops: list[Op] = []
        self.wake = threading.Event()
        self.last_activity = time.monotonic()
        self.last_worker_poll = 0.0
        self.in_flight = 0
        self.count_lock = threading.Lock()
        self.completions = 0
        self.stopping = False
        self._slack = threading.local()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Return once everything posted has ended and the thread is gone."""
        self.stopping = True
        self.wake.set()
        if self._thread is not None:
            self._thread.join()

    def post(self, op: Op, *requests) -> None:
        op.left = len(requests)
        if op.node is not None:
            with self.count_lock:
                self.in_flight += 1
        self.incoming.append((op, requests))
        self.last_activity = time.monotonic()
        self.wake.set()

    def poll(self) -> bool | None:
        """Test the requests in flight once and finish what ended, in this thread. None:
        nothing in flight, or another thread is polling; False: nothing ended; True: some did."""
        if not self.lock.acquire(blocking=False):
            return None
        finished = []
        try:
            reqs, ops = self.reqs, self.ops
            while self.incoming:
                op, rs = self.incoming.popleft()
                reqs.extend(rs)
                ops.extend([op] * len(rs))
            if not reqs:
                return None
            try:
                idx = MPI.Request.Testsome(reqs)
            except MPI.Exception:
                idx = None
                self.failed(reqs, ops)
            if idx:
                done = set(idx)
                for i in idx:
                    op = ops[i]
                    op.left -= 1
                    if op.left == 0:
                        finished.append(op)
                self.reqs = [r for i, r in enumerate(reqs) if i not in done]
                self.ops = [o for i, o in enumerate(ops) if i not in done]
        finally:
            self.lock.release()
        if not finished:
            return False
        self.last_activity = time.monotonic()
        for op in finished:
            if op.node is not None:
                with self.count_lock:
                    self.in_flight -= 1
                    self.completions += 1
            if op.done is not None:
                op.done(op)
        return True

    def idle(self) -> bool:
        """An idle worker's turn (Executor.idle). False: block on your queue instead."""
        if time.monotonic() - self.last_activity > SPIN_S:
            return False
        ended = self.poll()
        if ended is None:
            return False
        self.last_worker_poll = time.monotonic()
        if not ended:
            if not getattr(self._slack, "set", False):
                precise_sleeps()
                self._slack.set = True
            time.sleep(SPIN_NAP_S)
        return True

    @property
    def pending(self) -> bool:
        return bool(self.reqs or self.incoming)

    def _run(self) -> None:
        precise_sleeps()
        try:
            self._loop()
        except BaseException:
            self.fatal(f"taskrt: the MPI progress thread {self.name} failed\n{traceback.format_exc()}")

    def _loop(self) -> None:
        nap = 0.0
        last_busy = time.monotonic()
        while True:
            self.wake.clear()
            # while an idle worker polls, this thread only minds the tick
            ended = self.poll() if time.monotonic() - self.last_worker_poll > BACKUP_S else None
            busy = self.tick() or bool(ended)
            now = time.monotonic()
            pending = self.pending
            if self.stopping and not pending:
                return
            last_busy = max(last_busy, self.last_activity)
            if busy:
                last_busy = now
                nap = SPIN_NAP_S
                time.sleep(nap)
            elif now - self.last_worker_poll < BACKUP_S:
                time.sleep(BACKUP_S)
            elif pending:
                if now - last_busy > SPIN_S:
                    nap = min(MAX_NAP_S, nap * 2)
                time.sleep(nap)
            else:
                self.wake.wait(IDLE_POLL_S)


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
