"""Lowering: parallel configs, the launches and partitions they make, and the semantics principle
(any valid config computes what one tile on one processor computes)."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from ops import SGD, ConfigError, Model, TileConfig, default_config
from ops.base import OP_REGISTRY
from ops.conv import Conv2d
from ops.embedding import Embedding
from ops.linear import Dense
from ops.lower import Lowering, compute_processors, default_devices, resolve_config, tile_rects
from ops.loss import SparseCategoricalCrossEntropy
from ops.norm import BatchNorm
from ops.pool import Pool2d
from taskrt import CopyNode, Machine, Partition, Rect, Region, ReplayMismatch, Runtime, TaskNode
from tests.opcheck import spec

MACHINE4 = Machine.build(1, 4)


@pytest.fixture(scope="module")
def rt1():
    with Runtime(cpus=1) as rt:
        yield rt


@pytest.fixture(scope="module")
def rt4():
    with Runtime(cpus=4, separate_memories=True) as rt:
        yield rt


# ---- TileConfig and config rules ---------------------------------------------------------------
def test_tile_config_reads_well_and_checks_itself():
    c = TileConfig((2, 1, 1, 2), (0, 1, 2, 3))
    assert repr(c) == "TileConfig(degrees=(2, 1, 1, 2), devices=(0, 1, 2, 3))"
    assert str(c) == "2x1x1x2 on [0, 1, 2, 3]"
    assert str(TileConfig([3, 1])) == "3x1" and TileConfig([3, 1]).degrees == (3, 1)
    assert c.num_tiles == 4 and c.colors() == [(0, 0, 0, 0), (0, 0, 0, 1), (1, 0, 0, 0), (1, 0, 0, 1)]
    assert TileConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ConfigError, match="degrees must all be >= 1"):
        TileConfig((0, 1))
    with pytest.raises(ConfigError, match="has 2 tiles but 3 devices"):
        TileConfig((2, 1), (0, 1, 2))
    with pytest.raises(ConfigError, match="device numbers >= 0"):
        TileConfig((2,), (0, -1))
    with pytest.raises(ConfigError, match="must be ints"):
        TileConfig((1.5,))


def test_resolve_config_names_op_dim_and_kind():
    dense = Dense("fc", [spec((8, 16))], out_features=6)
    relu = Dense("fc_relu", [spec((8, 16))], out_features=6, activation="relu")
    with pytest.raises(ConfigError, match=r"dense 'fc_relu'.* splits dim 2 2 ways, but dim 2 may not be split; "
                                          r"splittable dims: dim 0 \(sample\), dim 1 \(parameter\)"):
        resolve_config(relu, TileConfig((1, 1, 2)), MACHINE4)
    with pytest.raises(ConfigError, match=r"dense 'fc'.* splits dim 1 \(parameter\) 7 ways, more than its extent 6"):
        resolve_config(dense, TileConfig((1, 7, 1)), MACHINE4)
    with pytest.raises(ConfigError, match=r"dense 'fc'.* has 2 degrees but the op's tile space \(8, 6, 16\) has "
                                          r"3 dims"):
        resolve_config(dense, TileConfig((1, 1)), MACHINE4)
    with pytest.raises(ConfigError, match=r"places tile 1 on device 4, but .* computes on 4 cpus: devices 0..3"):
        resolve_config(dense, TileConfig((2, 1, 1), (0, 4)), MACHINE4)
    with pytest.raises(ConfigError, match="must be a TileConfig"):
        resolve_config(dense, (2, 1, 1), MACHINE4)
    assert resolve_config(dense, TileConfig((2, 1, 2)), MACHINE4).devices == (0, 1, 2, 3)


def test_default_config_splits_the_sample_dim_over_the_compute_processors():
    conv = Conv2d("c", [spec((8, 3, 6, 6))], out_channels=4, kernel=3)
    assert default_config(conv, MACHINE4) == TileConfig((4, 1, 1, 1), (0, 1, 2, 3))
    small = Conv2d("c", [spec((2, 3, 6, 6))], out_channels=4, kernel=3)
    assert default_config(small, MACHINE4) == TileConfig((2, 1, 1, 1), (0, 2))
    bn = BatchNorm("bn", [spec((8, 4, 5, 5))])  # statistics synchronized across sample tiles
    assert default_config(bn, MACHINE4) == TileConfig((4, 1, 1, 1), (0, 1, 2, 3))
    fc = Dense("fc", [spec((8, 16))], out_features=6)  # the tile space has the input features
    assert default_config(fc, MACHINE4) == TileConfig((4, 1, 1), (0, 1, 2, 3))
    gpus = Machine.build(1, cpus_per_rank=2, gpus_per_rank=2)  # devices are the GPUs (processors 2, 3)
    assert default_devices(gpus, 4) == (0, 0, 1, 1) and compute_processors(gpus) == (2, 3)
    with pytest.raises(ConfigError, match=r"places tile 1 on device 2, but .* computes on 2 gpus: devices 0..1"):
        resolve_config(fc, TileConfig((2, 1, 1), (0, 2)), gpus)


def test_tiles_follow_partition_equal():
    shape, degrees = (7, 5, 3), (3, 2, 1)
    region = Region(shape)
    assert tile_rects(shape, degrees) == Partition.equal(region, degrees).rects


# ---- what lowering launches ----------------------------------------------------------------------
def test_lowering_builds_tile_partitions_halos_reductions_and_updates():
    x, labels = spec((4, 2, 6, 6), name="x"), spec((4,), "int64", "labels")
    conv = Conv2d("conv", [x], out_channels=3, kernel=3, padding=1)
    from ops.shape import Flat
    flat = Flat("flat", conv.outputs)
    fc = Dense("fc", flat.outputs, out_features=4)
    loss = SparseCategoricalCrossEntropy("loss", [fc.outputs[0], labels], from_logits=True)
    ops = [conv, flat, fc, loss]
    configs = {"conv": TileConfig((1, 1, 2, 1), (0, 1)), "flat": TileConfig((2, 1), (2, 3)),
               "fc": TileConfig((1, 2, 1), (1, 3)), "loss": TileConfig((2,), (0, 1))}
    with Runtime(machine=MACHINE4, execute=False) as rt:
        low = Lowering(rt, ops, [x, labels], configs, SGD(lr=0.1, momentum=0.9), loss="loss", tag="t")
        plan = low.plans["conv"]
        part = plan.fwd_reqs[True][0].partition
        assert part.aliased and part.colors() == [(0, 0, 0, 0), (0, 0, 1, 0)]
        assert part[(0, 0, 0, 0)] == Rect.make((0, 0, 0, 0), (4, 2, 4, 6))  # rows 0..2 plus a halo row
        assert part[(0, 0, 1, 0)] == Rect.make((0, 0, 2, 0), (4, 2, 6, 6))
        assert plan.placement == {(0, 0, 0, 0): 0, (0, 0, 1, 0): 1}
        # its input gradient adds up over the tiles; its weight and bias blocks are each one tile's
        assert [r.privilege.mode for r in low.plans["fc"].bwd_reqs] == ["R"] * 5 + ["Reduce", "WD", "WD"]
        assert low.plans["fc"].writes_weight_grads == {"weight": True, "bias": True}
        assert low.plans["conv"].writes_weight_grads == {"weight": False, "bias": False}
        assert low.plans["conv"].grad_inputs == [False]  # no gradient for model inputs
        # the parameter-split dense weight updates in two disjoint row blocks on its tiles' processors
        fc_update = next(u for u in low.updates if u.param.name == "fc.weight")
        assert list(fc_update.reqs[0].partition.rects.values()) == [Rect.make((0, 0), (2, 108)),
                                                                     Rect.make((2, 0), (4, 108))]
        assert list(fc_update.placement.values()) == [1, 3]
        conv_update = next(u for u in low.updates if u.param.name == "conv.weight")
        # the conv weight, replicated on both of its tiles' processors, is too small (216 bytes) to
        # shard: one piece, on the first of them
        assert [r.region.name for r in conv_update.reqs] == [
            "conv.weight", "conv.weight.grad", "conv.weight.momentum"]
        assert list(conv_update.reqs[0].partition.rects.values()) == [Rect.make((0, 0, 0, 0), (3, 2, 3, 3))]
        assert list(conv_update.placement.values()) == [0]
        low.train_step(1, valid=4)
        tasks = [n for n in rt.graph.nodes.values() if isinstance(n, TaskNode)]
        names = {n.name for n in tasks}
        assert {"conv.fwd", "conv.bwd", "fc.fwd", "fc.bwd", "loss.bwd", "conv.weight.update",
                "fill:flat.out.grad"} <= names
        assert "flat.bwd" in names and "x.grad" not in {r.name for r in low.grads.values()}
        assert sorted(str(n.proc) for n in tasks if n.name == "fc.bwd") == ["r0.cpu1", "r0.cpu3"]
        folds = [n for n in rt.graph.copies() if n.redop == "sum"]
        # both fc tiles read all of flat's output: their input gradients add up; flat's sample
        # halves and the loss's tile their inputs exactly: they write their gradients whole
        assert {f.region.name for f in folds} >= {"conv.weight.grad", "flat.out.grad"}
        # the conv weight's replicas add up into a zero-filled gradient; the fc's blocks are written
        assert "fill:conv.weight.grad" in names and not {"fill:fc.weight.grad", "fill:fc.bias.grad"} & names
        assert not {f.region.name for f in folds} & {"fc.weight.grad", "fc.bias.grad"}
        assert not {"fill:conv.out.grad", "fill:fc.out.grad"} & names
        assert not {f.region.name for f in folds} & {"conv.out.grad", "fc.out.grad"}
        assert [r.privilege.mode for r in low.plans["flat"].bwd_reqs][-1] == "WD"


def test_a_plan_made_like_another_of_its_degrees_launches_what_a_fresh_one_launches():
    """The simulator's search makes a plan per proposal and shares the tiles, rects and partitions
    of plans with the same degrees (OpPlan's `like`): only the placement differs, and the
    launches are those of a plan made afresh. A plan of other degrees is refused as a model."""
    from ops.lower import OpPlan
    x, labels = spec((4, 2, 6, 6), name="x"), spec((4,), "int64", "labels")
    conv = Conv2d("conv", [x], out_channels=4, kernel=3, padding=1)
    bn = BatchNorm("bn", conv.outputs)
    from ops.shape import Flat
    flat = Flat("flat", bn.outputs)
    fc = Dense("fc", flat.outputs, out_features=4)
    loss = SparseCategoricalCrossEntropy("loss", [fc.outputs[0], labels], from_logits=True)
    ops = [conv, bn, flat, fc, loss]
    configs = {"conv": TileConfig((2, 2, 1, 1), (0, 1, 2, 3)), "bn": TileConfig((2, 1, 2, 1), (0, 1, 2, 3)),
               "flat": TileConfig((2, 1), (2, 3)), "fc": TileConfig((1, 2, 2), (1, 3, 0, 2)),
               "loss": TileConfig((2,), (0, 1))}
    moved = {"conv": (3, 1, 0, 2), "bn": (2, 3, 1, 0), "fc": (0, 2, 3, 1)}

    def launches(plan):
        out = []
        for launch in plan.forward_launches(True) + plan.backward_launches():
            out.append((launch.name, launch.placement, [(r.partition.region.name, r.partition.rects, r.privilege)
                                                        for r in launch.reqs], launch.args))
        return out
    with Runtime(machine=MACHINE4, execute=False) as rt:
        low = Lowering(rt, ops, [x, labels], configs, SGD(lr=0.1), loss="loss", tag="like")
        for name, devices in moved.items():
            op = next(o for o in ops if o.name == name)
            config = TileConfig(configs[name].degrees, devices)
            fresh = OpPlan(low, op, config, True, None)
            like = OpPlan(low, op, config, True, None, low.plans[name])
            assert like.tiles is low.plans[name].tiles and like.placement == fresh.placement
            assert launches(like) == launches(fresh)
        with pytest.raises(ValueError, match="is not a plan of"):
            OpPlan(low, conv, TileConfig((4, 1, 1, 1), (0, 1, 2, 3)), True, None, low.plans["conv"])


def test_a_plan_made_from_a_twin_launches_what_a_fresh_one_launches():
    """A plan of an op whose kind, attributes, input shapes and degrees another op's plan has (its
    `twin`: networks repeat their blocks) takes that plan's tiles and rects and its partitions'
    pieces on its own regions; its launches are those of a plan made afresh. A plan of an op of
    other attributes is refused as a twin."""
    from ops.lower import OpPlan
    from ops.shape import Flat
    x, labels = spec((4, 3, 6, 6), name="x"), spec((4,), "int64", "labels")
    conv1 = Conv2d("conv1", [x], out_channels=3, kernel=3, padding=1)
    bn1 = BatchNorm("bn1", conv1.outputs, relu=True)
    conv2 = Conv2d("conv2", bn1.outputs, out_channels=3, kernel=3, padding=1)
    bn2 = BatchNorm("bn2", conv2.outputs, relu=True)
    conv3 = Conv2d("conv3", bn2.outputs, out_channels=3, kernel=3, padding=0)
    flat = Flat("flat", conv3.outputs)
    fc = Dense("fc", flat.outputs, out_features=4)
    loss = SparseCategoricalCrossEntropy("loss", [fc.outputs[0], labels], from_logits=True)
    ops = [conv1, bn1, conv2, bn2, conv3, flat, fc, loss]
    configs = {"conv1": TileConfig((2, 3, 1, 2), (0, 1, 2, 3, 3, 2, 1, 0, 0, 1, 2, 3)),
               "bn1": TileConfig((2, 3, 2, 1), (0, 1, 2, 3, 3, 2, 1, 0, 0, 1, 2, 3)),
               "conv2": TileConfig((1, 1, 1, 1), (3,)), "bn2": TileConfig((1, 1, 1, 1), (3,)),
               "conv3": TileConfig((2, 1, 1, 1), (0, 1)), "flat": TileConfig((2, 1), (2, 3)),
               "fc": TileConfig((1, 2, 2), (1, 3, 0, 2)), "loss": TileConfig((2,), (0, 1))}

    def launches(plan):
        return [(launch.name, launch.placement, [(r.partition.region.name, r.partition.rects, r.privilege)
                                                 for r in launch.reqs], launch.args)
                for launch in plan.forward_launches(True) + plan.forward_launches(False) + plan.backward_launches()]
    with Runtime(machine=MACHINE4, execute=False) as rt:
        low = Lowering(rt, ops, [x, labels], configs, SGD(lr=0.1), loss="loss", tag="twin")
        for name, twin_of in (("conv2", "conv1"), ("bn2", "bn1")):
            op = next(o for o in ops if o.name == name)
            config = TileConfig(configs[twin_of].degrees, tuple(reversed(configs[twin_of].devices)))
            fresh = OpPlan(low, op, config, True, None)
            twin = OpPlan(low, op, config, True, None, None, low.plans[twin_of])
            assert twin.tiles is low.plans[twin_of].tiles and twin._ins[0].rects is low.plans[twin_of]._ins[0].rects
            assert launches(twin) == launches(fresh)
        with pytest.raises(ValueError, match="is not a plan of an op like"):
            OpPlan(low, conv3, configs["conv2"], True, None, None, low.plans["conv2"])


def test_backward_needs_a_training_forward_and_consumes_what_it_saved(rt1):
    m = _mlp(rt1, batch=4)
    m.compile("sgd", "mean_squared_error")
    x, y = np.ones((4, 5), np.float32), np.zeros((4, 3), np.float32)
    m.forward(x)
    assert len(m._low.saved) == 3 * 1  # three ops, one tile each on a 1-cpu runtime
    m.backward(y)
    rt1.wait()
    assert m._low.saved == {}
    with pytest.raises(RuntimeError, match="call forward"):
        m.backward(y)


# ---- the semantics principle ---------------------------------------------------------------------
def _cnn(rt, batch=4, seed=3):
    m = Model(rt, seed=seed)
    x = m.input((batch, 2, 8, 8))
    h = m.conv2d(x, 4, 3, padding=1)
    h = m.batch_norm(h)
    h = m.relu(h)
    h = m.pool2d(h, 2)
    h = m.flat(h)
    h = m.dense(h, 6, activation="relu")
    m.softmax(m.dense(h, 3))
    return m


def _mlp(rt, batch=4, seed=5):
    m = Model(rt, seed=seed)
    x = m.input((batch, 5))
    m.dense(m.dense(m.dense(x, 8, activation="tanh"), 6, activation="relu"), 3)
    return m


def _run(m, inputs, labels, configs, loss="sparse_categorical_crossentropy", steps=0):
    """Forward and gradients of one batch, then parameters after `steps` training steps.

    (SGD, not Adam: a conv bias before batch_norm gets a gradient of zero plus rounding noise,
    which Adam would scale up to full-size steps.)"""
    m.compile(SGD(lr=0.1, momentum=0.9), loss, configs=configs)
    outs = m.forward(inputs)
    m.backward(labels)
    grads = m.gradients()
    stats = m.stats()
    if steps:
        m.fit(inputs, labels, iterations=steps, shuffle=False, verbose=False)
    return outs, grads, stats, m.parameters()


def _assert_same(a, b, what, rtol=2e-4, atol=2e-6):
    for got, want in zip(a, b):
        assert got.keys() == want.keys()
        for k in want:
            np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=atol, err_msg=f"{what}: {k}")


def _ones(m):
    return {op.name: TileConfig((1,) * len(op.tile_shape), (0,)) for op in m.ops}


CNN_CONFIGS = {
    "sample split on 4 processors": lambda m: {op.name: TileConfig((4,) + (1,) * (len(op.tile_shape) - 1))
                                               for op in m.ops},
    "conv height and width split with halos": lambda m: {
        "conv2d_0": TileConfig((1, 1, 2, 2), (0, 1, 2, 3)), "relu_0": TileConfig((1, 1, 2, 2), (3, 2, 1, 0)),
        "pool2d_0": TileConfig((1, 1, 2, 2), (1, 1, 2, 2)), "batch_norm_0": TileConfig((1, 2, 1, 1), (2, 3))},
    "channel and parameter splits": lambda m: {
        "conv2d_0": TileConfig((2, 2, 1, 1), (0, 1, 2, 3)), "dense_0": TileConfig((1, 3, 1), (1, 2, 3)),
        "dense_1": TileConfig((2, 3, 1), (0, 1, 2, 3, 0, 1)), "softmax_0": TileConfig((4, 1), (3, 2, 1, 0))},
    "batch norm over samples and rows, dense over input features": lambda m: {
        "batch_norm_0": TileConfig((2, 1, 2, 1), (3, 1, 2, 0)), "dense_1": TileConfig((1, 1, 3), (2, 0, 1)),
        "dense_0": TileConfig((2, 2, 1), (0, 1, 2, 3))},
}


@pytest.mark.parametrize("case", sorted(CNN_CONFIGS))
def test_cnn_under_any_config_matches_one_tile(case, rt1, rt4):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 2, 8, 8)).astype(np.float32)
    y = rng.integers(0, 3, 4)
    ref = _cnn(rt1)
    want = _run(ref, x, y, _ones(ref), steps=2)
    m = _cnn(rt4)
    got = _run(m, x, y, CNN_CONFIGS[case](m), steps=2)
    _assert_same(got, want, case)


def test_mlp_with_parameter_split_dense_layers_matches_one_tile(rt1, rt4):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    y = rng.standard_normal((4, 3)).astype(np.float32)
    ref = _mlp(rt1)
    want = _run(ref, x, y, _ones(ref), "mean_squared_error", steps=2)
    m = _mlp(rt4)
    configs = {"dense_0": TileConfig((1, 4, 1), (3, 2, 1, 0)), "dense_1": TileConfig((2, 3, 1)),
               "dense_2": TileConfig((1, 3, 2), (1, 1, 2, 0, 3, 3)), "loss": TileConfig((4,), (0, 1, 2, 3))}
    got = _run(m, x, y, configs, "mean_squared_error", steps=2)
    _assert_same(got, want, "mlp")


def _every_op(rt, seed=7):
    """A model using every operator of the model API once."""
    m = Model(rt, seed=seed)
    img = m.input((4, 2, 6, 6), name="img")
    seq = m.input((4, 6, 8), name="seq")
    idx = m.input((4, 6), "int64", name="idx")
    a = m.add(seq, m.embedding(idx, 10, 8))
    a = m.layer_norm(a)
    att = m.gelu(m.multihead_attention(a, num_heads=2))
    y, h, c = m.lstm(att, 8)
    s1, s2 = m.split(m.concat([y, att], axis=2), [8, 8], axis=2)
    t = m.transpose(m.multiply(s1, s2), [0, 2, 1])               # [4, 8, 6]
    bm = m.batch_matmul(t, att)                                  # [4, 8, 8]
    z = m.subtract(m.sigmoid(m.dropout(bm, 0.25)), m.tanh(bm))
    z = m.reshape(z, [4, 64])
    v = m.flat(m.pool2d(m.relu(m.batch_norm(m.conv2d(img, 3, 3, padding=1))), 2, pool_type="avg"))
    z = m.concat([z, v, h], axis=1)
    m.softmax(m.dense(z, 5, activation="gelu"))
    return m


def _split_everything(m):
    """Every declared split dim (of extent >= 2) cut in 2, tiles spread over the processors."""
    configs = {}
    for op in m.ops:
        dims = {s.dim for s in op.split_dims()}
        degrees = tuple(2 if d in dims and n >= 2 else 1 for d, n in enumerate(op.tile_shape))
        configs[op.name] = TileConfig(degrees)
    return configs


def test_every_operator_under_every_split_matches_one_tile(rt1, rt4):
    rng = np.random.default_rng(2)
    inputs = {"img": rng.standard_normal((4, 2, 6, 6)).astype(np.float32),
              "seq": rng.standard_normal((4, 6, 8)).astype(np.float32),
              "idx": rng.integers(0, 10, (4, 6))}
    y = rng.integers(0, 5, 4)
    ref = _every_op(rt1)
    assert {op.kind for op in ref.ops} == set(OP_REGISTRY) - {"sparse_categorical_crossentropy",
                                                              "mean_squared_error"}
    want = _run(ref, inputs, y, _ones(ref), steps=2)
    m = _every_op(rt4)
    configs = _split_everything(m)
    assert configs["concat_0"].degrees == (2, 2, 2) and configs["conv2d_0"].degrees == (2, 2, 2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayMismatch)
        got = _run(m, inputs, y, configs, steps=2)
        m.fit(inputs, y, iterations=2, shuffle=False, verbose=False)
    _assert_same(got, want, "every op", rtol=1e-3, atol=1e-5)
    # the concat split along its axis leaves tiles with empty input rects: no reduction may stay pending
    analyzer = rt4.analyzer
    assert all(not analyzer.lookup(uid).pending for uid in [*analyzer.states, *analyzer.deferred])


# ---- kernels that write into the runtime's views (Op.writes_out) ----------------------------------
def _writers():
    """One op of each kind with writes_out, its input and weights (numpy, float32)."""
    rng = np.random.default_rng(4)
    ops = [Conv2d("conv", [spec((3, 2, 6, 6))], out_channels=4, kernel=3, padding=1),
           Conv2d("conv_1x1", [spec((3, 4, 6, 6))], out_channels=2, kernel=1),
           Conv2d("conv_big", [spec((2, 8, 40, 40))], out_channels=8, kernel=3, padding=1),
           BatchNorm("bn", [spec((3, 2, 6, 6))], relu=True),
           Pool2d("pool", [spec((3, 2, 6, 6))], kernel=2),
           Dense("fc", [spec((3, 5))], out_features=4, activation="relu"),
           Dense("fc_none", [spec((3, 5))], out_features=4)]
    for op in ops:
        w = {k: v for k, v in op.init_weights(rng).items() if k not in op.state_shapes()}
        yield op, rng.standard_normal(op.inputs[0].shape).astype(np.float32), w


@pytest.mark.parametrize("op, x, w", list(_writers()), ids=lambda v: getattr(v, "name", ""))
def test_a_kernel_given_out_writes_and_returns_it_with_the_same_values(op, x, w):
    assert op.writes_out
    tile = Rect.from_shape(op.tile_shape)
    rects = op.input_rects(tile)
    want, saved = op.forward(np, tile, [x], rects, w, training=True)
    out = np.full_like(want[0], np.nan)
    got, saved_out = op.forward(np, tile, [x], rects, w, training=True, out=[out])
    assert got[0] is out
    np.testing.assert_allclose(out, want[0], rtol=1e-6, atol=1e-7)
    dy = np.random.default_rng(5).standard_normal(want[0].shape).astype(np.float32)
    (dx_want,), gw_want = op.backward(np, tile, [x], rects, w, want, [dy], saved)
    dx = np.full_like(x, np.nan)
    (dx_got,), gw_got = op.backward(np, tile, [x], rects, w, [out], [dy], saved_out, out=[dx])
    assert dx_got is dx
    np.testing.assert_allclose(dx, dx_want, rtol=1e-6, atol=1e-7)
    for k in gw_want:
        np.testing.assert_allclose(gw_got[k], gw_want[k], rtol=1e-6, atol=1e-7)
    _, saved = op.forward(np, tile, [x], rects, w, training=True)  # an input gradient nothing reads: skipped
    (none,), gw_skip = op.backward(np, tile, [x], rects, w, want, [dy], saved, out=[False])
    assert none is None and gw_skip.keys() == gw_want.keys()
    for k in gw_want:
        np.testing.assert_allclose(gw_skip[k], gw_want[k], rtol=1e-6, atol=1e-7)


def test_lowering_gives_writing_kernels_its_views_and_skips_the_copy(rt1, monkeypatch):
    seen = []
    forward = Conv2d.forward

    def spy(self, *args, out=None, **kw):
        outputs, saved = forward(self, *args, out=out, **kw)
        seen.append(out is not None and out[0] is not None and outputs[0] is out[0])
        return outputs, saved

    monkeypatch.setattr(Conv2d, "forward", spy)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 2, 8, 8)).astype(np.float32)
    y = rng.integers(0, 3, 4)
    m = _cnn(rt1)
    m.compile(SGD(lr=0.1), configs=_ones(m))
    m.fit(x, y, iterations=2, shuffle=False, verbose=False)
    assert seen and all(seen)  # one tile, a contiguous view: written in place every time


def test_lowering_gives_weight_writing_kernels_the_gradients_views(rt1, rt4, monkeypatch):
    """An embedding's and a dense layer's weight gradients are written into the runtime's views
    (Op.writes_weight_out): the same training as when they allocate and lowering copies, bit for
    bit, on one tile and split (the table by rows, each block written whole; the dense layer's
    weight over samples, its replicas' gradients added up)."""
    seen = []
    backward = Embedding.backward

    def spy(self, *args, weight_out=None, **kw):
        grads_in, grads = backward(self, *args, weight_out=weight_out, **kw)
        seen.append(weight_out is not None and grads["weight"] is weight_out["weight"])
        return grads_in, grads

    def build(rt):
        m = Model(rt, seed=7)
        m.dense(m.embedding(m.input((4, 3), dtype="int64", name="tok"), 12, 6, name="emb"), 5, name="fc")
        return m

    rng = np.random.default_rng(8)
    x, y = rng.integers(0, 12, (4, 3)), rng.standard_normal((4, 3, 5)).astype(np.float32)
    split = {"emb": TileConfig((1, 1, 1, 2)), "fc": TileConfig((2, 1, 1, 2))}
    monkeypatch.setattr(Embedding, "backward", spy)
    runs = {}
    for writes in (False, True):
        monkeypatch.setattr(Embedding, "writes_weight_out", writes)
        monkeypatch.setattr(Dense, "writes_weight_out", writes)
        for name, rt, configs in (("one tile", rt1, None), ("split", rt4, split)):
            seen.clear()
            m = build(rt)
            m.compile(SGD(lr=0.1), loss="mean_squared_error", configs=configs or _ones(m))
            if name == "split":
                assert m._low.plans["emb"].writes_weight_grads == {"weight": True}
                assert m._low.plans["fc"].writes_weight_grads == {"weight": False, "bias": False}
            m.fit(x, y, iterations=3, shuffle=False, verbose=False)
            runs[writes, name] = m.parameters()
            m.close()
            assert seen and set(seen) == {writes}, (name, seen)   # given and written exactly when asked
    for name in ("one tile", "split"):
        for k, v in runs[False, name].items():
            np.testing.assert_array_equal(runs[True, name][k], v, err_msg=f"{name}: {k}")


def test_a_step_that_releases_frees_every_activation_and_activation_gradient_and_keeps_the_rest():
    """After training with release=True only the inputs, labels, weights, their gradients and the
    optimizer state keep instances: the activation gradients were left out of what a step
    releases, and stayed allocated (about 290 KB a device in tiny alexnet's data parallelism)."""
    with Runtime(cpus=2) as rt:
        m = Model(rt, seed=0)
        m.dense(m.dense(m.input((8, 6), name="x"), 16, activation="relu"), 3)
        m.compile(optimizer=SGD(lr=0.1, momentum=0.9), release=True)
        m.fit(np.ones((8, 6), np.float32), np.zeros(8, "int64"), iterations=3, verbose=False)
        rt.wait()
        low = m._low
        kept = {r.uid for p in low.params.values() for r in (p.value, p.grad, *p.state.values())}
        kept |= {low.values[name].uid for name in low.input_names} | {low.values[m._labels.name].uid}
        held = {key[0] for key in rt.store.instances}
        gone = {r.uid for name, r in low.values.items() if name not in low.input_names} | {
            r.uid for r in low.grads.values()}
        assert held & gone == set() and held >= kept - {None}
        m.close()


def test_training_steps_are_replayed(rt4):
    m = _cnn(rt4, batch=8)
    m.compile(SGD(lr=0.05, momentum=0.9), metrics=["accuracy"])
    rng = np.random.default_rng(3)
    x = rng.standard_normal((32, 2, 8, 8)).astype(np.float32)
    y = rng.integers(0, 3, 32)
    before = dict(rt4.replay_stats)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplayMismatch)
        m.fit(x, y, epochs=3, verbose=False)
    after = rt4.replay_stats
    assert after["recorded"] - before["recorded"] <= 2
    assert after["replayed"] - before["replayed"] >= 10
    assert after["mismatches"] == before["mismatches"]


