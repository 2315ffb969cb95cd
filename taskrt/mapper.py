"""Mappers decide which processor runs each point task, and so where its data lives."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from .machine import Machine, Processor


class Mapper(ABC):
    """Interface: pick a processor for point `point` of a launch over `domain` (a list of colors)."""

    @abstractmethod
    def select_processor(self, machine: Machine, launch_name: str, point: tuple, domain: Sequence[tuple],
                         index: int) -> Processor:
        """The processor for point `point`, the `index`-th of `domain`, of launch `launch_name`."""


class DefaultMapper(Mapper):
    """Block distribution: point i of n goes to processor i*P//n of the preferred kind
    (GPUs when there are any), so neighbouring tiles share a processor. Single tasks go
    to the first of them, as Legion's default mapper keeps them on the local processor:
    a chain of small tasks then runs without a thread hand-off per task, and the
    parallelism of a program comes from its index launches."""

    def __init__(self):
        self._procs: dict[Machine, list[Processor]] = {}

    def select_processor(self, machine, launch_name, point, domain, index):
        procs = self._procs.get(machine)
        if procs is None:
            procs = [p for p in machine.processors if p.kind == "gpu"] or list(machine.processors)
            self._procs[machine] = procs
        if len(domain) <= 1:
            return procs[0]
        return procs[index * len(procs) // len(domain)]
