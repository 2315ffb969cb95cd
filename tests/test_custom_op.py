"""An operator of a user's own, as README's "Writing an operator" shows: an Op subclass registered
with @register_op, added to a model with Model.add_op, trained tiled against one device, costed,
searched and saved."""
import importlib
import sys
import textwrap

import numpy as np
import pytest
import torch

from ops import SGD, Model
from ops.base import OP_REGISTRY, Op, register_op
from ops.lower import TileConfig
from strategies.cost import CostModel
from strategies.machine_model import load_machine
from strategies.search import search
from strategies.simulator import Simulator
from taskrt import Runtime
from taskrt.taskgraph import TaskNode
from tests.opcheck import check_finite_differences, check_tiled, spec

SWISH = '''
from ops.base import Op, float_attr, register_op, sample_split_dims


@register_op
class Swish(Op):
    """y = x * sigmoid(beta * x), element-wise; every dim may be split."""

    kind = "test_swish"
    float_inputs = True

    def __init__(self, name, inputs, beta: float = 1.0):
        super().__init__(name, inputs, beta=float_attr(self.kind, name, "beta", beta))

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 1:
            raise self.fail(f"takes 1 input, got {len(in_shapes)}")
        return [in_shapes[0]]

    def split_dims(self):
        return sample_split_dims(len(self.tile_shape))

    def input_rects(self, tile):
        return [tile]

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        (x,) = inputs
        return [x / (1 + xp.exp(-self.beta * x))], None

    def backward_reads(self):
        return (True,), (False,)

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        (x,), (dy,) = inputs, grad_outputs
        s = 1 / (1 + xp.exp(-self.beta * x))
        return [dy * (s + self.beta * x * s * (1 - s))], {}

    def flops(self, tile):
        return 6 * tile.volume
'''


@pytest.fixture(scope="module")
def swish(tmp_path_factory):
    """The op's module, written to a file and imported, as a user's would be; forgotten after
    (tests/test_lower.py runs every registered operator)."""
    folder = tmp_path_factory.mktemp("user")
    (folder / "user_swish.py").write_text(textwrap.dedent(SWISH))
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module("user_swish")
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("user_swish", None)
        OP_REGISTRY.pop("test_swish", None)


def net(rt, swish, width=16):
    m = Model(runtime=rt, seed=0)
    x = m.input((8, 12), name="x")
    h = m.add_op(swish.Swish, m.dense(x, width), beta=1.5, name="act")
    m.dense(h, 4)
    return m


def test_its_kernels_match_pytorch_whole_and_tiled(swish):
    op = swish.Swish("s", [spec((6, 5), "float64")], beta=1.5)
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((6, 5)), rng.standard_normal((6, 5))
    xt = torch.tensor(x, requires_grad=True)
    yt = xt * torch.sigmoid(1.5 * xt)
    yt.backward(torch.tensor(g))
    check_tiled(op, [x], {}, [g], rtol=1e-12, atol=1e-12)
    check_finite_differences(op, [x], {})
    (y,), _ = op.forward(np, None, [x], None, {})
    (gx,), _ = op.backward(np, None, [x], None, {}, [None], [g], None)
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(gx, xt.grad.numpy(), rtol=1e-12)


def test_a_model_with_it_trains_tiled_as_on_one_device_and_saves(swish, tmp_path):
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((32, 12)).astype(np.float32), rng.integers(0, 4, 32)
    losses, weights = [], []
    for cpus, split in ((1, None), (2, (1, 2))):
        with Runtime(cpus=cpus) as rt:
            m = net(rt, swish)
            configs = None if split is None else {"act": TileConfig(split, (1, 0))}
            m.compile(optimizer=SGD(lr=0.1), configs=configs)
            losses.append(m.fit(x, y, iterations=4, verbose=False).loss)
            weights.append(m.parameters())
            if split is not None:
                m.save(tmp_path / "m.npz")
            m.close()
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    for k in weights[0]:
        np.testing.assert_allclose(weights[0][k], weights[1][k], rtol=1e-5, atol=1e-7)
    with Runtime(cpus=2) as rt:
        back = Model.load(tmp_path / "m.npz", runtime=rt)
        assert [op.kind for op in back.ops] == ["dense", "test_swish", "dense"] and back.ops[1].beta == 1.5
        np.testing.assert_allclose(back.parameters()["dense_1.weight"], weights[1]["dense_1.weight"])
        back.close()


def test_the_simulator_costs_it_and_the_search_splits_it(swish):
    m = net(Runtime(execute=False), swish)
    mm = load_machine("p100", nodes=1)
    sim = Simulator.for_model(m, mm, CostModel(mm, measured=False))
    result = search(sim, 30, seed=0, model=m)
    graph = sim.simulate(result.best).graph
    _, seconds, *_ = sim.node_costs(graph)
    act = [seconds[i] for i, node in enumerate(graph.nodes) if isinstance(node, TaskNode) and node.op == "act"]
    assert act and min(act) > mm.launch_overhead   # (its flops and bytes timed, beside the launch)
    assert "act" in result.best.ops and result.best_time <= min(result.baselines.values())


def test_add_refuses_what_is_not_a_registered_op(swish):
    class Unregistered(swish.Swish):
        kind = "test_unregistered"
    with Runtime(execute=False) as rt:
        m = Model(runtime=rt, weights=False)
        x = m.input((8, 12), name="x")
        with pytest.raises(ValueError, match=r"add_op: Unregistered \(kind 'test_unregistered'\) is not registered: "
                                             r"decorate it with @ops.base.register_op"):
            m.add_op(Unregistered, x)
        with pytest.raises(TypeError, match=r"add_op: takes an Op subclass, got 'dense'"):
            m.add_op("dense", x)


def test_a_module_reloaded_registers_its_op_again_and_another_class_of_that_kind_is_refused(swish):
    """Reloading the op's module (a notebook's cell run again) raised 'registered twice'."""
    again = importlib.reload(swish)
    assert again.Swish.kind == "test_swish"
    with pytest.raises(ValueError, match=r"operator kind 'test_swish' registered twice: by user_swish.Swish and "
                                         r"test_custom_op\..*Other"):
        @register_op
        class Other(Op):
            kind = "test_swish"
