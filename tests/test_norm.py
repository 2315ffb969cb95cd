"""BatchNorm and LayerNorm against PyTorch, finite differences and every tiling."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from threadpoolctl import threadpool_limits

from ops import cpu_threads, norm
from ops.base import ATTRIBUTE, OP_REGISTRY, PARAMETER, SAMPLE, ShapeError
from ops.norm import BatchNorm, LayerNorm
from taskrt.geometry import Rect
from tests.opcheck import check_finite_differences, check_tiled, run_whole, spec
from tests.test_activation import tile_view
from tests.opcheck import ArrayCodePath


def bn_data(op, seed=0, dtype=np.float32):
    """Random gamma/beta, running stats away from their defaults, and an input with a non-zero mean."""
    rng = np.random.default_rng(seed)
    c = op.inputs[0].shape[1]
    weights = {"weight": rng.standard_normal(c), "bias": rng.standard_normal(c)}
    state = {"running_mean": rng.standard_normal(c), "running_var": rng.uniform(0.5, 2.0, c)}
    x = 2 * rng.standard_normal(op.inputs[0].shape) + 1
    g = rng.standard_normal(op.inputs[0].shape)
    weights = {k: v.astype(dtype) for k, v in weights.items()}
    state = {k: v.astype(dtype) for k, v in state.items()}
    return x.astype(dtype), weights, state, g.astype(dtype)


def torch_bn(op, x, weights, state, g, training):
    """Output, grads and updated running stats from F.batch_norm (+ relu)."""
    xt = torch.tensor(x, requires_grad=True)
    wt = torch.tensor(weights["weight"], requires_grad=True)
    bt = torch.tensor(weights["bias"], requires_grad=True)
    rm, rv = torch.tensor(state["running_mean"]), torch.tensor(state["running_var"])
    yt = F.batch_norm(xt, rm, rv, wt, bt, training=training, momentum=op.momentum, eps=op.eps)
    if op.relu:
        yt = torch.relu(yt)
    yt.backward(torch.tensor(g))
    return yt.detach().numpy(), xt.grad.numpy(), wt.grad.numpy(), bt.grad.numpy(), rm.numpy(), rv.numpy()


@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (7, 5), (2, 5, 3, 1)])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_matches_torch_finite_differences_and_tiles(shape, relu, training):
    op = BatchNorm("bn", [spec(shape)], relu=relu, momentum=0.2)
    x, weights, state, g = bn_data(op)
    st_ = {k: v.copy() for k, v in state.items()}
    (y,), (gx,), gw, new_state = run_whole(op, [x], weights, [g], training=training, state=st_)
    ty, tgx, tgw, tgb, trm, trv = torch_bn(op, x, weights, state, g, training)
    assert y.dtype == np.float32 and y.shape == shape
    np.testing.assert_allclose(y, ty, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gx, tgx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gw["weight"], tgw, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gw["bias"], tgb, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(new_state["running_mean"], trm, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_state["running_var"], trv, rtol=1e-5, atol=1e-6)
    check_tiled(op, [x], weights, [g], rtol=1e-5, atol=1e-5, training=training, state=state)
    # without a state the running stats come from the weights (inference) or are not updated (training)
    check_finite_differences(op, [x], weights if training else {**weights, **state}, training=training)


@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (7, 5)])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_takes_its_epsilon_into_the_variance(shape, training):
    """eps 0.5 against variances about 4 (training) and 0.5-2 (the running ones): at the default
    1e-5 its share is within the tolerances, so a kernel that left it out passed."""
    op = BatchNorm("bn", [spec(shape)], eps=0.5)
    x, weights, state, g = bn_data(op)
    (y,), (gx,), _, _ = run_whole(op, [x], weights, [g], training=training, state={k: v.copy() for k, v in state.items()})
    ty, tgx, *_ = torch_bn(op, x, weights, state, g, training)
    np.testing.assert_allclose(y, ty, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gx, tgx, rtol=1e-4, atol=1e-4)


def test_batch_norm_running_stats_update_in_place_and_only_in_training():
    op = BatchNorm("bn", [spec((6, 2, 3, 3))], momentum=0.1)
    x, weights, state, g = bn_data(op, seed=2)
    tile = Rect.from_shape(op.tile_shape)
    st_ = {k: v.copy() for k, v in state.items()}
    before = {k: v for k, v in st_.items()}
    op.forward(np, tile, [x], [tile], weights, training=True, state=st_)
    assert all(st_[k] is before[k] for k in st_)  # updated in place
    n = x.size // 2
    mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3)) * n / (n - 1)
    np.testing.assert_allclose(st_["running_mean"], 0.9 * state["running_mean"] + 0.1 * mean, rtol=1e-5)
    np.testing.assert_allclose(st_["running_var"], 0.9 * state["running_var"] + 0.1 * var, rtol=1e-5)
    frozen = {k: v.copy() for k, v in state.items()}
    op.forward(np, tile, [x], [tile], weights, training=False, state=frozen)
    for k in state:
        np.testing.assert_array_equal(frozen[k], state[k])


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_numba_kernels_match_the_array_code(relu, training):
    """The CPU kernels and the array code (the GPU path), on a channel tile of a bigger read-only array."""
    shape = (3, 4, 5, 6)
    op = BatchNorm("bn", [spec(shape, "float64")], relu=relu)
    x, weights, state, g = bn_data(op, seed=3, dtype=np.float64)
    wide = np.zeros((shape[0], shape[1] + 2, *shape[2:]))
    wide[:, 1:-1] = x
    wide = wide[:, 1:-1]  # a channel tile of a bigger array: not contiguous
    wide.flags.writeable = False  # as the runtime passes inputs
    tile = Rect.from_shape(shape)
    results = []
    for xp in (np, ArrayCodePath()):
        st_ = {k: v.copy() for k, v in state.items()}
        (y,), saved = op.forward(xp, tile, [wide], [tile], weights, training=training, state=st_)
        (gx,), gw = op.backward(xp, tile, [wide], [tile], weights, [y], [g], saved)
        results.append([y, gx, gw["weight"], gw["bias"], *st_.values()])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("relu", [False, True])
def test_batch_norm_passes_over_channel_ranges_on_several_cores_match_one_core(monkeypatch, relu):
    """Each kernel run once a core of the task over its range of channels (5 channels on 3
    cores, of a channel tile of a bigger array) gives what one run over all of them gives."""
    shape = (3, 5, 4, 6)
    op = BatchNorm("bn", [spec(shape)], relu=relu)
    x, weights, state, g = bn_data(op, seed=4)
    wide = np.zeros((shape[0], shape[1] + 2, *shape[2:]), np.float32)
    wide[:, 1:-1] = x
    wide = wide[:, 1:-1]
    wide.flags.writeable = False
    tile = Rect.from_shape(shape)
    monkeypatch.setattr(norm, "PARALLEL_MIN_VALUES", 1)
    runs = {}

    def counted(name, kernel):
        def run(*args):
            runs[name] = runs.get(name, 0) + 1
            return kernel(*args)
        return run
    for name in ("_bn_moments_cpu", "_bn_apply_cpu", "_bn_grad_sums_cpu", "_bn_dx_cpu"):
        monkeypatch.setattr(norm, name, counted(name, getattr(norm, name)))
    results = []
    for cores in (1, 3):
        runs.clear()
        with threadpool_limits(limits=cores, user_api="blas"):
            st_ = {k: v.copy() for k, v in state.items()}
            (y,), saved = op.forward(np, tile, [wide], [tile], weights, training=True, state=st_)
            (gx,), gw = op.backward(np, tile, [wide], [tile], weights, [y], [g], saved)
            parts = min(3, cpu_threads.task_threads())
        assert runs == dict.fromkeys(runs, parts) and len(runs) == 4, (cores, runs)
        results.append([y, gx, gw["weight"], gw["bias"], *st_.values()])
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("relu", [False, True])
def test_batch_norm_sample_tiles_with_added_up_sums_agree_on_both_code_paths(relu):
    """Two sample tiles, their sums added up, through the CPU kernels and the array code (the GPU path)."""
    shape = (4, 3, 5, 6)
    op = BatchNorm("bn", [spec(shape, "float64")], relu=relu)
    x, weights, state, g = bn_data(op, seed=6, dtype=np.float64)
    tiles = [Rect((0, 0, 0, 0), (2, 3, 5, 6)), Rect((2, 0, 0, 0), (4, 3, 5, 6))]
    results = []
    for xp in (np, ArrayCodePath()):
        sums = {"moments": np.zeros((2, 3)), "grad": np.zeros((2, 3))}
        for name in op.forward_sums(True):
            for t in tiles:
                sums[name] += op.partial_sum(xp, name, t, [x[t.slices()]], sums)
        runs = [op.forward(xp, t, [x[t.slices()]], [t], weights, sums=sums) for t in tiles]
        for t, ((y,), saved) in zip(tiles, runs):
            sums["grad"] += op.partial_sum(xp, "grad", t, [x[t.slices()]], sums, [y], [g[t.slices()]], saved)
        out = []
        for t, ((y,), saved) in zip(tiles, runs):
            (gx,), gw = op.backward(xp, t, [x[t.slices()]], [t], weights, [y], [g[t.slices()]], saved, sums=sums)
            out += [y, gx, gw["weight"], gw["bias"]]
        results.append(out)
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_batch_norm_variance_stays_accurate_with_a_large_mean():
    op = BatchNorm("bn", [spec((8, 3, 6, 6), "float64")], momentum=1.0)
    rng = np.random.default_rng(4)
    x = 1e7 + rng.standard_normal(op.inputs[0].shape)
    weights = {"weight": np.ones(3), "bias": np.zeros(3)}
    state = {"running_mean": np.zeros(3), "running_var": np.ones(3)}
    (y,), _, _, st_ = run_whole(op, [x], weights, state=state)
    np.testing.assert_allclose(st_["running_var"], x.var(axis=(0, 2, 3), ddof=1), rtol=1e-9)
    np.testing.assert_allclose(y.std(axis=(0, 2, 3)), 1, rtol=1e-5)


def test_batch_norm_rules_and_init():
    op = BatchNorm("bn", [spec((8, 6, 4, 4))], relu=True)
    assert [(s.dim, s.kind) for s in op.split_dims()] == [(0, SAMPLE), (1, PARAMETER), (2, ATTRIBUTE),
                                                          (3, ATTRIBUTE)]
    tile = Rect((0, 2, 0, 0), (8, 5, 4, 4))
    assert op.input_rects(tile) == [tile]
    assert op.weight_rects(tile) == {k: Rect((2,), (5,)) for k in ("weight", "bias", "running_mean", "running_var")}
    # statistics: shared by tiles that split a channel's values, not by a channel split
    assert op.sum_shapes() == {"moments": (2, 6), "grad": (2, 6)}
    assert op.sum_rects(tile) == {"moments": Rect((0, 2), (2, 5)), "grad": Rect((0, 2), (2, 5))}
    assert op.forward_sums(True) == ("moments",) and op.forward_sums(False) == () and op.backward_sums() == ("grad",)
    assert not op.shares_sums([Rect((0, 0, 0, 0), (8, 3, 4, 4)), Rect((0, 3, 0, 0), (8, 6, 4, 4))])
    assert op.shares_sums([Rect((0, 0, 0, 0), (4, 6, 4, 4)), Rect((4, 0, 0, 0), (8, 6, 4, 4))])
    init = op.init_weights(np.random.default_rng(0))
    np.testing.assert_array_equal(init["weight"], np.ones(6, np.float32))
    np.testing.assert_array_equal(init["bias"], np.zeros(6, np.float32))
    np.testing.assert_array_equal(init["running_mean"], np.zeros(6, np.float32))
    np.testing.assert_array_equal(init["running_var"], np.ones(6, np.float32))
    assert op.weight_shapes() == {"weight": (6,), "bias": (6,)}
    assert op.state_shapes() == {"running_mean": (6,), "running_var": (6,)}
    assert op.has_training_mode and op.attrs() == {"eps": 1e-5, "momentum": 0.1, "relu": True}
    assert op.flops(tile) == 8 * tile.volume and op.bytes_moved(tile) > 0
    assert OP_REGISTRY["batch_norm"] is BatchNorm and OP_REGISTRY["layer_norm"] is LayerNorm


def test_batch_norm_statistics_added_up_across_tiles_stay_accurate():
    """float32 values of mean 1000 and spread 0.01, split over samples and rows: the moments are
    added up in float64, so E[x^2] - E[x]^2 keeps the variance to about 1e-16 (mean/std)^2 = 1e-6."""
    op = BatchNorm("bn", [spec((8, 3, 6, 6))], momentum=1.0)
    rng = np.random.default_rng(5)
    x = (1000 + 0.01 * rng.standard_normal(op.inputs[0].shape)).astype(np.float32)
    tiles = [Rect((n, 0, h, 0), (n + 4, 3, h + 3, 6)) for n in (0, 4) for h in (0, 3)]
    total = np.zeros((2, 3))
    for t in tiles:
        total += op.partial_sum(np, "moments", t, [x[t.slices()]], {})
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(total[0], x64.mean(axis=(0, 2, 3)), rtol=1e-12)
    np.testing.assert_allclose(total[1] - total[0] ** 2, x64.var(axis=(0, 2, 3)), rtol=1e-5)
    weights = {"weight": np.ones(3, np.float32), "bias": np.zeros(3, np.float32)}
    state = {"running_mean": np.zeros(3, np.float32), "running_var": np.ones(3, np.float32)}
    # float32 holds these values to 6e-5, 0.6% of their spread: normalized outputs of tilings
    # whose statistics differ in the last digits may differ by that much
    check_tiled(op, [x], weights, [rng.standard_normal(x.shape).astype(np.float32)], rtol=1e-4, atol=2e-2,
                state=state)


def test_batch_norm_bad_inputs_name_the_op():
    with pytest.raises(ShapeError, match=r"batch_norm 'bn': expects an \[N, C\] or NCHW input, got shape \(2, 3, 4\)"):
        BatchNorm("bn", [spec((2, 3, 4))])
    op = BatchNorm("bn", [spec((1, 3))])
    x = np.ones((1, 3), np.float32)
    with pytest.raises(ShapeError, match=r"batch_norm 'bn': needs more than 1 value per channel in training"):
        run_whole(op, [x], {"weight": np.ones(3, np.float32), "bias": np.zeros(3, np.float32)})
    assert op.training_problem() == "needs more than 1 value per channel in training, got 1"
    assert BatchNorm("bn", [spec((1, 3, 1, 2))]).training_problem() is None


def test_a_model_whose_batch_norm_cannot_train_predicts_and_refuses_to_train_before_any_work():
    """One value a channel: the batch norm normalizes with its running statistics in inference
    (predict, evaluate), as PyTorch's does in eval mode; training is refused up front (it was
    refused at compile, so such a model could not even predict)."""
    from ops import Model
    from taskrt import Runtime
    rt = Runtime(cpus=1)
    try:
        m = Model(runtime=rt)
        m.dense(m.flat(m.batch_norm(m.input((1, 3, 1, 1), name="x"), name="bn")), 2, name="fc")
        m.compile()
        x = np.array([[[[1.0]], [[-2.0]], [[0.5]]]], np.float32)
        w = m.parameters()
        stats = m.stats()
        normed = ((x.reshape(1, 3) - stats["bn.running_mean"]) / np.sqrt(stats["bn.running_var"] + 1e-5)
                  * w["bn.weight"] + w["bn.bias"])
        np.testing.assert_allclose(m.predict(x), normed @ w["fc.weight"].T + w["fc.bias"], rtol=1e-5, atol=1e-6)
        assert np.isfinite(m.evaluate(x, np.array([1]))["loss"])
        said = (r"batch_norm 'bn': needs more than 1 value per channel in training, got 1 \(input shapes "
                r"\[\(1, 3, 1, 1\)\]\); predict and evaluate run in inference mode")
        issued = rt.issued
        for what, call in (("fit", lambda: m.fit(x, np.array([1]), iterations=1, verbose=False)),
                           ("forward", lambda: m.forward(x)),
                           ("train_on", lambda: m.train_on(lambda step, lo, hi: (x, np.array([1])), 1))):
            with pytest.raises(ShapeError, match=f"^{what}: " + said):
                call()
        assert rt.issued == issued
        (out,) = m.forward(x, training=False).values()
        np.testing.assert_allclose(out, m.predict(x))
    finally:
        rt.shutdown()


def ln_data(shape, normalized_shape, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    weights = {"weight": rng.standard_normal(normalized_shape).astype(dtype),
               "bias": rng.standard_normal(normalized_shape).astype(dtype)}
    return (3 * rng.standard_normal(shape) - 1).astype(dtype), weights, rng.standard_normal(shape).astype(dtype)


def ln_check(shape, normalized_shape, affine=True, seed=0):
    op = LayerNorm("ln", [spec(shape)], normalized_shape=normalized_shape, elementwise_affine=affine)
    x, weights, g = ln_data(shape, op.normalized_shape, seed)
    if not affine:
        weights = {}
    (y,), (gx,), gw, _ = run_whole(op, [x], weights, [g])
    want = _torch_layer_norm(op, x, weights, g, torch.float64)
    torch32 = _torch_layer_norm(op, x, weights, g, torch.float32)
    ours = {"y": y, "x": gx, **gw}
    assert ours.keys() == want.keys()
    for k, truth in want.items():
        # against float64 PyTorch, as close as 1e-4, or as PyTorch's own float32 comes where the
        # rows are ill-conditioned (a short row of nearly equal values: float32 loses digits)
        slack = 4 * np.abs(torch32[k] - truth).max()
        np.testing.assert_allclose(ours[k], truth, rtol=1e-4, atol=max(1e-5 if k == "y" else 1e-4, slack), err_msg=k)
    check_tiled(op, [x], weights, [g], rtol=1e-5, atol=1e-5)
    return op, x, weights


def _torch_layer_norm(op, x, weights, g, dtype) -> dict:
    """PyTorch's layer norm in `dtype`: {"y": output, "x": dx, weight name: its gradient}."""
    xt = torch.tensor(x, dtype=dtype, requires_grad=True)
    wt = {k: torch.tensor(v, dtype=dtype, requires_grad=True) for k, v in weights.items()}
    yt = F.layer_norm(xt, op.normalized_shape, wt.get("weight"), wt.get("bias"), eps=op.eps)
    yt.backward(torch.tensor(g, dtype=dtype))
    return {"y": yt.detach().numpy(), "x": xt.grad.numpy(), **{k: v.grad.numpy() for k, v in wt.items()}}


@pytest.mark.parametrize("shape,normalized_shape", [((4, 7), 7), ((3, 4, 6), (6,)), ((2, 3, 4, 5), (4, 5)),
                                                    ((2, 3, 5), (3, 5))])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_matches_torch_finite_differences_and_tiles(shape, normalized_shape, affine):
    op, x, weights = ln_check(shape, normalized_shape, affine)
    check_finite_differences(op, [x], weights)


@settings(max_examples=15, deadline=None)
@given(shape=st.lists(st.integers(1, 5), min_size=2, max_size=4).map(tuple), data=st.data())
def test_layer_norm_any_shape(shape, data):
    k = data.draw(st.integers(1, len(shape) - 1))
    normalized = shape[len(shape) - k:]
    # over a single element x - mean is exactly 0 here but rounding noise (times 1/sqrt(eps)) in torch
    assume(np.prod(normalized) > 1)
    seed = data.draw(st.integers(0, 2**16))
    # a row whose values nearly agree divides float32 rounding of x - mean by a tiny std, in
    # torch and here alike, so the two gradients differ by noise, not by a bug
    x = ln_data(shape, normalized, seed)[0].astype(np.float64)
    assume(x.reshape(-1, int(np.prod(normalized))).std(axis=1).min() > 0.05)
    ln_check(shape, normalized, seed=seed)


