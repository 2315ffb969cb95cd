"""Batch and layer normalization (PyTorch semantics).

BatchNorm's statistics span batch, height and width: any dim may be split, and the tiles
that share a channel add up its statistics through REDUCE before they normalize (see
BatchNorm). LayerNorm's span the trailing normalized dims, so only the leading dims may be
split. Either way a tile reads exactly its own rect of the input.

On the CPU BatchNorm on NCHW runs fused numba kernels on the input viewed as [N, C, H*W]:
one pass for the statistics (two when they are added up across tiles: the mean, then the
squared deviations from it), one for normalize, scale, shift and relu; backward one pass
for its two sums and one for dx, each pass over ranges of channels, one a core of the task.
Per-channel sums accumulate in float64. On a GPU the sums
are cupy reduction kernels (in float64, no float64 copy of x), the per-channel statistics
(or dx's coefficients) one kernel over [C] arrays, and normalize and dx one fused kernel
each (ops/cuda_kernels.py). [N, C] inputs on the CPU, whose one value per channel and
sample makes rows too short for the kernels' loops, run array code.

LayerNorm on the CPU runs fused numba row kernels, rows shared out over the cores: forward
one pass a row (in cache) for its mean, variance and y, saving only the mean and 1/std of
each row; backward one pass a row for dx, each chunk of rows adding up its own part of the
weight gradients. Row sums accumulate in float64. On a GPU it is a CUDA kernel each way, a
block per row, and the weight gradients two column sums (ops/cuda_kernels.py).
"""
from __future__ import annotations

import math

import numba
import numpy as np

from ops import cpu_pool, cuda_kernels
from ops.cpu_threads import PARALLEL_MIN_VALUES, RowKernel, row_split, task_threads
from ops.cpu_layout import row_starts
from ops.base import (ATTRIBUTE, PARAMETER, SAMPLE, Op, SplitDim, bool_attr, float_attr, given_out, int_attr,
                      register_op, sample_split_dims)
from ops.cpu_layout import flat_row, flat_rows
from taskrt.geometry import Rect


# ---- BatchNorm's CPU kernels ---------------------------------------------------------------
# They take NCHW arrays as flat_rows (flat, sn, sc) of [N, C, L = H*W]: row (n, c) is contiguous,
# whether the array is a whole tensor or a channel tile of one, so every pass is a vectorized loop.
def _rows(a, writable: bool = False):
    """flat_rows of an NCHW array seen as [N, C, H*W]."""
    return flat_rows(a.reshape(a.shape[0], a.shape[1], -1), writable)


@numba.njit(nogil=True, inline="always")
def _row(rows, n, c, length):
    _, sn, sc = rows
    return flat_row(rows, n * sn + c * sc, length)


# reassoc lets LLVM vectorize the float64 sums (it reorders the additions, nothing else)
@numba.njit(nogil=True, cache=True, fastmath={"reassoc"})
def _bn_moments_cpu(x, shape, center, s, ss):
    """Per channel of the rows x of shape (N, C, L), in float64: s = sum(x - center[c]) and
    ss = sum((x - center[c])^2)."""
    n_, c_, l_ = shape
    s[:] = 0.0
    ss[:] = 0.0
    for n in range(n_):
        for c in range(c_):
            row, k = _row(x, n, c, l_), center[c]
            rs = 0.0
            rss = 0.0
            for i in range(l_):
                v = np.float64(row[i]) - k
                rs += v
                rss += v * v
            s[c] += rs
            ss[c] += rss


@numba.njit(nogil=True, cache=True)
def _bn_apply_cpu(x, shape, scale, shift, relu, y):
    """Rows y = x * scale[c] + shift[c], then max(y, 0) if relu (a NaN stays NaN)."""
    n_, c_, l_ = shape
    zero = scale.dtype.type(0)
    for n in range(n_):
        for c in range(c_):
            xr, yr, a, b = _row(x, n, c, l_), _row(y, n, c, l_), scale[c], shift[c]
            for i in range(l_):
                v = xr[i] * a + b
                if relu and v < zero:
                    v = zero
                yr[i] = v


