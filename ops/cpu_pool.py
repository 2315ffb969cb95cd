"""Numba (nogil) kernels split over the threads BLAS may use, so that a kernel's own passes run
on the cores numpy's matmul runs on beside them: one BLAS thread (the runtime's share of the
cores for each CPU worker, see taskrt.runtime.limit_blas_threads) runs them in the caller
alone; more split them over a shared pool.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_lock = threading.Lock()
_state: dict = {}


def _blas():
    """The BLAS library controller of numpy (threadpoolctl), found once."""
    with _lock:
        if "blas" not in _state:
            import numpy  # noqa: F401 - loads the BLAS that threadpoolctl then finds
            from threadpoolctl import ThreadpoolController

            found = ThreadpoolController().select(user_api="blas").lib_controllers
            _state["blas"] = found[0] if found else None
        return _state["blas"]


def threads() -> int:
    """How many threads BLAS may use now (1 where no BLAS is found)."""
    blas = _blas()
    return max(1, blas.get_num_threads()) if blas is not None else 1


def _pool() -> ThreadPoolExecutor:
    with _lock:
        if "pool" not in _state:
            _state["pool"] = ThreadPoolExecutor(max(1, (os.cpu_count() or 1) - 1), thread_name_prefix="cpu_pool")
        return _state["pool"]


def split(fn, n: int) -> None:
    """fn(a, b) for ranges [a, b) that split [0, n) evenly over threads() threads (the caller
    runs the first); an exception in any of them is raised here once all are done."""
    parts = min(threads(), n)
    if parts <= 1:
        if n:
            fn(0, n)
        return
    cuts = [n * i // parts for i in range(parts + 1)]
    others = [_pool().submit(fn, a, b) for a, b in zip(cuts[1:-1], cuts[2:])]
    errors = []
    try:
        fn(cuts[0], cuts[1])
    except BaseException as e:  # noqa: BLE001 - re-raised below, once the other parts are done
        errors.append(e)
    for f in others:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001 - as above
            errors.append(e)
    if errors:
        raise errors[0]
