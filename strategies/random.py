"""Random valid parallel configs: the proposals of the search and the inputs of property tests.

A random config (`random_config`) splits any of the dims an op declares (any SOAP kind,
partial ones too) by degrees that fit the extents, with no more tiles than compute
processors, each tile on a different device drawn from ops.lower.compute_devices:
the whole space, for property tests and random starts.

A proposal (`proposal_config`, what the search draws) is shaped the way FlexFlow's are: a
tile count that fits the machine's layout (a divisor of the devices of a node, or whole
nodes times a divisor of the node count), cut over the op's declared dims factor by
factor, on a run of consecutive devices (aligned to its size where it divides the
machine), so that tiles that talk share a node. One proposal in UNSHAPED_SHARE is a plain
random_config, so that every config stays reachable.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ops.base import Op
from ops.lower import TileConfig, compute_devices, compute_processors
from ops.model import Model
from ops.strategy import Strategy, model_fingerprint
from strategies.baselines import graph_ops
from taskrt.machine import Machine


def random_config(op: Op, machine: Machine, rng) -> TileConfig:
    """A config drawn for `op`: its declared split dims in a random order, each a degree uniform in
    1..min(extent, processors left), the tiles on distinct random compute processors.
    `rng` is a numpy Generator (or a seed)."""
    _check_op(op, "random_config")
    rng = np.random.default_rng(rng)
    procs = compute_devices(machine)
    shape = op.tile_shape
    degrees = [1] * len(shape)
    dims = sorted({s.dim for s in op.split_dims()})
    budget = len(procs)
    for i in rng.permutation(len(dims)):
        d = dims[i]
        top = min(shape[d], budget)
        if top > 1:
            degrees[d] = int(rng.integers(1, top + 1))
            budget //= degrees[d]
    devices = rng.choice(procs, size=math.prod(degrees), replace=False)
    return TileConfig(tuple(degrees), tuple(int(p) for p in devices))


#: the share of proposals that are plain random configs (any degrees, any devices)
UNSHAPED_SHARE = 0.125


def tile_counts(machine: Machine) -> list[int]:
    """The tile counts proposals use: the divisors of the compute processors a rank has, and
    that count times each divisor of the ranks (whole nodes)."""
    procs = compute_processors(machine)
    per_rank = max(1, sum(1 for i in procs if machine.processors[i].rank == machine.processors[procs[0]].rank))
    ranks = max(1, len(procs) // per_rank)
    counts = {d for d in range(1, per_rank + 1) if per_rank % d == 0}
    counts |= {per_rank * d for d in range(1, ranks + 1) if ranks % d == 0}
    return sorted(counts)


def proposal_config(op: Op, machine: Machine, rng) -> TileConfig:
    """A config for the search to propose for `op` (see the module doc). `rng` is a numpy
    Generator (or a seed)."""
    _check_op(op, "proposal_config")
    rng = np.random.default_rng(rng)
    if rng.random() < UNSHAPED_SHARE:
        return random_config(op, machine, rng)
    procs = compute_devices(machine)
    shape = op.tile_shape
    dims = sorted({s.dim for s in op.split_dims()})
    counts = tile_counts(machine)
    degrees = [1] * len(shape)
    for f in _prime_factors(int(counts[int(rng.integers(len(counts)))])):
        fits = [d for d in dims if degrees[d] * f <= shape[d]]
        if fits:
            degrees[fits[int(rng.integers(len(fits)))]] *= f
    tiles = math.prod(degrees)
    if len(procs) % tiles == 0:
        start = tiles * int(rng.integers(len(procs) // tiles))
    else:
        start = int(rng.integers(len(procs) - tiles + 1))
    return TileConfig(tuple(degrees), tuple(procs[start:start + tiles]))


def _check_op(op, what: str) -> None:
    if not isinstance(op, Op):
        raise TypeError(f"{what}: op must be an operator (model.ops has them), got {type(op).__name__} {op!r}")


def _prime_factors(n: int) -> list[int]:
    """n's prime factors with repeats, smallest first (n >= 1)."""
    out, f = [], 2
    while f * f <= n:
        while n % f == 0:
            out.append(f)
            n //= f
        f += 1
    return out + ([n] if n > 1 else [])


def random_strategy(model: Model | Sequence[Op], machine: Machine, rng, shaped: bool = False) -> Strategy:
    """A random_config for every op of a Model (its own ops) or of a list of ops; with `shaped`, a
    proposal_config for every op (the search's random start: a strategy from the space it
    searches, where one of wholly random configs is mostly copies)."""
    rng = np.random.default_rng(rng)
    ops = graph_ops(model)
    draw = proposal_config if shaped else random_config
    return Strategy(model_fingerprint(ops), {op.name: draw(op, machine, rng) for op in ops})
