"""Peak memory per device under a strategy, from the lowered graph's own plans.

What a device keeps during an iteration is what the runtime's instances hold (taskrt/instances.py):
per region, the smallest box holding every rect that the device's tasks ask its memory for:
- weights and state (batch norm's running stats): the weight and state rects of the tiles on it;
- the weights' update shards (ops/lower.py UpdatePlan: a weight replicated over P devices keeps
  1/P of its gradient and optimizer state on each), and a gradient that one tile writes whole;
- activations: every op's input and output rects on its tiles' devices, and the gradients
  its backward reads (its outputs') and writes whole (its inputs');
- partial sums and an ordered op's carries, on its tiles' devices.
Weights, their gradients and state, statistics, sums, carries and the graph's inputs and labels
are kept all the time. So are activations and their gradients on CPUs; on GPUs (where a step
releases them: ops.lower.releases_by_default, Lowering.release_points, Runtime.release) they
live for part of the step only: a device holds an activation from the first segment that
touches it there (its producer's forward, a consumer's forward that copies it in; a gradient's
fill at the start of backward, or the first backward that writes it) until its op's backward.
The peak is the most the device holds at once, segment by segment in the step's order: forward
op by op, the gradient fills, backward op by op in reverse. It equals the run's instances
region by region and, when the step runs one launch at a time, segment by segment
(tests/test_memory.py); a run whose devices run ahead of each other frees later and can hold
more. Besides, the reduction buffers: each tile's private buffer of what it sums into (a
replicated weight's gradient, a shared input's gradient, a partial output). Where the step releases, a buffer counts from the
first place that makes it to the last place that touches its region (the buffer is folded and
freed by then, at the next access that reads the region: a weight's gradient at its update, an
activation's at its op's backward); elsewhere all count as live at once (in alexnet's data
parallelism nine tenths of them were live at one time). And what the hosts keep besides
(_host_holdings): rank 0's home memory the weights, optimizer state and statistics attached
whole at the start (their instances stay), each rank's host its share of the step's inputs and
labels, written there by the batch source (Model.train_on; Model.fit attaches the whole batch on
rank 0's home). On a CPU machine the host is device 0 of its rank, so that device holds them too.
Not counted: what a kernel keeps for backward besides its inputs and outputs.

A strategy whose peak exceeds a device's `mem_bytes` does not fit (`fits`): the search treats
it as invalid.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ops.base import Op
from ops.lower import (FORWARD_PHASE, GRAD_FILL_PHASE, Lowering, TileConfig, default_config, rank_shares,
                       releases_by_default, resolve_config)
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


def _place(phase: str, index: int, n: int) -> int:
    """Where op `index` of n's launches of `phase` stand in a step (see the module doc)."""
    if phase == FORWARD_PHASE:
        return index
    if phase == GRAD_FILL_PHASE:
        return n + index
    return 3 * n - 1 - index   # backward, in reverse op order


def place_name(place: int, ops: Sequence[Op]) -> str:
    """A place of the step (_place) in words."""
    n = len(ops)
    if place < n:
        return f"forward of {ops[place].name}"
    if place < 2 * n:
        return f"gradient fills of {ops[place - n].name}"
    return f"backward of {ops[3 * n - 1 - place].name}"


def _op_holdings(plan, updates, fills, machine: Machine, index: int, n: int):
    """What op `index` of n keeps under its plan: ((memory, region name) -> [the rects of it that
    its tiles (its `plan`'s launches and gradient `fills`) and its weights' update shards
    (`updates`) ask that memory for, itemsize, the first place it does]; region name -> the
    last place it touches it; (memory, region name) -> [the bytes of its tiles' reduction buffers
    into that region there, the first place one is made])."""
    held: dict[tuple[Memory, str], list] = {}
    last: dict[str, int] = {}
    buffers: dict[tuple[Memory, str], list] = {}

    def add(region, memory: Memory, rect: Rect, at: int) -> None:
        if rect.empty:
            return
        known = held.get((memory, region.name))
        if known is None:
            held[(memory, region.name)] = [[rect], region.dtype.itemsize, at]
        else:
            known[0].append(rect)
            known[2] = min(known[2], at)

    procs = machine.processors
    launches = plan.training_launches() + [(GRAD_FILL_PHASE, f.colors, f.placement, f.reqs) for f in fills]
    for phase, colors, placement, reqs in launches:
        at = _place(phase, index, n)
        for r in reqs:
            last[r.region.name] = max(last.get(r.region.name, at), at)
        for color in colors:
            memory = procs[placement[color]].memory
            for r in reqs:
                rect = r.partition.rects[color]
                if r.privilege.is_reduce:   # into a private buffer of the tile's
                    known = buffers.setdefault((memory, r.region.name), [0, at])
                    known[0] += rect.volume * r.region.dtype.itemsize
                    known[1] = min(known[1], at)
                else:
                    add(r.region, memory, rect, at)
    at = _place(FORWARD_PHASE, index, n)
    for update in updates:
        for r in update.reqs:
            for color, rect in r.partition.rects.items():
                add(r.region, procs[update.placement[color]].memory, rect, at)
    return held, last, buffers


