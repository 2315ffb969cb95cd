"""Loss ops against PyTorch (per-sample loss forward, batch-mean gradient backward), finite differences, tilings."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ops.base import SAMPLE, ShapeError
from ops.loss import MeanSquaredError, SparseCategoricalCrossEntropy
from taskrt.geometry import Rect
from tests.opcheck import check_finite_differences, check_tiled, run_whole, spec


class SummedLoss:
    """Mixin for finite differences: backward is d(mean)/dx, so N times it is d(sum of weighted losses)/dx,
    which is what check_finite_differences measures on the per-sample outputs."""

    def backward(self, *args):
        gin, gw = super().backward(*args)
        n = self.inputs[0].shape[0]
        return [None if g is None else g * n for g in gin], gw


class SummedCE(SummedLoss, SparseCategoricalCrossEntropy):
    """Cross-entropy whose backward is the gradient of the summed loss."""


class SummedMSE(SummedLoss, MeanSquaredError):
    """Mean squared error whose backward is the gradient of the summed loss."""


def ce_case(rng, n, c, from_logits, dtype=np.float32):
    logits = 2 * rng.standard_normal((n, c))
    x = logits if from_logits else np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    labels = rng.integers(0, c, size=n)
    return x.astype(dtype), labels


def torch_ce(x, labels, from_logits):
    """Per-sample losses and the gradient of their mean, from PyTorch."""
    xt = torch.tensor(x, requires_grad=True)
    lt = torch.tensor(labels)
    per = F.cross_entropy(xt, lt, reduction="none") if from_logits else F.nll_loss(torch.log(xt), lt, reduction="none")
    mean = F.cross_entropy(xt, lt) if from_logits else F.nll_loss(torch.log(xt), lt)
    mean.backward()
    return per.detach().numpy(), xt.grad.numpy()


def ce_op(n, c, from_logits, dtype="float32", cls=SparseCategoricalCrossEntropy):
    return cls("loss", [spec((n, c), dtype, "pred"), spec((n,), "int64", "labels")], from_logits=from_logits)


@pytest.mark.parametrize("from_logits", [False, True])
@pytest.mark.parametrize("n,c", [(6, 5), (7, 3), (4, 1)])
def test_cross_entropy_matches_torch(n, c, from_logits):
    x, labels = ce_case(np.random.default_rng(0), n, c, from_logits)
    op = ce_op(n, c, from_logits)
    (loss,), (gx, glab), gw, _ = run_whole(op, [x, labels], {}, grad_outputs=[np.ones(n, np.float32)])
    ref_loss, ref_grad = torch_ce(x, labels, from_logits)
    assert loss.shape == (n,) and loss.dtype == np.float32 and glab is None and gw == {}
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gx, ref_grad, rtol=1e-5, atol=1e-6)
    # None as the incoming gradient reads as ones: the gradient of the mean loss
    _, (gx_none, _), _, _ = run_whole(op, [x, labels], {}, grad_outputs=[None])
    np.testing.assert_array_equal(gx_none, gx)


@pytest.mark.parametrize("from_logits", [False, True])
def test_cross_entropy_finite_differences_and_tiles(from_logits):
    rng = np.random.default_rng(1)
    x, labels = ce_case(rng, 6, 4, from_logits, np.float64)
    check_finite_differences(ce_op(6, 4, from_logits, "float64", SummedCE), [x, labels], {})
    op = ce_op(6, 4, from_logits)
    x32 = x.astype(np.float32)
    check_tiled(op, [x32, labels], {}, [np.ones(6, np.float32)])
    check_tiled(op, [x32, labels], {}, [rng.standard_normal(6).astype(np.float32)])


def test_cross_entropy_tiles_use_the_global_batch():
    x, labels = ce_case(np.random.default_rng(2), 8, 3, True)
    op = ce_op(8, 3, True)
    assert [(s.dim, s.kind) for s in op.split_dims()] == [(0, SAMPLE)]
    tile = Rect((2,), (5,))
    rects = op.input_rects(tile)
    assert rects == [Rect((2, 0), (5, 3)), Rect((2,), (5,))]
    ins = [x[r.slices()] for x, r in zip([x, labels], rects)]
    outs, saved = op.forward(np, tile, ins, rects, {})
    (gx, _), _ = op.backward(np, tile, ins, rects, {}, outs, [np.ones(3, np.float32)], saved)
    _, ref_grad = torch_ce(x, labels, True)
    np.testing.assert_allclose(gx, ref_grad[2:5], rtol=1e-5, atol=1e-7)


def test_cross_entropy_is_stable():
    logits = np.array([[1000.0, -1000.0, 0.0], [-500.0, 500.0, 499.0]], dtype=np.float32)
    labels = np.array([1, 2])
    op = ce_op(2, 3, True)
    (loss,), (gx, _), _, _ = run_whole(op, [logits, labels], {}, grad_outputs=[None])
    np.testing.assert_allclose(loss, [2000.0, 1.3132616], rtol=1e-5)
    assert np.all(np.isfinite(gx))
    probs = np.array([[0.0, 1.0], [0.5, 0.5]], dtype=np.float32)
    (loss,), (gp, _), _, _ = run_whole(ce_op(2, 2, False), [probs, np.array([0, 1])], {}, grad_outputs=[None])
    assert np.all(np.isfinite(loss)) and np.all(np.isfinite(gp))
    np.testing.assert_allclose(loss[1], np.log(2), rtol=1e-6)


def test_cross_entropy_label_out_of_range_names_op_label_and_classes():
    x, _ = ce_case(np.random.default_rng(3), 4, 5, True)
    op = ce_op(4, 5, True)
    with pytest.raises(ValueError, match=r"sparse_categorical_crossentropy 'loss': label 7 is out of range "
                                         r"for C = 5 classes \(labels must be in \[0, 5\)\)"):
        run_whole(op, [x, np.array([0, 7, 1, 2])], {})
    with pytest.raises(ValueError, match=r"label -1 is out of range for C = 5"):
        run_whole(op, [x, np.array([0, 1, -1, 2])], {})


def test_cross_entropy_shape_errors():
    with pytest.raises(ShapeError, match=r"labels must be \[N\] = \[4\], got shape \(5,\)"):
        SparseCategoricalCrossEntropy("loss", [spec((4, 3)), spec((5,), "int64")])
    with pytest.raises(ShapeError, match=r"labels must be integers, got dtype float32"):
        SparseCategoricalCrossEntropy("loss", [spec((4, 3)), spec((4,), "float32")])
    with pytest.raises(ShapeError, match=r"predictions must be \[N, \.\.\., C\] \(at least 2 dims\), got shape \(4,\)"):
        SparseCategoricalCrossEntropy("loss", [spec((4,)), spec((4,), "int64")])
    with pytest.raises(ShapeError, match=r"labels must be \[N, \.\.\.\] = \[4, 3\], got shape \(4,\)"):
        SparseCategoricalCrossEntropy("loss", [spec((4, 3, 2)), spec((4,), "int64")])
    with pytest.raises(ShapeError, match=r"takes 2 inputs"):
        SparseCategoricalCrossEntropy("loss", [spec((4, 3))])


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 9), c=st.integers(1, 6), from_logits=st.booleans(), seed=st.integers(0, 2**16))
def test_cross_entropy_any_size(n, c, from_logits, seed):
    x, labels = ce_case(np.random.default_rng(seed), n, c, from_logits)
    op = ce_op(n, c, from_logits)
    (loss,), (gx, _), _, _ = run_whole(op, [x, labels], {}, grad_outputs=[None])
    ref_loss, ref_grad = torch_ce(x, labels, from_logits)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gx, ref_grad, rtol=1e-5, atol=1e-6)
    check_tiled(op, [x, labels], {}, [np.ones(n, np.float32)])


# ---- cross-entropy over sequences: predictions [N, ..., C], labels [N, ...] ----------

def torch_seq_ce(x, labels, from_logits):
    """Per-sample mean losses and the gradient of the mean over all positions, from PyTorch's
    F.cross_entropy (or nll_loss of log p) on the flattened positions."""
    n, c = x.shape[0], x.shape[-1]
    xt = torch.tensor(x, requires_grad=True)
    flat, lt = xt.reshape(-1, c), torch.tensor(labels).reshape(-1)
    per = F.cross_entropy(flat, lt, reduction="none") if from_logits else F.nll_loss(torch.log(flat), lt,
                                                                                     reduction="none")
    per.mean().backward()
    return per.detach().reshape(n, -1).mean(dim=1).numpy(), xt.grad.numpy()


def seq_case(rng, shape, from_logits, dtype=np.float32):
    logits = 2 * rng.standard_normal(shape)
    x = logits if from_logits else np.exp(logits) / np.exp(logits).sum(axis=-1, keepdims=True)
    return x.astype(dtype), rng.integers(0, shape[-1], size=shape[:-1])


def seq_op(shape, from_logits, dtype="float32", cls=SparseCategoricalCrossEntropy):
    return cls("loss", [spec(shape, dtype, "pred"), spec(shape[:-1], "int64", "labels")], from_logits=from_logits)


@pytest.mark.parametrize("from_logits", [False, True])
@pytest.mark.parametrize("shape", [(4, 6, 5), (3, 1, 7), (2, 3, 2, 4)])
def test_sequence_cross_entropy_matches_torch_finite_differences_and_tiles(shape, from_logits):
    rng = np.random.default_rng(10)
    x, labels = seq_case(rng, shape, from_logits)
    op = seq_op(shape, from_logits)
    assert op.outputs[0].shape == (shape[0],) and op.input_rects(Rect((1,), (2,)))[1] == Rect(
        (1,) + (0,) * (len(shape) - 2), (2,) + shape[1:-1])
    (loss,), (gx, glab), gw, _ = run_whole(op, [x, labels], {}, grad_outputs=[np.ones(shape[0], np.float32)])
    ref_loss, ref_grad = torch_seq_ce(x, labels, from_logits)
    assert loss.shape == (shape[0],) and loss.dtype == np.float32 and glab is None and gw == {}
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gx, ref_grad, rtol=1e-5, atol=1e-6)
    # the batch mean of the per-sample losses is the token mean that F.cross_entropy reports
    if from_logits:
        token_mean = F.cross_entropy(torch.tensor(x).reshape(-1, shape[-1]), torch.tensor(labels).reshape(-1))
        assert loss.mean() == pytest.approx(token_mean.item(), rel=1e-5)
    x64 = x.astype(np.float64)
    check_finite_differences(seq_op(shape, from_logits, "float64", SummedCE), [x64, labels], {})
    check_tiled(op, [x, labels], {}, [rng.standard_normal(shape[0]).astype(np.float32)])


def test_sequence_cross_entropy_label_out_of_range():
    x, labels = seq_case(np.random.default_rng(11), (2, 3, 4), True)
    labels[1, 2] = 4
    with pytest.raises(ValueError, match=r"'loss': label 4 is out of range for C = 4 classes"):
        run_whole(seq_op((2, 3, 4), True), [x, labels], {})


@settings(max_examples=15, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=3, max_size=4).map(tuple), from_logits=st.booleans(),
       seed=st.integers(0, 2**16))
def test_sequence_cross_entropy_any_shape(shape, from_logits, seed):
    x, labels = seq_case(np.random.default_rng(seed), shape, from_logits)
    op = seq_op(shape, from_logits)
    (loss,), (gx, _), _, _ = run_whole(op, [x, labels], {}, grad_outputs=[None])
    ref_loss, ref_grad = torch_seq_ce(x, labels, from_logits)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gx, ref_grad, rtol=1e-5, atol=1e-6)
    check_tiled(op, [x, labels], {}, [np.ones(shape[0], np.float32)])


# ---- mean squared error ------------------------------------------------------------

def torch_mse(p, t):
    pt = torch.tensor(p, requires_grad=True)
    tt = torch.tensor(t)
    per = F.mse_loss(pt, tt, reduction="none")
    per = per.reshape(per.shape[0], -1).mean(dim=1)
    F.mse_loss(pt, tt).backward()
    return per.detach().numpy(), pt.grad.numpy()


@pytest.mark.parametrize("shape", [(5, 3), (6, 2, 3), (7,)])
def test_mse_matches_torch_finite_differences_and_tiles(shape):
    rng = np.random.default_rng(4)
    p = rng.standard_normal(shape).astype(np.float32)
    t = rng.standard_normal(shape).astype(np.float32)
    op = MeanSquaredError("mse", [spec(shape, name="pred"), spec(shape, name="target")])
    assert op.outputs[0].shape == (shape[0],)
    (loss,), (gp, gt), _, _ = run_whole(op, [p, t], {}, grad_outputs=[np.ones(shape[0], np.float32)])
    ref_loss, ref_grad = torch_mse(p, t)
    assert gt is None
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(gp, ref_grad, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(loss.mean(), F.mse_loss(torch.tensor(p), torch.tensor(t)).item(), rtol=1e-5)
    summed = SummedMSE("mse", [spec(shape, "float64"), spec(shape, "float64")])
    check_finite_differences(summed, [p.astype(np.float64), t.astype(np.float64)], {})
    check_tiled(op, [p, t], {}, [rng.standard_normal(shape[0]).astype(np.float32)])


def test_mse_errors():
    with pytest.raises(ShapeError, match=r"mean_squared_error 'mse': predictions \(4, 3\) and targets \(4, 2\) "
                                         r"must have the same shape"):
        MeanSquaredError("mse", [spec((4, 3)), spec((4, 2))])
    with pytest.raises(ShapeError, match=r"input 1 \(t\) must be floats, got dtype int64"):
        MeanSquaredError("mse", [spec((4, 3)), spec((4, 3), "int64", "t")])


@settings(max_examples=15, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple), seed=st.integers(0, 2**16))
def test_mse_any_shape(shape, seed):
    rng = np.random.default_rng(seed)
    p = rng.standard_normal(shape).astype(np.float32)
    t = rng.standard_normal(shape).astype(np.float32)
    op = MeanSquaredError("mse", [spec(shape), spec(shape)])
    (loss,), (gp, _), _, _ = run_whole(op, [p, t], {}, grad_outputs=[None])
    ref_loss, ref_grad = torch_mse(p, t)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gp, ref_grad, rtol=1e-5, atol=1e-6)
    check_tiled(op, [p, t], {}, [np.ones(shape[0], np.float32)])
