"""Baseline strategies and random configs (strategies/): each is valid on every machine, splits
what its rule says by the kinds the ops declare, and trains as one device does."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ops import SGD, Model, TileConfig, default_config, model_fingerprint
from ops.activation import ElementUnary
from ops.attention import MultiHeadAttention
from ops.base import ATTRIBUTE, PARAMETER, REDUCE, SAMPLE, SplitDim
from ops.conv import Conv2d
from ops.pool import Pool2d
from ops.linear import Dense
from ops.lower import compute_devices, resolve_config
from strategies import (BASELINES, data_parallel, expert, model_parallel, random_config, random_strategy,
                        tensor_parallel)
from strategies.baselines import reduce_dim
from strategies.random import proposal_config, tile_counts
from taskrt import Machine, Runtime
from tests.opcheck import spec

MACHINE4 = Machine.build(1, 4)
GPUS = Machine.build(2, cpus_per_rank=2, gpus_per_rank=2)  # devices 0-3: the 4 GPUs, processors 2, 3, 6, 7


@pytest.fixture(scope="module")
def rt():
    with Runtime(cpus=4, separate_memories=True) as rt:
        yield rt


def cnn(rt=None, seed=0) -> Model:
    m = Model(rt if rt is not None else Runtime(execute=False, machine=MACHINE4), seed=seed)
    x = m.input((8, 3, 8, 8))
    h = m.relu(m.batch_norm(m.conv2d(x, 6, 3, padding=1)))
    h = m.flat(m.pool2d(h, 2))
    h = m.dense(h, 16, activation="relu")
    h = m.gelu(m.dense(h, 12))
    m.softmax(m.dense(h, 4))
    return m


def attention_net(rt=None, seed=0) -> Model:
    m = Model(rt if rt is not None else Runtime(execute=False, machine=MACHINE4), seed=seed)
    x = m.input((4, 6, 8))
    h = m.layer_norm(m.add(x, m.multihead_attention(x, num_heads=2)))
    h = m.dense(m.dense(h, 16, activation="gelu"), 8)
    m.dense(m.flat(h), 3)
    return m


def kinds(op, config: TileConfig) -> set[str]:
    """The SOAP kinds of the dims a config splits."""
    declared = {s.dim: s.kind for s in op.split_dims()}
    return {declared[d] for d, deg in enumerate(config.degrees) if deg > 1}


# ---- every baseline ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(BASELINES))
@pytest.mark.parametrize("machine", [MACHINE4, GPUS, Machine.build(1, 1)], ids=["4cpus", "4gpus", "1cpu"])
def test_every_baseline_is_valid_on_every_machine(name, machine):
    for m in (cnn(), attention_net()):
        s = BASELINES[name](m, machine)
        assert s.model == model_fingerprint(m.ops) and list(s.ops) == [op.name for op in m.ops]
        configs, defaulted = s.resolve(m.ops, machine)
        assert configs == s.ops and defaulted == []
        for config in s.ops.values():
            assert set(config.devices) <= set(compute_devices(machine)), (name, config)


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_every_baseline_trains_as_one_device_does(rt, name):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 3, 8, 8)).astype(np.float32)
    y = rng.integers(0, 4, 16)
    one = cnn(rt, seed=2)
    one.compile(SGD(lr=0.1), configs={op.name: TileConfig((1,) * len(op.tile_shape)) for op in one.ops})
    one.fit(x, y, iterations=3, verbose=False)
    m = cnn(rt, seed=2)
    m.compile(SGD(lr=0.1), strategy=BASELINES[name](m, rt.machine))
    m.fit(x, y, iterations=3, verbose=False)
    for k, v in one.parameters().items():
        np.testing.assert_allclose(m.parameters()[k], v, rtol=1e-4, atol=1e-5, err_msg=k)


# ---- each baseline's rule -----------------------------------------------------------------------
def test_data_parallel_is_the_default_config():
    m = cnn()
    assert data_parallel(m, MACHINE4).ops == {op.name: default_config(op, MACHINE4) for op in m.ops}
    assert data_parallel(m.ops, MACHINE4) == data_parallel(m, MACHINE4)


def test_model_parallel_splits_weights_and_hands_out_the_rest_in_turn():
    m = cnn()
    s = model_parallel(m, MACHINE4)
    after = 0  # the processor after the previous op's last tile
    for op in m.ops:
        config = s.ops[op.name]
        if op.weight_shapes():
            assert kinds(op, config) == {PARAMETER} and config.num_tiles == 4, (op.name, config)
        else:
            assert config.num_tiles == 1 and config.devices == (after,), (op.name, config)
        after = (config.devices[-1] + 1) % 4
    assert {d for c in s.ops.values() for d in c.devices} == {0, 1, 2, 3}
    assert model_parallel(m, GPUS).ops["relu_0"].devices == (0,)  # the first GPU


def test_expert_is_data_parallel_convolutions_and_model_parallel_dense_layers():
    m = cnn()
    s = expert(m, MACHINE4)
    for op in m.ops:
        if isinstance(op, Dense):
            assert kinds(op, s.ops[op.name]) == {PARAMETER} and s.ops[op.name].devices == (0, 1, 2, 3)
        else:
            assert s.ops[op.name] == default_config(op, MACHINE4), op.name
            if isinstance(op, (Conv2d, Pool2d)):
                assert kinds(op, s.ops[op.name]) == {SAMPLE}


def test_tensor_parallel_chooses_by_the_splits_the_ops_declare():
    m = attention_net()
    s = tensor_parallel(m, MACHINE4)
    ops = {op.name: op for op in m.ops}
    chosen = {name: kinds(op, s.ops[name]) for name, op in ops.items()}
    if reduce_dim(ops["dense_1"]) is not None:
        assert chosen["dense_0"] == {PARAMETER} and chosen["dense_1"] == {REDUCE}
        assert s.ops["dense_0"].devices == s.ops["dense_1"].devices
    else:
        assert chosen["dense_0"] == chosen["dense_1"] == {SAMPLE}
    heads = [d for d in ops["multihead_attention_0"].split_dims() if d.kind == PARAMETER and d.partial]
    assert chosen["multihead_attention_0"] == ({PARAMETER} if heads else {SAMPLE})
    for name in ("add_0", "layer_norm_0", "flat_0", "dense_2"):
        assert s.ops[name] == default_config(ops[name], MACHINE4), name


class ReduceDense(Dense):
    """Dense as it declares a reduce split: tile space [..., out, in], in features summed partially."""

    @property
    def tile_shape(self):
        return self.outputs[0].shape + (self.in_features,)

    def split_dims(self):
        n = len(self.tile_shape)
        return (SplitDim(0, SAMPLE),) + tuple(SplitDim(d, ATTRIBUTE) for d in range(1, n - 2)) + (
            SplitDim(n - 2, PARAMETER), SplitDim(n - 1, REDUCE))


class HeadAttention(MultiHeadAttention):
    """Attention as it declares a head split: a trailing tile dim of one entry per head, partial."""

    @property
    def tile_shape(self):
        return self.outputs[0].shape + (self.num_heads,)

    def split_dims(self):
        return (SplitDim(0, SAMPLE), SplitDim(1, ATTRIBUTE), SplitDim(3, PARAMETER, partial=True))


def test_tensor_parallel_pairs_column_then_row_dense_layers_and_splits_heads():
    x = spec((4, 6, 16), name="input_0")
    att = HeadAttention("att", [x, x, x], num_heads=2)
    d0 = ReduceDense("d0", att.outputs, out_features=32)
    act = ElementUnary("act", d0.outputs, fn="gelu")
    d1 = ReduceDense("d1", act.outputs, out_features=16)
    d2 = ReduceDense("d2", d1.outputs, out_features=3)  # right after a pair: a first, with nothing to pair with
    fork = ReduceDense("fork", d1.outputs, out_features=8)
    s = tensor_parallel([att, d0, act, d1, d2, fork], MACHINE4)
    assert s.ops["att"] == TileConfig((1, 1, 1, 2), (0, 1))
    assert s.ops["d0"] == TileConfig((1, 1, 4, 1), (0, 1, 2, 3))
    assert s.ops["act"] == TileConfig((1, 1, 4), (0, 1, 2, 3))
    assert s.ops["d1"] == TileConfig((1, 1, 1, 4), (0, 1, 2, 3))
    assert {k: kinds(op, s.ops[k]) for k, op in [("d0", d0), ("act", act), ("d1", d1), ("att", att)]} == {
        "d0": {PARAMETER}, "act": {ATTRIBUTE}, "d1": {REDUCE}, "att": {PARAMETER}}
    assert s.ops["d2"] == s.ops["fork"] == TileConfig((4, 1, 1, 1), (0, 1, 2, 3))
    chain = [ReduceDense("a", [spec((4, 8), name="input_0")], out_features=8)]
    for name in "bcd":
        chain.append(ReduceDense(name, chain[-1].outputs, out_features=8))
    pairs = tensor_parallel(chain, Machine.build(1, 2))
    assert [kinds(op, pairs.ops[op.name]) for op in chain] == [{PARAMETER}, {REDUCE}, {PARAMETER}, {REDUCE}]


def test_attention_splits_its_heads_over_every_device_in_model_and_tensor_parallelism():
    """Its weights have no parameter dim of their own: model parallelism takes the heads (a
    partial parameter dim), and tensor parallelism as many as there are devices. With 2 heads on
    4 devices the test above could not tell 4 from 2; 4 heads can."""
    x = spec((4, 6, 16), name="input_0")
    att = HeadAttention("att", [x, x, x], num_heads=4)
    four = TileConfig((1, 1, 1, 4), (0, 1, 2, 3))
    assert model_parallel([att], MACHINE4).ops["att"] == four
    assert tensor_parallel([att], MACHINE4).ops["att"] == four


# ---- random configs -------------------------------------------------------------------------------
@given(seed=st.integers(0, 2**32 - 1), cpus=st.integers(1, 6))
def test_random_configs_are_valid_and_use_distinct_processors(seed, cpus):
    machine = Machine.build(1, cpus)
    m = cnn()
    s = random_strategy(m, machine, seed)
    configs, defaulted = s.resolve(m.ops, machine)
    assert configs == s.ops and defaulted == [] and s == random_strategy(m, machine, seed)
    for config in s.ops.values():
        assert config.num_tiles <= cpus and len(set(config.devices)) == config.num_tiles


@pytest.mark.parametrize("draw", [random_config, proposal_config], ids=["random", "proposal"])
def test_a_config_is_drawn_for_an_operator_not_its_name(draw):
    with pytest.raises(TypeError, match=f"{draw.__name__}: op must be an operator .* got str 'dense_0'"):
        draw("dense_0", Machine.build(1, 2), 0)


@pytest.mark.parametrize("draw", [random_config, proposal_config], ids=["random", "proposal"])
def test_configs_reach_every_declared_split_and_no_other(draw):
    """Random configs and search proposals both reach every split an op declares, only those, on
    its compute devices; and configs of 3 tiles on this machine's 4 (for a proposal: the
    plain random ones among them, since its tile counts are 1, 2 and 4)."""
    x = spec((8, 6, 16), name="input_0")
    ops = [Conv2d("conv", [spec((8, 3, 6, 6))], out_channels=4, kernel=3), HeadAttention("att", [x, x, x], num_heads=2),
           ReduceDense("fc", [x], out_features=5)]
    rng = np.random.default_rng(0)
    for op in ops:
        split, counts = set(), set()
        for _ in range(300):
            config = draw(op, GPUS, rng)
            split |= {d for d, deg in enumerate(config.degrees) if deg > 1}
            counts.add(config.num_tiles)
            assert set(config.devices) <= {0, 1, 2, 3}   # the GPUs (processors 2, 3, 6, 7)
        assert split == {s.dim for s in op.split_dims()}, op.name
        assert 3 in counts


@given(seed=st.integers(0, 2**32 - 1), ranks=st.sampled_from([1, 2, 4]), per_rank=st.sampled_from([1, 2, 3, 4]))
def test_proposals_fit_the_machine_layout_on_consecutive_devices(seed, ranks, per_rank):
    """A search proposal is valid; unless it is one of the plain random ones, its tile count divides
    a rank's processors or is whole ranks, its devices are consecutive (aligned to its size where
    that divides the machine), and it is reproducible for a seed."""
    machine = Machine.build(ranks, per_rank)
    procs = list(compute_devices(machine))
    assert tile_counts(machine) == sorted({d for d in range(1, per_rank + 1) if per_rank % d == 0}
                                          | {per_rank * d for d in range(1, ranks + 1) if ranks % d == 0})
    m = cnn()
    rng = np.random.default_rng(seed)
    again = np.random.default_rng(seed)
    for op in m.ops:
        config = proposal_config(op, machine, rng)
        assert config == proposal_config(op, machine, again)
        assert resolve_config(op, config, machine) == config
        tiles = config.num_tiles
        assert len(set(config.devices)) == tiles and tiles <= len(procs)
    shaped = [proposal_config(op, machine, s) for s in range(seed % 1000, seed % 1000 + 40) for op in m.ops[:2]]
    layout = [c for c in shaped if c.num_tiles in tile_counts(machine)
              and list(c.devices) == procs[procs.index(c.devices[0]):procs.index(c.devices[0]) + c.num_tiles]]
    assert len(layout) >= len(shaped) // 2
    for c in layout:
        if len(procs) % c.num_tiles == 0:
            assert procs.index(c.devices[0]) % c.num_tiles == 0


def test_a_baseline_given_a_machine_model_says_to_pass_its_machine():
    from strategies.machine_model import load_machine
    m = Model(Runtime(execute=False), weights=False)
    m.dense(m.input((8, 6)), 3)
    for baseline in BASELINES.values():
        with pytest.raises(TypeError, match=r"a baseline strategy needs a taskrt Machine \(a machine model: pass "
                                            r"its to_machine\(\)\), got MachineModel"):
            baseline(m, load_machine("p100"))
