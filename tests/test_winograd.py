"""Winograd F(4x4, 3x3) (ops/winograd.py) against PyTorch and the im2col path, forward and
backward, whole and on tiles; its float32 error against a float64 reference; ops/cpu_pool."""
from __future__ import annotations

import contextlib

import numba
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from threadpoolctl import threadpool_limits

import ops.conv as conv_module
from ops import blas, cpu_pool, direct_conv, winograd
from ops.conv import Conv2d
from ops.cpu_threads import batch_parts
from taskrt.geometry import Rect
from tests.opcheck import check_tiled, run_whole, spec


def _unit_rows(fn, n):
    """The matrix of a written-out 1-D transform: fn applied to each unit vector, as columns."""
    k = winograd._consts(np.float64)
    return np.array([fn(*np.eye(n)[i], k) for i in range(n)]).T


def test_written_out_transforms_are_the_matrices():
    np.testing.assert_array_equal(_unit_rows(winograd._bt.py_func, 6), winograd.BT)
    np.testing.assert_array_equal(_unit_rows(winograd._b.py_func, 6), winograd.BT.T)
    np.testing.assert_array_equal(_unit_rows(winograd._at.py_func, 6), winograd.AT)
    np.testing.assert_array_equal(_unit_rows(winograd._a.py_func, 4), winograd.AT.T)


def test_matrices_compute_a_correlation():
    rng = np.random.default_rng(0)
    d, g = rng.standard_normal(6), rng.standard_normal(3)
    y = winograd.AT @ ((winograd.G @ g) * (winograd.BT @ d))
    np.testing.assert_allclose(y, [d[i:i + 3] @ g for i in range(4)], rtol=1e-13)


def run_winograd(x, w, dy, top_left):
    """y, dx, dw from ops.winograd for the output shape of dy."""
    y = np.empty((x.shape[0], w.shape[0], *dy.shape[2:]), x.dtype)
    winograd.forward(x, w, top_left, y)
    dx = np.full(x.shape, np.nan, x.dtype)  # backward must write all of it
    return y, dx, winograd.backward(x, w, dy, top_left, dx)


def torch_reference(x, w, dy, top_left, out_hw):
    """y, dx, dw of the stride-1 correlation of x padded by top_left (and with zeros past its end,
    as far as the outputs out_hw reach) with the windows w, from PyTorch in float64."""
    (top, left), (oh, ow) = top_left, out_hw
    kh, kw = w.shape[2:]
    bottom = max(0, oh + kh - 1 - top - x.shape[2])
    right = max(0, ow + kw - 1 - left - x.shape[3])
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    yt = F.conv2d(F.pad(xt, (left, right, top, bottom)), wt)[:, :, :oh, :ow]
    yt.backward(torch.tensor(dy, dtype=torch.float64))
    return yt.detach().numpy(), xt.grad.numpy(), wt.grad.numpy()


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 3), c=st.integers(1, 5), oc=st.integers(1, 5), h=st.integers(1, 11),
       w=st.integers(1, 11), top=st.integers(0, 2), left=st.integers(0, 2), bottom=st.integers(0, 2),
       right=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_forward_and_backward_match_torch(n, c, oc, h, w, top, left, bottom, right, seed):
    """Any padding, on each side (a tile's halo pads only some), odd sizes (blocks stick out)."""
    oh, ow = h + top + bottom - 2, w + left + right - 2
    if oh < 1 or ow < 1:
        return
    rng = np.random.default_rng(seed)
    x, wt = rng.standard_normal((n, c, h, w)), rng.standard_normal((oc, c, 3, 3))
    dy = rng.standard_normal((n, oc, oh, ow))
    y_ref, dx_ref, dw_ref = torch_reference(x, wt, dy, (top, left), (oh, ow))
    y, dx, dw = run_winograd(x, wt, dy, (top, left))
    assert y.shape == y_ref.shape and dx.shape == x.shape and dw.shape == wt.shape
    np.testing.assert_allclose(y, y_ref, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-11, atol=1e-11)


def test_views_and_several_chunks(monkeypatch):
    """Strided views in (as a tile's are), and sample chunks smaller than the batch."""
    monkeypatch.setattr(winograd, "_CHUNK_BYTES", 1)
    monkeypatch.setattr(winograd, "_MIN_CHUNK_BLOCKS", 1)
    check_strided_views(run_winograd)


