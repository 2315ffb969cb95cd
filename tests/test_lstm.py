"""LSTM against torch.nn.LSTM(batch_first=True), finite differences and every batch tiling."""
from __future__ import annotations

import math

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from threadpoolctl import threadpool_limits

from ops.base import ATTRIBUTE, OP_REGISTRY, SAMPLE, ShapeError
from ops.lstm import LSTM, _tanh
from taskrt.geometry import Rect
from tests.opcheck import ArrayCodePath, check_finite_differences, check_tiled, run_whole, spec

WEIGHTS = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")


def lstm_case(batch, seq, n_in, hidden, with_initial_state, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    inputs = [spec((batch, seq, n_in), np.dtype(dtype).name)]
    if with_initial_state:
        inputs += [spec((batch, hidden), np.dtype(dtype).name, "h0"), spec((batch, hidden), np.dtype(dtype).name, "c0")]
    op = LSTM("rnn", inputs, hidden_size=hidden, with_initial_state=with_initial_state)
    w = op.init_weights(rng)
    xs = [rng.standard_normal(t.shape).astype(dtype) for t in op.inputs]
    gs = [rng.standard_normal(t.shape).astype(dtype) for t in op.outputs]
    return op, xs, w, gs


def torch_lstm(op, xs, w, gs):
    """Outputs, input grads and weight grads of torch.nn.LSTM with the same weights."""
    n_in, hidden = op.inputs[0].shape[2], op.hidden_size
    m = torch.nn.LSTM(n_in, hidden, batch_first=True)
    if xs[0].dtype == np.float64:
        m = m.double()
    with torch.no_grad():
        for k in WEIGHTS:
            getattr(m, k + "_l0").copy_(torch.from_numpy(w[k]))
    ts = [torch.tensor(a, requires_grad=True) for a in xs]
    if op.with_initial_state:
        y, (hn, cn) = m(ts[0], (ts[1][None], ts[2][None]))
    else:
        y, (hn, cn) = m(ts[0])
    torch.autograd.backward([y, hn[0], cn[0]], [torch.from_numpy(g) for g in gs])
    outs = [y.detach().numpy(), hn[0].detach().numpy(), cn[0].detach().numpy()]
    return outs, [t.grad.numpy() for t in ts], {k: getattr(m, k + "_l0").grad.numpy() for k in WEIGHTS}


def run_path(xp, op, xs, w, gs):
    """Outputs, input grads and weight grads of the whole op with array module xp."""
    tile = Rect.from_shape(op.tile_shape)
    rects = op.input_rects(tile)
    outs, saved = op.forward(xp, tile, xs, rects, w)
    gin, gw = op.backward(xp, tile, xs, rects, w, outs, gs, saved)
    return outs, gin, gw


def check_against_torch(op, xs, w, gs, rtol=1e-4, atol=1e-5, xp=None):
    if xp is None:
        outs, gin, gw, _ = run_whole(op, xs, w, grad_outputs=gs)
    else:
        outs, gin, gw = run_path(xp, op, xs, w, gs)
    t_outs, t_gin, t_gw = torch_lstm(op, xs, w, gs)
    assert len(outs) == 3 and len(gin) == len(xs)
    for name, a, b in zip(("y", "h_n", "c_n"), outs, t_outs):
        assert a.shape == b.shape and a.dtype == xs[0].dtype, name
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=name)
    for name, a, b in zip(("x", "h0", "c0"), gin, t_gin):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"grad {name}")
    assert set(gw) == set(WEIGHTS)
    for k in WEIGHTS:
        np.testing.assert_allclose(gw[k], t_gw[k], rtol=rtol, atol=atol, err_msg=f"grad {k}")


@pytest.mark.parametrize("with_initial_state", [False, True])
def test_lstm_matches_torch_finite_differences_and_tiles(with_initial_state):
    op, xs, w, gs = lstm_case(4, 5, 3, 6, with_initial_state)
    check_against_torch(op, xs, w, gs)
    check_finite_differences(op, xs, w)
    op64, xs64, w64, gs64 = lstm_case(4, 5, 3, 6, with_initial_state, dtype=np.float64)
    check_tiled(op64, xs64, w64, gs64)


@settings(max_examples=12, deadline=None)
@given(batch=st.integers(1, 4), seq=st.integers(1, 6), n_in=st.integers(1, 5), hidden=st.integers(1, 5),
       with_initial_state=st.booleans(), seed=st.integers(0, 99))
def test_lstm_any_shape(batch, seq, n_in, hidden, with_initial_state, seed):
    op, xs, w, gs = lstm_case(batch, seq, n_in, hidden, with_initial_state, seed)
    check_against_torch(op, xs, w, gs)
    op64, xs64, w64, gs64 = lstm_case(batch, seq, n_in, hidden, with_initial_state, seed, np.float64)
    check_tiled(op64, xs64, w64, gs64)


@settings(max_examples=10, deadline=None)
@given(batch=st.integers(1, 3), seq=st.integers(1, 4), hidden=st.integers(1, 70), with_initial_state=st.booleans(),
       seed=st.integers(0, 99))
def test_lstm_cpu_kernels_and_array_code_agree_with_torch(batch, seq, hidden, with_initial_state, seed):
    """The numba step kernels (numpy) and the array code (cupy's path, here on numpy) against torch
    in float32, at hidden sizes that cover the kernels' vector loops and their remainders, and
    the two paths against each other in float64."""
    op, xs, w, gs = lstm_case(batch, seq, 3, hidden, with_initial_state, seed)
    check_against_torch(op, xs, w, gs)
    check_against_torch(op, xs, w, gs, xp=ArrayCodePath())
    op64, xs64, w64, gs64 = lstm_case(batch, seq, 3, hidden, with_initial_state, seed, np.float64)
    a = run_path(np, op64, xs64, w64, gs64)
    b = run_path(ArrayCodePath(), op64, xs64, w64, gs64)
    for left, right in zip(a[0] + a[1], b[0] + b[1]):
        np.testing.assert_allclose(left, right, rtol=1e-12, atol=1e-14)
    for k in WEIGHTS:
        np.testing.assert_allclose(a[2][k], b[2][k], rtol=1e-12, atol=1e-14, err_msg=k)


@numba.njit
def _fast_tanh(x):
    out = np.empty_like(x)
    for i in range(x.size):
        out[i] = _tanh(x[i], True)
    return out


def test_float32_tanh_is_within_a_few_ulp_everywhere():
    x = np.concatenate([np.linspace(-12, 12, 400001), 10.0 ** np.linspace(-30, 2, 3201)]).astype(np.float32)
    x = np.concatenate([x, -x, [0, np.inf, -np.inf]]).astype(np.float32)
    y = _fast_tanh(x)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, np.tanh(x.astype(np.float64)), rtol=5e-7, atol=5e-7)
    assert np.all(np.abs(y) <= 1)


def test_lstm_long_sequence_with_large_inputs_stays_accurate():
    """Saturated gates (|pre-activation| >> 1) over 30 steps, against torch in float64."""
    op, xs, w, gs = lstm_case(3, 30, 4, 8, True, seed=3, dtype=np.float64)
    xs[0] *= 20
    check_against_torch(op, xs, w, gs, rtol=1e-9, atol=1e-10)


