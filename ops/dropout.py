"""Dropout whose mask depends only on (seed, step, global element index), so any tiling agrees.

The keep decision for element i is a splitmix64 hash of i (its flat index in the whole
tensor, computed from the tile's rect) keyed by the seed and the training step: plain
uint64 array math that runs the same on numpy and cupy. On the CPU one numba pass makes the
output and the multiplier together (_dropout_cpu), where the array math takes a dozen passes
over uint64 temporaries.
"""
from __future__ import annotations

import functools

import numba
import numpy as np

from ops.base import Op, ShapeError, float_attr, int_attr, register_op, sample_split_dims

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _splitmix64(z: int) -> int:
    """The splitmix64 finalizer on a Python int (used once per seed)."""
    z = (z + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


_U64_GOLDEN, _U64_MIX1, _U64_MIX2 = np.uint64(_GOLDEN), np.uint64(_MIX1), np.uint64(_MIX2)
_U64_30, _U64_27, _U64_31, _U64_11 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(11)


@numba.njit(nogil=True, cache=True)
def _dropout_cpu(x, lo, shape, strides, key, threshold, scale, y, mult):
    """y = x * mult, mult = scale where keep_mask keeps the element, else 0: x, y and mult the
    tile's elements in C order (1-D), the tile at `lo` of `shape` in a tensor of element
    `strides`; key = splitmix64(seed), threshold = rate * 2**53 (keep_mask's hash, per element)."""
    nd = shape.size
    inner = shape[nd - 1]
    rows = x.size // inner if inner else 0
    for r in range(rows):
        rem, base = r, lo[nd - 1]
        for d in range(nd - 2, -1, -1):
            base += (lo[d] + rem % shape[d]) * strides[d]
            rem //= shape[d]
        _dropout_row(x[r * inner:(r + 1) * inner], np.uint64(base), key, threshold, scale,
                     y[r * inner:(r + 1) * inner], mult[r * inner:(r + 1) * inner])


@numba.njit(nogil=True, inline="always")
def _dropout_row(x, base, key, threshold, scale, y, mult):
    """One contiguous row of _dropout_cpu, global indices from `base`: a loop LLVM vectorizes."""
    for j in range(x.size):
        z = (base + np.uint64(j)) * _U64_GOLDEN + key
        z ^= z >> _U64_30
        z *= _U64_MIX1
        z ^= z >> _U64_27
        z *= _U64_MIX2
        z ^= z >> _U64_31
        m = scale * ((z >> _U64_11) >= threshold)
        mult[j] = m
        y[j] = x[j] * m


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
    float_inputs = True
    has_training_mode = True
    uses_step = True

    def __init__(self, name, inputs, rate: float = 0.5, seed: int = 0):
        super().__init__(name, inputs, rate=float_attr(self.kind, name, "rate", rate, 0.0, 1.0),
                         seed=int_attr(self.kind, name, "seed", seed, 0))
        if self.seed >= 2**64:   # (the mask hashes its low 64 bits)
            raise ShapeError(f"{self.kind} {name!r}: seed must be below 2**64, got {self.seed}")

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

    def _seed(self, step: int) -> int:
        """The hash's seed at training iteration `step` (step 0: the op's seed itself)."""
        return _splitmix64((int(self.seed) & _MASK64) ^ _splitmix64(int(step) & _MASK64)) if step else self.seed

    def _scale(self) -> float:
        return 0.0 if self.rate >= 1.0 else 1.0 / (1.0 - self.rate)

    def _multiplier(self, xp, tile, dtype, step: int = 0):
        """mask / (1 - rate) for the tile's elements at training iteration `step`, in the input's dtype."""
        keep = keep_mask(xp, self._seed(step), self.rate, tile.lo, tile.hi, self.tile_shape)
        return keep * np.dtype(dtype).type(self._scale())

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None, step: int = 0):
        (x,) = inputs
        if not training or self.rate == 0.0:
            return [x], None  # the runtime copies outputs into their regions
        if xp is np and x.ndim:
            return self._forward_cpu(tile, x, step)
        mult = self._multiplier(xp, tile, x.dtype, step)
        return [x * mult], mult

    def _forward_cpu(self, tile, x, step: int):
        """forward in one numba pass (_dropout_cpu), the same numbers as the array math."""
        x = np.ascontiguousarray(x)
        y, mult = np.empty_like(x), np.empty_like(x)
        key = np.uint64(_splitmix64(self._seed(step) & _MASK64))
        _dropout_cpu(x.reshape(-1), np.array(tile.lo, np.int64), np.array(tile.shape, np.int64),
                     self._element_strides, key, np.uint64(round(self.rate * (1 << 53))), x.dtype.type(self._scale()),
                     y.reshape(-1), mult.reshape(-1))
        return [y], mult

    @functools.cached_property
    def _element_strides(self) -> np.ndarray:
        """The tensor's C-order element strides (what global_index multiplies by)."""
        strides, stride = [], 1
        for n in reversed(self.tile_shape):
            strides.append(stride)
            stride *= int(n)
        return np.array(strides[::-1], np.int64)

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        (dy,) = grad_outputs
        return [dy if saved is None else dy * saved], {}
