"""A single-layer LSTM over a batch-first sequence, with PyTorch's weights, gate order and init.

Forward does the input projection of every step in one GEMM ([batch*seq, in] @ W_ih^T),
then one recurrent GEMM per step, keeping the gate activations and cell states for
backward. Backward runs through time with one GEMM per step for the recurrent gradient
and finishes with two big GEMMs: dx, and dW_ih and dW_hh together (dgates^T @ [x | h_{t-1}]).
On the CPU the per-step GEMMs run transposed, W_hh @ h^T and W_hh^T @ dgates^T with the
weight first: OpenBLAS runs those 10-30% faster than h @ W_hh^T at 8-64 samples (a [4h, batch]
result; the steps transpose it back, 40-50 us a step at 16 samples).

Gates, per step t, in PyTorch's order (i, f, g, o):
    i, f, o = sigmoid(.), g = tanh(.) of x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh
    c_t = f * c_{t-1} + i * g,    h_t = o * tanh(c_t)

The sequence is an ordered split: a tile is a chunk of time steps, and chunk k starts from
the (h, c) that chunk k-1 left in the op's carry (backward: from the gradient of them that
chunk k+1 left). The runtime orders the chunks by that carry alone, so stacked layers on
different devices run as a wavefront: chunk k of layer 2 beside chunk k+1 of layer 1.

On the CPU (float32 and float64) each step's element-wise work is one numba kernel over the
step's rows: forward turns the pre-activations into the gates in place and writes c, tanh(c)
and h; backward turns the gates into the pre-activations' gradients in place (backward
consumes what forward saved) and updates dc. Each kernel is a few short loops per row, each
reading and writing few arrays, so that LLVM vectorizes them (one loop over all seven arrays
needs more overlap checks than LLVM makes, and stays scalar); float32's tanh is a rational
function that vectorizes (np.tanh in numba does not). Elsewhere (cupy) the same steps are
plain array code.

The samples' recurrences are independent: on a CPU task with at least PARTS_MIN_ROWS samples
per core, each core runs its samples' projection, steps and dx alone, with BLAS on one
thread (see _in_parts).
"""
from __future__ import annotations

import numba
import numpy as np

from ops import cpu_pool
from ops.base import ATTRIBUTE, SAMPLE, Op, SplitDim, batch_rect, register_op
from ops.linear import torch_linear_init
from taskrt.geometry import Rect

# ---- one step's element-wise work on the CPU ------------------------------------------------
_f32 = np.float32
_ONE, _HALF = _f32(1.0), _f32(0.5)  # float32 constants keep float32 math float32 (float64 stays float64)
# tanh(x) ~ x p(x^2) / q(x^2) on [-c, c] and +-1 beyond: Eigen's float32 rational approximation
# (within 4e-7 of tanh over the whole line)
_TANH_CLAMP = _f32(7.90531110763549805)
_TANH_P = (_f32(4.89352455891786e-03), _f32(6.37261928875436e-04), _f32(1.48572235717979e-05),
           _f32(5.12229709037114e-08), _f32(-8.60467152213735e-11), _f32(2.00018790482477e-13),
           _f32(-2.76076847742355e-16))
_TANH_Q = (_f32(4.89352518554385e-03), _f32(2.26843463243900e-03), _f32(1.18534705686654e-04),
           _f32(1.19825839466702e-06))
_P1, _P3, _P5, _P7, _P9, _P11, _P13 = _TANH_P
_Q0, _Q2, _Q4, _Q6 = _TANH_Q

#: the kernels' flags: error_model="numpy" (a division by zero is not checked: the check
#: keeps loops from vectorizing) and contracted multiply-adds
_KERNEL = dict(nogil=True, error_model="numpy", fastmath={"contract"})


