"""The iteration graph assembled from cached segments: what the search builds per proposal.

strategies/graph.py builds one training iteration's graph by running the runtime's lowering
and dependence analysis over the whole program. That is the reference, and it costs over
100 us a node. A search changes one op's config per proposal, so almost all of that work
repeats. Here the same graph is put together from parts that are each a pure function of a
few configs, and cached by them:

- a segment is the launches of one op in one phase (ops/lower.py Segment: forward, gradient
  fills, weight-gradient zeroing, backward, update), a pure function of the op and its
  config: its point tasks (processor, rects, privileges) are recorded once per (op, phase,
  config);
- the dependence analysis is per region (taskrt/analysis.py keeps one RegionState per
  region, and a task's preds are the union over its regions), so the copies, folds and
  edges one region causes are a pure function of the segments that touch it, in program
  order: the producer's and every reader's config. They are cached by (region, those
  segments' keys): the analysis runs on that region's accesses alone, through the same
  Analyzer the runtime uses;
- on a miss there, a second cache answers accesses that differ only in where they run and
  whose they are: the analysis is equivariant under renaming memories and reads of a region
  only its bounds, so it is keyed by the bounds, what the tasks ask of the region and their
  memories numbered by first appearance; a hit renames the stored copies' sources and
  destinations and moves them to this region and these tasks, so like layers (a ResNet's
  blocks) and devices permuted share one analysis (SegmentBuilder._region).

A proposal that changes op k re-records k's segments and re-analyzes only the regions they
touch (k's inputs, outputs, weights and their gradients); everything else comes from the
caches. Assembly then lays the nodes out, in arrays, in the runtime's program order (each task after
the copies it causes, those in requirement order), so the graph equals the one
build_iteration makes, node for node and edge for edge (tests/test_segments.py).

    builder = SegmentBuilder(ops, inputs, loss, machine, optimizer)
    graph = builder.build(configs)      # an AssembledIteration
    graph.nodes, graph.successors, graph.pred_ptr, graph.pred_idx, graph.segment_of, graph.task_cost_at(i)
"""
from __future__ import annotations

import bisect
import functools
import itertools
import operator
from dataclasses import dataclass, field
from typing import Sequence

import numba
import numpy as np

from ops.base import Op, TensorSpec
from ops.lower import (BACKWARD_PHASE, FORWARD_PHASE, GRAD_FILL_PHASE, SOURCE_PHASE, UPDATE_PHASE, ZERO_GRAD_PHASE,
                       Lowering, OpPlan, Segment, TileConfig, UpdatePlan, default_config, geometry)
from ops.optimizers import SGD
from strategies.graph import TaskCost, launch_task_costs
from strategies.arena import Arena, columns_of
from strategies.timing import Successors, stable_sort_by, successor_lists
from taskrt import Runtime
from taskrt.geometry import Rect
from taskrt.heap import collect_cycles_less
from taskrt.machine import Machine
from taskrt.region_analysis import ACCESS, BUFFER_NODE, BUFFER_REQ, DST, NODE, REDOP, SRC, analyze_region
from taskrt.region_analysis import privilege_code as _privilege_code
from taskrt.region_analysis import redop_name as _redop_name
from taskrt.taskgraph import CopyNode, PhysicalReq, TaskNode

#: about how many bytes the caches of recorded segments and region analyses may hold before
#: they are dropped (SegmentBuilder._bound_caches): a 10,000-proposal search at 1,024 devices
#: grew to 16.9 GB resident without a bound
CACHE_BYTES = 4 << 30
#: the bytes a recorded point task takes, about (a TaskNode, its requirements and cost, measured
#: at 1,024 devices: 1.1 GB of resident memory over 2,566 segments of 1,024 tasks)
TASK_BYTES = 400
#: the bytes of a recorded segment besides its tasks' (its dicts by region and their arrays'
#: headers), of a region result besides its arrays' data (eleven array headers and itself), and
#: of a part's costs besides theirs (the simulator's): the tiny apps' searches held 3,000-5,000,
#: about 2,000 and 330 (tracemalloc), and were counted at a third of what they held without them
SEGMENT_BYTES = 3000
REGION_BYTES = 2000
PART_COST_BYTES = 330


@dataclass(frozen=True)
class RecordedSegment:
    """A segment's point tasks as the runtime would make them (ids -1), with what each computes;
    per region uid (the keys of each dict below: the regions the segment touches) the tasks
    that touch it, in order (`access_tasks`: an access is a task's requirements on the
    region), one row a requirement (`requirements`: task index, requirement index, rect
    (lo..., hi...), privilege code, taskrt.region_analysis), and, for the canonical region
    cache, what those tasks ask of it apart from where they run and which tasks they are
    (`shapes`: an interned id of, task by task, their requirement indices, rects and
    privileges) and the memory of each access (`memory_ids`: its number in the machine's
    memories).

    Timing needs of a task only its processor (`procs`) and what it computes (`costs`): the
    TaskNodes are made from the mapped launches (`launches`) on first use of `tasks`."""

    key: tuple
    key_id: int                   # a small int per recording (never reused), so region keys hash fast
    op: str | None
    phase: str
    launches: tuple[_MappedLaunch, ...]
    procs: tuple
    n_tasks: int
    costs: tuple[TaskCost, ...]
    shapes: dict
    memory_ids: dict
    access_tasks: dict
    requirements: dict
    fills: tuple[str, ...] = ()
    _tasks: list = field(default_factory=list, repr=False, compare=False)

    @property
    def tasks(self) -> tuple[TaskNode, ...]:
        """The point tasks as the runtime would make them (ids -1), made once."""
        if not self._tasks:
            self._tasks.append(tuple(task for launch in self.launches for task in launch.tasks()))
        return self._tasks[0]

    def task_nbytes(self, index: int) -> int:
        """The bytes of task `index`'s requirements (what a fill's time depends on)."""
        for launch in self.launches:
            if index < len(launch.points):
                return sum(rect.volume * region.dtype.itemsize
                           for region, rect in zip(launch.regions, launch.rects[index]))
            index -= len(launch.points)
        raise IndexError(f"segment {self.key}: no task {index}")


@dataclass(frozen=True)
class _MappedLaunch:
    """A launch as the runtime maps it: per point its processor, rects (one per requirement,
    on `regions` with `privileges`) and args."""

    name: str
    fn: object
    op: str
    regions: tuple
    privileges: tuple
    points: list
    procs: list
    rects: list
    args: list

    def tasks(self) -> list[TaskNode]:
        out = []
        for point, proc, rects, args in zip(self.points, self.procs, self.rects, self.args):
            memory = proc.memory
            reqs = tuple([PhysicalReq(region, rect, privilege, memory)
                          for region, rect, privilege in zip(self.regions, rects, self.privileges)])
            out.append(TaskNode(-1, self.name, proc, self.fn, reqs, args, point, -1, self.op))
        return out


@dataclass(frozen=True)
class _OpSegments:
    """An op's own recorded segments under one config (SegmentBuilder._op_segments)."""

    config: TileConfig
    plan: OpPlan
    forward: RecordedSegment
    backward: RecordedSegment
    zero_grads: tuple
    updates: tuple
    update_plans: tuple