@numba.njit(nogil=True, cache=True, fastmath={"reassoc"})
def _bn_grad_sums_cpu(x, dy, y, shape, relu, mean, sum_g, sum_g_xmu):
    """Per channel, in float64: sum(g) and sum(g * (x - mean)), g = dy where y > 0 if relu, else dy."""
    n_, c_, l_ = shape
    sum_g[:] = 0.0
    sum_g_xmu[:] = 0.0
    for n in range(n_):
        for c in range(c_):
            xr, gr, yr, m = _row(x, n, c, l_), _row(dy, n, c, l_), _row(y, n, c, l_), mean[c]
            s = 0.0
            t = 0.0
            for i in range(l_):
                g = np.float64(gr[i])
                if relu and not yr[i] > 0:
                    g = 0.0
                s += g
                t += g * (np.float64(xr[i]) - m)
            sum_g[c] += s
            sum_g_xmu[c] += t


@numba.njit(nogil=True, cache=True)
def _bn_dx_cpu(x, dy, y, shape, relu, training, coef, dx):
    """Rows dx = a * g + b * (x - m) + d in training, else a * g, with (a, b, m, d) = coef[:, c]
    and g as in _bn_grad_sums_cpu."""
    n_, c_, l_ = shape
    zero = coef.dtype.type(0)
    for n in range(n_):
        for c in range(c_):
            xr, gr, yr, dr = _row(x, n, c, l_), _row(dy, n, c, l_), _row(y, n, c, l_), _row(dx, n, c, l_)
            a, b, m, d = coef[0, c], coef[1, c], coef[2, c], coef[3, c]
            for i in range(l_):
                g = gr[i]
                if relu and not yr[i] > 0:
                    g = zero
                v = a * g
                if training:
                    v += b * (xr[i] - m) + d
                dr[i] = v


def _mean_and_variance(xp, m1, m2, shift):
    """(mean, biased variance), new arrays, from the moments m1 = E[x - shift] and m2 =
    E[(x - shift)^2]; a variance below 0 by rounding is 0 (a NaN stays NaN)."""
    var = m2 - m1 * m1
    return shift + m1, xp.where(var < 0, 0.0, var)


def _shape3(a) -> tuple[int, int, int]:
    n, c, h, w = a.shape
    return n, c, h * w


def _over_channels(x, work) -> None:
    """work(a, b) for ranges [a, b) of x's channels, one a core of the task where x holds at
    least PARALLEL_MIN_VALUES values. The passes are memory-bound, and one core does not draw
    all the bandwidth: a training step of 32 x 64 x 56 x 56 float32 values took 17.0 ms on one
    core of the 2-core VM and 12.2 on both."""
    if x.size < PARALLEL_MIN_VALUES:
        work(0, x.shape[1])
    else:
        cpu_pool.in_parts(work, x.shape[1], most=task_threads())


