"""Programs: a fixed list of launches that a program issues again and again (a training step).

A `Launch` is an index launch as a value: what `Runtime.index_launch` takes except its args.
`Runtime.issue_program(name, launches, args)` issues launches[k] with args[k], for every k in
order, inside the replay block `name` (taskrt/replay.py). The first time, and whenever the
block cannot be replayed, the launches go through `index_launch` one by one and are recorded.
Afterwards, when the very same list (the same object) comes back, the recorded nodes are
issued again in one go (ReplayBlock.reissue): no launch is checked, mapped, keyed or matched
again, so a step costs the runtime little more than making its nodes. Only launches marked
`returns` get futures then; the others' task results are dropped.

    step = [Launch(kernel, points, (req(x, READ), req(y, WRITE)), "kernel")]
    futures = rt.issue_program("step", step, [(alpha,)])
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .launch import Future, Requirement, check_launch


@dataclass(frozen=True, eq=False)
class Launch:
    """One index launch as a value. `placement` maps points to processors (None: the mapper
    chooses); `returns`: its FutureMap is wanted (Runtime.issue_program returns None for the
    others); `releases`: regions the program needs no more once this launch is issued
    (Runtime.release)."""

    fn: Callable | None
    points: tuple
    reqs: tuple[Requirement, ...]
    name: str
    placement: dict | None = None
    op: str = ""
    returns: bool = False
    releases: tuple = ()

    def __post_init__(self):
        check_launch(self.name, self.fn, self.points, self.reqs)

    def __repr__(self) -> str:
        return f"Launch({self.name!r}, {len(self.points)} points, {len(self.reqs)} requirements)"


def check_program(launches, args) -> None:
    """One args tuple per launch, and no Future among them (a program's launches wait for
    nothing but their data): raised before anything is issued."""
    if len(args) != len(launches):
        raise ValueError(f"issue_program: {len(args)} args tuples for {len(launches)} launches")
    for k, (launch, a) in enumerate(zip(launches, args)):
        if not isinstance(launch, Launch):
            raise TypeError(f"issue_program: launch {k} must be a taskrt Launch, got {type(launch).__name__}")
        if not isinstance(a, tuple):
            raise TypeError(f"issue_program: args of launch {k} ({launch.name!r}) must be a tuple, got "
                            f"{type(a).__name__}")
        if any(type(x) is Future for x in a):
            raise TypeError(f"issue_program: args of launch {k} ({launch.name!r}) hold a Future; a program's "
                            "launches take plain values (use index_launch to wait for a future)")
