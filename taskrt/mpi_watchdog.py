"""Nothing hangs: heartbeats, the no-progress guard on the main thread's waits, and Abort.

- A busy rank (running something itself, not only waiting for messages) sends Alive to
  every peer each HEARTBEAT_S, from the progress thread's turn (`tick`); any control
  message read counts as heard (`heard`).
- A main-thread wait runs in slices (`wait_local`, `block`): one that blocks for STALL_S
  sends a checkpoint once (so that a stuck rank is compared), and one that sees no progress
  on this rank and hears nothing from its peers for `timeout` seconds (TASKRT_MPI_TIMEOUT,
  default 60; 0: never) aborts, naming what it waited for.
- A rank whose program ends with its runtime open (no shutdown) sends Exited to its peers
  at exit (MPITransport.at_exit); a peer's wait that then sees nothing move here for
  EXITED_QUIET_S aborts, naming that rank, rather than after `timeout`.
- Abort prints the first fatal error only and ends every rank (MPI_Abort); a task that
  raises, an exception out of `with Runtime()` and an uncaught one all end there.

State: the Watchdog's `last_heard` and `exited` (written by the progress thread), `main_waiting`
(written by the main thread) and `next_beat` (progress thread only) are single-writer
values read without a lock: a stale read only moves a decision by one turn. Abort's
`dying` is guarded by `Abort.lock`.
"""
from __future__ import annotations

import math
import os
import sys
import threading
import time
import traceback
from typing import Callable

from .mpi_control import Alive, Exited

#: a wait that has blocked this long sends a checkpoint (so a stuck rank is compared)
STALL_S = 0.25
#: a busy rank tells its peers so this often (so that their no-progress guard waits)
HEARTBEAT_S = 2.0
#: between printing a fatal error and MPI_Abort, so that mpiexec forwards the message
ABORT_GRACE_S = 0.2
DEFAULT_TIMEOUT_S = 60.0
#: after a peer's program ended with its runtime open, a wait that sees nothing move here for
#: this long aborts (messages it had sent before exiting have arrived by then)
EXITED_QUIET_S = 1.0


#: the shortest no-progress timeout: a busy peer says so once every HEARTBEAT_S, so a timeout
#: nearer that than twice it ended correct programs whose peer was computing
MIN_TIMEOUT_S = 2 * HEARTBEAT_S


def timeout_from_env() -> float:
    """TASKRT_MPI_TIMEOUT (seconds, 0: never, else at least MIN_TIMEOUT_S), else DEFAULT_TIMEOUT_S."""
    value = os.environ.get("TASKRT_MPI_TIMEOUT", "").strip()
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    return checked_timeout(seconds, "TASKRT_MPI_TIMEOUT", repr(value))


def checked_timeout(seconds, what: str = "Runtime.from_mpi: timeout", shown: str | None = None) -> float:
    """`seconds` as a no-progress timeout (0: never, else at least MIN_TIMEOUT_S), or a ValueError
    naming `what` and the value (`shown`: as the user wrote it)."""
    shown = repr(seconds) if shown is None else shown
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (0 <= seconds < math.inf):
        raise ValueError(f"{what} must be seconds, at least 0 (0: never), got {shown}")
    if 0 < seconds < MIN_TIMEOUT_S:
        raise ValueError(f"{what} must be 0 (never) or at least {MIN_TIMEOUT_S:g} seconds (a busy rank "
                         f"tells the others so every {HEARTBEAT_S:g} s; a shorter timeout ends correct programs), "
                         f"got {shown}")
    return float(seconds)


class Abort:
    """Ends every rank of `world` with a message (see the module doc)."""

    def __init__(self, world):
        self.world = world
        self.rank = world.rank
        self.size = world.size
        self.lock = threading.Lock()
        self.dying = False

    def fatal(self, text: str) -> None:
        """Print `text` and end every rank. Only the first caller prints; later ones (another
        thread that saw the same failure) wait for the abort to land."""
        with self.lock:
            first = not self.dying
            self.dying = True
        if first:
            sys.stderr.write(text.rstrip("\n") + "\n")
            sys.stderr.flush()
            time.sleep(ABORT_GRACE_S)  # mpiexec may stop forwarding output as soon as a rank aborts
            self.world.Abort(1)
        while True:
            time.sleep(1.0)

    def task_failed(self, error) -> None:
        """The executor's on_error: a task raised on this rank."""
        self.fatal(f"taskrt: rank {self.rank}: a task failed; aborting all {self.size} ranks\n{error}")

    def program_raised(self, exc_type, exc, tb) -> None:
        """The program raised on this rank inside `with Runtime()`: the other ranks would wait forever."""
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        self.fatal(f"taskrt: rank {self.rank}: the program raised; aborting all {self.size} ranks\n{text}")


