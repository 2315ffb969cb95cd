"""Direct convolution (ops/direct_conv.py) against PyTorch in float64 and the im2col path,
forward and backward, whole and on tiles; where Conv2d chooses it."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import ops.conv as conv_module
from ops import direct_conv
from ops.conv import Conv2d
from taskrt.geometry import Rect
from tests.opcheck import spec
from tests.test_winograd import (assert_one_version_per_float, check_conv_path, check_strided_views,
                                 check_tile_against_columns, conv_arrays, torch_reference)


def run_direct(x, w, dy, top_left, bias=None, want_dx=True):
    """y, dx (None unless want_dx), dw from ops.direct_conv for the output shape of dy (the samples
    in parts, one per core, as Conv2d runs them)."""
    y = np.full((x.shape[0], w.shape[0], *dy.shape[2:]), np.nan, x.dtype)   # forward must write all of it
    direct_conv.forward_in_parts(x, w, np.zeros(w.shape[0], x.dtype) if bias is None else bias, *top_left, y)
    dx = np.full(x.shape, np.nan, x.dtype) if want_dx else None
    dw = direct_conv.backward_in_parts(x, w, dy, *top_left, dx)
    return y, dx if want_dx else None, dw


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 3), c=st.integers(1, 4), oc=st.integers(1, 5), h=st.integers(1, 11),
       w=st.integers(1, 11), k=st.sampled_from([(3, 3), (3, 3), (1, 3), (2, 2), (5, 3)]),
       top=st.integers(0, 2), left=st.integers(0, 2), bottom=st.integers(0, 2), right=st.integers(0, 2),
       seed=st.integers(0, 2**16))
def test_forward_and_backward_match_torch(n, c, oc, h, w, k, top, left, bottom, right, seed):
    """Any padding on each side (a tile's halo pads only some), odd sizes, odd and even output
    channel counts (pairs and one left over), 3x3 and other windows (the generic runs)."""
    kh, kw = k
    oh, ow = h + top + bottom - kh + 1, w + left + right - kw + 1
    if oh < 1 or ow < 1 or top >= kh or left >= kw:
        return
    rng = np.random.default_rng(seed)
    x, wt = rng.standard_normal((n, c, h, w)), rng.standard_normal((oc, c, kh, kw))
    dy, bias = rng.standard_normal((n, oc, oh, ow)), rng.standard_normal(oc)
    y_ref, dx_ref, dw_ref = torch_reference(x, wt, dy, (top, left), (oh, ow))
    y, dx, dw = run_direct(x, wt, dy, (top, left), bias)
    np.testing.assert_allclose(y, y_ref + bias[:, None, None], rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-11, atol=1e-11)
    _, no_dx, dw_alone = run_direct(x, wt, dy, (top, left), bias, want_dx=False)
    assert no_dx is None
    np.testing.assert_allclose(dw_alone, dw_ref, rtol=1e-11, atol=1e-11)


def test_views_in():
    """Strided views of inputs, weights and output gradients (as a tile's are)."""
    check_strided_views(run_direct)


def test_views_out_and_read_only_in():
    """y and dx written into strided views (a tile of the output's channels, as a cout split
    hands over), the arrays around them untouched; read-only inputs; and still one compiled
    version per float type of each kernel (ops/per_float.py)."""
    rng = np.random.default_rng(5)
    x, wt, dy = rng.standard_normal((3, 3, 9, 8)), rng.standard_normal((4, 3, 3, 3)), rng.standard_normal((3, 4, 9, 8))
    for a in (x, wt, dy):
        a.flags.writeable = False
    y_ref, dx_ref, dw_ref = torch_reference(x, wt, dy, (1, 1), (9, 8))
    y_around, dx_around = np.full((3, 6, 9, 8), 7.0), np.full((3, 5, 9, 8), 7.0)
    direct_conv.forward_in_parts(x, wt, np.zeros(4), 1, 1, y_around[:, 1:5])
    dw = direct_conv.backward_in_parts(x, wt, dy, 1, 1, dx_around[:, 2:])
    np.testing.assert_allclose(y_around[:, 1:5], y_ref, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(dx_around[:, 2:], dx_ref, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-11, atol=1e-11)
    assert (y_around[:, [0, 5]] == 7).all() and (dx_around[:, :2] == 7).all()
    for kernel in (direct_conv.forward, direct_conv.backward, direct_conv._forward_parts, direct_conv._backward_parts):
        assert_one_version_per_float(kernel, np.float64)


def test_float32_error_against_float64():
    """A first layer in float32 stays within 1e-6 of float64 relative to the largest value."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3, 32, 32))
    wt = rng.uniform(-1, 1, (16, 3, 3, 3)) / np.sqrt(27)
    dy = rng.standard_normal((4, 16, 32, 32))
    ref = torch_reference(x, wt, dy, (1, 1), (32, 32))
    got = run_direct(*(a.astype(np.float32) for a in (x, wt, dy)), (1, 1))
    for name, a, want in zip(("y", "dx", "dw"), got, ref):
        assert a.dtype == np.float32
        err = np.abs(a - want).max() / np.abs(want).max()
        assert err < 1e-6, f"{name}: float32 error {err:.2e} of the largest value"


def direct_op(shape, dtype="float32", **attrs):
    op = Conv2d("conv", [spec(shape, dtype)], kernel=attrs.pop("kernel", 3), **attrs)
    assert op._path(np, Rect.from_shape(op.tile_shape)) == "direct", f"{op} should run as direct convolution"
    return op


@pytest.mark.parametrize("padding, use_bias", [(1, True), (0, False), ((2, 1), True)])
def test_conv2d_direct_matches_torch_and_every_tiling(padding, use_bias):
    check_conv_path(direct_op, (3, 3, 9, 10), 5, padding, use_bias, tol=1e-5)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 2), c=st.integers(1, 4), oc=st.integers(1, 4), h=st.integers(3, 9),
       w=st.integers(3, 9), ph=st.integers(0, 2), pw=st.integers(0, 2), lo=st.integers(0, 3),
       seed=st.integers(0, 2**16))
def test_conv2d_direct_tile_matches_the_im2col_path(n, c, oc, h, w, ph, pw, lo, seed):
    """A tile (a corner of rows and columns, some of the out channels) as direct and as im2col."""
    op = direct_op((n, c, h, w), "float64", out_channels=oc + 1, padding=(ph, pw))
    x, weights, g = conv_arrays(op, seed, np.float64)
    check_tile_against_columns(op, x, weights, g, lo)


def test_conv2d_runs_direct_only_for_a_first_layer():
    def path(c, **attrs):
        op = Conv2d("c", [spec((2, c, 8, 8))], out_channels=16, kernel=attrs.pop("kernel", 3), **attrs)
        return op._path(np, Rect.from_shape(op.tile_shape))
    most = conv_module._DIRECT_MAX_CHANNELS
    assert path(most, padding=1) == "direct" and path(1, padding=1) == "direct"
    assert path(most + 1, padding=1) != "direct"
    assert path(3, kernel=5, padding=2) != "direct"      # the 3x3 runs are what make it pay
    assert path(3, padding=1, stride=2) != "direct"
    op = Conv2d("g", [spec((2, 4, 8, 8))], out_channels=4, kernel=3, padding=1, groups=2)
    assert op._path(np, Rect.from_shape(op.tile_shape)) != "direct"


def test_conv2d_direct_takes_read_only_inputs_and_may_skip_the_input_gradient():
    """As the runtime calls it on a model's first layer: read-only input views, no input gradient."""
    op = direct_op((2, 3, 8, 8), out_channels=4, padding=1)
    rng = np.random.default_rng(2)
    weights = op.init_weights(rng)
    x = rng.standard_normal(op.inputs[0].shape).astype(np.float32)
    g = rng.standard_normal(op.outputs[0].shape).astype(np.float32)
    x.setflags(write=False)
    tile = Rect.from_shape(op.tile_shape)
    rects = op.input_rects(tile)
    (y,), saved = op.forward(np, tile, [x], rects, weights)
    (dx,), grads = op.backward(np, tile, [x], rects, weights, [y], [g], saved, out=[False])
    assert dx is None
    xt = torch.tensor(x.copy())
    wt = torch.tensor(weights["weight"], requires_grad=True)
    F.conv2d(xt, wt, torch.tensor(weights["bias"]), padding=1).backward(torch.tensor(g))
    np.testing.assert_allclose(grads["weight"], wt.grad.numpy(), rtol=1e-5, atol=1e-4)
