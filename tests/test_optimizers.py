"""SGD and Adam against torch.optim step by step, tiled updates, saving, and argument checks."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ops.optimizers import SGD, Adam, optimizer_from_dict

STEPS = 6


def torch_optimizer(opt, params):
    if isinstance(opt, SGD):
        return torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay,
                               nesterov=opt.nesterov)
    return torch.optim.Adam(params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay)


def run_both(opt, shape=(4, 5), steps=STEPS, seed=0):
    """Our updates and torch.optim's on the same float64 params and gradient sequence."""
    rng = np.random.default_rng(seed)
    ours = rng.standard_normal(shape)
    grads = [rng.standard_normal(shape) for _ in range(steps)]
    theirs = torch.tensor(ours.copy(), requires_grad=True)
    topt = torch_optimizer(opt, [theirs])
    state = opt.init_state(np, ours)
    assert set(state) == set(opt.state_names())
    for step, g in enumerate(grads, start=1):
        opt.update(np, ours, g, state, step)
        theirs.grad = torch.tensor(g)
        topt.step()
        np.testing.assert_allclose(ours, theirs.detach().numpy(), rtol=1e-6, atol=1e-12,
                                   err_msg=f"{opt} step {step}")
    return ours, state


SGDS = [SGD(lr=0.1), SGD(lr=0.05, momentum=0.9), SGD(lr=0.05, momentum=0.9, nesterov=True),
        SGD(lr=0.02, momentum=0.5, weight_decay=0.01), SGD(lr=0.1, weight_decay=0.1)]
ADAMS = [Adam(), Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1), Adam(lr=0.5, betas=(0.0, 0.5))]


@pytest.mark.parametrize("opt", SGDS + ADAMS, ids=repr)
def test_matches_torch_optim(opt):
    run_both(opt)


def test_momentum_state_matches_torch_buffer():
    opt = SGD(lr=0.1, momentum=0.9)
    rng = np.random.default_rng(1)
    ours = rng.standard_normal(5)
    theirs = torch.tensor(ours.copy(), requires_grad=True)
    topt = torch_optimizer(opt, [theirs])
    state = opt.init_state(np, ours)
    for step in range(1, 4):
        g = rng.standard_normal(5)
        opt.update(np, ours, g, state, step)
        theirs.grad = torch.tensor(g)
        topt.step()
    np.testing.assert_allclose(state["momentum"], topt.state[theirs]["momentum_buffer"].numpy(), rtol=1e-12)


@pytest.mark.parametrize("opt", SGDS + ADAMS, ids=repr)
def test_update_on_tiles_equals_update_on_the_whole(opt):
    rng = np.random.default_rng(2)
    whole = rng.standard_normal((6, 4))
    tiled = whole.copy()
    s_whole, s_tiled = opt.init_state(np, whole), opt.init_state(np, tiled)
    halves = [(slice(0, 3), slice(None)), (slice(3, 6), slice(None))]
    columns = [(slice(None), slice(0, 1)), (slice(None), slice(1, 4))]
    for step in range(1, STEPS + 1):
        g = rng.standard_normal(whole.shape)
        opt.update(np, whole, g, s_whole, step)
        # the row halves on odd steps, the (non-contiguous) column pieces on even steps
        for idx in (halves if step % 2 else columns):
            opt.update(np, tiled[idx], g[idx], {k: v[idx] for k, v in s_tiled.items()}, step)
        np.testing.assert_array_equal(tiled, whole)
        for k in s_whole:
            np.testing.assert_array_equal(s_tiled[k], s_whole[k])


def test_update_is_in_place_and_leaves_the_gradient_alone():
    opt = Adam(weight_decay=0.1)
    p = np.ones(3, np.float32)
    g = np.full(3, 0.5, np.float32)
    state = opt.init_state(np, p)
    opt.update(np, p, g, state, 1)
    assert p.dtype == np.float32 and np.all(p < 1)  # p itself changed: the update is in place
    np.testing.assert_array_equal(g, np.full(3, 0.5, np.float32))
    assert state["exp_avg"].dtype == np.float32 and np.all(state["exp_avg_sq"] > 0)


def test_state_names():
    assert SGD().state_names() == ()
    assert SGD(momentum=0.9).state_names() == ("momentum",)
    assert Adam().state_names() == ("exp_avg", "exp_avg_sq")
    assert SGD().init_state(np, np.zeros(3)) == {}


