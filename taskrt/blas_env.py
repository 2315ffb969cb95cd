"""OpenBLAS's idle threads go to sleep at once instead of spinning: set before numpy loads it.

After each GEMM it ran on several threads, OpenBLAS keeps its helper threads spinning for
2**28 cycles (about a tenth of a second here) in case another GEMM follows. Work that follows
on threads of our own (attention's head groups, numba's parallel loops, the runtime's other
workers and its MPI progress thread) then shares the cores with threads that do nothing:
attention's forward + backward ran 1.35x slower for it. OpenBLAS reads the
spin time once, from OPENBLAS_THREAD_TIMEOUT, when it loads, which is when numpy is first
imported; so every package of ours sets it on import, and a process that imported numpy
first is told.
"""
from __future__ import annotations

import os
import sys
import warnings

#: OpenBLAS spins 2**THREAD_TIMEOUT cycles (about 25 us) before its idle threads sleep: enough
#: for back-to-back GEMMs, too short to hold a core that other work needs
THREAD_TIMEOUT = "16"

_LATE = ("numpy was imported before taskrt, without OPENBLAS_THREAD_TIMEOUT set: numpy's OpenBLAS, "
         "if that is its BLAS, keeps idle threads spinning for about 0.1 s after each threaded GEMM, "
         f"on cores the kernels need; import taskrt, ops or strategies before numpy, or set "
         f"OPENBLAS_THREAD_TIMEOUT={THREAD_TIMEOUT}")


def quiet_idle_threads() -> bool:
    """Set OPENBLAS_THREAD_TIMEOUT (unless the user has) for this process's BLAS and for the
    processes it starts. Returns whether it came in time for this process; warns if not."""
    if "OPENBLAS_THREAD_TIMEOUT" in os.environ:
        return True
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = THREAD_TIMEOUT
    if "numpy" in sys.modules:
        warnings.warn(_LATE, RuntimeWarning, stacklevel=3)
        return False
    return True

