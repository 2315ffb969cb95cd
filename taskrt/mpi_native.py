"""Large receives posted and completed by a compiled loop that holds no GIL.

Between ranks of one node, MPICH copies a large message inside an MPI call that the
*receiver* makes (CMA), so that call should be made as soon as the message is there. A
Python progress thread needs the GIL after every copy and competes with the workers for
it; this loop, compiled by numba with `nogil=True`, posts the receives and tests them by
calling the MPI library's C functions directly, so copies go on while the workers run
Python. Python only hands a receive over (`receive`) and finishes it (`op.done(op)`, on
the finisher thread, woken by a POSIX semaphore).

Shared state, numpy arrays the loop and Python both see:
- a slot per receive in flight (SLOTS of them): header and payload buffers, peer, tag;
  `ops[slot]` is the Op that Python finishes;
- the active receives' request handles, packed (see `receive_loop`);
- `posted`, a ring of slots that Python appends to (under `lock`) and the loop takes;
- `done`, a ring of slots that the loop appends to and the finisher takes;
- `ctl`: stop flag, ring heads and tails, the MPI error (the loop stops on one).
While messages keep coming the loop spins between tests where the node has a core for it,
else naps SHARED_CORE_NAP_S; after SPIN_S without one its naps double up to 1 ms, like
the Python engine's, and with nothing in flight it sleeps on a semaphore. Used where
mpi4py's MPI is a shared library this process can call and the processor is x86-64 (stores
are seen in order by other threads); `TASKRT_MPI_NATIVE=0` turns it off.
"""
from __future__ import annotations

import ctypes
import os
import platform
import threading
import traceback
from typing import Callable

import numba
import numpy as np
from llvmlite import ir
from mpi4py import MPI
from numba import types
from numba.extending import intrinsic

from .machine import switched_off
from .mpi_progress import MAX_NAP_S, SHARED_CORE_NAP_S, SPIN_NAP_S, SPIN_S, precise_sleeps

SLOTS = 128  # receives in flight at once; Testsome scans every slot's handles, so not many
MAX_BYTES = 2**31 - 1  # an MPI count is a C int
# ctl fields
STOP, POST_HEAD, POST_TAIL, DONE_HEAD, ERROR, ERROR_SLOT, EXITED, ACTIVE, ERROR_COUNT = range(9)


@intrinsic
def c_call(typingctx, address, args):
    """Call the C function at `address` with the integers in tuple `args`; its int result."""
    if not isinstance(address, types.Integer) or not isinstance(args, types.BaseTuple):
        return None
    if not all(isinstance(a, types.Integer) for a in args):
        return None

    def codegen(context, builder, signature, llargs):
        addr, tup = llargs
        values = [builder.extract_value(tup, i) for i in range(len(args))]
        fnty = ir.FunctionType(ir.IntType(32), [v.type for v in values])
        return builder.call(builder.inttoptr(addr, fnty.as_pointer()), values)

    return types.int32(address, args), codegen


@intrinsic
def fence(typingctx):
    """A full memory barrier: what was written before it is seen before what comes after."""
    def codegen(context, builder, signature, llargs):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.none(), codegen


@numba.njit(nogil=True, cache=True)
def _now(fns, ts) -> float:
    c_call(fns[4], (np.int32(1), ts.ctypes.data))  # clock_gettime(CLOCK_MONOTONIC, ts)
    return ts[0] + ts[1] * 1e-9


@numba.njit(nogil=True, cache=True)
def receive_loop(fns, comms, handles, at, hdr_addr, data_addr, nbytes, peer, tag, left, posted, done, ctl,
                 statuses, indices, outcount, sems, spin, spin_s, nap_s, max_nap_s, undefined, byte):
    """Post the receives Python hands over (a header and a payload each), test them until
    they end, hand ended slots back.

    The requests in flight are kept packed: active receive k (k < ctl[ACTIVE]) is slot at[k]
    with its header and payload requests at handles[2k], handles[2k+1], so that Testsome
    scans only those. fns: MPI_Irecv, MPI_Testsome, sem_post, sem_wait, clock_gettime,
    nanosleep; comms: the header and payload communicators; sems: the post and done semaphores. While messages came in
    the last `spin_s`, the loop spins if `spin`, else naps `nap_s` between tests; after
    that its naps double up to `max_nap_s`."""
    irecv, testsome, sem_post, sem_wait, nanosleep = fns[0], fns[1], fns[2], fns[3], fns[5]
    ring = posted.shape[0]
    ts = np.zeros(2, np.int64)
    nap_ts = np.zeros(2, np.int64)
    active = 0
    last = _now(fns, ts)
    nap = nap_s
    while ctl[STOP] == 0 or active > 0 or ctl[POST_TAIL] < ctl[POST_HEAD]:
        while ctl[POST_TAIL] < ctl[POST_HEAD]:
            fence()
            s = posted[ctl[POST_TAIL] % ring]
            h = handles[2 * active:2 * active + 2]
            err = c_call(irecv, (hdr_addr[s], np.int32(4), byte[1], np.int32(peer[s]), np.int32(tag[s]),
                                 comms[0], h.ctypes.data))
            if err == 0:
                err = c_call(irecv, (data_addr[s], np.int32(nbytes[s]), byte[0], np.int32(peer[s]),
                                     np.int32(tag[s]), comms[1], h.ctypes.data + h.itemsize))
            if err != 0:
                ctl[ERROR], ctl[ERROR_SLOT], ctl[EXITED] = err, s, 1
                c_call(sem_post, (sems[1],))
                return
            at[active] = s
            left[s] = 2
            active += 1
            ctl[ACTIVE] = active
            ctl[POST_TAIL] += 1
            last = _now(fns, ts)
        if active == 0:
            c_call(sem_wait, (sems[0],))
            continue
        err = c_call(testsome, (np.int32(2 * active), handles.ctypes.data, outcount.ctypes.data,
                                indices.ctypes.data, statuses.ctypes.data))
        if err != 0:
            ctl[ERROR], ctl[ERROR_SLOT], ctl[EXITED] = err, -1, 1
            ctl[ERROR_COUNT] = outcount[0] if outcount[0] != undefined else 0  # indices/statuses say which
            c_call(sem_post, (sems[1],))
            return
        n = outcount[0]
        if n > 0 and n != undefined:
            for j in range(n):
                s = at[indices[j] // 2]
                left[s] -= 1
                if left[s] == 0:
                    done[ctl[DONE_HEAD] % ring] = s
                    fence()
                    ctl[DONE_HEAD] += 1
                    c_call(sem_post, (sems[1],))
            k = 0
            while k < active:  # pack: the last active receive moves into an ended one's place
                if left[at[k]] == 0:
                    active -= 1
                    at[k] = at[active]
                    handles[2 * k] = handles[2 * active]
                    handles[2 * k + 1] = handles[2 * active + 1]
                else:
                    k += 1
            ctl[ACTIVE] = active
            last = _now(fns, ts)
            nap = nap_s
        else:
            quiet = _now(fns, ts) - last > spin_s
            if quiet or not spin:
                nap_ts[1] = np.int64(nap * 1e9)
                c_call(nanosleep, (nap_ts.ctypes.data, np.int64(0)))
            if quiet:
                nap = min(max_nap_s, nap * 2)
    ctl[EXITED] = 1
    c_call(sem_post, (sems[1],))


def _libmpi() -> ctypes.CDLL | None:
    """The MPI library mpi4py loaded (found in this process's memory map), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps}
    except OSError:
        return None
    for path in sorted(p for p in paths if os.path.basename(p).startswith("libmpi") and ".so" in p):
        try:
            lib = ctypes.CDLL(path)
            lib.MPI_Irecv, lib.MPI_Testsome
            return lib
        except (OSError, AttributeError):
            continue
    return None


def available() -> str | None:
    """None when the native loop can run here, else why not."""
    if switched_off("TASKRT_MPI_NATIVE"):
        return "TASKRT_MPI_NATIVE=0"
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"{platform.machine()} may reorder stores between threads"
    if MPI._sizeof(MPI.Request) not in (4, 8) or MPI._sizeof(MPI.Comm) not in (4, 8):
        return "MPI handles of unexpected size"
    if _libmpi() is None:
        return "the MPI library is not a shared library this process can find"
    return None


def _address(function) -> int:
    """Where a ctypes function's C code starts, for `c_call`."""
    return ctypes.cast(function, ctypes.c_void_p).value


def _handles(values) -> np.ndarray:
    """MPI handles as the C library holds them: 32-bit ints (MPICH) or pointers; mpi4py
    gives them as unsigned Python ints, some sign-extended to 64 bits."""
    if MPI._sizeof(MPI.Request) == 4:
        return np.array([v & 0xFFFF_FFFF for v in values], np.uint32).view(np.int32)
    return np.array([v & 0xFFFF_FFFF_FFFF_FFFF for v in values], np.uint64).view(np.int64)


class NativeReceives:
    """Receives of a header and a data buffer, posted and tested by `receive_loop` on a thread
    of its own; `finish(op)` (the Progress engine's) runs on the finisher thread as each ends.
    On an MPI error the loop stops: `failed(op, error_code)` for each receive that failed,
    or `fatal(text)` when it cannot tell which. `spin`: spin between tests while messages
    come (the node has a core for the loop), rather than nap."""

    def __init__(self, name: str, hdr_comm, data_comm, finish: Callable, failed: Callable,
                 fatal: Callable[[str], None], spin: bool = True):
        self.name = name
        self.finish = finish
        self.failed = failed
        self.fatal = fatal
        lib, libc = _libmpi(), ctypes.CDLL(None)
        self.sem_wait = libc.sem_wait
        self.sem_wait.argtypes, self.sem_wait.restype = [ctypes.c_void_p], ctypes.c_int
        # sem_post never blocks: called keeping the GIL (PyDLL), so the caller does not queue for it again
        self.sem_post = ctypes.PyDLL(None).sem_post
        self.sem_post.argtypes, self.sem_post.restype = [ctypes.c_void_p], ctypes.c_int
        self.fns = np.array([_address(f) for f in (lib.MPI_Irecv, lib.MPI_Testsome, libc.sem_post, libc.sem_wait,
                                                    libc.clock_gettime, libc.nanosleep)], np.int64)
        self.comms = _handles([hdr_comm.handle, data_comm.handle])
        self.byte = _handles([MPI.BYTE.handle, MPI.INT64_T.handle])
        self.null = _handles([MPI.REQUEST_NULL.handle])[0]
        self.handles = np.full(2 * SLOTS, self.null, self.null.dtype)
        self.at = np.zeros(SLOTS, np.int64)
        self.hdr_addr = np.zeros(SLOTS, np.int64)
        self.data_addr = np.zeros(SLOTS, np.int64)
        self.nbytes = np.zeros(SLOTS, np.int64)
        self.peer = np.zeros(SLOTS, np.int64)
        self.tag = np.zeros(SLOTS, np.int64)
        self.left = np.zeros(SLOTS, np.int64)
        self.posted = np.zeros(SLOTS, np.int64)
        self.done = np.zeros(SLOTS, np.int64)
        self.ctl = np.zeros(9, np.int64)
        self.status_size = MPI._sizeof(MPI.Status)
        self.statuses = np.zeros(2 * SLOTS * self.status_size, np.uint8)
        self.indices = np.zeros(2 * SLOTS, np.int32)
        self.outcount = np.zeros(1, np.int32)
        self._sem_mem = np.zeros((2, 8), np.int64)  # two sem_t (32 bytes each on Linux)
        for i in range(2):
            if libc.sem_init(ctypes.c_void_p(self._sem_mem[i].ctypes.data), 0, 0) != 0:
                raise OSError(f"sem_init failed for {name}")
        self.sems = np.array([self._sem_mem[0].ctypes.data, self._sem_mem[1].ctypes.data], np.int64)
        self.post_sem, self.done_sem = (int(a) for a in self.sems)
        self.ops: list = [None] * SLOTS
        self.free = list(range(SLOTS - 1, -1, -1))
        self.lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._taken = 0
        self._args = (self.fns, self.comms, self.handles, self.at, self.hdr_addr, self.data_addr, self.nbytes,
                      self.peer, self.tag, self.left, self.posted, self.done, self.ctl, self.statuses, self.indices,
                      self.outcount, self.sems, spin, SPIN_S, SPIN_NAP_S if spin else SHARED_CORE_NAP_S, MAX_NAP_S,
                      MPI.UNDEFINED, self.byte)
        # compiled (or loaded from numba's cache) now, at start-up, not in the middle of a run
        receive_loop.compile(tuple(numba.typeof(a) for a in self._args))

    def _start(self) -> None:
        """Start the loop and the finisher, at the first receive: a program without large
        receives runs no extra threads."""
        for target, suffix in ((self._loop, "-native"), (self._finisher, "-finish")):
            t = threading.Thread(target=target, name=self.name + suffix, daemon=True)
            t.start()
            self._threads.append(t)

    def receive(self, op, header: np.ndarray, target: np.ndarray, peer: int, tag: int) -> bool:
        """Hand over a receive of `header` (4 int64) and `target` from `peer` with `tag`;
        False when every slot is taken (the caller posts it another way)."""
        if target.nbytes > MAX_BYTES:
            return False
        with self.lock:
            if not self.free:
                return False
            if not self._threads:
                self._start()
            s = self.free.pop()
            self.ops[s] = (op, header, target)
            self.hdr_addr[s] = header.ctypes.data
            self.data_addr[s] = target.ctypes.data
            self.nbytes[s] = target.nbytes
            self.peer[s] = peer
            self.tag[s] = tag
            self.posted[self.ctl[POST_HEAD] % SLOTS] = s
            self.ctl[POST_HEAD] += 1
        self.sem_post(self.post_sem)
        return True

    def stop(self) -> None:
        """Once what was posted has ended: end the loop and the finisher."""
        self.ctl[STOP] = 1
        self.sem_post(self.post_sem)
        for t in self._threads:
            t.join()

    def _loop(self) -> None:
        precise_sleeps()
        receive_loop(*self._args)

    def _finisher(self) -> None:
        try:
            while True:
                self.sem_wait(self.done_sem)
                while self._taken < self.ctl[DONE_HEAD]:
                    s = int(self.done[self._taken % SLOTS])
                    self._taken += 1
                    op, _, _ = self.ops[s]
                    with self.lock:
                        self.ops[s] = None
                        self.free.append(s)
                    self.finish(op)
                if self.ctl[ERROR]:
                    self._report_error()
                    return
                if self.ctl[EXITED] and self._taken == self.ctl[DONE_HEAD]:
                    return
        except BaseException:
            self.fatal(f"taskrt: the MPI receive finisher {self.name} failed\n{traceback.format_exc()}")

    def _report_error(self) -> None:
        """The loop stopped on an MPI error: tell `failed` which receives it was, from the
        slot that failed to post, or from the error field of Testsome's statuses."""
        code = int(self.ctl[ERROR])
        found = []
        if self.ctl[ERROR_SLOT] >= 0:
            found.append((int(self.ctl[ERROR_SLOT]), code))
        elif code == MPI.ERR_IN_STATUS:
            offset = _status_error_offset()
            for j in range(int(self.ctl[ERROR_COUNT])):
                at = j * self.status_size + offset
                error = int(self.statuses[at:at + 4].view(np.int32)[0])
                if error != MPI.SUCCESS:
                    found.append((int(self.at[self.indices[j] // 2]), error))
        for slot, error in found:
            self.failed(self.ops[slot][0], error)
        if not found:
            self.fatal(f"taskrt: rank {MPI.COMM_WORLD.rank}: MPI error {code} in the native receive loop: "
                       f"{MPI.Get_error_string(code)}")


def _status_error_offset() -> int:
    """Where MPI_ERROR sits in this MPI's MPI_Status (implementations order the fields differently)."""
    status = MPI.Status()
    status.source, status.tag, status.error = 0x1234567, 0x2345678, 0x3456789
    raw = np.frombuffer(bytes(status.tomemory()), np.uint8)
    for at in range(0, raw.nbytes - 3, 4):
        if int(raw[at:at + 4].view(np.int32)[0]) == 0x3456789:
            return at
    raise RuntimeError("cannot find MPI_ERROR in this MPI's MPI_Status")
