"""Multi-head attention with PyTorch's nn.MultiheadAttention(batch_first=True) weights and init.

    q, k, v = query Wq^T + bq, key Wk^T + bk, value Wv^T + bv     (W = in_proj_weight rows)
    per head:  P = softmax(q k^T / sqrt(d) [+ causal mask]),  ctx = P v
    out = ctx Wo^T + bo                                            (Wo = out_proj_weight)

Heads are strided views of the projected [batch, seq, E] arrays (no transposed copies);
the per-head GEMMs write straight into [batch, seq, heads, d] buffers. Backward uses
the flash-attention identity rowsum(dP * P) = rowsum(dctx * ctx), which avoids one
pass over the [batch, heads, Lq, Lk] scores.
"""
from __future__ import annotations

import math

import numpy as np

from ops.base import ATTRIBUTE, SAMPLE, Op, SplitDim, register_op
from taskrt.geometry import Rect


def _heads(a, num_heads: int):
    """[batch, seq, E] -> a [batch, heads, seq, d] view."""
    b, n, e = a.shape
    return a.reshape(b, n, num_heads, e // num_heads).transpose(0, 2, 1, 3)


def _softmax_last_(xp, s) -> None:
    """Numerically stable softmax over the last axis, in place."""
    s -= s.max(axis=-1, keepdims=True)
    xp.exp(s, out=s)
    s *= xp.reciprocal(s.sum(axis=-1, keepdims=True))


@register_op
class MultiHeadAttention(Op):
    """out = MHA(query [b, Lq, E], key [b, Lk, E], value [b, Lk, E]) -> [b, Lq, E].

    `causal` masks key j for query i when j > i (only when Lq == Lk). Dim 0 is the
    sample dim and dim 1 (query positions) an attribute: a tile reads its query rows
    and all keys and values of its samples, and all weights.
    """

    kind = "multihead_attention"

    def __init__(self, name, inputs, num_heads: int, use_bias: bool = True, causal: bool = False):
        super().__init__(name, inputs, num_heads=num_heads, use_bias=use_bias, causal=causal)

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
        for t in self.inputs:
            if np.dtype(t.dtype).kind != "f":
                raise self.fail(f"input {t.name} must be floating point, got {t.dtype}")
        e = q[2]
        if not isinstance(self.num_heads, (int, np.integer)) or self.num_heads < 1:
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

    def split_dims(self):
        return (SplitDim(0, SAMPLE), SplitDim(1, ATTRIBUTE))

    def input_rects(self, tile: Rect) -> list[Rect]:
        e = self.embed_dim
        lk = self.inputs[1].shape[1]
        b0, b1 = tile.lo[0], tile.hi[0]
        query = Rect((b0, tile.lo[1], 0), (b1, tile.hi[1], e))
        kv = Rect((b0, 0, 0), (b1, lk, e))
        return [query, kv, kv]

    def _project(self, x, weights, which: int):
        """x [b, n, E] @ W_which^T + b_which, which = 0 (q), 1 (k), 2 (v)."""
        e = self.embed_dim
        w = weights["in_proj_weight"][which * e:(which + 1) * e]
        y = x.reshape(-1, e) @ w.T
        if self.use_bias:
            y += weights["in_proj_bias"][which * e:(which + 1) * e]
        return y.reshape(x.shape)

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        query, key, value = inputs
        b, lq, e = query.shape
        lk = key.shape[1]
        nh = int(self.num_heads)
        d = e // nh
        if weights["in_proj_weight"].shape != (3 * e, e):
            raise self.fail(f"in_proj_weight is {tuple(weights['in_proj_weight'].shape)}, expected {(3 * e, e)}")
        q = self._project(query, weights, 0)
        q *= q.dtype.type(1.0 / math.sqrt(d))
        k = self._project(key, weights, 1)
        v = self._project(value, weights, 2)

        p = xp.matmul(_heads(q, nh), _heads(k, nh).swapaxes(-1, -2))  # [b, nh, lq, lk]
        if self.causal:
            q0 = in_rects[0].lo[1]
            mask = xp.zeros((lq, lk), dtype=p.dtype)  # query q0 + i may not see key j > q0 + i
            mask[xp.arange(lk)[None, :] > (q0 + xp.arange(lq))[:, None]] = -xp.inf
            p += mask
        _softmax_last_(xp, p)
        ctx = xp.empty((b, lq, e), dtype=q.dtype)
        xp.matmul(p, _heads(v, nh), out=_heads(ctx, nh))

        out = ctx.reshape(-1, e) @ weights["out_proj_weight"].T
        if self.use_bias:
            out += weights["out_proj_bias"]
        return [out.reshape(b, lq, e)], (q, k, v, p, ctx)

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        query, key, value = inputs
        (dout,) = grad_outputs
        q, k, v, p, ctx = saved
        b, lq, e = query.shape
        lk = key.shape[1]
        nh = int(self.num_heads)
        scale = q.dtype.type(1.0 / math.sqrt(e // nh))
        w_in, w_out = weights["in_proj_weight"], weights["out_proj_weight"]

        d2 = dout.reshape(-1, e)
        grads = {"out_proj_weight": d2.T @ ctx.reshape(-1, e)}
        if self.use_bias:
            grads["out_proj_bias"] = d2.sum(axis=0)
        dctx = (d2 @ w_out).reshape(b, lq, e)
        dctx_h = _heads(dctx, nh)

        dv = xp.empty((b, lk, e), dtype=q.dtype)
        xp.matmul(p.swapaxes(-1, -2), dctx_h, out=_heads(dv, nh))
        ds = xp.matmul(dctx_h, _heads(v, nh).swapaxes(-1, -2))  # dP, then dS in place
        # rowsum(dP * P) = rowsum(dctx * ctx) per head: [b, nh, lq, 1]
        row = (dctx * ctx).reshape(b, lq, nh, e // nh).sum(axis=-1).transpose(0, 2, 1)[..., None]
        ds -= row
        ds *= p
        dq = xp.empty((b, lq, e), dtype=q.dtype)
        xp.matmul(ds, _heads(k, nh), out=_heads(dq, nh))
        dq *= scale  # q was scaled after projection
        dk = xp.empty((b, lk, e), dtype=q.dtype)
        xp.matmul(ds.swapaxes(-1, -2), _heads(q, nh), out=_heads(dk, nh))

        g_in = xp.empty((3 * e, e), dtype=w_in.dtype)
        grad_inputs = []
        for which, (x, dproj) in enumerate(zip((query, key, value), (dq, dk, dv))):
            rows = slice(which * e, (which + 1) * e)
            dp2 = dproj.reshape(-1, e)
            xp.matmul(dp2.T, x.reshape(-1, e), out=g_in[rows])
            grad_inputs.append((dp2 @ w_in[rows]).reshape(x.shape))
        grads["in_proj_weight"] = g_in
        if self.use_bias:
            grads["in_proj_bias"] = xp.concatenate([dq.reshape(-1, e).sum(axis=0), dk.reshape(-1, e).sum(axis=0),
                                                    dv.reshape(-1, e).sum(axis=0)])
        return grad_inputs, grads

    def flops(self, tile: Rect) -> int:
        b, lq = tile.shape[0], tile.shape[1]
        e = self.embed_dim
        lk = self.inputs[1].shape[1]
        projections = 2 * b * (2 * lq + 2 * lk) * e * e  # q and out on the tile's rows, k and v on all keys
        attention = 4 * b * lq * lk * e  # q k^T and P v over all heads (heads * d = E)
        softmax = 5 * b * int(self.num_heads) * lq * lk
        return projections + attention + softmax
