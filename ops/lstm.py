"""A single-layer LSTM over a batch-first sequence, with PyTorch's weights, gate order and init.

Forward does the input projection of every step in one GEMM ([batch*seq, in] @ W_ih^T),
then one recurrent GEMM per step, keeping the gate activations and cell states for
backward. Backward runs through time with one GEMM per step for the recurrent gradient
and finishes with two big GEMMs: dx, and dW_ih and dW_hh together (dgates^T @ [x | h_{t-1}]).

Gates, per step t, in PyTorch's order (i, f, g, o):
    i, f, o = sigmoid(.), g = tanh(.) of x_t W_ih^T + b_ih + h_{t-1} W_hh^T + b_hh
    c_t = f * c_{t-1} + i * g,    h_t = o * tanh(c_t)

The sequence is an ordered split: a tile is a chunk of time steps, and chunk k starts from
the (h, c) that chunk k-1 left in the op's carry (backward: from the gradient of them that
chunk k+1 left). The runtime orders the chunks by that carry alone, so stacked layers on
different devices run as a wavefront: chunk k of layer 2 beside chunk k+1 of layer 1.

On the CPU (float32 and float64) each step is one numba call, its recurrent GEMM included
(ops/thin_gemm.py's dots, which does not repack W_hh at every step as BLAS does: 110-170
GFLOP/s on an AVX-512 VM's two cores at 8-32 samples against OpenBLAS's 55-115; with AVX2 its
tiles of 2 samples, 35.6 GFLOP/s a core against OpenBLAS's 23.8). A step's work is cut
by hidden units, one part per core of the task (prange): part i computes its units' four gate
rows and their element-wise update, reading all of h_{t-1} and writing only its own units, so
one call is one step and the parts meet once a step. Backward does the same with W_hh^T,
transposed once a call. The element-wise loops run over slices from 0 (a loop from j0 is not
known to index from 0, so numba's wraparound check kept it scalar, 5-8 times slower), each
reading and writing few arrays; float32's tanh is a rational function that vectorizes (np.tanh
in numba does not). The big GEMMs run on the pool (ops/cpu_pool.py), BLAS on one thread a part,
whose threads sleep when done, where OpenBLAS's would spin on the cores the steps need.
On a GPU (cupy) a step is its GEMM and one fused kernel each way (ops/cuda_kernels.py).
"""
from __future__ import annotations

import numba
import numpy as np

from ops import cpu_pool, cpu_threads, cuda_kernels
from ops.base import ATTRIBUTE, SAMPLE, Op, SplitDim, batch_rect, is_count, register_op
from ops.cpu_threads import RowKernel
from ops.linear import torch_linear_init
from ops.thin_gemm import dots
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


@RowKernel
def _forward_step(w_hh, bias, gates, h_src, c_src, s, cs, tcs, y, t, rec, fast, cuts):
    """Step t for the hidden units [cuts[i], cuts[i+1]) of each part i: their four gates' rows of
    W_hh times h_{t-1} = h_src[b, s] into rec[b, 0] (scratch), then gates[b, t] (there: the input
    projection) plus those and the bias turned into the gates in place (i f g o); c_t, tanh(c_t)
    and h_t go to cs[b, t], tcs[b, t] and y[b, t], from c_{t-1} = c_src[b, s]. A part reads all
    of h_{t-1} and writes only its own units, so the parts of one step run side by side. (The
    products went straight into gates[b, t] before: rows the projection wrote long before, out
    of cache, each product a read and a write there; one core, a step at 64 samples took 9.2 ms
    against 7.3 with those rows in cache.)"""
    h = cs.shape[2]
    for p in numba.prange(len(cuts) - 1):
        j0, j1 = cuts[p], cuts[p + 1]
        for q in range(4):
            dots(w_hh, h_src, s, rec, 0, q * h + j0, q * h + j1, False)
        n = j1 - j0
        for b in range(gates.shape[0]):
            g, cp, c, tc, hy = gates[b, t], c_src[b, s, j0:j1], cs[b, t, j0:j1], tcs[b, t, j0:j1], y[b, t, j0:j1]
            gi, gf, gg, go = g[j0:j1], g[h + j0:h + j1], g[2 * h + j0:2 * h + j1], g[3 * h + j0:3 * h + j1]
            r = rec[b, 0]
            ri, rf, rg, ro = r[j0:j1], r[h + j0:h + j1], r[2 * h + j0:2 * h + j1], r[3 * h + j0:3 * h + j1]
            bi, bf, bg, bo = bias[j0:j1], bias[h + j0:h + j1], bias[2 * h + j0:2 * h + j1], bias[3 * h + j0:3 * h + j1]
            for j in range(n):
                gi[j] = _sigmoid(gi[j] + ri[j] + bi[j], fast)
            for j in range(n):
                gf[j] = _sigmoid(gf[j] + rf[j] + bf[j], fast)
            for j in range(n):
                gg[j] = _tanh(gg[j] + rg[j] + bg[j], fast)
            for j in range(n):
                go[j] = _sigmoid(go[j] + ro[j] + bo[j], fast)
            for j in range(n):
                c[j] = gf[j] * cp[j] + gi[j] * gg[j]
            for j in range(n):
                tc[j] = _tanh(c[j], fast)
            for j in range(n):
                hy[j] = go[j] * tc[j]


