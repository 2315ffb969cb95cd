"""The runtime front end: regions, launches, futures, waiting, replay and traces.

A program calls `launch` / `index_launch` in sequential order; each call is checked,
mapped (the mapper picks processors), analyzed into graph nodes (taskrt/analysis.py)
and handed to the executor, and returns futures at once. With `execute=False` the same
calls only build the TaskGraph, which is what the simulator consumes.

Threads of a program may issue at once: each launch (fill, attach, read, release, a program)
is issued whole under a lock, in the order the threads take it, and a replay block holds the
lock from its start to its end, so no other thread's launch falls inside it. (Without it,
two threads' launches on one region were analyzed against each other half done, and
increments were lost.) Under mpiexec every rank must issue the same launches in the same
order: there, issue from one thread.

On many MPI ranks (`Runtime.from_mpi()`, or any `Runtime()` started by mpiexec with more
than one rank) every rank runs the program and builds the whole graph; the transport
(taskrt/mpi.py) runs this rank's share and moves data between ranks. Attach and fill
run once, on rank 0's host processor, so that every rank builds the same graph.
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import math
import os
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .analysis import Analyzer
from .backends import gpu
from .cores import bind_rank, node_cores
from .executor import Executor, TaskError
from .geometry import Rect, as_int
from .heap import collect_cycles_less, keep_freed_memory
from .instances import InstanceStore
from .launch import Future, FutureMap, Requirement, check_launch, req
from .machine import Machine, Memory, Processor, count_from_env, mpi_world_size_from_env
from .mapper import DefaultMapper, Mapper
from .outputs import output_problem
from .privilege import READ, WRITE
from .program import Launch, check_program
from .region import Partition, Region, beyond_range, int_tuples
from .replay import ReplayBlock
from .replication import launch_signature
from .taskgraph import CopyNode, TaskGraph, TaskNode
from .tracing import TraceRecorder, rank_trace_path

#: distinct placed launches whose mapping a runtime keeps (then it starts over), and task
#: functions whose first parameter it knows
MAPPED_LAUNCHES_KEPT = 4096


@dataclass
class TaskContext:
    """Passed to a task function whose first parameter is named `ctx`."""

    point: tuple
    rects: list[Rect]
    processor: Processor
    xp: object
    name: str


@dataclass
class LaunchSpec:
    """A checked, mapped launch: everything analysis or replay needs, nothing computed yet."""

    name: str
    fn: Callable | None
    points: list[tuple]
    reqs: list[Requirement]
    rects: list[list[Rect]]
    procs: list[Processor]
    args: list[tuple]
    extra_preds: list[tuple]
    launch_id: int
    op: str = ""
    futures: list[Future] = field(default_factory=list)
    signature: str | None = None   # taskrt.replication.launch_signature, when a transport checks it
    known_key: tuple | None = None   # key(), when the runtime kept it with the mapping

    def key(self) -> tuple:
        """What replay compares: the function, name, points, requirements and processors."""
        if self.known_key is not None:
            return self.known_key
        return (self.fn, self.name, tuple(self.points), tuple(r.key() for r in self.reqs), tuple(self.procs))


class Runtime:
    """One rank's runtime. See README.md for a tour; `with Runtime() as rt:` shuts down at exit.

    Under mpiexec with more than one rank (and no `machine` or `transport` given, and
    TASKRT_MPI not 0) `Runtime()` is `Runtime.from_mpi()`: see docs/mpi.md."""

    def __init__(self, machine: Machine | None = None, mapper: Mapper | None = None, *, cpus: int | None = None,
                 gpus: int | None = None, separate_memories: bool = False, execute: bool = True,
                 keep_graph: bool | None = None, trace: str | bool | None = None, rank: int = 0, transport=None,
                 blas_threads: int | None = None):
        for flag, value in (("separate_memories", separate_memories), ("execute", execute),
                            ("keep_graph", keep_graph)):
            if not isinstance(value, (bool, np.bool_)) and not (flag == "keep_graph" and value is None):
                raise TypeError(f"Runtime: {flag} must be True or False, got {type(value).__name__} {value!r}")
        if machine is None and transport is None and execute and mpi_world_size_from_env() > 1:
            from .mpi import connect
            machine, transport = connect(cpus=cpus, gpus=gpus, separate_memories=separate_memories)
            rank = transport.rank
        if transport is not None and not execute:
            raise ValueError("a transport runs graphs; a Runtime with execute=False only builds them")
        self.machine = machine or Machine.local(cpus, gpus, separate_memories=separate_memories)
        if not isinstance(self.machine, Machine):
            raise TypeError(f"Runtime: machine must be a taskrt Machine, got {type(self.machine).__name__} "
                            f"{self.machine!r}")
        _check_rank("Runtime", rank, self.machine)
        if execute and transport is None and self.machine.num_ranks > 1:
            raise ValueError(f"Runtime: {self.machine!r} has {self.machine.num_ranks} ranks, and a run on many ranks "
                             f"needs MPI: start it under mpiexec -n {self.machine.num_ranks} (or Runtime.from_mpi); "
                             f"execute=False builds its graphs here")
        if execute and any(p.kind == "gpu" for p in self.machine.rank_processors(rank)):
            gpu.module()   # a clear error where cupy is missing, not GPU workers that die and tasks that wait
        self.mapper = mapper or DefaultMapper()
        if not callable(getattr(self.mapper, "select_processor", None)):
            raise TypeError(f"Runtime: mapper must have select_processor (a taskrt Mapper), got "
                            f"{type(self.mapper).__name__} {self.mapper!r}")
        self.rank = rank
        self.graph = TaskGraph(keep=(not execute) if keep_graph is None else keep_graph)
        self._next_id = 0
        self._launch_count = 0
        self._mapped_launches: dict[tuple, tuple] = {}
        #: whether mapped launches are kept for the next step (False for one that maps each launch
        #: once, as the simulator's segment recording does: keying them was most of mapping one)
        self.keep_mapped_launches = True
        self._sinks: set[int] = set()
        self._sink_limit = 1024
        self._replay: ReplayBlock | None = None
        self._recordings = {}
        self.replay_stats = {"recorded": 0, "replayed": 0, "mismatches": 0, "reissued": 0}
        self._ctx_fns: dict[Callable, bool] = {}
        self._arity_checked: set[tuple] = set()   # (function, views, args) that _check_arity took
        #: held while a launch, a release or a program is issued, and through a replay block
        self._issuing = threading.RLock()
        self.analyzer = Analyzer(self._new_id, self._emit, self._is_done)
        gpu_devices = {p.memory: p.device for p in self.machine.processors if p.kind == "gpu"}
        self.store = InstanceStore(gpu_devices)
        self.home = self.machine.host_processor(0)
        if not (trace is None or isinstance(trace, (str, bool, os.PathLike))):
            raise TypeError(f"Runtime: trace must be a path, True, False or None, got {type(trace).__name__} "
                            f"{trace!r}")
        if blas_threads is not None:
            as_int("Runtime: blas_threads", blas_threads, least=1)
        if isinstance(trace, os.PathLike):
            trace = os.fspath(trace)
        trace = os.environ.get("TASKRT_TRACE") if trace is None else trace
        self.trace_path = trace if isinstance(trace, str) and trace else None
        if self.trace_path and transport is not None:
            self.trace_path = rank_trace_path(self.trace_path, rank)
        problem = output_problem(self.trace_path) if self.trace_path else None
        if problem is not None:
            raise ValueError(f"Runtime: the trace {self.trace_path}: {problem}")
        self.tracer = TraceRecorder(rank) if trace else None
        self.transport = transport
        self.executor = None
        if execute:
            local = self.machine.rank_processors(rank)
            mems = sorted({p.memory for p in local}, key=str)
            self.executor = Executor(local + mems, self._run_task, self._run_copy,
                                     [self.tracer] if self.tracer else [], self._setup_worker, rank)
            self.executor.on_lost = self._lost_node
        self._closed = False
        self._blas_limit = None
        self._binding = None
        if self.executor is not None:
            self._blas_limit = limit_blas_threads(self.machine, rank, blas_threads)
            if transport is not None:
                self._binding = bind_rank(self.machine, rank)
            keep_freed_memory()
            collect_cycles_less()
        if transport is not None:
            transport.bind(self)

    @classmethod
    def from_mpi(cls, comm=None, *, cpus: int | None = None, gpus: int | None = None,
                 separate_memories: bool = False, mapper: Mapper | None = None, trace: str | bool | None = None,
                 timeout: float | None = None) -> "Runtime":
        """This rank's runtime of a program that every rank of `comm` (COMM_WORLD) runs;
        collective. The machine comes from Machine.discover (cpus per rank: `cpus`, else
        TASKRT_CPUS, else the node's cores shared; one GPU per local rank where cupy sees
        one). `timeout`: seconds of no progress anywhere before a waiting rank aborts
        (TASKRT_MPI_TIMEOUT, default 60; 0 never). See docs/mpi.md."""
        from .mpi import connect
        machine, transport = connect(comm, cpus=cpus, gpus=gpus, separate_memories=separate_memories,
                                     timeout=timeout)
        return cls(machine, mapper, trace=trace, rank=transport.rank, transport=transport)

    @property
    def num_ranks(self) -> int:
        return self.machine.num_ranks

    def __repr__(self) -> str:
        return f"Runtime(rank {self.rank}, {self.machine!r}, {self._next_id} nodes issued)"

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None and self.transport is not None and not self._closed:
            self.transport.abort_on_exception(exc_type, exc, tb)
        self.shutdown(wait=exc_type is None)
        return False

    # ---- regions and data ---------------------------------------------------------------
    def region(self, shape: Sequence[int], dtype="float32", name: str | None = None) -> Region:
        return Region(shape, dtype, name)

    def attach(self, region: Region, array, rect: Rect | None = None) -> Future:
        """Copy a numpy array into `rect` of the region (whole by default), in program order.
        On many ranks every rank passes the same array and rank 0's is used."""
        _check_region("attach", region)
        rect = region.rect if rect is None else rect
        region.check_rect(rect)
        try:
            array = np.asarray(array)
        except ValueError as e:   # (rows of different lengths)
            raise ValueError(f"attach: the data for {region!r} is not an array of numbers: {e}") from None
        if array.shape != rect.shape:
            raise ValueError(f"attach: array of shape {array.shape} does not fit {region!r}{rect!r} "
                             f"of shape {rect.shape}")
        if not np.can_cast(array.dtype, region.dtype, casting="same_kind"):
            raise ValueError(f"attach: an array of dtype {array.dtype} does not convert to {region!r}'s "
                             f"{region.dtype} without losing its kind (a complex array into a real region, floats "
                             f"into ints, signed ints into unsigned)")
        _check_range(array, region)
        if self.home.rank == self.rank:
            array = array.astype(region.dtype, copy=True)
        else:
            array = None  # the attach runs on rank 0; this rank never reads the array
        return self.launch(_attach_kernel, req(region, WRITE, rect), args=(array,), name=f"attach:{region.name}",
                           proc=self.home)

    def fill(self, region: Region, value, rect: Rect | None = None) -> Future:
        """Set `rect` of the region (whole by default) to the number `value`, in program order."""
        _check_region("fill", region)
        if not _holds(region.dtype, value):
            raise ValueError(f"fill: {value!r} ({type(value).__name__}) is not a number that {region!r} "
                             f"({region.dtype}) can hold")
        return self.launch(_fill_kernel, req(region, WRITE, rect), args=(value,), name=f"fill:{region.name}",
                           proc=self.home)

    def read(self, region: Region, rect: Rect | None = None, wait: bool = True, rank: int | None = None):
        """A copy of `rect` of the region as a numpy array (a Future if wait=False).
        On many ranks every rank gets the array; with `rank=k` only rank k does (the
        others get None, or a Future that asks rank k for it)."""
        _check_region("read", region)
        if rank is not None:
            _check_rank("read", rank, self.machine)
        name = f"read:{region.name}"
        if rank is not None or self.machine.num_ranks == 1:
            proc = self.machine.host_processor(rank or 0)
            fut = self.launch(_read_kernel, req(region, READ, rect), name=name, proc=proc)
            if not wait:
                return fut
            return self._local_value(fut) if proc.rank == self.rank else None
        hosts = {(r,): self.machine.host_processor(r) for r in range(self.machine.num_ranks)}
        fm = self.index_launch(_read_kernel, list(hosts), req(region, READ, rect), name=name, placement=hosts)
        fut = fm[(self.rank,)]
        fut._replicated = False  # every rank reads its own point: no rank asks another for it
        return self._local_value(fut) if wait else fut

    def _local_value(self, fut: Future):
        """The value of a task of this rank, without holding it for other ranks."""
        if not fut._has_value:
            self._wait_node(fut.node_id)
        return fut._value

    # ---- launches -----------------------------------------------------------------------
    def launch(self, fn: Callable, *reqs: Requirement, args: tuple = (), name: str | None = None,
               proc: Processor | int | None = None, op: str = "") -> Future:
        """One task. Returns at once with its Future."""
        with self._issuing:
            spec = self._make_spec(fn, [()], reqs, args, None, name, None if proc is None else {(): proc}, op)
            self._issue(spec)
        return spec.futures[0]

    def index_launch(self, fn: Callable, domain, *reqs: Requirement, args: tuple = (),
                     point_args: dict | None = None, name: str | None = None, placement: dict | None = None,
                     op: str = "") -> FutureMap:
        """One point task per point of `domain` (a list of colors, a Rect, a Partition or a count).
        `placement` maps points to processors (or their global indices), overriding the mapper.
        `args` (and `point_args`) go to the tasks as they are, not copied: an array argument is
        read when the task runs, so change it only once the task's future is ready."""
        points = _points_of(domain)
        if point_args is not None:
            _check_point_args(points, point_args)
        with self._issuing:
            spec = self._make_spec(fn, points, reqs, args, point_args, name, placement, op)
            self._issue(spec)
        return FutureMap(dict(zip(points, spec.futures)))

    def _make_spec(self, fn, points, reqs, args, point_args, name, placement, op) -> LaunchSpec:
        self._check_alive()
        self._check_caller("a launch")
        name = name or getattr(fn, "__name__", "task")
        check_launch(name, fn, points, reqs)
        if self.executor is not None:
            for r in reqs:
                if r.region.owner is None or r.region.owner() is not self:
                    self._claim(name, r)
        rects, procs, signature, key = self._mapped(fn, name, points, reqs, placement)
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"launch {name!r}: args must be a tuple of arguments, got {type(args).__name__} {args!r}")
        args = tuple(args)
        if point_args:
            all_args = [args + tuple(point_args[p]) for p in points]
            extra = [tuple(a.node_id for a in pa if isinstance(a, Future)) for pa in all_args]
        else:
            all_args = [args] * len(points)
            extra = [tuple(a.node_id for a in args if isinstance(a, Future))] * len(points)
        if self.executor is not None and fn is not None:
            for count in {len(a) for a in all_args} if point_args else (len(args),):
                self._check_arity(name, fn, len(reqs), count)
        if any(extra):   # (only a launch given futures can be given a lost one, or another runtime's)
            given = [a for pa in (all_args if point_args else [args]) for a in pa if isinstance(a, Future)]
            alien = next((a for a in given if a._runtime is not self), None)
            if alien is not None:
                raise ValueError(f"launch {name!r}: an argument is a Future of another Runtime (node "
                                 f"#{alien.node_id} there): pass its value (.get()), or launch on that runtime")
            lost = next((a for a in given if a._lost is not None), None)
            if lost is not None:
                raise ValueError(f"launch {name!r}: an argument is the future of task {lost._lost!r} (node "
                                 f"#{lost.node_id}), which failed or was skipped after a failure: its value is lost")
        spec = LaunchSpec(name, fn, points, list(reqs), rects, procs, all_args, extra, self._launch_count, op,
                          signature=signature, known_key=key)
        self._launch_count += 1
        spec.futures = [Future(self, None, proc.rank) for proc in procs]
        if self.transport is not None:
            self.transport.on_launch(spec)
        return spec

    def _check_arity(self, name: str, fn, views: int, args: int) -> None:
        """Refuse a task function that cannot take what its tasks will be given (a context if its
        first parameter is named ctx, a view a requirement, the args), before anything is issued:
        it failed in a worker and stopped the runtime. Asked once per function and count."""
        key = (fn, views, args)
        if key in self._arity_checked:
            return
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):   # (a builtin, say: it will tell when it runs)
            signature = None
        if signature is not None:
            ctx = next(iter(signature.parameters), None) == "ctx"
            self._ctx_fns[fn] = ctx   # (what the worker asks _first_param, known now)
            try:
                signature.bind(*range(ctx + views + args))
            except TypeError as e:
                given = f"{'a context, ' if ctx else ''}{views} region view(s) and {args} argument(s)"
                called = getattr(fn, "__name__", type(fn).__name__)
                raise TypeError(f"launch {name!r}: its task function {called!r}{signature} is given {given}: "
                                f"{e}") from None
        if len(self._arity_checked) >= MAPPED_LAUNCHES_KEPT:
            self._arity_checked.clear()
        self._arity_checked.add(key)

    def _mapped(self, fn, name, points, reqs, placement) -> tuple[list, list, str | None, tuple | None]:
        """(each point's rects, each point's processor, the replication signature under MPI, the
        LaunchSpec key) of a launch: checked and mapped once per distinct fully placed launch (a
        training step makes the same ones every iteration), kept in `_mapped_launches`; the
        shared lists are never changed. The key is None for a launch that is not kept."""
        key = None
        if placement is not None and not isinstance(placement, dict):
            raise TypeError(f"launch {name!r}: placement maps points to processors (a dict), got "
                            f"{type(placement).__name__} {placement!r}")
        if placement and self.keep_mapped_launches:
            try:
                placed = tuple(map(placement.__getitem__, points))
            except KeyError:   # some point left to the mapper: not kept
                placed = None
            if placed is not None:
                key = (fn, name, tuple(points), tuple(reqs), placed)
                known = self._mapped_launches.get(key)
                if known is not None:
                    return known
        if placement and points:
            # (a placement may name more points than this launch has: lowering gives each launch
            # of an ordered op's positions the whole op's placement)
            ndim = len(points[0])
            unknown = [p for p in placement if not (isinstance(p, tuple) and len(p) == ndim)]
            if unknown:
                raise ValueError(f"launch {name!r}: placement keys {unknown[:4]} are not points of its domain "
                                 f"(points are tuples of {ndim}, such as {points[0]!r})")
        rects = [[r.rect_for(p) for r in reqs] for p in points]
        _check_interference(name, reqs, rects)
        procs = []
        for i, p in enumerate(points):
            chosen = placement.get(p) if placement else None
            if chosen is None:
                chosen = self.mapper.select_processor(self.machine, name, p, points, i)
                if type(chosen) is not Processor:
                    raise TypeError(f"launch {name!r}: the mapper {type(self.mapper).__name__} chose {chosen!r} for "
                                    f"point {p}: select_processor returns one of the machine's Processors")
            elif isinstance(chosen, (int, np.integer)) and not isinstance(chosen, bool):
                chosen = self.machine.processor(int(chosen))
            elif chosen not in self.machine.processors:
                raise ValueError(f"launch {name!r}: point {p} placed on {chosen!r}, which is not in {self.machine!r}")
            procs.append(chosen)
        signature = None
        if self.transport is not None:
            signature = launch_signature(LaunchSpec(name, fn, points, list(reqs), rects, procs, [], [], -1))
        mapped = (rects, procs, signature, None)
        if key is not None:
            spec_key = (fn, name, tuple(points), tuple(r.key() for r in reqs), tuple(procs))
            mapped = (rects, procs, signature, spec_key)
            if len(self._mapped_launches) >= MAPPED_LAUNCHES_KEPT:
                self._mapped_launches.clear()
            self._mapped_launches[key] = mapped
        return mapped

    def _issue(self, spec: LaunchSpec) -> None:
        if self._replay is not None:
            self._replay.issue(spec)
        else:
            self._analyze(spec)

    def _analyze(self, spec: LaunchSpec, shadow: bool = False) -> None:
        released = self.analyzer.released
        if released and not shadow:
            for k, r in enumerate(spec.reqs):
                if r.privilege.reads and r.region.uid in released:
                    for rects in spec.rects:
                        self.analyzer.check_released(r.region, rects[k], spec.launch_id, spec.op)
        add = self.analyzer.add_task
        for i, point in enumerate(spec.points):
            reqs = [(r.region, rect, r.privilege) for r, rect in zip(spec.reqs, spec.rects[i])]
            add(spec.name, spec.procs[i], spec.fn, reqs, spec.args[i], point, spec.launch_id,
                spec.extra_preds[i], spec.op, None if shadow else spec.futures[i])

    def replay(self, name: str) -> ReplayBlock:
        """`with rt.replay("step"):` analyze this block once, replay it on later entries."""
        self._check_open("Runtime.replay")
        return ReplayBlock(self, name)

    def issue_program(self, name: str, launches: Sequence[Launch], args: Sequence[tuple]) -> list[FutureMap | None]:
        """Issue launches[k] with args[k] for every k, as replay block `name`; the FutureMaps of
        the launches marked `returns` (None for the others). When the block replays a recording
        of this very list, its nodes are issued again in one go (taskrt/program.py)."""
        self._check_alive()   # (a reissue makes no launch, which would ask)
        check_program(launches, args)
        with self.replay(name) as block:
            if block.can_reissue(launches):
                return block.reissue(args)
            block.program = launches
            out = []
            for launch, a in zip(launches, args):
                fm = self.index_launch(launch.fn, list(launch.points), *launch.reqs, args=a, name=launch.name,
                                       placement=launch.placement, op=launch.op)
                out.append(fm if launch.returns else None)
                if launch.releases:
                    self.release(*launch.releases)
            return out

    def release(self, *regions: Region) -> None:
        """What the program issued so far wrote into `regions` is needed no more (a training
        step's activations after their backward): once it has run, their instances are freed,
        and the nodes issued from now on get new ones (taskrt/instances.py, generations), which
        they must write before they read: a read of data written before the release is refused
        when it is issued. Regions keep their dependences; a release is not a node."""
        self._check_caller("Runtime.release")
        self._check_open("Runtime.release")
        for region in regions:
            _check_region("release", region)
        with self._issuing:
            at = self._next_id
            replay = self._replay
            if replay is not None:
                replay.on_release(regions)
            if replay is None or replay.mode != "replaying":   # (replaying: the states are the recording's)
                self._drop_pending(regions)
            self._collect_when_done(regions, at, self._start_generation(regions, at))

    def forget_replay(self, name: str) -> None:
        """Drop replay block `name`'s recording (its program will not come back)."""
        self._check_caller("Runtime.forget_replay")
        with self._issuing:
            self._recordings.pop(name, None)

    def _drop_pending(self, regions) -> None:
        """A released region's reductions still pending are never folded: their buffers go. A
        block that drops some is not replayed (its replays would not know which buffers)."""
        for region in regions:
            if not self.analyzer.has_pending(region.uid):
                continue
            parts = self.analyzer.drop_pending(region)
            if self.executor is not None:
                self.store.discard(parts)
            if self._replay is not None and self._replay.mode == "recording":
                self._replay.recording.replayable = False

    def expect_releases(self) -> None:
        """Releases will come (a training step that frees its activations): from the next node
        on, note which instances each touches, so that a release frees each instance as soon as
        the nodes that used it have run. A release counts every node issued before the first of
        these calls (or before itself) as a user of everything."""
        if self.executor is not None:
            self.executor.track_touches(self._next_id, _instances_touched)

    def _start_generation(self, regions, at: int) -> list[int]:
        """Nodes from id `at` on use new instances of `regions` (before any of them is submitted);
        returns the generation of each that ends there (for _collect_when_done)."""
        for region in regions:
            self.analyzer.released[region.uid] = at
        if self.executor is None:
            return []
        self.executor.track_touches(at, _instances_touched)   # (from here, unless expect_releases came first)
        return [self.store.release(region, at) for region in regions]

    def _collect_when_done(self, regions, at: int, gens: list[int]) -> None:
        """Free each instance of `regions` that nodes before id `at` used once those of them
        that touch it have run (after every node before `at` this rank runs has been
        submitted); `gens`: what _start_generation returned."""
        if self.executor is not None:
            for region, gen in zip(regions, gens):
                for memory, free in self.store.collections(region, gen):
                    self.executor.when_done_below(at, free, (region.uid, memory))

    # ---- graph building (called by the analyzer and replay) ------------------------------
    def _new_id(self) -> int:
        nid = self._next_id
        self._next_id += 1
        return nid

    def _emit(self, node, preds) -> None:
        self._emit_many([(node, tuple(preds))])

    def _emit_many(self, items: list[tuple], sinks: bool = True) -> None:
        """Record and submit (node, preds tuple) pairs in order (one executor call for them all).
        sinks=False: the caller keeps `_sinks` itself (ReplayBlock.reissue knows the block's)."""
        graph, tracer, replay = self.graph, self.tracer, self._replay
        if graph.keep or tracer is not None or sinks or (replay is not None and replay.mode == "recording"):
            for node, preds in items:
                graph.add(node, preds)
                if tracer is not None:
                    tracer.preds[node.id] = preds
                if sinks:
                    self._sinks.difference_update(preds)
                    self._sinks.add(node.id)
                if replay is not None:
                    replay.on_emit(node, preds)
            if sinks:
                self._prune_sinks()
        if self.executor is not None:
            if replay is None or replay.mode != "replaying":   # a replay's nodes touch what its recording's did
                self._reserve(items)
            if self.transport is not None:
                for node, preds in items:
                    self.transport.submit(node, preds)
            else:
                self.executor.submit_many(items)

    def _reserve(self, items: list[tuple]) -> None:
        """Tell the instance store what the nodes touch in this rank's memories before they are
        submitted (an instance holds the box of the rects its memory is asked for). Where an
        instance made already must grow, wait for every node submitted so far first: none of
        them uses it then (a wait for nodes earlier in program order, so ranks that wait at
        different points still finish what the others wait for)."""
        rank, reserve = self.rank, self.store.reserve
        grow = {}   # (region uid, memory) -> (region, memory): each instance grows once, to its widest
        for node, _ in items:
            for region, rect, memory in _touched(node):
                if memory.rank == rank and reserve(region, memory, rect):
                    grow[(region.uid, memory)] = (region, memory)
        if grow:
            with contextlib.suppress(TaskError):   # (a failure drains too: these nodes are made, and go in)
                self.executor.wait_all()
            for region, memory in grow.values():
                self.store.grow(region, memory)

    def _add_sinks(self, ids, waited_for: int | None) -> None:
        """Nodes `ids` are sinks now, and `waited_for` (if any) no longer is one."""
        if waited_for is not None:
            self._sinks.discard(waited_for)
        self._sinks.update(ids)
        self._prune_sinks()

    def _prune_sinks(self) -> None:
        if len(self._sinks) > self._sink_limit:
            self._sinks = {s for s in self._sinks if not self._is_done(s)}
            self._sink_limit = max(1024, 2 * len(self._sinks))

    def _emit_fence(self, name: str) -> int:
        """A no-op node after everything issued so far; returns its id."""
        node = TaskNode(self._new_id(), name, self.home, None, ())
        live = [s for s in self._sinks if not self._is_done(s)]
        self._sinks.clear()
        self._emit(node, live)
        return node.id

    def _is_done(self, node_id: int) -> bool:
        if self.executor is None:
            return False
        if self.transport is not None:
            return self.transport.is_done(node_id)
        return self.executor.is_done(node_id)

    # ---- running nodes (on worker threads) ----------------------------------------------
    def _setup_worker(self, where) -> None:
        """A GPU processor's thread, and the thread of copies into a GPU memory, issue their
        work on that device and on a stream of their own."""
        if isinstance(where, Processor) and where.kind == "gpu":
            gpu.use_device(where.device)
        elif isinstance(where, Memory) and where.kind == "gpu":
            gpu.use_device(self.store.gpu_devices[where])

    def _run_task(self, node: TaskNode) -> None:
        fn = node.fn
        if fn is None:
            return
        store = self.store
        views = []
        for i, r in enumerate(node.reqs):
            if r.privilege.is_reduce:
                views.append(store.new_buffer((node.id, i), r.region, r.rect, r.memory, r.privilege.redop))
            else:
                views.append(store.view(r.region, r.rect, r.memory, r.privilege.writes, node.id))
        args = node.args
        if args and node.future is not None and any(isinstance(a, Future) for a in args):
            args = tuple(self._argument_value(a) if isinstance(a, Future) else a for a in args)
        wants_ctx = self._ctx_fns.get(fn)
        if wants_ctx is None:
            if len(self._ctx_fns) >= MAPPED_LAUNCHES_KEPT:   # (closed models' kernels, and what they hold)
                self._ctx_fns.clear()
            wants_ctx = self._ctx_fns[fn] = _first_param(fn) == "ctx"
        if wants_ctx:
            ctx = TaskContext(node.point, [r.rect for r in node.reqs], node.proc, store.xp(node.proc.memory), node.name)
            result = fn(ctx, *views, *args)
        else:
            result = fn(*views, *args)
        if node.proc.kind == "gpu":
            gpu.synchronize()  # finished means the data is there for other threads and streams
        if node.future is not None:
            if getattr(result, "base", None) is not None:   # (a view, maybe of the task's instances)
                result = _detached(result, views, store.xp(node.proc.memory))
            node.future._set(result)

    def _lost_node(self, node, ran: bool) -> None:
        """A node that failed (`ran`) or was skipped after a failure settles its reduction
        buffers as its run would have: a task leaves an empty buffer for each, made or not (its
        contribution, whole or partial, is lost), a skipped fold takes its part. So the folds
        issued later, even after Runtime.recover, find their buffers, and none leaks; and its
        future says its value is lost."""
        if type(node) is TaskNode:
            if node.future is not None:
                node.future._lose(node.name)
            if node.fn is not None:
                for i, r in enumerate(node.reqs):
                    if r.privilege.is_reduce:
                        self.store.skip_buffer((node.id, i), r.rect)
        elif type(node) is CopyNode and node.buffer is not None and not ran:
            self.store.take_buffer(node.buffer, node.rect)

    def _run_copy(self, node: CopyNode):
        if type(node) is not CopyNode:
            return node.run()  # a transport's node (taskrt/mpi.py): posts messages, may finish later
        if node.redop is None:
            self.store.copy(node.region, node.rect, node.src, node.dst, node.id)
        else:
            self.store.fold(node.region, node.rect, node.dst, node.buffer, node.redop, node.id)

    # ---- waiting and shutting down --------------------------------------------------------
    def _node_done(self, node_id) -> bool:
        return node_id is not None and self._is_done(node_id)

    def _future_done(self, future: Future) -> bool:
        if self.transport is not None and future.rank != self.rank:
            return self.transport.values.arrived(future)
        return self._node_done(future.node_id)

    def _wait_node(self, node_id: int | None, timeout=None) -> None:
        if self.executor is None:
            raise RuntimeError("this runtime was built with execute=False: it builds task graphs and runs nothing")
        self._check_caller("a wait")
        timeout = _check_timeout(timeout)
        self._check_stopped(f"node #{node_id}", node_id)
        self._wait_for(node_id, timeout)

    def _argument_value(self, future: Future):
        """A Future passed to a task, inside the task: its node is one of the task's preds (so
        done), but on many ranks its value may still be on its way."""
        if not future._has_value:
            self._wait_for(future.node_id, None)
        future._check_lost()
        self._resolve_future(future)
        return future._value

    def _wait_for(self, node_id: int | None, timeout) -> None:
        if self.transport is None:
            self.executor.wait_node(node_id, timeout)
        else:
            self.transport.wait_local(lambda t: self.executor.wait_node(node_id, t), timeout, f"node #{node_id}")

    def _resolve_future(self, future: Future) -> None:
        """After a wait: a task that ran on another rank sends its value (taskrt/mpi.py)."""
        if self.transport is not None:
            self.transport.fetch_future(future)

    def _prefetch(self, futures) -> None:
        if self.transport is not None:
            self.transport.prefetch(futures)

    def wait(self, timeout: float | None = None) -> None:
        """Block until everything issued so far has run; raise the first task error.
        On many ranks: until this rank's share has run (not a barrier)."""
        if self.executor is None:
            return
        self._check_caller("Runtime.wait")
        timeout = _check_timeout(timeout)
        self._check_stopped("Runtime.wait")
        if self.transport is None:
            self.executor.wait_all(timeout)
        else:
            self.transport.checkpoint("wait")
            self.transport.wait_local(self.executor.wait_all, timeout, "this rank's tasks and copies")

    def recover(self) -> list[int]:
        """Go on after a task failed: wait until everything issued has drained, then forget the
        failure, so that the next launch runs; returns the ids of the nodes that failed or were
        skipped (those that depend on a failed one), in order: every other node issued ran.
        Regions that those nodes would have written hold unspecified data until they are written
        again. One process only: on many ranks a failure ends every rank."""
        if self.transport is not None:
            raise RuntimeError("recover: on many ranks a failed task ends every rank; there is nothing to recover")
        if self.executor is None or self.executor.error is None:
            return []
        with contextlib.suppress(TaskError):  # raised to the caller already: here it only drains
            self.executor.wait_all()
        return self.executor.forget_failure()

    @property
    def issued(self) -> int:
        """How many nodes this runtime has issued: the id the next one gets."""
        return self._next_id

    def _claim(self, name: str, r: Requirement) -> None:
        """Make this runtime the owner of r's region, unless another runtime that is still open
        holds its data (its instances are that runtime's: here the region would read as zeros),
        or one that has shut down held it and `r` reads it (its data went with that runtime)."""
        region = r.region
        other = None if region.owner is None else region.owner()
        if other is not None and other is not self and not other._closed:
            raise ValueError(f"launch {name!r}: {region!r} belongs to another Runtime that is still open; its data "
                             f"lives there (a region is used by one runtime at a time)")
        if region.owner is not None and (other is None or other._closed) and \
                (r.privilege.reads or r.privilege.is_reduce):
            raise ValueError(f"launch {name!r}: {region!r} held its data in a Runtime that has been shut down, and "
                             f"its data went with it: attach or fill it in this runtime before reading it")
        region.owner = weakref.ref(self)

    def _check_caller(self, what: str) -> None:
        """Refuse `what` from inside one of this runtime's tasks: a task that launches or waits
        would wait on itself (its worker runs nothing else), and shutdown would then hang."""
        worker = None if self.executor is None else self.executor.worker_running_here()
        if worker is not None:
            raise RuntimeError(f"{what} from inside a task (on worker {worker}): tasks cannot launch tasks, wait "
                               f"for them or read regions; do it in the program that launched the task")

    def _check_stopped(self, what: str, node_id: int | None = None) -> None:
        """Refuse to wait for work that a shutdown(wait=False) left unrun: its workers are gone."""
        if not self._closed:
            return
        left = self.executor.unfinished
        if node_id is not None and node_id in left:
            raise RuntimeError(f"{what}: shutdown(wait=False) left it unrun, and the workers are gone")
        if node_id is None and left:
            raise RuntimeError(f"{what}: shutdown(wait=False) left {len(left)} nodes unrun, and the workers are gone")

    def _check_open(self, what: str) -> None:
        """Refuse `what` on a runtime that has shut down (a release or a replay block there did
        nothing, silently); one stopped by a failure still takes them, as Model.close's."""
        if self._closed:
            raise RuntimeError(f"{what}: the runtime has been shut down")

    def _check_alive(self) -> None:
        if self._closed:
            raise RuntimeError("the runtime has been shut down")
        if self.executor is not None and self.executor.error is not None:
            raise RuntimeError(f"the runtime stopped after a task failed: {self.executor.error}")

    def write_trace(self, path: str | None = None) -> str | None:
        path = path or self.trace_path
        if self.tracer is None or path is None:
            return None
        self.tracer.write(path)
        return path

    def shutdown(self, wait: bool = True) -> None:
        """Wait for everything (unless wait=False), stop the workers, write the trace.
        On many ranks this is collective: it ends with a barrier that compares every
        rank's launches (docs/mpi.md); wait=False there aborts all ranks."""
        if self._closed:
            return
        if self.transport is not None and not wait:
            self.transport.abort_on_exception(RuntimeError, RuntimeError(
                "Runtime.shutdown(wait=False) on one rank of a replicated program"), None)
        try:
            if wait and self.executor is not None and self.executor.error is None:
                self.wait()
                if self.transport is not None:
                    self.transport.close()
        finally:
            self._closed = True
            if self.executor is not None:
                self.executor.shutdown()
            if self._blas_limit is not None:
                self._blas_limit.restore_original_limits()
            if self._binding is not None:
                self._binding.restore()
            if self.trace_path:
                self.write_trace()