@register_op
class BatchNorm(Op):
    """nn.BatchNorm2d (or 1d on [N, C]) with an optional fused relu, as FlexFlow's BatchNorm.

    Training normalizes with the batch statistics and updates the running stats in the
    `state` tiles (unbiased variance, as PyTorch); inference uses the running stats,
    read from `state`, or from `weights` when no state is passed.

    Every dim may be split: samples, channels (parameter) and the spatial dims. Tiles that
    split a channel's values share its statistics, so they are added up across the tiles
    (`partial_sum`, summed through REDUCE) before the kernels read them: in training forward
    the moments E[x] and E[x^2] in one pass, in float64 (one round of sums, not a mean and
    then the deviations from it: the variance E[x^2] - E[x]^2 loses about 1e-16 (mean/std)^2
    of itself, 1e-6 for float32 values of mean 1000 and spread 0.01); in backward the sums
    of g and g * (x - mean) per channel. The first tile of each channel group (at 0 along
    every dim but the channels) returns the weight gradients, which are those sums.
    """

    kind = "batch_norm"
    float_inputs = True
    writes_out = True
    has_training_mode = True

    def __init__(self, name, inputs, eps: float = 1e-5, momentum: float = 0.1, relu: bool = False):
        super().__init__(name, inputs, eps=float_attr(self.kind, name, "eps", eps, 0.0, lo_open=True),
                         momentum=float_attr(self.kind, name, "momentum", momentum, 0.0, 1.0),
                         relu=bool_attr(self.kind, name, "relu", relu))

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 1:
            raise self.fail(f"takes 1 input, got {len(in_shapes)}")
        (shape,) = in_shapes
        if len(shape) not in (2, 4):
            raise self.fail(f"expects an [N, C] or NCHW input, got shape {tuple(shape)}")
        return [shape]

    @property
    def _channels(self) -> int:
        return self.inputs[0].shape[1]

    @property
    def _count(self) -> int:
        """Values per channel over the whole input: what the statistics average over."""
        shape = self.inputs[0].shape
        return shape[0] * math.prod(shape[2:])

    def weight_shapes(self):
        return {"weight": (self._channels,), "bias": (self._channels,)}

    def state_shapes(self):
        return {"running_mean": (self._channels,), "running_var": (self._channels,)}

    def init_weights(self, rng):
        dtype = self.weight_dtype("weight")
        c = self._channels
        return {"weight": np.ones(c, dtype), "bias": np.zeros(c, dtype),
                "running_mean": np.zeros(c, dtype), "running_var": np.ones(c, dtype)}

    def split_dims(self):
        spatial = tuple(SplitDim(d, ATTRIBUTE) for d in range(2, len(self.tile_shape)))
        return (SplitDim(0, SAMPLE), SplitDim(1, PARAMETER)) + spatial

    def input_rects(self, tile):
        return [tile]

    def weight_rects(self, tile):
        channels = Rect((tile.lo[1],), (tile.hi[1],))
        return {k: channels for k in ("weight", "bias", "running_mean", "running_var")}

    def sum_shapes(self):
        c = self._channels
        return {"moments": (2, c), "grad": (2, c)}

    def sum_rects(self, tile):
        both = Rect((0, tile.lo[1]), (2, tile.hi[1]))  # the two sums of the tile's channels
        return {"moments": both, "grad": both}

    def forward_sums(self, training):
        return ("moments",) if training else ()

    def backward_sums(self):
        return ("grad",)

    def backward_reads(self):
        return (True,), (self.relu,)   # y only for the fused relu's mask

    def partial_sum(self, xp, name, tile, inputs, sums, outputs=None, grad_outputs=None, saved=None):
        (x,) = inputs
        if name == "moments":
            return xp.stack(self._moments(xp, x, None)) / self._count
        if name == "grad":   # (y is not kept without the relu: x stands in, unread)
            y = outputs[0] if self.relu else x
            return xp.stack(self._grad_moments(xp, x, grad_outputs[0], y, saved[1]))
        raise ValueError(f"{self.kind} {self.name!r}: no sum {name!r}; its sums are {list(self.sum_shapes())}")

    def flops(self, tile):
        # statistics (sum, squared deviation), normalize, scale and shift; plus the fused relu
        return (7 + self.relu) * tile.volume

    def _axes(self, x):
        return (0,) if x.ndim == 2 else (0, 2, 3)

    def _bcast(self, v, ndim):
        return v.reshape((1, -1) + (1,) * (ndim - 2))

    @staticmethod
    def _use_kernels(xp, x) -> bool:
        """Whether the numba kernels run (NCHW on the CPU)."""
        return xp is np and x.ndim == 4

    def _moments(self, xp, x, center):
        """Per channel, in float64: sum(x - center) and sum((x - center)^2) (center None: 0)."""
        c = x.shape[1]
        if self._use_kernels(xp, x):
            s, ss = np.empty(c), np.empty(c)
            center = np.zeros(c) if center is None else np.asarray(center, np.float64)

            def moments(a, b):
                part = x[:, a:b]
                _bn_moments_cpu(_rows(part), _shape3(part), center[a:b], s[a:b], ss[a:b])
            _over_channels(x, moments)
            return s, ss
        if cuda_kernels.on_gpu(xp):
            return cuda_kernels.batch_norm_moments(x, xp.zeros(c) if center is None
                                                   else xp.asarray(center, dtype=xp.float64))
        xc = x.astype(xp.float64)
        if center is not None:
            xc -= self._bcast(xp.asarray(center, dtype=xp.float64), x.ndim)
        axes = self._axes(x)
        return xc.sum(axis=axes), (xc * xc).sum(axis=axes)

    def _local_stats(self, xp, x):
        """Mean and biased variance of a tile that holds all of its channels' values: one pass
        over x minus each channel's first value (accurate when the mean is large against the
        spread), in float64."""
        shift = x[(0, slice(None)) + (0,) * (x.ndim - 2)].astype(xp.float64)
        s, ss = self._moments(xp, x, shift)
        return _mean_and_variance(xp, s / self._count, ss / self._count, shift)

    def _grad_moments(self, xp, x, dy, y, mean):
        """Per channel, in float64: sum(g) and sum(g * (x - mean)), g = dy where y > 0 if relu, else dy."""
        c = x.shape[1]
        if self._use_kernels(xp, x):
            sum_g, sum_g_xmu = np.empty(c), np.empty(c)
            mean = np.asarray(mean, np.float64)

            def sums(a, b):
                xr = _rows(x[:, a:b])
                _bn_grad_sums_cpu(xr, _rows(dy[:, a:b]), _rows(y[:, a:b]) if self.relu else xr,
                                  _shape3(x[:, a:b]), self.relu, mean[a:b], sum_g[a:b], sum_g_xmu[a:b])
            _over_channels(x, sums)
            return sum_g, sum_g_xmu
        if cuda_kernels.on_gpu(xp):
            return cuda_kernels.batch_norm_grad_sums(x, dy, y, xp.asarray(mean, dtype=xp.float64), self.relu)
        g = (dy * (y > 0) if self.relu else dy).astype(xp.float64)
        xc = x.astype(xp.float64) - self._bcast(xp.asarray(mean, dtype=xp.float64), x.ndim)
        axes = self._axes(x)
        return g.sum(axis=axes), (g * xc).sum(axis=axes)

    def _running_update(self, state, mean, var, count) -> None:
        """running = (1 - momentum) * running + momentum * batch stat (unbiased variance), in place."""
        m = state["running_mean"].dtype.type(self.momentum)
        state["running_mean"][...] = (1 - m) * state["running_mean"] + m * mean
        state["running_var"][...] = (1 - m) * state["running_var"] + m * var * (count / (count - 1))

    def _leads_channels(self, tile) -> bool:
        """The tile at 0 along every dim but the channels: one per channel group."""
        return all(a == 0 for d, a in enumerate(tile.lo) if d != 1)

    def training_problem(self) -> str | None:
        count = self._count
        return None if count >= 2 else f"needs more than 1 value per channel in training, got {count}"

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None, sums=None, out=None):
        (x,) = inputs
        count = self._count
        problem = self.training_problem() if training else None
        if problem is not None:
            raise self.fail(problem)
        if self._use_cuda(xp, x, weights):
            return self._forward_cuda(xp, x, weights, training, state, sums)
        if training:
            if sums is None:
                mean, var = self._local_stats(xp, x)
            else:  # new arrays: the sums' region is refilled next step, before backward reads `saved`
                mean, var = _mean_and_variance(xp, sums["moments"][0], sums["moments"][1], 0.0)
            if state is not None:
                self._running_update(state, mean, var, count)
        else:
            stats = state if state is not None else weights
            mean, var = stats["running_mean"], stats["running_var"]
        invstd = 1 / xp.sqrt(var.astype(xp.float64) + self.eps)
        scale = weights["weight"] * invstd
        shift = (weights["bias"] - mean * scale).astype(x.dtype)
        scale = scale.astype(x.dtype)
        if self._use_kernels(xp, x):
            given = given_out(out, 0)[0]
            y = np.empty(x.shape, x.dtype) if given is None else given

            def apply(a, b):
                _bn_apply_cpu(_rows(x[:, a:b]), _shape3(x[:, a:b]), scale[a:b], shift[a:b], self.relu,
                              _rows(y[:, a:b], writable=True))
            _over_channels(x, apply)
        else:
            y = x * self._bcast(scale, x.ndim) + self._bcast(shift, x.ndim)
            if self.relu:
                xp.maximum(y, 0, out=y)
        return [y], (training, xp.array(mean, dtype=xp.float64), invstd)

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved, sums=None, out=None):
        (x,), (dy,), (y,) = inputs, grad_outputs, outputs
        if not self.relu:
            y = x   # y is not kept without the relu (backward_reads): x stands in, unread
        if self._use_cuda(xp, x, weights):
            return self._backward_cuda(xp, tile, x, dy, y, weights, saved, sums, out)
        training, mean, invstd = saved
        count = self._count
        if sums is None:
            sum_g, sum_g_xmu = self._grad_moments(xp, x, dy, y, mean)
        else:
            sum_g, sum_g_xmu = sums["grad"][0], sums["grad"][1]
        dbeta, dgamma = sum_g, sum_g_xmu * invstd
        # dx = scale * (g - dbeta / count - xhat * dgamma / count), xhat = (x - mean) * invstd
        scale = weights["weight"] * invstd
        coef = xp.stack([scale, -scale * invstd * dgamma / count, mean, -scale * dbeta / count]).astype(x.dtype)
        given, wanted = given_out(out, 0)
        if not wanted:  # the model's input: the weight gradients alone
            dx = None
        elif self._use_kernels(xp, x):
            dx = np.empty(x.shape, x.dtype) if given is None else given

            def grad(a, b):
                xr = _rows(x[:, a:b])
                _bn_dx_cpu(xr, _rows(dy[:, a:b]), _rows(y[:, a:b]) if self.relu else xr, _shape3(x[:, a:b]),
                           self.relu, training, np.ascontiguousarray(coef[:, a:b]), _rows(dx[:, a:b], writable=True))
            _over_channels(x, grad)
        else:
            nd = x.ndim
            g = dy * (y > 0) if self.relu else dy
            dx = self._bcast(coef[0], nd) * g
            if training:
                dx += self._bcast(coef[1], nd) * (x - self._bcast(coef[2], nd)) + self._bcast(coef[3], nd)
        return [dx], self._weight_grads(xp, tile, dgamma, dbeta, weights, sums)

    def _weight_grads(self, xp, tile, dgamma, dbeta, weights, sums):
        """The weight gradients in the weights' dtype: zeros but on the first tile of each channel
        group where the sums came across tiles."""
        wdt = weights["weight"].dtype
        if sums is not None and not self._leads_channels(tile):
            dgamma, dbeta = xp.zeros_like(dgamma), xp.zeros_like(dbeta)
        return {"weight": dgamma.astype(wdt), "bias": dbeta.astype(wdt)}

    @staticmethod
    def _use_cuda(xp, x, weights) -> bool:
        """Whether forward and backward run their CUDA kernels: on a GPU, weights of x's float dtype."""
        return cuda_kernels.on_gpu(xp) and cuda_kernels.supports(x, weights["weight"], weights["bias"])

    def _forward_cuda(self, xp, x, weights, training, state, sums):
        """forward on a GPU: the statistics, scale and shift of every channel in one kernel over
        [C] arrays (they were some twenty launches), y in another."""
        count = self._count
        if not training:
            stats = state if state is not None else weights
            m1, m2 = stats["running_mean"].astype(xp.float64), stats["running_var"].astype(xp.float64)
            center, n = x[(0, slice(None)) + (0,) * (x.ndim - 2)], 1
        elif sums is None:
            center, n = x[(0, slice(None)) + (0,) * (x.ndim - 2)], count
            m1, m2 = self._moments(xp, x, center)
        else:
            center, n = xp.zeros(x.shape[1], x.dtype), 1
            m1, m2 = sums["moments"][0], sums["moments"][1]   # E[x], E[x^2]: the sums over 1 value
        mean, var, invstd, scale, shift = cuda_kernels.batch_norm_statistics(
            m1, m2, n, center, weights["weight"], weights["bias"], self.eps, moments=training)
        if training and state is not None:
            cuda_kernels.batch_norm_running_update(state["running_mean"], state["running_var"], mean, var,
                                                   self.momentum, count / (count - 1))
        y = cuda_kernels.batch_norm_apply(x, self._bcast(scale, x.ndim), self._bcast(shift, x.ndim), self.relu)
        return [y], (training, mean, invstd)

    def _backward_cuda(self, xp, tile, x, dy, y, weights, saved, sums, out):
        """backward on a GPU: dx's coefficients and dgamma in one kernel over [C] arrays, dx in another."""
        training, mean, invstd = saved
        if sums is None:
            sum_g, sum_g_xmu = self._grad_moments(xp, x, dy, y, mean)
        else:
            sum_g, sum_g_xmu = sums["grad"][0], sums["grad"][1]
        c0, c1, c2, c3, dgamma = cuda_kernels.batch_norm_grad_coefficients(sum_g, sum_g_xmu, weights["weight"], mean,
                                                                           invstd, self._count)
        dx = None
        if given_out(out, 0)[1]:  # else the model's input: the weight gradients alone
            nd = x.ndim
            dx = cuda_kernels.batch_norm_dx(x, dy, y, *(self._bcast(c, nd) for c in (c0, c1, c2, c3)), self.relu,
                                            training)
        return [dx], self._weight_grads(xp, tile, dgamma, sum_g, weights, sums)