def test_an_output_whose_only_consumer_is_off_the_gradient_path_still_gets_a_zero_gradient(rt4):
    """A split's second output feeds only an op whose result the loss ignores: that op runs no
    backward, so nothing writes the output's gradient and its zero fill stays; the weights train
    as in the same model without the dangling op."""
    def build(dangling: bool):
        m = Model(rt4, seed=5)
        x = m.input((8, 6), name="x")
        a, b = m.split(m.dense(x, 8, name="fc0"), [3, 5], axis=1, name="cut")
        if dangling:
            m.relu(b, name="unused")
        m.dense(a, 3, name="out")
        return m

    x = np.random.default_rng(2).standard_normal((8, 6)).astype(np.float32)
    y = np.arange(8) % 3
    results = []
    for dangling in (True, False):
        m = build(dangling)
        results.append(_run(m, x, y, {"fc0": TileConfig((2, 1, 1), (0, 1)), "cut": TileConfig((2, 1), (0, 1))},
                            steps=2))
        if dangling:
            low = m._low
            b = m.ops[1].outputs[1].name
            assert low.plans["unused"].writes_grads == [False]
            assert b not in low.written_grads(low.plans, m.ops[1])
            assert b in {t for seg in low.backward_segments() for t in seg.fills}
    _assert_same(results[0][1:2] + results[0][3:], results[1][1:2] + results[1][3:], "dangling branch")


