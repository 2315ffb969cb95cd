"""Dropout: a mask that depends only on (seed, global index), so every tiling agrees."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ops.base import ATTRIBUTE, OP_REGISTRY, SAMPLE, ShapeError
from ops.dropout import Dropout, global_index, keep_mask
from taskrt.geometry import Rect
from tests.opcheck import check_finite_differences, check_tiled, run_whole, spec, tiles_of


def dropout_run(shape, rate, seed, training=True):
    op = Dropout("drop", [spec(shape)], rate=rate, seed=seed)
    x = np.random.default_rng(0).uniform(1.0, 2.0, shape).astype(np.float32)  # never 0
    (y,), (gx,), _, _ = run_whole(op, [x], {}, [np.ones_like(x)], training=training)
    return op, x, y, gx


@pytest.mark.parametrize("shape", [(6,), (5, 7), (3, 4, 5), (2, 3, 4, 5)])
def test_dropout_is_identical_on_every_tiling(shape):
    op, x, y, _ = dropout_run(shape, 0.4, seed=11)
    g = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    check_tiled(op, [x], {}, [g], rtol=0, atol=0)
    check_finite_differences(op, [x], {})
    # an uneven hand-made tiling too
    tiled = np.zeros_like(y)
    for tile in tiles_of(shape, {d: min(3, shape[d]) for d in range(len(shape))}):
        (t,), _ = op.forward(np, tile, [x[tile.slices()]], [tile], {})
        tiled[tile.slices()] = t
    np.testing.assert_array_equal(tiled, y)


def test_dropout_seed_rate_and_scale():
    shape = (64, 50, 40)
    _, x, y, gx = dropout_run(shape, 0.3, seed=7)
    kept = y != 0
    assert abs(1 - kept.mean() - 0.3) < 0.005
    np.testing.assert_allclose(y[kept], x[kept] / 0.7, rtol=1e-6)
    np.testing.assert_allclose(gx, kept / np.float32(0.7), rtol=1e-6)
    _, _, y_again, _ = dropout_run(shape, 0.3, seed=7)
    np.testing.assert_array_equal(y, y_again)
    _, _, y_other, _ = dropout_run(shape, 0.3, seed=8)
    assert 0.3 < np.mean((y_other != 0) != kept) < 0.5  # independent masks differ in ~42% of places
    for rate in (0.1, 0.5, 0.9):
        _, _, y_r, _ = dropout_run(shape, rate, seed=3)
        assert abs(np.mean(y_r == 0) - rate) < 0.005


def test_dropout_inference_and_extreme_rates():
    _, x, y, gx = dropout_run((8, 9), 0.5, seed=1, training=False)
    np.testing.assert_array_equal(y, x)
    np.testing.assert_array_equal(gx, np.ones_like(x))
    _, x, y, _ = dropout_run((8, 9), 0.0, seed=1)
    np.testing.assert_array_equal(y, x)
    _, _, y, gx = dropout_run((8, 9), 1.0, seed=1)
    assert not y.any() and not gx.any()


def test_dropout_mask_depends_on_global_index_only():
    shape = (4, 5, 6)
    full = global_index(np, (0, 0, 0), shape, shape)
    np.testing.assert_array_equal(full, np.arange(120, dtype=np.uint64).reshape(shape))
    part = global_index(np, (1, 2, 3), (3, 4, 6), shape)
    np.testing.assert_array_equal(part, full[1:3, 2:4, 3:6])
    np.testing.assert_array_equal(keep_mask(np, 5, 0.5, (1, 2, 3), (3, 4, 6), shape),
                                  keep_mask(np, 5, 0.5, (0, 0, 0), shape, shape)[1:3, 2:4, 3:6])


def test_dropout_mask_changes_with_the_step_and_not_with_the_tiling():
    shape = (6, 7, 8)
    op = Dropout("drop", [spec(shape)], rate=0.5, seed=4)
    x = np.ones(shape, np.float32)

    def run(step, tiles):
        y = np.zeros_like(x)
        for tile in tiles:
            (t,), _ = op.forward(np, tile, [x[tile.slices()]], [tile], {}, step=step)
            y[tile.slices()] = t
        return y

    whole = [Rect.from_shape(shape)]
    y0, y1, y2 = run(0, whole), run(1, whole), run(2, whole)
    assert 0.3 < np.mean(y0 != y1) < 0.7 and 0.3 < np.mean(y1 != y2) < 0.7
    np.testing.assert_array_equal(y0, run_whole(op, [x], {})[0][0])  # step defaults to 0
    np.testing.assert_array_equal(y1, run(1, tiles_of(shape, {0: 2, 1: 3, 2: 3})))
    other_seed = Dropout("drop", [spec(shape)], rate=0.5, seed=5)
    assert np.any(other_seed.forward(np, whole[0], [x], whole, {}, step=1)[0][0] != y1)


def test_dropout_rules_and_errors():
    op = Dropout("drop", [spec((4, 5, 6))], rate=0.25, seed=3)
    assert [(s.dim, s.kind) for s in op.split_dims()] == [(0, SAMPLE), (1, ATTRIBUTE), (2, ATTRIBUTE)]
    tile = Rect((1, 0, 2), (3, 5, 6))
    assert op.input_rects(tile) == [tile] and op.weight_shapes() == {}
    assert op.attrs() == {"rate": 0.25, "seed": 3} and op.has_training_mode and op.uses_step
    assert op.flops(tile) == tile.volume
    assert OP_REGISTRY["dropout"] is Dropout
    with pytest.raises(ShapeError, match=r"dropout 'drop': rate must be in \[0, 1\], got 1.5"):
        Dropout("drop", [spec((4, 5))], rate=1.5)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.data(), st.sampled_from([0.1, 0.5, 0.8, 1.0]),
       st.integers(0, 2**40), st.integers(0, 50), st.sampled_from(["float32", "float64"]))
def test_the_cpu_kernel_gives_the_array_math_bit_for_bit(shape, data, rate, seed, step, dtype):
    """forward on numpy (one numba pass) against the xp array math that cupy runs, on any tile
    of any tensor: the same multiplier and output, bit for bit."""
    shape = tuple(shape)
    lo = [data.draw(st.integers(0, n - 1)) for n in shape]
    hi = [data.draw(st.integers(a + 1, n)) for a, n in zip(lo, shape)]
    tile = Rect.make(lo, hi)
    op = Dropout("drop", [spec(shape, dtype)], rate=rate, seed=seed)
    x = np.random.default_rng(seed % 97).standard_normal(tile.shape).astype(dtype)
    (y,), mult = op.forward(np, tile, [x], [tile], {}, step=step)
    want = op._multiplier(np, tile, x.dtype, step)
    assert mult.dtype == want.dtype == y.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(mult, want)
    np.testing.assert_array_equal(y, x * want)
    # a strided view (every other element of a bigger array) gives the same
    big = np.zeros(tile.shape + (2,), dtype)
    big[..., 0] = x
    assert x.size == 1 or not big[..., 0].flags.c_contiguous
    (y_view,), _ = op.forward(np, tile, [big[..., 0]], [tile], {}, step=step)
    np.testing.assert_array_equal(y_view, y)
