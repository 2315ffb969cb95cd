"""Softmax and element-wise unary activations against PyTorch, finite differences and every tiling."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from threadpoolctl import threadpool_limits

from ops.activation import ElementUnary, Softmax, softmax_grad_rows, softmax_rows_
from ops.base import ATTRIBUTE, SAMPLE, OP_REGISTRY, ShapeError
from taskrt.geometry import Rect
from tests.opcheck import check_finite_differences, check_tiled, run_whole, spec
from tests.opcheck import ArrayCodePath

TORCH_UNARY = {"relu": torch.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "gelu": F.gelu}


def away_from_zero(rng, shape, dtype=np.float32):
    """Random values at least 0.1 from 0, so relu's kink is never within a finite-difference step."""
    x = rng.standard_normal(shape)
    return (np.sign(x) * (0.1 + np.abs(x))).astype(dtype)


def torch_check(op, torch_fn, x, g):
    """Forward and backward of `op` on the whole input match torch_fn in float32."""
    outs, gin, _, _ = run_whole(op, [x], {}, grad_outputs=[g])
    xt = torch.tensor(x, requires_grad=True)
    yt = torch_fn(xt)
    yt.backward(torch.tensor(g))
    assert outs[0].dtype == np.float32 and outs[0].shape == op.outputs[0].shape
    np.testing.assert_allclose(outs[0], yt.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gin[0], xt.grad.numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("shape", [(4, 7), (3, 4, 5), (2, 3, 2, 6)])
def test_softmax_matches_torch_and_tiles(shape):
    rng = np.random.default_rng(0)
    x = (3 * rng.standard_normal(shape)).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    op = Softmax("sm", [spec(shape)])
    torch_check(op, lambda t: torch.softmax(t, dim=-1), x, g)
    check_finite_differences(op, [x], {})
    check_tiled(op, [x], {}, [g])


def test_softmax_split_dims_exclude_the_softmax_dim():
    op = Softmax("sm", [spec((4, 5, 6))])
    assert [(s.dim, s.kind) for s in op.split_dims()] == [(0, SAMPLE), (1, ATTRIBUTE)]
    assert op.attrs() == {"axis": -1}
    assert OP_REGISTRY["softmax"] is Softmax


def test_softmax_is_stable_for_huge_logits():
    x = np.array([[1000.0, 1000.0, -1000.0], [-1e4, 0.0, 1e4]], dtype=np.float32)
    op = Softmax("sm", [spec(x.shape)])
    (y,), gin, _, _ = run_whole(op, [x], {}, grad_outputs=[np.ones_like(x)])
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(gin[0]))
    np.testing.assert_allclose(y, [[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], atol=1e-7)


def test_softmax_accepts_the_last_axis_by_index_and_rejects_others():
    Softmax("sm", [spec((2, 3))], axis=1)
    with pytest.raises(ShapeError, match=r"softmax 'sm': axis=0 is not supported; only the last dim"):
        Softmax("sm", [spec((2, 3))], axis=0)
    for axis in (1.0, True):   # (1.0 == 1 and True == 1 were taken)
        with pytest.raises(ShapeError, match=rf"axis={axis!r} is not supported"):
            Softmax("sm", [spec((2, 2))], axis=axis)
    with pytest.raises(ShapeError, match=r"at least 2 dims"):
        Softmax("sm", [spec((5,))])
    with pytest.raises(ShapeError, match=r"takes 1 input, got 2"):
        Softmax("sm", [spec((2, 3)), spec((2, 3))])


@pytest.mark.parametrize("fn", ["relu", "sigmoid", "tanh", "gelu"])
@pytest.mark.parametrize("shape", [(6,), (4, 5), (2, 3, 4)])
def test_unary_matches_torch_and_tiles(fn, shape):
    rng = np.random.default_rng(1)
    x = away_from_zero(rng, shape)
    g = rng.standard_normal(shape).astype(np.float32)
    op = ElementUnary("act", [spec(shape)], fn=fn)
    torch_check(op, TORCH_UNARY[fn], x, g)
    check_finite_differences(op, [x], {})
    check_tiled(op, [x], {}, [g])
    assert op.flops(Rect.from_shape(shape)) >= x.size


def test_unary_split_dims_and_errors():
    op = ElementUnary("act", [spec((4, 5, 6))], fn="tanh")
    assert [(s.dim, s.kind) for s in op.split_dims()] == [(0, SAMPLE), (1, ATTRIBUTE), (2, ATTRIBUTE)]
    assert op.attrs() == {"fn": "tanh"}
    with pytest.raises(ShapeError, match=r"unary 'act': unknown fn 'softplus'"):
        ElementUnary("act", [spec((4, 5))], fn="softplus")


def test_unary_keeps_float64():
    x = np.linspace(-2, 2, 12).reshape(3, 4)
    op = ElementUnary("act", [spec(x.shape, "float64")], fn="gelu")
    (y,), (gx,), _, _ = run_whole(op, [x], {}, grad_outputs=[np.ones_like(x)])
    assert y.dtype == np.float64 and gx.dtype == np.float64
    np.testing.assert_allclose(y, F.gelu(torch.tensor(x)).numpy(), rtol=1e-12)


shapes = st.lists(st.integers(1, 5), min_size=2, max_size=4).map(tuple)


@settings(max_examples=15, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**16))
def test_softmax_any_shape(shape, seed):
    rng = np.random.default_rng(seed)
    x = (4 * rng.standard_normal(shape)).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    op = Softmax("sm", [spec(shape)])
    torch_check(op, lambda t: torch.softmax(t, dim=-1), x, g)
    check_tiled(op, [x], {}, [g])


