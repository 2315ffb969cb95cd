"""How many cores a CPU kernel uses (ops/cpu_threads.py): the threshold, the chunks, and a
RowKernel's serial and parallel compilations agreeing."""
from __future__ import annotations

import numba
import numpy as np
from threadpoolctl import threadpool_limits

from ops import cpu_threads
from ops.cpu_threads import RowKernel, row_split, task_threads, use_task_threads


def test_a_task_has_the_threads_blas_has():
    for threads in (1, 2):
        with threadpool_limits(limits=threads, user_api="blas"):
            assert task_threads() == min(threads, numba.config.NUMBA_NUM_THREADS)


def test_kernels_below_the_threshold_run_on_one_thread(monkeypatch):
    monkeypatch.setattr(cpu_threads, "PARALLEL_MIN_VALUES", 100)
    with threadpool_limits(limits=2, user_api="blas"):
        assert use_task_threads(99) == 1
        assert use_task_threads(100) == task_threads()
        threads, chunks = row_split(50, 2)
        assert (threads, chunks) == (task_threads(), min(50, 4 * task_threads()))
        assert row_split(3, 40) == (task_threads(), 3)   # no more chunks than rows
        assert row_split(10, 2) == (1, 4)


@RowKernel
def _scaled_rows(x, k, out, chunks):
    """out = k * x, rows cut into chunks (a kernel of the RowKernel shape, for the test)."""
    rows = x.shape[0]
    for c in numba.prange(chunks):
        for r in range(c * rows // chunks, (c + 1) * rows // chunks):
            out[r] = k * x[r]


def test_a_row_kernel_gives_the_same_serial_and_parallel():
    x = np.random.default_rng(0).standard_normal((37, 5))
    outs = []
    for kernel in (_scaled_rows.on(1), _scaled_rows.on(2)):
        out = np.full_like(x, np.nan)
        kernel(x, 3.0, out, 7)
        outs.append(out)
    np.testing.assert_array_equal(outs[0], 3.0 * x)
    np.testing.assert_array_equal(outs[1], 3.0 * x)
    assert _scaled_rows.on(1) is _scaled_rows.serial and _scaled_rows.on(2) is _scaled_rows.parallel
    assert _scaled_rows.serial.py_func.__name__ == "_scaled_rows_serial"   # its own cache entry
