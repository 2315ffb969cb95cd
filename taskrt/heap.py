"""How a process that runs the runtime manages its memory: freed buffers kept for the next
task (glibc's malloc settings), and Python's cycle collector run less often.

A training step allocates and frees the same large arrays every time: outputs, im2col
columns, gradients. By default glibc returns a freed block of more than 128 KiB to the
kernel (and, once it has adjusted, trims the top of the heap), so the next step's allocation
of the same size faults its pages in again: 1,260 page faults a step on the small CNN of
bench/scaling.py, about 4 us each on a virtual machine, 12-15% of the worker's CPU. With a
high mmap threshold and trim threshold the blocks stay in the heap and are reused.

Setting either threshold turns off glibc's dynamic adjustment of both, so both are set. A
block above the mmap threshold (at most 32 MiB on 64-bit glibc) is still mapped per
allocation. The process keeps up to TRIM_BYTES of free heap per arena instead of returning
it. Elsewhere than glibc there is nothing to set.

Python's cycle collector runs a young-generation pass every 700 allocations more than
frees, and every tenth of those an older one: a replayed training step makes thousands of
short-lived nodes, futures and tuples (freed by reference counting, hardly ever in cycles),
so a step of tiny Inception-v3 paid about 200 young, 19 middle and 2 full collections of the
250,000 objects alive, a full one about 150 ms with the GIL held: 10-20% of the step.
`collect_cycles_less` raises the young threshold to YOUNG_THRESHOLD, where the user has not
set the thresholds themselves. TASKRT_KEEP_HEAP=0 leaves malloc and the collector as they are.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys

from .machine import switched_off

MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest: HEAP_MAX_SIZE / 2 on 64-bit
TRIM_BYTES = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # from glibc's malloc.h
YOUNG_THRESHOLD = 10_000
_DEFAULT_GC_THRESHOLDS = (700, 10, 10)

_state = {"done": False}


def keep_freed_memory() -> bool:
    """Once per process: raise glibc's mmap and trim thresholds (see the module's docstring).
    True if they are set (now or before), False where malloc is not glibc's or the user said
    TASKRT_KEEP_HEAP=0."""
    if _state["done"]:
        return True
    if switched_off("TASKRT_KEEP_HEAP") or not sys.platform.startswith("linux"):
        return False
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES) == 1 and ok
    _state["done"] = ok
    return ok


def collect_cycles_less() -> bool:
    """Raise the cycle collector's young threshold to YOUNG_THRESHOLD (see the module's
    docstring), unless TASKRT_KEEP_HEAP=0 or the thresholds are not Python's defaults (the
    user chose them). True if the threshold is YOUNG_THRESHOLD now."""
    current = gc.get_threshold()
    if current[0] == YOUNG_THRESHOLD:
        return True
    if switched_off("TASKRT_KEEP_HEAP") or current != _DEFAULT_GC_THRESHOLDS:
        return False
    gc.set_threshold(YOUNG_THRESHOLD, *current[1:])
    return True


def _glibc():
    """The C library, if it is glibc (it has gnu_get_libc_version); else None (musl, say)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc
