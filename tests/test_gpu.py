"""The GPU path (cupy) against the CPU path: the same programs and models, placed on a GPU,
give the CPU's numbers. Needs a GPU that cupy sees; CI machines have none, so there the
module reports itself skipped (run it on a GPU machine: `pytest tests/test_gpu.py`)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from ops import SGD, Model
from taskrt import Machine, Runtime
from taskrt.geometry import Rect
from taskrt.machine import RankSpec, count_gpus
from taskrt.mapper import Mapper
from tests import test_runtime as tr
from tests.test_mpi import assert_every_rank_ok, run_mpi

pytestmark = pytest.mark.skipif(count_gpus() == 0, reason="no GPU visible through cupy")


class Spread(Mapper):
    """Point i on processor i mod P, GPUs and CPUs alike: neighbouring tiles change memory kind."""

    def select_processor(self, machine, launch_name, point, domain, index):
        return machine.processors[index % len(machine.processors)]


def gpu_machine(cpus: int = 1, gpus: int = 1) -> Machine:
    """One rank with `cpus` CPU workers and `gpus` GPU processors, all on device 0 when
    there are fewer devices (each with a memory of its own, so tiles still move)."""
    visible = count_gpus()
    return Machine.from_ranks([RankSpec(cpus, tuple(g % visible for g in range(gpus)))], ["local"],
                              separate_memories=True)


def test_local_machine_finds_the_gpus(monkeypatch):
    monkeypatch.delenv("TASKRT_GPUS")  # the suite's conftest sets 0
    machine = Machine.local(cpus=1)
    kinds = [p.kind for p in machine.processors]
    assert kinds.count("gpu") == count_gpus() and kinds.count("cpu") == 1, machine


@pytest.mark.parametrize("cpus,gpus", [(1, 1), (1, 2), (2, 2)])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prog=tr.programs())
def test_random_programs_over_cpus_and_gpus_match_sequential(cpus, gpus, prog):
    with Runtime(gpu_machine(cpus, gpus), Spread()) as rt:
        tr.check_program(rt, prog)


def cnn(rt, dtype):
    m = Model(rt, seed=2)
    x = m.input((4, 3, 8, 8), dtype)
    h = m.relu(m.batch_norm(m.conv2d(x, 6, 3, padding=1)))
    h = m.pool2d(h, 2)
    h = m.conv2d(h, 4, 3, stride=1, padding=1, groups=2)
    h = m.pool2d(h, 2, pool_type="avg")
    h = m.dropout(m.flat(h), 0.25, seed=5)
    m.softmax(m.dense(h, 5))
    return m


def sequence_net(rt, dtype):
    """Every other operator: embedding, LSTM, layer norm, attention, batched matmul, the
    element-wise ops and the shape ops."""
    m = Model(rt, seed=3)
    ids = m.input((4, 6), "int64")
    seq = m.input((4, 6, 5), dtype)
    e = m.embedding(ids, 20, 8)
    y, h, _ = m.lstm(m.concat([e, m.dense(seq, 8)], axis=2), 10)
    y = m.layer_norm(y)
    a = m.multihead_attention(y, num_heads=2, causal=True)
    left, right = m.split(m.gelu(a), [5, 5], axis=2)
    s = m.batch_matmul(left, m.transpose(m.sigmoid(right), (0, 2, 1)))
    s = m.reshape(s, (4, 36))
    z = m.add(m.tanh(m.dense(s, 10)), m.multiply(h, m.subtract(h, m.dense(h, 10))))
    m.dense(z, 3)
    return m


def data(kind, dtype, rng):
    if kind == "cnn":
        return [rng.standard_normal((4, 3, 8, 8)).astype(dtype)], rng.integers(0, 5, 4)
    return ([rng.integers(0, 20, (4, 6)), rng.standard_normal((4, 6, 5)).astype(dtype)],
            rng.standard_normal((4, 3)).astype(dtype))


def tolerance(array) -> float:
    return 1e-9 if array.dtype == np.float64 else 2e-4


@pytest.mark.parametrize("kind", ["cnn", "sequence"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_models_on_a_gpu_match_the_cpu(kind, dtype):
    """Forward, gradients and three SGD steps: on the GPU (tiles split over two GPU
    processors) and on two CPU workers. Tolerances follow each array's dtype (an embedding
    table is float32 in a float64 model); updates compound rounding, hence the 10x. (Not
    Adam: it scales the rounding noise of gradients that are zero in exact arithmetic, such
    as a conv bias under batch norm or an attention key bias, up to a full step.)"""
    build, loss = (cnn, "sparse_categorical_crossentropy") if kind == "cnn" else (sequence_net, "mean_squared_error")
    rng = np.random.default_rng(0)
    inputs, labels = data(kind, dtype, rng)
    results = []
    for machine in (Machine.local(cpus=2, gpus=0), gpu_machine(cpus=1, gpus=2)):
        with Runtime(machine) as rt:
            m = build(rt, dtype)
            m.compile(SGD(lr=0.05, momentum=0.9), loss)
            out = m.forward(inputs)
            value = m.backward(labels)
            arrays = {**out, **{f"grad {k}": v for k, v in m.gradients().items()}}
            history = m.fit(inputs, labels, iterations=3, verbose=False, shuffle=False)
            arrays.update(m.parameters())
            arrays.update(m.stats())
            results.append((value, history.loss, arrays))
            m.close()
    (loss_c, hist_c, cpu), (loss_g, hist_g, gpu) = results
    rtol = tolerance(np.zeros(1, dtype))
    assert loss_g == pytest.approx(loss_c, rel=rtol)
    np.testing.assert_allclose(hist_g, hist_c, rtol=10 * rtol)
    assert gpu.keys() == cpu.keys()
    for name, want in cpu.items():
        tol = 10 * tolerance(want)
        np.testing.assert_allclose(gpu[name], want, rtol=tol, atol=tol, err_msg=name)


@pytest.mark.parametrize("n", [2])
def test_ranks_move_gpu_tiles_between_them(n):
    proc, _ = run_mpi(n, "gpus.py", timeout=180, env={"TASKRT_GPUS": ""})
    assert_every_rank_ok(proc, n)


# ---- the fused CUDA kernels (ops/cuda_kernels.py) against the CPU path, op by op --------------
def _both_paths(op, inputs, tile=None, training=True, seed=0):
    """Forward and backward of one tile of `op` (inputs as views of whole arrays, as the runtime
    hands them over) with numpy and with cupy: [(outputs, input grads, weight grads, state)] each
    as numpy arrays."""
    import cupy

    rng = np.random.default_rng(seed)
    weights = op.init_weights(rng)
    state = {k: weights.pop(k) for k in list(weights) if k.startswith("running")}
    tile = tile or Rect.from_shape(op.tile_shape)
    rects, wrects = op.input_rects(tile), op.tile_weight_rects(tile)
    grads = [rng.standard_normal(r.shape).astype(o.dtype) for o, r in zip(op.outputs, op.output_rects(tile))]
    results = []
    for xp in (np, cupy):
        ins = [xp.asarray(x)[r.slices()] for x, r in zip(inputs, rects)]
        ws = {k: xp.asarray(a)[wrects[k].slices()] for k, a in weights.items() if k in wrects}
        st = {k: xp.asarray(a)[wrects[k].slices()].copy() for k, a in state.items()} or None
        outs, saved = op.forward(xp, tile, ins, rects, ws, training=training, state=st)
        gi, gw = op.backward(xp, tile, ins, rects, ws, outs, [xp.asarray(g) for g in grads], saved)
        host = cupy.asnumpy if xp is cupy else np.asarray
        results.append(([host(o) for o in outs], [None if g is None else host(g) for g in gi],
                        {k: host(v) for k, v in gw.items()}, {k: host(v) for k, v in (st or {}).items()}))
    return results


def _assert_paths_agree(results, dtype):
    tol = 1e-9 if dtype == "float64" else 3e-5
    (cpu_o, cpu_gi, cpu_gw, cpu_st), (gpu_o, gpu_gi, gpu_gw, gpu_st) = results
    for label, want, got in [("output", cpu_o, gpu_o), ("input grad", cpu_gi, gpu_gi)]:
        for i, (w, g) in enumerate(zip(want, got)):
            if w is not None:
                np.testing.assert_allclose(g, w, rtol=tol, atol=tol, err_msg=f"{label} {i}")
    assert cpu_gw.keys() == gpu_gw.keys() and cpu_st.keys() == gpu_st.keys()
    for k in cpu_gw:
        np.testing.assert_allclose(gpu_gw[k], cpu_gw[k], rtol=tol, atol=tol * 10, err_msg=f"grad {k}")
    for k in cpu_st:
        np.testing.assert_allclose(gpu_st[k], cpu_st[k], rtol=tol, atol=tol, err_msg=f"state {k}")


def _spec(shape, dtype):
    from ops.base import TensorSpec
    return TensorSpec(tuple(shape), dtype, "x")


def _normal(shape, dtype, seed=1):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


DTYPES = ["float32", "float64"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fn", ["relu", "sigmoid", "tanh", "gelu"])
def test_fused_activations_match_the_cpu(fn, dtype):
    from ops.activation import ElementUnary
    x = 3 * _normal((6, 5, 33), dtype)
    op = ElementUnary("act", [_spec(x.shape, dtype)], fn=fn)
    _assert_paths_agree(_both_paths(op, [x], Rect((0, 1, 0), (6, 4, 33))), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,tile", [((4, 7, 37), None), ((3, 300), None), ((5, 1), None),
                                        ((4, 7, 37), Rect((1, 2, 0), (3, 6, 37)))])
def test_fused_softmax_matches_the_cpu(shape, tile, dtype):
    from ops.activation import Softmax
    x = 4 * _normal(shape, dtype)
    _assert_paths_agree(_both_paths(Softmax("sm", [_spec(shape, dtype)]), [x], tile), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_fused_softmax_matches_the_cpu(causal, dtype):
    from ops.attention import MultiHeadAttention
    x = _normal((3, 11, 8), dtype)
    op = MultiHeadAttention("mha", [_spec(x.shape, dtype)] * 3, num_heads=2, causal=causal)
    _assert_paths_agree(_both_paths(op, [x, x, x], Rect((0, 3, 0, 0), (2, 9, 8, 2))), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,normalized,affine", [((4, 7, 33), (33,), True), ((4, 7, 300), (300,), False),
                                                      ((3, 5, 6, 7), (6, 7), True)])
def test_fused_layer_norm_matches_the_cpu(shape, normalized, affine, dtype):
    from ops.norm import LayerNorm
    x = 5 + 2 * _normal(shape, dtype)
    op = LayerNorm("ln", [_spec(shape, dtype)], normalized_shape=normalized, elementwise_affine=affine)
    tile = Rect((1,) + (0,) * (len(shape) - 1), (3,) + shape[1:])
    _assert_paths_agree(_both_paths(op, [x], tile), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape,tile", [((4, 6, 5, 7), Rect((0, 2, 0, 0), (4, 5, 5, 7))), ((9, 5), None)])
def test_fused_batch_norm_matches_the_cpu(shape, tile, training, relu, dtype):
    from ops.norm import BatchNorm
    x = 3 + _normal(shape, dtype)
    op = BatchNorm("bn", [_spec(shape, dtype)], relu=relu)
    _assert_paths_agree(_both_paths(op, [x], tile, training=training), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel,stride,padding", [(3, 2, 1), (2, 2, 0), (3, 1, 1), ((1, 3), (2, 1), (0, 1))])
@pytest.mark.parametrize("tile", [None, Rect((0, 1, 2, 1), (2, 3, 4, 4))])
def test_fused_max_pool_matches_the_cpu(kernel, stride, padding, tile, dtype):
    from ops.pool import Pool2d
    x = _normal((2, 3, 9, 11), dtype)
    x[0, 0, 0, :3] = 1.5  # ties: the first maximum wins
    op = Pool2d("pool", [_spec(x.shape, dtype)], kernel=kernel, stride=stride, padding=padding)
    if tile is not None and any(h > s for h, s in zip(tile.hi, op.tile_shape)):
        tile = Rect(tile.lo, tuple(min(h, s) for h, s in zip(tile.hi, op.tile_shape)))
    _assert_paths_agree(_both_paths(op, [x], tile), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_lstm_steps_match_the_cpu(dtype):
    from ops.lstm import LSTM
    x = _normal((4, 6, 5), dtype)
    op = LSTM("lstm", [_spec(x.shape, dtype)], hidden_size=7)
    _assert_paths_agree(_both_paths(op, [x], Rect((1, 0, 0), (3, 6, 7))), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel,stride,padding,groups", [(3, 1, 1, 1), (3, 2, 1, 1), ((1, 7), 1, (0, 3), 1),
                                                          (3, 1, 0, 2), (1, 1, 0, 1), (5, 3, 2, 1)])
@pytest.mark.parametrize("tiled", [False, True])
def test_fused_im2col_convolution_matches_the_cpu(kernel, stride, padding, groups, tiled, dtype):
    from ops.conv import Conv2d
    x = _normal((3, 4, 13, 12), dtype)
    op = Conv2d("conv", [_spec(x.shape, dtype)], out_channels=6, kernel=kernel, stride=stride, padding=padding,
                groups=groups, use_bias=True)
    shape = op.tile_shape
    tile = Rect((1, 2, 1, 0), (3, shape[1], shape[2], shape[3] - 1)) if tiled else None
    _assert_paths_agree(_both_paths(op, [x], tile), dtype)


@pytest.mark.parametrize("activation", ["relu", "sigmoid", "tanh", "gelu"])
def test_dense_with_a_fused_activation_matches_the_cpu(activation):
    """Dense saves x for gelu's backward only: the others' kernels must not need it."""
    from ops.linear import Dense
    x = _normal((5, 9), "float32")
    op = Dense("fc", [_spec(x.shape, "float32")], out_features=7, activation=activation)
    _assert_paths_agree(_both_paths(op, [x]), "float32")
