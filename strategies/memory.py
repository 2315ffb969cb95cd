"""Peak memory per device under a strategy, from the lowered graph's own plans.

What a device keeps during an iteration is what the runtime's instances hold (taskrt/instances.py):
per region, the smallest box holding every rect that the device's tasks ask its memory for:
- weights and state (batch norm's running stats): the weight and state rects of the tiles on it;
- the weights' update shards (ops/lower.py UpdatePlan: a weight replicated over P devices keeps
  1/P of its gradient and optimizer state on each), and a gradient that one tile writes whole;
- activations: every op's input and output rects on its tiles' devices, and the gradients
  its backward reads (its outputs') and writes whole (its inputs');
- partial sums and an ordered op's carries, on its tiles' devices.
These equal what the run's instances hold, region by region, on every device but the one that
attaches the data (tests/test_memory.py). Besides, the reduction buffers: each tile's private
buffer of what it sums into (a replicated weight's gradient, a shared input's gradient, a
partial output), all counted as live at once (they live until folded, and in alexnet's data
parallelism nine tenths of them were live at one time). Not counted: what a kernel keeps for
backward besides its inputs and outputs, and host memory (attached inputs, initial weights).

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
from taskrt.geometry import Rect
from taskrt.machine import Machine, Memory


def _sources(ops: Sequence[Op]) -> list:
    """The tensors the ops read that no op makes (model inputs and labels), in first-use order."""
    made = {t.name for op in ops for t in op.outputs}
    seen: dict[str, object] = {}
    for op in ops:
        for t in op.inputs:
            if t.name not in made:
                seen.setdefault(t.name, t)
    return list(seen.values())


def _op_holdings(plan, updates, machine: Machine) -> tuple[dict[tuple[Memory, str], tuple[list[Rect], int]],
                                                          dict[Memory, int]]:
    """((memory, region name) -> (the rects of it that an op's tiles (its `plan`) and its weights'
    update shards (`updates`) ask that memory for, its itemsize), memory -> the bytes of its tiles'
    reduction buffers there)."""
    held: dict[tuple[Memory, str], tuple[list[Rect], int]] = {}
    buffers: dict[Memory, int] = {}

    def add(region, memory: Memory, rect: Rect) -> None:
        if rect.empty:
            return
        known = held.get((memory, region.name))
        if known is None:
            held[(memory, region.name)] = ([rect], region.dtype.itemsize)
        else:
            known[0].append(rect)

    procs = machine.processors
    for colors, placement, reqs in plan.training_launches():
        for color in colors:
            memory = procs[placement[color]].memory
            for r in reqs:
                rect = r.partition.rects[color]
                if r.privilege.is_reduce:   # into a private buffer of the tile's
                    buffers[memory] = buffers.get(memory, 0) + rect.volume * r.region.dtype.itemsize
                else:
                    add(r.region, memory, rect)
    for update in updates:
        for r in update.reqs:
            for color, rect in r.partition.rects.items():
                add(r.region, procs[update.placement[color]].memory, rect)
    return held, buffers


def box_volume(rects) -> int:
    """Elements in the smallest box holding every non-empty rect of `rects` (what an instance holds)."""
    rects = [r for r in set(rects) if not r.empty]
    if len(rects) <= 1:
        return rects[0].volume if rects else 0
    volume = 1
    for los, his in zip(zip(*[r.lo for r in rects]), zip(*[r.hi for r in rects])):
        volume *= max(his) - min(los)
    return volume


def _updates_by_op(low) -> dict[str, list]:
    out: dict[str, list] = {}
    for u in low.updates:
        out.setdefault(u.op_name, []).append(u)
    return out


def _holdings(low: Lowering, machine: Machine) -> tuple[dict[Memory, dict[str, tuple[list[Rect], int]]],
                                                       dict[Memory, int]]:
    """(memory -> region name -> (the rects of it the memory holds, its itemsize), memory -> the
    bytes of reduction buffers there)."""
    held: dict[Memory, dict[str, tuple[list[Rect], int]]] = defaultdict(dict)
    buffers: dict[Memory, int] = defaultdict(int)
    updates = _updates_by_op(low)
    for op in low.ops:
        regions, op_buffers = _op_holdings(low.plans[op.name], updates.get(op.name, ()), machine)
        for (memory, name), (rects, itemsize) in regions.items():
            held[memory].setdefault(name, ([], itemsize))[0].extend(rects)
        for memory, nbytes in op_buffers.items():
            buffers[memory] += nbytes
    return held, buffers


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
        #: (op name, config) -> memory -> the bytes of the op's reduction buffers there
        self._op_buffers: dict[tuple, dict[Memory, int]] = {}
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
            regions, self._op_buffers[key] = _op_holdings(low.plans[op.name], low.updates_of(op.name), self.machine)
            got = self._op_held[key] = {}
            for (memory, name), held in regions.items():
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
                for memory, nbytes in (self._op_buffers[old].items() if old is not None else ()):
                    self._total[memory] -= nbytes
                for memory, nbytes in self._op_buffers[key].items():
                    self._total[memory] = self._total.get(memory, 0) + nbytes
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
            per_memory = self._region_bytes[key] = {m: box_volume(rs) * itemsize
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
    held, buffers = _holdings(low, machine)
    for memory in set(held) | set(buffers):
        total = sum(box_volume(rects) * itemsize for rects, itemsize in held.get(memory, {}).values())
        peak[first[memory]] = peak.get(first[memory], 0) + int(total + buffers.get(memory, 0))
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