@settings(max_examples=15, deadline=None)
@given(shape=shapes, fn=st.sampled_from(["relu", "sigmoid", "tanh", "gelu"]), seed=st.integers(0, 2**16))
def test_unary_any_shape(shape, fn, seed):
    rng = np.random.default_rng(seed)
    x = away_from_zero(rng, shape)
    g = rng.standard_normal(shape).astype(np.float32)
    op = ElementUnary("act", [spec(shape)], fn=fn)
    torch_check(op, TORCH_UNARY[fn], x, g)
    check_tiled(op, [x], {}, [g])


# ---- the CPU row kernels against a float64 formula and the array code (the GPU path) ----------
def tile_view(x, pads, strided_rows=False):
    """x as a read-only view into a bigger array, `pads[d]` extra values before it along each
    leading dim d (as a tile of a bigger region arrives); `strided_rows` also spaces each
    row's values two apart (rows not contiguous, which the kernels copy)."""
    lead = x.shape[:-1]
    step = 2 if strided_rows else 1
    big = np.full(tuple(n + 2 * p for n, p in zip(lead, pads)) + (x.shape[-1] * step,), np.nan, x.dtype)
    view = big[tuple(slice(p, p + n) for n, p in zip(lead, pads)) + (slice(None, None, step),)]
    view[...] = x
    view.flags.writeable = False
    return view


def softmax64(x, hidden=None):
    """softmax over the last axis in float64, with the `hidden` entries left out (0)."""
    x = x.astype(np.float64)
    if hidden is not None:
        x = np.where(hidden, -np.inf, x)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def softmax_grad64(y, g):
    y, g = y.astype(np.float64), g.astype(np.float64)
    return y * (g - (g * y).sum(axis=-1, keepdims=True))


TOL = {np.float32: dict(rtol=1e-5, atol=1e-6), np.float64: dict(rtol=1e-12, atol=1e-14)}


@settings(max_examples=25, deadline=None)
@given(shape=shapes, dtype=st.sampled_from([np.float32, np.float64]), seed=st.integers(0, 2**16),
       pads=st.lists(st.integers(0, 2), min_size=3, max_size=3), strided_rows=st.booleans())
def test_softmax_kernels_match_the_formula_on_tile_views(shape, dtype, seed, pads, strided_rows):
    rng = np.random.default_rng(seed)
    x = tile_view((8 * rng.standard_normal(shape)).astype(dtype), pads, strided_rows)
    g = tile_view(rng.standard_normal(shape).astype(dtype), pads[::-1], strided_rows)
    ref_y = softmax64(x)
    ref_dx = softmax_grad64(ref_y, g)
    for xp in (np, ArrayCodePath()):
        y = np.empty(shape, dtype)
        softmax_rows_(xp, x, y)
        dx = softmax_grad_rows(xp, tile_view(y, pads), g)
        assert y.dtype == dtype and dx.dtype == dtype and dx.shape == shape
        np.testing.assert_allclose(y, ref_y, **TOL[dtype])
        np.testing.assert_allclose(dx, ref_dx, **TOL[dtype])


@settings(max_examples=20, deadline=None)
@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple), lq=st.integers(1, 6),
       extra=st.integers(0, 5), data=st.data(), dtype=st.sampled_from([np.float32, np.float64]))
