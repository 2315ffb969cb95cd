"""The task graph: point tasks and copies as nodes, dependencies as edges.

Node ids are given in program order, so every edge runs from a smaller id to a
larger one and the id order is a topological order. The executor runs a graph;
the simulator replays the same graph against a cost model; nothing here executes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .geometry import Rect
from .machine import Memory, Processor
from .privilege import Privilege
from .region import Region


@dataclass(frozen=True)
class PhysicalReq:
    """One requirement of a point task as mapped: region, rect, privilege, memory."""

    region: Region
    rect: Rect
    privilege: Privilege
    memory: Memory

    def __repr__(self) -> str:
        return f"{self.privilege!r} {self.region.name}{self.rect!r}@{self.memory}"


@dataclass(eq=False)
class TaskNode:
    """A point task: run `fn` on processor `proc` with the views its requirements name."""

    id: int
    name: str
    proc: Processor
    fn: Callable | None
    reqs: tuple[PhysicalReq, ...]
    args: tuple = ()
    point: tuple = ()
    launch: int = -1
    op: str = ""
    kind: str = "task"
    future: object = None

    @property
    def where(self):
        return self.proc

    @property
    def rank(self) -> int:
        return self.proc.rank

    @property
    def nbytes(self) -> int:
        return sum(r.rect.volume * r.region.dtype.itemsize for r in self.reqs)

    def __repr__(self) -> str:
        return f"TaskNode#{self.id}({self.name}{list(self.point)} on {self.proc})"


@dataclass(eq=False)
class CopyNode:
    """Move `rect` of `region` from `src` to `dst`. With `redop`, fold the reduction buffer
    of task `buffer` (its requirement `buffer_req`) into dst instead of copying."""

    id: int
    region: Region
    rect: Rect
    src: Memory
    dst: Memory
    redop: str | None = None
    buffer: tuple[int, int] | None = None
    launch: int = -1
    op: str = ""

    @property
    def kind(self) -> str:
        return "reduce" if self.redop else "copy"

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.region.name}"

    @property
    def where(self) -> Memory:
        return self.dst

    @property
    def rank(self) -> int:
        return self.dst.rank

    @property
    def nbytes(self) -> int:
        return self.rect.volume * self.region.dtype.itemsize

    @property
    def crosses_ranks(self) -> bool:
        return self.src.rank != self.dst.rank

    def __repr__(self) -> str:
        what = f"fold({self.redop}) of task {self.buffer[0]}" if self.redop else "copy"
        return f"CopyNode#{self.id}({what} {self.region.name}{self.rect!r} {self.src}->{self.dst})"


Node = TaskNode | CopyNode


@dataclass
class TaskGraph:
    """Nodes by id and the ids each node waits for. With `keep` false nothing is stored (the
    executor holds what is in flight), so a long run does not grow without bound."""

    nodes: dict[int, Node] = field(default_factory=dict)
    preds: dict[int, tuple[int, ...]] = field(default_factory=dict)
    keep: bool = True

    def add(self, node: Node, preds) -> None:
        if self.keep:
            self.nodes[node.id] = node
            self.preds[node.id] = tuple(sorted(preds))

    def __len__(self) -> int:
        return len(self.nodes)

    def edges(self):
        for nid, ps in self.preds.items():
            for p in ps:
                yield p, nid

    def successors(self) -> dict[int, list[int]]:
        succ: dict[int, list[int]] = {nid: [] for nid in self.nodes}
        for p, n in self.edges():
            if p in succ:
                succ[p].append(n)
        return succ

    def tasks(self) -> list[TaskNode]:
        return [n for n in self.nodes.values() if isinstance(n, TaskNode)]

    def copies(self) -> list[CopyNode]:
        return [n for n in self.nodes.values() if isinstance(n, CopyNode)]

    def summary(self) -> str:
        return f"TaskGraph({len(self.tasks())} tasks, {len(self.copies())} copies, {sum(1 for _ in self.edges())} edges)"

    def critical_path_length(self) -> int:
        """Nodes on the longest dependence chain (ids are a topological order)."""
        depth: dict[int, int] = {}
        for nid in sorted(self.nodes):
            depth[nid] = 1 + max((depth.get(p, 0) for p in self.preds[nid]), default=0)
        return max(depth.values(), default=0)