@dataclass(frozen=True)
class RegionResult:
    """What one region's analysis adds to the graph's second iteration, in arrays.

    A task is named by (j, t): task t of the segment at program position j (the segments that
    touch a region, and so their positions, are part of its cache key). Copy i is caused by
    task (copy_j[i], copy_t[i]) at its requirement copy_req[i] (the task's first on this
    region); buffer_j/t name a fold's buffer task (-1: none). Preds are edges, one a column of
    the rows (dst kind, dst a, dst b, src kind, src a, src b), so that assembly reads each row
    contiguously: an end is a copy (kind 0: its index here in a) or a task (kind 1: (j, t) in
    a, b); edges into the first step are already gone. The first `timed` edges are what timing
    needs: each of the rest is implied by a path of two of this result's edges (u -> w -> v for
    u -> v), so it changes no node's ready time (a node ends no earlier than its preds, and one
    waits for the same last pred), and assembly lays out only the timed ones for the search
    (a third of a graph's edges go at 64 devices); the graph's preds have them all. `columns`
    stacks the five per-copy arrays (in the order above), so that assembly joins every
    result's in one go; the five are its rows (views: the cache keeps each number once).

    The copies themselves are arrays too, of `region`: per copy its rect ([lo..., hi...]), its
    source and destination as indices into `memories`, its reduction operator code (-1: a copy,
    taskrt.region_analysis) and a fold's buffer requirement (-1: none). So a result moved to
    another region or other memories (SegmentBuilder._region) only swaps those two fields, and
    the CopyNodes are made only when something asks for them (`copy_nodes`)."""

    region: object
    memories: tuple
    copy_rects: np.ndarray
    copy_ends: np.ndarray         # rows (src, dst): indices into memories
    copy_redop: np.ndarray
    copy_buffer_req: np.ndarray
    columns: np.ndarray           # rows copy_j, copy_t, copy_req, buffer_j, buffer_t (int64)
    edges: np.ndarray
    timed: int
    copy_j: np.ndarray = field(init=False, repr=False, compare=False)
    copy_t: np.ndarray = field(init=False, repr=False, compare=False)
    copy_req: np.ndarray = field(init=False, repr=False, compare=False)
    buffer_j: np.ndarray = field(init=False, repr=False, compare=False)
    buffer_t: np.ndarray = field(init=False, repr=False, compare=False)
    _nodes: list = field(default_factory=list, init=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """The bytes of its arrays (the five per-copy columns counted once)."""
        return sum(a.nbytes for a in (self.copy_rects, self.copy_ends, self.copy_redop, self.copy_buffer_req,
                                      self.columns, self.edges))

    def __post_init__(self):
        for name, row in zip(("copy_j", "copy_t", "copy_req", "buffer_j", "buffer_t"), self.columns):
            object.__setattr__(self, name, row)

    @property
    def timed_edges(self) -> np.ndarray:
        """The edges timing needs (a view: the first `timed`)."""
        return self.edges[:, :self.timed]

    def copy_nodes(self, program: list) -> tuple:
        """The copies as CopyNode templates (ids -1), each named after the op of the task that
        causes it (`program`: the segments by position), made once."""
        if not self._nodes:
            nd, region, memories = self.region.ndim, self.region, self.memories
            ops = [program[j].launches[0].op for j in self.copy_j.tolist()]
            self._nodes.append(tuple(
                CopyNode(-1, region, Rect(tuple(r[:nd]), tuple(r[nd:])), memories[src], memories[dst],
                         redop=_redop_name(redop), buffer=None if req < 0 else (-1, req), op=op)
                for r, (src, dst), redop, req, op in zip(self.copy_rects.tolist(), self.copy_ends.tolist(),
                                                         self.copy_redop.tolist(), self.copy_buffer_req.tolist(),
                                                         ops)))
        return self._nodes[0]

    def copy_nbytes(self) -> np.ndarray:
        """Each copy's bytes."""
        nd = self.region.ndim
        extent = np.maximum(self.copy_rects[:, nd:] - self.copy_rects[:, :nd], 0)
        return np.prod(extent, axis=1, dtype=np.int64) * np.dtype(self.region.dtype).itemsize


@dataclass
class AssembledIteration:
    """One steady-state iteration in the runtime's program order: node i is `nodes[i]` (a shared
    template: its `id` means nothing here, positions are the ids), its edges are `successors`
    (its preds pred_idx[pred_ptr[i]:pred_ptr[i + 1]]), it was caused by the segment at program
    position segment_of[i], a fold's buffer task is buffers[i] (-1 elsewhere). `order` lays out the
    parts (the segments' tasks, then the region results' copies, as in `parts`: every result, so
    that the list keeps its length from graph to graph where the regions stay) in that order,
    so per-part arrays (costs) index into it. `nodes`, `segment_of` and `buffer_index` are made
    on first use: timing a graph needs only the arrays and the parts. `successors` has the
    edges that timing needs (each region result's timed ones: the same times); the preds have
    every edge, laid out again from `layout` (the arguments of _lay_out but the edges) when
    first asked for. `delta` says which parts differ from the graph the builder made before:
    (its serial, this graph's, the indices in `parts`), for Arena.place; None where all may."""

    successors: Successors
    order: np.ndarray
    parts: list
    segments: list[RecordedSegment]
    delta: tuple | None
    view: "_PlanView"
    machine: Machine
    layout: tuple
    _costs: list | None = None
    _nodes: list | None = None
    _preds: tuple | None = None
    _causes: tuple | None = None

    @property
    def nodes(self) -> list:
        if self._nodes is None:
            templates = [t for part in self.parts for t in
                         (part.tasks if isinstance(part, RecordedSegment) else part.copy_nodes(self.segments))]
            self._nodes = [templates[i] for i in self.order.tolist()]
        return self._nodes

    def __repr__(self) -> str:
        tasks = sum(isinstance(n, TaskNode) for n in self.nodes)
        return f"AssembledIteration({tasks} tasks, {len(self.nodes) - tasks} copies, {len(self.pred_idx)} edges)"

    @property
    def preds(self) -> list[tuple[int, ...]]:
        ptr, idx = self.pred_ptr, self.pred_idx.tolist()
        return [tuple(idx[ptr[i]:ptr[i + 1]]) for i in range(len(ptr) - 1)]

    @property
    def segment_of(self) -> np.ndarray:
        return self._caused()[0]

    @property
    def buffer_index(self) -> np.ndarray:
        return self._caused()[1]

    def _caused(self) -> tuple[np.ndarray, np.ndarray]:
        """(segment_of, buffer_index), made on first use (timing needs neither)."""
        if self._causes is None:
            columns, copy_columns, copy_counts, offset, sizes, second = self.layout
            self._causes = _causes(columns, copy_columns, offset, sizes, second, self.order)
        return self._causes

    @property
    def buffers(self) -> list:
        return [None if b < 0 else int(b) for b in self.buffer_index]

    def pred_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(pred_ptr, pred_idx): each node's distinct preds, ascending, made on first use from every
        edge of the region results (timing needs only the timed ones)."""
        if self._preds is None:
            columns, copy_columns, copy_counts, offset, sizes, second = self.layout
            results = self.parts[len(self.parts) - len(copy_counts):]
            edges = np.concatenate([np.empty((6, 0), np.int64)] + [r.edges for r in results], axis=1)
            counts = np.array([r.edges.shape[1] for r in results], np.int64)
            _, _, ptr, idx = _lay_out(columns, copy_columns, edges, np.cumsum(counts) - counts, counts,
                                      copy_counts, offset, sizes, second)
            n = ptr.shape[0] - 1
            self._preds = _pred_lists(idx.astype(np.int64), np.repeat(np.arange(n, dtype=np.int64), np.diff(ptr)), n)
        return self._preds

    @property
    def pred_ptr(self) -> np.ndarray:
        return self.pred_arrays()[0]

    @property
    def pred_idx(self) -> np.ndarray:
        return self.pred_arrays()[1]

    def task_cost_at(self, index: int) -> TaskCost | None:
        """What task `index` computes (None for a copy)."""
        if self._costs is None:
            self._costs = [c for part in self.parts if isinstance(part, RecordedSegment) for c in part.costs]
        i = int(self.order[index])
        return self._costs[i] if i < len(self._costs) else None

    @property
    def lowering(self) -> "_PlanView":
        """What strategies.memory reads of a lowering (ops, plans, regions, updates)."""
        return self.view


@dataclass
class _PlanView:
    """The parts of a Lowering that strategies.memory reads, with this strategy's plans (and
    what Lowering.written_grads and Lowering.transient read, so that they take a view too); and
    which ops' plans changed since the builder's program before (`delta`: its serial, this
    one's, the op names; None where all may have), for PeakCache."""

    ops: list
    plans: dict
    values: dict
    input_names: list
    grads: dict
    params: dict
    stats: dict
    loss_output: str | None
    sole_consumers: dict
    update_plans: list   # each op's update plans, in op order
    op_index: dict
    delta: tuple | None

    @functools.cached_property
    def updates(self) -> list:
        """The update plans of every op, in op order (made when first asked for)."""
        return list(itertools.chain.from_iterable(self.update_plans))

    def updates_of(self, op_name: str) -> list:
        """The update plans of one op (what PeakCache asks of an op whose config changed)."""
        return list(self.update_plans[self.op_index[op_name]])


class _ResultList:
    """The region results of the last graph, in a list whose entries keep their places from
    graph to graph: a region that no segment touches any more leaves an empty result in its
    place, which the next new region takes. So a proposal changes a few entries, and the arenas
    are told which (Arena.place's delta) instead of comparing a few thousand (a sixth of a late
    search's assembly). The order of the results changes no node's place in the layout (a
    requirement's copies all come from its region's result) and no time."""

    def __init__(self):
        self.entries: list[RegionResult] = []
        self._index: dict[int, int] = {}   # uid -> its entry
        self._free: list[int] = []         # entries left empty

    def reset(self, where: dict, by_uid: dict) -> None:
        """The results of `where`'s uids, in its order, and no empty entries."""
        self.entries = [by_uid[uid] for uid in where]
        self._index = {uid: k for k, uid in enumerate(where)}
        self._free = []

    def update(self, by_uid: dict, redo: list[int], gone: list[int], region_of: dict) -> list[int] | None:
        """Put in the results of the uids `redo` and empty the entries of those `gone`; the entries
        changed, or None where the list was made again (reset): when a quarter is empty."""
        changed = []
        for uid in gone:
            k = self._index.get(uid)
            if k is None or uid in by_uid:   # (a region can go at one position and come at another)
                continue
            del self._index[uid]
            self.entries[k] = _no_result(region_of[uid])
            self._free.append(k)
            changed.append(k)
        for uid in redo:
            k = self._index.get(uid)
            if k is None:
                k = self._index[uid] = self._free.pop() if self._free else len(self.entries)
                if k == len(self.entries):
                    self.entries.append(None)
            self.entries[k] = by_uid[uid]
            changed.append(k)
        if len(self._free) > 64 and 4 * len(self._free) > len(self.entries):
            live = sorted(self._index, key=self._index.__getitem__)
            self.reset(dict.fromkeys(live), by_uid)
            return None
        return changed


def _no_result(region) -> RegionResult:
    """An empty entry of _ResultList: no copies, no edges."""
    nd = region.ndim
    return RegionResult(region, (), np.empty((0, 2 * nd), np.int64), np.empty((0, 2), np.int64),
                        np.empty(0, np.int64), np.empty(0, np.int64), np.empty((5, 0), np.int64),
                        np.empty((6, 0), np.int64), 0)


class SegmentBuilder:
    """Builds iteration graphs of one op graph on one machine under any configs, from caches."""

    def __init__(self, ops: Sequence[Op], inputs: Sequence[TensorSpec], loss: str, machine: Machine,
                 optimizer=None):
        # a cold build allocates millions of short-lived objects: at the collector's default pace
        # its young passes and full ones over the caches took 30% of a build (as the Simulator,
        # and a runtime that executes, the collector runs less)
        collect_cycles_less()
        self.ops = list(ops)
        self.machine = machine
        self.optimizer = optimizer or SGD(lr=0.01, momentum=0.9)
        self.rt = Runtime(machine, execute=False)
        self.rt.keep_mapped_launches = False   # each launch is recorded once (per op, config and phase)
        defaults = {op.name: default_config(op, machine) for op in self.ops}
        self.low = Lowering(self.rt, self.ops, inputs, defaults, self.optimizer, loss=loss, tag="segments")
        self._backward = self.low._gradient_path()
        self._update_index = {(u.op_name, u.param.name): i for i, u in enumerate(self.low.updates)}
        self._update_shorts = {}
        for u in self.low.updates:
            self._update_shorts.setdefault(u.op_name, []).append((u.param.name, u.param.name[len(u.op_name) + 1:]))
        self._plans: dict[tuple, OpPlan] = {}
        self._plan_shapes: dict[tuple, OpPlan] = {}   # (op name, degrees) -> the first plan of them
        self._plan_twins: dict[tuple, OpPlan] = {}    # (an op's geometry, degrees) -> the first plan of them
        self._geometries: dict[str, tuple] = {}       # op name -> _geometry_of
        self._update_plans: dict[tuple, UpdatePlan] = {}
        self._segments: dict[tuple, RecordedSegment] = {}
        self._regions: dict[tuple, RegionResult] = {}
        self._canonical: dict[tuple, tuple] = {}   # see _region: (result, its region, its memories)
        self._shape_ids: dict[tuple, int] = {}
        self._by_name = {op.name: op for op in self.ops}
        self._region_of: dict = {}   # uid -> Region, of every region a recorded segment touches
        self._memory_index = {m: i for i, m in enumerate(machine.memories)}   # memory -> its number
        self.stats = {"segments_recorded": 0, "regions_analyzed": 0, "regions_renamed": 0, "cache_flushes": 0}
        self.cache_bytes = CACHE_BYTES
        self._cached_bytes = 0
        self._op_parts: dict[tuple, _OpSegments] = {}
        self._results = _ResultList()
        self._serial = 0   # builds made: a graph's `delta` names the one before it
        #: per op index, the op indices whose gradient fills depend on its config: its own and
        #: those of the ops whose outputs it alone reads (Lowering.written_grads)
        index = self._op_index = {op.name: i for i, op in enumerate(self.ops)}
        self._fill_dependents: list[set[int]] = [{i} for i in range(len(self.ops))]
        for i, op in enumerate(self.ops):
            for t in op.outputs:
                use = self.low.sole_consumers.get(t.name)
                if use is not None:
                    self._fill_dependents[index[use[0]]].add(i)
        #: the last program's per-op parts, fills and plans, its serial, what changed and its step (_program)
        self._last_ops: tuple[list, list, dict, int, tuple | None, list] | None = None
        self._op_names = [op.name for op in self.ops]
        #: where each op's zeroings and updates stand in a step (_step: op i's from at[i] to at[i + 1])
        self._places: tuple[list[int], list[int]] | None = None
        self._programs = 0   # programs made: a view's delta names the one before it
        # the program's own fills (of unsharded weight gradients, of every weight and state at
        # the start) and each step's batch source
        zero = self.low.host_fill_segment(ZERO_GRAD_PHASE, [
            (p.grad, 0.0) for p in self.low.params.values() if p.grad is not None
            and p.name not in {u.param.name for u in self.low.updates}])
        init = self.low.host_fill_segment("init", [
            (r, 0.0) for p in self.low.params.values() for r in (p.value, *p.state.values())]
            + [(r, 0.0) for r in self.low.stats.values()])
        source = self.low.source_segment(None)
        self._zero = self._get(("graph", ZERO_GRAD_PHASE), lambda: (zero, None))
        self._init = self._get(("graph", "init"), lambda: (init, None))
        self._source = self._get(("graph", SOURCE_PHASE), lambda: (source, None))
        #: the last build's program, per region uid its positions in it and its result, and per
        #: position its segment's key_id and task count: the next build (a proposal changes one
        #: op) redoes only the regions of the segments it changed, and rereads only those segments
        self._last: tuple[list, dict, dict, list, np.ndarray] | None = None
        #: the step's segment count: every program has it (each op always makes the same segments,
        #: empty or not), since the cached region analyses name segments by their places
        self._step_length: int | None = None
        self._columns = Arena(5, np.int64)    # the results' columns and edges, each placed once
        self._edges = Arena(6, np.int64)

    def __repr__(self) -> str:
        return (f"SegmentBuilder({len(self.ops)} ops, {len(self._segments)} segments and "
                f"{len(self._regions)} region analyses cached)")

    # ---- plans and segments, cached by config ------------------------------------------------
    def plan(self, op: Op, config: TileConfig) -> OpPlan:
        """op's plan under `config`, made once; it shares its tiles, rects and partitions with the
        first plan made of the op's degrees (OpPlan's `like`), or, for the first, its tiles and
        rects with the first plan of a twin op of those degrees (OpPlan's `twin`: the same kind,
        attributes and input shapes; networks repeat their blocks)."""
        key = (op.name, config)
        plan = self._plans.get(key)
        if plan is None:
            shape = (op.name, config.degrees)
            like = self._plan_shapes.get(shape)
            twin = None
            if like is None:
                twin_key = (self._geometry_of(op), config.degrees)
                twin = self._plan_twins.get(twin_key)
            plan = self._plans[key] = OpPlan(self.low, op, config, self._backward[op.name], None, like, twin)
            if like is None:
                self._plan_shapes[shape] = plan
                self._plan_twins.setdefault(twin_key, plan)
        return plan

    def _geometry_of(self, op: Op) -> tuple:
        """ops.lower.geometry of op (what OpPlan's twins share), made once per op."""
        known = self._geometries.get(op.name)
        if known is None:
            known = self._geometries[op.name] = geometry(op)
        return known

    def updates(self, op: Op, config: TileConfig) -> list[UpdatePlan]:
        """The update plans of op's trained weights under `config`, in the Lowering's order."""
        out = []
        for full, short in self._update_shorts.get(op.name, ()):
            key = (full, config)
            u = self._update_plans.get(key)
            if u is None:
                u = self._update_plans[key] = UpdatePlan(self.low.params[full], self.plan(op, config), short,
                                                         self.optimizer,
                                                         rotate=self._update_index[(op.name, full)])
            out.append(u)
        return out

    def _program(self, configs: dict[str, TileConfig]) -> tuple[list[RecordedSegment], int]:
        """The program of build_iteration as its segments in order; and where the iteration graph
        starts: the second step's batch source.
        An op's own segments come from _op_segments (made once per op and config); its gradient
        fills depend on the configs of its outputs' sole consumers too (_fill_of). Both are
        taken from the last program where the configs they depend on are the same objects (a
        proposal changes one op's), and the last step is patched where they changed."""
        last = self._last_ops
        if last is None:
            parts = [self._op_segments(op, configs[op.name]) for op in self.ops]
            plans = {op.name: part.plan for op, part in zip(self.ops, parts)}
            fills = [self._fill_of(op, part, plans) for op, part in zip(self.ops, parts)]
            step = self._step(parts, fills)
            changed = None
        else:
            parts, fills, plans, step = list(last[0]), list(last[1]), dict(last[2]), list(last[5])
            names = self._op_names
            changed = list(itertools.compress(range(len(parts)), map(
                operator.is_not, map(configs.__getitem__, names), map(_config_of, parts))))
            for i in changed:
                parts[i] = self._op_segments(self.ops[i], configs[names[i]])
                plans[names[i]] = parts[i].plan
            refilled = {k for i in changed for k in self._fill_dependents[i]}
            for i in refilled:
                fills[i] = self._fill_of(self.ops[i], parts[i], plans)
            if any(fills[i][2] != last[1][i][2] for i in refilled):
                step = self._step(parts, fills)   # another set of gradients is filled on the host
            else:
                self._patch_step(step, parts, fills, changed, refilled)
                self._check_length(len(step))
        serial, self._programs = self._programs, self._programs + 1
        self._last_ops = (parts, fills, plans, serial,
                          None if changed is None else (last[3], serial, [self.ops[i].name for i in changed]), step)
        return [self._init, self._source, *step, self._source, *step], 2 + len(step)

    def _step(self, parts: list["_OpSegments"], fills: list[tuple]) -> list[RecordedSegment]:
        """One step's segments in build_iteration's order, from every op's parts and fills; notes
        where each op's parts stand in it (_patch_step)."""
        low = self.low
        filled = set()
        for _, _, covered in fills:
            filled.update(covered)
        unfilled = tuple(name for name in low.grads if name not in filled)
        host = self._get(("graph", GRAD_FILL_PHASE, tuple(low.grads[name].uid for name in unfilled)),
                         lambda: (low.host_fill_segment(GRAD_FILL_PHASE, [
                             (low.grads[name], 1.0 if name == low.loss_output else 0.0) for name in unfilled]), None))
        step = ([part.forward for part in parts] + [rec for _, rec, _ in fills] + [host]
                + [rec for part in parts for rec in part.zero_grads] + [self._zero]
                + [part.backward for part in reversed(parts)] + [rec for part in parts for rec in part.updates])
        if self._step_length is None:
            self._step_length = len(step)
            n = len(parts)
            zero_at = list(itertools.accumulate([len(part.zero_grads) for part in parts], initial=2 * n + 1))
            update_at = list(itertools.accumulate([len(part.updates) for part in parts], initial=zero_at[-1] + 1 + n))
            self._places = (zero_at, update_at)
        self._check_length(len(step))
        return step

    def _patch_step(self, step: list, parts: list, fills: list, changed: list[int], refilled: set[int]) -> None:
        """Put the new parts of the ops at `changed` and the new fills at `refilled` into the last
        step, in place (_step's order: forwards, fills, the host's fill, zeroings, the program's
        zeroing, backwards in reverse, updates)."""
        n = len(parts)
        zero_at, update_at = self._places
        for i in changed:
            part = parts[i]
            step[i] = part.forward
            step[zero_at[-1] + n - i] = part.backward
            for at, recs in ((zero_at, part.zero_grads), (update_at, part.updates)):
                if len(recs) != at[i + 1] - at[i]:
                    self._check_length(len(step) + len(recs) - (at[i + 1] - at[i]))
                step[at[i]:at[i + 1]] = recs
        for i in refilled:
            step[n + i] = fills[i][1]

    def _check_length(self, length: int) -> None:
        if length != self._step_length:
            raise RuntimeError(f"SegmentBuilder: a step of {length} segments after one of {self._step_length}: "
                               f"an op's segments must not come and go with its config")

    def _fill_of(self, op: Op, part: "_OpSegments", plans: dict[str, OpPlan]) -> tuple:
        """(the outputs of `op` whose gradients their consumers write whole under `plans`, so none
        is filled; the recorded fills of the rest; the gradients those two cover)."""
        low = self.low
        written = low.written_grads(plans, op)
        rec = self._get((op.name, GRAD_FILL_PHASE, part.config, tuple(sorted(written))),
                        lambda: (low.grad_fill_segment(part.plan, written), part.plan))
        return written, rec, frozenset(written).union(rec.fills)

    def _op_segments(self, op: Op, config: TileConfig) -> "_OpSegments":
        """op's own recorded segments under `config` (forward, backward, weight-gradient zeroing and
        updates), made once."""
        key = (op.name, config)
        known = self._op_parts.get(key)
        if known is None:
            plan = self.plan(op, config)
            low = self.low
            updates = self.updates(op, config)
            known = self._op_parts[key] = _OpSegments(
                config, plan,
                self._get((op.name, FORWARD_PHASE, config), lambda: (low.forward_segment(plan, True), plan)),
                self._get((op.name, BACKWARD_PHASE, config), lambda: (low.backward_segment(plan), plan)),
                tuple(self._get((u.param.name, ZERO_GRAD_PHASE, config), lambda u=u: (low.zero_grad_segment(u), None))
                      for u in updates),
                tuple(self._get((u.param.name, UPDATE_PHASE, config), lambda u=u: (low.update_segment(u, 1), None))
                      for u in updates),
                tuple(updates))
        return known

    def _get(self, key: tuple, make) -> RecordedSegment:
        rec = self._segments.get(key)
        if rec is None:
            segment, plan = make()
            rec = self._segments[key] = self._record(key, segment, plan)
            self._cached_bytes += SEGMENT_BYTES + TASK_BYTES * len(rec.procs)
        return rec

    def _record(self, key: tuple, segment: Segment, plan: OpPlan | None) -> RecordedSegment:
        """The segment's point tasks as Runtime.index_launch would map them, and what each computes."""
        rt = self.rt
        op = self._by_name.get(segment.op)
        launches, procs, costs = [], [], []
        accesses = {}   # uid -> the index of each task that touches it
        asked = {}   # uid -> what the tasks ask of it, flat (see shapes below)
        rows = {}    # uid -> the rows of `requirements`, flat
        for launch in segment.launches:
            spec = rt._make_spec(launch.fn, list(launch.colors), launch.reqs, launch.args, None, launch.name,
                                 launch.placement, segment.op or "")
            regions = tuple([r.region for r in spec.reqs])
            privileges = tuple([r.privilege for r in spec.reqs])
            launches.append(_MappedLaunch(spec.name, spec.fn, spec.op, regions, privileges, spec.points, spec.procs,
                                          spec.rects, spec.args))
            codes = [_privilege_code(p) for p in privileges]
            uids = [region.uid for region in regions]
            self._region_of.update(zip(uids, regions))
            base = len(procs)
            procs += spec.procs
            costs += launch_task_costs(op, plan, spec.name, spec.rects, spec.points)
            if len(set(uids)) == len(uids):   # each region once a task: requirement by requirement
                for j, uid in enumerate(uids):
                    column = [rects[j] for rects in spec.rects]
                    indexes = [i for i, rect in enumerate(column, base) if not rect._empty]
                    if not indexes:
                        continue
                    if uid not in accesses:
                        accesses[uid], asked[uid], rows[uid] = [], [], []
                    accesses[uid] += indexes
                    flat, row, code = asked[uid], rows[uid], codes[j]
                    for index in indexes:
                        rect = column[index - base]
                        asks = (j, *rect.lo, *rect.hi, code)
                        flat.append(-1)
                        flat += asks
                        row.append(index)
                        row += asks
                continue
            for index, rects in enumerate(spec.rects, base):
                for j, rect in enumerate(rects):
                    if rect._empty:
                        continue
                    uid = uids[j]
                    tasks = accesses.get(uid)
                    if tasks is None:
                        accesses[uid] = [index]
                        asked[uid] = flat = [-1]
                        rows[uid] = row = []
                    else:
                        flat, row = asked[uid], rows[uid]
                        if tasks[-1] != index:
                            tasks.append(index)
                            flat.append(-1)
                    asks = (j, *rect.lo, *rect.hi, codes[j])
                    flat += asks
                    row.append(index)
                    row += asks
        # a shape: per task -1, then per requirement on the region its index, rect and privilege
        # code (records of one length): all ints, so that it hashes and compares fast
        shapes = {uid: self._shape_id(tuple(flat)) for uid, flat in asked.items()}
        memory_of = [self._memory_index[p.memory] for p in procs]
        memory_ids = {uid: tuple([memory_of[t] for t in tasks]) for uid, tasks in accesses.items()}
        requirements = {uid: np.array(row, np.int64).reshape(-1, 3 + 2 * self._region_of[uid].ndim)
                        for uid, row in rows.items()}
        access_tasks = {uid: np.array(tasks, np.int64) for uid, tasks in accesses.items()}
        self.stats["segments_recorded"] += 1
        return RecordedSegment(key, self.stats["segments_recorded"], segment.op, segment.phase, tuple(launches),
                               tuple(procs), len(procs), tuple(costs), shapes, memory_ids, access_tasks,
                               requirements, segment.fills)

    def _shape_id(self, shape: tuple) -> int:
        """A small int per distinct shape (what a segment's tasks ask of one region), so that
        canonical region keys hash fast."""
        i = self._shape_ids.get(shape)
        if i is None:
            i = self._shape_ids[shape] = len(self._shape_ids)
        return i

    # ---- the graph -----------------------------------------------------------------------------
    def build(self, configs: dict[str, TileConfig]) -> AssembledIteration:
        """The iteration graph under `configs` (op name -> resolved TileConfig, every op)."""
        program, second = self._program(configs)
        return self._assemble(program, second)

    def _assemble(self, program: list[RecordedSegment], second: int) -> AssembledIteration:
        """Lay the second step's tasks and the copies their regions' analyses cause out in program
        order (each task after its copies, those by requirement, then as analyzed), in arrays."""
        view = self._view()   # (before _bound_caches may drop the last program's parts)
        last, self._last = self._last, None   # (updated in place: a build that fails leaves none)
        if last is None or len(last[0]) != len(program):
            last = changed = None
        else:
            changed = list(itertools.compress(range(len(program)), map(operator.is_not, last[0], program)))
        where, by_uid, redo, gone = self._regions_of(program, last, changed)
        ids, sizes = _program_numbers(program, last, changed)
        for uid in redo:
            positions = where[uid]
            key = (uid, tuple([ids[j] for j in positions]))
            result = self._regions.get(key)
            if result is None:
                result = self._regions[key] = self._region(uid, program, positions, second)
                self._cached_bytes += REGION_BYTES + result.nbytes
            by_uid[uid] = result
        self._last = (program, where, by_uid, ids, sizes)
        self._bound_caches()
        if last is None:
            self._results.reset(where, by_uid)
            moved = None
        else:
            moved = self._results.update(by_uid, redo, gone, self._region_of)
        results = self._results.entries
        serial, self._serial = self._serial, self._serial + 1
        # task numbers: the second step's tasks in order; the first step's are negative (edges to them go)
        sizes = sizes.copy()
        sizes[:second] = 0
        offset = np.cumsum(sizes) - sizes
        offset[:second] = -(1 << 40)
        delta = None if moved is None else (serial - 1, serial, moved)
        copy_starts, copy_counts = self._columns.place(results, _columns_of, delta)
        edge_starts, edge_counts = self._edges.place(results, _edges_of, delta)
        copy_columns = columns_of(copy_starts, copy_counts)
        order, indeg, ptr, idx = _lay_out(self._columns.store, copy_columns, self._edges.store, edge_starts,
                                          edge_counts, copy_counts, offset, sizes, second)
        changed_parts = None if delta is None else (   # the parts (below) that differ from the last graph's
            serial - 1, serial,
            [j - second for j in changed if j >= second] + [len(program) - second + k for k in moved])
        return AssembledIteration(Successors(indeg, ptr, idx), order,
                                  program[second:] + results, program, changed_parts,
                                  view, self.machine,
                                  (self._columns.store, copy_columns, copy_counts, offset, sizes, second))

    def count_cached(self, nbytes: int) -> None:
        """Count `nbytes` more of what is cached for the parts this builder made (a simulator's
        costs of them), dropped with them."""
        self._cached_bytes += nbytes

    def _bound_caches(self) -> None:
        """Drop the caches of recorded segments and region analyses when they hold more than
        cache_bytes (about): the next builds record and analyze again what they need, from the
        plans (kept) and the last build (kept: it is what the next one is compared with). A
        segment's key_id is never reused, so no region key made before can match one made
        after; the simulator drops its costs of the old parts when it sees the count of flushes
        change."""
        if self._cached_bytes <= self.cache_bytes:
            return
        self._segments.clear()
        self._op_parts.clear()
        self._last_ops = None
        self._regions.clear()
        self._canonical.clear()
        self._cached_bytes = 0
        self.stats["cache_flushes"] += 1

    def _regions_of(self, program: list[RecordedSegment], last: tuple | None,
                    changed: list[int] | None) -> tuple[dict, dict, list[int], list[int]]:
        """(region uid -> the positions of the segments that touch it, in program order; uid -> the
        last build's result for the uids whose segments are all as they were; the uids to look up
        afresh; the uids no segment touches any more). From the last build's (`last`,
        self._last: updated in place) where the program has its length, the positions `changed`
        (a changed config changes which segments stand at a few positions), else from scratch."""
        if last is None:
            where: dict[int, list[int]] = {}
            for j, rec in enumerate(program):
                for uid in rec.access_tasks:
                    where.setdefault(uid, []).append(j)
            return where, {}, list(where), []
        before, where, by_uid = last[0], last[1], last[2]
        redo: dict[int, None] = {}   # (a dict: in the order met, so that runs are alike)
        gone = []
        for j in changed:
            old, new = before[j], program[j]
            for uid in old.access_tasks.keys() - new.access_tasks.keys():
                positions = [k for k in where[uid] if k != j]
                if positions:
                    where[uid] = positions
                else:
                    del where[uid]
                    by_uid.pop(uid, None)
                    gone.append(uid)
            for uid in new.access_tasks.keys() - old.access_tasks.keys():
                positions = list(where.get(uid, ()))
                bisect.insort(positions, j)
                where[uid] = positions
            redo.update(dict.fromkeys(new.access_tasks))
            redo.update(dict.fromkeys(old.access_tasks))
        return where, by_uid, [uid for uid in redo if uid in where], gone

    def _view(self) -> _PlanView:
        """What strategies.memory reads of the last program's ops (_program): their plans and update plans."""
        parts, _, plans, _, delta, _ = self._last_ops
        return self._plan_view(plans, list(map(_update_plans_of, parts)), delta)

    def plan_view(self, configs: dict[str, TileConfig]) -> _PlanView:
        """What strategies.memory reads of the ops under `configs` (op name -> resolved TileConfig,
        every op), from the plans alone: no graph is built."""
        return self._plan_view({op.name: self.plan(op, configs[op.name]) for op in self.ops},
                               [self.updates(op, configs[op.name]) for op in self.ops], None)

    def _plan_view(self, plans: dict, update_plans: list, delta: tuple | None) -> _PlanView:
        low = self.low
        return _PlanView(self.ops, plans, low.values, low.input_names, low.grads, low.params, low.stats,
                         low.loss_output, low.sole_consumers, update_plans, self._op_index, delta)

    # ---- one region's analysis -------------------------------------------------------------------
    def _region(self, uid: int, program: list[RecordedSegment], positions: list[int], second: int) -> RegionResult:
        """Region `uid`'s result when its exact key missed: renamed from an analysis of the same
        accesses elsewhere, or analyzed.

        The analysis is equivariant under renaming memories: it uses them only as dict keys and
        by equality (`choose_source` takes a piece's first valid memory in insertion order, and
        a renamed program inserts the renamed memories in the same order), so tasks mapped to
        other memories by a bijection give the same nodes and edges, with the copies' sources
        and destinations renamed by it. Of the region it reads only the bounds, and of the
        segments only what their tasks ask of it, in order: not the op, not where in the
        program they stand (beyond which step). So the same accesses to another region of the
        same bounds (a like layer's weight or activation, or a region a plan makes afresh)
        come from one analysis too, moved to this region, these memories and these segments'
        positions. The canonical key is what the analysis reads: the region's bounds, per
        segment that touches it (in program order) whether it is in the graph's step and, task
        by task, the requirement indices, rects and privileges on the region (its shape), and
        each task's memory numbered by first appearance."""
        region = self._region_of[uid]
        flat = list(itertools.chain.from_iterable([program[j].memory_ids[uid] for j in positions]))
        numbering = {m: k for k, m in enumerate(dict.fromkeys(flat))}   # by first appearance (in C but this)
        numbers = tuple(map(numbering.__getitem__, flat))
        key = (region.rect, tuple([j >= second for j in positions]), tuple([program[j].shapes[uid] for j in positions]),
               numbers)
        memories = tuple([self.machine.memories[i] for i in numbering])
        tasks = _task_keys(program, positions, uid)
        known = self._canonical.get(key)
        if known is None:
            result = self._analyze(region, program, positions, second, numbers, memories)
            self._canonical[key] = (result, region, memories, tasks)
            return result
        self.stats["regions_renamed"] += 1
        return _moved(*known, region, memories, tasks)

    def _analyze(self, region, program: list[RecordedSegment], positions: list[int], second: int,
                 access_mem: Sequence[int], memories: tuple) -> RegionResult:
        """The analysis of `region`'s accesses alone (the tasks of the segments at `positions` that
        touch it, in program order: taskrt/region_analysis.py, the runtime's Analyzer compiled),
        keeping what it adds to the second step (from `second` on). `access_mem` numbers each
        access's memory, `memories` by those numbers."""
        uid = region.uid
        parts = [program[j].requirements[uid] for j in positions]
        rows = np.concatenate(parts)
        access_first, access_k = _access_runs(rows, np.array([len(p) for p in parts], np.int64))
        keep_from = int(np.searchsorted(access_k, bisect.bisect_left(positions, second)))   # the second step's first
        out = analyze_region(region.ndim, access_mem, access_first, rows[:, 2:-1], rows[:, -1], keep_from)
        result = RegionResult(region, memories, *_second_step(out.copies, out.copy_rects, out.task_node, out.edges,
                                                               rows, access_first, access_k,
                                                               np.array(positions, np.int64), second))
        self.stats["regions_analyzed"] += 1
        return result


def _program_numbers(program: list[RecordedSegment], last: tuple | None,
                     changed: list[int] | None) -> tuple[list[int], np.ndarray]:
    """(each segment's key_id, its task count (an array)) by program position: from the last
    build's (`last`, SegmentBuilder._last) at the positions `changed` where there is one (a
    program has thousands of segments, and reading each was a tenth of an assembly)."""
    if last is None:
        return list(map(_key_id, program)), np.fromiter(map(_task_count, program), np.int64, len(program))
    ids, sizes = last[3], last[4]
    for j in changed:
        ids[j] = program[j].key_id
        sizes[j] = program[j].n_tasks
    return ids, sizes


#: task keys are position * TASK_KEY + task index (a segment has fewer tasks than this)
TASK_KEY = 1 << 32


def _task_keys(program: list[RecordedSegment], positions: list[int], uid: int) -> np.ndarray:
    """The tasks that touch region `uid`, in program order, each as position * TASK_KEY + its index
    in its segment."""
    tasks = [program[j].access_tasks[uid] for j in positions]
    keys = np.concatenate(tasks)
    keys += np.repeat(np.array(positions, np.int64) * TASK_KEY, list(map(len, tasks)))
    return keys


def _moved(result: RegionResult, analyzed: object, analyzed_on: tuple, analyzed_tasks: np.ndarray, region,
           memories: tuple, tasks: np.ndarray) -> RegionResult:
    """`result`, an analysis of `analyzed` whose accesses came from tasks `analyzed_tasks` (keys, in
    program order) on memories `analyzed_on` (result.memories), as the analysis of the same
    accesses to `region` by `tasks` on `memories`: the copies on the region between the renamed
    memories (the same indices into the new memories), and every task they name replaced by the
    one in its place."""
    if analyzed is region and analyzed_on == memories and np.array_equal(analyzed_tasks, tasks):
        return result
    columns, edges = _renamed_tasks(result.columns, result.edges, analyzed_tasks, tasks)
    return RegionResult(region, memories, result.copy_rects, result.copy_ends, result.copy_redop,
                        result.copy_buffer_req, columns, edges, result.timed)


@numba.njit(cache=True, nogil=True)
def _renamed_tasks(columns, edges, analyzed_tasks, tasks):
    """_moved's columns and edges: each task (j, t) they name (a copy's cause, a fold's buffer,
    an edge's task ends) replaced by the key in `tasks` at the place of j * TASK_KEY + t in
    `analyzed_tasks` (distinct keys)."""
    order = np.argsort(analyzed_tasks)
    ranked = analyzed_tasks[order]
    columns = columns.copy()
    edges = edges.copy()
    for i in range(columns.shape[1]):
        _rename(columns, 0, i, order, ranked, tasks)
        if columns[3, i] >= 0:
            _rename(columns, 3, i, order, ranked, tasks)
    for i in range(edges.shape[1]):
        for kind in (0, 3):
            if edges[kind, i] == 1:
                _rename(edges, kind + 1, i, order, ranked, tasks)
    return columns, edges


@numba.njit(cache=True, nogil=True, inline="always")
def _rename(rows, at, i, order, ranked, tasks):
    """The task (rows[at, i], rows[at + 1, i]) replaced by the one in its place (_renamed_tasks)."""
    new = tasks[order[np.searchsorted(ranked, rows[at, i] * TASK_KEY + rows[at + 1, i])]]
    rows[at, i] = new // TASK_KEY
    rows[at + 1, i] = new % TASK_KEY


@numba.njit(cache=True, nogil=True)
def _access_runs(rows, counts):
    """(where each access starts in `rows`, the end last; the index of its segment): an access is
    a run of rows of one task of one segment (`rows` holds the segments' rows on a region,
    counts[k] of segment k's, each row's task first)."""
    first = np.empty(rows.shape[0] + 1, np.int64)
    segment = np.empty(rows.shape[0], np.int64)
    n = 0
    r = 0
    for k in range(counts.shape[0]):
        for i in range(r, r + counts[k]):
            if i == r or rows[i, 0] != rows[i - 1, 0]:
                first[n] = i
                segment[n] = k
                n += 1
        r += counts[k]
    first[n] = rows.shape[0]
    return first[:n + 1].copy(), segment[:n].copy()


@numba.njit(cache=True, nogil=True)
def _second_step(copies, copy_rects, task_node, edges, rows, access_first, access_k, place, second):
    """What a region's analysis (analyze_region's copies, copy_rects, task_node and edges, of
    the accesses `access_first` and `access_k` (_access_runs) of `rows`) adds to the second
    step, as RegionResult's arrays after its region and memories: the copies that accesses of
    segments at positions from `second` cause (`place`: each segment's position), the edges
    (an analysis from the second step's first access, `keep_from`, lists only those between
    its nodes), those that no two others imply first (_implied), and how many come first
    (RegionResult.timed)."""
    n_nodes = 0
    for a in range(task_node.shape[0]):
        n_nodes = max(n_nodes, task_node[a] + 1)
    for c in range(copies.shape[0]):
        n_nodes = max(n_nodes, copies[c, NODE] + 1)
    task_access = np.full(n_nodes, -1, np.int64)   # node -> its access (tasks)
    # each node as an edge's end (kind, a, b): a task of the second step (1, its segment's position,
    # its index there), a kept copy (0, its index, 0); kind -1 for the rest (edges to them go)
    end = np.full((n_nodes, 3), -1, np.int64)
    for a in range(task_node.shape[0]):
        node = task_node[a]
        task_access[node] = a
        if place[access_k[a]] >= second:
            end[node, 0], end[node, 1], end[node, 2] = 1, place[access_k[a]], rows[access_first[a], 0]
    kept = np.empty(copies.shape[0], np.int64)
    n = 0
    for c in range(copies.shape[0]):
        if place[access_k[copies[c, ACCESS]]] >= second:
            node = copies[c, NODE]
            end[node, 0], end[node, 1], end[node, 2] = 0, n, 0
            kept[n] = c
            n += 1
    kept_rects = np.empty((n, copy_rects.shape[1]), np.int64)
    ends = np.empty((n, 2), np.int64)
    redop = np.empty(n, np.int64)
    buffer_req = np.empty(n, np.int64)
    columns = np.full((5, n), -1, np.int64)
    for i in range(n):
        c = kept[i]
        kept_rects[i] = copy_rects[c]
        ends[i, 0], ends[i, 1], redop[i] = copies[c, SRC], copies[c, DST], copies[c, REDOP]
        a = copies[c, ACCESS]
        columns[0, i], columns[1, i], columns[2, i] = place[access_k[a]], rows[access_first[a], 0], rows[access_first[a], 1]
        buffer_req[i] = -1
        if copies[c, BUFFER_NODE] >= 0:
            b = task_access[copies[c, BUFFER_NODE]]
            buffer_req[i] = copies[c, BUFFER_REQ]
            columns[3, i], columns[4, i] = place[access_k[b]], rows[access_first[b], 0]
    m = edges.shape[0]
    implied = _implied(edges, n_nodes)
    out = np.empty((6, m), np.int64)
    timed = m - np.count_nonzero(implied)
    at_timed, at_implied = 0, timed   # the timed edges first, then the implied ones, each in the analysis' order
    for e in range(m):
        dst, src = edges[e, 0], edges[e, 1]
        if implied[e]:
            at = at_implied
            at_implied += 1
        else:
            at = at_timed
            at_timed += 1
        for k in range(3):
            out[k, at] = end[dst, k]
            out[3 + k, at] = end[src, k]
    return kept_rects, ends, redop, buffer_req, columns, out, timed


@numba.njit(cache=True, nogil=True)
def _implied(edges, n_nodes):
    """Which of the edges (rows dst, src: node ids under n_nodes) another two of them imply:
    u -> v where u -> w and w -> v are among them too. Removing all of these keeps what reaches
    what (in a DAG each is then implied by a path of kept ones)."""
    m = edges.shape[0]
    count = np.zeros(n_nodes + 1, np.int64)
    for e in range(m):
        count[edges[e, 1] + 1] += 1
    for v in range(n_nodes):
        count[v + 1] += count[v]
    succ = np.empty(m, np.int64)   # node u's out-edges (indices into edges) from count[u]
    fill = count[:n_nodes].copy()
    for e in range(m):
        src = edges[e, 1]
        succ[fill[src]] = e
        fill[src] += 1
    two_hops = np.full(n_nodes, -1, np.int64)   # v: the last u with u -> w -> v
    implied = np.zeros(m, np.bool_)
    for u in range(n_nodes):
        for k in range(count[u], count[u + 1]):
            w = edges[succ[k], 0]
            for k2 in range(count[w], count[w + 1]):
                two_hops[edges[succ[k2], 0]] = u
        for k in range(count[u], count[u + 1]):
            implied[succ[k]] = two_hops[edges[succ[k], 0]] == u
    return implied


@numba.njit(cache=True, nogil=True)
def _pred_lists(dst: np.ndarray, src: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Edges (dst[i] waits for src[i]) of an n-node graph as pred lists: (ptr, idx), node v's
    preds idx[ptr[v]:ptr[v + 1]], ascending and each once. A counting sort by node, then each
    node's few preds sorted in place: linear in the edges, where sorting them all was not."""
    _, start, idx = successor_lists(src, dst, n)   # the reversed edges' successors: each node's preds
    ptr = np.zeros(n + 1, np.int64)
    out = 0
    for v in range(n):
        a, b = start[v], start[v + 1]
        if b - a > 16:
            idx[a:b].sort()
        else:
            for i in range(a + 1, b):   # insertion sort: most nodes have a few preds
                x = idx[i]
                j = i - 1
                while j >= a and idx[j] > x:
                    idx[j + 1] = idx[j]
                    j -= 1
                idx[j + 1] = x
        for i in range(a, b):
            if i == a or idx[i] != idx[i - 1]:
                idx[out] = idx[i]
                out += 1
        ptr[v + 1] = out
    return ptr, idx[:out].copy()


#: what the builder's arenas place of each region result
_columns_of, _edges_of = operator.attrgetter("columns"), operator.attrgetter("timed_edges")
#: per program entry, read in C (a program has thousands)
_key_id, _task_count = operator.attrgetter("key_id"), operator.attrgetter("n_tasks")
_update_plans_of = operator.attrgetter("update_plans")
_config_of = operator.attrgetter("config")


@numba.njit(cache=True, nogil=True, inline="always")
def _end_node(kind, a, b, offset, base):
    """The number of an edge end: a task (kind 1) is task b of the segment at program position a
    (numbered from offset[a]); a copy (kind 0) is copy a of its result (numbered from base)."""
    return offset[a] + b if kind == 1 else base + a


@numba.njit(cache=True, nogil=True)
def _lay_out(columns, copy_columns, edges, edge_starts, edge_counts, copy_counts, offset, sizes, second):
    """The assembly's arrays from the region results' columns and edges (RegionResult: placed in
    their arenas' stores: copy i's column in `columns` is copy_columns[i], copies numbered
    result after result; result r's edges are edge_counts[r] columns of `edges` from
    edge_starts[r]; `copy_counts` per result) and each program position's task count (`sizes`,
    zero before `second`) and first task number (`offset`).

    Tasks are numbered in program order, copies after them by result. The layout puts each task
    after the copies it causes, those by requirement and then in the order analyzed (a counting
    sort by causing task, linear in the nodes). Returns (order: layout position -> number,
    and the edges in layout positions as successor lists: indegree, succ_ptr, succ_idx (an edge
    two region results both make is there twice: the timing needs no more, and pred_lists makes
    the distinct preds where they are asked for). Its arrays are int32: they are read over and
    over, and at half the width the layout and the schedule took about 13% and 3% less time."""
    n_tasks = 0
    for j in range(second, sizes.shape[0]):
        n_tasks += sizes[j]
    n_copies = copy_columns.shape[0]
    n = n_tasks + n_copies
    # copies bucketed by causing task (stably), each bucket then by requirement (stably)
    copy_task = np.empty(n_copies, np.int32)
    for c in range(n_copies):
        copy_task[c] = offset[columns[0, copy_columns[c]]] + columns[1, copy_columns[c]]
    start, bucket = stable_sort_by(copy_task, np.arange(n_copies, dtype=np.int32), n_tasks)
    for v in range(n_tasks):
        for i in range(start[v] + 1, start[v + 1]):
            c = bucket[i]
            k = i - 1
            while k >= start[v] and columns[2, copy_columns[bucket[k]]] > columns[2, copy_columns[c]]:
                bucket[k + 1] = bucket[k]
                k -= 1
            bucket[k + 1] = c
    order = np.empty(n, np.int32)
    position = np.empty(n, np.int32)
    at = 0
    for v in range(n_tasks):
        for i in range(start[v], start[v + 1]):
            order[at] = n_tasks + bucket[i]
            position[n_tasks + bucket[i]] = at
            at += 1
        order[at] = v
        position[v] = at
        at += 1
    # edges, rows (dst kind, a, b, src kind, a, b): ends as layout positions
    m = edge_counts.sum()
    dst = np.empty(m, np.int32)
    src = np.empty(m, np.int32)
    e = 0
    base = n_tasks
    for r in range(edge_counts.shape[0]):
        for k in range(edge_starts[r], edge_starts[r] + edge_counts[r]):
            dst[e] = position[_end_node(edges[0, k], edges[1, k], edges[2, k], offset, base)]
            src[e] = position[_end_node(edges[3, k], edges[4, k], edges[5, k], offset, base)]
            e += 1
        base += copy_counts[r]
    indeg, ptr, idx = successor_lists(dst, src, n)
    return order, indeg, ptr, idx


@numba.njit(cache=True, nogil=True)
def _causes(columns, copy_columns, offset, sizes, second, order):
    """(segment_of, buffer_index) by layout position (AssembledIteration), from _lay_out's
    arguments and its `order`: which program position caused each node, and a fold's buffer
    task (-1: none, or made in the first step)."""
    n = order.shape[0]
    n_copies = copy_columns.shape[0]
    n_tasks = n - n_copies
    position = np.empty(n, np.int64)
    for p in range(n):
        position[order[p]] = p
    segment_of = np.empty(n, np.int64)
    buffer_index = np.full(n, -1, np.int64)
    v = 0
    for j in range(second, sizes.shape[0]):
        for _ in range(sizes[j]):
            segment_of[position[v]] = j
            v += 1
    for c in range(n_copies):
        p = position[n_tasks + c]
        col = copy_columns[c]
        segment_of[p] = columns[0, col]
        if columns[3, col] >= 0:
            buf = offset[columns[3, col]] + columns[4, col]
            if buf >= 0:
                buffer_index[p] = position[buf]
    return segment_of, buffer_index
