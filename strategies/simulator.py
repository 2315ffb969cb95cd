"""The execution simulator: one training iteration under a strategy, timed without running it.

It times the graph the runtime would run (strategies/graph.py: the runtime's own lowering
and dependence analysis on an execute=False runtime) against a cost model, as a null
device would: every task takes its cost model time on its processor, every copy its link's
latency plus bytes over bandwidth on its channel (copies on one channel take turns, so
contention counts), a fold from another memory its copy plus the fold on the target, a fold
within one memory its fold on that memory's copy worker. On a cpu machine with message
overheads, a copy between ranks also holds the sending processor before the wire and the
receiving one after it (the runtime's MPI handling on the workers' cores), and is in flight
for the model's message_delay on top of the link's latency. Each processor,
channel and memory runs one node at a time in order of readiness (strategies/timing.py).

    sim = Simulator.for_model(model, load_machine("p100"))
    result = sim.simulate(data_parallel(model, sim.machine))
    result.time, result.busy, result.peak_memory

A result also writes a trace in the runtime's format (`write_trace`), so the trace tools
read simulations and real runs alike.
"""
from __future__ import annotations

import functools
import itertools
import json
import math
import operator
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numba
import numpy as np

from ops.base import Op, TensorSpec
from ops.optimizers import make_optimizer
from ops.lower import ConfigError, TileConfig, default_config, resolve_config
from ops.model import check_source
from ops.strategy import Strategy, model_fingerprint
from strategies.cost import CostModel
from strategies.graph import (BACKWARD, BACKWARD_WEIGHTS, FILL, FORWARD, SOURCE_PHASE, UPDATE, IterationGraph,
                              build_iteration)
from strategies.arena import Arena, columns_of
from strategies.machine_model import MachineModel
from strategies.memory import PeakCache, plan_peak
from strategies.segments import PART_COST_BYTES, AssembledIteration, RecordedSegment, SegmentBuilder
from strategies.timing import NO_NAPS, Handling, Naps, Timing, schedule_successors
from taskrt.heap import collect_cycles_less, keep_freed_memory
from taskrt.taskgraph import CopyNode

#: the most samples a batch source is timed on (CostModel.measure_source keeps seconds a sample;
#: a source makes its samples one at a time, so a batch of a million took minutes to time)
SOURCE_SAMPLES = 64
#: the most entries _pair_columns's dense tables may have (32 bytes each: 1 GiB; about 5,800
#: memories): past it, a dict lookup per distinct memory pair
DENSE_PAIRS = 1 << 25


