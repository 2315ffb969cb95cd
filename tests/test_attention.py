"""Multi-head attention against torch.nn.MultiheadAttention, finite differences and every tiling."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ops import attention
from ops.attention import MultiHeadAttention, _head_groups
from ops.base import ATTRIBUTE, OP_REGISTRY, PARAMETER, SAMPLE, ShapeError
from taskrt.geometry import Rect
from tests.opcheck import check_finite_differences, check_tiled, run_whole, spec
from tests.opcheck import ArrayCodePath


def mha_case(batch, lq, lk, e, heads, use_bias=True, causal=False, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype).name
    op = MultiHeadAttention("attn", [spec((batch, lq, e), dt, "q"), spec((batch, lk, e), dt, "k"),
                                     spec((batch, lk, e), dt, "v")], num_heads=heads, use_bias=use_bias, causal=causal)
    w = op.init_weights(rng)
    for k in ("in_proj_bias", "out_proj_bias"):  # torch inits them to zero; make them matter
        if k in w:
            w[k] = rng.standard_normal(w[k].shape).astype(dtype)
    xs = [rng.standard_normal(t.shape).astype(dtype) for t in op.inputs]
    g = rng.standard_normal(op.outputs[0].shape).astype(dtype)
    return op, xs, w, g


def torch_mha(op, xs, w, g):
    e, lq, lk = op.embed_dim, op.inputs[0].shape[1], op.inputs[1].shape[1]
    m = torch.nn.MultiheadAttention(e, op.num_heads, bias=op.use_bias, batch_first=True)
    if xs[0].dtype == np.float64:
        m = m.double()
    params = {"in_proj_weight": m.in_proj_weight, "out_proj_weight": m.out_proj.weight}
    if op.use_bias:
        params.update(in_proj_bias=m.in_proj_bias, out_proj_bias=m.out_proj.bias)
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(torch.from_numpy(w[k]))
    ts = [torch.tensor(a, requires_grad=True) for a in xs]
    mask = torch.triu(torch.ones(lq, lk, dtype=torch.bool), diagonal=1) if op.causal else None
    out, _ = m(*ts, need_weights=False, attn_mask=mask)
    out.backward(torch.from_numpy(g))
    return out.detach().numpy(), [t.grad.numpy() for t in ts], {k: p.grad.numpy() for k, p in params.items()}


def check_against_torch(op, xs, w, g, rtol=1e-4, atol=2e-5):
    outs, gin, gw, _ = run_whole(op, xs, w, grad_outputs=[g])
    t_out, t_gin, t_gw = torch_mha(op, xs, w, g)
    assert outs[0].shape == t_out.shape and outs[0].dtype == xs[0].dtype
    np.testing.assert_allclose(outs[0], t_out, rtol=rtol, atol=atol, err_msg="output")
    for name, a, b in zip(("query", "key", "value"), gin, t_gin):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"grad {name}")
    assert set(gw) == set(t_gw)
    for k in gw:
        np.testing.assert_allclose(gw[k], t_gw[k], rtol=rtol, atol=atol, err_msg=f"grad {k}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("use_bias", [True, False])
def test_attention_matches_torch_finite_differences_and_tiles(causal, use_bias):
    op, xs, w, g = mha_case(2, 5, 5, 8, 2, use_bias, causal)
    check_against_torch(op, xs, w, g)
    check_finite_differences(op, xs, w)
    op64, xs64, w64, g64 = mha_case(3, 5, 5, 8, 2, use_bias, causal, dtype=np.float64)
    check_tiled(op64, xs64, w64, [g64])


def test_cross_attention_with_different_lengths():
    op, xs, w, g = mha_case(2, 3, 7, 12, 3)
    check_against_torch(op, xs, w, g)
    check_finite_differences(op, xs, w)
    op64, xs64, w64, g64 = mha_case(2, 3, 7, 12, 3, dtype=np.float64)
    check_tiled(op64, xs64, w64, [g64])


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 3), lq=st.integers(1, 6), lk=st.integers(1, 6), heads=st.integers(1, 3),
       d=st.integers(1, 4), use_bias=st.booleans(), causal=st.booleans(), seed=st.integers(0, 99),
       whole_bytes=st.sampled_from([0, attention.WHOLE_SCORES_BYTES]))
def test_attention_any_shape(batch, lq, lk, heads, d, use_bias, causal, seed, whole_bytes):
    """Against torch, and tiled, with the (sample, head) pairs one at a time (whole_bytes 0) and
    all at once."""
    if causal:
        lk = lq
    saved = attention.WHOLE_SCORES_BYTES
    attention.WHOLE_SCORES_BYTES = whole_bytes
    try:
        op, xs, w, g = mha_case(batch, lq, lk, heads * d, heads, use_bias, causal, seed)
        check_against_torch(op, xs, w, g)
        op64, xs64, w64, g64 = mha_case(batch, lq, lk, heads * d, heads, use_bias, causal, seed, np.float64)
        check_tiled(op64, xs64, w64, [g64])
        tile = Rect.from_shape(op.tile_shape)
        _, scores = op.forward(np, tile, xs, op.input_rects(tile), w)
        assert isinstance(scores[3], list) == (whole_bytes == 0)
    finally:
        attention.WHOLE_SCORES_BYTES = saved


def test_head_tiles_sum_to_the_whole_attention():
    """Each head alone: its projections, attention and partial output projection; the partial
    outputs and input grads add up to torch's, its weight grads are zero outside its heads' rows."""
    op, xs, w, g = mha_case(2, 4, 5, 12, 3, dtype=np.float64)
    outs, gin, gw, _ = run_whole(op, xs, w, grad_outputs=[g])
    total_out, total_gin = np.zeros_like(outs[0]), [np.zeros_like(x) for x in xs]
    total_gw = {k: np.zeros_like(v) for k, v in w.items()}
    for h in range(3):
        tile = Rect((0, 0, 0, h), (2, 4, 12, h + 1))
        rects = op.tile_weight_rects(tile)
        ws = {k: w[k][r.slices()] for k, r in rects.items() if not r.empty}
        (out,), saved = op.forward(np, tile, xs, op.input_rects(tile), ws)
        tgin, tgw = op.backward(np, tile, xs, op.input_rects(tile), ws, [out], [g], saved)
        total_out += out
        for a, t in zip(total_gin, tgin):
            a += t
        for k, t in tgw.items():
            total_gw[k][rects[k].slices()] += t
        own = np.zeros(36, bool)
        own[[r + which * 12 for which in range(3) for r in range(4 * h, 4 * h + 4)]] = True
        assert not tgw["in_proj_weight"][~own].any() and not tgw["in_proj_bias"][~own].any()
    np.testing.assert_allclose(total_out, outs[0], rtol=1e-12, atol=1e-12)
    for a, b in zip(total_gin, gin):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    for k in gw:
        np.testing.assert_allclose(total_gw[k], gw[k], rtol=1e-10, atol=1e-12, err_msg=k)


def test_softmax_is_stable_for_huge_scores():
    op, xs, w, g = mha_case(2, 4, 4, 8, 2, causal=True)
    xs = [1e3 * x for x in xs]
    outs, gin, gw, _ = run_whole(op, xs, w, grad_outputs=[g])
    assert all(np.isfinite(a).all() for a in [outs[0], *gin, *gw.values()])
    # the softmax is saturated (one-hot), so only the forward is well conditioned enough to compare
    t_out, _, _ = torch_mha(op, xs, w, g)
    np.testing.assert_allclose(outs[0], t_out, rtol=1e-4, atol=1e-2)


def test_causal_first_query_sees_only_the_first_key():
    """Query 0's output depends on key/value 0 only, even in a query tile that starts later."""
    op, xs, w, g = mha_case(1, 6, 6, 4, 2, causal=True, dtype=np.float64)
    base, _, _, _ = run_whole(op, xs, w)
    changed = [x.copy() for x in xs]
    changed[1][:, 1:] += 5.0
    changed[2][:, 1:] -= 3.0
    out, _, _, _ = run_whole(op, changed, w)
    np.testing.assert_allclose(out[0][:, 0], base[0][:, 0], rtol=1e-12)
    assert not np.allclose(out[0][:, 1:], base[0][:, 1:])


