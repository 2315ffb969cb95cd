"""taskrt: a Legion-style task runtime in Python.

Regions are logical tensors; partitions split them into sub-rects; tasks name the data
they touch with privileges; the runtime finds the parallelism, moves the data and
traces everything. See README.md.
"""
from .jit_cache import refresh as _refresh_jit_cache

_refresh_jit_cache(__file__)   # before any kernel loads its cache

from .executor import TaskError
from .geometry import Rect
from .launch import Future, FutureMap, Requirement, req
from .machine import Machine, Memory, Processor
from .mapper import DefaultMapper, Mapper
from .privilege import READ, READ_WRITE, WRITE, Privilege, Reduce
from .region import Partition, Region
from .replay import ReplayMismatch
from .runtime import Runtime, TaskContext
from .taskgraph import CopyNode, TaskGraph, TaskNode

__all__ = [
    "Rect", "Region", "Partition", "Privilege", "READ", "WRITE", "READ_WRITE", "Reduce", "Requirement", "req",
    "Runtime", "TaskContext", "Future", "FutureMap", "TaskError", "Machine", "Memory", "Processor", "Mapper",
    "DefaultMapper", "TaskGraph", "TaskNode", "CopyNode", "ReplayMismatch",
]