@dataclass
class SimResult:
    """A simulated iteration: its time (seconds), the busy seconds of each processor (global
    index), the peak bytes of each processor's memory and whether they fit, and the schedule
    behind them (`res`: each node's resource). The busy seconds and the memory are worked out
    when first asked for: a search reads the time of every proposal, and whether it fits only
    of those it would accept (`peak_of` gives the graph's peak; `capacity` each processor's
    memory, None where it has no limit)."""

    time: float
    graph: IterationGraph
    timing: Timing
    resources: list
    res: np.ndarray
    proc_index: dict
    peak_of: Callable = field(repr=False)
    capacity: list = field(repr=False)
    #: seconds of each task and fold spent in the runtime's hand-off before its kernel (the machine
    #: model's launch_overhead, part of the node's time): a trace shows it as a wait before the
    #: node's event, as a run's trace does, so their events' spans compare
    launch: float = 0.0

    @functools.cached_property
    def peak_memory(self) -> dict[int, int]:
        return self.peak_of(self.graph.lowering)

    @functools.cached_property
    def fits(self) -> bool:
        return _fits(self.peak_memory, self.capacity)

    @functools.cached_property
    def busy(self) -> dict[int, float]:
        used = np.bincount(self.res, minlength=len(self.resources))
        return {self.proc_index[r[1]]: float(self.timing.busy[i]) for i, r in enumerate(self.resources)
                if r[0] == "proc" and used[i]}

    def __repr__(self) -> str:
        return (f"SimResult({self.time * 1e3:.3f} ms, {len(self.graph.nodes)} nodes, "
                f"peak memory {max(self.peak_memory.values(), default=0) / 2**20:.1f} MiB"
                f"{'' if self.fits else ', does not fit'})")

    def records(self):
        """Trace events in the runtime's format (README.md), microseconds from the iteration's start,
        each with `preds`: the ids of the nodes it waits on within the iteration (a node's id is its
        position in the iteration), and `launch`: the microseconds of the runtime's hand-off before
        `start` (tasks and folds), which the node held its processor for but a run's trace does not
        show as the node's own, so that an event's span is what a run's would be."""
        preds = self.graph.preds   # (made afresh at each access of an assembled graph's)
        for i, node in enumerate(self.graph.nodes):
            if isinstance(node, CopyNode):
                where, rank, kind = f"{node.src}->{node.dst}", node.dst.rank, node.kind
                point = None
                handoff = self.launch if _folds(node.src, node.dst, node.redop) else 0.0
            else:
                where, rank, kind, point = str(node.proc), node.proc.rank, node.kind, list(node.point)
                handoff = self.launch
            start, end = float(self.timing.start[i]), float(self.timing.end[i])
            handoff = min(handoff, end - start)
            yield {"id": i, "name": node.name, "kind": kind, "op": node.op, "rank": rank, "proc": where,
                   "start": round((start + handoff) * 1e6, 3), "end": round(end * 1e6, 3),
                   "bytes": node.nbytes, "point": point, "preds": list(preds[i]),
                   "launch": round(handoff * 1e6, 3)}

    def write_trace(self, path: str) -> str:
        """One JSON line per task and copy after a meta line (kind 'meta', simulated: true)."""
        events = list(self.records())
        with open(path, "w") as f:
            f.write(json.dumps({"kind": "meta", "rank": 0, "unit": "us", "events": len(events), "simulated": True,
                                "iteration_us": round(self.time * 1e6, 3)}) + "\n")
            for e in events:
                f.write(json.dumps(e) + "\n")
        return path



def _folds(src, dst, redop: str | None) -> bool:
    """Whether a copy from memory `src` to `dst` is timed as a fold (its launch, and the fold's
    reads and write on the destination): a reduction's, or one within a memory (_copy_codes says
    the same of arrays)."""
    return redop is not None or src == dst


def _timing(mm: MachineModel) -> tuple:
    """What a cost model times a machine model's devices by: their kind, name, peak and bandwidth,
    and its host's (not the node count, nor a device's memory size, which its share of the host's
    memory sets)."""
    return tuple((d.kind, d.name, d.peak_flops, d.mem_bandwidth) if d is not None else None
                 for d in (mm.device, mm.host))


def _fits(peak: dict[int, int], capacity: list) -> bool:
    """Every processor's peak bytes within its memory (`capacity` by processor, None: no limit)."""
    return all(capacity[i] is None or b <= capacity[i] for i, b in peak.items())

