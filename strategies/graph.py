"""The task graph of one steady-state training iteration, built by the runtime's own lowering.

The simulator times exactly the graph that the runtime would run: the ops are lowered by
ops.lower.Lowering onto a Runtime with execute=False (no threads, no data), and one training
iteration is issued twice; the second is the steady state (the first starts from where the
weights were attached). Weights and optimizer state are filled, not attached, so nothing is
allocated. Each iteration starts as Model.train_on's do: every rank makes its share of the
batch in a `source` task on its host processor (Lowering.source_segment). The nodes of the
second iteration from its source on, with the edges among them, are the iteration graph:
edges into the iteration before are dropped, since that iteration has ended before this one
starts.

Every task says what it computes through `TaskCost`: the op, its phase (forward, backward,
update, fill or source) and the rect it works on, which is what a cost model needs.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ops.base import Op, TensorSpec
from ops.lower import SOURCE, SOURCE_PHASE, Lowering, TileConfig
from ops.optimizers import SGD
from strategies.timing import Successors
from taskrt import Runtime
from taskrt.geometry import Rect
from taskrt.machine import Machine
from taskrt.taskgraph import CopyNode, TaskNode

FORWARD, BACKWARD, UPDATE, FILL = "forward", "backward", "update", "fill"
#: a backward that computes weight gradients alone: no one reads its op's input gradients (the
#: model's input), and the op's kernel skips them (Op.writes_out)
BACKWARD_WEIGHTS = "backward_weights"
_CHUNK = re.compile(r"\[\d+\]$")


@dataclass(frozen=True)
class TaskCost:
    """What a task computes: `op` (None for a fill or a source), `phase`, and the rect of its tile
    (forward, backward), of its weight shard (update), of what it fills, or of the rank's share
    of the first input (source)."""

    op: Op | None
    phase: str
    rect: Rect
    param: str | None = None

    def __repr__(self) -> str:
        what = self.op.name if self.op is not None else self.phase
        return f"TaskCost({what} {self.phase} {self.rect!r})"


@dataclass
class IterationGraph:
    """The nodes of one steady-state iteration in program order, the preds of each (indices into
    `nodes`), and the lowering that made them (its plans tell each task's tile)."""

    nodes: list
    preds: list[tuple[int, ...]]
    lowering: Lowering
    machine: Machine

    def __repr__(self) -> str:
        tasks = sum(isinstance(n, TaskNode) for n in self.nodes)
        return f"IterationGraph({tasks} tasks, {len(self.nodes) - tasks} copies, {sum(map(len, self.preds))} edges)"

    def task_cost_at(self, index: int) -> TaskCost:
        return self.task_cost(self.nodes[index])

    def pred_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The preds in CSR form: node i's are idx[ptr[i]:ptr[i + 1]]."""
        ptr = np.zeros(len(self.nodes) + 1, np.int64)
        ptr[1:] = np.cumsum([len(p) for p in self.preds])
        idx = np.fromiter((q for p in self.preds for q in p), np.int64, count=int(ptr[-1]))
        return ptr, idx

    @property
    def successors(self) -> Successors:
        """The edges as the timing core walks them (strategies/timing.py)."""
        return Successors.of_preds(*self.pred_arrays())

    def task_cost(self, node: TaskNode) -> TaskCost:
        """The op, phase and rect of a task of this graph."""
        plan = self.lowering.plans.get(node.op)
        return task_cost_of(None if plan is None else plan.op, plan, node.name, [r.rect for r in node.reqs],
                            node.point)


def task_cost_of(op: Op | None, plan, name: str, rects, point) -> TaskCost:
    """What a task computes, from its launch's name: a fill its rect; an update ('W.update') its
    shard of weight W (its first requirement's rect, of `rects`); a kernel task its plan's tile
    at its point."""
    return launch_task_costs(op, plan, name, [rects], [point])[0]


def launch_task_costs(op: Op | None, plan, name: str, rects: list, points: list) -> list[TaskCost]:
    """task_cost_of for each point of one launch (rects[i] the requirement rects of points[i]),
    the launch's kind and phase worked out once: a segment's launches have 64 points at 64
    devices."""
    if name.startswith("fill:"):
        return [TaskCost(None, FILL, r[0] if r else Rect((), ())) for r in rects]
    if name == SOURCE:
        return [TaskCost(None, SOURCE_PHASE, r[0]) for r in rects]
    if name.endswith(".update"):
        return [TaskCost(op, UPDATE, r[0], name[:-len(".update")]) for r in rects]
    phase = launch_phase(name)
    if phase == BACKWARD and plan.skips_input_grads:
        phase = BACKWARD_WEIGHTS
    tiles, new = plan.tiles, TaskCost.__new__
    costs = [new(TaskCost) for _ in points]
    for cost, point in zip(costs, points):   # TaskCost's fields set directly: its frozen __init__ took
        cost.__dict__.update(op=op, phase=phase, rect=tiles[point], param=None)   # half of this
    return costs


def launch_phase(name: str) -> str:
    """The cost phase of an op's kernel launch by its name: BACKWARD for 'op.bwd' (and an ordered
    dim's 'op.bwd[k]': a launch per position along it, an LSTM's time chunks), else FORWARD."""
    return BACKWARD if _CHUNK.sub("", name).endswith(".bwd") else FORWARD


def build_iteration(ops: Sequence[Op], inputs: Sequence[TensorSpec], loss: str, configs: dict[str, TileConfig],
                    machine: Machine, optimizer=None) -> IterationGraph:
    """Lower `ops` (the loss op among them, named `loss`) under `configs` on `machine` and return
    the graph of the second training iteration. `optimizer` defaults to SGD with momentum."""
    optimizer = optimizer or SGD(lr=0.01, momentum=0.9)
    rt = Runtime(machine, execute=False)
    low = Lowering(rt, ops, inputs, configs, optimizer, loss=loss, tag="simulated")
    for p in low.params.values():
        rt.fill(p.value, 0.0)
        for region in p.state.values():
            rt.fill(region, 0.0)
    for region in low.stats.values():
        rt.fill(region, 0.0)
    first = 0
    for step in (1, 2):
        first = rt._next_id
        low.issue(low.source_segment(None))
        # train_step's launches without its replay block: the runtime analyzes each iteration
        # anyway (the first two always differ), and recording one costs a fifth of the build
        low.forward(training=True, step=step)
        low.backward()
        low.update(step)
    ids = range(first, rt._next_id)
    index = {nid: i for i, nid in enumerate(ids)}
    nodes = [rt.graph.nodes[nid] for nid in ids]
    preds = [tuple(sorted(index[p] for p in rt.graph.preds[nid] if p in index)) for nid in ids]
    return IterationGraph(nodes, preds, low, machine)



def weight_sync_bytes(nodes, params) -> tuple[Counter, Counter]:
    """Bytes of weight values and weight gradients that the copies and folds among `nodes` move
    between memories: (into each memory, out of each memory). `params` are a lowering's
    ParamRegions. The measure of weight synchronization (ideal: 2(P-1)/P of the weights)."""
    weights = {r.uid for p in params for r in (p.value, p.grad) if r is not None}
    into, out = Counter(), Counter()
    for n in nodes:
        if isinstance(n, CopyNode) and n.src != n.dst and n.region.uid in weights:
            into[n.dst] += n.nbytes
            out[n.src] += n.nbytes
    return into, out