def test_layer_norm_rules():
    op = LayerNorm("ln", [spec((4, 5, 6, 7))], normalized_shape=(6, 7))
    assert [(s.dim, s.kind) for s in op.split_dims()] == [(0, SAMPLE), (1, ATTRIBUTE)]
    assert op.weight_shapes() == {"weight": (6, 7), "bias": (6, 7)}
    tile = Rect((1, 2, 0, 0), (3, 5, 6, 7))
    assert op.input_rects(tile) == [tile]
    assert op.weight_rects(tile) == {"weight": Rect.from_shape((6, 7)), "bias": Rect.from_shape((6, 7))}
    assert op.attrs() == {"normalized_shape": (6, 7), "eps": 1e-5, "elementwise_affine": True}
    assert op.flops(tile) == 8 * tile.volume


def test_layer_norm_bad_inputs_name_the_op():
    with pytest.raises(ShapeError,
                       match=r"layer_norm 'ln': normalized_shape \(5,\) is not the trailing dims of shape \(4, 6\)"):
        LayerNorm("ln", [spec((4, 6))], normalized_shape=5)
    with pytest.raises(ShapeError, match=r"layer_norm 'ln': normalized_shape \(2, 3, 4\) is not the trailing dims"):
        LayerNorm("ln", [spec((3, 4))], normalized_shape=(2, 3, 4))


