"""The machine: ranks, processors and memories, discovered at start-up or built by hand."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Memory:
    """A place instances live: host memory ('sys') or a GPU's memory ('gpu') on one rank."""

    kind: str
    rank: int
    index: int

    def __repr__(self) -> str:
        return f"Memory({self})"

    def __str__(self) -> str:
        return f"r{self.rank}.{self.kind}{self.index}"


@dataclass(frozen=True)
class Processor:
    """Something that runs point tasks: a CPU worker thread or a GPU (a cupy device and stream)."""

    kind: str
    rank: int
    index: int
    memory: Memory
    device: int | None = None

    def __repr__(self) -> str:
        return f"Processor({self})"

    def __str__(self) -> str:
        return f"r{self.rank}.{self.kind}{self.index}"


@dataclass(frozen=True)
class Machine:
    """All processors and memories of all ranks; every rank holds the same Machine."""

    processors: tuple[Processor, ...]
    memories: tuple[Memory, ...]
    num_ranks: int = 1
    hosts: tuple[str, ...] = field(default=("localhost",))

    def __repr__(self) -> str:
        cpus = sum(p.kind == "cpu" for p in self.processors)
        gpus = sum(p.kind == "gpu" for p in self.processors)
        return f"Machine({self.num_ranks} ranks, {cpus} cpus, {gpus} gpus, {len(self.memories)} memories)"

    @staticmethod
    def build(num_ranks: int = 1, cpus_per_rank: int = 1, gpus_per_rank: int = 0,
              separate_memories: bool = False, hosts=None) -> "Machine":
        """A machine of identical ranks. `separate_memories` gives every CPU its own memory,
        which exercises every copy path of the runtime without a GPU."""
        if cpus_per_rank < 1:
            raise ValueError(f"cpus_per_rank must be >= 1, got {cpus_per_rank}")
        procs, mems = [], []
        for rank in range(num_ranks):
            host_mem = Memory("sys", rank, 0)
            mems.append(host_mem)
            for i in range(cpus_per_rank):
                mem = host_mem
                if separate_memories and i > 0:
                    mem = Memory("sys", rank, i)
                    mems.append(mem)
                procs.append(Processor("cpu", rank, i, mem))
            for g in range(gpus_per_rank):
                mem = Memory("gpu", rank, g)
                mems.append(mem)
                procs.append(Processor("gpu", rank, g, mem, device=g))
        hosts = tuple(hosts) if hosts else tuple("localhost" for _ in range(num_ranks))
        return Machine(tuple(procs), tuple(mems), num_ranks, hosts)

    @staticmethod
    def local(cpus: int | None = None, gpus: int | None = None, separate_memories: bool = False) -> "Machine":
        """This process alone: `cpus` workers (flag, else TASKRT_CPUS, else the core count)
        and every visible GPU (through cupy) unless `gpus` says otherwise."""
        if cpus is None:
            cpus = int(os.environ.get("TASKRT_CPUS", os.cpu_count() or 1))
        if gpus is None:
            gpus = count_gpus()
        return Machine.build(1, cpus, gpus, separate_memories, hosts=[socket.gethostname()])

    def rank_processors(self, rank: int) -> list[Processor]:
        return [p for p in self.processors if p.rank == rank]

    def host_memory(self, rank: int = 0) -> Memory:
        return Memory("sys", rank, 0)

    def host_processor(self, rank: int = 0) -> Processor:
        """The processor that runs attach, fill and read-back on a rank: its first CPU."""
        for p in self.processors:
            if p.rank == rank and p.kind == "cpu" and p.memory == self.host_memory(rank):
                return p
        raise ValueError(f"rank {rank} has no CPU processor with host memory")

    def processor(self, index: int) -> Processor:
        """Processor by global index (the order of `processors`)."""
        if not 0 <= index < len(self.processors):
            raise ValueError(f"processor index {index} out of range: the machine has {len(self.processors)}")
        return self.processors[index]


def count_gpus() -> int:
    """Visible GPUs through cupy; 0 when cupy or a driver is missing."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0
