"""Concat, split, flat, reshape and transpose against PyTorch, finite differences and every tiling."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ops.base import ATTRIBUTE, OP_REGISTRY, SAMPLE, ShapeError
from ops.shape import Concat, Flat, Reshape, Split, Transpose
from taskrt.geometry import Rect
from tests.opcheck import check_finite_differences, check_tiled, run_whole, spec


def rand(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def torch_grads(fn, arrays, grads):
    """Outputs of fn(*tensors) and the gradients of sum(out * grad) with respect to each array."""
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    outs = fn(*ts)
    outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
    sum((o * torch.tensor(g)).sum() for o, g in zip(outs, grads)).backward()
    return [o.detach().numpy() for o in outs], [t.grad.numpy() for t in ts]


def check_all(op, inputs, torch_fn, seed=0, finite_differences=True):
    rng = np.random.default_rng(seed)
    grads = [rand(rng, o.shape) for o in op.outputs]
    outs, gin, _, _ = run_whole(op, inputs, {}, grad_outputs=grads)
    ref_outs, ref_gin = torch_grads(torch_fn, inputs, grads)
    for o, r, spec_ in zip(outs, ref_outs, op.outputs):
        assert o.shape == spec_.shape
        np.testing.assert_array_equal(o, r)
    for g, r in zip(gin, ref_gin):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)
    if finite_differences:
        check_finite_differences(op, inputs, {})
    check_tiled(op, inputs, {}, grads)


# ---- concat ----------------------------------------------------------------------

@pytest.mark.parametrize("shapes,axis", [
    ([(4, 2, 3), (4, 3, 3), (4, 1, 3)], 1),
    ([(2, 3), (3, 3)], 0),
    ([(3, 2, 2), (3, 2, 5)], -1),
    ([(5, 4)], 1),
])
def test_concat_matches_torch_and_tiles(shapes, axis):
    rng = np.random.default_rng(0)
    xs = [rand(rng, s) for s in shapes]
    op = Concat("cat", [spec(s, name=f"x{i}") for i, s in enumerate(shapes)], axis=axis)
    check_all(op, xs, lambda *ts: torch.cat(ts, dim=axis))


def test_concat_tile_reads_only_the_inputs_it_overlaps():
    op = Concat("cat", [spec((4, 2)), spec((4, 3)), spec((4, 1))], axis=1)
    assert op.outputs[0].shape == (4, 6)
    rects = op.input_rects(Rect((1, 2), (3, 4)))
    assert rects == [Rect((1, 2), (3, 2)), Rect((1, 0), (3, 2)), Rect((1, 0), (3, 0))]
    assert [r.volume for r in rects] == [0, 4, 0]
    rects = op.input_rects(Rect((0, 5), (4, 6)))
    assert [r.shape for r in rects] == [(4, 0), (4, 0), (4, 1)]
    # every empty rect selects nothing from its input and never indexes from the end
    assert all(0 <= r.lo[1] == r.hi[1] <= s.shape[1] for r, s in zip(rects[:2], op.inputs[:2]))
    assert [(s.dim, s.kind) for s in op.split_dims()] == [(0, SAMPLE), (1, ATTRIBUTE)]


def test_concat_kernel_handles_empty_input_rects():
    rng = np.random.default_rng(1)
    xs = [rand(rng, (4, 2)), rand(rng, (4, 3)), rand(rng, (4, 1))]
    op = Concat("cat", [spec(x.shape) for x in xs], axis=1)
    tile = Rect((0, 5), (4, 6))
    rects = op.input_rects(tile)
    ins = [x[r.slices()] for x, r in zip(xs, rects)]
    (y,), _ = op.forward(np, tile, ins, rects, {})
    np.testing.assert_array_equal(y, xs[2])
    g = rand(rng, (4, 1))
    gin, gw = op.backward(np, tile, ins, rects, {}, [y], [g], None)
    assert [a.shape for a in gin] == [(4, 0), (4, 0), (4, 1)] and gw == {}
    np.testing.assert_array_equal(gin[2], g)


def test_concat_errors():
    with pytest.raises(ShapeError, match=r"concat 'cat': input 1 has shape \(4, 3, 2\), which doesn't match "
                                         r"input 0's \(4, 2, 3\) outside axis 1"):
        Concat("cat", [spec((4, 2, 3)), spec((4, 3, 2))], axis=1)
    with pytest.raises(ShapeError, match=r"axis=2 is out of range for 2 dims"):
        Concat("cat", [spec((4, 2)), spec((4, 3))], axis=2)
    with pytest.raises(ShapeError, match=r"needs at least 1 input"):
        Concat("cat", [], axis=0)


@st.composite
def concat_case(draw):
    base = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    axis = draw(st.integers(-len(base), len(base) - 1))
    sizes = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    shapes = [tuple(base[:axis % len(base)] + [s] + base[axis % len(base) + 1:]) for s in sizes]
    return shapes, axis


@settings(max_examples=20, deadline=None)
@given(case=concat_case(), seed=st.integers(0, 2**16))
def test_concat_any_shapes(case, seed):
    shapes, axis = case
    rng = np.random.default_rng(seed)
    xs = [rand(rng, s) for s in shapes]
    op = Concat("cat", [spec(s) for s in shapes], axis=axis)
    check_all(op, xs, lambda *ts: torch.cat(ts, dim=axis), seed=seed, finite_differences=False)


# ---- split -----------------------------------------------------------------------

@pytest.mark.parametrize("shape,sizes,axis", [
    ((4, 6, 3), [2, 3, 1], 1),
    ((6, 5), [1, 4, 1], 0),
    ((3, 2, 7), [3, 4], -1),
    ((4, 3), [3], 1),
])
def test_split_matches_torch_and_tiles(shape, sizes, axis):
    x = rand(np.random.default_rng(2), shape)
    op = Split("split", [spec(shape)], sizes=sizes, axis=axis)
    assert op.tile_shape == shape
    assert [o.name for o in op.outputs] == ([f"split.out{i}" for i in range(len(sizes))]
                                            if len(sizes) > 1 else ["split.out"])
    check_all(op, [x], lambda t: torch.split(t, sizes, dim=axis))


def test_split_output_rects_map_input_tiles_to_outputs():
    op = Split("split", [spec((4, 6))], sizes=[2, 3, 1], axis=1)
    assert [(s.dim, s.kind) for s in op.split_dims()] == [(0, SAMPLE), (1, ATTRIBUTE)]
    rects = op.output_rects(Rect((1, 1), (3, 4)))
    assert rects == [Rect((1, 1), (3, 2)), Rect((1, 0), (3, 2)), Rect((1, 0), (3, 0))]
    rects = op.output_rects(Rect((0, 5), (4, 6)))
    assert [r.shape for r in rects] == [(4, 0), (4, 0), (4, 1)]
    assert all(0 <= r.lo[1] == r.hi[1] for r in rects[:2])
    assert op.bytes_moved(Rect((0, 5), (4, 6))) == 2 * 4 * 4


def test_split_backward_reads_a_missing_output_gradient_as_zeros():
    x = rand(np.random.default_rng(3), (3, 5))
    op = Split("split", [spec(x.shape)], sizes=[2, 3], axis=1)
    g1 = np.ones((3, 3), dtype=np.float32)
    _, (gx,), _, _ = run_whole(op, [x], {}, grad_outputs=[None, g1])
    np.testing.assert_array_equal(gx, np.concatenate([np.zeros((3, 2), np.float32), g1], axis=1))


def test_split_errors():
    with pytest.raises(ShapeError, match=r"split 's': sizes \[2, 2\] sum to 4, but dim 1 of the input is 5"):
        Split("s", [spec((3, 5))], sizes=[2, 2], axis=1)
    with pytest.raises(ShapeError, match=r"sizes must be a non-empty list of positive ints, got \[5, 0\]"):
        Split("s", [spec((3, 5))], sizes=[5, 0], axis=1)
    with pytest.raises(ShapeError, match=r"axis=-3 is out of range for 2 dims"):
        Split("s", [spec((3, 5))], sizes=[3], axis=-3)


@st.composite
def split_case(draw):
    shape = draw(st.lists(st.integers(1, 5), min_size=1, max_size=3))
    axis = draw(st.integers(0, len(shape) - 1))
    sizes, left = [], shape[axis]
    while left:
        s = draw(st.integers(1, left))
        sizes.append(s)
        left -= s
    return tuple(shape), sizes, axis


@settings(max_examples=20, deadline=None)
@given(case=split_case(), seed=st.integers(0, 2**16))
def test_split_any_sizes(case, seed):
    shape, sizes, axis = case
    x = rand(np.random.default_rng(seed), shape)
    op = Split("split", [spec(shape)], sizes=sizes, axis=axis)
    check_all(op, [x], lambda t: torch.split(t, sizes, dim=axis), seed=seed, finite_differences=False)


# ---- flat and reshape ------------------------------------------------------------

@pytest.mark.parametrize("shape", [(4, 2, 3, 2), (5, 3), (3, 1, 4)])
def test_flat_matches_torch_and_tiles(shape):
    x = rand(np.random.default_rng(4), shape)
    op = Flat("flat", [spec(shape)])
    assert [(s.dim, s.kind) for s in op.split_dims()] == [(0, SAMPLE)]
    assert op.input_rects(Rect((1, 0), (3, op.outputs[0].shape[1]))) == [Rect((1,) + (0,) * (len(shape) - 1),
                                                                             (3,) + shape[1:])]
    check_all(op, [x], lambda t: torch.flatten(t, 1))


def test_flat_needs_two_dims():
    with pytest.raises(ShapeError, match=r"flat 'flat': needs at least 2 dims \[N, \.\.\.\], got shape \(5,\)"):
        Flat("flat", [spec((5,))])


@pytest.mark.parametrize("src,shape,expect", [
    ((4, 6, 2), [4, -1, 3], (4, 4, 3)),
    ((4, 12), [4, 3, 2, 2], (4, 3, 2, 2)),
    ((3, 2, 5), [-1, 10], (3, 10)),
    ((2, 3, 4), [2, 12], (2, 12)),
])
def test_reshape_matches_torch_and_tiles(src, shape, expect):
    x = rand(np.random.default_rng(5), src)
    op = Reshape("rs", [spec(src)], shape=shape)
    assert op.outputs[0].shape == expect and op.attrs() == {"shape": shape}
    check_all(op, [x], lambda t: t.reshape(shape))


def test_reshape_errors():
    with pytest.raises(ShapeError, match=r"reshape 'rs': reshape must keep dim 0 \(the batch, 4\), "
                                         r"but \(8, -1\) gives 8"):
        Reshape("rs", [spec((4, 6))], shape=[8, -1])
    with pytest.raises(ShapeError, match=r"shape \[4, -1, -1\] has more than one -1"):
        Reshape("rs", [spec((4, 6))], shape=[4, -1, -1])
    with pytest.raises(ShapeError, match=r"can't reshape \(4, 6\) \(24 elements\) -> \(4, 5\) \(20 elements\)"):
        Reshape("rs", [spec((4, 6))], shape=[4, 5])
    with pytest.raises(ShapeError, match=r"can't reshape \(4, 6\) -> \(4, -1, 5\): 24 elements don't divide by 20"):
        Reshape("rs", [spec((4, 6))], shape=[4, -1, 5])


# ---- transpose -------------------------------------------------------------------

@pytest.mark.parametrize("shape,perm", [((2, 3, 4), [0, 2, 1]), ((2, 3, 4, 5), [0, 3, 1, 2]),
                                        ((3, 4), [1, 0]), ((2, 3, 4), [2, 0, 1])])
def test_transpose_matches_torch_and_tiles(shape, perm):
    x = rand(np.random.default_rng(6), shape)
    op = Transpose("tr", [spec(shape)], perm=perm)
    check_all(op, [x], lambda t: t.permute(*perm))


def test_transpose_input_rect_is_the_permuted_tile_and_sample_follows_dim_0():
    op = Transpose("tr", [spec((2, 3, 4))], perm=[2, 0, 1])
    assert op.outputs[0].shape == (4, 2, 3)
    assert op.input_rects(Rect((1, 0, 2), (3, 1, 3))) == [Rect((0, 2, 1), (1, 3, 3))]
    assert [(s.dim, s.kind) for s in op.split_dims()] == [(0, ATTRIBUTE), (1, SAMPLE), (2, ATTRIBUTE)]


def test_transpose_errors():
    with pytest.raises(ShapeError, match=r"transpose 'tr': perm \[0, 0, 1\] is not a permutation of the 3 input dims"):
        Transpose("tr", [spec((2, 3, 4))], perm=[0, 0, 1])
    with pytest.raises(ShapeError, match=r"perm \[1, 0\] is not a permutation of the 3 input dims"):
        Transpose("tr", [spec((2, 3, 4))], perm=[1, 0])


@settings(max_examples=20, deadline=None)
@given(data=st.data(), shape=st.lists(st.integers(1, 4), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_transpose_any_perm(data, shape, seed):
    perm = data.draw(st.permutations(range(len(shape))))
    x = rand(np.random.default_rng(seed), tuple(shape))
    op = Transpose("tr", [spec(shape)], perm=perm)
    check_all(op, [x], lambda t: t.permute(*perm), seed=seed, finite_differences=False)


def test_data_movement_ops_count_no_flops():
    ops = [Concat("c", [spec((2, 3)), spec((2, 3))], axis=1), Split("s", [spec((2, 4))], sizes=[1, 3], axis=1),
           Flat("f", [spec((2, 3, 4))]), Reshape("r", [spec((2, 6))], shape=[2, 3, 2]),
           Transpose("t", [spec((2, 3))], perm=[1, 0])]
    for op in ops:
        tile = Rect.from_shape(op.tile_shape)
        assert op.flops(tile) == 0 and op.bytes_moved(tile) > 0


def test_attrs_rebuild_the_same_op():
    ops = [Concat("c", [spec((2, 3)), spec((2, 1))], axis=-1), Split("s", [spec((2, 4))], sizes=[1, 3], axis=1),
           Flat("f", [spec((2, 3, 4))]), Reshape("r", [spec((2, 6))], shape=[2, -1, 2]),
           Transpose("t", [spec((2, 3, 4))], perm=[0, 2, 1])]
    for op in ops:
        again = OP_REGISTRY[op.kind](op.name, op.inputs, **op.attrs())
        assert again.outputs == op.outputs and again.attrs() == op.attrs()
