"""One helper that every operator test uses: whole-op and tiled checks against a reference.

`run_whole` runs an operator's forward and backward kernels on the whole tile space,
compares them with a reference (PyTorch or NumPy), checks backward against central
finite differences in float64, and then checks the tile rules: splitting the tile
space along every declared split dimension, running each tile on exactly the input
and weight rects the op asks for, and summing overlapping gradient contributions,
must reproduce the whole-op results. Tiles are treated as lowering treats them
(ops/lower.py): tiles of a partial split sum their outputs and only the group's leader
gets the biases; shared sums are added up over the tiles before the kernels run; tiles
along a split ordered dim run in order (backward: in reverse) handing their carry on; a
state rect shared by several tiles is updated by the first of them. That check is what
makes an operator's rect rules trustworthy for SOAP execution.
"""
from __future__ import annotations

import itertools

import numpy as np

from ops.base import TensorSpec
from ops.lower import first_users
from taskrt.geometry import Rect


def spec(shape, dtype="float32", name="x") -> TensorSpec:
    """An operator input of `shape`."""
    return TensorSpec(tuple(shape), dtype, name)


def _given(arrays: dict, rects: dict) -> dict:
    """Each array's slice at its rect, for the rects that are not empty (what a tile is given)."""
    return {k: a[rects[k].slices()] for k, a in arrays.items() if k in rects and not rects[k].empty}


def _tile(op, tile, inputs, weights, training=True, state=None, state_rects=None, **extra):
    in_rects = op.input_rects(tile)
    ins = [x[r.slices()] for x, r in zip(inputs, in_rects)]
    wr = op.tile_weight_rects(tile)
    ws = _given(weights, wr)
    st = None if state is None else {k: v.copy() for k, v in _given(state, state_rects or wr).items()} or None
    outs, saved = op.forward(np, tile, ins, in_rects, ws, training=training, state=st, **extra)
    return in_rects, ins, wr, ws, outs, saved, st


def run_whole(op, inputs, weights, grad_outputs=None, training=True, state=None):
    """Forward (and backward when grad_outputs given) on the whole tile space."""
    tile = Rect.from_shape(op.tile_shape)
    in_rects, ins, wr, ws, outs, saved, st = _tile(op, tile, inputs, weights, training, state)
    if grad_outputs is None:
        return outs, None, None, st
    gin, gw = op.backward(np, tile, *_read(op, ins, in_rects, ws, outs, grad_outputs, saved))
    return outs, gin, gw, st


def _read(op, inputs, in_rects, weights, outputs, grad_outputs, saved) -> tuple:
    """backward's arguments as lowering gives them: None for the inputs and outputs the op says
    its backward does not read (Op.backward_reads), so that a wrong declaration fails here too."""
    return _read_inputs(op, inputs), in_rects, weights, _read_outputs(op, outputs), grad_outputs, saved


def _read_inputs(op, inputs: list) -> list:
    return [x if r else None for x, r in zip(inputs, op.backward_reads()[0])]


def _read_outputs(op, outputs: list) -> list:
    return [o if r else None for o, r in zip(outputs, op.backward_reads()[1])]