def layer_norm64(x, normalized_shape, weights, g, eps=1e-5):
    """y and the grads of x, weight and bias from F.layer_norm in float64 on x's values."""
    xt = torch.tensor(x.astype(np.float64), requires_grad=True)
    wt = {k: torch.tensor(v.astype(np.float64), requires_grad=True) for k, v in weights.items()}
    yt = F.layer_norm(xt, normalized_shape, wt.get("weight"), wt.get("bias"), eps=eps)
    yt.backward(torch.tensor(g.astype(np.float64)))
    return yt.detach().numpy(), xt.grad.numpy(), {k: t.grad.numpy() for k, t in wt.items()}


@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=2, max_size=4).map(tuple), data=st.data(),
       affine=st.booleans(), dtype=st.sampled_from([np.float32, np.float64]),
       pads=st.lists(st.integers(0, 2), min_size=3, max_size=3), strided_rows=st.booleans())
def test_layer_norm_kernels_match_torch_and_the_array_code_on_tile_views(shape, data, affine, dtype, pads,
                                                                         strided_rows):
    """Forward and backward on a read-only view into a bigger array (as a tile arrives), through
    the CPU kernels and the array code (the GPU path), against torch in float64."""
    k = data.draw(st.integers(1, len(shape) - 1))
    normalized = shape[len(shape) - k:]
    assume(np.prod(normalized) > 1)
    x, weights, g = ln_data(shape, normalized, data.draw(st.integers(0, 2**16)), dtype)
    assume(x.reshape(-1, int(np.prod(normalized))).std(axis=1).min() > 0.05)  # see test_layer_norm_any_shape
    weights = weights if affine else {}
    x, g = tile_view(x, pads, strided_rows), tile_view(g, pads[::-1])
    op = LayerNorm("ln", [spec(shape, np.dtype(dtype).name)], normalized_shape=normalized, elementwise_affine=affine)
    ref_y, ref_dx, ref_gw = layer_norm64(x, normalized, weights, g)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-10)
    tile = Rect.from_shape(shape)
    for xp in (np, ArrayCodePath()):
        (y,), saved = op.forward(xp, tile, [x], [tile], weights)
        (dx,), gw = op.backward(xp, tile, [x], [tile], weights, [y], [g], saved)
        assert y.dtype == dtype and dx.dtype == dtype and set(gw) == set(weights)
        np.testing.assert_allclose(y, ref_y, **tol)
        np.testing.assert_allclose(dx, ref_dx, **tol)
        for name in gw:
            assert gw[name].dtype == dtype and gw[name].shape == normalized
            np.testing.assert_allclose(gw[name], ref_gw[name], **tol)
