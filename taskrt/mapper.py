"""Mappers decide which processor runs each point task, and so where its data lives."""
from __future__ import annotations

from typing import Sequence

from .machine import Machine, Processor


class Mapper:
    """Interface: pick a processor for point `point` of a launch over `domain` (a list of colors)."""

    def select_processor(self, machine: Machine, launch_name: str, point: tuple, domain: Sequence[tuple],
                         index: int) -> Processor:
        raise NotImplementedError(f"{type(self).__name__}.select_processor")


class DefaultMapper(Mapper):
    """Block distribution: point i of n goes to processor i*P//n of the preferred kind
    (GPUs when there are any), so neighbouring tiles share a processor; single tasks
    rotate over processors."""

    def __init__(self):
        self._next_single = 0
        self._procs: dict[Machine, list[Processor]] = {}

    def select_processor(self, machine, launch_name, point, domain, index):
        procs = self._procs.get(machine)
        if procs is None:
            procs = [p for p in machine.processors if p.kind == "gpu"] or list(machine.processors)
            self._procs[machine] = procs
        if len(domain) <= 1:
            proc = procs[self._next_single % len(procs)]
            self._next_single += 1
            return proc
        return procs[index * len(procs) // len(domain)]
