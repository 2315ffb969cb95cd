"""The iteration graph assembled from cached segments: what the search builds per proposal.

strategies/graph.py builds one training iteration's graph by running the runtime's lowering
and dependence analysis over the whole program. That is the reference, and it costs about
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
  Analyzer the runtime uses.

A proposal that changes op k re-records k's segments and re-analyzes only the regions they
touch (k's inputs, outputs, weights and their gradients); everything else comes from the
caches. `assemble` then lays the nodes out in the runtime's program order (each task after
the copies it causes, those in requirement order), so the graph equals the one
build_iteration makes, node for node and edge for edge (tests/test_segments.py).

    builder = SegmentBuilder(ops, inputs, loss, machine, optimizer)
    graph = builder.build(configs)      # an AssembledIteration
    graph.nodes, graph.preds, graph.segment_of, graph.task_costs
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ops.base import Op, TensorSpec
from ops.lower import (BACKWARD_PHASE, FORWARD_PHASE, GRAD_FILL_PHASE, UPDATE_PHASE, ZERO_GRAD_PHASE, Lowering,
                       OpPlan, Segment, TileConfig, UpdatePlan, default_config)
from ops.optimizers import SGD
from strategies.graph import FILL, UPDATE, TaskCost, launch_phase
from taskrt import Runtime
from taskrt.analysis import Analyzer
from taskrt.machine import Machine
from taskrt.taskgraph import CopyNode, PhysicalReq, TaskNode

#: the program of build_iteration: initial fills, then two training steps; the second is the graph
STEPS = (1, 2)


@dataclass(frozen=True)
class RecordedSegment:
    """A segment's point tasks as the runtime would make them (ids -1), with what each computes,
    and per region uid the tasks that touch it: (task index, requirement indices)."""

    key: tuple
    op: str | None
    phase: str
    tasks: tuple[TaskNode, ...]
    costs: tuple[TaskCost, ...]
    touches: dict
    fills: tuple[str, ...] = ()


@dataclass(frozen=True)
class RegionResult:
    """What one region's analysis adds to the graph's second iteration.

    Accesses are named by (k, t): the k-th segment touching the region (in program order)
    and the task's index in that segment. `copies` are (access, first requirement index of
    the region in that task, copy template, preds, buffer access or None); `task_preds` maps
    an access to its preds. A pred is ('c', i) for this result's copy i or ('t', access)."""

    copies: tuple
    task_preds: dict


@dataclass
class AssembledIteration:
    """One steady-state iteration: nodes in program order, the preds of each (indices), the
    program position of the segment that caused each node, each task's TaskCost (None for a
    copy) and each fold's buffer task (index; None elsewhere). The node objects are shared
    templates: their `id` fields mean nothing here, positions are the ids."""

    nodes: list
    preds: list[tuple[int, ...]]
    segment_of: list[int]
    task_costs: list
    buffers: list
    segments: list[RecordedSegment]
    view: "_PlanView"
    machine: Machine

    def __repr__(self) -> str:
        tasks = sum(isinstance(n, TaskNode) for n in self.nodes)
        return (f"AssembledIteration({tasks} tasks, {len(self.nodes) - tasks} copies, "
                f"{sum(map(len, self.preds))} edges)")

    def task_cost_at(self, index: int) -> TaskCost:
        return self.task_costs[index]

    @property
    def lowering(self) -> "_PlanView":
        """What strategies.memory reads of a lowering (ops, plans, regions, updates)."""
        return self.view


@dataclass
class _PlanView:
    """The parts of a Lowering that strategies.memory reads, with this strategy's plans."""

    ops: list
    plans: dict
    values: dict
    params: dict
    stats: dict
    updates: list