#: the holder in PeakCache of what the hosts keep besides the ops' tiles (_host_holdings)
HOST = ""


def _host_holdings(low, machine: Machine) -> dict[str, dict[Memory, list]]:
    """Region name -> memory -> [its rects there, itemsize, first place (0)]: rank 0's home the
    weights, optimizer state and statistics that Lowering.init_values attached whole there, each
    rank's host its share of every input (and the labels) that the batch source writes
    (ops.lower.rank_shares)."""
    home = machine.host_processor(0).memory
    out: dict[str, dict[Memory, list]] = {}
    attached = [r for p in low.params.values() for r in (p.value, *p.state.values())] + list(low.stats.values())
    for region in attached:
        out[region.name] = {home: [[region.rect], region.dtype.itemsize, 0]}
    for name in low.input_names:
        region = low.values[name]
        out[region.name] = {machine.host_processor(rank).memory: [[rect], region.dtype.itemsize, 0]
                            for rank, rect in rank_shares(region.shape, machine.num_ranks).items()}
    return out


def box_volume(rects) -> int:
    """Elements in the smallest box holding every non-empty rect of `rects` (what an instance holds)."""
    rects = [r for r in set(rects) if not r.empty]
    if len(rects) <= 1:
        return rects[0].volume if rects else 0
    volume = 1
    for los, his in zip(zip(*[r.lo for r in rects]), zip(*[r.hi for r in rects])):
        volume *= max(his) - min(los)
    return volume


