"""Winograd along one axis (ops/winograd_1d.py) against PyTorch and the im2col path, forward and
backward, whole and on tiles, 1xr and rx1; its matrices; its float32 error against float64."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ops.conv as conv_module
from ops import winograd, winograd_1d
from ops.conv import Conv2d
from taskrt.geometry import Rect
from tests.opcheck import spec
from tests.test_winograd import check_conv_path, check_tile_against_columns, conv_arrays, torch_reference

RS = sorted(winograd_1d.POINTS)


@pytest.mark.parametrize("r", RS)
def test_shipped_matrices_compute_a_correlation(r):
    m = winograd_1d.POINTS[r][0]
    at, g, bt = winograd_1d.transforms(m, r, winograd_1d.POINTS[r][1])
    rng = np.random.default_rng(r)
    d, w = rng.standard_normal(m + r - 1), rng.standard_normal(r)
    np.testing.assert_allclose(at @ ((g @ w) * (bt @ d)), [d[i:i + r] @ w for i in range(m)], rtol=1e-12)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 4), r=st.integers(1, 5),
       points=st.lists(st.fractions(min_value=-3, max_value=3, max_denominator=4), min_size=8, max_size=8, unique=True))
def test_the_construction_holds_at_any_points(m, r, points):
    """Toom-Cook at any distinct finite points (and infinity): A^T ((G g) * (B^T d)) is the
    correlation of d with g, exactly (checked on each unit pair, in fractions' float images)."""
    n = m + r - 1
    at, g, bt = winograd_1d.transforms(m, r, points[:n - 1])
    for k in range(r):
        for j in range(n):
            y = at @ ((g @ np.eye(r)[k]) * (bt @ np.eye(n)[j]))
            np.testing.assert_allclose(y, [float(j == i + k) for i in range(m)], atol=1e-9)


def test_points_must_be_distinct_and_enough():
    with pytest.raises(ValueError, match=r"F\(2, 3\) needs 3 distinct finite points"):
        winograd_1d.transforms(2, 3, (0, 1))
    with pytest.raises(ValueError, match="distinct"):
        winograd_1d.transforms(2, 3, (0, 1, Fraction(2, 2)))


def run_1d(x, w, dy, top_left):
    """y, dx, dw from ops.winograd_1d for a 1xr or rx1 filter w, the output shape of dy."""
    along_w = w.shape[2] == 1
    r = w.shape[3] if along_w else w.shape[2]
    left = top_left[1] if along_w else top_left[0]
    turn = (lambda a: a) if along_w else (lambda a: a.swapaxes(2, 3))
    g = w.reshape(*w.shape[:2], r)
    y = np.full((x.shape[0], w.shape[0], *dy.shape[2:]), np.nan, x.dtype)   # all of it must be written
    u = winograd_1d.filter_transform(g)
    winograd_1d.forward(turn(x), r, left, turn(y), None, u)
    dx = np.full(x.shape, np.nan, x.dtype)
    du = winograd_1d.transformed_backward(turn(x), r, left, u, turn(dy), turn(dx))
    return y, dx, winograd_1d.filter_gradient(du, r).reshape(w.shape)


@settings(max_examples=40, deadline=None)
@given(r=st.sampled_from(RS), along_w=st.booleans(), n=st.integers(1, 3), c=st.integers(1, 5),
       oc=st.integers(1, 5), rows=st.integers(1, 5), length=st.integers(1, 13), before=st.integers(0, 3),
       after=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_forward_and_backward_match_torch(r, along_w, n, c, oc, rows, length, before, after, seed):
    """Any padding on either side of the axis (a tile's halo pads only some), any length (the
    last block sticks out), along the width or the height."""
    out_len = length + before + after - r + 1
    if out_len < 1:
        return
    rng = np.random.default_rng(seed)
    hw = (rows, length) if along_w else (length, rows)
    kernel = (1, r) if along_w else (r, 1)
    out_hw = (rows, out_len) if along_w else (out_len, rows)
    top_left = (0, before) if along_w else (before, 0)
    x, w = rng.standard_normal((n, c, *hw)), rng.standard_normal((oc, c, *kernel))
    dy = rng.standard_normal((n, oc, *out_hw))
    want = torch_reference(x, w, dy, top_left, out_hw)
    for name, got, ref in zip(("y", "dx", "dw"), run_1d(x, w, dy, top_left), want):
        assert got.shape == ref.shape, name
        np.testing.assert_allclose(got, ref, rtol=1e-11, atol=1e-11, err_msg=name)


@pytest.mark.parametrize("along_w", [True, False])
def test_views_and_several_chunks(monkeypatch, along_w):
    """Strided views in (as a tile's are), and sample chunks smaller than the batch (ops/winograd.py's)."""
    monkeypatch.setattr(winograd, "_CHUNK_BYTES", 1)
    monkeypatch.setattr(winograd, "_MIN_CHUNK_BLOCKS", 1)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 6, 13, 12))[1:4, 1:5, 2:, 1:-1]
    w = rng.standard_normal((6, 5, 7, 7))[1:4, 1:]
    w = w[:, :, :1, :] if along_w else w[:, :, :, :1]
    top_left, out_hw = ((0, 3) if along_w else (3, 0)), (11, 10)   # "same" padding of x [3, 4, 11, 10]
    dy = rng.standard_normal((3, 5, *out_hw))[:, 1:4]
    want = torch_reference(x, w, dy, top_left, out_hw)
    for name, got, ref in zip(("y", "dx", "dw"), run_1d(x, w, dy, top_left), want):
        np.testing.assert_allclose(got, ref, rtol=1e-11, atol=1e-11, err_msg=name)