@pytest.mark.parametrize("opt", SGDS + ADAMS, ids=repr)
def test_to_dict_round_trips_through_json(opt):
    d = json.loads(json.dumps(opt.to_dict()))
    assert d["kind"] in ("sgd", "adam")
    assert optimizer_from_dict(d) == opt


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match=r"SGD: lr must be a number in \(0.0, inf\), got 0"):
        SGD(lr=0)
    with pytest.raises(ValueError, match=r"SGD: momentum must be a number in \[0.0, inf\), got -0.5"):
        SGD(momentum=-0.5)
    with pytest.raises(ValueError, match=r"SGD: weight_decay must be a number .* got -1"):
        SGD(weight_decay=-1)
    with pytest.raises(ValueError, match=r"SGD: nesterov=True needs momentum > 0, got momentum=0.0"):
        SGD(nesterov=True)
    with pytest.raises(ValueError, match=r"Adam: lr must be a number in \(0.0, inf\), got -0.001"):
        Adam(lr=-1e-3)
    with pytest.raises(ValueError, match=r"Adam: betas\[1\] must be a number in \[0.0, 1.0\), got 1.0"):
        Adam(betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"Adam: betas must be a pair \(beta1, beta2\), got \(0.9,\)"):
        Adam(betas=(0.9,))
    with pytest.raises(ValueError, match=r"Adam: eps must be a number .* got nan"):
        Adam(eps=float("nan"))
    # numpy's real numbers are numbers (np.float32(0.1) was refused as out of (0, inf)), kept as floats
    assert SGD(lr=np.float32(0.5), momentum=np.float64(0.9)) == SGD(lr=0.5, momentum=0.9)
    assert type(Adam(lr=np.float32(0.5)).lr) is float and type(SGD(lr=1).lr) is float
    with pytest.raises(ValueError, match=r"SGD: lr must be a number .* got np.True_"):
        SGD(lr=np.bool_(True))
    with pytest.raises(ValueError, match=r"Adam: eps must be a number in \(0.0, inf\), got 0.0"):
        Adam(eps=0.0)   # (an update where a gradient's second moment is 0 divided by zero)
    with pytest.raises(ValueError, match=r"Adam: lr must be a number .* got '0.1'"):
        Adam(lr="0.1")
    with pytest.raises(ValueError, match=r"Adam.update: step is 1-based and must be an int >= 1, got 0"):
        Adam().update(np, np.zeros(2), np.zeros(2), Adam().init_state(np, np.zeros(2)), 0)
    with pytest.raises(ValueError, match=r"unknown optimizer 'rmsprop'; expected one of \['adam', 'sgd'\]"):
        optimizer_from_dict({"kind": "rmsprop", "lr": 0.1})
    with pytest.raises(ValueError, match=r"bad sgd optimizer settings"):
        optimizer_from_dict({"kind": "sgd", "lr": 0.1, "beta": 3})


@settings(max_examples=15, deadline=None)
@given(lr=st.floats(1e-4, 1.0), momentum=st.sampled_from([0.0, 0.5, 0.9]), nesterov=st.booleans(),
       wd=st.sampled_from([0.0, 1e-3, 0.1]), beta1=st.floats(0.0, 0.99), beta2=st.floats(0.5, 0.9999),
       seed=st.integers(0, 2**16))
def test_random_settings_match_torch(lr, momentum, nesterov, wd, beta1, beta2, seed):
    run_both(SGD(lr=lr, momentum=momentum, nesterov=nesterov and momentum > 0, weight_decay=wd),
             shape=(7,), steps=4, seed=seed)
    run_both(Adam(lr=lr, betas=(beta1, beta2), weight_decay=wd), shape=(7,), steps=4, seed=seed)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(SGDS + ADAMS + [SGD(lr=0.3, momentum=0.7, weight_decay=0.05, nesterov=True)]),
       st.sampled_from([np.float32, np.float64]), st.integers(1, 40), st.integers(0, 2**32 - 1))
def test_an_update_in_one_pass_gives_the_numpy_rules_bits(opt, dtype, n, seed):
    """Contiguous arrays take the compiled one-pass update; others (here the same values in
    Fortran order) take numpy's expressions: the same bits after several steps, state included."""
    rng = np.random.default_rng(seed)
    start = rng.standard_normal((n, 3)).astype(dtype)
    fast, slow = start.copy(), np.asfortranarray(start.copy())
    fast_state, slow_state = opt.init_state(np, fast), {k: np.asfortranarray(v) for k, v in opt.init_state(np, slow).items()}
    for step in range(1, 5):
        g = (rng.standard_normal((n, 3)) * (rng.random((n, 1)) < 0.7)).astype(dtype)   # some zero rows
        opt.update(np, fast, g, fast_state, step)
        opt.update(np, slow, np.asfortranarray(g), slow_state, step)
    assert fast.dtype == dtype and np.array_equal(fast, slow)
    assert all(np.array_equal(fast_state[k], slow_state[k]) for k in fast_state)