def test_attention_rects_split_dims_and_flops():
    op = MultiHeadAttention("attn", [spec((4, 6, 8), name="q"), spec((4, 9, 8), name="k"), spec((4, 9, 8), name="v")],
                            num_heads=2)
    assert op.tile_shape == (4, 6, 8, 2)
    assert [(s.dim, s.kind, s.partial) for s in op.split_dims()] == [(0, SAMPLE, False), (1, ATTRIBUTE, False),
                                                                     (3, PARAMETER, True)]
    tile = Rect((1, 2, 0, 0), (3, 5, 8, 2))
    kv = Rect((1, 0, 0), (3, 9, 8))
    assert op.input_rects(tile) == [Rect((1, 2, 0), (3, 5, 8)), kv, kv]
    assert op.output_rects(tile) == [Rect((1, 2, 0), (3, 5, 8))]
    assert op.weight_rects(tile) == {k: Rect.from_shape(s) for k, s in op.weight_shapes().items()}
    b, lq, lk, e, h, d = 2, 3, 9, 8, 2, 4
    want = 2 * b * lq * e * e * 2 + 2 * b * lk * e * e * 2 + 2 * 2 * b * h * lq * lk * d + 5 * b * h * lq * lk
    assert op.flops(tile) == want
    # head 1 of 2: its columns of out_proj_weight, no out-projection bias (head 0 adds it), half the work
    head = Rect((1, 2, 0, 1), (3, 5, 8, 2))
    assert op.output_rects(head) == op.output_rects(tile) and op.input_rects(head) == op.input_rects(tile)
    assert op.tile_weight_rects(head) == {"in_proj_weight": Rect((0, 0), (24, 8)), "in_proj_bias": Rect((0,), (24,)),
                                          "out_proj_weight": Rect((0, 4), (8, 8)), "out_proj_bias": Rect((0,), (0,))}
    assert op.flops(head) * 2 == want
    assert OP_REGISTRY["multihead_attention"] is MultiHeadAttention
    assert op.attrs() == {"num_heads": 2, "use_bias": True, "causal": False}


