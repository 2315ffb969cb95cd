"""How many of its task's cores a CPU kernel uses, and kernels compiled for one core and for several.

A CPU worker's task has a share of the node's cores; the runtime sets BLAS's thread count to it
(taskrt.runtime.limit_blas_threads), so that count is the task's cores. A numba kernel over
enough values shares its rows out over them with prange (RowKernel's parallel compilation);
below PARALLEL_MIN_VALUES it runs on one.
"""
from __future__ import annotations

import types

import numba
import numpy as np

from ops import cpu_pool


def task_threads() -> int:
    """The cores the running task has: the threads BLAS may use now (the runtime limits BLAS to
    each CPU worker's share of the cores), at most numba's."""
    return max(1, min(cpu_pool.threads(), numba.config.NUMBA_NUM_THREADS))


#: values below which a row kernel runs on one thread: waking a second thread costs a few tens
#: of microseconds, which pays from about 100k values (a layer norm of 512 x 768 values, forward
#: and backward, took 308 us on one thread and 200 us on two, PyTorch 288; of 256 x 768, 208
#: and 146 us; of 64 x 768, 61 and 65 us)
PARALLEL_MIN_VALUES = 1 << 17


def use_task_threads(values: int) -> int:
    """How many of the task's cores a kernel over `values` values uses (one for fewer than
    PARALLEL_MIN_VALUES), this thread's numba kernels set to them where that is more than one."""
    threads = task_threads() if values >= PARALLEL_MIN_VALUES else 1
    if threads > 1:
        numba.set_num_threads(threads)
    return threads


def batch_parts(n: int, most: int | None = None) -> tuple[int, np.ndarray]:
    """(threads, cuts) for a kernel that runs parts of a batch of n samples in a prange, one per
    core of the task (at most `most`): numba's threads set to them, and the even cuts of [0, n)
    into that many parts."""
    threads = max(1, min(n, task_threads() if most is None else min(most, task_threads())))
    if threads > 1:
        numba.set_num_threads(threads)
    return threads, np.array([n * i // threads for i in range(threads + 1)], np.int64)


def row_split(rows: int, length: int) -> tuple[int, int]:
    """(threads, chunks) for a row kernel over `rows` rows of `length`: use_task_threads, and
    how many pieces to cut the rows into, a few per thread so that they even out."""
    threads = use_task_threads(rows * length)
    return threads, max(1, min(rows, 4 * threads))


_ROW_KERNEL_OPTIONS = dict(nogil=True, cache=True, error_model="numpy", fastmath={"reassoc", "contract"})


class RowKernel:
    """A row kernel whose prange cuts the rows into `chunks` (its last argument), compiled
    twice from one function: parallel, for a task with several cores, and serial, for one. A
    parallel kernel's launch goes through numba's threading layer even on one thread, and two
    workers' launches contend there: an 8k-value layer norm took 10.8 us a call alone and
    26.9 us a call from each of two threads at once; serial, 9.5 and 6.5."""

    def __init__(self, fn):
        self.parallel = numba.njit(parallel=True, **_ROW_KERNEL_OPTIONS)(fn)
        # its own name, so that numba's cache (keyed by name, not by flags) keeps both
        serial = types.FunctionType(fn.__code__, fn.__globals__, f"{fn.__name__}_serial", fn.__defaults__,
                                    fn.__closure__)
        serial.__qualname__ = f"{fn.__qualname__}_serial"
        self.serial = numba.njit(**_ROW_KERNEL_OPTIONS)(serial)
        self.__doc__ = fn.__doc__

    def on(self, threads: int):
        """The compilation to run on `threads` threads (row_split's)."""
        return self.parallel if threads > 1 else self.serial
