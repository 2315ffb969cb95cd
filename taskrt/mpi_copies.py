"""Copies between ranks: this rank's half of each, as an executor node with the copy's id.

A copy from rank a to rank b is a SendHalf on a and a RecvHalf on b, so that whatever
waits for the copy on a rank waits for its half. A fold's reduction buffer travels and is
folded on the dst rank. A copy is two messages with the same tag (the copy's number
between the two ranks modulo TAG_UB): a 4-int header on `hdr` (copy id, launch number,
running launch hash, bytes), checked on receipt, and the payload on `data`, sent from the
instance itself when the rect is contiguous (else from a packed copy) and received in
place when it can be. A half posts its requests from whichever thread makes it ready and
returns PENDING. A large receive is posted and tested by a compiled loop that holds no GIL
(taskrt/mpi_native.py), which makes MPI's copy while the workers run Python; where that
loop cannot run, by the progress thread. (Sends stay with the progress thread: through
the loop they measured slower, 16 cores or 2.) A small message that has already ended (an
eager one) finishes at once, the others through the progress engine
(taskrt/mpi_progress.py).

State: none of its own that threads share. A half's `pending` (the Op of a receive still
to unpack) is set by the progress thread before it resumes the half on its worker, which
alone reads it; the receive loop keeps its own state under its own lock.
"""
from __future__ import annotations

import time
import traceback
from typing import Callable

import numpy as np
from mpi4py import MPI

from .backends import gpu
from .executor import PENDING
from .mpi_native import NativeReceives
from .mpi_progress import Op

#: a receive at least this large goes to the receive loop (or, without it, the progress
#: thread): MPI makes its copy (CMA reads it from the sender) inside the receiver's calls,
#: posting included, and a worker that made it would hold up its tasks for the whole copy
COPY_IN_PROGRESS_BYTES = 64 * 1024


class _Half:
    """One rank's half of a copy between ranks: an executor node with the copy's id.
    `inline`: cheap enough to post from whichever thread makes it ready; `pending` holds
    the Op of a receive whose data must still be unpacked or folded on its worker."""

    __slots__ = ("id", "copy", "where", "peer", "tag", "check", "copies", "inline", "pending")
    point = None

    def __init__(self, copies: "Copies", copy, where, peer: int, tag: int, check: tuple[int, int], inline: bool):
        self.copies = copies
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
        return self.copies.post_send(self)


class RecvHalf(_Half):
    kind = "recv"

    def run(self):
        if self.pending is None:
            return self.copies.post_recv(self)
        return self.copies.unpack_recv(self)