def test_causal_softmax_in_place_matches_the_masked_formula(lead, lq, extra, data, dtype):
    """Scores of queries q0..q0+lq-1 over lk >= q0 + lq keys: query q0 + i sees keys 0..q0 + i."""
    lk = lq + extra
    q0 = data.draw(st.integers(0, lk - lq))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    x = (5 * rng.standard_normal(lead + (lq, lk))).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    hidden = np.arange(lk)[None, :] > (q0 + np.arange(lq))[:, None]
    ref_y = softmax64(x, hidden)
    for xp in (np, ArrayCodePath()):
        y = x.copy()
        softmax_rows_(xp, y, y, causal_first=q0)
        np.testing.assert_allclose(y, ref_y, **TOL[dtype])
        assert not y[..., hidden].any()
        dx = g.copy()
        assert softmax_grad_rows(xp, y, dx, out=dx) is dx
        np.testing.assert_allclose(dx, softmax_grad64(ref_y, g), **TOL[dtype])


def test_softmax_kernel_keeps_nans_and_gives_minus_infinity_no_weight():
    x = np.array([[1.0, np.nan, 2.0], [0.0, -np.inf, 0.0], [-np.inf, 3.0, -1e30]], np.float32)
    (y,), _, _, _ = run_whole(Softmax("sm", [spec(x.shape)]), [x], {})
    t = torch.softmax(torch.tensor(x), dim=-1).numpy()
    assert np.isnan(y[0]).all() and np.isnan(t[0]).all()
    np.testing.assert_allclose(y[1:], t[1:], rtol=1e-6, atol=1e-30)


def test_row_kernels_give_the_same_on_every_thread_count(monkeypatch):
    """Softmax and layer norm rows shared out over the cores (the threshold lowered to 0) give
    what one thread gives."""
    import ops.cpu_threads
    from ops.norm import LayerNorm
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 37, 33)).astype(np.float32)
    g = rng.standard_normal(x.shape).astype(np.float32)
    op = LayerNorm("ln", [spec(x.shape)], normalized_shape=33)
    weights = {"weight": rng.standard_normal(33).astype(np.float32), "bias": rng.standard_normal(33).astype(np.float32)}
    tile = Rect.from_shape(x.shape)
    results = []
    for threshold in (x.size + 1, 0):
        monkeypatch.setattr(ops.cpu_threads, "PARALLEL_MIN_VALUES", threshold)
        y = np.empty_like(x)
        softmax_rows_(np, x, y)
        (ln,), saved = op.forward(np, tile, [x], [tile], weights)
        (dx,), gw = op.backward(np, tile, [x], [tile], weights, [ln], [g], saved)
        results.append([y, softmax_grad_rows(np, y, g), ln, dx, gw["weight"], gw["bias"]])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


# ---- gelu's CPU kernels (ops/functions.py) ------------------------------------------------------
@pytest.mark.parametrize("dtype, tol", [(np.float32, 2e-6), (np.float64, 1e-13)])
@pytest.mark.parametrize("threads", [1, 2])
def test_gelu_kernels_match_the_array_code(monkeypatch, dtype, tol, threads):
    """The numba kernels, on one core and shared out over two (strided views in, as a tile's
    are; more values than a block of the backward's exp), against the array code that cupy
    runs, evaluated in float64; values up to +-20, past erf's clamp."""
    import ops.cpu_threads
    import ops.functions as functions
    rng = np.random.default_rng(4)
    x = (6 * rng.standard_normal((50, 202))).astype(dtype)[:, ::2]
    dy = rng.standard_normal((50, 202)).astype(dtype)[:, 1::2]
    monkeypatch.setattr(ops.cpu_threads, "PARALLEL_MIN_VALUES", 0 if threads > 1 else x.size + 1)
    with threadpool_limits(limits=threads, user_api="blas"):
        y = functions.activation_forward(np, "gelu", x)
        dx = functions.activation_backward(np, "gelu", x, y, dy)
    monkeypatch.setattr(functions, "_cpu_kernels", lambda *arrays: False)
    y_ref = functions.activation_forward(np, "gelu", x.astype(np.float64))
    dx_ref = functions.activation_backward(np, "gelu", x.astype(np.float64), y_ref, dy.astype(np.float64))
    assert y.dtype == dx.dtype == dtype and y.shape == dx.shape == x.shape
    np.testing.assert_allclose(y, y_ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(dx, dx_ref, rtol=tol, atol=tol)
