"""Batch and layer normalization (PyTorch semantics).

BatchNorm's statistics span batch, height and width, so only channels may be split;
LayerNorm's span the trailing normalized dims, so only the leading dims may be.
Either way a tile reads exactly its own rect of the input.

On the CPU BatchNorm on NCHW runs fused numba kernels on the input viewed as [N, C, H*W]:
one pass for the statistics, one for normalize, scale, shift and relu; backward one pass
for its two sums and one for dx. Per-channel sums accumulate in float64. Elsewhere (cupy,
and [N, C] inputs, whose one value per channel and sample makes rows too short for the
kernels' loops) it is plain array code.
"""
from __future__ import annotations

import numba
import numpy as np

from ops.base import PARAMETER, Op, SplitDim, register_op, sample_split_dims
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
def _bn_stats_cpu(x, shape, mean, var):
    """Per-channel mean and biased variance of the rows x of shape (N, C, L), in float64, in one pass.

    The sums are of x minus the channel's first value, which keeps the variance accurate
    when the mean is large against the spread."""
    n_, c_, l_ = shape
    shift, s, ss = np.empty(c_), np.zeros(c_), np.zeros(c_)
    for c in range(c_):
        shift[c] = _row(x, 0, c, l_)[0]
    for n in range(n_):
        for c in range(c_):
            row, k = _row(x, n, c, l_), shift[c]
            rs = 0.0
            rss = 0.0
            for i in range(l_):
                v = np.float64(row[i]) - k
                rs += v
                rss += v * v
            s[c] += rs
            ss[c] += rss
    count = n_ * l_
    for c in range(c_):
        m = s[c] / count
        v = ss[c] / count - m * m
        mean[c] = shift[c] + m
        var[c] = 0.0 if v < 0.0 else v  # keeps a NaN


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


def _shape3(a) -> tuple[int, int, int]:
    n, c, h, w = a.shape
    return n, c, h * w


