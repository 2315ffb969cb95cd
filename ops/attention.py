"""Multi-head attention with PyTorch's nn.MultiheadAttention(batch_first=True) weights and init.

    q, k, v = query Wq^T + bq, key Wk^T + bk, value Wv^T + bv     (W = in_proj_weight rows)
    per head:  P = softmax(q k^T / sqrt(d) [+ causal mask]),  ctx = P v
    out = ctx Wo^T + bo                                            (Wo = out_proj_weight)

Heads are strided views of the projected [batch, seq, E] arrays (no transposed copies);
the per-head GEMMs write straight into [batch, seq, heads, d] buffers. The softmax, with
the causal mask, and its backward run in place on the [batch, heads, Lq, Lk] scores, through
ops.activation's fused row kernels on the CPU (one pass each).

On the CPU all the work runs as one job per group of (sample, head) pairs on a small thread
pool, one group per core the task has, each GEMM on one BLAS thread: a group projects its
samples' q, k and v over its heads' columns, attends, and makes its share of the output (in
backward, of every gradient; the shares are added up after). The per-head GEMMs gain nothing
from BLAS's own threads, which also stall badly while another process holds a core, and one
job per group waits for the cores once, not once per GEMM. The projections are in the groups
too, not threaded GEMMs around them: after a threaded GEMM OpenBLAS's idle threads spin for
about 0.1 s on the cores the groups need (forward + backward, 4 samples of 512 tokens: 190 ->
140 ms). Inside a group the pairs go one at a time (see _pairs), so a pair's scores stay in
cache between its steps. Scores small enough (WHOLE_SCORES_BYTES) go whole instead, all pairs
in each call.

The heads are a partial parameter split (the tile space is [batch, Lq, E, heads]): a tile
projects and attends with its own heads only, and its output projection, over its heads'
columns of ctx, is a partial output that the tiles sum (the out-projection bias on the
first head tile only).
"""
from __future__ import annotations

import functools
import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ops import cpu_pool
from ops.activation import softmax_grad_rows, softmax_rows_
from ops.base import ATTRIBUTE, PARAMETER, SAMPLE, Op, SplitDim, bool_attr, is_count, register_op
from taskrt.geometry import Rect


def _heads(a, num_heads: int):
    """[batch, seq, E] -> a [batch, heads, seq, d] view."""
    b, n, e = a.shape
    return a.reshape(b, n, num_heads, e // num_heads).transpose(0, 2, 1, 3)


# ---- the per-head work on the CPU's cores ----------------------------------------------------
@functools.cache
def _pool() -> ThreadPoolExecutor:
    """The threads that run the head groups (their numba kernels on one thread, as BLAS)."""
    return ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="attention-heads")