def abort_on_uncaught_exceptions(world) -> None:
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


class Watchdog:
    """Heartbeats and the no-progress guard of one rank (see the module doc).

    Callbacks: `send(dest, msg)` posts a control message; `stalled()` sends the stall
    checkpoint; `marks()` is a value that changes whenever this rank makes progress;
    `working()` is true while some node runs that waits for no message; `waiting_for()`
    lists the messages this rank waits for; `fatal(text)` ends every rank."""

    def __init__(self, rank: int, size: int, timeout: float, send: Callable, stalled: Callable[[], None],
                 marks: Callable[[], tuple], working: Callable[[], bool], waiting_for: Callable[[], list],
                 fatal: Callable[[str], None]):
        self.rank = rank
        self.size = size
        self.timeout = timeout
        self.send = send
        self.stalled = stalled
        self.marks = marks
        self.working = working
        self.waiting_for = waiting_for
        self.fatal = fatal
        self.last_heard = time.monotonic()
        self.next_beat = 0.0
        self.main_waiting = False
        #: the peers whose programs ended with their runtimes open, in the order heard
        self.exited: list[int] = []

    # ---- heartbeats (progress thread) ----------------------------------------------------------
    def heard(self, msg=None) -> None:
        """A control message came from some peer (an Alive says no more than that)."""
        self.last_heard = time.monotonic()

    def peer_exited(self, msg: Exited) -> None:
        """Rank msg.src's program ended without shutting its runtime down."""
        self.exited.append(msg.src)
        self.heard()

    def busy(self) -> bool:
        """Running something itself (not only waiting for messages)."""
        return not self.main_waiting or self.working()

    def tick(self, now: float) -> bool:
        """Once every HEARTBEAT_S: tell the peers this rank is busy, if it is; whether the
        period came round."""
        if now < self.next_beat:
            return False
        self.next_beat = now + HEARTBEAT_S
        if self.busy():
            for p in range(self.size):
                if p != self.rank:
                    self.send(p, Alive(self.rank))
        return True

    # ---- waiting (main thread) -----------------------------------------------------------------
    def wait_local(self, wait_fn, timeout: float | None, what: str) -> None:
        """Run an executor wait in slices, checkpointing when it stalls and aborting when
        nothing at all moves for `self.timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.guarded(lambda t: _ran(wait_fn, t), deadline, what)

    def block(self, cond: threading.Condition, ready: Callable[[], bool], what: str) -> None:
        """Wait on `cond` until `ready()`, guarded; whoever makes it ready notifies `cond`."""
        def step(t):
            with cond:
                if not ready():
                    cond.wait(t)
                return ready()
        self.guarded(step, None, what)

    def guarded(self, step: Callable[[float], bool], deadline: float | None, what: str) -> None:
        """Call `step(seconds)` until it returns true, in slices of at most STALL_S."""
        if step(0):
            return
        self.main_waiting = True
        try:
            start = last = time.monotonic()
            seen = self.marks()
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
                    self.stalled()
                    checked = True
                marks = self.marks()
                if marks != seen:
                    seen, last = marks, now
                if self.exited and now - last >= EXITED_QUIET_S and not self.working():
                    self.fatal(self._exited_report(what))
                idle = now - max(last, self.last_heard)
                if self.timeout and idle > self.timeout:
                    self.fatal(self._stuck_report(what, idle))
        finally:
            self.main_waiting = False

    def _stuck_report(self, what: str, idle: float) -> str:
        return (f"taskrt: rank {self.rank} waited {idle:.0f} s for {what} with no progress on this rank and no "
                f"busy peer (TASKRT_MPI_TIMEOUT={self.timeout:g}); messages it waits for: "
                f"{_listing(self.waiting_for()) or 'nothing posted'}. "
                f"The ranks' task graphs probably differ, or a rank is stuck outside taskrt.")

    def _exited_report(self, what: str) -> str:
        ranks = ", ".join(map(str, self.exited))
        listing = _listing(self.waiting_for())
        waiting = f"; messages it waits for: {listing}" if listing else ""
        return (f"taskrt: rank {ranks} ended its program with its Runtime open (no rt.shutdown(), no `with "
                f"Runtime.from_mpi()`) while rank {self.rank} waits for {what}{waiting}. Every rank must make "
                f"the same launches and shut its runtime down.")


def _listing(waiting: list[str]) -> str:
    """The first messages a rank waits for, for a report ('' for none)."""
    return "; ".join(waiting[:8]) + (" ..." if len(waiting) > 8 else "")


def _ran(wait_fn, t: float) -> bool:
    try:
        wait_fn(t)
        return True
    except TimeoutError:
        return False