def test_the_batch_source_gives_each_rank_its_share_and_refuses_inputs_without_the_batch():
    """source_segment: one task a rank on its host processor, writing samples [r*B//R, (r+1)*B//R)
    of every input; an input whose first dim is not the batch is named before anything is issued."""
    x, labels = spec((5, 3), name="x"), spec((5,), "int64", "labels")
    fc = Dense("fc", [x], out_features=2)
    loss = SparseCategoricalCrossEntropy("loss", [fc.outputs[0], labels], from_logits=True)
    machine = Machine.build(2, 2)
    rt = Runtime(machine, execute=False)
    low = Lowering(rt, [fc, loss], [x, labels], {op.name: default_config(op, machine) for op in (fc, loss)},
                   SGD(lr=0.1), loss="loss")
    (launch,) = low.source_segment(None).launches
    assert launch.colors == [(0,), (1,)]
    assert launch.placement == {(0,): machine.host_processor(0), (1,): machine.host_processor(1)}
    assert [r.partition.rects for r in launch.reqs] == [
        {(0,): Rect((0, 0), (2, 3)), (1,): Rect((2, 0), (5, 3))}, {(0,): Rect((0,), (2,)), (1,): Rect((2,), (5,))}]
    odd = Lowering(rt, [fc, loss], [x, labels, spec((4, 3), name="extra")],
                   {op.name: default_config(op, machine) for op in (fc, loss)}, SGD(lr=0.1), loss="loss")
    with pytest.raises(ValueError, match=r"input 'extra' has shape \(4, 3\), but every input needs the batch \(5\)"):
        odd.source_segment(None)


