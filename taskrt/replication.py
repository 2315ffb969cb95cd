"""Control replication checks: do all ranks make the same launches?

Every rank keeps a LaunchLog: a running hash (crc32 chained over a short signature of
each launch: name, function, point count, first and last point and processor, and each
requirement's shape, privilege and partition size) and the signatures of the last
LOG_KEEP launches. Ranks compare hashes at *checkpoints*, never on the hot path:

- each cross-rank copy carries (launch number, running hash) in its header, compared on
  receipt (taskrt/mpi_copies.py);
- at every `wait()`, at every wait that blocks longer than STALL_S (taskrt/mpi_watchdog.py),
  and at shutdown a rank sends its (launch count, running hash) to its checkpoint peers
  (taskrt/mpi_divergence.py): rank 0 to every rank, every other rank to rank 0 (a star,
  so n - 1 messages each way);
- a checkpoint for a count this rank has passed is compared at once; one for a count
  it has not reached yet waits in `pending` until it gets there (one integer compare per
  launch); one that can never be reached (the other rank went further than this rank's
  final count, or stopped short of it) is a divergence at once.

Run state: `log` (count, hash, recent signatures), `pending` (a heap of checkpoints
ahead of this rank), `agreed` (peer -> highest count known to match), `shut` (peer -> its
final launch count, compared with this rank's own when it shuts down), `final` (this
rank's launch count once it shuts down). A divergence goes to `report(peer, lo, hi, how)`,
which asks the peer for its signatures in [lo, hi) and names the first launch that
differs (ReplicationCheck.describe).
"""
from __future__ import annotations

import heapq
import threading
import zlib
from collections import deque

#: signatures kept for naming the launch where ranks diverged
LOG_KEEP = 1 << 14


def launch_signature(spec) -> str:
    """What every rank must agree on about a launch. No region uids or default names
    (those count objects made by the process, which may differ harmlessly), no args (an
    attach's array is on rank 0 alone); but where the function is a method of an object with a
    `replication_key` (an op's plan: its attributes; an update: its optimizer), that key, so
    that ranks given other hyperparameters stop rather than train a mix of them."""
    fn = spec.fn
    fname = "-" if fn is None else f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    key = getattr(getattr(fn, "__self__", None), "replication_key", None)
    if key is not None:
        fname = f"{fname} of {key}"
    reqs = []
    for r in spec.reqs:
        target = f"{len(r.partition.rects)} pieces" if r.partition is not None else repr(r.rect_or_all)
        reqs.append(f"{r.privilege!r} {r.region.dtype}{list(r.region.shape)} {target}")
    pts, procs = spec.points, spec.procs
    return (f"{spec.name!r} fn={fname} points={len(pts)} [{pts[0]}@{procs[0]} .. {pts[-1]}@{procs[-1]}] "
            f"reqs=({'; '.join(reqs)})")


class LaunchLog:
    """This rank's launches: how many, their running hash, and the last LOG_KEEP signatures."""

    def __init__(self, keep: int = LOG_KEEP):
        self.count = 0
        self.hash = 0
        self.base = 0
        self.entries: deque[tuple[int, str]] = deque(maxlen=keep)
        self.lock = threading.Lock()

    def add(self, signature: str) -> None:
        self.add_many((signature,))

    def add_many(self, signatures) -> None:
        """Log each signature in turn, the hashes chained outside the lock and the entries
        appended under one hold of it (a replayed step's launches: a lock and a call each were
        a tenth of reissuing it)."""
        hashes, h = [], self.hash
        for signature in signatures:
            h = zlib.crc32(signature.encode(), h)
            hashes.append(h)
        with self.lock:
            entries = self.entries
            self.base += max(0, len(entries) + len(hashes) - entries.maxlen)
            entries.extend(zip(hashes, signatures))
            self.hash = h
            self.count += len(hashes)

    def position(self) -> tuple[int, int]:
        """(launches made, their running hash), read together (a worker may ask while the main
        thread logs)."""
        with self.lock:
            return self.count, self.hash

    def hash_at(self, count: int) -> int | None:
        """The running hash after `count` launches; None if not reached or forgotten."""
        if count == 0:
            return 0
        with self.lock:
            i = count - 1 - self.base
            if count > self.count or i < 0:
                return None
            return self.entries[i][0]

    def window(self, lo: int, hi: int) -> tuple[int, list[tuple[int, str]]]:
        """(first launch number, [(running hash, signature)]) for launches in [lo, hi) still kept."""
        with self.lock:
            lo = max(lo, self.base)
            hi = min(hi, self.count)
            return lo, [self.entries[i - self.base] for i in range(lo, hi)]


