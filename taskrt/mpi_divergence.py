"""The replication check over MPI: checkpoints out, the peers' in, divergence reports, and
the shutdown barrier that compares every rank's final launches.

Divergence: every launch goes into the LaunchLog (`on_launch`); `checkpoint(kind)` sends
(launch count, running hash) to the checkpoint peers; the peers' checkpoints go to the
ReplicationCheck (taskrt/replication.py), which calls `diverged` on a difference, as do
copies whose header or size is wrong (`found`). A report asks the peer for its launches
around the difference (Query, answered with Launches), names the first that differs and
aborts, on a thread of its own so that the progress thread keeps answering.

ShutdownBarrier: rank 0 waits for every rank's shutdown checkpoint, then releases them
(Release); a rank that found a divergence never passes it (its report ends in Abort).

State: Divergence's `last_checkpoint` (main thread only); `reporting` and `replies` (peer
-> its Launches window) under `Divergence.replied`. ShutdownBarrier's `arrived` (ranks
whose shutdown checkpoint came) and `released` under `ShutdownBarrier.cond`.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from .mpi_control import Checkpoint, Launches, Query, Release
from .replication import LaunchLog, ReplicationCheck, launch_signature

#: how long a report waits for the peer's launches before it aborts without them
REPLY_WAIT_S = 3.0


class Divergence:
    """This rank's side of the replication check (see the module doc). `send(dest, msg)`
    posts a control message; `fatal(text)` ends every rank."""

    def __init__(self, rank: int, size: int, log: LaunchLog, send: Callable, fatal: Callable[[str], None]):
        self.rank = rank
        self.log = log
        self.check = ReplicationCheck(log, rank, size, self.diverged)
        self.send = send
        self.fatal = fatal
        self.last_checkpoint = -1
        self.replied = threading.Condition()
        self.reporting = False
        self.replies: dict[int, tuple] = {}

    # ---- launches and checkpoints (main thread) ------------------------------------------------
    def on_launch(self, spec) -> None:
        self.on_signatures((spec.signature or launch_signature(spec),))

    def on_signatures(self, signatures) -> None:
        """Log launches (made again without specs: in one go), then compare the peers'
        checkpoints that this rank's launch count has reached (ReplicationCheck.reached
        compares every one passed)."""
        self.log.add_many(signatures)
        if self.log.count >= self.check.next_check:
            self.check.reached()

    def checkpoint(self, kind: str) -> None:
        """Send (launch count, running hash) to the checkpoint peers."""
        count = self.log.count
        if kind != "shutdown" and count == self.last_checkpoint:
            return
        self.last_checkpoint = count
        for p in self.check.peers:
            self.send(p, Checkpoint(self.rank, kind, count, self.log.hash))

    def finish(self) -> None:
        """This rank makes no more launches: send the shutdown checkpoint."""
        self.check.finish()
        self.checkpoint("shutdown")

    # ---- messages (progress thread) ------------------------------------------------------------
    def on_checkpoint(self, msg: Checkpoint) -> None:
        self.check.received(msg.src, msg.what, msg.count, msg.hash)

    def on_query(self, msg: Query) -> None:
        self.send(msg.src, Launches(self.rank, self.log.window(msg.lo, msg.hi)))

    def on_launches(self, msg: Launches) -> None:
        with self.replied:
            self.replies[msg.src] = msg.window
            self.replied.notify_all()

    # ---- reports (any thread) ------------------------------------------------------------------
    def found(self, peer: int, hi: int, how: str) -> None:
        """A divergence with `peer` seen before launch `hi`, after the last count both agreed on."""
        self.diverged(peer, self.check.agreed.get(peer, 0), hi, how)

    def diverged(self, peer: int, lo: int, hi: int, how: str) -> None:
        """Report a divergence (once): ask `peer` for its launches in [lo, hi), name the first
        that differs, abort."""
        with self.replied:
            if self.reporting:
                return
            self.reporting = True
        threading.Thread(target=self._report, args=(peer, lo, hi, how), daemon=True,
                         name="taskrt-divergence").start()

    def _report(self, peer: int, lo: int, hi: int, how: str) -> None:
        lo = max(0, min(lo, hi - 1))
        self.send(peer, Query(self.rank, lo, hi))
        deadline = time.monotonic() + REPLY_WAIT_S
        with self.replied:
            while peer not in self.replies and time.monotonic() < deadline:
                self.replied.wait(0.05)
            theirs = self.replies.get(peer)
        self.fatal(self.check.describe(peer, lo, hi, theirs, how))

    def hold_if_diverged(self) -> None:
        """Checkpoints were compared on receipt; a rank that found a divergence never passes
        the shutdown barrier (its report ends in Abort)."""
        if self.reporting:
            while True:
                time.sleep(1.0)


class ShutdownBarrier:
    """The barrier through rank 0 at shutdown (see the module doc). `block(cond, ready,
    what)` waits on the main thread, guarded; `send(dest, msg)` posts a control message."""

    def __init__(self, rank: int, size: int, send: Callable, block: Callable):
        self.rank = rank
        self.size = size
        self.send = send
        self.block = block
        self.cond = threading.Condition()
        self.arrived: set[int] = set()
        self.released = False

    def on_checkpoint(self, msg: Checkpoint) -> None:
        if msg.what == "shutdown":
            with self.cond:
                self.arrived.add(msg.src)
                self.cond.notify_all()

    def on_release(self, msg: Release) -> None:
        with self.cond:
            self.released = True
            self.cond.notify_all()

    def wait(self, hold: Callable[[], None]) -> None:
        """Rank 0: wait for every rank's shutdown checkpoint, `hold()`, release them; the
        others: wait for the release (main thread)."""
        if self.rank == 0:
            others = set(range(1, self.size))
            self.block(self.cond, lambda: others <= self.arrived, "every rank to shut down")
            hold()
            for p in others:
                self.send(p, Release(0))
        else:
            self.block(self.cond, lambda: self.released, "rank 0 to release the shutdown")
