"""Element-wise binary ops with broadcasting against PyTorch, finite differences and every tiling."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ops.base import ATTRIBUTE, SAMPLE, ShapeError
from ops.elementwise import ElementBinary
from taskrt.geometry import Rect
from tests.opcheck import check_finite_differences, check_tiled, run_whole, spec

TORCH_BINARY = {"add": torch.add, "subtract": torch.sub, "multiply": torch.mul}


def check_against_torch(fn, sa, sb, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(sa).astype(np.float32)
    b = rng.standard_normal(sb).astype(np.float32)
    op = ElementBinary("bin", [spec(sa, name="a"), spec(sb, name="b")], fn=fn)
    out_shape = np.broadcast_shapes(sa, sb)
    assert op.outputs[0].shape == out_shape
    g = rng.standard_normal(out_shape).astype(np.float32)

    outs, gin, _, _ = run_whole(op, [a, b], {}, grad_outputs=[g])
    at, bt = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    yt = TORCH_BINARY[fn](at, bt)
    yt.backward(torch.tensor(g))
    np.testing.assert_allclose(outs[0], yt.detach().numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(gin[0], at.grad.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gin[1], bt.grad.numpy(), rtol=1e-5, atol=1e-5)
    check_tiled(op, [a, b], {}, [g])
    return op, a, b


BROADCASTS = [((4, 3), (4, 3)), ((4, 3), (3,)), ((4, 3), (4, 1)), ((4, 1, 5), (1, 3, 1)),
              ((2, 3, 4), (4,)), ((1, 3), (4, 1)), ((3,), (2, 1, 3)), ((5, 1), (1,))]


@pytest.mark.parametrize("fn", ["add", "subtract", "multiply"])
@pytest.mark.parametrize("sa,sb", BROADCASTS)
def test_binary_matches_torch_and_tiles(fn, sa, sb):
    op, a, b = check_against_torch(fn, sa, sb)
    check_finite_differences(op, [a, b], {})


def test_broadcast_input_reads_rect_0_1():
    op = ElementBinary("bin", [spec((6, 4, 5)), spec((4, 1))], fn="add")
    ra, rb = op.input_rects(Rect((2, 1, 3), (4, 3, 5)))
    assert ra == Rect((2, 1, 3), (4, 3, 5))
    assert rb == Rect((1, 0), (3, 1))
    assert [(s.dim, s.kind) for s in op.split_dims()] == [(0, SAMPLE), (1, ATTRIBUTE), (2, ATTRIBUTE)]


def test_integer_input_gets_no_gradient():
    a = np.arange(12, dtype=np.float64).reshape(3, 4)
    mask = np.array([1, 0, 1, 1], dtype=np.int64)
    op = ElementBinary("bin", [spec(a.shape, "float64"), spec(mask.shape, "int64")], fn="multiply")
    (y,), (ga, gm), _, _ = run_whole(op, [a, mask], {}, grad_outputs=[np.ones_like(a)])
    np.testing.assert_array_equal(y, a * mask)
    np.testing.assert_array_equal(ga, np.broadcast_to(mask, a.shape))
    assert gm is None and op.outputs[0].dtype == "float64"


def test_binary_errors_name_the_shapes():
    with pytest.raises(ShapeError, match=r"binary 'bin': shapes \(4, 3\) and \(2,\) don't broadcast"):
        ElementBinary("bin", [spec((4, 3)), spec((2,))], fn="add")
    with pytest.raises(ShapeError, match=r"unknown fn 'divide'"):
        ElementBinary("bin", [spec((4, 3)), spec((4, 3))], fn="divide")
    with pytest.raises(ShapeError, match=r"takes 2 inputs, got 1"):
        ElementBinary("bin", [spec((4, 3))], fn="add")


@st.composite
def broadcast_pair(draw):
    """An output shape and two input shapes that broadcast to it (dims dropped in front or set to 1)."""
    out = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    ins = []
    for _ in range(2):
        drop = draw(st.integers(0, len(out) - 1))
        shape = [1 if draw(st.booleans()) else s for s in out[drop:]]
        ins.append(tuple(shape))
    return ins[0], ins[1]


@settings(max_examples=25, deadline=None)
@given(pair=broadcast_pair(), fn=st.sampled_from(["add", "subtract", "multiply"]), seed=st.integers(0, 2**16))
def test_binary_any_broadcast(pair, fn, seed):
    check_against_torch(fn, *pair, seed=seed)