def _head_groups(batch: int, heads: int, parts: int) -> list[tuple[slice, slice]]:
    """(samples, heads) slices that cut the batch x heads pairs into at most `parts` groups:
    along the batch when it has enough samples (or more than heads), else along the heads."""
    if batch >= min(parts, heads):
        n = min(parts, batch)
        return [(slice(batch * i // n, batch * (i + 1) // n), slice(None)) for i in range(n)]
    n = min(parts, heads)
    return [(slice(None), slice(heads * i // n, heads * (i + 1) // n)) for i in range(n)]


#: scores of at most this many bytes (all pairs of a tile) are worked on whole, in batched GEMMs
#: and one softmax call, on the CPU too: per pair, a tiny transformer's tile (4 samples, 2 heads,
#: 64 x 64) paid more for the calls than for their math
WHOLE_SCORES_BYTES = 1 << 18


def _whole(xp, scores_shape: tuple, itemsize: int) -> bool:
    """Whether the per-head work runs on all pairs at once (always with cupy)."""
    return xp is not np or math.prod(scores_shape) * itemsize <= WHOLE_SCORES_BYTES


def _per_head_groups(xp, batch: int, heads: int, work, whole: bool) -> list[tuple]:
    """[((samples, heads), work(samples, heads))] over groups that cover every (sample, head) pair
    once: one group when `whole`; else on the CPU one job per group on the pool, a group per core
    of the task, BLAS on one thread."""
    if whole:
        everything = (slice(0, batch), slice(0, heads))
        return [(everything, work(*everything))]
    with cpu_pool.blas_on_one_thread() as threads:
        groups = _head_groups(batch, heads, threads)
        if len(groups) == 1:
            return [(groups[0], work(*groups[0]))]
        jobs = [_pool().submit(work, *g) for g in groups]
        return [(g, job.result()) for g, job in zip(groups, jobs)]


def _head_columns(hs: slice, heads: int, d: int) -> slice:
    """The columns of a tile's projected [.., heads * d] arrays that heads `hs` own."""
    lo, hi, _ = hs.indices(heads)
    return slice(lo * d, hi * d)


def _all_heads(hs: slice, heads: int) -> bool:
    """Whether a group's heads are all the tile's."""
    return hs.indices(heads)[:2] == (0, heads)


def _pairs(batch: int, heads: int, samples: slice, hs: slice, whole: bool) -> list[tuple]:
    """The (sample, head) index pairs of a group, for the per-head work to take one at a time on
    the CPU: a pair's scores (Lq x Lk) then stay in cache from one GEMM through the softmax to
    the next, where a whole group's would stream through memory three times. When `whole`, the
    group in one go (batched GEMMs)."""
    if whole:
        return [(samples, hs)]
    return [(i, h) for i in range(*samples.indices(batch)) for h in range(*hs.indices(heads))]


def _scores(xp, shape: tuple, dtype, whole: bool):
    """The softmaxed scores [batch, heads, Lq, Lk], kept for backward: on the CPU, unless
    `whole`, one array per sample, since glibc's malloc maps each allocation over 32 MiB afresh
    (a page fault per page on first touch, a fifth of the forward at 8 x 8 x 512 x 512) and
    reuses smaller ones."""
    if whole:
        return xp.empty(shape, dtype)
    return [np.empty(shape[1:], dtype) for _ in range(shape[0])]


def _pair(scores, i, h):
    """The scores of sample(s) i, head(s) h (a _pairs item)."""
    return scores[i][h] if isinstance(scores, list) else scores[i, h]


@register_op
class MultiHeadAttention(Op):
    """out = MHA(query [b, Lq, E], key [b, Lk, E], value [b, Lk, E]) -> [b, Lq, E].

    `causal` masks key j for query i when j > i (only when Lq == Lk). The tile space is
    [batch, Lq, E, heads]: dim 0 is the sample dim, dim 1 (query positions) an attribute and
    dim 3 the heads, a partial parameter dim. A tile reads its query rows and all keys and
    values of its samples; of the weights, the columns of out_proj_weight that its heads
    own, and all of in_proj_weight and in_proj_bias (a set of heads owns three bands of
    their rows, q, k and v, which no one rect holds; its gradient is zero outside them).
    """

    kind = "multihead_attention"
    float_inputs = True

    def __init__(self, name, inputs, num_heads: int, use_bias: bool = True, causal: bool = False):
        super().__init__(name, inputs, num_heads=num_heads, use_bias=bool_attr(self.kind, name, "use_bias", use_bias),
                         causal=bool_attr(self.kind, name, "causal", causal))

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 3:
            raise self.fail(f"takes 3 inputs (query, key, value), got {len(in_shapes)}")
        q, k, v = in_shapes
        if len(q) != 3 or len(k) != 3 or len(v) != 3:
            raise self.fail(f"query, key and value must be [batch, seq, E], got {q}, {k}, {v}")
        if not (q[0] == k[0] == v[0]):
            raise self.fail(f"batch sizes differ: query {q[0]}, key {k[0]}, value {v[0]}")
        if not (q[2] == k[2] == v[2]):
            raise self.fail(f"embedding sizes differ: query E={q[2]}, key E={k[2]}, value E={v[2]}")
        if k[1] != v[1]:
            raise self.fail(f"key and value lengths differ: {k[1]} and {v[1]}")
        if q[1] < 1 or k[1] < 1:
            raise self.fail(f"query and key lengths must be >= 1, got Lq={q[1]}, Lk={k[1]}")
        e = q[2]
        if not is_count(self.num_heads):
            raise self.fail(f"num_heads must be a positive int, got {self.num_heads!r}")
        if e % self.num_heads:
            raise self.fail(f"embedding size E={e} is not divisible by num_heads={self.num_heads}")
        if self.causal and q[1] != k[1]:
            raise self.fail(f"causal mask needs Lq == Lk, got Lq={q[1]}, Lk={k[1]}")
        return [tuple(q)]

    @property
    def embed_dim(self) -> int:
        return self.inputs[0].shape[2]

    def weight_shapes(self):
        e = self.embed_dim
        shapes = {"in_proj_weight": (3 * e, e), "out_proj_weight": (e, e)}
        if self.use_bias:
            shapes["in_proj_bias"] = (3 * e,)
            shapes["out_proj_bias"] = (e,)
        return shapes

    def init_weights(self, rng):
        e = self.embed_dim
        out = {}
        for k, s in self.weight_shapes().items():
            if k == "in_proj_weight":  # xavier_uniform over the [3E, E] matrix
                bound = math.sqrt(6.0 / (3 * e + e))
            elif k == "out_proj_weight":  # nn.Linear's default
                bound = 1.0 / math.sqrt(e)
            else:  # torch zeros both biases
                bound = 0.0
            out[k] = rng.uniform(-bound, bound, size=s).astype(self.weight_dtype(k))
        return out

    @property
    def tile_shape(self) -> tuple[int, ...]:
        return self.outputs[0].shape + (int(self.num_heads),)

    def split_dims(self):
        return (SplitDim(0, SAMPLE), SplitDim(1, ATTRIBUTE), SplitDim(3, PARAMETER, partial=True))

    def output_rects(self, tile: Rect) -> list[Rect]:
        return [Rect(tile.lo[:3], tile.hi[:3])]

    def input_rects(self, tile: Rect) -> list[Rect]:
        e = self.embed_dim
        lk = self.inputs[1].shape[1]
        b0, b1 = tile.lo[0], tile.hi[0]
        query = Rect((b0, tile.lo[1], 0), (b1, tile.hi[1], e))
        kv = Rect((b0, 0, 0), (b1, lk, e))
        return [query, kv, kv]

    def _columns(self, tile: Rect) -> slice:
        """The columns of the projected [.., E] arrays that the tile's heads own."""
        d = self.embed_dim // int(self.num_heads)
        return slice(tile.lo[3] * d, tile.hi[3] * d)

    def weight_rects(self, tile: Rect) -> dict[str, Rect]:
        rects = {k: Rect.from_shape(s) for k, s in self.weight_shapes().items()}
        cols = self._columns(tile)
        rects["out_proj_weight"] = Rect((0, cols.start), (self.embed_dim, cols.stop))
        return rects

    def bias_weights(self):
        return ("out_proj_bias",) if self.use_bias else ()

    def _rows(self, which: int, cols: slice) -> slice:
        """Rows of in_proj_weight projecting to q (0), k (1) or v (2) for the columns `cols`."""
        e = self.embed_dim
        return slice(which * e + cols.start, which * e + cols.stop)

    def _project(self, xp, x, weights, which: int, cols: slice, out) -> None:
        """out [b, n, len(cols)] = x [b, n, E] @ W_which^T + b_which over the columns `cols` of q (0),
        k (1) or v (2)."""
        rows = self._rows(which, cols)
        x2, w = x.reshape(-1, self.embed_dim), weights["in_proj_weight"][rows].T
        direct = out.flags.c_contiguous   # a group of samples: the GEMM writes its rows in place
        y = xp.matmul(x2, w, out=out.reshape(x2.shape[0], -1)) if direct else x2 @ w
        if self.use_bias:
            y += weights["in_proj_bias"][rows]
        if not direct:
            out[...] = y.reshape(out.shape)

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        query, key, value = inputs
        b, lq, e = query.shape
        lk = key.shape[1]
        nh = tile.shape[3]
        d = e // int(self.num_heads)
        w_in, w_out = weights["in_proj_weight"], weights["out_proj_weight"]
        if w_in.shape != (3 * e, e):
            raise self.fail(f"in_proj_weight is {tuple(w_in.shape)}, expected {(3 * e, e)}")
        cols = self._columns(tile)
        dtype = xp.result_type(query.dtype, w_in.dtype)
        scale = dtype.type(1.0 / math.sqrt(d))
        q, k, v, ctx = (xp.empty((b, n, nh * d), dtype=dtype) for n in (lq, lk, lk, lq))
        whole = _whole(xp, (b, nh, lq, lk), dtype.itemsize)
        p = _scores(xp, (b, nh, lq, lk), dtype, whole)
        qh, kh, vh, ctx_h = _heads(q, nh), _heads(k, nh), _heads(v, nh), _heads(ctx, nh)
        causal_first = in_rects[0].lo[1] if self.causal else None  # query q0 + i may not see key j > q0 + i
        out = xp.empty((b, lq, e), dtype=dtype)

        def group(bs, hs):
            """Samples bs, heads hs: their projections, attention and share of the output."""
            hc = _head_columns(hs, nh, d)
            own = slice(cols.start + hc.start, cols.start + hc.stop)   # their columns of all E
            for which, (x, y) in enumerate(((query, q), (key, k), (value, v))):
                self._project(xp, x[bs], weights, which, own, y[bs, :, hc])
            q[bs, :, hc] *= scale
            for i, h in _pairs(b, nh, bs, hs, whole):
                pg = _pair(p, i, h)
                xp.matmul(qh[i, h], kh[i, h].swapaxes(-1, -2), out=pg)
                softmax_rows_(xp, pg, pg, causal_first)
                xp.matmul(pg, vh[i, h], out=ctx_h[i, h])
            c = ctx[bs, :, hc]
            return c.reshape(-1, c.shape[-1]) @ w_out[:, hc].T
        shares = _per_head_groups(xp, b, nh, group, whole)
        if _all_heads(shares[0][0][1], nh):   # groups of samples: each makes its rows of the output
            for (bs, _), y in shares:
                out[bs] = y.reshape(out[bs].shape)
        else:                                 # groups of heads: their partial outputs add up
            out[...] = sum(y for _, y in shares).reshape(out.shape)
        if "out_proj_bias" in weights:
            out += weights["out_proj_bias"]
        return [out], (q, k, v, p, ctx)

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        query, key, value = inputs
        (dout,) = grad_outputs
        q, k, v, p, ctx = saved
        b, lq, e = query.shape
        lk = key.shape[1]
        nh = tile.shape[3]
        d = e // int(self.num_heads)
        scale = q.dtype.type(1.0 / math.sqrt(d))
        w_in, w_out = weights["in_proj_weight"], weights["out_proj_weight"]
        cols = self._columns(tile)
        whole = not isinstance(p, list)
        dctx, dq, dk, dv = (xp.empty((b, n, nh * d), dtype=q.dtype) for n in (lq, lq, lk, lk))
        qh, kh, vh, dctx_h = _heads(q, nh), _heads(k, nh), _heads(v, nh), _heads(dctx, nh)
        dqh, dkh, dvh = _heads(dq, nh), _heads(dk, nh), _heads(dv, nh)
        inputs3 = (query, key, value)

        def group(bs, hs):
            """Samples bs, heads hs: their shares of the weights' gradients, as (name, index, array)
            to add, and of the inputs' gradients (their rows; all rows, partial, for some heads)."""
            hc = _head_columns(hs, nh, d)
            own = slice(cols.start + hc.start, cols.start + hc.stop)
            d2 = dout[bs].reshape(-1, e)
            dctx[bs, :, hc] = (d2 @ w_out[:, hc]).reshape(dctx[bs, :, hc].shape)
            c = ctx[bs, :, hc]
            weight_shares = [("out_proj_weight", (slice(None), hc), d2.T @ c.reshape(-1, c.shape[-1]))]
            pairs = _pairs(b, nh, bs, hs, whole)
            ds = xp.empty_like(_pair(p, *pairs[0]))  # dP, then dS in place: a pair's, reused on the CPU
            for i, h in pairs:
                pg = _pair(p, i, h)
                xp.matmul(pg.swapaxes(-1, -2), dctx_h[i, h], out=dvh[i, h])
                xp.matmul(dctx_h[i, h], vh[i, h].swapaxes(-1, -2), out=ds)
                softmax_grad_rows(xp, pg, ds, out=ds)
                xp.matmul(ds, kh[i, h], out=dqh[i, h])
                xp.matmul(ds.swapaxes(-1, -2), qh[i, h], out=dkh[i, h])
            dq[bs, :, hc] *= scale  # q was scaled after projection
            input_shares = []
            for which, (x, dproj) in enumerate(zip(inputs3, (dq, dk, dv))):
                rows = self._rows(which, own)
                dp2 = dproj[bs, :, hc].reshape(-1, hc.stop - hc.start)
                weight_shares.append(("in_proj_weight", rows, dp2.T @ x[bs].reshape(-1, e)))
                if self.use_bias:
                    weight_shares.append(("in_proj_bias", rows, dp2.sum(axis=0)))
                input_shares.append((dp2 @ w_in[rows]).reshape(x[bs].shape))
            return weight_shares, input_shares
        results = _per_head_groups(xp, b, nh, group, whole)
        # a set of heads owns three bands of in_proj's rows: its gradient is zero outside them
        grads = {"in_proj_weight": xp.zeros((3 * e, e), dtype=w_in.dtype),
                 "out_proj_weight": xp.zeros(w_out.shape, dtype=w_out.dtype)}
        if self.use_bias:
            grads["in_proj_bias"] = xp.zeros((3 * e,), dtype=w_in.dtype)
        by_heads = not _all_heads(results[0][0][1], nh)   # groups of heads: their input grads add up
        grad_inputs = [(xp.zeros if by_heads else xp.empty)(x.shape, dtype=q.dtype) for x in inputs3]
        for (bs, _), (weight_shares, input_shares) in results:
            for name, where, a in weight_shares:
                grads[name][where] += a
            for gx, a in zip(grad_inputs, input_shares):
                if by_heads:
                    gx += a
                else:
                    gx[bs] = a
        if "out_proj_bias" in weights:
            grads["out_proj_bias"] = dout.reshape(-1, e).sum(axis=0)
        return grad_inputs, grads

    def flops(self, tile: Rect) -> int:
        b, lq, heads = tile.shape[0], tile.shape[1], tile.shape[3]
        e = self.embed_dim
        et = heads * (e // int(self.num_heads))  # the tile's heads' width
        lk = self.inputs[1].shape[1]
        projections = 2 * b * (2 * lq + 2 * lk) * e * et  # q and out on the tile's rows, k and v on all keys
        attention = 4 * b * lq * lk * et  # q k^T and P v over the tile's heads
        softmax = 5 * b * heads * lq * lk
        return projections + attention + softmax