def check_strided_views(run):
    """run(x, w, dy, top_left) -> (y, dx, dw) on strided views of inputs, weights and output
    gradients (as a tile's are) against torch_reference."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 6, 13, 12))[1:4, 1:5, 2:, 1:-1]
    wt = rng.standard_normal((6, 5, 3, 3))[1:4, 1:]
    dy = rng.standard_normal((3, 5, 11, 10))[:, 1:4]
    y_ref, dx_ref, dw_ref = torch_reference(x, wt, dy, (0, 1), (11, 10))
    y, dx, dw = run(x, wt, dy, (0, 1))
    np.testing.assert_allclose(y, y_ref, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-11, atol=1e-11)


def test_float32_error_against_float64():
    """At ResNet-like channel counts, float32 Winograd stays within 1e-5 of the float64 result
    relative to its largest value (direct float32 convolution: about 1e-6)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 64, 20, 20))
    wt = rng.uniform(-1, 1, (64, 64, 3, 3)) / np.sqrt(64 * 9)
    dy = rng.standard_normal((2, 64, 20, 20))
    ref = torch_reference(x, wt, dy, (1, 1), (20, 20))
    f32 = [a.astype(np.float32) for a in (x, wt, dy)]
    y, dx, dw = run_winograd(*f32, (1, 1))
    for name, got, want in zip(("y", "dx", "dw"), (y, dx, dw), ref):
        assert got.dtype == np.float32
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 1e-5, f"{name}: float32 error {err:.2e} of the largest value"


@pytest.fixture(autouse=True)
def small_images_run_as_winograd(request, monkeypatch):
    """The Winograd path on the small images and channel counts these tests use (in use it
    starts at _WINOGRAD_MIN_BLOCKS blocks and _WINOGRAD_MIN_CHANNEL_PAIRS), except where a test
    checks that choice itself."""
    if "real_threshold" not in request.keywords:
        monkeypatch.setattr(conv_module, "_WINOGRAD_MIN_BLOCKS", 1)
        monkeypatch.setattr(conv_module, "_WINOGRAD_MIN_CHANNEL_PAIRS", 1)


def winograd_conv(shape, dtype="float32", **attrs):
    op = Conv2d("conv", [spec(shape, dtype)], kernel=3, **attrs)
    assert op._winograd(np, Rect.from_shape(op.tile_shape)), f"{op} should run as Winograd"
    return op


def conv_arrays(op, seed, dtype):
    rng = np.random.default_rng(seed)
    weights = {k: v.astype(dtype) for k, v in op.init_weights(rng).items()}
    x = rng.standard_normal(op.inputs[0].shape).astype(dtype)
    return x, weights, rng.standard_normal(op.outputs[0].shape).astype(dtype)


@pytest.mark.parametrize("padding, use_bias", [(1, True), (0, False), ((2, 1), True)])
def test_conv2d_winograd_matches_torch_and_every_tiling(padding, use_bias):
    check_conv_path(winograd_conv, (2, 8, 9, 10), 6, padding, use_bias, tol=1e-4)


def check_conv_path(make, shape, out_channels, padding, use_bias, tol):
    """The conv `make(shape, dtype, ...)` builds (asserting the path it takes) against PyTorch in
    float32 (to `tol`; the weight gradients sum more, to 10 * tol absolute), and every tiling of
    it against the whole op in float64."""
    op = make(shape, out_channels=out_channels, padding=padding, use_bias=use_bias)
    x, weights, g = conv_arrays(op, 0, np.float32)
    (y,), (gx,), gw, _ = run_whole(op, [x], weights, grad_outputs=[g])
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(weights["weight"], requires_grad=True)
    bt = torch.tensor(weights["bias"], requires_grad=True) if use_bias else None
    yt = F.conv2d(xt, wt, bt, stride=op.stride, padding=op.padding)
    yt.backward(torch.tensor(g))
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(gx, xt.grad.numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(gw["weight"], wt.grad.numpy(), rtol=tol, atol=10 * tol)
    if use_bias:
        np.testing.assert_allclose(gw["bias"], bt.grad.numpy(), rtol=tol, atol=10 * tol)
    op64 = make(shape, "float64", out_channels=out_channels, padding=padding, use_bias=use_bias)
    x64, w64, g64 = conv_arrays(op64, 1, np.float64)
    check_tiled(op64, [x64], w64, [g64], rtol=1e-10, atol=1e-12)


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 2), c=st.integers(8, 10), oc=st.integers(1, 4), h=st.integers(3, 9),
       w=st.integers(3, 9), ph=st.integers(0, 2), pw=st.integers(0, 2), lo=st.integers(0, 3),
       seed=st.integers(0, 2**16))