def test_attention_init_is_torch_default():
    e = 64
    op = MultiHeadAttention("attn", [spec((1, 2, e), name=n) for n in "qkv"], num_heads=4)
    w = op.init_weights(np.random.default_rng(0))
    assert {k: v.shape for k, v in w.items()} == {"in_proj_weight": (3 * e, e), "in_proj_bias": (3 * e,),
                                                  "out_proj_weight": (e, e), "out_proj_bias": (e,)}
    xavier = math.sqrt(6 / (4 * e))
    assert xavier * 0.9 < np.abs(w["in_proj_weight"]).max() <= xavier
    assert 0.9 / math.sqrt(e) < np.abs(w["out_proj_weight"]).max() <= 1 / math.sqrt(e)
    assert not w["in_proj_bias"].any() and not w["out_proj_bias"].any()
    assert all(v.dtype == np.float32 for v in w.values())
    no_bias = MultiHeadAttention("attn", [spec((1, 2, e), name=n) for n in "qkv"], num_heads=4, use_bias=False)
    assert set(no_bias.weight_shapes()) == {"in_proj_weight", "out_proj_weight"}


@pytest.mark.parametrize("shapes,attrs,needle", [
    (((2, 5, 12),) * 3, dict(num_heads=5), "E=12 is not divisible by num_heads=5"),
    (((2, 5, 12),) * 3, dict(num_heads=0), "num_heads"),
    (((2, 5, 12), (2, 6, 12), (2, 6, 12)), dict(num_heads=2, causal=True), "Lq == Lk"),
    (((2, 5, 12), (2, 6, 8), (2, 6, 8)), dict(num_heads=2), "embedding sizes differ"),
    (((2, 5, 12), (3, 6, 12), (3, 6, 12)), dict(num_heads=2), "batch sizes differ"),
    (((2, 5, 12), (2, 6, 12), (2, 7, 12)), dict(num_heads=2), "key and value lengths differ"),
    (((2, 12),) * 3, dict(num_heads=2), r"\[batch, seq, E\]"),
    (((2, 5, 12), (2, 0, 12), (2, 0, 12)), dict(num_heads=2), "Lk=0"),
    (((2, 5, 12),) * 2, dict(num_heads=2), "takes 3 inputs"),
])
def test_attention_bad_inputs_name_the_op(shapes, attrs, needle):
    with pytest.raises(ShapeError, match=needle) as err:
        MultiHeadAttention("self_attn", [spec(s, name=f"in{i}") for i, s in enumerate(shapes)], **attrs)
    assert "multihead_attention 'self_attn'" in str(err.value)


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 3), lq=st.integers(1, 6), extra=st.integers(0, 3), heads=st.integers(1, 3),
       d=st.integers(1, 3), use_bias=st.booleans(), causal=st.booleans(), data=st.data())
def test_attention_cpu_kernels_match_the_array_code_on_tiles(batch, lq, extra, heads, d, use_bias, causal, data):
    """One tile (a range of samples, queries and heads) through the CPU kernels (fused softmax,
    causal mask and softmax backward) and through the array code (the GPU path), in float64."""
    lk = lq if causal else lq + extra
    op, xs, w, g = mha_case(batch, lq, lk, heads * d, heads, use_bias, causal, data.draw(st.integers(0, 99)),
                            np.float64)
    lo = [data.draw(st.integers(0, n - 1)) for n in (batch, lq, heads)]
    hi = [data.draw(st.integers(a + 1, n)) for a, n in zip(lo, (batch, lq, heads))]
    tile = Rect((lo[0], lo[1], 0, lo[2]), (hi[0], hi[1], heads * d, hi[2]))
    in_rects = op.input_rects(tile)
    ins = [x[r.slices()] for x, r in zip(xs, in_rects)]
    rects = op.tile_weight_rects(tile)
    ws = {k: w[k][r.slices()] for k, r in rects.items() if not r.empty}
    gout = g[op.output_rects(tile)[0].slices()]
    results = []
    for xp in (np, ArrayCodePath()):
        (out,), saved = op.forward(xp, tile, ins, in_rects, ws)
        gin, gw = op.backward(xp, tile, ins, in_rects, ws, [out], [gout], saved)
        results.append([out, *gin, *(gw[k] for k in sorted(gw))])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@settings(max_examples=50, deadline=None)
@given(batch=st.integers(1, 9), heads=st.integers(1, 9), parts=st.integers(1, 5))
def test_head_groups_cover_every_sample_and_head_once(batch, heads, parts):
    groups = _head_groups(batch, heads, parts)
    assert 1 <= len(groups) <= parts
    seen = np.zeros((batch, heads), int)
    for bs, hs in groups:
        assert seen[bs, hs].size > 0
        seen[bs, hs] += 1
    assert (seen == 1).all()
    assert len(groups) == min(parts, max(batch, heads))  # as many as the pool can use
