"""Batch and layer normalization (PyTorch semantics).

BatchNorm's statistics span batch, height and width, so only channels may be split;
LayerNorm's span the trailing normalized dims, so only the leading dims may be.
Either way a tile reads exactly its own rect of the input.
"""
from __future__ import annotations

import numpy as np

from ops.base import ATTRIBUTE, PARAMETER, SAMPLE, Op, SplitDim, register_op
from taskrt.geometry import Rect


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

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        (x,) = inputs
        axes = self._axes(x)
        count = x.size // x.shape[1]
        if training:
            if count < 2:
                raise self.fail(f"needs more than 1 value per channel in training, got {count}")
            mean = x.mean(axis=axes)
            var = ((x - self._bcast(mean, x.ndim)) ** 2).mean(axis=axes)
            if state is not None:
                m = x.dtype.type(self.momentum)
                state["running_mean"][...] = (1 - m) * state["running_mean"] + m * mean
                state["running_var"][...] = (1 - m) * state["running_var"] + m * var * (count / (count - 1))
        else:
            stats = state if state is not None else weights
            mean, var = stats["running_mean"], stats["running_var"]
        invstd = 1 / xp.sqrt(var + x.dtype.type(self.eps))
        scale = weights["weight"] * invstd
        y = x * self._bcast(scale, x.ndim) + self._bcast(weights["bias"] - mean * scale, x.ndim)
        if self.relu:
            xp.maximum(y, 0, out=y)
        return [y], (training, mean, invstd)

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        (x,), (dy,) = inputs, grad_outputs
        training, mean, invstd = saved
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
        lead = len(self.tile_shape) - len(self.normalized_shape)
        return tuple(SplitDim(d, SAMPLE if d == 0 else ATTRIBUTE) for d in range(lead))

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