def test_conv2d_winograd_tile_matches_the_im2col_path(n, c, oc, h, w, ph, pw, lo, seed):
    """A tile (a corner of rows and columns, some of the out channels) as Winograd and as im2col."""
    op = winograd_conv((n, c, h, w), "float64", out_channels=oc + 1, padding=(ph, pw))
    x, weights, g = conv_arrays(op, seed, np.float64)
    check_tile_against_columns(op, x, weights, g, lo)


def check_tile_against_columns(op, x, weights, g, lo: int):
    """A corner tile of `op` (rows and columns cut by `lo`, out channels from `lo` on) through its
    own path and through the im2col columns path (_forward_columns, _backward_columns) agree."""
    n, oc, oh, ow = op.tile_shape
    tile = Rect((0, min(lo, oc - 1), min(lo, oh - 1), 0), (n, oc, oh, max(1, ow - lo)))
    (rect,) = op.input_rects(tile)
    xs = x[rect.slices()]
    ws = {k: v[op.weight_rects(tile)[k].slices()] for k, v in weights.items()}
    gs = g[tile.slices()]
    pads = op._pads(tile, rect)
    y, _ = op.forward(np, tile, [xs], [rect], ws)
    (dx,), gw = op.backward(np, tile, [xs], [rect], ws, y, [gs], None)
    y_c = np.empty((n, tile.shape[1], tile.shape[2] * tile.shape[3]))
    op._forward_columns(np, tile, np.pad(xs, ((0, 0), (0, 0), *pads)), ws["weight"], y_c)
    y_c += ws["bias"][:, None]
    dx_c = np.empty(xs.shape)
    dw_c = op._backward_columns(np, tile, xs, pads, ws["weight"], gs, dx_c)
    np.testing.assert_allclose(y[0], y_c.reshape(tile.shape), rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(dx, dx_c, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(gw["weight"], dw_c, rtol=1e-11, atol=1e-11)


@pytest.mark.real_threshold
def test_conv2d_winograd_only_where_it_pays(monkeypatch):
    def winograd_tile(shape, oc, tile_parts=None, **attrs):
        op = Conv2d("c", [spec(shape)], out_channels=oc, kernel=attrs.pop("kernel", 3), **attrs)
        hi = list(op.tile_shape)
        for d, parts in (tile_parts or {}).items():
            hi[d] //= parts
        return op._winograd(np, Rect.make([0] * 4, hi))
    blocks = conv_module._WINOGRAD_MIN_BLOCKS  # 4x4 blocks: an 8x8 image has 4
    assert winograd_tile((blocks // 4, 16, 8, 8), 16, padding=1)
    assert not winograd_tile((blocks // 4 - 1, 16, 8, 8), 16, padding=1)
    assert not winograd_tile((blocks // 4, 16, 8, 8), 16, {0: 2}, padding=1)  # a tile of half the batch
    assert winograd_tile((blocks // 4, 16, 8, 8), 8, padding=1)  # 16 x 8 channel pairs
    assert not winograd_tile((blocks // 4, 8, 8, 8), 8, padding=1)  # 8 x 8
    assert not winograd_tile((blocks // 4, 8, 8, 8), 16, {1: 2}, padding=1)  # 8 x 8 of 8 x 16
    monkeypatch.setattr(conv_module, "_WINOGRAD_MIN_BLOCKS", 1)   # the other conditions, on small images
    monkeypatch.setattr(conv_module, "_WINOGRAD_MIN_CHANNEL_PAIRS", 1)
    assert not winograd_tile((1, 4, 8, 8), 4)  # few input channels
    assert not winograd_tile((1, 8, 8, 8), 8, stride=2)
    assert not winograd_tile((1, 8, 8, 8), 8, groups=2)
    assert not winograd_tile((1, 8, 8, 8), 8, kernel=(3, 1))
    assert winograd_tile((1, 8, 8, 8), 8, padding=1)


def run_parts(x, w, dy, top_left, most_parts, want_dx=True):
    """y, dx (None unless want_dx), dw from ops.winograd on at most most_parts parts."""
    y = np.full((x.shape[0], w.shape[0], *dy.shape[2:]), np.nan, x.dtype)
    winograd.forward(x, w, top_left, y, most_parts=most_parts)
    dx = np.full(x.shape, np.nan, x.dtype) if want_dx else None
    return y, dx, winograd.backward(x, w, dy, top_left, dx, most_parts=most_parts)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 5), c=st.integers(1, 6), oc=st.integers(1, 6), h=st.integers(2, 13),
       w=st.integers(2, 13), top=st.integers(0, 1), left=st.integers(0, 1), most_parts=st.integers(1, 3),
       want_dx=st.booleans(), dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**16))
def test_compiled_parts_match_the_matmul_path(n, c, oc, h, w, top, left, most_parts, want_dx, dtype, seed):
    """The GEMMs called from numba (ops/blas.py), the samples in parallel parts, against the
    steps with np.matmul between them (where numpy's BLAS has no symbols numba can call)."""
    oh, ow = h + 2 * top - 2, w + 2 * left - 2
    if oh < 1 or ow < 1:
        return
    rng = np.random.default_rng(seed)
    x, wt = rng.standard_normal((n, c, h, w)).astype(dtype), rng.standard_normal((oc, c, 3, 3)).astype(dtype)
    dy = rng.standard_normal((n, oc, oh, ow)).astype(dtype)
    parts = []
    with threadpool_limits(limits=2, user_api="blas"), pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(winograd, "batch_parts", lambda *a: parts.append(batch_parts(*a)) or parts[-1])
        y, dx, dw = run_parts(x, wt, dy, (top, left), most_parts, want_dx)
        assert [p[0] for p in parts] == [min(n, most_parts, 2)] * 2   # threads: forward, backward
        monkeypatch.setitem(blas._found, np.dtype(dtype), None)
        y_ref, dx_ref, dw_ref = run_parts(x, wt, dy, (top, left), most_parts, want_dx)
    tol = 1e-5 if dtype == np.float32 else 1e-12   # float32: of the largest value (the transforms add up to 8x)
    np.testing.assert_allclose(y, y_ref, rtol=0, atol=tol * np.abs(y_ref).max())
    np.testing.assert_allclose(dw, dw_ref, rtol=0, atol=tol * np.abs(dw_ref).max())
    if want_dx:
        np.testing.assert_allclose(dx, dx_ref, rtol=0, atol=tol * np.abs(dx_ref).max())


def test_compiled_parts_on_views_and_several_chunks(monkeypatch):
    """Strided views in, chunks smaller than a part, in two parts: against PyTorch; and still one
    compiled version per float type of each kernel (ops/per_float.py)."""
    monkeypatch.setattr(winograd, "_CHUNK_BYTES", 1)
    monkeypatch.setattr(winograd, "_MIN_CHUNK_BLOCKS", 1)
    with threadpool_limits(limits=2, user_api="blas"):
        check_strided_views(lambda *args: run_parts(*args, most_parts=2))
        check_strided_views(lambda *args: run_parts(*args, most_parts=1))
    for kernel in (winograd._forward_compiled, winograd._backward_compiled, winograd._forward_parts,
                   winograd._backward_parts):
        assert_one_version_per_float(kernel, np.float64)


def assert_one_version_per_float(kernel, dtype) -> None:
    """`kernel` has one compiled version per float type it was compiled for (ops/per_float.py),
    `dtype`'s among them."""
    floats = [next(t.dtype for t in signature if isinstance(t, numba.types.Array)) for signature in kernel.overloads]
    assert len(floats) == len(set(floats)) and numba.from_dtype(np.dtype(dtype)) in floats, (kernel.__name__, floats)


def test_in_parts_splits_over_the_blas_threads_with_blas_on_one():
    blas = []

    def work(a, b):
        blas.append(cpu_pool.threads())
        return a, b
    with threadpool_limits(limits=2, user_api="blas"):
        parts = cpu_pool.in_parts(work, 9)
        assert cpu_pool.threads() == 2  # restored
    assert parts == [(0, 4), (4, 9)] and blas == [1, 1]
    blas.clear()
    with threadpool_limits(limits=1, user_api="blas"):
        assert cpu_pool.in_parts(work, 9) == [(0, 9)]
    with threadpool_limits(limits=2, user_api="blas"):
        assert cpu_pool.in_parts(work, 1) == [(0, 1)] and blas == [1, 2]  # one part keeps BLAS's threads
        assert cpu_pool.in_parts(work, 9, most=1) == [(0, 9)] and blas == [1, 2, 2]
    with threadpool_limits(limits=3, user_api="blas"):
        assert cpu_pool.in_parts(work, 9, most=2) == [(0, 4), (4, 9)]
        assert cpu_pool.in_parts(work, 9, most=5) == [(0, 3), (3, 6), (6, 9)]


def test_in_parts_raises_what_a_part_raised_and_restores_blas():
    def fail_last(a, b):
        if b == 7:
            raise ValueError(f"part [{a}, {b})")
        return b
    with threadpool_limits(limits=2, user_api="blas"):
        with pytest.raises(ValueError, match=r"part \[3, 7\)"):
            cpu_pool.in_parts(fail_last, 7)
        assert cpu_pool.threads() == 2


def test_conv2d_runs_on_sample_parts_like_one(monkeypatch):
    """The op's sample parts (one per core) give what one part gives, on every path: im2col on
    cpu_pool's threads, Winograd and direct in a prange (these tiles are split however few their
    flops)."""
    monkeypatch.setattr(conv_module, "_PART_MIN_FLOPS", 1)
    cases = (((5, 8, 9, 9), 3, 1, "winograd"), ((5, 8, 9, 9), 3, 2, "batched"), ((5, 8, 9, 9), 1, 1, "columns"),
             ((5, 3, 9, 9), 3, 1, "direct"))
    for shape, kernel, stride, path in cases:
        op = Conv2d("conv", [spec(shape, "float64")], out_channels=4, kernel=kernel, stride=stride,
                    padding=kernel // 2)
        assert op._path(np, Rect.from_shape(op.tile_shape)) == path
        x, weights, g = conv_arrays(op, 2, np.float64)
        results = []
        for threads in (1, 2):
            with recorded_parts(monkeypatch) as parts, threadpool_limits(limits=threads, user_api="blas"):
                results.append(run_whole(op, [x], weights, grad_outputs=[g]))
            assert parts == [[(0, 5)]] * 2 if threads == 1 else [[(0, 2), (2, 5)]] * 2, (path, parts)
        (y1,), (dx1,), gw1, _ = results[0]
        (y2,), (dx2,), gw2, _ = results[1]
        np.testing.assert_allclose(y2, y1, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(dx2, dx1, rtol=1e-12, atol=1e-12)
        for k in gw1:
            np.testing.assert_allclose(gw2[k], gw1[k], rtol=1e-12, atol=1e-12)


@contextlib.contextmanager
def recorded_parts(monkeypatch):
    """Yields a list that gets, for each cut of a batch into parts (cpu_pool.in_parts or
    cpu_threads.batch_parts, as the paths take them), its sample ranges."""
    seen, in_parts = [], cpu_pool.in_parts

    def spy_batch_parts(n, most=None):
        threads, cuts = batch_parts(n, most)
        seen.append(list(zip(cuts[:-1].tolist(), cuts[1:].tolist())))
        return threads, cuts

    def spy_in_parts(work, n, most=None):
        ranges = []
        results = in_parts(lambda a, b: ranges.append((a, b)) or work(a, b), n, most)
        seen.append(sorted(ranges))
        return results
    with monkeypatch.context() as m:
        m.setattr(winograd, "batch_parts", spy_batch_parts)
        m.setattr(direct_conv, "batch_parts", spy_batch_parts)
        m.setattr(cpu_pool, "in_parts", spy_in_parts)
        yield seen


def parts_of(monkeypatch, op, threads: int) -> list:
    """The sample ranges the op's forward cuts its whole tile into with `threads` cores."""
    x, weights, _ = conv_arrays(op, 0, np.float32)
    with recorded_parts(monkeypatch) as parts, threadpool_limits(limits=threads, user_api="blas"):
        run_whole(op, [x], weights)
    assert len(parts) == 1, parts
    return parts[0]


@pytest.mark.real_threshold
def test_conv2d_splits_only_tiles_with_flops_for_every_part(monkeypatch):
    """Each part gets at least _PART_MIN_FLOPS of forward (below that the parts cost more than
    they save); the direct path splits at any size."""
    def conv(samples):
        return Conv2d("c", [spec((samples, 16, 8, 8))], out_channels=16, kernel=3, padding=1)
    per_sample = conv(1).flops(Rect.from_shape(conv(1).tile_shape))
    enough = -(-2 * conv_module._PART_MIN_FLOPS // per_sample)   # samples for two parts
    assert parts_of(monkeypatch, conv(enough), 2) == [(0, enough // 2), (enough // 2, enough)]
    assert parts_of(monkeypatch, conv(enough - 1), 2) == [(0, enough - 1)]
    assert parts_of(monkeypatch, conv(enough), 1) == [(0, enough)]
    with monkeypatch.context() as m:   # three cores, as many parts as the flops allow
        m.setattr(numba.config, "NUMBA_NUM_THREADS", 3)
        m.setattr(numba, "set_num_threads", lambda n: None)
        assert parts_of(monkeypatch, conv(2 * enough), 3) == [(0, enough * 2 // 3), (enough * 2 // 3, enough * 4 // 3),
                                                              (enough * 4 // 3, 2 * enough)]
    first_layer = Conv2d("c", [spec((2, 3, 8, 8))], out_channels=4, kernel=3, padding=1)   # direct: always split
    assert first_layer._path(np, Rect.from_shape(first_layer.tile_shape)) == "direct"
    assert parts_of(monkeypatch, first_layer, 2) == [(0, 1), (1, 2)]
