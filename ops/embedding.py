"""Embedding lookup: rows of a [num_embeddings, embedding_dim] table picked by integer indices.

Backward is a scatter-add of the output gradient into the table's rows: a numba loop
on the CPU (np.add.at is an order of magnitude slower), cupy's add.at on a GPU.
"""
from __future__ import annotations

import numba
import numpy as np

from ops.base import ATTRIBUTE, PARAMETER, SAMPLE, Op, SplitDim, register_op
from taskrt.geometry import Rect


@numba.njit(nogil=True, cache=True)
def _scatter_add_rows_cpu(out, idx, src):
    """out[idx[i], :] += src[i, :] for every i, in order (duplicates accumulate)."""
    ncols = src.shape[1]
    for i in range(idx.shape[0]):
        r = idx[i]
        for j in range(ncols):
            out[r, j] += src[i, j]


def scatter_add_rows(xp, out, idx, src) -> None:
    """out[idx[i]] += src[i] in place; idx is 1-D, src is [len(idx), out.shape[1]]."""
    if xp is np:
        _scatter_add_rows_cpu(out, idx, src)
    else:
        xp.add.at(out, idx, src)


@register_op
class Embedding(Op):
    """y[..., :] = weight[idx[...], :] (PyTorch's nn.Embedding); y is float32 whatever idx's int type.

    idx is [batch, ...] of integers, y is [batch, ..., embedding_dim]. Dim 0 is the
    sample dim, the other index dims are attributes, the last (embedding columns) is
    the parameter dim: a tile with columns [a, b) reads the column slice [:, a:b) of
    the table and all of its index rect.
    """

    kind = "embedding"

    def __init__(self, name, inputs, num_embeddings: int, embedding_dim: int):
        super().__init__(name, inputs, num_embeddings=num_embeddings, embedding_dim=embedding_dim)

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 1:
            raise self.fail(f"takes 1 input (indices), got {len(in_shapes)}")
        (shape,) = in_shapes
        if len(shape) < 1:
            raise self.fail("needs indices of at least 1 dim [batch, ...], got a scalar")
        if np.dtype(self.inputs[0].dtype).kind not in "iu":
            raise self.fail(f"indices must be integers, got dtype {self.inputs[0].dtype}")
        for attr in ("num_embeddings", "embedding_dim"):
            v = getattr(self, attr)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise self.fail(f"{attr} must be a positive int, got {v!r}")
        return [tuple(shape) + (int(self.embedding_dim),)]

    def output_dtypes(self):
        return ["float32"]

    def weight_shapes(self):
        return {"weight": (int(self.num_embeddings), int(self.embedding_dim))}

    def init_weights(self, rng):
        shape = self.weight_shapes()["weight"]
        return {"weight": rng.standard_normal(shape, dtype=np.float32).astype(self.weight_dtype("weight"))}

    def split_dims(self):
        n = len(self.tile_shape)
        return (SplitDim(0, SAMPLE),) + tuple(SplitDim(d, ATTRIBUTE) for d in range(1, n - 1)) + (
            SplitDim(n - 1, PARAMETER),)

    def input_rects(self, tile: Rect) -> list[Rect]:
        return [Rect(tile.lo[:-1], tile.hi[:-1])]

    def weight_rects(self, tile: Rect) -> dict[str, Rect]:
        return {"weight": Rect((0, tile.lo[-1]), (int(self.num_embeddings), tile.hi[-1]))}

    def _flat_indices(self, idx):
        flat = idx.reshape(-1)
        if flat.size:
            lo, hi = int(flat.min()), int(flat.max())
            if lo < 0 or hi >= self.num_embeddings:
                bad = lo if lo < 0 else hi
                raise IndexError(f"{self.kind} {self.name!r}: index {bad} is out of range for "
                                 f"num_embeddings={self.num_embeddings} (valid: 0..{self.num_embeddings - 1})")
        return flat

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        (idx,) = inputs
        w = weights["weight"]
        flat = self._flat_indices(idx)
        out = xp.take(w, flat, axis=0)
        return [out.reshape(idx.shape + (w.shape[1],))], None

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        (idx,), (dy,) = inputs, grad_outputs
        w = weights["weight"]
        flat = self._flat_indices(idx)
        gw = xp.zeros(w.shape, dtype=w.dtype)
        scatter_add_rows(xp, gw, flat, dy.reshape(flat.size, w.shape[1]))
        return [None], {"weight": gw}

    def flops(self, tile: Rect) -> int:
        # a gather does no arithmetic; count one op per element copied
        return tile.volume