@numba.njit(inline="always", **_KERNEL)
def _tanh(x, fast):
    """tanh(x): the rational approximation if `fast` (float32), else np.tanh."""
    if fast:
        x = _TANH_CLAMP if x > _TANH_CLAMP else x
        x = -_TANH_CLAMP if x < -_TANH_CLAMP else x
        x2 = x * x
        p = x2 * _P13 + _P11
        p = p * x2 + _P9
        p = p * x2 + _P7
        p = p * x2 + _P5
        p = p * x2 + _P3
        p = p * x2 + _P1
        q = x2 * _Q6 + _Q4
        q = q * x2 + _Q2
        q = q * x2 + _Q0
        return x * p / q
    return np.tanh(x)


@numba.njit(inline="always", **_KERNEL)
def _sigmoid(x, fast):
    """sigmoid(x) as 0.5 * tanh(x / 2) + 0.5 (no overflow for large |x|)."""
    return _HALF * _tanh(_HALF * x, fast) + _HALF


@numba.njit(cache=True, **_KERNEL)
def _step_forward_cpu(gates, rec, bias, c0, cs, tcs, y, t, fast):
    """Step t of every row b: gates[b, t] ([4h], i f g o, the input projection) plus rec[b] (h_{t-1}
    W_hh^T) plus bias become the gates in place; c_t, tanh(c_t) and h_t go to cs[b, t], tcs[b, t]
    and y[b, t], from c_{t-1} = cs[b, t - 1] (c0[b] at t = 0). All C-contiguous."""
    h = cs.shape[2]
    s = np.empty(4 * h, gates.dtype)
    for b in range(gates.shape[0]):
        g, r = gates[b, t], rec[b]
        cp = cs[b, t - 1] if t > 0 else c0[b]
        c, tc, hy = cs[b, t], tcs[b, t], y[b, t]
        for j in range(4 * h):
            s[j] = g[j] + r[j] + bias[j]
        for j in range(2 * h):
            g[j] = _sigmoid(s[j], fast)
        for j in range(2 * h, 3 * h):
            g[j] = _tanh(s[j], fast)
        for j in range(3 * h, 4 * h):
            g[j] = _sigmoid(s[j], fast)
        for j in range(h):
            c[j] = g[h + j] * cp[j] + g[j] * g[2 * h + j]
        for j in range(h):
            tc[j] = _tanh(c[j], fast)
        for j in range(h):
            hy[j] = g[3 * h + j] * tc[j]


@numba.njit(cache=True, **_KERNEL)
def _step_backward_cpu(gates, tcs, cs, c0, dh, dc, t):
    """Step t of backward for every row b: from dh[b] (the gradient of h_t, dy's included) and dc[b]
    (that of c_t through step t + 1), the gates[b, t] (i f g o) become the gradients of their
    pre-activations in place, and dc[b] that of c_{t-1}. All C-contiguous."""
    h = cs.shape[2]
    di = np.empty(h, gates.dtype)
    for b in range(gates.shape[0]):
        g = gates[b, t]
        gi, gf, gg, go = g[:h], g[h:2 * h], g[2 * h:3 * h], g[3 * h:]
        tc, d, dcb = tcs[b, t], dh[b], dc[b]
        cp = cs[b, t - 1] if t > 0 else c0[b]
        for j in range(h):  # dc += dh * o * (1 - tanh(c)^2)
            dcb[j] += d[j] * go[j] * (_ONE - tc[j] * tc[j])
        for j in range(h):  # do = dh * tanh(c) * o * (1 - o)
            go[j] = d[j] * tc[j] * go[j] * (_ONE - go[j])
        for j in range(h):  # di = dc * g * i * (1 - i), kept apart: dg needs i
            di[j] = dcb[j] * gg[j] * gi[j] * (_ONE - gi[j])
        for j in range(h):  # dg = dc * i * (1 - g^2)
            gg[j] = dcb[j] * gi[j] * (_ONE - gg[j] * gg[j])
        for j in range(h):
            gi[j] = di[j]
        for j in range(h):  # df = dc * c_{t-1} * f * (1 - f); to step t - 1: dc * f
            f, dcj = gf[j], dcb[j]
            gf[j] = dcj * cp[j] * f * (_ONE - f)
            dcb[j] = dcj * f


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _transpose_cpu(a, out, lo, hi):
    """out[j] = a[:, j] for the columns lo <= j < hi of a (out is a.T, C-contiguous). Eight rows
    of a at a time: each out row then takes 32 contiguous bytes per pass (3-4 times numpy's
    transposing copy, 4M float32 in 9 ms on one core)."""
    n = a.shape[0]
    for i0 in range(0, n, 8):
        i1 = min(i0 + 8, n)
        for j in range(lo, hi):
            o = out[j]
            for i in range(i0, i1):
                o[i] = a[i, j]


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _transpose_small(a, out):
    """out[j] = a[:, j] for every column j of a: the recurrence's per-step [batch, n] <-> [n, batch]
    transposes (out rows gathered one at a time: at batch 16, 38 us for 4096 x 16, half of
    _transpose_cpu's blocks of eight rows, which suit big square matrices)."""
    for j in range(a.shape[1]):
        o = out[j]
        for i in range(a.shape[0]):
            o[i] = a[i, j]


