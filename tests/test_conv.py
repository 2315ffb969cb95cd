"""Conv2d against PyTorch, a float64 direct reference, finite differences and every tiling (halos included)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ops.base import ATTRIBUTE, OP_REGISTRY, PARAMETER, SAMPLE, ShapeError
import ops.conv as conv_module
from ops.conv import Conv2d, _col2im_cpu, _col2im_xp
from taskrt.geometry import Rect
from tests.opcheck import check_finite_differences, check_tiled, run_both_paths, run_whole, spec


def make_conv(shape, dtype="float32", **attrs):
    return Conv2d("conv", [spec(shape, dtype)], **attrs)


def conv_data(op, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    weights = {k: v.astype(dtype) for k, v in op.init_weights(rng).items()}
    x = rng.standard_normal(op.inputs[0].shape).astype(dtype)
    g = rng.standard_normal(op.outputs[0].shape).astype(dtype)
    return x, weights, g


def torch_conv_check(op, x, weights, g):
    """Forward, grad input, grad weight and grad bias match F.conv2d in float32."""
    outs, (gx,), gw, _ = run_whole(op, [x], weights, grad_outputs=[g])
    assert gx.shape == x.shape  # the whole op's rect is the whole input, unread rows included
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(weights["weight"], requires_grad=True)
    bt = torch.tensor(weights["bias"], requires_grad=True) if op.use_bias else None
    yt = F.conv2d(xt, wt, bt, stride=op.stride, padding=op.padding, groups=op.groups)
    yt.backward(torch.tensor(g))
    assert outs[0].shape == op.outputs[0].shape == tuple(yt.shape) and outs[0].dtype == x.dtype
    np.testing.assert_allclose(outs[0], yt.detach().numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gx, xt.grad.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gw["weight"], wt.grad.numpy(), rtol=1e-4, atol=1e-3)
    if op.use_bias:
        np.testing.assert_allclose(gw["bias"], bt.grad.numpy(), rtol=1e-4, atol=1e-3)
    else:
        assert "bias" not in gw


CONV_CASES = [
    dict(shape=(2, 3, 9, 7), out_channels=4, kernel=3, stride=1, padding=1, groups=1),
    dict(shape=(3, 4, 11, 9), out_channels=6, kernel=(3, 2), stride=2, padding=(1, 0), groups=2),
    dict(shape=(2, 6, 9, 10), out_channels=6, kernel=(2, 3), stride=(3, 2), padding=(2, 1), groups=3),
    dict(shape=(2, 4, 7, 7), out_channels=4, kernel=2, stride=3, padding=3, groups=4, use_bias=False),
    dict(shape=(1, 2, 5, 13), out_channels=3, kernel=(5, 1), stride=(1, 4), padding=(2, 0), groups=1),
    # 1x1 kernels take the input as their columns: unpadded stride 1 (the input gradient straight
    # from the matmul), strided, padded, grouped
    dict(shape=(2, 4, 6, 5), out_channels=6, kernel=1, stride=1, padding=0, groups=2),
    dict(shape=(2, 3, 7, 6), out_channels=4, kernel=1, stride=2, padding=0, groups=1),
    dict(shape=(1, 4, 5, 5), out_channels=2, kernel=1, stride=(1, 2), padding=1, groups=1, use_bias=False),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: f"{c['shape']}-k{c['kernel']}-s{c['stride']}-g{c['groups']}")
def test_conv_matches_torch_finite_differences_and_tiles(case):
    case = dict(case)
    shape = case.pop("shape")
    op = make_conv(shape, **case)
    x, weights, g = conv_data(op)
    torch_conv_check(op, x, weights, g)
    check_tiled(op, [x], weights, [g], rtol=1e-4, atol=1e-5)
    op64 = make_conv(shape, "float64", **case)
    x64, w64, g64 = conv_data(op64, seed=1, dtype=np.float64)
    check_tiled(op64, [x64], w64, [g64], rtol=1e-10, atol=1e-12)
    check_finite_differences(op64, [x64], w64)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 3), groups=st.integers(1, 2), icpg=st.integers(1, 2), ocpg=st.integers(1, 3),
       h=st.integers(3, 9), w=st.integers(3, 9), kh=st.integers(1, 4), kw=st.integers(1, 4),
       sh=st.integers(1, 3), sw=st.integers(1, 3), ph=st.integers(0, 2), pw=st.integers(0, 2),
       seed=st.integers(0, 2**16))
def test_conv_any_geometry(n, groups, icpg, ocpg, h, w, kh, kw, sh, sw, ph, pw, seed):
    assume(kh <= h + 2 * ph and kw <= w + 2 * pw)
    op = make_conv((n, groups * icpg, h, w), out_channels=groups * ocpg, kernel=(kh, kw), stride=(sh, sw),
                   padding=(ph, pw), groups=groups)
    x, weights, g = conv_data(op, seed)
    torch_conv_check(op, x, weights, g)
    op64 = make_conv((n, groups * icpg, h, w), "float64", out_channels=groups * ocpg, kernel=(kh, kw),
                     stride=(sh, sw), padding=(ph, pw), groups=groups)
    x64, w64, g64 = conv_data(op64, seed, np.float64)
    check_tiled(op64, [x64], w64, [g64], rtol=1e-10, atol=1e-12)


def direct_conv64(x, w, b, dy, stride, padding, groups):
    """Forward and gradients of a grouped convolution in float64, straight from its definition:
    y[n, o, p, q] = b[o] + the sum over c, i, j of w[o, c, i, j] * xpad[n, c', p*sh + i, q*sw + j]
    (c' the input channel c of o's group), one kernel offset (i, j) at a time. -> (y, dx, dw, db)."""
    x, w, dy = (a.astype(np.float64) for a in (x, w, dy))
    (sh, sw), (ph, pw) = stride, padding
    n, c, h, wd = x.shape
    oc, icpg, kh, kw = w.shape
    oh, ow = dy.shape[2:]
    xpad = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    dxpad = np.zeros_like(xpad)
    y = np.zeros(dy.shape)
    dw = np.zeros(w.shape)
    ocpg = oc // groups
    for g in range(groups):
        o, ci = slice(g * ocpg, (g + 1) * ocpg), slice(g * icpg, (g + 1) * icpg)
        for i in range(kh):
            for j in range(kw):
                rows, cols = slice(i, i + sh * (oh - 1) + 1, sh), slice(j, j + sw * (ow - 1) + 1, sw)
                win = xpad[:, ci, rows, cols]
                y[:, o] += np.einsum("oc,ncpq->nopq", w[o, :, i, j], win)
                dw[o, :, i, j] += np.einsum("nopq,ncpq->oc", dy[:, o], win)
                dxpad[:, ci, rows, cols] += np.einsum("oc,nopq->ncpq", w[o, :, i, j], dy[:, o])
    y += b.astype(np.float64)[:, None, None]
    return y, dxpad[:, :, ph:ph + h, pw:pw + wd], dw, dy.sum(axis=(0, 2, 3))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5), groups=st.integers(1, 3), icpg=st.integers(1, 3), ocpg=st.integers(1, 3),
       h=st.integers(1, 12), w=st.integers(1, 12), kh=st.integers(1, 5), kw=st.integers(1, 5),
       sh=st.integers(1, 3), sw=st.integers(1, 3), ph=st.integers(0, 3), pw=st.integers(0, 3),
       chunk=st.sampled_from([64, 1 << 20]), seed=st.integers(0, 2**16))
def test_conv_batched_and_per_sample_columns_match_a_direct_reference(n, groups, icpg, ocpg, h, w, kh, kw, sh, sw,
                                                                      ph, pw, chunk, seed):
    """Both CPU column paths (samples side by side, and per sample) against direct_conv64, on the
    whole op in float32 and float64 and under every tiling in float64; chunks of one sample or
    of the whole batch."""
    assume(kh <= h + 2 * ph and kw <= w + 2 * pw)
    geometry = dict(out_channels=groups * ocpg, kernel=(kh, kw), stride=(sh, sw), padding=(ph, pw), groups=groups)
    shape = (n, groups * icpg, h, w)
    op = make_conv(shape, **geometry)
    x, weights, g = conv_data(op, seed)
    y64, dx64, dw64, db64 = direct_conv64(x, weights["weight"], weights["bias"], g, (sh, sw), (ph, pw), groups)
    op64 = make_conv(shape, "float64", **geometry)
    x64, w64, g64 = (x.astype(np.float64), {k: v.astype(np.float64) for k, v in weights.items()}, g.astype(np.float64))
    for max_pixels in (0, 10**9):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(conv_module, "_BATCHED_MAX_PIXELS", max_pixels)
            patch.setattr(conv_module, "_CHUNK_BYTES", chunk)
            patch.setattr(conv_module, "_WINOGRAD_MIN_BLOCKS", 10**9)  # the column paths, not Winograd's
            patch.setattr(conv_module, "_DIRECT_MAX_CHANNELS", 0)        # nor the direct one
            batched = max_pixels > 0 and (kh, kw) != (1, 1)
            assert op._path(np, Rect.from_shape(op.tile_shape)) == ("batched" if batched else "columns")
            for o, xs, ws, gs, tol in ((op, x, weights, g, 1e-4), (op64, x64, w64, g64, 1e-11)):
                (y,), (dx,), grads, _ = run_whole(o, [xs], ws, grad_outputs=[gs])
                assert y.dtype == dx.dtype == grads["weight"].dtype == xs.dtype
                np.testing.assert_allclose(y, y64, rtol=tol, atol=tol)
                np.testing.assert_allclose(dx, dx64, rtol=tol, atol=tol)
                np.testing.assert_allclose(grads["weight"], dw64, rtol=tol, atol=10 * tol)
                np.testing.assert_allclose(grads["bias"], db64, rtol=tol, atol=10 * tol)
            check_tiled(op64, [x64], w64, [g64], rtol=1e-10, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3), c=st.integers(1, 3), h=st.integers(1, 11), w=st.integers(1, 11), kh=st.integers(1, 5),
       kw=st.integers(1, 5), sh=st.integers(1, 4), sw=st.integers(1, 4), ph=st.integers(0, 3), pw=st.integers(0, 3),
       seed=st.integers(0, 2**16))
def test_phase_planes_give_the_columns_and_their_sums_of_strided_reads(n, c, h, w, kh, kw, sh, sw, ph, pw, seed):
    """im2col and col2im through phase planes (strides over 1) against the strided row kernels:
    the same columns exactly, the same input gradient to rounding; phase planes of odd and
    narrow sizes, shifts on both sides, windows past the input included."""
    assume(kh <= h + 2 * ph and kw <= w + 2 * pw)
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w))
    rows, phased = (np.full((c * kh * kw, n, oh, ow), np.nan) for _ in range(2))
    phases = np.full((n, c, sh, sw, -(-h // sh), -(-w // sw)), np.nan)
    conv_module._im2col_rows_cpu(x, (kh, kw), (sh, sw), (ph, pw), rows)
    conv_module._im2col_phases_cpu(x, (kh, kw), (ph, pw), phased, phases)
    np.testing.assert_array_equal(phased, rows)
    g = rng.standard_normal(rows.shape)
    dx_rows, dx_phased = np.full(x.shape, np.nan), np.full(x.shape, np.nan)
    conv_module._col2im_rows_cpu(g.copy(), (kh, kw), (sh, sw), (ph, pw), dx_rows)
    conv_module._col2im_phases_cpu(g.copy(), (kh, kw), (ph, pw), dx_phased, phases)
    np.testing.assert_allclose(dx_phased, dx_rows, rtol=1e-12, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3), c=st.integers(1, 3), h=st.integers(1, 11), w=st.integers(1, 11), kh=st.integers(1, 5),
       kw=st.integers(1, 5), sh=st.integers(1, 4), sw=st.integers(1, 4), ph=st.integers(0, 3), pw=st.integers(0, 3),
       seed=st.integers(0, 2**16))
def test_the_window_index_gives_the_columns_and_their_sums_of_the_row_kernels(n, c, h, w, kh, kw, sh, sw, ph, pw,
                                                                              seed):
    """im2col and col2im through the window index (small planes) against the row kernels: the same
    columns exactly, the same input gradient to rounding, padding on every side included."""
    assume(kh <= h + 2 * ph and kw <= w + 2 * pw)
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w))
    rows, indexed = (np.full((c * kh * kw, n, oh, ow), np.nan) for _ in range(2))
    index = conv_module._window_index((kh, kw), (sh, sw), (ph, pw), (h, w), (oh, ow))
    conv_module._im2col_rows_cpu(x, (kh, kw), (sh, sw), (ph, pw), rows)
    conv_module._im2col_index_cpu(x, index, indexed)
    np.testing.assert_array_equal(indexed, rows)
    g = rng.standard_normal(rows.shape)
    dx_rows, dx_indexed = np.full(x.shape, np.nan), np.full(x.shape, np.nan)
    conv_module._col2im_rows_cpu(g.copy(), (kh, kw), (sh, sw), (ph, pw), dx_rows)
    conv_module._col2im_index_cpu(g.copy(), index, dx_indexed)
    np.testing.assert_allclose(dx_indexed, dx_rows, rtol=1e-12, atol=1e-12)


def test_conv_batched_path_takes_small_images_and_tiles_of_views(monkeypatch):
    """The samples-side-by-side path on the small CNN's shapes, whole and on tiles that are views
    of the batch and the channels (as the runtime hands them over), against the per-sample path
    (Winograd's, which would take the 16-channel one, and the direct path, which would take the
    3-channel one, kept out)."""
    for shape, cout in (((8, 3, 32, 32), 16), ((8, 16, 16, 16), 32), ((4, 6, 40, 8), 4)):
        op = make_conv(shape, out_channels=cout, kernel=3, padding=1)
        monkeypatch.setattr(conv_module, "_WINOGRAD_MIN_BLOCKS", 10**9)
        monkeypatch.setattr(conv_module, "_DIRECT_MAX_CHANNELS", 0)
        assert op._path(np, Rect.from_shape(op.tile_shape)) == "batched"
        x, weights, g = conv_data(op)
        n = shape[0]
        for tile in (Rect.from_shape(op.tile_shape), Rect((n // 4, 0, 0, 0), (3 * n // 4, cout, *op.tile_shape[2:])),
                     Rect((0, cout // 2, 0, 0), (n, cout, *op.tile_shape[2:])),
                     Rect((1, 0, 3, 2), (3, cout, op.tile_shape[2] - 1, op.tile_shape[3]))):
            rects = op.input_rects(tile)
            xs = [x[rects[0].slices()]]
            ws = {k: v[r.slices()] for k, v in weights.items() for r in [op.tile_weight_rects(tile)[k]]}
            gs = [g[tile.slices()]]
            results = []
            for max_pixels in (10**9, 0):
                with pytest.MonkeyPatch.context() as patch:
                    patch.setattr(conv_module, "_BATCHED_MAX_PIXELS", max_pixels)
                    outs, saved = op.forward(np, tile, xs, rects, ws)
                    results.append((outs[0], *op.backward(np, tile, xs, rects, ws, outs, gs, saved)))
            (y1, (dx1,), gw1), (y2, (dx2,), gw2) = results
            np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(dx1, dx2, rtol=1e-5, atol=1e-5)
            for k in gw1:
                np.testing.assert_allclose(gw1[k], gw2[k], rtol=1e-4, atol=1e-4)


def test_conv_input_rects_include_the_halo_clipped_to_the_input():
    op = make_conv((4, 8, 10, 10), out_channels=6, kernel=3, stride=1, padding=1)
    # output rows 5..10 read input rows 4..11, clipped to 4..10; all input channels
    assert op.input_rects(Rect((0, 2, 5, 0), (2, 4, 10, 4))) == [Rect((0, 0, 4, 0), (2, 8, 10, 5))]
    assert op.weight_rects(Rect((0, 2, 5, 0), (2, 4, 10, 4))) == {
        "weight": Rect((2, 0, 0, 0), (4, 8, 3, 3)), "bias": Rect((2,), (4,))}
    strided = make_conv((1, 2, 11, 11), out_channels=2, kernel=3, stride=2, padding=0)
    assert strided.input_rects(Rect((0, 0, 1, 2), (1, 2, 3, 4)))[0] == Rect((0, 0, 2, 4), (1, 2, 7, 9))
    # the last tile also takes the trailing row and column that no window reaches
    uneven = make_conv((1, 1, 9, 9), out_channels=1, kernel=2, stride=2)
    assert uneven.input_rects(Rect((0, 0, 2, 0), (1, 1, 4, 2)))[0] == Rect((0, 0, 4, 0), (1, 1, 9, 4))
    assert uneven.input_rects(Rect.from_shape(uneven.tile_shape))[0] == Rect.from_shape((1, 1, 9, 9))


def test_conv_group_tiles_read_only_their_groups():
    op = make_conv((2, 6, 5, 5), out_channels=9, kernel=3, padding=1, groups=3)
    # 3 out channels and 2 in channels per group; channels 4..7 belong to groups 1 and 2
    assert op.input_rects(Rect((0, 4, 0, 0), (2, 7, 5, 5)))[0] == Rect((0, 2, 0, 0), (2, 6, 5, 5))
    assert op.input_rects(Rect((0, 0, 0, 0), (2, 3, 5, 5)))[0] == Rect((0, 0, 0, 0), (2, 2, 5, 5))
    assert op.weight_rects(Rect((0, 4, 0, 0), (2, 7, 5, 5)))["weight"] == Rect((4, 0, 0, 0), (7, 2, 3, 3))


def test_conv_tile_that_reads_only_padding():
    op = make_conv((1, 1, 4, 4), out_channels=1, kernel=2, stride=1, padding=3)
    tile = Rect((0, 0, 0, 0), (1, 1, 2, 9))
    (rect,) = op.input_rects(tile)
    assert rect.shape[2] == 0
    x, weights, g = conv_data(op)
    (y,), _ = op.forward(np, tile, [x[rect.slices()]], [rect], weights)
    np.testing.assert_allclose(y, np.broadcast_to(weights["bias"][:, None, None], tile.shape[1:])[None])


def test_conv_split_dims_flops_weights_and_attrs():
    op = make_conv((8, 6, 20, 20), out_channels=12, kernel=(3, 5), stride=2, padding=(1, 2), groups=3)
    assert [(s.dim, s.kind) for s in op.split_dims()] == [(0, SAMPLE), (1, PARAMETER), (2, ATTRIBUTE), (3, ATTRIBUTE)]
    assert op.outputs[0].shape == (8, 12, 10, 10)
    assert op.weight_shapes() == {"weight": (12, 2, 3, 5), "bias": (12,)}
    tile = Rect((0, 4, 0, 0), (4, 8, 5, 10))
    assert op.flops(tile) == 2 * 4 * 4 * 5 * 10 * 2 * 3 * 5
    assert op.bytes_moved(tile) > 0
    assert op.attrs() == dict(out_channels=12, kernel=(3, 5), stride=(2, 2), padding=(1, 2), groups=3, use_bias=True)
    assert Conv2d("conv", op.inputs, **op.attrs()).outputs == op.outputs
    assert OP_REGISTRY["conv2d"] is Conv2d


def test_conv_init_is_pytorch_default():
    op = make_conv((2, 4, 8, 8), out_channels=16, kernel=3, groups=2)
    weights = op.init_weights(np.random.default_rng(0))
    bound = 1 / np.sqrt(2 * 3 * 3)
    assert weights["weight"].dtype == np.float32 and weights["weight"].shape == (16, 2, 3, 3)
    assert np.abs(weights["weight"]).max() <= bound and np.abs(weights["weight"]).max() > 0.8 * bound
    assert np.abs(weights["bias"]).max() <= bound


def test_conv_bad_inputs_name_the_op():
    with pytest.raises(ShapeError, match=r"conv2d 'conv': kernel \(7, 7\) is bigger than the padded input \(6, 6\)"):
        make_conv((1, 3, 4, 4), out_channels=2, kernel=7, padding=1)
    with pytest.raises(ShapeError,
                       match=r"conv2d 'conv': in_channels 3 and out_channels 4 must both be divisible by groups 2"):
        make_conv((1, 3, 8, 8), out_channels=4, kernel=3, groups=2)
    with pytest.raises(ShapeError, match=r"conv2d 'conv': expects an NCHW input \(4 dims\), got shape \(3, 8, 8\)"):
        make_conv((3, 8, 8), out_channels=4, kernel=3)
    with pytest.raises(ShapeError, match=r"conv2d 'conv': stride must be >= 1, got 0"):
        make_conv((1, 3, 8, 8), out_channels=4, kernel=3, stride=0)
    with pytest.raises(ShapeError, match=r"conv2d 'conv': kernel must be an int, got float 3.0"):
        make_conv((1, 3, 8, 8), out_channels=4, kernel=3.0)
    with pytest.raises(ShapeError, match=r"conv2d 'conv': out_channels must be an int, got float 2.5"):
        make_conv((1, 3, 8, 8), out_channels=2.5, kernel=3)
    with pytest.raises(ShapeError, match=r"conv2d 'conv': kernel must be 2 ints"):
        make_conv((1, 3, 8, 8), out_channels=4, kernel=(3, 3, 3))


def test_col2im_numba_and_array_paths_agree():
    rng = np.random.default_rng(0)
    cols = rng.standard_normal((2, 3, 3, 2, 4, 5))
    for stride in [(1, 1), (2, 3)]:
        shape = (2, 3, (4 - 1) * stride[0] + 3, (5 - 1) * stride[1] + 2)
        a, b = np.zeros(shape), np.zeros(shape)
        _col2im_cpu(cols, stride[0], stride[1], a)
        _col2im_xp(np, cols, stride, b)
        np.testing.assert_allclose(a, b, rtol=1e-14)
        assert np.isclose(a.sum(), cols.sum())


def test_gpu_code_paths_match_the_cpu_ones():
    for case in CONV_CASES[1:3] + CONV_CASES[5:7]:  # im2col and 1x1 kernels
        case = dict(case)
        op = make_conv(case.pop("shape"), "float64", **case)
        run_both_paths(op, *conv_data(op, dtype=np.float64))


@given(n=st.integers(1, 300), per_sample=st.integers(1, 3 << 20))
def test_im2col_chunks_cover_the_samples_in_as_few_even_batches_as_fit(n, per_sample):
    chunks = conv_module._chunks(np, n, per_sample)
    fit = max(1, conv_module._CHUNK_BYTES // per_sample)
    sizes = [b - a for a, b in chunks]
    assert chunks[0][0] == 0 and chunks[-1][1] == n
    assert all(b == a2 for (_, b), (a2, _) in zip(chunks, chunks[1:]))  # contiguous
    assert len(chunks) == -(-n // fit) and max(sizes) <= fit  # as few as fit
    assert sizes == sorted(sizes, reverse=True) and sizes[0] - sizes[-1] <= 1  # even, largest first