class SegmentBuilder:
    """Builds iteration graphs of one op graph on one machine under any configs, from caches."""

    def __init__(self, ops: Sequence[Op], inputs: Sequence[TensorSpec], loss: str, machine: Machine,
                 optimizer=None):
        self.ops = list(ops)
        self.machine = machine
        self.optimizer = optimizer or SGD(lr=0.01, momentum=0.9)
        self.rt = Runtime(machine, execute=False)
        defaults = {op.name: default_config(op, machine) for op in self.ops}
        self.low = Lowering(self.rt, self.ops, inputs, defaults, self.optimizer, loss=loss, tag="segments")
        self._backward = self.low._gradient_path()
        self._update_index = {(u.op_name, u.param.name): i for i, u in enumerate(self.low.updates)}
        self._update_shorts = {}
        for u in self.low.updates:
            self._update_shorts.setdefault(u.op_name, []).append((u.param.name, u.param.name[len(u.op_name) + 1:]))
        self._plans: dict[tuple, OpPlan] = {}
        self._update_plans: dict[tuple, UpdatePlan] = {}
        self._segments: dict[tuple, RecordedSegment] = {}
        self._regions: dict[tuple, RegionResult] = {}
        self._by_name = {op.name: op for op in self.ops}
        self._region_of: dict = {}   # uid -> Region, of every region a recorded segment touches
        self.zero_segment = self.low.host_fill_segment(ZERO_GRAD_PHASE, [
            (p.grad, 0.0) for p in self.low.params.values() if p.grad is not None
            and p.name not in {u.param.name for u in self.low.updates}])
        self.init_segment = self.low.host_fill_segment("init", [
            (r, 0.0) for p in self.low.params.values() for r in (p.value, *p.state.values())]
            + [(r, 0.0) for r in self.low.stats.values()])
        self.input_segment = self.low.host_fill_segment("input", [
            (self.low.values[t.name], 0) for t in inputs])
        self.stats = {"segments_recorded": 0, "regions_analyzed": 0}

    def __repr__(self) -> str:
        return (f"SegmentBuilder({len(self.ops)} ops, {len(self._segments)} segments and "
                f"{len(self._regions)} region analyses cached)")

    # ---- plans and segments, cached by config ------------------------------------------------
    def plan(self, op: Op, config: TileConfig) -> OpPlan:
        key = (op.name, config)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = OpPlan(self.low, op, config, self._backward[op.name], None)
        return plan

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

    def _program(self, configs: dict[str, TileConfig]) -> tuple[list[tuple], int]:
        """The program of build_iteration as (segment key, make) pairs in order, `make()` giving
        (the Segment, the plan that costs its tasks); and where the iteration graph starts: the
        second step's first forward segment (its input fills stay outside, as there)."""
        low = self.low
        by_op = [(op, configs[op.name]) for op in self.ops]
        step = []
        for op, cfg in by_op:
            step.append(((op.name, FORWARD_PHASE, cfg),
                         lambda op=op, cfg=cfg: (low.forward_segment(self.plan(op, cfg), True), self.plan(op, cfg))))
        for op, cfg in by_op:
            step.append(((op.name, GRAD_FILL_PHASE, cfg),
                         lambda op=op, cfg=cfg: (low.grad_fill_segment(self.plan(op, cfg)), self.plan(op, cfg))))
        filled = set()
        for key, make in step[len(by_op):]:
            filled.update(self._get(key, make).fills)
        host = low.host_fill_segment(GRAD_FILL_PHASE, [(region, 1.0 if name == low.loss_output else 0.0)
                                                        for name, region in low.grads.items() if name not in filled])
        step.append((("graph", GRAD_FILL_PHASE, tuple(l.reqs[0].region.uid for l in host.launches)),
                     lambda host=host: (host, None)))
        for op, cfg in by_op:
            for u in self.updates(op, cfg):
                step.append(((u.param.name, ZERO_GRAD_PHASE, cfg), lambda u=u: (low.zero_grad_segment(u), None)))
        step.append((("graph", ZERO_GRAD_PHASE), lambda: (self.zero_segment, None)))
        for op, cfg in reversed(by_op):
            step.append(((op.name, BACKWARD_PHASE, cfg),
                         lambda op=op, cfg=cfg: (low.backward_segment(self.plan(op, cfg)), self.plan(op, cfg))))
        for op, cfg in by_op:
            for u in self.updates(op, cfg):
                step.append(((u.param.name, UPDATE_PHASE, cfg), lambda u=u: (low.update_segment(u, 1), None)))
        init = (("graph", "init"), lambda: (self.init_segment, None))
        inputs = (("graph", "input"), lambda: (self.input_segment, None))
        program = [init, inputs, *step, inputs, *step]
        return program, 3 + len(step)

    def _get(self, key: tuple, make) -> RecordedSegment:
        rec = self._segments.get(key)
        if rec is None:
            segment, plan = make()
            rec = self._segments[key] = self._record(key, segment, plan)
        return rec

    def _record(self, key: tuple, segment: Segment, plan: OpPlan | None) -> RecordedSegment:
        """The segment's point tasks as Runtime.index_launch would map them, and what each computes."""
        rt = self.rt
        op = self._by_name.get(segment.op)
        tasks, costs, touches = [], [], {}
        for launch in segment.launches:
            spec = rt._make_spec(launch.fn, list(launch.colors), launch.reqs, launch.args, None, launch.name,
                                 launch.placement, segment.op or "")
            for i, point in enumerate(spec.points):
                proc = spec.procs[i]
                reqs = tuple(PhysicalReq(r.region, rect, r.privilege, proc.memory)
                             for r, rect in zip(spec.reqs, spec.rects[i]))
                index = len(tasks)
                tasks.append(TaskNode(-1, spec.name, proc, spec.fn, reqs, spec.args[i], point, -1, spec.op))
                costs.append(_task_cost(op, plan, spec.name, reqs, point))
                for j, r in enumerate(reqs):
                    if r.rect.empty:
                        continue
                    self._region_of[r.region.uid] = r.region
                    entry = touches.setdefault(r.region.uid, [])
                    if entry and entry[-1][0] == index:
                        entry[-1][1].append(j)
                    else:
                        entry.append((index, [j]))
        self.stats["segments_recorded"] += 1
        return RecordedSegment(key, segment.op, segment.phase, tuple(tasks), tuple(costs),
                               {uid: tuple((t, tuple(js)) for t, js in v) for uid, v in touches.items()},
                               segment.fills)

    # ---- the graph -----------------------------------------------------------------------------
    def build(self, configs: dict[str, TileConfig]) -> AssembledIteration:
        """The iteration graph under `configs` (op name -> resolved TileConfig, every op)."""
        program, second = self._program(configs)
        return self._assemble([self._get(key, make) for key, make in program], second, configs)

    def _assemble(self, program: list[RecordedSegment], second: int, configs) -> AssembledIteration:
        where: dict[int, list[int]] = {}
        for j, rec in enumerate(program):
            for uid in rec.touches:
                where.setdefault(uid, []).append(j)
        regions = self._region_of
        # per task of the second step: (requirement index, order, copy) of the copies it causes
        task_copies: dict[tuple[int, int], list] = {}
        task_preds: dict[tuple[int, int], list] = {}
        region_refs = []
        for uid, positions in where.items():
            key = (uid, tuple(program[j].key for j in positions))
            result = self._regions.get(key)
            if result is None:
                result = self._regions[key] = self._analyze(regions[uid], [program[j] for j in positions],
                                                            [j >= second for j in positions])
            region_refs.append((positions, result))
            for c, (access, first_req, copy, preds, buffer) in enumerate(result.copies):
                task = (positions[access[0]], access[1])
                task_copies.setdefault(task, []).append((first_req, c, len(region_refs) - 1))
            for access, preds in result.task_preds.items():
                task_preds.setdefault((positions[access[0]], access[1]), []).append((len(region_refs) - 1, preds))
        nodes, preds, segment_of, task_costs, buffers = [], [], [], [], []
        copy_index: dict[tuple[int, int], int] = {}   # (region ref, copy) -> node index
        task_index: dict[tuple[int, int], int] = {}   # (position, task) -> node index
        pending_buffers = []

        def resolve(ref_i: int, pred) -> int | None:
            kind, what = pred
            if kind == "c":
                return copy_index[(ref_i, what)]
            positions = region_refs[ref_i][0]
            return task_index.get((positions[what[0]], what[1]))

        for j in range(second, len(program)):
            rec = program[j]
            for t, task in enumerate(rec.tasks):
                for _, c, ref_i in sorted(task_copies.get((j, t), ())):
                    positions, result = region_refs[ref_i]
                    access, _, copy, cpreds, buffer = result.copies[c]
                    copy_index[(ref_i, c)] = len(nodes)
                    ps = {resolve(ref_i, p) for p in cpreds}
                    ps.discard(None)
                    nodes.append(copy)
                    preds.append(tuple(sorted(ps)))
                    segment_of.append(j)
                    task_costs.append(None)
                    buffers.append(None)
                    if buffer is not None:
                        pending_buffers.append((len(nodes) - 1, ref_i, buffer))
                ps = set()
                for ref_i, tpreds in task_preds.get((j, t), ()):
                    for p in tpreds:
                        q = resolve(ref_i, p)
                        if q is not None:
                            ps.add(q)
                task_index[(j, t)] = len(nodes)
                nodes.append(task)
                preds.append(tuple(sorted(ps)))
                segment_of.append(j)
                task_costs.append(rec.costs[t])
                buffers.append(None)
        for i, ref_i, buffer in pending_buffers:
            buffers[i] = resolve(ref_i, ("t", buffer))
        view = self._view(configs)
        return AssembledIteration(nodes, preds, segment_of, task_costs, buffers, program, view, self.machine)

    def _view(self, configs) -> _PlanView:
        low = self.low
        plans = {op.name: self.plan(op, configs[op.name]) for op in self.ops}
        updates = [u for op in self.ops for u in self.updates(op, configs[op.name])]
        return _PlanView(self.ops, plans, low.values, low.params, low.stats, updates)

    # ---- one region's analysis -------------------------------------------------------------------
    def _analyze(self, region, segments: list[RecordedSegment], in_graph: list[bool]) -> RegionResult:
        """Run the runtime's Analyzer over `region`'s accesses alone and keep what it adds to the
        accesses of the segments marked `in_graph` (the second step)."""
        uid = region.uid
        ids = iter(range(1 << 62))
        owner: dict[int, tuple] = {}       # local task id -> access (k, t)
        emitted: list = []                  # (copy node, preds, access causing it, first req)
        current = [None, 0]

        def emit(node, preds):
            if isinstance(node, CopyNode):
                emitted.append((node, tuple(preds), current[0], current[1]))
            else:
                local_preds[node.id] = tuple(preds)

        local_preds: dict[int, tuple] = {}
        analyzer = Analyzer(lambda: next(ids), emit)
        for k, rec in enumerate(segments):
            for t, reqs in rec.touches[uid]:
                task = rec.tasks[t]
                current[0], current[1] = (k, t), reqs[0]
                node = analyzer.add_task(task.name, task.proc, None,
                                         [(region, task.reqs[j].rect, task.reqs[j].privilege) for j in reqs],
                                         point=task.point, op=task.op)
                owner[node.id] = (k, t)
        copy_of: dict[int, int] = {}
        copies = []
        for node, preds, access, first_req in emitted:
            if not in_graph[access[0]]:
                continue
            copy_of[node.id] = len(copies)
            buffer = None if node.buffer is None else owner[node.buffer[0]]
            template = CopyNode(-1, node.region, node.rect, node.src, node.dst, redop=node.redop,
                                buffer=None if node.buffer is None else (-1, node.buffer[1]), op=node.op)
            copies.append((access, first_req, template, preds, buffer))

        def ref(n: int):
            if n in copy_of:
                return ("c", copy_of[n])
            if n in owner:
                return ("t", owner[n])
            return None   # a copy of the first step: the edge leaves the iteration

        copies = tuple((a, f, tpl, tuple(r for r in map(ref, ps) if r is not None), b)
                       for a, f, tpl, ps, b in copies)
        task_preds = {owner[nid]: tuple(r for r in map(ref, ps) if r is not None)
                      for nid, ps in local_preds.items() if in_graph[owner[nid][0]]}
        self.stats["regions_analyzed"] += 1
        return RegionResult(copies, task_preds)


def _task_cost(op: Op | None, plan: OpPlan | None, name: str, reqs, point) -> TaskCost:
    """What a recorded task computes (as IterationGraph.task_cost says for the runtime's graph)."""
    if name.startswith("fill:"):
        return TaskCost(None, FILL, reqs[0].rect)
    if name.endswith(".update"):
        return TaskCost(op, UPDATE, reqs[0].rect, name[:-len(".update")])
    return TaskCost(op, launch_phase(name), plan.tiles[point])