@RowKernel
def _backward_step(w_hh_t, gates, tcs, cs, c0, dy, dh, dc, t, cuts):
    """For the hidden units [cuts[i], cuts[i+1]) of each part i: where step t + 1 exists, dh[b, 0]
    = W_hh^T rows times gates[b, t + 1] (step t + 1's gates' gradients: the gradient of h_t);
    where step t does (t >= 0), dh += dy[b, t] (when dy has rows), then the gates[b, t] (i f g o)
    become the gradients of their pre-activations in place and dc[b] that of c_{t-1}. A part
    reads all of step t + 1's gradients and writes only its own units."""
    n_b, seq, h = cs.shape
    for p in numba.prange(len(cuts) - 1):
        j0, j1 = cuts[p], cuts[p + 1]
        if t + 1 < seq:
            dots(w_hh_t, gates, t + 1, dh, 0, j0, j1, False)
        n = j1 - j0
        for b in range(n_b if t >= 0 else 0):
            g, tc, d, dcb = gates[b, t], tcs[b, t, j0:j1], dh[b, 0, j0:j1], dc[b, j0:j1]
            gi, gf, gg, go = g[j0:j1], g[h + j0:h + j1], g[2 * h + j0:2 * h + j1], g[3 * h + j0:3 * h + j1]
            cp = cs[b, t - 1, j0:j1] if t > 0 else c0[b, 0, j0:j1]
            if dy.shape[0]:
                dyb = dy[b, t, j0:j1]
                for j in range(n):
                    d[j] += dyb[j]
            for j in range(n):  # dc += dh * o * (1 - tanh(c)^2)
                dcb[j] += d[j] * go[j] * (_ONE - tc[j] * tc[j])
            for j in range(n):  # do = dh * tanh(c) * o * (1 - o)
                go[j] = d[j] * tc[j] * go[j] * (_ONE - go[j])
            for j in range(n):  # di = dc * g * i * (1 - i), dg = dc * i * (1 - g^2)
                i, gj, dcj = gi[j], gg[j], dcb[j]
                gi[j] = dcj * gj * i * (_ONE - i)
                gg[j] = dcj * i * (_ONE - gj * gj)
            for j in range(n):  # df = dc * c_{t-1} * f * (1 - f); to step t - 1: dc * f
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


