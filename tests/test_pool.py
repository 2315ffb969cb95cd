"""Pool2d against PyTorch, finite differences, every tiling (halos included) and its kernels."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ops.base import ATTRIBUTE, OP_REGISTRY, SAMPLE, ShapeError
from ops.cpu_layout import flat_rows
from ops.pool import Pool2d, _maxpool_cpu, _maxpool_scatter_cpu, _maxpool_scatter_xp, window_argmax
from taskrt.geometry import Rect
from tests.opcheck import check_finite_differences, check_tiled, run_both_paths, run_whole, spec


def make_pool(shape, dtype="float32", **attrs):
    return Pool2d("pool", [spec(shape, dtype)], **attrs)


def torch_pool(op, xt):
    fn = F.max_pool2d if op.pool_type == "max" else F.avg_pool2d
    return fn(xt, op.kernel, op.stride, op.padding)


def pool_check(op, x, g):
    """Forward and grad input match PyTorch; every tiling reproduces them."""
    outs, (gx,), gw, _ = run_whole(op, [x], {}, grad_outputs=[g])
    assert gx.shape == x.shape  # the whole op's rect is the whole input, unread rows included
    xt = torch.tensor(x, requires_grad=True)
    yt = torch_pool(op, xt)
    yt.backward(torch.tensor(g))
    assert outs[0].shape == op.outputs[0].shape == tuple(yt.shape) and gw == {}
    np.testing.assert_allclose(outs[0], yt.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gx, xt.grad.numpy(), rtol=1e-5, atol=1e-6)
    check_tiled(op, [x], {}, [g])


@pytest.mark.parametrize("pool_type", ["max", "avg"])
@pytest.mark.parametrize("geometry", [dict(kernel=2), dict(kernel=3, stride=2, padding=1),
                                      dict(kernel=(3, 2), stride=(1, 2), padding=(1, 1)),
                                      dict(kernel=(2, 4), stride=(3, 1), padding=(0, 2))])
def test_pool_matches_torch_finite_differences_and_tiles(pool_type, geometry):
    rng = np.random.default_rng(0)
    shape = (2, 3, 9, 8)
    op = make_pool(shape, pool_type=pool_type, **geometry)
    x = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(op.outputs[0].shape).astype(np.float32)
    pool_check(op, x, g)
    check_finite_differences(op, [x], {})


def test_max_pool_ties_go_to_the_first_maximum_like_torch():
    rng = np.random.default_rng(3)
    shape = (2, 2, 7, 7)
    x = rng.integers(0, 3, shape).astype(np.float32)  # many ties in every window
    for geometry in [dict(kernel=3, stride=2, padding=1), dict(kernel=2, stride=1)]:
        op = make_pool(shape, pool_type="max", **geometry)
        pool_check(op, x, rng.standard_normal(op.outputs[0].shape).astype(np.float32))


def test_max_pool_routes_nan_windows_like_torch():
    x = np.arange(2 * 6 * 6, dtype=np.float32).reshape(1, 2, 6, 6)
    x[0, 0, 1, 1] = x[0, 0, 2, 2] = x[0, 1, 0, 3] = np.nan
    op = make_pool(x.shape, kernel=3, stride=1)
    (y,), (gx,), _, _ = run_whole(op, [x], {}, grad_outputs=[np.ones(op.outputs[0].shape, np.float32)])
    xt = torch.tensor(x, requires_grad=True)
    yt = torch_pool(op, xt)
    yt.backward(torch.ones_like(yt))
    np.testing.assert_array_equal(y, yt.detach().numpy())
    np.testing.assert_array_equal(gx, xt.grad.numpy())


def test_max_pool_numba_argmax_and_scatter_match_the_array_code():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 4, (2, 3, 9, 8)).astype(np.float64)  # ties; windows cover the input exactly
    kernel, stride = (3, 2), (2, 3)
    y, arg = np.empty((2, 3, 4, 3)), np.empty((2, 3, 4, 3), np.int32)
    _maxpool_cpu(flat_rows(x), x.shape, kernel, stride, (0, 0), y, arg)
    k = window_argmax(np, x, y, kernel, stride)  # index in the window, i*KW + j
    oh, ow = np.indices(y.shape[2:])
    np.testing.assert_array_equal(arg, (oh * stride[0] + k // kernel[1]) * x.shape[3] + ow * stride[1] + k % kernel[1])
    dy = rng.standard_normal(y.shape)
    a, b = np.zeros_like(x), np.zeros_like(x)
    _maxpool_scatter_cpu(flat_rows(dy), arg, a.reshape(2, 3, -1))
    _maxpool_scatter_xp(np, dy, k, kernel, stride, b)
    np.testing.assert_allclose(a, b, rtol=1e-14)


def special_values(kind, shape, rng):
    """NaNs among normals; +0 and -0 ties among -1s; or mostly -inf."""
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "nan":
        x[rng.random(shape) < 0.15] = np.nan
    elif kind == "signed zeros":
        x = np.where(rng.random(shape) < 0.5, np.float32(0.0), np.float32(-0.0))
        x[rng.random(shape) < 0.3] = -1
    else:
        x[rng.random(shape) < 0.8] = -np.inf
    return x


@pytest.mark.parametrize("kind", ["nan", "signed zeros", "-inf"])
@pytest.mark.parametrize("geometry", [dict(kernel=3, stride=2, padding=1),
                                      dict(kernel=(2, 3), stride=1, padding=(1, 1))])
def test_max_pool_special_values_like_torch(kind, geometry):
    """Values (signs of zeros too) and the routing of gradients, on the whole op and every tiling."""
    rng = np.random.default_rng(5)
    x = special_values(kind, (2, 3, 9, 8), rng)
    op = make_pool(x.shape, pool_type="max", **geometry)
    g = rng.standard_normal(op.outputs[0].shape).astype(np.float32)
    (y,), (gx,), _, _ = run_whole(op, [x], {}, grad_outputs=[g])
    xt = torch.tensor(x, requires_grad=True)
    yt = torch_pool(op, xt)
    yt.backward(torch.tensor(g))
    np.testing.assert_array_equal(y, yt.detach().numpy())
    np.testing.assert_array_equal(np.signbit(y), np.signbit(yt.detach().numpy()))
    np.testing.assert_allclose(gx, xt.grad.numpy(), rtol=1e-6, atol=1e-7)
    check_tiled(op, [x], {}, [g])


def test_flat_rows_views_a_tile_as_contiguous_rows():
    a = np.arange(2 * 5 * 4 * 6, dtype=np.float32).reshape(2, 5, 4, 6)
    tile = a[:, 1:4, 1:3, 2:5]
    flat, *strides = flat_rows(tile)
    assert strides == [120, 24, 6] and np.shares_memory(flat, a)
    assert flat.flags.c_contiguous and not flat.flags.writeable
    for idx in np.ndindex(tile.shape[:-1]):
        start = sum(i * s for i, s in zip(idx, strides))
        np.testing.assert_array_equal(flat[start:start + 3], tile[idx])
    out, *_ = flat_rows(a[1:], writable=True)
    assert out.flags.writeable and np.shares_memory(out, a)
    flipped, *_ = flat_rows(a[..., ::-1])  # rows that are not contiguous: a copy
    assert not np.shares_memory(flipped, a) and flipped[0] == 5
    with pytest.raises(ValueError, match=r"flat_rows: output of shape \(2, 5, 4, 3\) has strides"):
        flat_rows(a[..., ::2], writable=True)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 2), c=st.integers(1, 3), h=st.integers(2, 9), w=st.integers(2, 9),
       kh=st.integers(1, 4), kw=st.integers(1, 4), sh=st.integers(1, 3), sw=st.integers(1, 3),
       ph=st.integers(0, 2), pw=st.integers(0, 2), pool_type=st.sampled_from(["max", "avg"]),
       seed=st.integers(0, 2**16))
def test_pool_any_geometry(n, c, h, w, kh, kw, sh, sw, ph, pw, pool_type, seed):
    assume(2 * ph <= kh and 2 * pw <= kw and kh <= h + 2 * ph and kw <= w + 2 * pw)
    op = make_pool((n, c, h, w), kernel=(kh, kw), stride=(sh, sw), padding=(ph, pw), pool_type=pool_type)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    pool_check(op, x, rng.standard_normal(op.outputs[0].shape).astype(np.float32))


def test_pool_rects_split_dims_flops_and_attrs():
    assert OP_REGISTRY["pool2d"] is Pool2d
    op = make_pool((4, 6, 12, 12), kernel=3, stride=2, padding=1)
    assert op.outputs[0].shape == (4, 6, 6, 6)
    assert op.attrs() == dict(kernel=(3, 3), stride=(2, 2), padding=(1, 1), pool_type="max")
    assert [(s.dim, s.kind) for s in op.split_dims()] == [(0, SAMPLE), (1, ATTRIBUTE), (2, ATTRIBUTE), (3, ATTRIBUTE)]
    assert op.weight_shapes() == {}
    tile = Rect((1, 2, 3, 0), (2, 4, 6, 3))
    # output rows 3..6 read rows 5..12 (clipped to 12); columns 0..3 read -1..6, clipped to 0..6
    assert op.input_rects(tile) == [Rect((1, 2, 5, 0), (2, 4, 12, 6))]
    assert op.flops(tile) == tile.volume * 9


def test_pool_bad_inputs_name_the_op():
    with pytest.raises(ShapeError, match=r"pool2d 'pool': padding \(2, 2\) must be at most half of kernel \(3, 3\)"):
        make_pool((1, 1, 8, 8), kernel=3, padding=2)
    with pytest.raises(ShapeError, match=r"pool2d 'pool': unknown pool_type 'min'"):
        make_pool((1, 1, 8, 8), kernel=2, pool_type="min")
    with pytest.raises(ShapeError, match=r"pool2d 'pool': kernel \(5, 5\) is bigger than the padded input \(4, 4\)"):
        make_pool((1, 1, 4, 4), kernel=5)
    with pytest.raises(ShapeError, match=r"pool2d 'pool': expects an NCHW input"):
        make_pool((8, 8), kernel=2)


def test_pool_gpu_code_paths_match_the_cpu_ones():
    rng = np.random.default_rng(0)
    for pool_type in ("max", "avg"):
        op = make_pool((2, 3, 9, 8), "float64", kernel=3, stride=2, padding=1, pool_type=pool_type)
        x = rng.integers(0, 3, (2, 3, 9, 8)).astype(np.float64)  # with ties
        run_both_paths(op, x, {}, rng.standard_normal(op.outputs[0].shape))
