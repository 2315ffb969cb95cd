"""A single-layer LSTM over a batch-first sequence, with PyTorch's weights, gate order and init.

Forward does the input projection of every step in one GEMM ([batch*seq, in] @ W_ih^T),
then one [batch, hidden] @ W_hh^T GEMM per step, keeping the gate activations and cell
states for backward. Backward runs through time with one GEMM per step for the
recurrent gradient and finishes with three big GEMMs for dx, dW_ih and dW_hh.

Gates, per step t, in PyTorch's order (i, f, g, o):
    i, f, o = sigmoid(.), g = tanh(.) of x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh
    c_t = f * c_{t-1} + i * g,    h_t = o * tanh(c_t)

The sequence is an ordered split: a tile is a chunk of time steps, and chunk k starts from
the (h, c) that chunk k-1 left in the op's carry (backward: from the gradient of them that
chunk k+1 left). The runtime orders the chunks by that carry alone, so stacked layers on
different devices run as a wavefront: chunk k of layer 2 beside chunk k+1 of layer 1.
"""
from __future__ import annotations

import numpy as np

from ops.base import ATTRIBUTE, SAMPLE, Op, SplitDim, batch_rect, register_op
from ops.linear import torch_linear_init
from taskrt.geometry import Rect


def _sigmoid_(xp, a) -> None:
    """a = sigmoid(a) in place, as 0.5 * tanh(a / 2) + 0.5 (no overflow for large |a|)."""
    a *= 0.5
    xp.tanh(a, out=a)
    a *= 0.5
    a += 0.5