def test_a_step_with_its_source_lets_the_weight_copies_go_before_the_batch_is_made():
    """train_step(source=...) puts the batch source's launch first in the step's program, so in a
    replayed step the source's tasks and the weight copies between ranks are roots side by side,
    each waiting only for the steps before (as the simulator times a step). Issued before the step
    instead, the source is among what the replay's fence waits for, and so are the copies."""
    x, labels = spec((4, 3), name="x"), spec((4,), "int64", "labels")
    fc = Dense("fc", [x], out_features=2)
    loss = SparseCategoricalCrossEntropy("loss", [fc.outputs[0], labels], from_logits=True)
    machine = Machine.build(2, 1)

    def last_step(inside: bool):
        rt = Runtime(machine, execute=False)
        low = Lowering(rt, [fc, loss], [x, labels], {op.name: default_config(op, machine) for op in (fc, loss)},
                       SGD(lr=0.1), loss="loss")
        for step in (1, 2, 3, 4):
            first = rt._next_id
            if inside:
                low.train_step(step, source=(None, "a source"))
            else:
                low.issue(low.source_segment(None, ("a source", step)))
                low.train_step(step)
        ids = range(first, rt._next_id)
        sources = [i for i in ids if isinstance(rt.graph.nodes[i], TaskNode) and rt.graph.nodes[i].name == "source"]
        copies = [i for i in ids if isinstance(rt.graph.nodes[i], CopyNode) and rt.graph.nodes[i].region.name ==
                  "fc.weight" and rt.graph.nodes[i].src.rank != rt.graph.nodes[i].dst.rank]
        assert len(sources) == 2 and copies and rt.replay_stats["reissued"] >= 1
        behind, todo = set(), list(copies)
        while todo:
            for p in rt.graph.preds[todo.pop()]:
                if p >= first and p not in behind:
                    behind.add(p)
                    todo.append(p)
        return set(sources) & behind

    assert not last_step(inside=True), "a weight copy waited for the step's own source"
    assert last_step(inside=False), "issued before the step, the source was not behind the fence"