# ---- LayerNorm's CPU kernels ------------------------------------------------------------------
# They take [..., D] arrays as row_starts (flat, starts), D the normalized values of a row.
@RowKernel
def _ln_forward_cpu(x, xs, d, eps, affine, w, b, y, ys, mean, rstd, chunks):
    """Per row: mean, rstd = 1 / sqrt(biased variance + eps) (both from float64 sums), and
    y = (x - mean) * rstd (* w + b if affine)."""
    rows = xs.size
    for c in numba.prange(chunks):
        for r in range(c * rows // chunks, (c + 1) * rows // chunks):
            xr, yr = x[xs[r]:xs[r] + d], y[ys[r]:ys[r] + d]
            s = 0.0
            for i in range(d):
                s += xr[i]
            m = xr.dtype.type(s / d)
            ss = 0.0
            for i in range(d):
                v = np.float64(xr[i] - m)
                ss += v * v
            rs = xr.dtype.type(1.0 / np.sqrt(ss / d + eps))
            mean[r], rstd[r] = m, rs
            if affine:
                for i in range(d):
                    yr[i] = (xr[i] - m) * rs * w[i] + b[i]
            else:
                for i in range(d):
                    yr[i] = (xr[i] - m) * rs


@RowKernel
def _ln_backward_cpu(x, xs, dy, dys, d, affine, w, mean, rstd, dx, dxs, dw, db, chunks):
    """Per row, with xhat = (x - mean) * rstd and g = dy * w (dy if not affine):
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat)). If affine, chunk c's rows add their
    dy * xhat and dy into dw[c] and db[c] (float64)."""
    rows = xs.size
    for c in numba.prange(chunks):
        if affine:
            dw[c, :] = 0.0
            db[c, :] = 0.0
        for r in range(c * rows // chunks, (c + 1) * rows // chunks):
            xr, gr, dr = x[xs[r]:xs[r] + d], dy[dys[r]:dys[r] + d], dx[dxs[r]:dxs[r] + d]
            m, rs = mean[r], rstd[r]
            s1 = 0.0
            s2 = 0.0
            if affine:
                for i in range(d):
                    xh = (xr[i] - m) * rs
                    g = gr[i] * w[i]
                    s1 += g
                    s2 += g * xh
                    dw[c, i] += gr[i] * xh
                    db[c, i] += gr[i]
            else:
                for i in range(d):
                    xh = (xr[i] - m) * rs
                    s1 += gr[i]
                    s2 += gr[i] * xh
            a, k = rs * xr.dtype.type(s1 / d), rs * xr.dtype.type(s2 / d)
            if affine:
                for i in range(d):
                    dr[i] = rs * gr[i] * w[i] - a - (xr[i] - m) * rs * k
            else:
                for i in range(d):
                    dr[i] = rs * gr[i] - a - (xr[i] - m) * rs * k


@register_op
class LayerNorm(Op):
    """nn.LayerNorm over the trailing `normalized_shape` dims; the leading dims may be split."""

    kind = "layer_norm"
    float_inputs = True

    def __init__(self, name, inputs, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True):
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        shape = tuple(int_attr(self.kind, name, "normalized_shape", s) for s in normalized_shape)
        super().__init__(name, inputs, normalized_shape=shape, eps=float_attr(self.kind, name, "eps", eps, 0.0,
                                                                              lo_open=True),
                         elementwise_affine=bool_attr(self.kind, name, "elementwise_affine", elementwise_affine))

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 1:
            raise self.fail(f"takes 1 input, got {len(in_shapes)}")
        (shape,) = in_shapes
        k = len(self.normalized_shape)
        if k == 0 or k > len(shape) or tuple(shape[len(shape) - k:]) != self.normalized_shape:
            raise self.fail(f"normalized_shape {self.normalized_shape} is not the trailing dims of shape "
                            f"{tuple(shape)}")
        return [shape]

    def weight_shapes(self):
        if not self.elementwise_affine:
            return {}
        return {"weight": self.normalized_shape, "bias": self.normalized_shape}

    def init_weights(self, rng):
        dtype = self.weight_dtype("weight")
        if not self.elementwise_affine:
            return {}
        return {"weight": np.ones(self.normalized_shape, dtype), "bias": np.zeros(self.normalized_shape, dtype)}

    def split_dims(self):
        return sample_split_dims(len(self.tile_shape) - len(self.normalized_shape))

    def input_rects(self, tile):
        return [tile]

    def flops(self, tile):
        # mean, squared deviation, normalize (2), scale and shift (2)
        return (8 if self.elementwise_affine else 6) * tile.volume

    def _axes(self, x):
        return tuple(range(x.ndim - len(self.normalized_shape), x.ndim))

    def _use_kernels(self, xp, x, weights) -> bool:
        """Whether the numba kernels run: on the CPU, for float inputs of the weights' dtype."""
        return (xp is np and x.dtype in (np.float32, np.float64) and x.size > 0
                and all(w.dtype == x.dtype for w in weights.values()))

    def _use_cuda(self, xp, x, weights) -> bool:
        """Whether the CUDA kernels run: on a GPU, for float inputs of the weights' dtype."""
        return cuda_kernels.on_gpu(xp) and cuda_kernels.supports(x, *weights.values())

    def _rows(self, a):
        """a as [..., D] rows, D the normalized values (a view when a's trailing dims are contiguous)."""
        return a.reshape(a.shape[:a.ndim - len(self.normalized_shape)] + (-1,))

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        (x,) = inputs
        if self._use_kernels(xp, x, weights):
            return self._forward_cpu(x, weights)
        if self._use_cuda(xp, x, weights):
            w, b = (weights["weight"], weights["bias"]) if self.elementwise_affine else (None, None)
            y, mean, rstd = cuda_kernels.layer_norm_forward(x, math.prod(self.normalized_shape), self.eps, w, b)
            return [y], (mean, rstd)
        axes = self._axes(x)
        mean = x.mean(axis=axes, keepdims=True)
        xc = x - mean
        rstd = 1 / xp.sqrt((xc * xc).mean(axis=axes, keepdims=True) + x.dtype.type(self.eps))
        xhat = xc * rstd
        y = xhat * weights["weight"] + weights["bias"] if self.elementwise_affine else xhat
        return [y], (xhat, rstd)

    def _forward_cpu(self, x, weights):
        rows = self._rows(x)
        xflat, xs = row_starts(rows)
        y = np.empty(x.shape, x.dtype)
        yflat, ys = row_starts(self._rows(y), writable=True)
        mean, rstd = np.empty(xs.size, x.dtype), np.empty(xs.size, x.dtype)
        w, b = self._flat_weights(weights, x.dtype)
        threads, chunks = row_split(xs.size, rows.shape[-1])
        _ln_forward_cpu.on(threads)(xflat, xs, rows.shape[-1], self.eps, self.elementwise_affine, w, b, yflat, ys,
                                    mean, rstd, chunks)
        return [y], (mean, rstd)

    def _flat_weights(self, weights, dtype):
        """weight and bias as 1-D arrays over a row (empty ones when there are none)."""
        if not self.elementwise_affine:
            return np.empty(0, dtype), np.empty(0, dtype)
        return (np.ascontiguousarray(weights["weight"]).reshape(-1),
                np.ascontiguousarray(weights["bias"]).reshape(-1))

    def _backward_cpu(self, x, dy, weights, mean, rstd):
        rows = self._rows(x)
        xflat, xs = row_starts(rows)
        gflat, gs = row_starts(self._rows(dy))
        dx = np.empty(x.shape, x.dtype)
        dflat, ds = row_starts(self._rows(dx), writable=True)
        d = rows.shape[-1]
        threads, chunks = row_split(xs.size, d)
        w, _ = self._flat_weights(weights, x.dtype)
        parts = (chunks, d) if self.elementwise_affine else (0, 0)
        dw, db = np.empty(parts), np.empty(parts)
        _ln_backward_cpu.on(threads)(xflat, xs, gflat, gs, d, self.elementwise_affine, w, mean, rstd, dflat, ds, dw,
                                     db, chunks)
        if not self.elementwise_affine:
            return [dx], {}
        shape, dtype = self.normalized_shape, weights["weight"].dtype
        return [dx], {"weight": dw.sum(axis=0).astype(dtype).reshape(shape),
                      "bias": db.sum(axis=0).astype(dtype).reshape(shape)}

    def _backward_cuda(self, x, dy, weights, mean, rstd):
        w = weights["weight"] if self.elementwise_affine else None
        dx, dw, db = cuda_kernels.layer_norm_backward(x, dy, math.prod(self.normalized_shape), w, mean, rstd)
        if not self.elementwise_affine:
            return [dx], {}
        shape, dtype = self.normalized_shape, weights["weight"].dtype
        return [dx], {"weight": dw.astype(dtype).reshape(shape), "bias": db.astype(dtype).reshape(shape)}

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        if self._use_kernels(xp, inputs[0], weights):
            return self._backward_cpu(inputs[0], grad_outputs[0], weights, *saved)
        if self._use_cuda(xp, inputs[0], weights):
            return self._backward_cuda(inputs[0], grad_outputs[0], weights, *saved)
        (dy,), (xhat, rstd) = grad_outputs, saved
        axes = self._axes(dy)
        lead = tuple(range(dy.ndim - len(self.normalized_shape)))
        grads = {}
        if self.elementwise_affine:
            grads = {"weight": (dy * xhat).sum(axis=lead), "bias": dy.sum(axis=lead)}
            dy = dy * weights["weight"]
        dx = rstd * (dy - dy.mean(axis=axes, keepdims=True) - xhat * (dy * xhat).mean(axis=axes, keepdims=True))
        return [dx], grads