def _splits(extent, parts):
    cuts = [extent * i // parts for i in range(parts + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]


def tilings(op, parts=(2, 3)):
    """Tilings of the tile space: each split dim alone in 2 and 3 pieces, and all together in 2."""
    shape = op.tile_shape
    dims = [s.dim for s in op.split_dims()]
    out = []
    for d in dims:
        for p in parts:
            if shape[d] >= p:
                out.append({d: p})
    if len(dims) > 1:
        out.append({d: 2 for d in dims if shape[d] >= 2})
    return out


def tiles_of(shape, degrees):
    """The tiles of a tiling in row-major order (the order of lowering's colors)."""
    ranges = [_splits(shape[d], degrees.get(d, 1)) for d in range(len(shape))]
    for combo in itertools.product(*ranges):
        yield Rect(tuple(a for a, _ in combo), tuple(b for _, b in combo))


def _add_up(op, tiles, names, part_of):
    """The totals of sums `names` over `tiles`, in order: part_of(i, tile, name, earlier totals)
    gives tile i's part; a later sum sees the earlier totals at the tile's rects."""
    totals = {}
    for k in names:
        total = np.zeros(op.sum_shapes()[k])
        for i, tile in enumerate(tiles):
            rects = op.sum_rects(tile)
            before = {j: totals[j][rects[j].slices()] for j in totals}
            total[rects[k].slices()] += part_of(i, tile, k, before)
        totals[k] = total
    return totals


def _extra(op, tile, sums, carry):
    """The sums= and carry= keyword arguments of ops that take them, as lowering passes them."""
    extra = {}
    if op.sum_shapes():
        rects = op.sum_rects(tile)
        extra["sums"] = None if sums is None else {k: v[rects[k].slices()] for k, v in sums.items()} or None
    if op.carry_shapes():
        rects = op.carry_rects(tile)
        extra["carry"] = None if carry is None else {k: v[rects[k].slices()] for k, v in carry.items()}
    return extra


def check_tiled(op, inputs, weights, grad_outputs, rtol=1e-5, atol=1e-6, training=True, state=None):
    """Every tiling of the declared split dims gives the whole-op forward and backward."""
    ref_outs, ref_gin, ref_gw, ref_state = run_whole(op, inputs, weights, grad_outputs, training,
                                                     None if state is None else {k: v.copy() for k, v in state.items()})
    ordered = op.ordered_dim()
    for degrees in tilings(op):
        tiles = list(tiles_of(op.tile_shape, degrees))
        chained = ordered is not None and degrees.get(ordered, 1) > 1
        shared = op.shares_sums(tiles)
        dtype = next((o.dtype for o in ref_outs if o is not None), np.float64)
        carry = {k: np.zeros(s, dtype) for k, s in op.carry_shapes().items()} if chained else None
        state_rects = {i: op.tile_weight_rects(t) for i, t in enumerate(tiles)}
        if training:
            state_rects = first_users(list(state_rects), state_rects)
        sums = None
        if shared:
            sums = _add_up(op, tiles, op.forward_sums(training), lambda i, tile, k, before: op.partial_sum(
                np, k, tile, [x[r.slices()] for x, r in zip(inputs, op.input_rects(tile))], before))
        outs = [np.zeros_like(o) for o in ref_outs]
        new_state = None if state is None else {k: v.copy() for k, v in state.items()}
        runs = []
        for tile, srects in zip(tiles, state_rects.values()):
            in_rects, ins, wr, ws, touts, saved, st = _tile(op, tile, inputs, weights, training, state, srects,
                                                            **_extra(op, tile, sums, carry))
            for full, r, t in zip(outs, op.output_rects(tile), touts):
                if r.empty:
                    continue
                assert t.shape == r.shape, f"{op.kind}: tile {tile} output shape {t.shape} != {r.shape}"
                full[r.slices()] += t
            if st is not None:
                for k in st:
                    new_state[k][srects[k].slices()] = st[k]
            tgouts = [None if g is None or r.empty else g[r.slices()]
                      for g, r in zip(grad_outputs, op.output_rects(tile))]
            runs.append((tile, in_rects, ins, wr, ws, touts, tgouts, saved))
        if shared:
            sums = _add_up(op, tiles, op.backward_sums(), lambda i, tile, k, before: op.partial_sum(
                np, k, tile, _read_inputs(op, runs[i][2]), before, _read_outputs(op, runs[i][5]), runs[i][6],
                runs[i][7]))
        carry = {k: np.zeros(s, dtype) for k, s in op.carry_shapes().items()} if chained else None
        gin = [None if g is None else np.zeros_like(g) for g in ref_gin]
        gw = {k: np.zeros_like(v) for k, v in ref_gw.items()}
        for tile, in_rects, ins, wr, ws, touts, tgouts, saved in reversed(runs):
            tg_in, tg_w = op.backward(np, tile, *_read(op, ins, in_rects, ws, touts, tgouts, saved),
                                      **_extra(op, tile, sums, carry))
            for full, r, t in zip(gin, in_rects, tg_in):
                if full is not None and t is not None and not r.empty:
                    assert t.shape == r.shape, f"{op.kind}: grad input shape {t.shape} != rect {r}"
                    full[r.slices()] += t
            assert set(tg_w) == set(ws), (f"{op.kind}: tile {tile} returned grads {sorted(tg_w)} for weights "
                                          f"{sorted(ws)}")
            for k, t in tg_w.items():
                assert t.shape == wr[k].shape, f"{op.kind}: grad {k} shape {t.shape} != weight rect {wr[k]}"
                gw[k][wr[k].slices()] += t
        for a, b in zip(outs, ref_outs):
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"{op.kind} forward, tiling {degrees}")
        for a, b in zip(gin, ref_gin):
            if a is not None:
                np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"{op.kind} grad input, tiling {degrees}")
        for k in gw:
            np.testing.assert_allclose(gw[k], ref_gw[k], rtol=rtol, atol=atol, err_msg=f"{op.kind} grad {k}, tiling {degrees}")
        if state is not None:
            for k in state:
                np.testing.assert_allclose(new_state[k], ref_state[k], rtol=rtol, atol=atol,
                                           err_msg=f"{op.kind} state {k}, tiling {degrees}")