@register_op
class BatchNorm(Op):
    """nn.BatchNorm2d (or 1d on [N, C]) with an optional fused relu, as FlexFlow's BatchNorm.

    Training normalizes with the batch statistics and updates the running stats in the
    `state` tiles (unbiased variance, as PyTorch); inference uses the running stats,
    read from `state`, or from `weights` when no state is passed.
    """

    kind = "batch_norm"
    has_training_mode = True

    def __init__(self, name, inputs, eps: float = 1e-5, momentum: float = 0.1, relu: bool = False):
        super().__init__(name, inputs, eps=float(eps), momentum=float(momentum), relu=bool(relu))

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
        return (SplitDim(1, PARAMETER),)

    def input_rects(self, tile):
        return [tile]

    def weight_rects(self, tile):
        channels = Rect((tile.lo[1],), (tile.hi[1],))
        return {k: channels for k in ("weight", "bias", "running_mean", "running_var")}

    def flops(self, tile):
        # statistics (sum, squared deviation), normalize, scale and shift; plus the fused relu
        return (7 + self.relu) * tile.volume

    def _axes(self, x):
        return (0,) if x.ndim == 2 else (0, 2, 3)

    def _bcast(self, v, ndim):
        return v.reshape((1, -1) + (1,) * (ndim - 2))

    @staticmethod
    def _use_kernels(xp, x) -> bool:
        """Whether the numba kernels run (NCHW on the CPU); forward and backward must agree."""
        return xp is np and x.ndim == 4

    def _running_update(self, state, mean, var, count) -> None:
        """running = (1 - momentum) * running + momentum * batch stat (unbiased variance), in place."""
        m = state["running_mean"].dtype.type(self.momentum)
        state["running_mean"][...] = (1 - m) * state["running_mean"] + m * mean
        state["running_var"][...] = (1 - m) * state["running_var"] + m * var * (count / (count - 1))

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        (x,) = inputs
        count = x.size // x.shape[1]
        if training and count < 2:
            raise self.fail(f"needs more than 1 value per channel in training, got {count}")
        if self._use_kernels(xp, x):
            return self._forward_cpu(x, weights, training, state, count)
        axes = self._axes(x)
        if training:
            mean = x.mean(axis=axes)
            var = ((x - self._bcast(mean, x.ndim)) ** 2).mean(axis=axes)
            if state is not None:
                self._running_update(state, mean, var, count)
        else:
            stats = state if state is not None else weights
            mean, var = stats["running_mean"], stats["running_var"]
        invstd = 1 / xp.sqrt(var + x.dtype.type(self.eps))
        scale = weights["weight"] * invstd
        y = x * self._bcast(scale, x.ndim) + self._bcast(weights["bias"] - mean * scale, x.ndim)
        if self.relu:
            xp.maximum(y, 0, out=y)
        return [y], (training, mean, invstd)

    def _forward_cpu(self, x, weights, training, state, count):
        """forward with the numba kernels; mean and invstd are saved in float64."""
        rows, shape = _rows(x), _shape3(x)
        if training:
            mean, var = np.empty(shape[1]), np.empty(shape[1])
            _bn_stats_cpu(rows, shape, mean, var)
            if state is not None:
                self._running_update(state, mean, var, count)
        else:
            stats = state if state is not None else weights
            mean, var = stats["running_mean"].astype(np.float64), stats["running_var"].astype(np.float64)
        invstd = 1 / np.sqrt(var + self.eps)
        scale = weights["weight"] * invstd
        shift = weights["bias"] - mean * scale
        y = np.empty(x.shape, x.dtype)
        _bn_apply_cpu(rows, shape, scale.astype(x.dtype), shift.astype(x.dtype), self.relu, _rows(y, writable=True))
        return [y], (training, mean, invstd)

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        (x,), (dy,) = inputs, grad_outputs
        training, mean, invstd = saved
        if self._use_kernels(xp, x):
            return self._backward_cpu(x, dy, outputs[0], weights, training, mean, invstd)
        axes, nd = self._axes(x), x.ndim
        if self.relu:
            dy = dy * (outputs[0] > 0)
        xhat = (x - self._bcast(mean, nd)) * self._bcast(invstd, nd)
        dbeta = dy.sum(axis=axes)
        dgamma = (dy * xhat).sum(axis=axes)
        scale = weights["weight"] * invstd
        if training:
            count = x.size // x.shape[1]
            dx = self._bcast(scale, nd) * (dy - self._bcast(dbeta / count, nd) - xhat * self._bcast(dgamma / count, nd))
        else:
            dx = dy * self._bcast(scale, nd)
        return [dx], {"weight": dgamma, "bias": dbeta}

    def _backward_cpu(self, x, dy, y, weights, training, mean, invstd):
        """backward with the numba kernels: one pass for dbeta and dgamma, one for dx."""
        shape = _shape3(x)
        xr, gr = _rows(x), _rows(dy)
        yr = _rows(y) if self.relu else xr  # y only masks the relu
        dbeta, dgamma = np.empty(shape[1]), np.empty(shape[1])
        _bn_grad_sums_cpu(xr, gr, yr, shape, self.relu, mean, dbeta, dgamma)
        dgamma *= invstd
        # dx = scale * (g - dbeta / count - xhat * dgamma / count), xhat = (x - mean) * invstd
        scale = weights["weight"] * invstd
        count = shape[0] * shape[2]
        coef = np.stack([scale, -scale * invstd * dgamma / count, mean, -scale * dbeta / count]).astype(x.dtype)
        dx = np.empty(x.shape, x.dtype)
        _bn_dx_cpu(xr, gr, yr, shape, self.relu, training, coef, _rows(dx, writable=True))
        wdt = weights["weight"].dtype
        return [dx], {"weight": dgamma.astype(wdt), "bias": dbeta.astype(wdt)}


@register_op
class LayerNorm(Op):
    """nn.LayerNorm over the trailing `normalized_shape` dims; the leading dims may be split."""

    kind = "layer_norm"

    def __init__(self, name, inputs, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True):
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        super().__init__(name, inputs, normalized_shape=tuple(int(s) for s in normalized_shape), eps=float(eps),
                         elementwise_affine=bool(elementwise_affine))

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

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        (x,) = inputs
        axes = self._axes(x)
        mean = x.mean(axis=axes, keepdims=True)
        xc = x - mean
        rstd = 1 / xp.sqrt((xc * xc).mean(axis=axes, keepdims=True) + x.dtype.type(self.eps))
        xhat = xc * rstd
        y = xhat * weights["weight"] + weights["bias"] if self.elementwise_affine else xhat
        return [y], (xhat, rstd)

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        (dy,), (xhat, rstd) = grad_outputs, saved
        axes = self._axes(dy)
        lead = tuple(range(dy.ndim - len(self.normalized_shape)))
        grads = {}
        if self.elementwise_affine:
            grads = {"weight": (dy * xhat).sum(axis=lead), "bias": dy.sum(axis=lead)}
            dy = dy * weights["weight"]
        dx = rstd * (dy - dy.mean(axis=axes, keepdims=True) - xhat * (dy * xhat).mean(axis=axes, keepdims=True))
        return [dx], grads