def limit_blas_threads(machine: Machine, rank: int, threads: int | None):
    """Give each CPU processor of this rank its share of the cores for BLAS (numpy's matmul):
    P workers each running a BLAS that starts one thread per core oversubscribe the machine
    many times over, and OpenBLAS's spinning threads then slow everything down (ranks that
    share a node share its cores, one worker each included). `threads` (>= 1, checked by Runtime)
    overrides the share (TASKRT_BLAS_THREADS too). Returns the limiter (restored at
    shutdown), or None when nothing is limited."""
    cpus = sum(p.kind == "cpu" for p in machine.rank_processors(rank))
    if threads is None:
        threads = count_from_env("TASKRT_BLAS_THREADS", "BLAS threads", 1)
        if threads is None:
            cores = node_cores()
            ranks_here = max(1, len(machine.ranks_on_host(rank)))
            threads = max(1, cores // (ranks_here * max(1, cpus)))
            if threads >= cores:
                return None  # one worker alone on the node: BLAS may use every core
    from threadpoolctl import threadpool_limits
    return threadpool_limits(limits=threads, user_api="blas")


def _touched(node) -> list[tuple]:
    """(region, rect, memory) of each instance part a node reads or writes: a task's requirements
    but its reductions (private buffers), a copy's source and destination, a fold's destination."""
    if type(node) is TaskNode:
        return [(r.region, r.rect, r.memory) for r in node.reqs if not r.privilege.is_reduce]
    if type(node) is CopyNode:
        if node.redop is None:
            return [(node.region, node.rect, node.src), (node.region, node.rect, node.dst)]
        return [(node.region, node.rect, node.dst)]
    return []


def _instances_touched(node) -> list[tuple]:
    """(region uid, memory) of each instance a node reads or writes: those of _touched, and for
    the half of a copy between ranks that this rank runs, a send's source or a receive's
    destination."""
    if type(node) is TaskNode or type(node) is CopyNode:
        return [(region.uid, memory) for region, _, memory in _touched(node)]
    half = getattr(node, "kind", None)
    copy = getattr(node, "copy", None)
    if half == "send" and copy.redop is None:
        return [(copy.region.uid, copy.src)]
    if half == "recv":
        return [(copy.region.uid, copy.dst)]
    return []


def _attach_kernel(view, array):
    view[...] = array


def _holds(dtype: np.dtype, value) -> bool:
    """Whether an array of `dtype` holds the number `value` as it is: no complex number in a real
    array (numpy refuses it, imaginary part or not), no fraction cut off an integer, nothing out
    of an integer type's range (ints compared exactly: 2**63 - 1 is int64's), no finite number
    that would become inf."""
    if isinstance(value, (complex, np.complexfloating)) and dtype.kind != "c":
        return False
    if isinstance(value, (bool, int, np.integer, np.bool_)):
        if dtype.kind in "biu":
            low, high = (0, 1) if dtype.kind == "b" else (int(np.iinfo(dtype).min), int(np.iinfo(dtype).max))
            return low <= int(value) <= high
        return abs(int(value)) <= int(np.finfo(dtype).max)
    if not isinstance(value, (float, complex, np.number)):
        return False
    v = complex(value)
    if dtype.kind in "biu":
        return v.real.is_integer() and _holds(dtype, int(v.real))
    top = float(np.finfo(dtype).max)
    return not any(math.isfinite(part) and abs(part) > top for part in (v.real, v.imag))   # (it would become inf)


def _detached(result, views: list, xp):
    """A task's result (an array view) as its future keeps it: a copy where it is a view of one of
    the task's instances (which later tasks change), else itself. A future holds a value, as
    Legion's do."""
    if any(type(v) is type(result) and xp.may_share_memory(result, v) for v in views):
        return result.copy()
    return result


def _fill_kernel(view, value):
    view[...] = value


def _read_kernel(view):
    return np.array(view) if isinstance(view, np.ndarray) else gpu.to_numpy(view)


def _first_param(fn) -> str | None:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return params[0] if params else None


#: the most points a launch takes: each is a task node and a future (a million take about a
#: gigabyte; a domain of 10**9 was made point by point until the process was killed)
MAX_LAUNCH_POINTS = 1 << 20


def _points_of(domain) -> list[tuple]:
    """A launch domain's points: a count, a Partition's colors, a Rect's points, or a list of
    points (tuples of ints of one length, or ints), each once."""
    if isinstance(domain, (int, np.integer)) and not isinstance(domain, bool):
        _check_point_count(f"a launch domain of {int(domain)} points", int(domain))
        return [(i,) for i in range(int(domain))]
    if isinstance(domain, Partition):
        return domain.colors()
    if isinstance(domain, Rect):
        if not int_tuples([domain.lo, domain.hi]):
            raise TypeError(f"a launch domain's Rect has int bounds, got {domain!r}")
        _check_point_count(f"a launch domain of {domain!r}", domain.volume)
        return list(domain.points())
    if isinstance(domain, (str, bytes, bool, float)) or not hasattr(domain, "__iter__"):
        raise TypeError(f"a launch domain is a count, a Rect, a Partition or a list of points, got "
                        f"{type(domain).__name__} {domain!r}")
    points = [p if isinstance(p, tuple) else (p,) for p in domain]
    if not (int_tuples(points) and len(set(map(len, points))) <= 1):   # (in C: lowering's colors pass)
        for p in points:
            if len(p) != len(points[0]) or not all(isinstance(c, (int, np.integer)) and not isinstance(c, bool)
                                                    for c in p):
                raise TypeError(f"a launch domain's points are tuples of ints of one length, got {p!r} "
                                f"(the first is {points[0]!r})")
    if len(set(points)) != len(points):
        twice = next(p for i, p in enumerate(points) if p in points[:i])
        raise ValueError(f"a launch domain lists point {twice!r} twice")
    return points


def _check_point_count(what: str, count: int) -> None:
    if count < 1:
        raise ValueError(f"{what}: a launch needs at least one point")
    if count > MAX_LAUNCH_POINTS:
        raise ValueError(f"{what}: at most {MAX_LAUNCH_POINTS:,} points a launch (each is a task)")


def _check_point_args(points: list[tuple], point_args) -> None:
    """point_args: a tuple of arguments for every point of the domain (keys are the points)."""
    if not isinstance(point_args, dict):
        raise TypeError(f"point_args must be a dict of point -> tuple of arguments, got {type(point_args).__name__}")
    missing = [p for p in points if p not in point_args]
    if missing:
        raise ValueError(f"point_args has no arguments for points {missing[:4]} (its keys are points, tuples such as "
                         f"{points[0]!r})")
    for p in points:
        if not isinstance(point_args[p], tuple):
            raise TypeError(f"point_args[{p!r}] must be a tuple of arguments, got {type(point_args[p]).__name__} "
                            f"{point_args[p]!r}")


def _check_range(array: np.ndarray, region: Region) -> None:
    """Refuse finite numbers that the region's floats cannot hold (beyond_range), and ints beyond
    its narrower ints. Every rank checks, as every rank passes the same array."""
    to = np.dtype(region.dtype)
    where = beyond_range(array, to)
    if where is not None:
        raise ValueError(f"attach: {array[where].item()!r} at {where} is beyond what {region!r}'s {to} holds "
                         f"(at most {np.finfo(to).max:.4g}{' a part' if to.kind == 'c' else ''}): it would "
                         f"become inf")
    if array.size and array.dtype.kind in "iu" and to.kind in "iu" and not np.can_cast(array.dtype, to):
        low, high = np.iinfo(to).min, np.iinfo(to).max
        outside = (array < low) | (array > high)
        if outside.any():
            where = tuple(int(k) for k in np.argwhere(outside)[0])
            raise ValueError(f"attach: {int(array[where])} at {where} is beyond what {region!r}'s {to} holds "
                             f"({low} to {high}): it would wrap around")


def _check_region(what: str, region) -> None:
    if not isinstance(region, Region):
        hint = " (a partition's pieces are read through an index launch)" if isinstance(region, Partition) else ""
        raise TypeError(f"{what}: takes a Region{hint}, got {type(region).__name__}")


def _check_rank(what: str, rank, machine: Machine) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < machine.num_ranks:
        raise ValueError(f"{what}: rank {rank!r} is not a rank of {machine!r} (ranks 0..{machine.num_ranks - 1})")


def _check_timeout(timeout) -> float | None:
    """A wait's timeout: None (no limit) or seconds >= 0; infinity is no limit (the threads'
    waits overflowed on it)."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout >= 0):
        raise ValueError(f"timeout must be seconds >= 0 or None, got {type(timeout).__name__} {timeout!r}")
    return None if timeout == math.inf else timeout


def _check_interference(name: str, reqs: Sequence[Requirement], rects: list[list[Rect]]) -> None:
    """Two requirements of one task on overlapping data must not conflict (Legion's rule)."""
    by_region: dict[int, list[int]] = {}
    for i, r in enumerate(reqs):
        by_region.setdefault(r.region.uid, []).append(i)
    for idx in by_region.values():
        # the pairs whose privileges conflict do so at every point: find them once
        pairs = [(a, b) for a, b in itertools.combinations(idx, 2)
                 if reqs[a].privilege.conflicts(reqs[b].privilege)]
        if not pairs:
            continue
        for point_rects in rects:
            for a, b in pairs:
                if point_rects[a].overlaps(point_rects[b]):
                    raise ValueError(f"launch {name!r}: requirements {a} ({reqs[a]!r}) and {b} ({reqs[b]!r}) "
                                     f"overlap at {point_rects[a].intersect(point_rects[b])!r} with conflicting "
                                     f"privileges")
