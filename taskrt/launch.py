"""What a program hands the runtime: requirements, and the futures it gets back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .geometry import Rect
from .privilege import Privilege, as_privilege, reduction_problem
from .region import Partition, Region


@dataclass(frozen=True)
class Requirement:
    """A region (whole, one rect, or a partition read through a projection) and a privilege.

    In an index launch a partition requirement gives point p the sub-rect of color
    projection(p) (identity by default); a region or rect requirement gives every point
    the same rect (all points reading the weights, or all reducing into one gradient).
    """

    region: Region
    privilege: Privilege
    rect: Rect | None = None
    partition: Partition | None = None
    projection: Callable | None = None
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        # part of the key of every kept launch mapping: hashed once
        object.__setattr__(self, "_hash", hash((self.region, self.privilege, self.rect, self.partition,
                                                self.projection)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (Requirement, (self.region, self.privilege, self.rect, self.partition, self.projection))

    def __repr__(self) -> str:
        target = self.partition.name if self.partition is not None else f"{self.region.name}{self.rect_or_all!r}"
        return f"Requirement({self.privilege!r} {target})"

    @property
    def rect_or_all(self) -> Rect:
        return self.rect if self.rect is not None else self.region.rect

    def rect_for(self, point: tuple) -> Rect:
        if self.partition is None:
            return self.rect_or_all
        color = point if self.projection is None else self.projection(point)
        if not isinstance(color, tuple):
            color = (color,)
        rect = self.partition.rects.get(color)
        if rect is None:
            raise ValueError(f"{self!r}: point {point} projects to color {color}, which is not in "
                             f"{self.partition!r}")
        return rect

    def key(self) -> tuple:
        """What identifies this requirement when checking that a replayed launch repeats."""
        target = self.partition.key if self.partition is not None else self.rect_or_all
        return (self.region.uid, target, self.privilege, self.projection)


def check_launch(name: str, fn, points, reqs) -> None:
    """A launch's function, requirements and domain, refused by name before anything is issued
    (Runtime.index_launch and taskrt.program.Launch alike)."""
    if fn is not None and not callable(fn):
        raise TypeError(f"a task must be callable, got {type(fn).__name__}: {fn!r}")
    for i, r in enumerate(reqs):
        if not isinstance(r, Requirement):
            raise TypeError(f"launch {name!r}: requirement {i} must be a Requirement (use taskrt.req), "
                            f"got {type(r).__name__}: {r!r}")
    if not points:
        raise ValueError(f"launch {name!r}: empty launch domain")


def req(target, privilege, rect: Rect | None = None, projection: Callable | None = None) -> Requirement:
    """Requirement on a Region (whole or `rect` of it) or a Partition, checked at once."""
    privilege = as_privilege(privilege)
    region = target.region if isinstance(target, Partition) else target
    if privilege.is_reduce and isinstance(region, Region):
        problem = reduction_problem(privilege.redop, region.dtype)
        if problem is not None:
            raise ValueError(f"a requirement on {region!r}: {problem}")
    if isinstance(target, Partition):
        if rect is not None:
            raise ValueError(f"give a rect or a partition, not both ({target!r}, {rect!r})")
        if projection is not None and not callable(projection):
            raise TypeError(f"a projection maps a launch point to a color of {target!r}: a function, got "
                            f"{type(projection).__name__} {projection!r}")
        return Requirement(target.region, privilege, partition=target, projection=projection)
    if isinstance(target, Region):
        if rect is not None:
            target.check_rect(rect)
        if projection is not None:
            raise ValueError(f"a projection needs a partition, got region {target!r}")
        return Requirement(target, privilege, rect=rect)
    raise TypeError(f"a requirement names a Region or a Partition, got {type(target).__name__}: {target!r}")


class Future:
    """The result of one point task; `get()` waits for it and re-raises the task's error.
    `rank` is the rank whose processor runs the task: on any other rank `get()` asks that
    rank for the value (taskrt/mpi.py). `_replicated` is false for a future that only its
    own rank holds (a rank's point of `Runtime.read`): nobody else will ask for it."""

    __slots__ = ("_runtime", "node_id", "rank", "_value", "_has_value", "_replicated", "_lost", "__weakref__")

    def __init__(self, runtime, node_id: int, rank: int = 0):
        self._runtime = runtime
        self.node_id = node_id
        self.rank = rank
        self._has_value = False
        self._value = None
        self._replicated = True
        self._lost: str | None = None   # the task's name, where it failed or was skipped after a failure

    def _set(self, value) -> None:
        self._value = value
        self._has_value = True

    def _lose(self, task: str) -> None:
        """The task failed or was skipped after a failure: it has no value, now or after recover."""
        self._lost = task

    def _check_lost(self) -> None:
        if self._lost is not None:
            raise RuntimeError(f"the value of task {self._lost!r} (node #{self.node_id}) is lost: the task failed or "
                               f"was skipped after a failure")

    def done(self) -> bool:
        """The value is here (for a task of another rank: has arrived; asking starts it)."""
        return self._has_value or self._runtime._future_done(self)

    def get(self, timeout: float | None = None):
        if not self._has_value:
            self._runtime._wait_node(self.node_id, timeout)
        self._check_lost()
        self._runtime._resolve_future(self)
        return self._value

    def wait(self, timeout: float | None = None) -> None:
        self.get(timeout)

    def __repr__(self) -> str:
        return f"Future(node {self.node_id}, {'ready' if self._has_value else 'pending'})"


class FutureMap:
    """The futures of an index launch, by point."""

    def __init__(self, futures: dict[tuple, Future]):
        self.futures = futures

    def __getitem__(self, point) -> Future:
        return self.futures[point if isinstance(point, tuple) else (point,)]

    def __iter__(self):
        return iter(self.futures)

    def __len__(self) -> int:
        return len(self.futures)

    def get(self, timeout: float | None = None) -> dict[tuple, object]:
        if self.futures:
            next(iter(self.futures.values()))._runtime._prefetch(self.futures.values())
        return {p: f.get(timeout) for p, f in self.futures.items()}

    def wait(self, timeout: float | None = None) -> None:
        for f in self.futures.values():
            f.wait(timeout)

    def __repr__(self) -> str:
        return f"FutureMap({len(self.futures)} points)"