@register_op
class LSTM(Op):
    """y, h_n, c_n = LSTM(x, h0, c0) for x [batch, seq, in]; y is [batch, seq, hidden], h_n and c_n [batch, hidden].

    h0 and c0 are inputs 1 and 2 when `with_initial_state`, zeros otherwise. The batch dim
    may be split, and the sequence (an ordered attribute dim: the recurrence runs along it),
    not the hidden units (every gate needs all of h): a tile reads its rows and steps of x,
    its rows of h0 and c0 when it holds step 0, and writes its rows and steps of y, and its
    rows of h_n and c_n when it holds the last step.
    """

    kind = "lstm"

    def __init__(self, name, inputs, hidden_size: int, with_initial_state: bool = False):
        super().__init__(name, inputs, hidden_size=hidden_size, with_initial_state=with_initial_state)

    def infer_shapes(self, in_shapes):
        n_in = 3 if self.with_initial_state else 1
        if len(in_shapes) != n_in:
            raise self.fail(f"takes {n_in} input{'s (x, h0, c0)' if n_in == 3 else ' (x)'} with "
                            f"with_initial_state={self.with_initial_state}, got {len(in_shapes)}")
        if not isinstance(self.hidden_size, (int, np.integer)) or self.hidden_size < 1:
            raise self.fail(f"hidden_size must be a positive int, got {self.hidden_size!r}")
        x = in_shapes[0]
        if len(x) != 3 or x[1] < 1:
            raise self.fail(f"x must be [batch, seq, in] with seq >= 1, got shape {x}")
        for t in self.inputs:
            if np.dtype(t.dtype).kind != "f":
                raise self.fail(f"input {t.name} must be floating point, got {t.dtype}")
        batch, seq, _ = x
        hidden = int(self.hidden_size)
        for label, s in zip(("h0", "c0"), in_shapes[1:]):
            if tuple(s) != (batch, hidden):
                raise self.fail(f"{label} must be [batch, hidden] = {(batch, hidden)}, got {s}")
        return [(batch, seq, hidden), (batch, hidden), (batch, hidden)]

    def weight_shapes(self):
        h, n_in = int(self.hidden_size), self.inputs[0].shape[-1]
        return {"weight_ih": (4 * h, n_in), "weight_hh": (4 * h, h), "bias_ih": (4 * h,), "bias_hh": (4 * h,)}

    def init_weights(self, rng):
        return {k: torch_linear_init(rng, s, int(self.hidden_size), self.weight_dtype(k))
                for k, s in self.weight_shapes().items()}

    def split_dims(self):
        return (SplitDim(0, SAMPLE), SplitDim(1, ATTRIBUTE, ordered=True))

    def _ends(self, tile: Rect) -> tuple[bool, bool]:
        """Whether the tile holds the first step, and the last."""
        return tile.lo[1] == 0, tile.hi[1] == self.inputs[0].shape[1]

    def input_rects(self, tile: Rect) -> list[Rect]:
        first, _ = self._ends(tile)
        x = Rect((tile.lo[0], tile.lo[1], 0), (tile.hi[0], tile.hi[1], self.inputs[0].shape[2]))
        return [x] + [batch_rect(tile, t.shape) if first else _no_rows(tile) for t in self.inputs[1:]]

    def output_rects(self, tile: Rect) -> list[Rect]:
        _, last = self._ends(tile)
        return [tile] + [batch_rect(tile, t.shape) if last else _no_rows(tile) for t in self.outputs[1:]]

    def _check_carry(self, tile: Rect, carry, needed: bool) -> None:
        if needed and carry is None:
            raise self.fail(f"tile {tile!r} holds steps {tile.lo[1]}..{tile.hi[1] - 1} of "
                            f"{self.inputs[0].shape[1]}, so it needs the carry of its neighbour chunk; got none")

    def carry_shapes(self):
        return {"state": (2, self.inputs[0].shape[0], int(self.hidden_size))}

    def carry_rects(self, tile: Rect) -> dict[str, Rect]:
        return {"state": Rect((0, tile.lo[0], 0), (2, tile.hi[0], int(self.hidden_size)))}

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None, carry=None):
        x = inputs[0]
        batch, seq, n_in = x.shape
        h = int(self.hidden_size)
        dt = x.dtype
        w_ih, w_hh = weights["weight_ih"], weights["weight_hh"]
        if w_ih.shape != (4 * h, n_in):
            raise self.fail(f"weight_ih is {tuple(w_ih.shape)}, expected {(4 * h, n_in)} for input features {n_in}")
        first, last = self._ends(tile)
        self._check_carry(tile, carry, not first)
        if not first:  # copies: the carry is overwritten before backward reads `saved`
            h_prev, c_prev = carry["state"][0].copy(), carry["state"][1].copy()
        elif self.with_initial_state:
            h_prev, c_prev = inputs[1], inputs[2]
        else:
            h_prev = c_prev = xp.zeros((batch, h), dtype=dt)
        h0, c0 = h_prev, c_prev

        # all steps' input projections in one GEMM; row b*seq + t is (sample b, step t)
        gates = x.reshape(batch * seq, n_in) @ w_ih.T
        gates += weights["bias_ih"]
        gates += weights["bias_hh"]
        gates = gates.reshape(batch, seq, 4 * h)

        y = xp.empty((batch, seq, h), dtype=dt)
        cs = xp.empty((batch, seq, h), dtype=dt)
        tanh_cs = xp.empty((batch, seq, h), dtype=dt)
        rec = xp.empty((batch, 4 * h), dtype=dt)
        tmp = xp.empty((batch, h), dtype=dt)
        w_hh_t = w_hh.T
        for t in range(seq):
            g = gates[:, t]
            xp.matmul(h_prev, w_hh_t, out=rec)
            g += rec
            _sigmoid_(xp, g[:, :2 * h])
            xp.tanh(g[:, 2 * h:3 * h], out=g[:, 2 * h:3 * h])
            _sigmoid_(xp, g[:, 3 * h:])
            i, f, gg, o = g[:, :h], g[:, h:2 * h], g[:, 2 * h:3 * h], g[:, 3 * h:]
            c_t, tc_t, h_t = cs[:, t], tanh_cs[:, t], y[:, t]
            xp.multiply(f, c_prev, out=c_t)
            xp.multiply(i, gg, out=tmp)
            c_t += tmp
            xp.tanh(c_t, out=tc_t)
            xp.multiply(o, tc_t, out=h_t)
            h_prev, c_prev = h_t, c_t
        saved = (gates, cs, tanh_cs, y, h0, c0)
        if carry is not None:
            carry["state"][0] = y[:, -1]
            carry["state"][1] = cs[:, -1]
        return [y, y[:, -1].copy() if last else None, cs[:, -1].copy() if last else None], saved

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved, carry=None):
        x = inputs[0]
        batch, seq, n_in = x.shape
        h = int(self.hidden_size)
        dt = x.dtype
        gates, cs, tanh_cs, y, h0, c0 = saved
        w_ih, w_hh = weights["weight_ih"], weights["weight_hh"]
        dy, dh_n, dc_n = grad_outputs
        first, last = self._ends(tile)
        self._check_carry(tile, carry, not last)
        if not last:
            dh, dc = carry["state"][0].astype(dt, copy=True), carry["state"][1].astype(dt, copy=True)
        else:
            dh = xp.zeros((batch, h), dtype=dt) if dh_n is None else dh_n.astype(dt, copy=True)
            dc = xp.zeros((batch, h), dtype=dt) if dc_n is None else dc_n.astype(dt, copy=True)

        dgates = xp.empty((batch, seq, 4 * h), dtype=dt)  # grads of the pre-activation gates
        tmp = xp.empty((batch, h), dtype=dt)
        for t in range(seq - 1, -1, -1):
            if dy is not None:
                dh += dy[:, t]
            g, dg = gates[:, t], dgates[:, t]
            i, f, gg, o = g[:, :h], g[:, h:2 * h], g[:, 2 * h:3 * h], g[:, 3 * h:]
            di, df, dgg, do = dg[:, :h], dg[:, h:2 * h], dg[:, 2 * h:3 * h], dg[:, 3 * h:]
            tc = tanh_cs[:, t]
            c_prev = cs[:, t - 1] if t > 0 else c0
            # o: dh * tanh(c) * o * (1 - o)
            xp.multiply(dh, tc, out=do)
            do *= o
            xp.subtract(1, o, out=tmp)
            do *= tmp
            # c: dc += dh * o * (1 - tanh(c)^2)
            xp.multiply(tc, tc, out=tmp)
            xp.subtract(1, tmp, out=tmp)
            tmp *= o
            tmp *= dh
            dc += tmp
            # i: dc * g * i * (1 - i)
            xp.multiply(dc, gg, out=di)
            di *= i
            xp.subtract(1, i, out=tmp)
            di *= tmp
            # f: dc * c_prev * f * (1 - f)
            xp.multiply(dc, c_prev, out=df)
            df *= f
            xp.subtract(1, f, out=tmp)
            df *= tmp
            # g: dc * i * (1 - g^2)
            xp.multiply(gg, gg, out=tmp)
            xp.subtract(1, tmp, out=tmp)
            tmp *= i
            xp.multiply(dc, tmp, out=dgg)
            # to step t-1
            dc *= f
            xp.matmul(dg, w_hh, out=dh)

        dg2 = dgates.reshape(batch * seq, 4 * h)
        h_prevs = xp.empty((batch, seq, h), dtype=dt)
        h_prevs[:, 0] = h0
        h_prevs[:, 1:] = y[:, :-1]
        dx = (dg2 @ w_ih).reshape(batch, seq, n_in)
        db = dg2.sum(axis=0)
        grads = {
            "weight_ih": dg2.T @ x.reshape(batch * seq, n_in),
            "weight_hh": dg2.T @ h_prevs.reshape(batch * seq, h),
            "bias_ih": db,
            "bias_hh": db.copy(),
        }
        if carry is not None:
            carry["state"][0] = dh
            carry["state"][1] = dc
        if not self.with_initial_state:
            return [dx], grads
        return [dx, dh, dc] if first else [dx, None, None], grads

    def flops(self, tile: Rect) -> int:
        batch, seq = tile.shape[0], tile.shape[1]
        n_in = self.inputs[0].shape[2]
        h = int(self.hidden_size)
        gemm = 2 * batch * seq * 4 * h * (n_in + h)
        # biases, 3 sigmoids, 2 tanh, the cell and hidden updates: ~30 per hidden unit per step
        return gemm + 30 * batch * seq * h


def _no_rows(tile: Rect) -> Rect:
    """The empty [batch, hidden] rect of a tile that does not touch h0, c0, h_n or c_n."""
    return Rect((tile.lo[0], 0), (tile.hi[0], 0))