def _transposed(xp, w):
    """w.T, C-contiguous on the CPU: backward's per-step GEMM w.T @ dgates^T runs faster with it
    than with the transposed view (OpenBLAS packs all of w at each call, and a transposed w packs
    slower); on a GPU (or for a dtype numba lacks) the view."""
    if xp is not np or w.dtype not in (np.float32, np.float64):
        return w.T
    out = np.empty(w.shape[::-1], w.dtype)
    cpu_pool.in_parts(lambda lo, hi: _transpose_cpu(w, out, lo, hi), w.shape[1])
    return out


# ---- the same steps as array code (cupy) ------------------------------------------------------
def _sigmoid_(xp, a) -> None:
    """a = sigmoid(a) in place, as 0.5 * tanh(a / 2) + 0.5 (no overflow for large |a|)."""
    a *= 0.5
    xp.tanh(a, out=a)
    a *= 0.5
    a += 0.5


def _step_forward_xp(xp, g, rec, bias, c_prev, c, tc, hy, tmp) -> None:
    """_step_forward_cpu on one step's [batch, .] views: g (the gates, in place), c, tc, hy."""
    h = c.shape[1]
    g += rec
    g += bias
    _sigmoid_(xp, g[:, :2 * h])
    xp.tanh(g[:, 2 * h:3 * h], out=g[:, 2 * h:3 * h])
    _sigmoid_(xp, g[:, 3 * h:])
    i, f, gg, o = g[:, :h], g[:, h:2 * h], g[:, 2 * h:3 * h], g[:, 3 * h:]
    xp.multiply(f, c_prev, out=c)
    xp.multiply(i, gg, out=tmp)
    c += tmp
    xp.tanh(c, out=tc)
    xp.multiply(o, tc, out=hy)