def test_lstm_rects_split_dims_and_flops():
    op = LSTM("rnn", [spec((8, 5, 3)), spec((8, 4), name="h0"), spec((8, 4), name="c0")], hidden_size=4,
              with_initial_state=True)
    assert [t.shape for t in op.outputs] == [(8, 5, 4), (8, 4), (8, 4)]
    assert [(s.dim, s.kind, s.ordered) for s in op.split_dims()] == [(0, SAMPLE, False), (1, ATTRIBUTE, True)]
    assert op.ordered_dim() == 1 and op.carry_shapes() == {"state": (2, 8, 4)}
    tile = Rect((2, 0, 0), (6, 5, 4))
    assert op.input_rects(tile) == [Rect((2, 0, 0), (6, 5, 3)), Rect((2, 0), (6, 4)), Rect((2, 0), (6, 4))]
    assert op.output_rects(tile) == [tile, Rect((2, 0), (6, 4)), Rect((2, 0), (6, 4))]
    # time chunks: only the first reads h0 and c0, only the last writes h_n and c_n; all share the carry rows
    first, middle, last = Rect((2, 0, 0), (6, 2, 4)), Rect((2, 2, 0), (6, 3, 4)), Rect((2, 3, 0), (6, 5, 4))
    assert op.input_rects(first)[1:] == [Rect((2, 0), (6, 4))] * 2
    assert all(r.empty for r in op.input_rects(middle)[1:] + op.output_rects(middle)[1:])
    assert op.input_rects(last)[0] == Rect((2, 3, 0), (6, 5, 3))
    assert op.output_rects(last)[1:] == [Rect((2, 0), (6, 4))] * 2
    assert {op.carry_rects(t)["state"] for t in (first, middle, last)} == {Rect((0, 2, 0), (2, 6, 4))}
    assert op.flops(middle) * 5 == op.flops(tile)
    gemm = 2 * 4 * 5 * 16 * (3 + 4)
    assert gemm < op.flops(tile) < 2 * gemm
    assert op.weight_rects(tile)["weight_hh"] == Rect((0, 0), (16, 4))
    assert OP_REGISTRY["lstm"] is LSTM
    assert op.attrs() == {"hidden_size": 4, "with_initial_state": True}


def test_lstm_init_is_torch_uniform():
    op = LSTM("rnn", [spec((2, 3, 50))], hidden_size=100)
    w = op.init_weights(np.random.default_rng(0))
    shapes = {"weight_ih": (400, 50), "weight_hh": (400, 100), "bias_ih": (400,), "bias_hh": (400,)}
    assert {k: v.shape for k, v in w.items()} == shapes
    bound = 1 / math.sqrt(100)
    for v in w.values():
        assert v.dtype == np.float32 and bound * 0.9 < np.abs(v).max() <= bound


def test_lstm_without_grads_for_final_states():
    """grad_outputs of None for h_n and c_n mean zeros (only y is used downstream)."""
    op, xs, w, gs = lstm_case(2, 4, 3, 5, True)
    _, gin, gw, _ = run_whole(op, xs, w, grad_outputs=[gs[0], None, None])
    _, gin0, gw0, _ = run_whole(op, xs, w, grad_outputs=[gs[0], np.zeros_like(gs[1]), np.zeros_like(gs[2])])
    for a, b in zip(gin, gin0):
        np.testing.assert_array_equal(a, b)
    for k in gw:
        np.testing.assert_array_equal(gw[k], gw0[k])


def test_a_later_chunk_without_a_carry_names_the_op_and_steps():
    op, xs, w, gs = lstm_case(2, 6, 3, 4, False)
    chunk = Rect((0, 2, 0), (2, 4, 4))
    with pytest.raises(ShapeError, match=r"lstm 'rnn': tile .* holds steps 2..3 of 6, so it needs the carry"):
        op.forward(np, chunk, [xs[0][:, 2:4]], op.input_rects(chunk), w)