class PeakCache:
    """Peak bytes per device for a sequence of strategies of one graph, kept up to date rather
    than redone: each op's holdings are kept by its config (and the gradients its only consumer
    writes whole: those it fills for no one), each region's bytes and places per memory by the
    configs of the ops that hold it (its producer and readers), and per memory the bytes that
    come and go at each place of the step, so a proposal that changes one op recomputes only
    that op's regions and the memories they are on. plan_peak is a new one's first answer."""

    def __init__(self, ops: Sequence[Op], machine: Machine, release: bool | None = None):
        self.machine = machine
        #: whether the step releases its activations (Lowering.release; None: by the machine's kind)
        self.release = releases_by_default(machine) if release is None else release
        self.ops = list(ops)
        self._order = {HOST: -1, **{op.name: i for i, op in enumerate(ops)}}
        self._by_name = {op.name: op for op in ops}
        self._seen = None   # the name of the last view's program (a view's delta)
        #: op name -> the ops that made its inputs that it alone reads (whose fills its config
        #: decides); the names of the regions a step releases (both from the first lowering seen)
        self._fill_producers: dict[str, list[str]] | None = None
        self._transient: set[str] | None = None
        #: places in a step: forward, gradient fills and backward, one per op each; the last one
        self._places = 3 * len(ops)
        self._end = self._places - 1
        #: memory -> its row in _diff; the processor index it reports under
        self._row: dict[Memory, int] = {}
        self._first: list[int] = []
        for i, p in enumerate(machine.processors):
            if p.memory not in self._row:
                self._row[p.memory] = len(self._first)
                self._first.append(i)
        #: per memory row, the bytes that come (+) and go (-) at each place of the step: [0] of
        #: instances, [1] of reduction buffers
        self._diff = np.zeros((2, len(self._first), self._places + 1), np.int64)
        self._peaks = np.zeros(len(self._first), np.int64)
        self._stale = np.zeros(len(self._first), bool)   # the memory rows whose peak is to be found again
        #: (op name, config, written) -> (region name -> memory -> [rects, itemsize, first place],
        #: region name -> last place, region name -> memory -> [bytes of its reduction buffers
        #: there, first place])
        self._op_held: dict[tuple, tuple] = {}
        self._region_parts: dict[tuple, tuple[list, list, np.ndarray]] = {}
        # the state after the last strategy
        self._plans: dict[str, object] = {}   # op name -> its plan (a plan seen again has its config)
        self._keys: dict[str, tuple] = {}
        self._holders: dict[str, list[str]] = {}
        #: region -> (its instance parts, its buffer parts, each (row, bytes, first place, last
        #: place); their changes to _diff), as _region_of makes them
        self._parts: dict[str, tuple[list, list, np.ndarray]] = {}

    def _held(self, op, low, key) -> tuple:
        got = self._op_held.get(key)
        if got is None:
            plan = low.plans[op.name]
            fills = [f for fs in plan.grad_fill_launches(low.loss_output, key[2]).values() for f in fs]
            held, last, buffers = _op_holdings(plan, low.updates_of(op.name), fills, self.machine,
                                               self._order[op.name], len(self.ops))
            regions: dict[str, dict[Memory, list]] = {}
            for (memory, name), h in held.items():
                regions.setdefault(name, {})[memory] = h
            by_region: dict[str, dict[Memory, list]] = {}
            for (memory, name), b in buffers.items():
                regions.setdefault(name, {})
                by_region.setdefault(name, {})[memory] = b
            got = self._op_held[key] = (regions, last, by_region)
        return got

    def _key(self, op, low) -> tuple:
        return (op.name, low.plans[op.name].config, Lowering.written_grads(low, low.plans, op))

    def peak(self, low) -> dict[int, int]:
        """Peak bytes per device of `low`'s plans (a Lowering or strategies.segments' view)."""
        touched: set[str] = set()
        if self._transient is None:
            host = _host_holdings(low, self.machine)
            self._keys[HOST] = (HOST,)
            self._op_held[(HOST,)] = (host, {}, {})
            for region in host:
                self._holders.setdefault(region, []).insert(0, HOST)
            touched.update(host)
            self._transient = {r.name for r in Lowering.transient(low)}
            producer = {t.name: op.name for op in self.ops for t in op.outputs}
            self._fill_producers = {op.name: [] for op in self.ops}
            for t, (consumer, _) in low.sole_consumers.items():
                if t in producer:
                    self._fill_producers[consumer].append(producer[t])
        plans = low.plans
        delta = getattr(low, "delta", None)   # (strategies.segments' views: the ops changed since a program)
        ops = self.ops
        if delta is not None and delta[0] == self._seen:
            ops = [self._by_name[name] for name in delta[2]]
        self._seen = None if delta is None else delta[1]
        moved = []   # the ops whose plan is another object
        for op in ops:
            plan = plans[op.name]
            if plan is not self._plans.get(op.name):
                self._plans[op.name] = plan
                moved.append(op.name)
        candidates = set(moved)
        for name in moved:
            candidates.update(self._fill_producers[name])
        changed = []
        for name in sorted(candidates, key=self._order.__getitem__):
            op = self._by_name[name]
            key = self._key(op, low)
            if self._keys.get(name) != key:
                changed.append((op, key))
        if changed or touched:
            self._update(changed, low, touched)
        if self._stale.any():
            rows = np.flatnonzero(self._stale)
            self._peaks[rows] = np.cumsum(self._diff[0, rows] + self._diff[1, rows], axis=1).max(axis=1)
            self._stale[:] = False
        peak: dict[int, int] = {}
        for row in np.flatnonzero(self._peaks):
            proc = self._first[row]
            peak[proc] = peak.get(proc, 0) + int(self._peaks[row])
        return dict(sorted(peak.items()))

    def _update(self, changed: list, low, touched: set[str]) -> None:
        """Take the ops `changed` ((op, key) of its new config) and the regions `touched` besides
        (the hosts' on a first peak) into the regions' parts and the diff arrays."""
        for op, key in changed:
            old = self._keys.get(op.name)
            self._keys[op.name] = key
            before = self._op_held[old][0].keys() if old is not None else set()
            after = self._held(op, low, key)[0].keys()
            for region in before - after:
                self._holders[region].remove(op.name)
            for region in after - before:
                names = self._holders.setdefault(region, [])
                names.append(op.name)
                names.sort(key=self._order.__getitem__)
            touched |= before | after
        added, taken = [], []   # the regions' changes to the diff arrays (_region_of), made in one go
        for region in touched:
            old = self._parts.pop(region, None)
            if old is not None:
                taken.append(old[2])
            names = self._holders.get(region)
            if names:
                parts = self._parts[region] = self._region_of(region, names)
                added.append(parts[2])
        if added or taken:
            kinds, rows, places, amounts = np.concatenate(added + taken, axis=1)
            if taken:
                amounts[-sum(t.shape[1] for t in taken):] *= -1
            np.add.at(self._diff, (kinds, rows, places), amounts)
            self._stale[rows] = True

    def _region_of(self, region: str, names: list[str]) -> tuple[list, list, np.ndarray]:
        """(instance parts, buffer parts, their changes to the diff arrays) of one region, held by
        the ops `names` under their current configs: per memory that holds it, (memory row, bytes,
        first place, last place); the changes as rows (kind: 0 instances, 1 buffers; memory row;
        place; bytes), each part's bytes coming at its first place and going after its last.
        Where the step releases, a buffer lives from the first place that reduces into the
        region there to the last place that touches the region (its fold comes by then: at the
        next access that reads it); elsewhere, all the step."""
        key = (region, tuple(self._keys[n] for n in names))
        parts = self._region_parts.get(key)
        if parts is None:
            rects: dict[Memory, list] = {}
            buffers: dict[Memory, list] = {}
            last = 0
            for n in names:
                regions, lasts, bufs = self._op_held[self._keys[n]]
                last = max(last, lasts.get(region, 0))
                for memory, (rs, itemsize, first) in regions.get(region, {}).items():
                    known = rects.get(memory)
                    if known is None:
                        rects[memory] = [list(rs), itemsize, first]
                    else:
                        known[0].extend(rs)
                        known[2] = min(known[2], first)
                for memory, (nbytes, first) in bufs.get(region, {}).items():
                    known = buffers.setdefault(memory, [0, first])
                    known[0] += nbytes
                    known[1] = min(known[1], first)
            transient = self.release and region in self._transient
            until = last if transient else self._end
            instances = [(self._row[m], box_volume(rs) * itemsize, first if transient else 0, until)
                         for m, (rs, itemsize, first) in rects.items()]
            held = [(self._row[m], nbytes, first if self.release else 0, until if self.release else self._end)
                    for m, (nbytes, first) in buffers.items()]
            changes = [(kind, row, at, sign * nbytes) for kind, both in enumerate((instances, held))
                       for row, nbytes, first, last in both for at, sign in ((first, 1), (last + 1, -1))]
            parts = self._region_parts[key] = (instances, held, np.array(changes, np.int64).reshape(-1, 4).T.copy())
        return parts


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