def _step_backward_xp(xp, g, tc, c_prev, dh, dc, tmp) -> None:
    """_step_backward_cpu on one step's [batch, .] views: g (the gates, in place) and dc."""
    h = dh.shape[1]
    i, f, gg, o = g[:, :h], g[:, h:2 * h], g[:, 2 * h:3 * h], g[:, 3 * h:]
    xp.multiply(tc, tc, out=tmp)  # dc += dh * o * (1 - tanh(c)^2)
    xp.subtract(1, tmp, out=tmp)
    tmp *= o
    tmp *= dh
    dc += tmp
    xp.subtract(1, o, out=tmp)  # do = dh * tanh(c) * o * (1 - o)
    tmp *= tc
    o *= tmp
    o *= dh
    xp.subtract(1, i, out=tmp)  # di = dc * g * i * (1 - i), kept apart: dg needs i
    tmp *= i
    tmp *= gg
    tmp *= dc
    gg *= gg  # dg = dc * i * (1 - g^2)
    xp.subtract(1, gg, out=gg)
    gg *= i
    gg *= dc
    i[...] = tmp
    xp.subtract(1, f, out=tmp)  # df = dc * c_{t-1} * f * (1 - f); to step t - 1: dc * f
    tmp *= f
    tmp *= c_prev
    tmp *= dc
    dc *= f
    f[...] = tmp


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

        # the input projections of all steps of a sample in one GEMM; row b*seq + t is (sample b, step t)
        x2 = x.reshape(batch * seq, n_in)
        gates = xp.empty((batch, seq, 4 * h), dtype=dt)
        g2 = gates.reshape(batch * seq, 4 * h)
        bias = (weights["bias_ih"] + weights["bias_hh"]).astype(dt, copy=False)
        fused = _fused(xp, dt)
        if fused:
            c0 = np.ascontiguousarray(c0, dtype=dt)
        y = xp.empty((batch, seq, h), dtype=dt)
        cs = xp.empty((batch, seq, h), dtype=dt)
        tanh_cs = xp.empty((batch, seq, h), dtype=dt)

        def steps(a, b):  # samples a..b-1: their projections, then their recurrence
            xp.matmul(x2[a * seq:b * seq], w_ih.T, out=g2[a * seq:b * seq])
            _forward_steps(xp, gates[a:b], bias, w_hh, h0[a:b], c0[a:b], cs[a:b], tanh_cs[a:b], y[a:b], fused)
        _in_parts(xp, fused, steps, batch)
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
            dh, dc = (carry["state"][k].astype(dt, order="C", copy=True) for k in (0, 1))
        else:
            dh = xp.zeros((batch, h), dtype=dt) if dh_n is None else dh_n.astype(dt, order="C", copy=True)
            dc = xp.zeros((batch, h), dtype=dt) if dc_n is None else dc_n.astype(dt, order="C", copy=True)

        fused = _fused(xp, dt)
        w_hh_t = _transposed(xp, w_hh) if fused else None   # only the fused steps' GEMM takes it

        dg2 = gates.reshape(batch * seq, 4 * h)  # the gates' gradients, once the steps have run
        dx = xp.empty((batch, seq, n_in), dtype=dt)
        dx2 = dx.reshape(batch * seq, n_in)

        def steps(a, b):  # samples a..b-1: their recurrence back through time, then their dx
            _backward_steps(xp, gates[a:b], tanh_cs[a:b], cs[a:b], c0[a:b], None if dy is None else dy[a:b], w_hh,
                            w_hh_t, dh[a:b], dc[a:b], fused)
            xp.matmul(dg2[a * seq:b * seq], w_ih, out=dx2[a * seq:b * seq])
        _in_parts(xp, fused, steps, batch)

        # both weights' gradients in one GEMM (it packs dg2 once): dg2^T @ [x | h_{t-1}]
        xh = xp.empty((batch, seq, n_in + h), dtype=dt)
        xh[:, :, :n_in] = x
        xh[:, 0, n_in:] = h0
        xh[:, 1:, n_in:] = y[:, :-1]
        xh2 = xh.reshape(batch * seq, n_in + h)
        dw = xp.empty((4 * h, n_in + h), dtype=dt)

        def gate_rows(a, b):  # rows a..b-1 of dw: those gates' gradients times [x | h_{t-1}]
            xp.matmul(dg2[:, a:b].T, xh2, out=dw[a:b])
        _in_parts(xp, fused, gate_rows, batch, 4 * h)
        db = dg2.sum(axis=0)
        grads = {"weight_ih": dw[:, :n_in], "weight_hh": dw[:, n_in:], "bias_ih": db, "bias_hh": db.copy()}
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


