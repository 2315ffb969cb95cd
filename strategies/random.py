"""Random valid parallel configs: the proposals of the search and the inputs of property tests.

A random config splits any of the dims an op declares (any SOAP kind, partial ones too) by
degrees that fit the extents, with no more tiles than compute processors, each tile on a
different processor drawn from ops.lower.compute_processors.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ops.base import Op
from ops.lower import TileConfig, compute_processors
from ops.model import Model
from ops.strategy import Strategy, model_fingerprint
from strategies.baselines import graph_ops
from taskrt.machine import Machine


def random_config(op: Op, machine: Machine, rng) -> TileConfig:
    """A config drawn for `op`: its declared split dims in a random order, each a degree uniform in
    1..min(extent, processors left), the tiles on distinct random compute processors.
    `rng` is a numpy Generator (or a seed)."""
    rng = np.random.default_rng(rng)
    procs = compute_processors(machine)
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


def random_strategy(model: Model | Sequence[Op], machine: Machine, rng) -> Strategy:
    """A random_config for every op of a Model (its own ops) or of a list of ops."""
    rng = np.random.default_rng(rng)
    ops = graph_ops(model)
    return Strategy(model_fingerprint(ops), {op.name: random_config(op, machine, rng) for op in ops})
