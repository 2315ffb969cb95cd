"""Embedding against PyTorch, finite differences, every tiling, and the scatter-add kernel."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from ops.base import ATTRIBUTE, OP_REGISTRY, PARAMETER, REDUCE, SAMPLE, ShapeError, TensorSpec
from ops.embedding import Embedding, scatter_add_rows
from taskrt.geometry import Rect
from tests.opcheck import check_finite_differences, check_tiled, run_whole


def spec(shape, dtype="int64", name="idx"):
    return TensorSpec(tuple(shape), dtype, name)


def embedding_case(idx_shape, num, dim, idx_dtype="int64", seed=0):
    rng = np.random.default_rng(seed)
    op = Embedding("emb", [spec(idx_shape, idx_dtype)], num_embeddings=num, embedding_dim=dim)
    w = op.init_weights(rng)
    # few distinct rows so that duplicates (accumulated in backward) are common
    idx = rng.integers(0, num, size=idx_shape).astype(idx_dtype)
    g = rng.standard_normal(op.outputs[0].shape).astype(np.float32)
    return op, idx, w, g


def check_against_torch(op, idx, w, g):
    outs, gin, gw, _ = run_whole(op, [idx], w, grad_outputs=[g])
    wt = torch.tensor(w["weight"], requires_grad=True)
    yt = F.embedding(torch.tensor(idx.astype(np.int64)), wt)
    yt.backward(torch.tensor(g))
    assert outs[0].dtype == np.float32 and outs[0].shape == op.outputs[0].shape
    np.testing.assert_array_equal(outs[0], yt.detach().numpy())
    assert gin == [None]
    np.testing.assert_allclose(gw["weight"], wt.grad.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("idx_shape,idx_dtype", [((7,), "int64"), ((4, 5), "int32"), ((2, 3, 4), "int64"),
                                                 ((3, 2), "uint8")])
def test_embedding_matches_torch_finite_differences_and_tiles(idx_shape, idx_dtype):
    op, idx, w, g = embedding_case(idx_shape, 6, 5, idx_dtype)
    check_against_torch(op, idx, w, g)
    check_finite_differences(op, [idx], w)
    check_tiled(op, [idx], {k: v.astype(np.float64) for k, v in w.items()}, [g.astype(np.float64)])


@settings(max_examples=15, deadline=None)
@given(batch=st.integers(1, 6), seq=st.integers(0, 5), num=st.integers(1, 12), dim=st.integers(1, 7),
       seed=st.integers(0, 99))
def test_embedding_any_shape(batch, seq, num, dim, seed):
    shape = (batch, seq) if seq else (batch,)
    op, idx, w, g = embedding_case(shape, num, dim, seed=seed)
    check_against_torch(op, idx, w, g)
    check_tiled(op, [idx], w, [g], rtol=1e-6, atol=1e-6)


def test_embedding_split_dims_rects_dtype_and_flops():
    op = Embedding("emb", [spec((8, 5), "int32")], num_embeddings=100, embedding_dim=16)
    assert op.outputs[0].shape == (8, 5, 16) and op.outputs[0].dtype == "float32"
    assert op.tile_shape == (8, 5, 16, 100)
    assert [(s.dim, s.kind) for s in op.split_dims()] == [(0, SAMPLE), (1, ATTRIBUTE), (2, PARAMETER), (3, REDUCE)]
    tile = Rect((2, 1, 4, 0), (6, 3, 10, 100))
    assert op.input_rects(tile) == [Rect((2, 1), (6, 3))]
    assert op.output_rects(tile) == [Rect((2, 1, 4), (6, 3, 10))]
    assert op.weight_rects(tile) == {"weight": Rect((0, 4), (100, 10))}
    assert op.flops(tile) == 4 * 2 * 6
    # int32 indices, the float32 column slice of the table, the float32 output tile
    assert op.bytes_moved(tile) == 4 * 8 + 4 * 100 * 6 + 4 * 4 * 2 * 6
    rows = Rect((2, 1, 4, 30), (6, 3, 10, 70))  # vocabulary rows [30, 70): a partial lookup
    assert op.weight_rects(rows) == {"weight": Rect((30, 4), (70, 10))}
    assert op.output_rects(rows) == op.output_rects(tile) and op.input_rects(rows) == op.input_rects(tile)
    assert OP_REGISTRY["embedding"] is Embedding
    assert op.attrs() == {"num_embeddings": 100, "embedding_dim": 16}


def test_embedding_init_is_standard_normal():
    op = Embedding("emb", [spec((2,))], num_embeddings=300, embedding_dim=100)
    w = op.init_weights(np.random.default_rng(0))["weight"]
    assert w.shape == (300, 100) and w.dtype == np.float32
    assert abs(w.mean()) < 0.02 and abs(w.std() - 1) < 0.02


@pytest.mark.parametrize("bad", [-1, 10, 12345])
def test_out_of_range_index_names_op_index_and_size(bad):
    op = Embedding("tok_emb", [spec((2, 3))], num_embeddings=10, embedding_dim=4)
    idx = np.array([[1, 2, 3], [4, bad, 5]])
    w = op.init_weights(np.random.default_rng(0))
    tile = Rect.from_shape(op.tile_shape)
    with pytest.raises(IndexError) as err:
        op.forward(np, tile, [idx], op.input_rects(tile), w)
    msg = str(err.value)
    assert "embedding 'tok_emb'" in msg and str(bad) in msg and "num_embeddings=10" in msg
    with pytest.raises(IndexError, match="tok_emb"):
        op.backward(np, tile, [idx], op.input_rects(tile), w, [None], [np.zeros((2, 3, 4), np.float32)], None)
    rows = Rect((0, 0, 0, 5), (2, 3, 4, 10))  # a tile holding rows 5..9 still checks the whole range
    with pytest.raises(IndexError, match="num_embeddings=10"):
        op.forward(np, rows, [idx], op.input_rects(rows), {"weight": w["weight"][5:]})


@pytest.mark.parametrize("inputs,attrs,needle", [
    ([spec((2, 3), "float32")], dict(num_embeddings=5, embedding_dim=4), "must be integers"),
    ([spec(())], dict(num_embeddings=5, embedding_dim=4), "at least 1 dim"),
    ([spec((2,)), spec((2,))], dict(num_embeddings=5, embedding_dim=4), "takes 1 input"),
    ([spec((2,))], dict(num_embeddings=0, embedding_dim=4), "num_embeddings"),
    ([spec((2,))], dict(num_embeddings=5, embedding_dim=-2), "embedding_dim"),
])
def test_embedding_bad_inputs_name_the_op(inputs, attrs, needle):
    with pytest.raises(ShapeError, match=needle) as err:
        Embedding("emb3", inputs, **attrs)
    assert "embedding 'emb3'" in str(err.value)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(0, 40), rows=st.integers(1, 8), cols=st.integers(1, 6), seed=st.integers(0, 99))
def test_scatter_add_rows_equals_add_at(n, rows, cols, seed):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, rows, n)
    src = rng.standard_normal((n, cols))
    out = rng.standard_normal((rows, cols))
    want = out.copy()
    np.add.at(want, idx, src)
    scatter_add_rows(np, out, idx, src)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


def test_backward_of_a_column_tile_reads_a_strided_grad():
    """A parameter-split tile gets a non-contiguous slice of the output grad and of the table."""
    op, idx, w, g = embedding_case((4, 3), 5, 8)
    tile = Rect((0, 0, 2, 0), (4, 3, 6, 5))
    wr = op.weight_rects(tile)["weight"]
    outs, _ = op.forward(np, tile, [idx], op.input_rects(tile), {"weight": w["weight"][wr.slices()]})
    np.testing.assert_array_equal(outs[0], w["weight"][idx][..., 2:6])
    _, gw = op.backward(np, tile, [idx], op.input_rects(tile), {"weight": w["weight"][wr.slices()]},
                        outs, [g[op.output_rects(tile)[0].slices()]], None)
    want = np.zeros((5, 4), np.float32)
    np.add.at(want, idx.reshape(-1), g[..., 2:6].reshape(-1, 4))
    np.testing.assert_allclose(gw["weight"], want, rtol=1e-6, atol=1e-6)


def test_a_vocabulary_tile_looks_up_only_its_rows():
    """Rows [2, 4) of the table: zeros for the other indices, and gradients for those rows only."""
    op, idx, w, g = embedding_case((4, 3), 6, 5)
    tile = Rect((0, 0, 0, 2), (4, 3, 5, 4))
    table = w["weight"][op.weight_rects(tile)["weight"].slices()]
    (out,), _ = op.forward(np, tile, [idx], op.input_rects(tile), {"weight": table})
    held = (idx >= 2) & (idx < 4)
    np.testing.assert_array_equal(out[held], w["weight"][idx[held]])
    assert not out[~held].any()
    _, gw = op.backward(np, tile, [idx], op.input_rects(tile), {"weight": table}, [out], [g], None)
    want = np.zeros((6, 5), np.float32)
    np.add.at(want, idx.reshape(-1), g.reshape(-1, 5))
    np.testing.assert_allclose(gw["weight"], want[2:4], rtol=1e-6, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 6), st.integers(2, 30), st.integers(1, 9), st.integers(0, 2**32 - 1))
def test_backward_into_the_runtimes_buffer_overwrites_it_with_the_gradient(n, num, dim, seed):
    """weight_out (what lowering hands a writes_weight_out op): the gradient is written into that
    array, whatever it held, and the array is returned; the values are those of the allocating path."""
    op, idx, w, g = embedding_case((n, 3), num, dim, seed=seed)
    tile = Rect.from_shape(op.tile_shape)
    outs, _ = op.forward(np, tile, [idx], op.input_rects(tile), w)
    _, allocated = op.backward(np, tile, [idx], op.input_rects(tile), w, outs, [g], None)
    buf = np.full((num, dim), np.nan, np.float32)
    _, given_buf = op.backward(np, tile, [idx], op.input_rects(tile), w, outs, [g], None, weight_out={"weight": buf})
    assert given_buf["weight"] is buf
    np.testing.assert_array_equal(buf, allocated["weight"])
    _, none_given = op.backward(np, tile, [idx], op.input_rects(tile), w, outs, [g], None, weight_out={"weight": None})
    np.testing.assert_array_equal(none_given["weight"], allocated["weight"])