def _forward_steps(xp, gates, bias, w_hh, h0, c0, cs, tanh_cs, y, fused) -> None:
    """Every step of forward for the samples of these arrays (rows of the op's)."""
    batch, seq, h = cs.shape
    rec = xp.empty((batch, 4 * h), dtype=cs.dtype)
    if fused:
        # the recurrent GEMM as W_hh @ h^T ([4h, batch], see the module docstring), transposed into rec
        rec_t, h_t = np.empty((4 * h, batch), cs.dtype), np.array(h0.T, order="C")  # a copy: it is written
        fast = cs.dtype == np.float32
        for t in range(seq):
            np.matmul(w_hh, h_t, out=rec_t)
            _transpose_small(rec_t, rec)
            _step_forward_cpu(gates, rec, bias, c0, cs, tanh_cs, y, t, fast)
            _transpose_small(y[:, t], h_t)
        return
    w_hh_t, tmp = w_hh.T, xp.empty((batch, h), dtype=cs.dtype)
    h_prev, c_prev = h0, c0
    for t in range(seq):
        xp.matmul(h_prev, w_hh_t, out=rec)
        _step_forward_xp(xp, gates[:, t], rec, bias, c_prev, cs[:, t], tanh_cs[:, t], y[:, t], tmp)
        h_prev, c_prev = y[:, t], cs[:, t]


def _backward_steps(xp, gates, tanh_cs, cs, c0, dy, w_hh, w_hh_t, dh, dc, fused) -> None:
    """Every step of backward, last to first, for the samples of these arrays: gates become
    their gradients, dh and dc those of h0 and c0. w_hh_t is _transposed(w_hh) where `fused`."""
    batch, seq, h = cs.shape
    if fused:
        # dh = dgates @ W_hh as W_hh^T @ dgates^T ([h, batch]), as forward does
        dg_t, dh_t = np.empty((4 * h, batch), cs.dtype), np.empty((h, batch), cs.dtype)
        for t in range(seq - 1, -1, -1):
            if dy is not None:
                dh += dy[:, t]
            _step_backward_cpu(gates, tanh_cs, cs, c0, dh, dc, t)
            _transpose_small(gates[:, t], dg_t)
            np.matmul(w_hh_t, dg_t, out=dh_t)   # to step t - 1
            _transpose_small(dh_t, dh)
        return
    tmp = xp.empty((batch, h), dtype=cs.dtype)
    for t in range(seq - 1, -1, -1):
        if dy is not None:
            dh += dy[:, t]
        _step_backward_xp(xp, gates[:, t], tanh_cs[:, t], cs[:, t - 1] if t > 0 else c0, dh, dc, tmp)
        xp.matmul(gates[:, t], w_hh, out=dh)  # to step t - 1


#: the fewest samples a part of the recurrence gets: at 32 a part's [32, h] x [h, 4h] GEMMs on one
#: BLAS thread each run about as fast as the whole batch's on all (at 8, a third slower)
PARTS_MIN_ROWS = 32


def _in_parts(xp, fused, work, batch: int, n: int | None = None) -> None:
    """work(a, b) over [0, n) (default: the samples of the batch, a recurrence each, independent
    of the others): on the CPU, one part per core the task has when each gets PARTS_MIN_ROWS
    samples, each part's many small GEMMs on one BLAS thread, waiting for the other cores once
    and not at every GEMM (on an idle machine that is about as fast; while another process
    holds a core, BLAS's threads stall at each GEMM and the whole batch runs 2-5 times slower);
    else all at once, its GEMMs on all of BLAS's threads. The weights' gradient (n: its rows)
    goes the way the steps went: after a threaded GEMM OpenBLAS's idle threads spin for about
    0.1 s, on the cores the other way's parts need (forward + backward at batch 64: 812-854 ->
    775-784 ms with its rows in parts; at batch 16 in parts after threaded steps, 10% slower)."""
    n = batch if n is None else n
    if fused and batch >= PARTS_MIN_ROWS * cpu_pool.threads():
        cpu_pool.in_parts(work, n)
    else:
        work(0, n)


def _fused(xp, dtype) -> bool:
    """Whether the steps run as the numba kernels (numpy arrays of float32 or float64)."""
    return xp is np and np.dtype(dtype) in (np.float32, np.float64)


def _no_rows(tile: Rect) -> Rect:
    """The empty [batch, hidden] rect of a tile that does not touch h0, c0, h_n or c_n."""
    return Rect((tile.lo[0], 0), (tile.hi[0], 0))
