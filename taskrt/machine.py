"""The machine: ranks, processors and memories, discovered at start-up (from MPI and cupy) or built by hand."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

from .geometry import as_int


@dataclass(frozen=True)
class Memory:
    """A place instances live: host memory ('sys') or a GPU's memory ('gpu') on one rank."""

    kind: str
    rank: int
    index: int
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        # a dict key everywhere (the analysis's valid copies, instances, views): hashed once
        object.__setattr__(self, "_hash", hash((self.kind, self.rank, self.index)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # rebuilt, not restored: a str's hash differs between processes (ranks)
        return (Memory, (self.kind, self.rank, self.index))

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
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.kind, self.rank, self.index, self.memory, self.device)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        return (Processor, (self.kind, self.rank, self.index, self.memory, self.device))

    def __repr__(self) -> str:
        return f"Processor({self})"

    def __str__(self) -> str:
        return f"r{self.rank}.{self.kind}{self.index}"


@dataclass(frozen=True)
class RankSpec:
    """What one rank brings: its CPU workers and the device numbers of its GPUs."""

    cpus: int
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class Machine:
    """All processors and memories of all ranks; every rank holds the same Machine."""

    processors: tuple[Processor, ...]
    memories: tuple[Memory, ...]
    num_ranks: int = 1
    hosts: tuple[str, ...] = field(default=("localhost",))
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        # the default mapper looks machines up per point: hash the tuples once
        object.__setattr__(self, "_hash", hash((self.processors, self.memories, self.num_ranks, self.hosts)))

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # rebuilt, not restored: string hashes differ between processes
        return Machine, (self.processors, self.memories, self.num_ranks, self.hosts)

    def __repr__(self) -> str:
        cpus = sum(p.kind == "cpu" for p in self.processors)
        gpus = sum(p.kind == "gpu" for p in self.processors)
        return f"Machine({self.num_ranks} ranks, {cpus} cpus, {gpus} gpus, {len(self.memories)} memories)"

    @staticmethod
    def build(num_ranks: int = 1, cpus_per_rank: int = 1, gpus_per_rank: int = 0,
              separate_memories: bool = False, hosts=None) -> "Machine":
        """A machine of identical ranks. `separate_memories` gives every CPU its own memory,
        which exercises every copy path of the runtime without a GPU."""
        num_ranks = as_int("Machine num_ranks", num_ranks, least=1)
        cpus_per_rank = as_int("Machine cpus_per_rank", cpus_per_rank, least=1)
        gpus_per_rank = as_int("Machine gpus_per_rank", gpus_per_rank, least=0)
        ranks = [RankSpec(cpus_per_rank, tuple(range(gpus_per_rank))) for _ in range(num_ranks)]
        return Machine.from_ranks(ranks, hosts, separate_memories)

    @staticmethod
    def from_ranks(ranks: "list[RankSpec]", hosts=None, separate_memories: bool = False) -> "Machine":
        """A machine whose rank r has ranks[r].cpus CPU workers and the GPUs ranks[r].gpus
        (device numbers on its node); each GPU gets its own memory."""
        if not isinstance(separate_memories, bool):
            raise TypeError(f"Machine: separate_memories must be True or False, got {type(separate_memories).__name__} "
                            f"{separate_memories!r}")
        if hosts is not None and (isinstance(hosts, str) or not all(isinstance(h, str) and h for h in hosts)):
            raise TypeError(f"Machine: hosts must be a sequence of host names, one a rank, got {hosts!r}")
        procs, mems = [], []
        for rank, spec in enumerate(ranks):
            if spec.cpus < 1:
                raise ValueError(f"cpus_per_rank must be >= 1, got {spec.cpus} (rank {rank})")
            host_mem = Memory("sys", rank, 0)
            mems.append(host_mem)
            for i in range(spec.cpus):
                mem = host_mem
                if separate_memories and i > 0:
                    mem = Memory("sys", rank, i)
                    mems.append(mem)
                procs.append(Processor("cpu", rank, i, mem))
            for g, device in enumerate(spec.gpus):
                mem = Memory("gpu", rank, g)
                mems.append(mem)
                procs.append(Processor("gpu", rank, g, mem, device=device))
        hosts = tuple(hosts) if hosts else tuple("localhost" for _ in ranks)
        if len(hosts) != len(ranks):
            raise ValueError(f"{len(hosts)} host names for {len(ranks)} ranks")
        return Machine(tuple(procs), tuple(mems), len(ranks), hosts)

    @staticmethod
    def local(cpus: int | None = None, gpus: int | None = None, separate_memories: bool = False) -> "Machine":
        """This process alone: `cpus` workers (flag, else TASKRT_CPUS, else the core count)
        and `gpus` GPUs (flag, else TASKRT_GPUS, else every GPU that cupy sees)."""
        if cpus is None:
            cpus = cpus_here(1)
        cpus = as_int("cpus", cpus, least=1)
        if gpus is None:
            gpus = gpus_from_env()
        if gpus is None:
            gpus = count_gpus()
        gpus = as_int("gpus", gpus, least=0)
        return Machine.build(1, cpus, gpus, separate_memories, hosts=[socket.gethostname()])

    @staticmethod
    def discover(comm=None, cpus_per_rank: int | None = None, gpus: int | None = None,
                 separate_memories: bool = False) -> "Machine":
        """The machine of all ranks of an MPI communicator (COMM_WORLD by default); collective.

        Nodes are told apart by host name. A rank's CPU workers: `cpus_per_rank`, else
        TASKRT_CPUS, else its node's cores shared evenly among the node's ranks. GPUs: `gpus`,
        else TASKRT_GPUS; `k` gives every rank k devices (local rank i takes i*k .. i*k+k-1),
        0 none; unset, one per local rank (local rank i takes device i) where cupy sees one."""
        if comm is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        host = socket.gethostname()
        hosts = comm.allgather(host)
        local_rank = hosts[:comm.rank].count(host)
        local_size = hosts.count(host)
        if cpus_per_rank is None:
            cpus_per_rank = cpus_here(local_size)
        cpus_per_rank = as_int("cpus per rank", cpus_per_rank, least=1)
        if gpus is None:
            gpus = gpus_from_env()
        if gpus is not None:
            gpus = as_int("gpus per rank", gpus, least=0)
        visible = count_gpus() if gpus != 0 else 0
        if gpus is None:
            devices = (local_rank,) if local_rank < visible else ()
        else:
            devices = tuple(range(local_rank * gpus, (local_rank + 1) * gpus))
            if devices and devices[-1] >= visible:
                raise ValueError(f"rank {comm.rank} (local rank {local_rank} on {host}) needs GPUs {list(devices)} "
                                 f"for gpus={gpus} per rank, but cupy sees {visible} on this node")
        ranks = comm.allgather(RankSpec(int(cpus_per_rank), devices))
        return Machine.from_ranks(ranks, hosts, separate_memories)

    def rank_processors(self, rank: int) -> list[Processor]:
        return [p for p in self.processors if p.rank == rank]

    def threads_fit_node(self, rank: int, extra_per_rank: int = 0) -> bool:
        """Whether the node (host) of `rank` has a core for every CPU worker of its ranks
        and `extra_per_rank` more threads of each (a busy loop, say). One pass over the
        processors: a local machine model may have thousands of ranks on this host."""
        ranks = set(self.ranks_on_host(rank))
        cpus = sum(p.kind == "cpu" and p.rank in ranks for p in self.processors)
        return (os.cpu_count() or 1) >= cpus + extra_per_rank * len(ranks)

    def ranks_on_host(self, rank: int) -> list[int]:
        """The ranks whose host is `rank`'s (itself included)."""
        host = self.hosts[rank] if rank < len(self.hosts) else None
        return [r for r, h in enumerate(self.hosts) if h == host]

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


def mpi_world_size_from_env() -> int:
    """The number of ranks mpiexec (MPICH/hydra, Open MPI, MVAPICH, Slurm PMI) started, from
    the environment, without initializing MPI; 1 outside mpiexec or with TASKRT_MPI=0."""
    if switched_off("TASKRT_MPI"):
        return 1
    return _env_count("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMIX_SIZE") or 1


def mpi_rank_from_env() -> int:
    """This process's rank among those mpiexec started, from the environment, without
    initializing MPI; 0 outside mpiexec or with TASKRT_MPI=0."""
    if mpi_world_size_from_env() == 1:
        return 0
    return _env_count("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK", "PMIX_RANK") or 0


def _env_count(*names: str) -> int | None:
    """The first of these environment variables that holds a whole number, as one; else None."""
    for var in names:
        value = os.environ.get(var)
        if value and value.isdigit():
            return int(value)
    return None


def count_from_env(name: str, what: str, least: int) -> int | None:
    """Environment variable `name` as a count of `what` of at least `least`; None when unset or
    empty; a ValueError naming the variable and its value otherwise."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < least:
        counts = ", ".join(str(k) for k in range(least, least + 2))
        raise ValueError(f"{name} must be a count of {what} ({counts}, ...), got {value!r}")
    return int(value)


def switched_off(name: str) -> bool:
    """Whether environment variable `name`, a switch that is on unless set to 0, is 0; a
    ValueError naming it for anything but 0, 1 or unset (any other value used to mean on)."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 (off) or 1 (on), got {value!r}")
    return value == "0"


def gpus_from_env() -> int | None:
    """TASKRT_GPUS as a count of GPUs (per rank); None when unset or empty."""
    return count_from_env("TASKRT_GPUS", "GPUs", 0)


def cpus_here(ranks_here: int) -> int:
    """A rank's CPU workers where `ranks_here` ranks share this host: TASKRT_CPUS, else the host's
    cores shared evenly among them (at least one)."""
    return cpus_from_env() or max(1, (os.cpu_count() or 1) // ranks_here)


def cpus_from_env() -> int | None:
    """TASKRT_CPUS as a count of CPU workers (per rank); None when unset or empty."""
    return count_from_env("TASKRT_CPUS", "CPU workers", 1)


def physical_memory() -> int | None:
    """This node's physical memory in bytes, or None where the platform does not tell."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def count_gpus() -> int:
    """Visible GPUs through cupy; 0 when cupy or a driver is missing."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0