@pytest.mark.parametrize("kernel, hw, channels", [((1, 7), (17, 17), 192), ((3, 1), (8, 8), 384)])
def test_float32_error_against_float64(kernel, hw, channels):
    """At Inception's channel counts, float32 stays within 1e-5 of the float64 result relative
    to its largest value (measured: 1-5e-6; direct float32 convolution about 1e-6; F(3, 7)
    would give 1.2-1.9e-5)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, channels, *hw))
    w = rng.uniform(-1, 1, (64, channels, *kernel)) / np.sqrt(channels * max(kernel))
    top_left = (kernel[0] // 2, kernel[1] // 2)
    dy = rng.standard_normal((2, 64, *hw))
    want = torch_reference(x, w, dy, top_left, hw)
    got = run_1d(*(a.astype(np.float32) for a in (x, w, dy)), top_left)
    for name, g, ref in zip(("y", "dx", "dw"), got, want):
        assert g.dtype == np.float32
        err = np.abs(g - ref).max() / np.abs(ref).max()
        assert err < 1e-5, f"{name}: float32 error {err:.2e} of the largest value"


@pytest.fixture(autouse=True)
def small_images_run_along_one_axis(request, monkeypatch):
    """The path on the small images and channel counts these tests use (in use it needs
    _WINOGRAD_1D_MIN_* channels, pairs and blocks), except where a test checks that choice."""
    if "real_threshold" not in request.keywords:
        for name in ("_WINOGRAD_1D_MIN_CHANNELS", "_WINOGRAD_1D_MIN_CHANNEL_PAIRS", "_WINOGRAD_1D_MIN_BLOCKS"):
            monkeypatch.setattr(conv_module, name, 1)


def conv_1d(kernel):
    def make(shape, dtype="float32", **attrs):
        op = Conv2d("conv", [spec(shape, dtype)], kernel=kernel, **attrs)
        assert op._path(np, Rect.from_shape(op.tile_shape)) == "winograd_1d", f"{op} should run along one axis"
        return op
    return make


@pytest.mark.parametrize("kernel, padding, use_bias", [((1, 7), (0, 3), True), ((7, 1), (3, 0), False),
                                                       ((1, 3), (0, 1), False), ((3, 1), (2, 0), True)])
def test_conv2d_matches_torch_and_every_tiling(kernel, padding, use_bias):
    check_conv_path(conv_1d(kernel), (2, 8, 9, 10), 6, padding, use_bias, tol=1e-4)


@settings(max_examples=15, deadline=None)
@given(kernel=st.sampled_from([(1, 7), (7, 1), (1, 3), (3, 1)]), n=st.integers(1, 2), c=st.integers(1, 6),
       oc=st.integers(1, 4), h=st.integers(7, 10), w=st.integers(7, 10), pad=st.integers(0, 3),
       lo=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_conv2d_tile_matches_the_im2col_path(kernel, n, c, oc, h, w, pad, lo, seed):
    """A tile (a corner of rows and columns, some of the out channels) along one axis and as im2col."""
    padding = (0, pad) if kernel[0] == 1 else (pad, 0)
    op = conv_1d(kernel)((n, c, h, w), "float64", out_channels=oc + 1, padding=padding)
    x, weights, g = conv_arrays(op, seed, np.float64)
    check_tile_against_columns(op, x, weights, g, lo)


@pytest.mark.real_threshold
def test_conv2d_along_one_axis_only_where_it_pays():
    def path(shape, oc, kernel=(1, 7), padding=(0, 3), tile_parts=None, **attrs):
        op = Conv2d("c", [spec(shape)], out_channels=oc, kernel=kernel, padding=padding, **attrs)
        hi = list(op.tile_shape)
        for d, parts in (tile_parts or {}).items():
            hi[d] //= parts
        return op._path(np, Rect.make([0] * 4, hi))
    assert path((2, 192, 17, 17), 192) == "winograd_1d"          # 2 x 17 rows x 9 blocks = 306
    assert path((2, 192, 17, 17), 192, (7, 1), (3, 0)) == "winograd_1d"
    assert path((16, 384, 8, 8), 384, (1, 3), (0, 1)) == "winograd_1d"
    assert path((2, 192, 17, 17), 192, tile_parts={0: 2}) == "batched"   # 153 blocks
    assert path((16, 32, 17, 17), 192) == "batched"                # 32 input channels
    assert path((16, 64, 17, 17), 16) == "batched"                 # 64 x 16 channel pairs
    assert path((16, 64, 17, 17), 32) == "winograd_1d"             # 64 x 32
    assert path((2, 192, 17, 17), 192, padding=(1, 3)) == "batched"          # padded across the axis
    assert path((2, 192, 17, 17), 192, stride=(1, 2)) == "batched"
    assert path((2, 192, 17, 17), 192, groups=2) == "batched"
    assert path((2, 192, 17, 17), 192, (1, 5), (0, 2)) == "batched"          # no F(m, 5) here