def test_chunks_chained_through_the_carry_equal_the_whole_sequence():
    """Three chunks run in order through one carry (and back in backward) give torch's numbers."""
    op, xs, w, gs = lstm_case(3, 7, 2, 5, True, seed=4, dtype=np.float64)
    outs, gin, gw, _ = run_whole(op, xs, w, grad_outputs=gs)
    chunks = [Rect((0, a, 0), (3, b, 5)) for a, b in ((0, 2), (2, 5), (5, 7))]
    carry = np.full((2, 3, 5), np.nan)  # the first chunk must not read it
    runs, y = [], np.zeros_like(outs[0])
    for t in chunks:
        rects = op.input_rects(t)
        ins = [x[r.slices()] for x, r in zip(xs, rects)]
        touts, saved = op.forward(np, t, ins, rects, w, carry={"state": carry})
        y[t.slices()] = touts[0]
        runs.append((t, rects, ins, touts, saved))
    np.testing.assert_allclose(y, outs[0], rtol=1e-12)
    np.testing.assert_allclose(runs[-1][3][1], outs[1], rtol=1e-12)
    carry[...] = np.nan  # the last chunk's backward starts from dh_n, dc_n
    total = {k: np.zeros_like(v) for k, v in gw.items()}
    for t, rects, ins, touts, saved in reversed(runs):
        g = [gs[i][r.slices()] if not r.empty else None for i, r in enumerate(op.output_rects(t))]
        tgin, tgw = op.backward(np, t, ins, rects, w, touts, g, saved, carry={"state": carry})
        for k in total:
            total[k] += tgw[k]
    np.testing.assert_allclose(tgin[1], gin[1], rtol=1e-10)  # dh0 and dc0 from the first chunk
    np.testing.assert_allclose(tgin[2], gin[2], rtol=1e-10)
    for k in total:
        np.testing.assert_allclose(total[k], gw[k], rtol=1e-10, err_msg=k)


@pytest.mark.parametrize("inputs,attrs,needle", [
    ([spec((2, 3, 4))], dict(hidden_size=0), "hidden_size"),
    ([spec((2, 4))], dict(hidden_size=5), r"\[batch, seq, in\]"),
    ([spec((2, 0, 4))], dict(hidden_size=5), "seq >= 1"),
    ([spec((2, 3, 4))], dict(hidden_size=5, with_initial_state=True), "takes 3 inputs"),
    ([spec((2, 3, 4)), spec((2, 5)), spec((2, 5))], dict(hidden_size=5), "takes 1 input"),
    ([spec((2, 3, 4)), spec((3, 5), name="h0"), spec((2, 5), name="c0")], dict(hidden_size=5, with_initial_state=True),
     r"h0 must be \[batch, hidden\] = \(2, 5\)"),
    ([spec((2, 3, 4)), spec((2, 5), name="h0"), spec((2, 4), name="c0")], dict(hidden_size=5, with_initial_state=True),
     "c0 must be"),
    ([spec((2, 3, 4), "int32")], dict(hidden_size=5), "floating point"),
])
def test_lstm_bad_inputs_name_the_op(inputs, attrs, needle):
    with pytest.raises(ShapeError, match=needle) as err:
        LSTM("enc", inputs, **attrs)
    assert "lstm 'enc'" in str(err.value)


@settings(max_examples=8, deadline=None)
@given(batch=st.integers(1, 9), seq=st.integers(1, 4), hidden=st.sampled_from([1, 3, 17, 40, 70]),
       with_initial_state=st.booleans(), seed=st.integers(0, 99))
def test_steps_over_parts_of_the_hidden_units_equal_one_thread(batch, seq, hidden, with_initial_state, seed):
    """The steps cut into one part of the hidden units per core (numba's threads, BLAS's GEMMs in
    parts on the pool) give the numbers of one thread; three BLAS threads, so that the task has
    as many cores as numba has."""
    import ops.lstm as lstm_module
    op, xs, w, gs = lstm_case(batch, seq, 3, hidden, with_initial_state, seed, np.float64)
    old = lstm_module.PARALLEL_MIN_MACS
    try:
        lstm_module.PARALLEL_MIN_MACS = 1 << 62
        whole = run_path(np, op, xs, w, gs)
        lstm_module.PARALLEL_MIN_MACS = 0
        with threadpool_limits(3, user_api="blas"):
            assert lstm_module._hidden_parts(batch, hidden)[0] == min(3, numba.config.NUMBA_NUM_THREADS)
            parts = run_path(np, op, xs, w, gs)
    finally:
        lstm_module.PARALLEL_MIN_MACS = old
    for a, b in zip(whole[0] + whole[1], parts[0] + parts[1]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    for k in WEIGHTS:
        np.testing.assert_allclose(whole[2][k], parts[2][k], rtol=1e-12, atol=1e-14, err_msg=k)
