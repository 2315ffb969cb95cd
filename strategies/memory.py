"""Peak memory per device under a strategy, from the lowered graph's own plans.

What a device keeps during an iteration, each region counted once per memory (the union of
the rects that memory holds of it):
- weights and state (batch norm's running stats): the weight and state rects of the tiles on it;
- gradients: the same rects of every trained weight's gradient;
- optimizer state: the state of the update shards on it (ops/lower.py UpdatePlan: a weight
  replicated over P devices keeps 1/P of its state on each);
- activations kept for backward: every op's input and output rects on its tiles' devices.
Not counted: activation gradients (REDUCE buffers live one op at a time), what a kernel saves
for backward besides its inputs and outputs, and host memory (attached inputs, initial weights).

A strategy whose peak exceeds a device's `mem_bytes` does not fit (`fits`): the search treats
it as invalid.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

from ops.base import Op
from ops.lower import Lowering, TileConfig, default_config, resolve_config
from strategies.machine_model import MachineModel
from taskrt import Runtime
from taskrt.geometry import Rect, pairwise_disjoint
from taskrt.machine import Machine, Memory


def union_volume(rects) -> int:
    """Elements covered by the union of `rects` (each counted once where they overlap)."""
    # PeakCache asks this of each memory's rects of each region it redoes: most are one rect, or
    # two (a tile and its reader's), so those two cases come first
    rects = set(rects)
    if len(rects) == 1:
        return next(iter(rects)).volume
    rects = [r for r in rects if not r.empty]
    if len(rects) == 2:
        a, b = rects
        return a.volume + b.volume - a.intersect(b).volume
    if len(rects) <= 1 or pairwise_disjoint(rects):
        return sum(r.volume for r in rects)
    if rects[0].ndim == 0:
        return 1
    cuts = sorted({r.lo[0] for r in rects} | {r.hi[0] for r in rects})
    total = 0
    for a, b in zip(cuts, cuts[1:]):
        inside = [Rect(r.lo[1:], r.hi[1:]) for r in rects if r.lo[0] <= a and r.hi[0] >= b]
        if inside:
            total += (b - a) * union_volume(inside)
    return total


def _sources(ops: Sequence[Op]) -> list:
    """The tensors the ops read that no op makes (model inputs and labels), in first-use order."""
    made = {t.name for op in ops for t in op.outputs}
    seen: dict[str, object] = {}
    for op in ops:
        for t in op.inputs:
            if t.name not in made:
                seen.setdefault(t.name, t)
    return list(seen.values())


def _op_holdings(op: Op, plan, updates, low, machine: Machine) -> dict[tuple[Memory, str], tuple[list[Rect], int]]:
    """(memory, region name) -> (the rects of it that `op`'s tiles and its weights' update shards
    (`updates`) keep in that memory, its itemsize)."""
    held: dict[tuple[Memory, str], tuple[list[Rect], int]] = {}

    def add(region, placed) -> None:
        """Adds the non-empty rects of `placed` ((memory, rect) pairs) of `region`."""
        name, itemsize = region.name, region.dtype.itemsize
        for memory, rect in placed:
            if rect.empty:
                continue
            known = held.get((memory, name))
            if known is None:
                held[(memory, name)] = ([rect], itemsize)
            else:
                known[0].append(rect)

    procs = machine.processors
    tiles = [(procs[proc].memory, color) for color, proc in plan.placement.items()]
    for i, t in enumerate(op.inputs):
        add(low.values[t.name], [(memory, plan.in_rects[color][i]) for memory, color in tiles])
    for i, t in enumerate(op.outputs):
        add(low.values[t.name], [(memory, plan.out_rects[color][i]) for memory, color in tiles])
    for k in plan.weight_names:
        param = low.params[f"{op.name}.{k}"]
        placed = [(memory, plan.weight_rects[color][k]) for memory, color in tiles]
        add(param.value, placed)
        if param.grad is not None:
            add(param.grad, placed)
    for k in plan.state_names:
        add(low.stats[f"{op.name}.{k}"], [(memory, plan.state_rects[color][k]) for memory, color in tiles])
    for update in updates:
        placed = [(procs[update.placement[color]].memory, rect)
                  for color, rect in update.reqs[0].partition.rects.items()]
        for region in update.param.state.values():
            add(region, placed)
    return held


def _updates_by_op(low) -> dict[str, list]:
    out: dict[str, list] = {}
    for u in low.updates:
        out.setdefault(u.op_name, []).append(u)
    return out


def _holdings(low: Lowering, machine: Machine) -> dict[Memory, dict[str, tuple[list[Rect], int]]]:
    """memory -> region name -> (the rects of it the memory holds, its itemsize)."""
    held: dict[Memory, dict[str, tuple[list[Rect], int]]] = defaultdict(dict)
    updates = _updates_by_op(low)
    for op in low.ops:
        for (memory, name), (rects, itemsize) in _op_holdings(op, low.plans[op.name], updates.get(op.name, ()),
                                                             low, machine).items():
            held[memory].setdefault(name, ([], itemsize))[0].extend(rects)
    return held


class PeakCache:
    """plan_peak for a sequence of strategies of one graph, kept up to date rather than redone:
    each op's holdings are kept by its config, each region's bytes per memory by the configs of
    the ops that hold it (its producer and readers), and the totals from the strategy before,
    so a proposal that changes one op recomputes only that op's regions. Equals plan_peak
    exactly (integer bytes)."""

    def __init__(self, ops: Sequence[Op], machine: Machine):
        self.machine = machine
        self._order = {op.name: i for i, op in enumerate(ops)}
        self._by_name = {op.name: op for op in ops}
        self._seen = None   # the name of the last view's program (a view's delta)
        #: (op name, config) -> region name -> memory -> (the rects of it the op keeps there, itemsize)
        self._op_held: dict[tuple, dict[str, dict[Memory, tuple[list[Rect], int]]]] = {}
        self._region_bytes: dict[tuple, dict[Memory, int]] = {}
        self._first = {}
        for i, p in enumerate(machine.processors):
            self._first.setdefault(p.memory, i)
        # the state after the last strategy
        self._plans: dict[str, object] = {}   # op name -> its plan (a plan seen again has its config)
        self._keys: dict[str, tuple] = {}
        self._holders: dict[str, list[str]] = {}
        self._bytes: dict[str, dict[Memory, int]] = {}
        self._total: dict[Memory, int] = {}

    def _held(self, op, low, key) -> dict[str, dict[Memory, tuple[list[Rect], int]]]:
        got = self._op_held.get(key)
        if got is None:
            updates = low.updates_of(op.name)
            got = self._op_held[key] = {}
            for (memory, name), held in _op_holdings(op, low.plans[op.name], updates, low, self.machine).items():
                got.setdefault(name, {})[memory] = held
        return got

    def peak(self, low) -> dict[int, int]:
        """Peak bytes per device of `low`'s plans (a Lowering or strategies.segments' view)."""
        plans = low.plans
        delta = getattr(low, "delta", None)   # (strategies.segments' views: the ops changed since a program)
        ops = low.ops
        if delta is not None and delta[0] == self._seen:
            ops = [self._by_name[name] for name in delta[2]]
        self._seen = None if delta is None else delta[1]
        changed = []   # the ops whose config changed, of those whose plan is another object
        for op in ops:
            plan = plans[op.name]
            if plan is not self._plans.get(op.name):
                self._plans[op.name] = plan
                if self._keys.get(op.name) != (op.name, plan.config):
                    changed.append(op)
        if changed:
            touched: set[str] = set()
            for op in changed:
                old = self._keys.get(op.name)
                key = self._keys[op.name] = (op.name, plans[op.name].config)
                before = self._op_held[old].keys() if old is not None else set()
                after = self._held(op, low, key).keys()
                for region in before - after:
                    self._holders[region].remove(op.name)
                for region in after - before:
                    names = self._holders.setdefault(region, [])
                    names.append(op.name)
                    names.sort(key=self._order.__getitem__)
                touched |= before | after
            for region in touched:
                for memory, nbytes in self._bytes.pop(region, {}).items():
                    self._total[memory] -= nbytes
                names = self._holders.get(region)
                if not names:
                    continue
                per_memory = self._region_of(region, names)
                self._bytes[region] = per_memory
                for memory, nbytes in per_memory.items():
                    self._total[memory] = self._total.get(memory, 0) + nbytes
        peak: dict[int, int] = {}
        for memory, nbytes in self._total.items():
            if nbytes:
                peak[self._first[memory]] = peak.get(self._first[memory], 0) + int(nbytes)
        return dict(sorted(peak.items()))

    def _region_of(self, region: str, names: list[str]) -> dict[Memory, int]:
        """Bytes per memory of one region, held by the ops `names` under their current configs."""
        key = (region, tuple(self._keys[n] for n in names))
        per_memory = self._region_bytes.get(key)
        if per_memory is None:
            rects: dict[Memory, tuple[list, int]] = {}
            for n in names:
                for memory, (rs, itemsize) in self._op_held[self._keys[n]].get(region, {}).items():
                    rects.setdefault(memory, ([], itemsize))[0].extend(rs)
            per_memory = self._region_bytes[key] = {m: union_volume(rs) * itemsize
                                                    for m, (rs, itemsize) in rects.items()}
        return per_memory


def peak_memory(graph: Lowering | tuple[Sequence[Op], Mapping[str, TileConfig]], machine_model: MachineModel,
                optimizer=None, loss: str | None = None) -> dict[int, int]:
    """Bytes each device (processor index of the machine) keeps under a strategy; see the module doc.

    `graph` is a Lowering (Model.compile's, on its runtime's machine) or (ops, configs): the ops
    in graph order with the loss op last (or named by `loss`), each op's TileConfig (missing
    ones get the data-parallel default), lowered here on machine_model.to_machine() with
    `optimizer` (its state count; None: no optimizer state)."""
    if isinstance(graph, Lowering):
        return plan_peak(graph, graph.rt.machine)
    ops, configs = graph
    ops = list(ops)
    if not ops:
        raise ValueError("peak_memory: the graph has no ops")
    machine = machine_model.to_machine()
    resolved = {op.name: resolve_config(op, configs[op.name], machine) if op.name in configs
                else default_config(op, machine) for op in ops}
    with Runtime(machine, execute=False) as rt:
        low = Lowering(rt, ops, _sources(ops), resolved, optimizer, loss=loss or ops[-1].name, tag="memory")
        return plan_peak(low, machine)


def plan_peak(low, machine: Machine) -> dict[int, int]:
    """Peak bytes per device (processor index) of a lowering's plans on `machine`; `low` is a
    Lowering or anything with its ops, plans, values, params, stats and updates."""
    first = {}
    for i, p in enumerate(machine.processors):
        first.setdefault(p.memory, i)
    peak: dict[int, int] = {}
    for memory, regions in _holdings(low, machine).items():
        total = sum(union_volume(rects) * itemsize for rects, itemsize in regions.values())
        peak[first[memory]] = peak.get(first[memory], 0) + int(total)
    return dict(sorted(peak.items()))


def over_capacity(peak: Mapping[int, int], machine_model: MachineModel,
                  machine: Machine | None = None) -> dict[int, tuple[int, int]]:
    """The devices whose peak exceeds their memory: processor index -> (peak bytes, capacity)."""
    machine = machine or machine_model.to_machine()
    over = {}
    for proc, nbytes in peak.items():
        capacity = machine_model.device_of(machine.processors[proc]).mem_bytes
        if nbytes > capacity:
            over[proc] = (nbytes, capacity)
    return over


def fits(graph: Lowering | tuple[Sequence[Op], Mapping[str, TileConfig]], machine_model: MachineModel,
         optimizer=None, loss: str | None = None) -> bool:
    """Whether every device's peak memory under the strategy fits its memory size."""
    machine = graph.rt.machine if isinstance(graph, Lowering) else None
    return not over_capacity(peak_memory(graph, machine_model, optimizer, loss), machine_model, machine)