def _transposed(w):
    """w.T, C-contiguous, made in parts on the pool: the backward steps' dot kernel reads W_hh^T
    by rows, each a sum over the gates."""
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
    """_forward_step's element-wise part on one step's [batch, .] views, rec being h_{t-1} W_hh^T:
    g (the gates, in place), c, tc, hy."""
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
    """_backward_step's element-wise part on one step's [batch, .] views, dh including dy's step:
    g (the gates, in place) and dc."""
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
    float_inputs = True

    def __init__(self, name, inputs, hidden_size: int, with_initial_state: bool = False):
        super().__init__(name, inputs, hidden_size=hidden_size, with_initial_state=with_initial_state)

    def infer_shapes(self, in_shapes):
        n_in = 3 if self.with_initial_state else 1
        if len(in_shapes) != n_in:
            raise self.fail(f"takes {n_in} input{'s (x, h0, c0)' if n_in == 3 else ' (x)'} with "
                            f"with_initial_state={self.with_initial_state}, got {len(in_shapes)}")
        if not is_count(self.hidden_size):
            raise self.fail(f"hidden_size must be a positive int, got {self.hidden_size!r}")
        x = in_shapes[0]
        if len(x) != 3 or x[1] < 1:
            raise self.fail(f"x must be [batch, seq, in] with seq >= 1, got shape {x}")
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
        y = xp.empty((batch, seq, h), dtype=dt)
        cs = xp.empty((batch, seq, h), dtype=dt)
        tanh_cs = xp.empty((batch, seq, h), dtype=dt)
        if _fused(xp, dt):
            _gemm_in_parts(lambda a, b: np.matmul(x2[a:b], w_ih.T, out=g2[a:b]), batch * seq, n_in * 4 * h)
            _forward_steps_cpu(gates, bias, w_hh, h0, c0, cs, tanh_cs, y)
        else:
            xp.matmul(x2, w_ih.T, out=g2)
            _forward_steps_xp(xp, gates, bias, w_hh, h0, c0, cs, tanh_cs, y)
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
        dg2 = gates.reshape(batch * seq, 4 * h)  # the gates' gradients, once the steps have run
        dx = xp.empty((batch, seq, n_in), dtype=dt)
        dx2 = dx.reshape(batch * seq, n_in)
        if fused:
            _backward_steps_cpu(gates, tanh_cs, cs, c0, dy, _transposed(w_hh.astype(dt, copy=False)), dh, dc)
            _gemm_in_parts(lambda a, b: np.matmul(dg2[a:b], w_ih, out=dx2[a:b]), batch * seq, 4 * h * n_in)
        else:
            _backward_steps_xp(xp, gates, tanh_cs, cs, c0, dy, w_hh, dh, dc)
            xp.matmul(dg2, w_ih, out=dx2)

        # both weights' gradients in one GEMM (it packs dg2 once): dg2^T @ [x | h_{t-1}]
        xh = xp.empty((batch, seq, n_in + h), dtype=dt)
        xh[:, :, :n_in] = x
        xh[:, 0, n_in:] = h0
        xh[:, 1:, n_in:] = y[:, :-1]
        xh2 = xh.reshape(batch * seq, n_in + h)
        dw = xp.empty((4 * h, n_in + h), dtype=dt)

        if fused:   # rows a..b-1 of dw: those gates' gradients times [x | h_{t-1}]
            _gemm_in_parts(lambda a, b: np.matmul(dg2[:, a:b].T, xh2, out=dw[a:b]), 4 * h, batch * seq * (n_in + h))
        else:
            xp.matmul(dg2.T, xh2, out=dw)
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


def _forward_steps_cpu(gates, bias, w_hh, h0, c0, cs, tanh_cs, y) -> None:
    """Every step of forward, each one _forward_step call over the task's cores (a part of the
    hidden units each) where a step is work enough for them."""
    batch, seq, h = cs.shape
    dt = cs.dtype
    threads, cuts = _hidden_parts(batch, h)
    step = _forward_step.on(threads)
    w_hh = np.ascontiguousarray(w_hh, dtype=dt)
    bias = np.ascontiguousarray(bias, dtype=dt)
    h_src = np.ascontiguousarray(h0, dtype=dt).reshape(batch, 1, h)
    c_src = np.ascontiguousarray(c0, dtype=dt).reshape(batch, 1, h)
    fast = dt == np.float32
    rec = np.empty((batch, 1, 4 * h), dt)
    for t in range(seq):
        step(w_hh, bias, gates, h_src, c_src, 0 if t == 0 else t - 1, cs, tanh_cs, y, t, rec, fast, cuts)
        h_src, c_src = y, cs


