"""A kernel's batch split over the cores its task has, each part on one thread with BLAS on
one thread too.

The runtime gives each CPU worker its share of the cores as BLAS's thread count (see
taskrt.runtime.limit_blas_threads). A kernel that makes many BLAS calls waits for all of
BLAS's threads at every call, and badly so while another process holds a core; cut into one
part per core instead, each part's calls run on its own thread and the kernel waits for the
cores once.
"""
from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

_lock = threading.Lock()
_state: dict = {"users": 0, "threads": 1}


def blas_libraries() -> list:
    """numpy's BLAS libraries as threadpoolctl controls them, found once (the lock only then:
    every kernel asks, from every worker thread)."""
    libraries = _state.get("blas")
    if libraries is None:
        with _lock:
            if "blas" not in _state:
                import numpy  # noqa: F401 - loads the BLAS that threadpoolctl then finds
                from threadpoolctl import ThreadpoolController

                _state["blas"] = ThreadpoolController().select(user_api="blas").lib_controllers
            libraries = _state["blas"]
    return libraries


def threads() -> int:
    """The threads BLAS may use now: the cores of the running task (1 where no BLAS is found)."""
    return max([lib.get_num_threads() for lib in blas_libraries()] + [1])


@contextlib.contextmanager
def blas_on_one_thread():
    """BLAS on one thread while inside; yields the threads it had before. Of concurrent users
    the first sets it and the last restores it."""
    libraries = blas_libraries()
    with _lock:
        if _state["users"] == 0:
            _state["threads"] = max([lib.get_num_threads() for lib in libraries] + [1])
            for lib in libraries:
                lib.set_num_threads(1)
        _state["users"] += 1
        before = _state["threads"]
    try:
        yield before
    finally:
        with _lock:
            _state["users"] -= 1
            if _state["users"] == 0:
                for lib in libraries:
                    lib.set_num_threads(_state["threads"])


def _pool() -> ThreadPoolExecutor:
    with _lock:
        if "pool" not in _state:
            _state["pool"] = ThreadPoolExecutor(max(1, (os.cpu_count() or 1) - 1), thread_name_prefix="cpu_pool")
        return _state["pool"]


def in_parts(work, n: int, most: int | None = None) -> list:
    """[work(a, b) for the ranges [a, b) that split [0, n) evenly, one per thread BLAS may use
    (at most `most`)], in order. With more than one part each runs on its own thread (the caller
    runs the first) with BLAS on one thread; an exception of any part is raised once all are
    done."""
    cap = n if most is None else min(n, most)
    if min(cap, threads()) <= 1:
        return [work(0, n)]
    with blas_on_one_thread() as cores:
        parts = min(cap, cores)
        cuts = [n * i // parts for i in range(parts + 1)]
        others = [_pool().submit(work, a, b) for a, b in zip(cuts[1:-1], cuts[2:])]
        results, errors = [], []
        try:
            results.append(work(cuts[0], cuts[1]))
        except BaseException as e:  # noqa: BLE001 - re-raised below, once the other parts are done
            errors.append(e)
        for job in others:
            try:
                results.append(job.result())
            except BaseException as e:  # noqa: BLE001 - as above
                errors.append(e)
        if errors:
            raise errors[0]
        return results
