"""Embedding lookup: rows of a [num_embeddings, embedding_dim] table picked by integer indices.

Backward is a scatter-add of the output gradient into the table's rows: a numba loop
on the CPU (np.add.at is an order of magnitude slower), cupy's add.at on a GPU.

The vocabulary rows are a reduce split: a tile holding rows [v0, v1) of the table looks up
only the indices in that range (zeros for the others), and the tiles' outputs are summed.
"""
from __future__ import annotations

import numba
import numpy as np

from ops.base import ATTRIBUTE, PARAMETER, REDUCE, SAMPLE, Op, SplitDim, is_count, register_op, weight_target
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

    idx is [batch, ...] of integers, y is [batch, ..., embedding_dim]; the tile space is
    [batch, ..., embedding_dim, num_embeddings]. Dim 0 is the sample dim, the other index
    dims are attributes, the embedding columns are the parameter dim and the vocabulary
    rows (the last) a reduce dim: a tile with columns [a, b) and rows [v0, v1) reads the
    block [v0:v1, a:b] of the table and all of its index rect.
    """

    kind = "embedding"
    writes_weight_out = True

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
            if not is_count(v):
                raise self.fail(f"{attr} must be a positive int, got {v!r}")
        return [tuple(shape) + (int(self.embedding_dim),)]

    def index_bound(self, i: int) -> int | None:
        return int(self.num_embeddings) if i == 0 else None

    def output_dtypes(self):
        return ["float32"]

    @property
    def tile_shape(self) -> tuple[int, ...]:
        return self.outputs[0].shape + (int(self.num_embeddings),)

    def weight_shapes(self):
        return {"weight": (int(self.num_embeddings), int(self.embedding_dim))}

    def init_weights(self, rng):
        shape = self.weight_shapes()["weight"]
        return {"weight": rng.standard_normal(shape, dtype=np.float32).astype(self.weight_dtype("weight"))}

    def split_dims(self):
        n = len(self.tile_shape)
        return (SplitDim(0, SAMPLE),) + tuple(SplitDim(d, ATTRIBUTE) for d in range(1, n - 2)) + (
            SplitDim(n - 2, PARAMETER), SplitDim(n - 1, REDUCE))

    def output_rects(self, tile: Rect) -> list[Rect]:
        return [Rect(tile.lo[:-1], tile.hi[:-1])]

    def input_rects(self, tile: Rect) -> list[Rect]:
        return [Rect(tile.lo[:-2], tile.hi[:-2])]

    def weight_rects(self, tile: Rect) -> dict[str, Rect]:
        return {"weight": Rect((tile.lo[-1], tile.lo[-2]), (tile.hi[-1], tile.hi[-2]))}

    def _held(self, xp, tile, flat):
        """(positions of `flat` whose rows the tile holds, those rows relative to the tile), or None
        when the tile holds every row."""
        v0, v1 = tile.lo[-1], tile.hi[-1]
        if v0 == 0 and v1 == self.num_embeddings:
            return None
        where = xp.nonzero((flat >= v0) & (flat < v1))[0]
        return where, flat[where] - v0

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
        held = self._held(xp, tile, flat)
        if held is None:
            out = xp.take(w, flat, axis=0)
        else:
            out = xp.zeros((flat.size, w.shape[1]), dtype=w.dtype)
            out[held[0]] = xp.take(w, held[1], axis=0)
        return [out.reshape(idx.shape + (w.shape[1],))], None

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved, weight_out=None):
        (idx,), (dy,) = inputs, grad_outputs
        w = weights["weight"]
        flat = self._flat_indices(idx)
        gw = weight_target(weight_out, "weight")
        if gw is None:
            gw = xp.zeros(w.shape, dtype=w.dtype)
        else:   # the runtime's buffer, in memory already in use: zeroed in place, not faulted in
            gw.fill(0)
        dy2 = dy.reshape(flat.size, w.shape[1])
        held = self._held(xp, tile, flat)
        if held is None:
            scatter_add_rows(xp, gw, flat, dy2)
        else:
            scatter_add_rows(xp, gw, held[1], dy2[held[0]])
        return [None], {"weight": gw}

    def flops(self, tile: Rect) -> int:
        # a gather does no arithmetic; count one op per element copied (all of them, held or not)
        return tile.volume // max(1, tile.shape[-1])
