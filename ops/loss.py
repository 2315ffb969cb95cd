"""Loss operators: per-sample loss forward, gradient of the batch-mean loss backward.

Forward writes one loss per sample ([N]), so a model can report it per sample or
average it. Backward returns the gradient of the *mean* over the whole batch:
every tile scales by 1 / N with the global N = inputs[0].shape[0] (not the
tile's), so tiles split along the batch sum to the whole-batch gradient. The
incoming gradient weights each sample's loss: the runtime seeds it with ones
(or passes None, read as ones), which gives d(mean loss)/d(predictions).
Labels and targets are not differentiated (their gradient is None).
"""
from __future__ import annotations

import math

import numpy as np

from ops.base import SAMPLE, Op, SplitDim, batch_rect, register_op
from taskrt.geometry import Rect


def _sample_weights(xp, grad_outputs, n: int, dtype):
    """The incoming per-sample gradient, ones when the runtime passes None."""
    g = grad_outputs[0] if grad_outputs else None
    return xp.ones(n, dtype=dtype) if g is None else g


@register_op
class SparseCategoricalCrossEntropy(Op):
    """loss[i] = mean over positions p of -log(pred[i, p, label[i, p]]) for predictions [N, ..., C]
    and integer labels [N, ...] (predictions without C); with [N, C] and [N] it is -log(p[i, label[i]]).

    Each sample's loss is the mean over its positions, so the batch mean is the mean over all
    tokens, as F.cross_entropy(pred.reshape(-1, C), labels.reshape(-1)) gives for a sequence
    model. With from_logits=False (default) the predictions are probabilities (a softmax
    output); a probability below the dtype's smallest normal number is read as that number,
    so the loss stays finite (PyTorch's nll_loss(log(p)) would give inf). With
    from_logits=True they are logits and a stable log-softmax is used, as in F.cross_entropy.
    Only the batch may be split.
    """

    kind = "sparse_categorical_crossentropy"

    def __init__(self, name, inputs, from_logits: bool = False):
        super().__init__(name, inputs, from_logits=from_logits)

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 2:
            raise self.fail(f"takes 2 inputs (predictions [N, ..., C], labels [N, ...]), got {len(in_shapes)}")
        pred, lab = in_shapes
        if len(pred) < 2:
            raise self.fail(f"predictions must be [N, ..., C] (at least 2 dims), got shape {pred}")
        if tuple(lab) != tuple(pred[:-1]):
            dims = "N" if len(pred) == 2 else "N, ..."
            raise self.fail(f"labels must be [{dims}] = {list(pred[:-1])}, got shape {lab}")
        if pred[-1] < 1:
            raise self.fail(f"predictions need at least 1 class, got C = {pred[-1]}")
        if np.dtype(self.inputs[1].dtype).kind not in "iu":
            raise self.fail(f"labels must be integers, got dtype {self.inputs[1].dtype}")
        if np.dtype(self.inputs[0].dtype).kind != "f":
            raise self.fail(f"predictions must be floats, got dtype {self.inputs[0].dtype}")
        return [(pred[0],)]

    def split_dims(self):
        return (SplitDim(0, SAMPLE),)

    def index_bound(self, i: int) -> int | None:
        return int(self.inputs[0].shape[-1]) if i == 1 else None

    def input_rects(self, tile: Rect) -> list[Rect]:
        return [batch_rect(tile, t.shape) for t in self.inputs]

    @property
    def _positions(self) -> int:
        """Predictions per sample: the product of the dims between the batch and the classes."""
        return math.prod(self.inputs[0].shape[1:-1])

    def _check_labels(self, labels, num_classes: int) -> None:
        bad = (labels < 0) | (labels >= num_classes)
        if bool(bad.any()):
            first = int(labels[bad][0])
            raise ValueError(f"{self.kind} {self.name!r}: label {first} is out of range for "
                             f"C = {num_classes} classes (labels must be in [0, {num_classes}))")

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        x, labels = inputs
        n, c = x.shape[0], x.shape[-1]
        rows_x, flat = x.reshape(-1, c), labels.reshape(-1)
        self._check_labels(flat, c)
        rows = xp.arange(flat.shape[0])
        if self.from_logits:
            m = rows_x.max(axis=1, keepdims=True)
            lse = m + xp.log(xp.exp(rows_x - m).sum(axis=1, keepdims=True))
            loss = lse[:, 0] - rows_x[rows, flat]
            saved = xp.exp(rows_x - lse)  # softmax, for backward
        else:
            picked = xp.maximum(rows_x[rows, flat], np.finfo(x.dtype).tiny)
            loss = -xp.log(picked)
            saved = picked
        loss = loss.reshape(n, -1).mean(axis=1) if x.ndim > 2 else loss
        return [loss.astype(x.dtype, copy=False)], saved

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        x, labels = inputs
        n, c = x.shape[0], x.shape[-1]
        flat = labels.reshape(-1)
        per_sample = _sample_weights(xp, grad_outputs, n, x.dtype) / (self.inputs[0].shape[0] * self._positions)
        scale = xp.repeat(per_sample, self._positions)
        rows = xp.arange(flat.shape[0])
        if self.from_logits:
            dx = saved.copy()
            dx[rows, flat] -= 1
            dx *= scale[:, None]
        else:
            dx = xp.zeros((flat.shape[0], c), dtype=x.dtype)
            dx[rows, flat] = -scale / saved
        return [dx.reshape(x.shape).astype(x.dtype, copy=False), None], {}

    def flops(self, tile: Rect) -> int:
        rows, c = tile.shape[0] * self._positions, self.inputs[0].shape[-1]
        return (4 * rows * c if self.from_logits else 0) + 2 * rows


@register_op
class MeanSquaredError(Op):
    """loss[i] = mean over the non-batch dims of (predictions[i] - targets[i]) ** 2.

    The batch mean of this equals F.mse_loss(predictions, targets). Targets are
    treated like labels: no gradient. Only the batch may be split.
    """

    kind = "mean_squared_error"

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 2:
            raise self.fail(f"takes 2 inputs (predictions, targets), got {len(in_shapes)}")
        pred, target = in_shapes
        if len(pred) < 1:
            raise self.fail("predictions need at least 1 dim (dim 0 is the batch)")
        if tuple(pred) != tuple(target):
            raise self.fail(f"predictions {pred} and targets {target} must have the same shape")
        for i, t in enumerate(self.inputs):
            if np.dtype(t.dtype).kind != "f":
                raise self.fail(f"input {i} ({t.name}) must be floats, got dtype {t.dtype}")
        return [(pred[0],)]

    def split_dims(self):
        return (SplitDim(0, SAMPLE),)

    def input_rects(self, tile: Rect) -> list[Rect]:
        r = batch_rect(tile, self.inputs[0].shape)
        return [r, r]

    @property
    def _per_sample(self) -> int:
        return math.prod(self.inputs[0].shape[1:])

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        p, t = inputs
        d = p - t.astype(p.dtype, copy=False)
        loss = (d * d).sum(axis=tuple(range(1, d.ndim))) / self._per_sample
        return [loss.astype(p.dtype, copy=False)], None

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        p, t = inputs
        n = p.shape[0]
        scale = _sample_weights(xp, grad_outputs, n, p.dtype) * (2 / (self.inputs[0].shape[0] * self._per_sample))
        dp = (p - t.astype(p.dtype, copy=False)) * scale.reshape((n,) + (1,) * (p.ndim - 1))
        return [dp.astype(p.dtype, copy=False), None], {}

    def flops(self, tile: Rect) -> int:
        return 3 * tile.shape[0] * self._per_sample