def _backward_steps_cpu(gates, tanh_cs, cs, c0, dy, w_hh_t, dh, dc) -> None:
    """Every step of backward, last to first, as _backward_step calls (one more at the end for
    the gradient of h0): gates become their gradients, dh and dc those of h0 and c0."""
    batch, seq, h = cs.shape
    dt = cs.dtype
    threads, cuts = _hidden_parts(batch, h)
    step = _backward_step.on(threads)
    c0 = np.ascontiguousarray(c0, dtype=dt).reshape(batch, 1, h)
    dy = np.zeros((0, seq, h), dt) if dy is None else np.ascontiguousarray(dy, dtype=dt)
    dh3 = dh.reshape(batch, 1, h)
    for t in range(seq - 1, -2, -1):
        step(w_hh_t, gates, tanh_cs, cs, c0, dy, dh3, dc, t, cuts)


#: multiply-adds a recurrent step needs (samples x 4 hidden x hidden) before it is split over
#: the task's cores: 2M take 40-70 us on one core; a two-part prange call costs about 2 us right
#: after another, tens of us once numba's threads have gone to sleep
PARALLEL_MIN_MACS = 1 << 21


def _hidden_parts(batch: int, h: int) -> tuple[int, np.ndarray]:
    """(threads, cuts) for the steps: the task's cores where a step has PARALLEL_MIN_MACS (numba's
    threads set to them), and the hidden units cut into one part per thread, at multiples of 16."""
    threads = cpu_threads.task_threads() if batch * 4 * h * h >= PARALLEL_MIN_MACS else 1
    if threads > 1:
        numba.set_num_threads(threads)
    unit = 16 if h >= 16 * threads else 1
    return threads, np.array([h * i // threads // unit * unit for i in range(threads)] + [h], np.int64)


def _gemm_in_parts(work, rows: int, macs_per_row: int) -> None:
    """work(a, b) on rows [a, b) of a GEMM, one part per core of the task with BLAS on one thread
    each, where it has PARALLEL_MIN_MACS. OpenBLAS's threads spin for about 0.1 s after a GEMM
    they ran (docs/kernels.md), on the cores the steps' numba threads need; the pool's sleep."""
    cpu_pool.in_parts(work, rows, None if rows * macs_per_row >= PARALLEL_MIN_MACS else 1)


def _forward_steps_xp(xp, gates, bias, w_hh, h0, c0, cs, tanh_cs, y) -> None:
    """Every step of forward, on a GPU (cupy) as a GEMM and its fused kernel, else as array code."""
    if cuda_kernels.on_gpu(xp):
        cuda_kernels.lstm_forward_steps(gates, bias, w_hh, h0, c0, cs, tanh_cs, y)
        return
    batch, seq, h = cs.shape
    rec, tmp = xp.empty((batch, 4 * h), dtype=cs.dtype), xp.empty((batch, h), dtype=cs.dtype)
    h_prev, c_prev = h0, c0
    for t in range(seq):
        xp.matmul(h_prev, w_hh.T, out=rec)
        _step_forward_xp(xp, gates[:, t], rec, bias, c_prev, cs[:, t], tanh_cs[:, t], y[:, t], tmp)
        h_prev, c_prev = y[:, t], cs[:, t]


def _backward_steps_xp(xp, gates, tanh_cs, cs, c0, dy, w_hh, dh, dc) -> None:
    """Every step of backward, last to first, on a GPU (cupy) as its fused kernel and a GEMM, else
    as array code: gates become their gradients, dh and dc those of h0 and c0."""
    if cuda_kernels.on_gpu(xp):
        cuda_kernels.lstm_backward_steps(gates, tanh_cs, cs, c0, dy, w_hh, dh, dc)
        return
    batch, seq, h = cs.shape
    tmp = xp.empty((batch, h), dtype=cs.dtype)
    for t in range(seq - 1, -1, -1):
        if dy is not None:
            dh += dy[:, t]
        c_prev = cs[:, t - 1] if t > 0 else c0
        _step_backward_xp(xp, gates[:, t], tanh_cs[:, t], c_prev, dh, dc, tmp)
        xp.matmul(gates[:, t], w_hh, out=dh)  # to step t - 1


def _fused(xp, dtype) -> bool:
    """Whether the steps run as the numba kernels (numpy arrays of float32 or float64)."""
    return xp is np and np.dtype(dtype) in (np.float32, np.float64)


def _no_rows(tile: Rect) -> Rect:
    """The empty [batch, hidden] rect of a tile that does not touch h0, c0, h_n or c_n."""
    return Rect((tile.lo[0], 0), (tile.hi[0], 0))
