"""Baseline strategies, each a function of (model, machine) -> Strategy: the starting points of
the search and the peers its results are measured against.

- data_parallel: every op's sample dim over the compute processors (ops.lower.default_config).
- model_parallel: ops over the processors in turn; an op with weights splits its parameter dim.
- expert: Krizhevsky's "one weird trick": data-parallel convolutions, pools and the rest,
  model-parallel (parameter-split) dense layers.
- tensor_parallel: Megatron's column-then-row dense pairs and head-split attention, data
  parallel elsewhere.

All read the split dims an op declares (`op.split_dims()`, `op.tile_shape`), never output
shapes, so they follow the ops as those declare new splits. `model` is a Model or its ops.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

from ops.attention import MultiHeadAttention
from ops.base import PARAMETER, REDUCE, Op
from ops.linear import Dense
from ops.lower import TileConfig, compute_devices, default_config
from ops.model import Model
from ops.strategy import Strategy, model_fingerprint
from taskrt.machine import Machine


def _check_machine(machine) -> None:
    """A baseline places tiles on a taskrt Machine's processors (a machine model's to_machine())."""
    if not isinstance(machine, Machine):
        hint = " (a machine model: pass its to_machine())" if hasattr(machine, "to_machine") else ""
        raise TypeError(f"a baseline strategy needs a taskrt Machine{hint}, got {type(machine).__name__}")


def graph_ops(model: Model | Sequence[Op]) -> list[Op]:
    """The ops a baseline configures: a Model's own ops (not its loss op) or the given ops."""
    return list(model.ops) if isinstance(model, Model) else list(model)


def split_config(op: Op, degrees: dict[int, int], devices: Sequence[int]) -> TileConfig:
    """`op` split degrees[d] ways along each tile dim d (1 elsewhere), tile i on devices[i]."""
    grid = tuple(degrees.get(d, 1) for d in range(len(op.tile_shape)))
    return TileConfig(grid, tuple(devices[:math.prod(grid)]))


def parameter_dim(op: Op, partial: bool = False) -> int | None:
    """The first parameter split dim `op` declares with this `partial`ness, or None."""
    return next((s.dim for s in op.split_dims() if s.kind == PARAMETER and s.partial == partial), None)


def reduce_dim(op: Op) -> int | None:
    """The first reduce (partial-sum) split dim `op` declares, or None."""
    return next((s.dim for s in op.split_dims() if s.kind == REDUCE), None)


def _strategy(ops: list[Op], configs: dict[str, TileConfig]) -> Strategy:
    return Strategy(model_fingerprint(ops), {op.name: configs[op.name] for op in ops})


def data_parallel(model: Model | Sequence[Op], machine: Machine) -> Strategy:
    """Every op's sample dim over the compute processors; ops without one run whole."""
    _check_machine(machine)
    ops = graph_ops(model)
    return _strategy(ops, {op.name: default_config(op, machine) for op in ops})


def model_parallel(model: Model | Sequence[Op], machine: Machine) -> Strategy:
    """Ops take the compute processors in turn: an op with weights and a parameter dim of extent
    >= 2 splits that dim over as many processors as it can (its weights and their work divide),
    every other op runs whole on the next processor."""
    _check_machine(machine)
    ops = graph_ops(model)
    procs = compute_devices(machine)
    cursor, configs = 0, {}
    for op in ops:
        dim = parameter_dim(op)
        if dim is None:
            dim = parameter_dim(op, partial=True)
        ways = min(len(procs), op.tile_shape[dim]) if dim is not None and op.weight_shapes() else 1
        turn = [procs[(cursor + i) % len(procs)] for i in range(ways)]
        configs[op.name] = split_config(op, {dim: ways} if ways > 1 else {}, turn)
        cursor = (cursor + ways) % len(procs)
    return _strategy(ops, configs)


def expert(model: Model | Sequence[Op], machine: Machine) -> Strategy:
    """Data-parallel convolutions and pools (and every other op), model-parallel dense layers:
    each dense splits its out features over the compute processors."""
    _check_machine(machine)
    ops = graph_ops(model)
    procs = compute_devices(machine)
    configs = {}
    for op in ops:
        dim = parameter_dim(op) if isinstance(op, Dense) else None
        if dim is None:
            configs[op.name] = default_config(op, machine)
        else:
            configs[op.name] = split_config(op, {dim: min(len(procs), op.tile_shape[dim])}, procs)
    return _strategy(ops, configs)


def tensor_parallel(model: Model | Sequence[Op], machine: Machine) -> Strategy:
    """Megatron-style: a dense whose output feeds another dense (directly or through single-input
    ops of the same shape, such as activations and dropout) splits its out features (parameter
    dim) and the second its in features (reduce dim) the same ways on the same processors, the
    ops between along their last dim; attention splits its heads. Data parallel elsewhere.

    A pair forms only where the second dense declares a reduce dim, and attention splits only
    where it declares a partial parameter (head) dim."""
    _check_machine(machine)
    ops = graph_ops(model)
    procs = compute_devices(machine)
    consumers: dict[str, list[Op]] = {}
    for op in ops:
        for t in op.inputs:
            consumers.setdefault(t.name, []).append(op)
    configs = {}
    for op in ops:
        if op.name in configs:
            continue
        if isinstance(op, MultiHeadAttention):
            heads = parameter_dim(op, partial=True)
            if heads is not None:
                configs[op.name] = split_config(op, {heads: min(len(procs), op.tile_shape[heads])}, procs)
                continue
        pair = _dense_pair(op, consumers, configs) if isinstance(op, Dense) else None
        if pair is not None:
            first_dim, chain, second, second_dim = pair
            ways = min([len(procs), op.tile_shape[first_dim], second.tile_shape[second_dim]]
                       + [mid.tile_shape[-1] for mid in chain])
            configs[op.name] = split_config(op, {first_dim: ways}, procs)
            for mid in chain:
                configs[mid.name] = split_config(mid, {len(mid.tile_shape) - 1: ways}, procs)
            configs[second.name] = split_config(second, {second_dim: ways}, procs)
            continue
        configs[op.name] = default_config(op, machine)
    return _strategy(ops, configs)


def _dense_pair(first: Dense, consumers: dict[str, list[Op]],
                taken: dict) -> tuple[int, list[Op], Dense, int] | None:
    """(first's parameter dim, the ops between, the second dense, its reduce dim) when `first`'s
    output reaches a dense through single-consumer, shape-keeping ops splittable along their
    last dim; None otherwise (or when an op on the way already has a config). `consumers`:
    tensor name -> the ops reading it."""
    first_dim = parameter_dim(first)
    if first_dim is None:
        return None
    chain, tensor = [], first.outputs[0]
    while True:
        users = consumers.get(tensor.name, [])
        if len(users) != 1 or users[0].name in taken or len(users[0].inputs) != 1:
            return None
        nxt = users[0]
        if isinstance(nxt, Dense):
            second_dim = reduce_dim(nxt)
            return None if second_dim is None else (first_dim, chain, nxt, second_dim)
        last = len(nxt.tile_shape) - 1
        if nxt.outputs[0].shape != tensor.shape or nxt.tile_shape != tensor.shape or not any(
                s.dim == last and not s.partial for s in nxt.split_dims()):
            return None
        chain.append(nxt)
        tensor = nxt.outputs[0]


BASELINES: dict[str, Callable[[Model | Sequence[Op], Machine], Strategy]] = {
    "data": data_parallel, "model": model_parallel, "expert": expert, "tensor": tensor_parallel}