class ReplicationCheck:
    """Compares this rank's LaunchLog with the checkpoints of its peers (see module doc)."""

    def __init__(self, log: LaunchLog, rank: int, size: int, report):
        self.log = log
        self.rank = rank
        self.peers = list(range(1, size)) if rank == 0 else [0]
        self.report = report
        self.pending: list[tuple[int, int, int, str]] = []
        self.next_check = float("inf")
        self.agreed: dict[int, int] = {}
        self.final: int | None = None
        #: peer -> the launch count it shut down at (a rank may launch more after it arrived)
        self.shut: dict[int, int] = {}
        self.lock = threading.Lock()

    def received(self, peer: int, kind: str, count: int, h: int) -> None:
        """A peer's checkpoint (progress thread)."""
        with self.lock:
            mine = self.log.count
            if kind == "shutdown":
                self.shut[peer] = count
            if count <= mine:
                self._compare(peer, kind, count, h)
                if kind == "shutdown" and count < mine:
                    self.report(peer, self.agreed.get(peer, 0), count + 1,
                                f"rank {peer} shut down after {count} launches; rank {self.rank} has made {mine}")
            elif self.final is not None:
                self.report(peer, self.agreed.get(peer, 0), self.final + 1,
                            f"rank {peer} reached launch count {count} ({kind}); rank {self.rank} shut down "
                            f"after {self.final}")
            else:
                heapq.heappush(self.pending, (count, peer, h, kind))
                self.next_check = self.pending[0][0]

    def reached(self) -> None:
        """This rank's launch count passed `next_check` (main thread)."""
        with self.lock:
            mine = self.log.count
            while self.pending and self.pending[0][0] <= mine:
                count, peer, h, kind = heapq.heappop(self.pending)
                self._compare(peer, kind, count, h)
            self.next_check = self.pending[0][0] if self.pending else float("inf")

    def finish(self) -> None:
        """This rank makes no more launches (main thread, at shutdown)."""
        with self.lock:
            self.final = self.log.count
            for count, peer, _, kind in self.pending:
                self.report(peer, self.agreed.get(peer, 0), self.final + 1,
                            f"rank {peer} reached launch count {count} ({kind}); rank {self.rank} shut down "
                            f"after {self.final}")
            self.pending.clear()
            self.next_check = float("inf")
            for peer, count in self.shut.items():
                if count < self.final:   # (it arrived when this rank had made no more than it)
                    self.report(peer, self.agreed.get(peer, 0), count + 1,
                                f"rank {peer} shut down after {count} launches; rank {self.rank} has made "
                                f"{self.final}")

    def _compare(self, peer: int, kind: str, count: int, h: int) -> None:
        mine = self.log.hash_at(count)
        if mine is None:
            return
        if mine != h:
            self.report(peer, self.agreed.get(peer, 0), count,
                        f"launch hashes differ after {count} launches (checkpoint '{kind}' of rank {peer})")
        elif count > self.agreed.get(peer, 0):
            self.agreed[peer] = count

    def describe(self, peer: int, lo: int, hi: int, theirs: tuple[int, list] | None, how: str) -> str:
        """The divergence report: the first launch in [lo, hi) where the two ranks' signatures differ.
        (Not their running hashes: those differ at every launch after the divergence, so where it
        was older than the launches kept, the first kept one was named, made alike by both.)"""
        head = (f"taskrt: control replication diverged between rank {self.rank} and rank {peer}: "
                "the ranks did not make the same launches.")
        tail = (f"  (found by rank {self.rank}: {how})\n"
                "  Every rank must make the same launches in the same order; a launch that depends on the "
                "rank (rt.rank, comm.rank, data that differs between ranks) breaks control replication.")
        mlo, mine = self.log.window(lo, hi)
        if theirs is None:
            return f"{head}\n  rank {peer} did not answer with its launches.\n{tail}"
        tlo, their = theirs
        start = max(mlo, tlo)
        for i in range(start, max(mlo + len(mine), tlo + len(their))):
            a = mine[i - mlo] if i - mlo < len(mine) else None
            b = their[i - tlo] if i - tlo < len(their) else None
            if a is None or b is None or a[1] != b[1]:
                return (f"{head}\n  launch #{i}: rank {self.rank} made {_what(a)}\n"
                        f"  launch #{i}: rank {peer} made {_what(b)}\n{tail}")
        return (f"{head}\n  the launches kept by both ranks (from #{start}) agree; the difference is older "
                f"than the last {LOG_KEEP} launches.\n{tail}")


def _what(entry) -> str:
    return "no launch (it had stopped launching)" if entry is None else entry[1]