class Copies:
    """Posts and finishes this rank's halves (see the module doc). `found(peer, hi, how)`
    reports a divergence seen in a copy's message; `fatal(text)` ends every rank. `native`:
    large receives go to the receive loop, which with `spin` spins while messages come."""

    def __init__(self, rank: int, executor, store, progress, hdr, data, tag_ub: int, found: Callable,
                 fatal: Callable, native: bool, spin: bool):
        self.rank = rank
        self.executor = executor
        self.store = store
        self.progress = progress
        self.hdr = hdr
        self.data = data
        self.tag_ub = tag_ub
        self.found = found
        self.fatal = fatal
        self.native = NativeReceives(f"taskrt-mpi-r{rank}", hdr, data, progress.finish, self.op_failed, fatal,
                                     spin=spin) if native else None

    # ---- halves (main thread, at submit) -----------------------------------------------------
    def send(self, node, seq: int, log_hash: int, preds) -> None:
        """Submit the send half of copy `node`, this rank's copy number `seq` to its dst rank."""
        self.executor.submit(self.send_half(node, seq, log_hash), preds)

    def receive(self, node, seq: int, log_hash: int, preds) -> None:
        """Submit the receive half of copy `node`, this rank's copy number `seq` from its src rank."""
        self.executor.submit(self.recv_half(node, seq, log_hash), preds)

    def send_half(self, node, seq: int, log_hash: int) -> SendHalf:
        cheap = node.src.kind == "sys" and (node.redop is not None or contiguous(node.rect, node.region.shape))
        return SendHalf(self, node, node.src, node.dst.rank, seq % self.tag_ub, (node.launch, log_hash), cheap)

    def recv_half(self, node, seq: int, log_hash: int) -> RecvHalf:
        return RecvHalf(self, node, node.dst, node.src.rank, seq % self.tag_ub, (node.launch, log_hash), True)

    # ---- posting and finishing (workers post; the progress thread or receive loop finishes) --
    def post_send(self, half: SendHalf):
        start = time.perf_counter()
        node = half.copy
        if node.redop is None:
            data = self.store.part(node.region, node.rect, node.src, node.id)
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
            view = self.store.part(node.region, node.rect, node.dst, node.id)
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
        try:
            arrived = MPI.Request.Testall(requests)
        except MPI.Exception as exc:   # a message longer than this receive: the graphs differ
            self.op_failed(op, exc.Get_error_code())
            return PENDING
        if arrived:
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
        self.found(half.peer, max(got[1], want[1]) + 1,
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
            self.store.fold_array(node.region, node.rect, node.dst, target, node.redop, node.id)
        else:
            self.store.put(node.region, node.rect, node.dst, target, node.id)

    def unpack_recv(self, half: RecvHalf):
        """On the dst memory's worker: fold the received buffer, or copy it into place."""
        op = half.pending
        self._unpack(half.copy, op.keep[1])
        self.executor.complete(half, op.start)
        return PENDING

    # ---- MPI errors and what is awaited --------------------------------------------------------
    def request_failed(self, reqs, ops) -> None:
        """An MPI error on some request (a message longer than its receive: the graphs differ)."""
        for r, op in zip(reqs, ops):
            try:
                r.Test()
            except MPI.Exception as exc:
                self.op_failed(op, exc.Get_error_code())
                return
        receives = [op for op in ops if isinstance(op.node, RecvHalf)]
        if len(receives) == 1:   # the failed test ended its request: the one receive is what did not fit
            self.op_failed(receives[0], MPI.ERR_TRUNCATE)
            return
        if receives:   # one of them did not fit: a divergence before the latest of them (it was a bare
            # fatal error, where one receive gets the report of the launch where the ranks differ)
            node = max((op.node for op in receives), key=lambda n: n.check[0])
            self.found(node.peer, node.check[0] + 1,
                       f"the message for copy #{node.id} ({node.name} {node.copy.rect!r}) or another of the "
                       f"{len(receives)} receives tested with it from rank {node.peer} did not fit")
            return
        self.fatal(f"taskrt: rank {self.rank}: MPI error while testing {len(reqs)} requests (a message longer than "
                   f"its receive: the ranks' task graphs probably differ, as when they run different strategies)")

    def op_failed(self, op: Op, code: int) -> None:
        """MPI error `code` ended `op`: a copy's message did not fit (the graphs differ), or worse."""
        node, text = op.node, MPI.Get_error_string(code)
        if isinstance(node, _Half):
            self.found(node.peer, node.check[0] + 1,
                       f"the message for copy #{node.id} ({node.name} {node.copy.rect!r}, "
                       f"{node.nbytes} bytes) from rank {node.peer} did not fit: {text}")
        else:
            self.fatal(f"taskrt: rank {self.rank}: MPI error on {node!r}: {text}")

    def waiting_for(self) -> list[str]:
        """The copies this rank has posted and not received, for the stuck report."""
        ex = self.executor
        return [f"copy #{node.id} from rank {node.peer}" for node in list(ex.unfinished.values())
                if isinstance(node, RecvHalf) and node.id not in ex.waiting]

    def stop(self) -> None:
        """Once what was posted has ended: stop the receive loop."""
        if self.native is not None:
            self.native.stop()


def contiguous(rect, shape) -> bool:
    """Whether `rect` of a C-ordered array of `shape` is one contiguous run of memory."""
    d, n = 0, len(shape)
    while d < n and rect.hi[d] - rect.lo[d] == 1:
        d += 1
    return all(rect.lo[k] == 0 and rect.hi[k] == shape[k] for k in range(d + 1, n))


def _host_contiguous(a) -> np.ndarray:
    if isinstance(a, np.ndarray):
        return a if a.flags.c_contiguous else np.ascontiguousarray(a)
    return gpu.to_numpy(a)
