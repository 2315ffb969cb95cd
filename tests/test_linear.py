"""Dense and batch matmul against PyTorch, finite differences and every tiling."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ops.base import ATTRIBUTE, OP_REGISTRY, PARAMETER, REDUCE, SAMPLE, ShapeError
from ops.linear import BatchMatmul, Dense
from taskrt.geometry import Rect
from tests.opcheck import check_finite_differences, check_tiled, run_whole, spec

TORCH_ACT = {None: lambda t: t, "relu": torch.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "gelu": F.gelu}


def as64(arrays):
    if isinstance(arrays, dict):
        return {k: v.astype(np.float64) for k, v in arrays.items()}
    return [a.astype(np.float64) for a in arrays]


def dense_case(shape, out, use_bias, activation, seed=0):
    rng = np.random.default_rng(seed)
    op = Dense("fc", [spec(shape)], out_features=out, use_bias=use_bias, activation=activation)
    w = op.init_weights(rng)
    if use_bias:  # init biases are small; make them matter
        w["bias"] = rng.standard_normal(out).astype(np.float32)
    x = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(op.outputs[0].shape).astype(np.float32)
    return op, x, w, g


def check_dense_against_torch(op, x, w, g):
    outs, gin, gw, _ = run_whole(op, [x], w, grad_outputs=[g])
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(w["weight"], requires_grad=True)
    bt = torch.tensor(w["bias"], requires_grad=True) if op.use_bias else None
    yt = TORCH_ACT[op.activation](F.linear(xt, wt, bt))
    yt.backward(torch.tensor(g))
    assert outs[0].dtype == np.float32 and outs[0].shape == op.outputs[0].shape
    np.testing.assert_allclose(outs[0], yt.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gin[0], xt.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gw["weight"], wt.grad.numpy(), rtol=1e-4, atol=1e-5)
    assert set(gw) == ({"weight", "bias"} if op.use_bias else {"weight"})
    if op.use_bias:
        np.testing.assert_allclose(gw["bias"], bt.grad.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("activation", [None, "relu", "sigmoid", "tanh", "gelu"])
@pytest.mark.parametrize("shape,use_bias", [((5, 7), True), ((3, 4, 6), False), ((2, 3, 2, 5), True)])
def test_dense_matches_torch_finite_differences_and_tiles(shape, use_bias, activation):
    op, x, w, g = dense_case(shape, 6, use_bias, activation)
    check_dense_against_torch(op, x, w, g)
    check_finite_differences(op, [x], w)
    check_tiled(op, as64([x]), as64(w), as64([g]))


@settings(max_examples=15, deadline=None)
@given(batch=st.integers(1, 5), mid=st.integers(0, 3), n_in=st.integers(1, 9), n_out=st.integers(1, 9),
       use_bias=st.booleans(), activation=st.sampled_from([None, "relu", "tanh", "gelu"]), seed=st.integers(0, 99))
def test_dense_any_shape_matches_torch_and_tiles(batch, mid, n_in, n_out, use_bias, activation, seed):
    shape = (batch, mid, n_in) if mid else (batch, n_in)
    op, x, w, g = dense_case(shape, n_out, use_bias, activation, seed)
    check_dense_against_torch(op, x, w, g)
    check_tiled(op, as64([x]), as64(w), as64([g]))


def test_dense_split_dims_rects_and_flops():
    op = Dense("fc", [spec((8, 5, 16))], out_features=12)
    assert op.tile_shape == (8, 5, 12, 16)
    assert [(s.dim, s.kind) for s in op.split_dims()] == [(0, SAMPLE), (1, ATTRIBUTE), (2, PARAMETER), (3, REDUCE)]
    assert op.split_dims()[3].partial and op.bias_weights() == ("bias",)
    tile = Rect((2, 1, 4, 0), (6, 3, 10, 16))
    assert op.input_rects(tile) == [Rect((2, 1, 0), (6, 3, 16))]
    assert op.output_rects(tile) == [Rect((2, 1, 4), (6, 3, 10))]
    assert op.weight_rects(tile) == {"weight": Rect((4, 0), (10, 16)), "bias": Rect((4,), (10,))}
    assert op.flops(tile) == 4 * 2 * 6 * (2 * 16 + 1)
    whole = Rect.from_shape(op.tile_shape)
    assert op.flops(whole) >= 2 * 8 * 5 * 12 * 16
    # bytes: input rows, weight slice, bias slice and output tile, all float32
    assert op.bytes_moved(tile) == 4 * (4 * 2 * 16 + 6 * 16 + 6 + 4 * 2 * 6)
    # in features [4, 12): a partial output of the block's columns, and no bias (only the tile at 0 adds it)
    part = Rect((2, 1, 4, 4), (6, 3, 10, 12))
    assert op.input_rects(part) == [Rect((2, 1, 4), (6, 3, 12))]
    assert op.output_rects(part) == op.output_rects(tile)
    assert op.tile_weight_rects(part) == {"weight": Rect((4, 4), (10, 12)), "bias": Rect((4,), (4,))}
    assert op.tile_weight_rects(Rect((2, 1, 4, 0), (6, 3, 10, 4)))["bias"] == Rect((4,), (10,))
    assert op.flops(part) == 4 * 2 * 6 * 2 * 8
    assert OP_REGISTRY["dense"] is Dense
    assert op.attrs() == {"out_features": 12, "use_bias": True, "activation": None}
    # an activation of partial sums is not the activation of their sum: no reduce split then
    relu = Dense("fc", [spec((8, 16))], out_features=12, activation="relu")
    assert relu.tile_shape == (8, 12, 16) and [s.kind for s in relu.split_dims()] == [SAMPLE, PARAMETER]


def test_dense_init_is_torch_linear_default():
    op = Dense("fc", [spec((2, 400))], out_features=300)
    w = op.init_weights(np.random.default_rng(0))
    bound = 1 / math.sqrt(400)
    assert w["weight"].shape == (300, 400) and w["weight"].dtype == np.float32
    assert w["bias"].shape == (300,)
    for v in w.values():
        assert np.abs(v).max() <= bound and np.abs(v).max() > 0.9 * bound
    assert abs(w["weight"].std() - bound / math.sqrt(3)) < 0.05 * bound


def test_dense_float64_weights_follow_the_input():
    op = Dense("fc", [spec((2, 4), "float64")], out_features=3)
    assert all(v.dtype == np.float64 for v in op.init_weights(np.random.default_rng(0)).values())


@pytest.mark.parametrize("inputs,attrs,needle", [
    ([spec((7,))], dict(out_features=3), "at least 2 dims"),
    ([spec((2, 7)), spec((2, 7))], dict(out_features=3), "takes 1 input"),
    ([spec((2, 7))], dict(out_features=0), "out_features"),
    ([spec((2, 7))], dict(out_features=3, activation="swish"), "swish"),
])
def test_dense_bad_inputs_name_the_op(inputs, attrs, needle):
    with pytest.raises(ShapeError, match=needle) as err:
        Dense("fc1", inputs, **attrs)
    assert "dense 'fc1'" in str(err.value)


def test_dense_kernel_rejects_mismatched_in_features():
    op = Dense("fc1", [spec((2, 7))], out_features=3)
    tile = Rect.from_shape(op.tile_shape)
    w = {"weight": np.zeros((3, 5), np.float32), "bias": np.zeros(3, np.float32)}
    with pytest.raises(ShapeError, match="in features mismatch.*7.*5") as err:
        op.forward(np, tile, [np.zeros((2, 7), np.float32)], op.input_rects(tile), w)
    assert "dense 'fc1'" in str(err.value)


# ---- batch matmul ------------------------------------------------------------------


def bmm_case(sa, sb, seed=0):
    rng = np.random.default_rng(seed)
    op = BatchMatmul("bmm", [spec(sa, name="a"), spec(sb, name="b")])
    a = rng.standard_normal(sa).astype(np.float32)
    b = rng.standard_normal(sb).astype(np.float32)
    g = rng.standard_normal(op.outputs[0].shape).astype(np.float32)
    return op, a, b, g


def check_bmm_against_torch(op, a, b, g):
    outs, gin, gw, _ = run_whole(op, [a, b], {}, grad_outputs=[g])
    at, bt = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    ct = torch.matmul(at, bt)
    ct.backward(torch.tensor(g))
    assert outs[0].shape == tuple(ct.shape) and gw == {}
    np.testing.assert_allclose(outs[0], ct.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gin[0], at.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gin[1], bt.grad.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sa,sb", [((3, 4, 5), (3, 5, 6)), ((2, 3, 4, 5), (2, 3, 5, 2))])
def test_batch_matmul_matches_torch_finite_differences_and_tiles(sa, sb):
    op, a, b, g = bmm_case(sa, sb)
    check_bmm_against_torch(op, a, b, g)
    check_finite_differences(op, [a, b], {})
    check_tiled(op, as64([a, b]), {}, as64([g]))


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 4), m=st.integers(1, 6), k=st.integers(1, 6), n=st.integers(1, 6), seed=st.integers(0, 99))
def test_batch_matmul_any_shape(batch, m, k, n, seed):
    op, a, b, g = bmm_case((batch, m, k), (batch, k, n), seed)
    check_bmm_against_torch(op, a, b, g)
    check_tiled(op, as64([a, b]), {}, as64([g]))


def test_batch_matmul_split_dims_rects_and_flops():
    op = BatchMatmul("bmm", [spec((4, 6, 8), name="a"), spec((4, 8, 10), name="b")])
    assert op.tile_shape == (4, 6, 10, 8)
    assert [(s.dim, s.kind) for s in op.split_dims()] == [(0, SAMPLE), (1, ATTRIBUTE), (2, PARAMETER), (3, REDUCE)]
    tile = Rect((1, 2, 3, 0), (3, 5, 7, 8))
    assert op.input_rects(tile) == [Rect((1, 2, 0), (3, 5, 8)), Rect((1, 0, 3), (3, 8, 7))]
    assert op.output_rects(tile) == [Rect((1, 2, 3), (3, 5, 7))]
    assert op.flops(tile) == 2 * 2 * 3 * 4 * 8
    inner = Rect((1, 2, 3, 2), (3, 5, 7, 5))  # k in [2, 5): a partial product
    assert op.input_rects(inner) == [Rect((1, 2, 2), (3, 5, 5)), Rect((1, 2, 3), (3, 5, 7))]
    assert op.output_rects(inner) == op.output_rects(tile) and op.flops(inner) == 2 * 2 * 3 * 4 * 3
    assert OP_REGISTRY["batch_matmul"] is BatchMatmul


@pytest.mark.parametrize("sa,sb,needle", [
    ((3, 4, 5), (3, 6, 2), "inner dims differ"),
    ((3, 4, 5), (2, 5, 2), "batch dims differ"),
    ((4, 5), (5, 2), "rank >= 3"),
    ((2, 4, 5), (2, 1, 5, 2), "rank >= 3"),
])
def test_batch_matmul_bad_inputs_name_the_op(sa, sb, needle):
    with pytest.raises(ShapeError, match=needle) as err:
        BatchMatmul("mm7", [spec(sa, name="a"), spec(sb, name="b")])
    assert "batch_matmul 'mm7'" in str(err.value) and str(sa) in str(err.value)


def test_batch_matmul_rejects_mixed_dtypes():
    with pytest.raises(ShapeError, match="dtypes differ"):
        BatchMatmul("mm", [spec((2, 3, 4), name="a"), spec((2, 4, 5), "float64", name="b")])


@pytest.mark.parametrize("use_bias", [True, False])
def test_dense_backward_into_the_runtimes_buffers(use_bias):
    """weight_out: the weight (and bias) gradients are written into the arrays given and returned,
    bit for bit the allocating path's."""
    rng = np.random.default_rng(3)
    op = Dense("d", [spec((6, 5))], out_features=4, use_bias=use_bias, activation="relu")
    x = rng.standard_normal((6, 5)).astype(np.float32)
    w = op.init_weights(rng)
    tile = Rect.from_shape(op.tile_shape)
    outs, saved = op.forward(np, tile, [x], op.input_rects(tile), w)
    dy = [rng.standard_normal(outs[0].shape).astype(np.float32)]
    _, allocated = op.backward(np, tile, [x], op.input_rects(tile), w, outs, dy, saved)
    bufs = {k: np.full(v.shape, np.nan, np.float32) for k, v in w.items()}
    _, given = op.backward(np, tile, [x], op.input_rects(tile), w, outs, dy, saved, weight_out=dict(bufs))
    assert set(given) == set(w) and all(given[k] is bufs[k] for k in w)
    for k in w:
        np.testing.assert_array_equal(bufs[k], allocated[k])
