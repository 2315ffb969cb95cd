"""The GPU path (cupy) against the CPU path: the same programs and models, placed on a GPU,
give the CPU's numbers. Needs a GPU that cupy sees; CI machines have none, so there the
module reports itself skipped (run it on a GPU machine: `pytest tests/test_gpu.py`)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from ops import SGD, Model
from taskrt import Machine, Runtime
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