def step_holdings(low, machine: Machine) -> tuple[dict[Memory, dict[str, tuple[int, int, int]]],
                                                    dict[Memory, np.ndarray], dict[Memory, np.ndarray],
                                                    dict[Memory, int]]:
    """What the model counts, for tests and tools: (memory -> region name -> (bytes of its
    instance, first place, last place); memory -> the bytes of instances held at each place of
    the step; memory -> the bytes of reduction buffers live at each place; memory -> the bytes of
    all its reduction buffers, live or not). Places: op i's forward is i, its gradient fills
    n + i, its backward 3n - 1 - i."""
    cache = PeakCache(low.ops, machine, getattr(low, "release", None))
    cache.peak(low)
    memories = {row: memory for memory, row in cache._row.items()}
    regions: dict[Memory, dict[str, tuple[int, int, int]]] = {m: {} for m in cache._row}
    total = {m: 0 for m in cache._row}
    for name, (instances, buffers, _) in cache._parts.items():
        for row, nbytes, first, last in instances:
            regions[memories[row]][name] = (nbytes, first, last)
        for row, nbytes, _, _ in buffers:
            total[memories[row]] += nbytes
    held = np.cumsum(cache._diff, axis=2)[:, :, :-1]
    return (regions, {m: held[0, row] for m, row in cache._row.items()},
            {m: held[1, row] for m, row in cache._row.items()}, total)


def plan_peak(low, machine: Machine) -> dict[int, int]:
    """Peak bytes per device (processor index) of a lowering's plans on `machine`; `low` is a
    Lowering or anything with its ops, plans, values, grads, params, stats, updates, loss
    output and sole consumers (strategies.segments' views, which release as the machine's
    kind says)."""
    return PeakCache(low.ops, machine, getattr(low, "release", None)).peak(low)


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