def check_finite_differences(op, inputs, weights, rtol=1e-4, atol=1e-6, eps=1e-6, seed=0, training=True,
                             max_checks=12):
    """Backward against central differences of sum(random projection of the outputs), in float64."""
    rng = np.random.default_rng(seed)
    inputs = [x.astype(np.float64) if np.issubdtype(x.dtype, np.floating) else x for x in inputs]
    weights = {k: v.astype(np.float64) for k, v in weights.items()}
    outs, _, _, _ = run_whole(op, inputs, weights, training=training)
    proj = [rng.standard_normal(o.shape) for o in outs]

    def objective():
        o, _, _, _ = run_whole(op, inputs, weights, training=training)
        return sum(float((a * p).sum()) for a, p in zip(o, proj))

    _, gin, gw, _ = run_whole(op, inputs, weights, grad_outputs=proj, training=training)
    targets = [(x, g, f"input {i}") for i, (x, g) in enumerate(zip(inputs, gin))
               if g is not None and np.issubdtype(x.dtype, np.floating)]
    targets += [(weights[k], gw[k], k) for k in gw]
    for arr, grad, label in targets:
        flat = arr.reshape(-1)
        idx = rng.choice(flat.size, size=min(max_checks, flat.size), replace=False)
        for i in idx:
            old = flat[i]
            flat[i] = old + eps
            up = objective()
            flat[i] = old - eps
            down = objective()
            flat[i] = old
            num = (up - down) / (2 * eps)
            ana = grad.reshape(-1)[i]
            assert np.isclose(ana, num, rtol=rtol, atol=atol), (
                f"{op.kind} grad of {label} at flat index {i}: analytic {ana}, numeric {num}")


class ArrayCodePath:
    """numpy under another identity: `xp is np` fails, so kernels take their GPU (cupy) code paths."""

    __name__ = "numpy"

    def __getattr__(self, name):
        return getattr(np, name)


def run_both_paths(op, x, weights, g):
    """Forward and backward of the whole op with numpy and with the array-code (GPU) path."""
    tile = Rect.from_shape(op.tile_shape)
    rects = op.input_rects(tile)
    results = []
    for xp in (np, ArrayCodePath()):
        outs, saved = op.forward(xp, tile, [x], rects, weights)
        results.append((outs, *op.backward(xp, tile, [x], rects, weights, outs, [g], saved)))
    (o1, gi1, gw1), (o2, gi2, gw2) = results
    np.testing.assert_allclose(o1[0], o2[0], rtol=1e-12)
    np.testing.assert_allclose(gi1[0], gi2[0], rtol=1e-12)
    for k in gw1:
        np.testing.assert_allclose(gw1[k], gw2[k], rtol=1e-12)
