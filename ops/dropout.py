"""Dropout whose mask depends only on (seed, step, global element index), so any tiling agrees.

The keep decision for element i is a splitmix64 hash of i (its flat index in the whole
tensor, computed from the tile's rect) keyed by the seed and the training step: plain
uint64 array math that runs the same on numpy and cupy.
"""
from __future__ import annotations

import numpy as np

from ops.base import Op, float_attr, int_attr, register_op, sample_split_dims

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _splitmix64(z: int) -> int:
    """The splitmix64 finalizer on a Python int (used once per seed)."""
    z = (z + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def global_index(xp, lo, hi, full_shape):
    """Row-major flat index, in the whole tensor of `full_shape`, of every element of box [lo, hi)."""
    ndim = len(full_shape)
    idx = xp.zeros((1,) * ndim, xp.uint64)
    stride = 1
    for d in reversed(range(ndim)):
        axis = xp.arange(lo[d], hi[d], dtype=xp.uint64) * np.uint64(stride)
        idx = idx + axis.reshape((-1,) + (1,) * (ndim - 1 - d))
        stride *= int(full_shape[d])
    return idx


def keep_mask(xp, seed: int, rate: float, lo, hi, full_shape):
    """True where element (global index i) survives: hash(seed, i) >= rate * 2**53."""
    z = global_index(xp, lo, hi, full_shape) * np.uint64(_GOLDEN)
    z += np.uint64(_splitmix64(int(seed) & _MASK64))
    z ^= z >> np.uint64(30)
    z *= np.uint64(_MIX1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(_MIX2)
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(11)) >= np.uint64(round(rate * (1 << 53)))


@register_op
class Dropout(Op):
    """Zero each element with probability `rate` and scale the rest by 1/(1-rate); identity in inference.

    The mask changes with the training `step` the runtime passes (step 0 keys the hash with
    the seed itself) and is the same for a given (seed, step) however the tensor is tiled.
    """

    kind = "dropout"
    has_training_mode = True
    uses_step = True

    def __init__(self, name, inputs, rate: float = 0.5, seed: int = 0):
        super().__init__(name, inputs, rate=float_attr(self.kind, name, "rate", rate, 0.0, 1.0),
                         seed=int_attr(self.kind, name, "seed", seed, 0))

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 1:
            raise self.fail(f"takes 1 input, got {len(in_shapes)}")
        if not 0.0 <= self.rate <= 1.0:
            raise self.fail(f"rate must be in [0, 1], got {self.rate}")
        if len(in_shapes[0]) < 1:
            raise self.fail("needs at least 1 dim (dim 0 is the batch)")
        return [in_shapes[0]]

    def split_dims(self):
        return sample_split_dims(len(self.tile_shape))

    def input_rects(self, tile):
        return [tile]

    def flops(self, tile):
        # one multiply per element (the hash is integer work)
        return tile.volume

    def _multiplier(self, xp, tile, dtype, step: int = 0):
        """mask / (1 - rate) for the tile's elements at training iteration `step`, in the input's dtype."""
        seed = _splitmix64((int(self.seed) & _MASK64) ^ _splitmix64(int(step) & _MASK64)) if step else self.seed
        keep = keep_mask(xp, seed, self.rate, tile.lo, tile.hi, self.tile_shape)
        scale = 0.0 if self.rate >= 1.0 else 1.0 / (1.0 - self.rate)
        return keep * np.dtype(dtype).type(scale)

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None, step: int = 0):
        (x,) = inputs
        if not training or self.rate == 0.0:
            return [x], None  # the runtime copies outputs into their regions
        mult = self._multiplier(xp, tile, x.dtype, step)
        return [x * mult], mult

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        (dy,) = grad_outputs
        return [dy if saved is None else dy * saved], {}