class Simulator:
    """Times training iterations of one graph (its ops with the loss op, its inputs with the labels)
    on one machine model with one cost model."""

    def __init__(self, ops: Sequence[Op], inputs: Sequence[TensorSpec], loss: str, machine_model: MachineModel,
                 cost: CostModel | None = None, optimizer=None, fingerprint: str | None = None, source=None):
        collect_cycles_less()  # graphs of 10^5 nodes: the collector's default pace cost a fifth of a build
        # each proposal's assembly allocates arrays of its 10^5 nodes and edges afresh: kept for reuse,
        # not faulted in again (a third of the assembly's array work at 64 devices)
        keep_freed_memory()
        self.ops = list(ops)
        self.inputs = list(inputs)
        self.loss = loss
        self.machine_model = machine_model
        self.machine = machine_model.to_machine()
        if cost is not None and _timing(cost.machine_model) != _timing(machine_model):
            raise ValueError(f"Simulator: the cost model times {cost.machine_model.name}'s devices "
                             f"({cost.machine_model.device!r}), the machine model is {machine_model.name} "
                             f"({machine_model.device!r}): give a CostModel of the same machine model")
        if source is not None:
            check_source(source, "Simulator")
        self.cost = cost or CostModel(machine_model)
        if source is not None and self.cost.measures(self.machine.host_processor(0)):
            batch, ranks = self.inputs[0].shape[0], self.machine.num_ranks
            # the largest rank share, at most SOURCE_SAMPLES of it: a figure a sample
            self.cost.measure_source(source, min(-(-batch // ranks), SOURCE_SAMPLES))
        #: whose updates the graph makes, the memory counts and the costs time: the cost model's
        #: (SGD with momentum 0.9 unless it says) where none is given
        self.optimizer = self.cost.optimizer if optimizer is None else make_optimizer(optimizer, "Simulator")
        self.fingerprint = fingerprint or model_fingerprint([op for op in self.ops if op.name != loss])
        self._proc_index = {p: i for i, p in enumerate(self.machine.processors)}
        #: each processor's memory size (None: unbounded), by index
        self._capacity = {i: machine_model.device_of(p).mem_bytes for i, p in enumerate(self.machine.processors)}
        self._memory_proc = {p.memory: p for p in self.machine.processors}
        self._builder: SegmentBuilder | None = None
        self._part_cost_cache: dict[int, tuple] = {}   # id(part) -> (part, its costs)
        self._flushes_seen = 0   # the builder's cache flushes when _part_cost_cache was last emptied
        mm = machine_model
        # a copy between ranks holds its processors too (before and after: 4 more cost rows)
        self._handling = mm.device.kind == "cpu" and (mm.send_overhead > 0 or mm.receive_overhead > 0)
        #: the receivers' naps, where a copy between ranks has a receipt and the runtime naps: where
        #: the ranks of a node have no core to spare for their progress threads (taskrt/mpi.py)
        self.naps = (Naps(mm.nap_first, mm.nap_longest, mm.nap_share)
                     if self._handling and not self.machine.threads_fit_node(0, extra_per_rank=1) else NO_NAPS)
        self._rows = 7 if self._handling else 3
        self._part_costs_placed = Arena(self._rows, np.float64)   # the parts' costs, each placed once
        self._no_costs = np.zeros((self._rows, 0))
        self._copy_costs: dict[tuple, tuple] = {}   # (src, dst, bytes, redop) -> _cost's answer
        self._memory_number = {m: i for i, m in enumerate(self.machine.memories)}
        self._pairs: dict[int, tuple] = {}   # see _copy_pair
        self._pair_tables: tuple | None = None   # see _pair_columns
        self._task_seconds: dict[tuple, float] = {}   # see _cost
        self._proc_resources: dict = {}   # processor -> its resource index
        self._resolved: dict[tuple, TileConfig] = {}
        self._defaults: dict[str, TileConfig] = {}   # see _default_config
        #: the last strategy configs() resolved from _resolved: its op names, its configs, and the result
        self._last_configs: tuple[list, list, dict] | None = None
        self._by_name = {op.name: op for op in self.ops}
        self._peaks = PeakCache(self.ops, self.machine)
        self._resources: list[tuple] = []
        self._resource_index: dict[tuple, int] = {}
        if self._handling:   # by memory number: its rank, and its processor's resource (-1: none)
            self._memory_rank = np.array([m.rank for m in self.machine.memories], np.int64)
            self._memory_proc_res = np.array([self._resource(("proc", self._memory_proc[m])) if m in self._memory_proc
                                              else -1 for m in self.machine.memories], np.int64)

    @classmethod
    def for_model(cls, model, machine_model: MachineModel, cost: CostModel | None = None, loss: str | None = None,
                  optimizer=None, output=None, source=None) -> "Simulator":
        """A simulator of `model` (built with or without weights; it need not be compiled), its loss
        on `output` (default: the last op's first output). `source`: the batch source the model
        will train on (Model.train_on's), timed here for the iteration's source tasks where the
        cost model measures the host (CostModel.measure_source)."""
        if not isinstance(machine_model, MachineModel):
            raise TypeError(f"Simulator: machine_model must be a MachineModel (load_machine(name)), got "
                            f"{type(machine_model).__name__} {machine_model!r}")
        if cost is not None and not isinstance(cost, CostModel):
            raise TypeError(f"Simulator: cost must be a CostModel or None, got {type(cost).__name__} {cost!r}")
        if not hasattr(model, "training_graph"):
            raise TypeError(f"Simulator.for_model: model must be an ops.Model (built with or without weights), got "
                            f"{type(model).__name__} {model!r}")
        if not model.ops:
            raise ValueError("Simulator: the model has no operators")
        ops, inputs, loss_op = model.training_graph(loss or "sparse_categorical_crossentropy", output,
                                                    "Simulator.for_model")
        return cls(ops, inputs, loss_op.name, machine_model, cost, optimizer, model_fingerprint(model.ops), source)

    def __repr__(self) -> str:
        return (f"Simulator({len(self.ops)} ops on {self.machine_model.name}, {len(self.machine.processors)} "
                f"processors, {self.optimizer.kind} updates)")

    # ---- configs -------------------------------------------------------------------------------
    def configs(self, strategy: Strategy | dict | None) -> dict[str, TileConfig]:
        """Every op's resolved config: from a Strategy (checked) or a dict; the rest data parallel."""
        if isinstance(strategy, Strategy):
            if strategy.model == self.fingerprint:
                configs = self._known_configs(strategy)
                if configs is not None:
                    return configs
            configs, _ = strategy.resolve(self.ops, self.machine, fingerprint=self.fingerprint)
            self._resolved.update({(n, c): configs[n] for n, c in strategy.ops.items()})
            return configs
        if strategy is not None and not isinstance(strategy, dict):
            raise TypeError(f"simulate: a strategy is a Strategy, a dict of op name -> TileConfig, or None "
                            f"(every op data parallel); got {type(strategy).__name__} {strategy!r}")
        given = dict(strategy or {})
        unknown = [name for name in given if name not in self._by_name]
        if unknown:
            raise ValueError(f"simulate: no op named {', '.join(map(repr, unknown))} in the model "
                             f"(its ops: {', '.join(op.name for op in self.ops)})")
        return {op.name: resolve_config(op, given[op.name], self.machine) if op.name in given
                else default_config(op, self.machine) for op in self.ops}

    def _known_configs(self, strategy: Strategy) -> dict[str, TileConfig] | None:
        """configs(strategy) from the entries resolved before (every entry is checked once), or
        None when a new entry names no op or does not fit its op. Taken from the last strategy's
        where the strategy names the same ops, for the entries that are the same objects: a
        search proposal changes one, so the rest cost no lookup."""
        names, given = list(strategy.ops), list(strategy.ops.values())
        last = self._last_configs
        fresh = last is None or names != last[0]
        changed = names if fresh else list(itertools.compress(names, map(operator.is_not, given, last[1])))
        if changed and not self._resolve_new(strategy, changed):
            return None
        known = self._resolved
        configs = {op.name: self._default_config(op) for op in self.ops} if fresh else dict(last[2])
        for name in changed:
            configs[name] = known[(name, strategy.ops[name])]
        self._last_configs = (names, given, configs)
        return dict(configs)

    def _default_config(self, op: Op) -> TileConfig:
        """default_config(op, machine), made once."""
        config = self._defaults.get(op.name)
        if config is None:
            config = self._defaults[op.name] = default_config(op, self.machine)
        return config

    def _resolve_new(self, strategy: Strategy, names: Sequence[str]) -> bool:
        """Resolve the entries `names` of `strategy` not seen before, one by one; False when one
        names no op or does not fit its op (Strategy.resolve then says what is wrong with each)."""
        ops = strategy.ops
        new = [(n, ops[n]) for n in names if (n, ops[n]) not in self._resolved]
        if any(n not in self._by_name for n, _ in new):
            return False
        try:
            resolved = {(n, c): resolve_config(self._by_name[n], c, self.machine) for n, c in new}
        except ConfigError:
            return False
        self._resolved.update(resolved)
        return True

    # ---- simulation ----------------------------------------------------------------------------
    @property
    def builder(self) -> SegmentBuilder:
        """The segment caches of delta simulation (made on first use)."""
        if self._builder is None:
            self._builder = SegmentBuilder(self.ops, self.inputs, self.loss, self.machine, self.optimizer)
        return self._builder

    def graph(self, strategy, delta: bool = True) -> IterationGraph | AssembledIteration:
        """The iteration graph under `strategy`: assembled from the segment caches (`delta`), or built
        afresh by the runtime's lowering and analysis over the whole program."""
        configs = self.configs(strategy)
        if delta:
            return self.builder.build(configs)
        return build_iteration(self.ops, self.inputs, self.loss, configs, self.machine, self.optimizer)

    def simulate(self, strategy, delta: bool = True) -> SimResult:
        """Simulate one steady-state iteration under `strategy` (a Strategy or op name -> TileConfig).

        Delta simulation (the default) rebuilds only the segments and region analyses that the
        configs changed since they were last seen, and costs only their new nodes; full
        simulation (`delta=False`) builds the runtime's graph from scratch. Both time the same
        graph the same way, so their results are equal (tests/test_simulator.py)."""
        if not isinstance(delta, bool):
            raise TypeError(f"simulate: delta must be True or False, got {type(delta).__name__} {delta!r}")
        graph = self.graph(strategy, delta)
        res, dur, delay, resources, handling = self.node_costs(graph, cache=delta)
        timing = schedule_successors(res, dur, graph.successors, len(resources), delay, handling, self.naps)
        peak_of = self._peaks.peak if delta else functools.partial(plan_peak, machine=self.machine)
        return SimResult(timing.time, graph, timing, list(resources), res, self._proc_index, peak_of, self._capacity,
                         self.machine_model.launch_overhead)

    def memory(self, strategy) -> tuple[dict[int, int], bool]:
        """(the peak bytes of each processor's memory, whether they fit) under `strategy`: what
        simulate's result says, from the ops' plans alone (no graph is built)."""
        peak = self._peaks.peak(self.builder.plan_view(self.configs(strategy)))
        return peak, _fits(peak, self._capacity)

    def node_costs(self, graph, cache: bool = False) -> tuple:
        """(resource index of each node, its seconds there, its delay after: a copy's latency in
        flight, the resources, the Handling of copies between ranks or None where the machine
        has none): processors ('proc', p), link channels ('link', channel) and memories' copy
        workers ('memory', m), numbered once for this simulator. With `cache`,
        an assembled graph's costs come per part (a segment's tasks, a region's copies) from
        what was computed when the part was first seen, so a delta simulation costs only its
        new parts."""
        if cache and isinstance(graph, AssembledIteration):
            flushes = self.builder.stats["cache_flushes"]
            if flushes != self._flushes_seen:   # the builder dropped its parts: so do their costs
                self._part_cost_cache.clear()
                self._flushes_seen = flushes
            starts, counts = self._part_costs_placed.place(graph.parts, self._part_costs, graph.delta)
            costs, res = _gathered_costs(self._part_costs_placed.store, starts, counts, graph.order)
        else:
            costs = np.array([self._cost(node, None if isinstance(node, CopyNode) else graph.task_cost_at(i))
                              for i, node in enumerate(graph.nodes)], float).reshape(-1, self._rows).T
            res = costs[0].astype(np.int64)
        handling = None
        if self._handling:
            handling = Handling(costs[3].astype(np.int64), costs[4], costs[5].astype(np.int64), costs[6])
        return res, costs[1], costs[2], self._resources, handling

    def _part_costs(self, part) -> np.ndarray:
        """A part's costs as rows (resource index, seconds, delay[, the Handling's four]), one column
        a node, made once."""
        known = self._part_cost_cache.get(id(part))
        if known is None or known[0] is not part:
            if isinstance(part, RecordedSegment):
                costs = self._segment_costs(part)
            elif not part.copy_ends.shape[0]:
                return self._no_costs   # a region result without copies (a graph lists them all)
            else:
                costs = self._region_costs(part)
            known = self._part_cost_cache[id(part)] = (part, costs)
            self.builder.count_cached(PART_COST_BYTES + costs.nbytes)
        return known[1]

    def _segment_costs(self, part: RecordedSegment) -> np.ndarray:
        """_part_costs of a recorded segment: each task's _cost in one loop over the segment
        (a segment at 1,024 devices has as many tasks, and a call and a tuple a task were most of
        its costing)."""
        costs = np.zeros((self._rows, part.n_tasks))
        if self._handling:
            costs[3] = costs[5] = -1   # a task holds no processor before or after its own
        res, seconds = costs[0], costs[1]
        for i, proc, tc in zip(range(part.n_tasks), part.procs, part.costs):
            res[i] = self._proc_resource(proc)
            seconds[i] = self._task_seconds_of(proc, tc, part.task_nbytes, i)
        return costs

    def _region_costs(self, part) -> np.ndarray:
        """_cost of a region result's copies as rows, from its arrays: each distinct (source,
        destination, fold or not) looked up once (_copy_pair), the seconds of all copies in one
        go, compiled (_copy_rows) where the pair tables are dense, else with CostModel.copy_times
        (both the arithmetic of transfer_time and fold_time, element by element: the same seconds
        as _copy_cost_of's copy by copy)."""
        numbers = np.array([self._memory_number[m] for m in part.memories], np.int64)
        memories = len(self._memory_number)
        if 2 * memories ** 2 <= DENSE_PAIRS:
            codes = _copy_codes(numbers, part.copy_ends, part.copy_redop, memories)
            mm = self.machine_model
            handling = (self._memory_rank, self._memory_proc_res, float(mm.send_overhead),
                        float(mm.receive_overhead)) if self._handling else (_NO_INTS, _NO_INTS, 0.0, 0.0)
            return _copy_rows(codes, part.copy_rects, part.region.ndim, np.dtype(part.region.dtype).itemsize,
                              *self._filled_tables(codes), float(mm.launch_overhead), memories, self._rows,
                              *handling)
        src, dst = numbers[part.copy_ends[:, 0]], numbers[part.copy_ends[:, 1]]
        fold = (part.copy_redop >= 0) | (src == dst)
        res, bandwidth, latency, dst_bandwidth = self._pair_columns(self._pair_code(src, dst, fold))
        costs = (res, self.cost.copy_times(part.copy_nbytes(), bandwidth, dst_bandwidth, fold), latency)
        return np.stack(costs + self._copy_handling(src, dst) if self._handling else costs).astype(float)

    def _pair_columns(self, codes: np.ndarray) -> tuple[np.ndarray, ...]:
        """_copy_pair's four figures for each of `codes` (an array), as arrays: read from dense
        tables by code, which _copy_pair fills for the codes not seen before (at 1,024 devices
        most copies of a redistribution have a pair of their own: a lookup each was most of
        their costing). The tables have 2 * memories^2 entries, made on first use; past
        DENSE_PAIRS entries (tens of thousands of devices, where they would take gigabytes)
        each distinct code is looked up in _copy_pair's dict instead."""
        if 2 * len(self._memory_number) ** 2 > DENSE_PAIRS:
            distinct, where = np.unique(codes, return_inverse=True)
            columns = np.array([self._copy_pair(code) for code in distinct.tolist()], float).reshape(-1, 4).T
            return columns[0].astype(np.int64)[where], columns[1][where], columns[2][where], columns[3][where]
        res, bandwidth, latency, dst_bandwidth = self._filled_tables(codes)
        return res[codes], bandwidth[codes], latency[codes], dst_bandwidth[codes]

    def _filled_tables(self, codes: np.ndarray) -> tuple[np.ndarray, ...]:
        """The dense tables of _pair_columns, with the entries of `codes` filled in."""
        if self._pair_tables is None:
            size = 2 * len(self._memory_number) ** 2
            self._pair_tables = (np.full(size, -1, np.int64), np.zeros(size), np.zeros(size), np.zeros(size))
        res, bandwidth, latency, dst_bandwidth = self._pair_tables
        for code in np.unique(codes[res[codes] < 0]).tolist():
            res[code], bandwidth[code], latency[code], dst_bandwidth[code] = self._copy_pair(code)
        return self._pair_tables

    def _copy_handling(self, src, dst) -> tuple[np.ndarray, ...]:
        """The Handling rows of copies from memory numbers `src` to `dst` (arrays): a copy between
        ranks holds the processor of its source memory for send_overhead before the wire and that
        of its destination for receive_overhead after; other copies hold neither (-1, 0)."""
        mm, proc_res = self.machine_model, self._memory_proc_res
        between = self._memory_rank[src] != self._memory_rank[dst]
        none = np.full(src.shape, -1, np.int64)
        return (np.where(between, proc_res[src], none), np.where(between, mm.send_overhead, 0.0),
                np.where(between, proc_res[dst], none), np.where(between, mm.receive_overhead, 0.0))

    def _pair_code(self, src, dst, fold):
        """The key of _copy_pair's table: (src * memories + dst) * 2 + fold, of memory numbers
        (numbers or arrays)."""
        return (src * len(self._memory_number) + dst) * 2 + fold

    def _copy_pair(self, code: int) -> tuple[int, float, float, float]:
        """(resource index, the link's bandwidth (inf within one memory), its latency (and the machine
        model's message_delay between ranks), the destination device's memory bandwidth) of copies
        from memory src to dst, `code` (src * memories + dst) * 2 + fold, made once."""
        known = self._pairs.get(code)
        if known is None:
            memories = self.machine.memories
            src, dst = divmod(code // 2, len(memories))
            src, dst = memories[src], memories[dst]
            device = self.cost.device(self._memory_proc[dst])
            if src == dst:
                known = (self._resource(("memory", dst)), math.inf, 0.0, device.mem_bandwidth)
            else:
                mm = self.machine_model
                link = mm.link(src, dst)
                latency = link.latency + (mm.message_delay if src.rank != dst.rank else 0.0)
                known = (self._resource(("link", mm.channel(src, dst))), link.bandwidth, latency, device.mem_bandwidth)
            self._pairs[code] = known
        return known

    def _resource(self, key: tuple) -> int:
        r = self._resource_index.get(key)
        if r is None:
            r = self._resource_index[key] = len(self._resources)
            self._resources.append(key)
        return r

    def _cost(self, node, tc) -> tuple:
        """(the resource index a node occupies, its seconds there, its delay after[, its Handling's
        pre resource and seconds, post resource and seconds])."""
        if isinstance(node, CopyNode):
            return self._copy_cost_of(node.src, node.dst, node.nbytes, node.redop)
        task = (self._proc_resource(node.proc), self._task_seconds_of(node.proc, tc, lambda _: node.nbytes), 0.0)
        return task + (-1, 0.0, -1, 0.0) if self._handling else task

    def _proc_resource(self, proc) -> int:
        """The resource index of processor `proc`."""
        r = self._proc_resources.get(proc)
        if r is None:
            r = self._proc_resources[proc] = self._resource(("proc", proc))
        return r

    def _task_seconds_of(self, proc, tc, nbytes_of, index: int = 0) -> float:
        """The seconds of a task on `proc` that computes `tc`, made once per what they depend on;
        `nbytes_of(index)` gives its requirements' bytes (asked for fills and sources only)."""
        # what a task's seconds depend on, so that like tiles of other configs are timed once
        if tc.op is not None:
            what = (tc.op.name, tc.phase, tc.rect, tc.param, proc.kind)
        else:
            data_bytes = nbytes_of(index)
            what = (tc.phase, tc.rect.shape[0] if tc.phase == SOURCE_PHASE else 0, data_bytes, proc.kind)
        seconds = self._task_seconds.get(what)
        if seconds is None:
            cost = self.cost
            if tc.phase == FILL:
                seconds = cost.fill_time(data_bytes, proc)
            elif tc.phase == SOURCE_PHASE:
                seconds = cost.source_time(tc.rect.shape[0], data_bytes, proc)
            elif tc.phase == UPDATE:
                seconds = cost.task_time(tc.op, UPDATE, tc.rect, proc, tc.param, self.optimizer)
            else:
                seconds = cost.task_time(tc.op, tc.phase, tc.rect, proc)
            self._task_seconds[what] = seconds
        return seconds

    def _copy_cost_of(self, src, dst, nbytes: int, redop: str | None) -> tuple:
        """_cost of a copy of `nbytes` from memory `src` to `dst` (a fold with `redop`), made once: the
        arithmetic of _region_costs for one copy."""
        what = (src, dst, nbytes, redop)
        known = self._copy_costs.get(what)
        if known is None:
            fold = _folds(src, dst, redop)
            res, bandwidth, latency, dst_bandwidth = self._copy_pair(
                self._pair_code(self._memory_number[src], self._memory_number[dst], fold))
            seconds = self.cost.copy_times(np.array([nbytes]), np.array([bandwidth]), np.array([dst_bandwidth]),
                                           np.array([fold]))
            known = (res, float(seconds[0]), latency)
            if self._handling:
                ends = np.array([self._memory_number[src]]), np.array([self._memory_number[dst]])
                known += tuple(a[0].item() for a in self._copy_handling(*ends))
            self._copy_costs[what] = known
        return known

    def tasks_to_measure(self, strategy) -> list[tuple]:
        """(op, phase, rect, processor[, param]) of every task of the iteration, for CostModel.measure_all
        (measure once, then simulate from the cache)."""
        graph = self.graph(strategy)
        out = []
        for i, node in enumerate(graph.nodes):
            if isinstance(node, CopyNode):
                continue
            tc = graph.task_cost_at(i)
            if tc.phase in (FORWARD, BACKWARD, BACKWARD_WEIGHTS):
                out.append((tc.op, tc.phase, tc.rect, node.proc))
            elif tc.phase == UPDATE:
                out.append((tc.op, UPDATE, tc.rect, node.proc, tc.param))
        return out


_NO_INTS = np.zeros(0, np.int64)


@numba.njit(cache=True, nogil=True)
def _copy_codes(numbers, copy_ends, copy_redop, memories):
    """Each copy's _pair_code, from its ends (indices into `numbers`, the memories' numbers)."""
    codes = np.empty(copy_ends.shape[0], np.int64)
    for i in range(copy_ends.shape[0]):
        src, dst = numbers[copy_ends[i, 0]], numbers[copy_ends[i, 1]]
        fold = 1 if copy_redop[i] >= 0 or src == dst else 0
        codes[i] = (src * memories + dst) * 2 + fold
    return codes


@numba.njit(cache=True, nogil=True)
def _copy_rows(codes, copy_rects, nd, itemsize, res_t, bandwidth_t, latency_t, dst_bandwidth_t, launch_overhead,
               memories, rows, memory_rank, memory_proc_res, send_overhead, receive_overhead):
    """The cost rows of copies (_region_costs) from their pair codes and rects, the dense pair
    tables and the Handling figures (rows 3-6, where `rows` is 7): CostModel.copy_times'
    arithmetic, copy by copy."""
    k = codes.shape[0]
    out = np.zeros((rows, k))
    for i in range(k):
        code = codes[i]
        nbytes = itemsize
        for d in range(nd):
            nbytes *= max(copy_rects[i, nd + d] - copy_rects[i, d], 0)
        seconds = max(nbytes, 0) / bandwidth_t[code]
        if code % 2 == 1:
            seconds = seconds + (3 * nbytes / dst_bandwidth_t[code] + launch_overhead)
        out[0, i] = res_t[code]
        out[1, i] = seconds
        out[2, i] = latency_t[code]
        if rows == 7:
            src, dst = divmod(code // 2, memories)
            if memory_rank[src] != memory_rank[dst]:
                out[3, i], out[4, i] = memory_proc_res[src], send_overhead
                out[5, i], out[6, i] = memory_proc_res[dst], receive_overhead
            else:
                out[3, i] = out[5, i] = -1
    return out


@numba.njit(cache=True, nogil=True)
def _gathered_costs(store: np.ndarray, starts: np.ndarray, counts: np.ndarray, order: np.ndarray) -> tuple:
    """(store[:, columns_of(starts, counts)[order]], its first row as int64): the cost rows of the
    nodes in layout order, read from the parts' places in the store in one pass (numpy's two
    fancy indexings took three times as long: 0.64 ms at 56,000 nodes)."""
    columns = columns_of(starts, counts)
    out = np.empty((store.shape[0], order.shape[0]), store.dtype)
    res = np.empty(order.shape[0], np.int64)
    for i in range(order.shape[0]):
        c = columns[order[i]]
        for r in range(store.shape[0]):
            out[r, i] = store[r, c]
        res[i] = np.int64(out[0, i])
    return out, res
