"""Strided convolutions as Winograd F(7, 2) over phase rows (ops/winograd_strided.py) against
PyTorch and the im2col path, forward and backward, whole and on tiles; its written-out transforms
against the construction's matrices; its float32 error against float64; where Conv2d takes it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import ops.conv as conv_module
from ops import winograd_strided as ws
from ops.conv import Conv2d
from taskrt.geometry import Rect
from tests.opcheck import spec
from tests.test_winograd import check_conv_path, check_tile_against_columns, conv_arrays

#: (kernel width, width stride) pairs whose window columns span two shifts of a phase
WIDTHS = [(3, 2), (4, 3), (5, 4)]


def test_written_out_transforms_are_the_matrices():
    """_bt is B^T and _b is B, column by column, exactly (in float64)."""
    k = ws._consts(np.float64)
    for s in range(ws.N):
        unit = [float(i == s) for i in range(ws.N)]
        np.testing.assert_array_equal(ws._bt(k, *unit), ws.BT[:, s])
        np.testing.assert_array_equal(ws._b(k, *unit), ws.BT.T[:, s])


def test_the_matrices_compute_a_correlation():
    rng = np.random.default_rng(0)
    d, g = rng.standard_normal(ws.N), rng.standard_normal(ws.R)
    np.testing.assert_allclose(ws.AT @ ((ws.G @ g) * (ws.BT @ d)), [d[i:i + ws.R] @ g for i in range(ws.M)],
                               rtol=1e-12)


@pytest.mark.parametrize("kernel, stride, ok", [((3, 3), (2, 2), True), ((1, 3), (1, 2), True),
                                                ((3, 4), (1, 3), True), ((5, 5), (4, 4), True),
                                                ((3, 3), (1, 1), False), ((3, 3), (3, 3), False),
                                                ((2, 2), (2, 2), False), ((5, 5), (2, 2), False),
                                                ((3, 4), (2, 2), False)])
def test_supported_kernels_and_strides(kernel, stride, ok):
    """Window columns over two shifts of a phase, whatever a tile's left padding (a 4-wide window
    at stride 2 spans two shifts at padding 0 but three at padding 1)."""
    assert ws.supports(kernel, stride) is ok


def reference(x, w, dy, stride, pads, out_hw):
    """y, dx, dw of the convolution of x padded by pads ((top, bottom), (left, right)), cut to
    out_hw, from PyTorch in float64."""
    (top, bottom), (left, right) = pads
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    yt = F.conv2d(F.pad(xt, (left, right, top, bottom)), wt, stride=stride)
    assert tuple(yt.shape[2:]) == out_hw
    yt.backward(torch.tensor(dy, dtype=torch.float64))
    return yt.detach().numpy(), xt.grad.numpy(), wt.grad.numpy()


def run_strided(x, w, dy, stride, top_left, bias=None):
    """y, dx, dw from ops.winograd_strided, the output shape of dy."""
    g = ws.stacked_filters(w, stride, top_left[1])
    y = np.full((x.shape[0], w.shape[0], *dy.shape[2:]), np.nan, x.dtype)   # all of it must be written
    ws.forward(x, w.shape[2:], stride, top_left, y, bias, ws.filter_transform(g, channels_last=True))
    dx = np.full(x.shape, np.nan, x.dtype)
    du = ws.transformed_backward(x, w.shape[2:], stride, top_left, ws.filter_transform(g), dy, dx)
    return y, dx, ws.filters_of_stacked(ws.filter_gradient(du), w.shape, stride, top_left[1])


@settings(max_examples=40, deadline=None)
@given(width=st.sampled_from(WIDTHS), kh=st.integers(1, 3), sh=st.integers(1, 3), n=st.integers(1, 3),
       c=st.integers(1, 4), oc=st.integers(1, 4), h=st.integers(1, 12), w=st.integers(1, 30),
       top=st.integers(0, 2), bottom=st.integers(0, 2), left=st.integers(0, 4), right=st.integers(0, 4),
       seed=st.integers(0, 2**16))
def test_forward_and_backward_match_torch(width, kh, sh, n, c, oc, h, w, top, bottom, left, right, seed):
    """Any padding on each side (a tile's halo pads only some), rows and columns that read only
    padding, output rows shorter and longer than a block (the last one sticks out)."""
    kw, sw = width
    oh, ow = (h + top + bottom - kh) // sh + 1, (w + left + right - kw) // sw + 1
    if oh < 1 or ow < 1:
        return
    rng = np.random.default_rng(seed)
    x, wt = rng.standard_normal((n, c, h, w)), rng.standard_normal((oc, c, kh, kw))
    dy = rng.standard_normal((n, oc, oh, ow))
    want = reference(x, wt, dy, (sh, sw), ((top, bottom), (left, right)), (oh, ow))
    for name, got, ref in zip(("y", "dx", "dw"), run_strided(x, wt, dy, (sh, sw), (top, left)), want):
        assert got.shape == ref.shape, name
        np.testing.assert_allclose(got, ref, rtol=1e-11, atol=1e-11, err_msg=name)


def test_views_bias_and_several_chunks(monkeypatch):
    """Strided views in (as a tile's are), a bias, sample chunks smaller than the batch, and a
    backward that writes no input gradient."""
    monkeypatch.setattr(ws, "_CHUNK_BYTES", 1)
    monkeypatch.setattr(ws, "_MIN_ROWS", 1)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 6, 17, 33))[1:4, 1:5, 2:, 1:-1]     # [3, 4, 15, 31]
    w = rng.standard_normal((6, 5, 3, 3))[1:4, 1:]
    dy = rng.standard_normal((3, 5, 8, 16))[:, 1:4]
    bias = rng.standard_normal(3)
    y_ref, dx_ref, dw_ref = reference(x, w, dy, (2, 2), ((1, 1), (1, 1)), (8, 16))
    y, dx, dw = run_strided(x, w, dy, (2, 2), (1, 1), bias)
    np.testing.assert_allclose(y, y_ref + bias[:, None, None], rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-11, atol=1e-11)
    # no input gradient wanted (a model's input): the same weight gradient
    u = ws.filter_transform(ws.stacked_filters(w, (2, 2), 1))
    du = ws.transformed_backward(x, (3, 3), (2, 2), (1, 1), u, dy, None)
    np.testing.assert_allclose(ws.filters_of_stacked(ws.filter_gradient(du), w.shape, (2, 2), 1), dw_ref,
                               rtol=1e-11, atol=1e-11)


def test_float32_error_against_float64():
    """At ResNet's channel counts, float32 stays within 1e-5 of the float64 result relative to
    its largest value (measured: 1-4e-6, as the im2col path's)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 128, 28, 28))
    w = rng.uniform(-1, 1, (64, 128, 3, 3)) / np.sqrt(128 * 9)
    dy = rng.standard_normal((2, 64, 14, 14))
    want = reference(x, w, dy, (2, 2), ((1, 1), (1, 1)), (14, 14))
    got = run_strided(*(a.astype(np.float32) for a in (x, w, dy)), (2, 2), (1, 1))
    for name, g, ref in zip(("y", "dx", "dw"), got, want):
        assert g.dtype == np.float32
        err = np.abs(g - ref).max() / np.abs(ref).max()
        assert err < 1e-5, f"{name}: float32 error {err:.2e} of the largest value"


@pytest.fixture(autouse=True)
def small_images_run_strided(request, monkeypatch):
    """The path on the small images and channel counts these tests use (in use it needs
    _STRIDED_MIN_* channel pairs and blocks, and full blocks), except where a test checks that choice."""
    if "real_threshold" not in request.keywords:
        monkeypatch.setattr(conv_module, "_STRIDED_MIN_CHANNEL_PAIRS", 1)
        monkeypatch.setattr(conv_module, "_STRIDED_MIN_BLOCKS", 1)
        monkeypatch.setattr(conv_module, "_STRIDED_MIN_USE", 0)


def strided_conv(shape, dtype="float32", **attrs):
    op = Conv2d("conv", [spec(shape, dtype)], kernel=3, stride=2, **attrs)
    assert op._path(np, Rect.from_shape(op.tile_shape)) == "winograd_strided", f"{op} should run strided"
    return op


@pytest.mark.parametrize("padding, use_bias", [(1, True), (0, False), ((1, 0), True)])
def test_conv2d_matches_torch_and_every_tiling(padding, use_bias):
    check_conv_path(strided_conv, (2, 8, 13, 31), 6, padding, use_bias, tol=1e-4)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 2), c=st.integers(1, 6), oc=st.integers(1, 4), h=st.integers(5, 12),
       w=st.integers(5, 30), pad=st.integers(0, 2), lo=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_conv2d_tile_matches_the_im2col_path(n, c, oc, h, w, pad, lo, seed):
    """A tile (a corner of rows and columns, some of the out channels) strided and as im2col."""
    op = strided_conv((n, c, h, w), "float64", out_channels=oc + 1, padding=pad)
    x, weights, g = conv_arrays(op, seed, np.float64)
    check_tile_against_columns(op, x, weights, g, lo)


@pytest.mark.real_threshold
def test_conv2d_strided_only_where_it_pays():
    def path(shape, oc, tile_parts=None, **attrs):
        op = Conv2d("c", [spec(shape)], out_channels=oc, kernel=attrs.pop("kernel", 3),
                    stride=attrs.pop("stride", 2), padding=attrs.pop("padding", 1), **attrs)
        hi = list(op.tile_shape)
        for d, parts in (tile_parts or {}).items():
            hi[d] //= parts
        return op._path(np, Rect.make([0] * 4, hi))
    assert path((8, 128, 56, 56), 128) == "winograd_strided"        # 8 x 28 rows x 4 blocks = 896
    assert path((32, 128, 56, 56), 128, tile_parts={1: 2}) == "winograd_strided"   # 128 x 64 pairs
    assert path((16, 256, 28, 28), 256) == "winograd_strided"       # 16 x 14 x 2 = 448 blocks
    assert path((4, 256, 28, 28), 256) == "batched"                 # 112 blocks
    assert path((16, 64, 56, 56), 64) == "batched"                  # 64 x 64 pairs
    assert path((32, 512, 14, 14), 512) == "batched"                # 7 outputs a row: 224 blocks
    assert path((32, 288, 35, 35), 384, padding=0) == "batched"     # 17 outputs in 3 blocks of 7
    assert path((8, 128, 56, 56), 128, groups=2) == "batched"
    assert path((8, 128, 56, 56), 128, kernel=5, padding=2) == "batched"     # three shifts of a phase
