"""Ranks that share a node, each bound to its own share of the node's cores.

Under a plain `mpiexec -n 2` every thread of every rank may run on any core, and the kernel's
scheduler moves them: one rank's MPI progress thread takes the core where the other rank's
worker was computing, and a worker that moves finds its data in the other core's cache. Bound
(rank i of the node on cores [i * k, (i + 1) * k), k = cores // ranks), a rank's threads share
only its own cores. Two ranks on this 2-core VM ran 10 of 12 strategies of the tiny apps
faster bound (0.84-1.00 of their time unbound, one 1.04) and most with less spread from run to
run (docs/mpi.md, "Ranks bound to cores").

A rank binds itself (`bind_rank`, when its Runtime starts) only where binding is its to do: on
Linux, with its ranks on the node no more than the node's cores, and while it may use every
core of the node (an mpiexec that bound it already, -bind-to core say, has chosen). The
binding covers the threads the process has then and, through them, those it starts later.
TASKRT_BIND_CORES=0 turns it off.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .machine import switched_off

THREADS_DIR = "/proc/self/task"
#: the binding in force in this process (bind_rank sets it, Binding.restore clears it)
_bound: list = []


def cores_problem(ranks: int) -> str | None:
    """Why `ranks` ranks of one CPU worker each cannot run on this machine (the apps give each its
    own core, apps/cli.py), or None."""
    cores = os.cpu_count() or 1
    return None if ranks <= cores else f"{ranks} ranks of one CPU worker each need {ranks} cores, this machine has {cores}"


def core_share(cores: list[int], ranks_here: list[int], rank: int) -> list[int] | None:
    """The cores of `rank` when the ranks `ranks_here` (rank among them) share `cores`: an equal
    run of them in rank order, the remainder left to none; None when there are fewer cores
    than ranks."""
    if rank not in ranks_here:
        raise ValueError(f"core_share: rank {rank} is not among the node's ranks {ranks_here}")
    share = len(cores) // len(ranks_here)
    if share == 0:
        return None
    i = sorted(ranks_here).index(rank)
    return sorted(cores)[i * share:(i + 1) * share]


@dataclass(frozen=True)
class Binding:
    """A rank bound to `cores`, from `before` (what its threads could use)."""

    cores: tuple[int, ...]
    before: tuple[int, ...]

    def restore(self) -> None:
        """Give the process's threads back the cores they had."""
        _set_all_threads(self.before)
        if self in _bound:
            _bound.remove(self)


def node_cores() -> int:
    """The cores this process may use, before bind_rank bound it where it did: what the node's
    ranks share (a BLAS or cost model share of them is counted from this)."""
    if _bound:
        return len(_bound[-1].before)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def bind_rank(machine, rank: int) -> Binding | None:
    """Bind this process (rank `rank` of `machine`) to its share of the node's cores, where that
    is its to do (see the module doc); the Binding, or None where nothing was bound."""
    if switched_off("TASKRT_BIND_CORES") or not hasattr(os, "sched_setaffinity") or not os.path.isdir(THREADS_DIR):
        return None
    ranks_here = machine.ranks_on_host(rank)
    before = sorted(os.sched_getaffinity(0))
    if len(ranks_here) < 2 or len(before) != os.cpu_count():
        return None
    cores = core_share(before, ranks_here, rank)
    if cores is None:
        return None
    _set_all_threads(cores)
    binding = Binding(tuple(cores), tuple(before))
    _bound.append(binding)
    return binding


def _set_all_threads(cores) -> None:
    """Every thread of this process on `cores` (a thread that ends meanwhile is let be)."""
    for tid in os.listdir(THREADS_DIR):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, FileNotFoundError):
            continue
