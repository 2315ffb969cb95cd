"""2-D pooling (max and average) on NCHW images, tile-aware with halos.

Pooling on the CPU is direct numba kernels that clip each window to the tile instead of
padding it (max pooling saves its argmax for backward). On the GPU max pooling is CUDA
kernels that clip the same way (ops/cuda_kernels.py: a thread per output forward, saving the
argmax, and a thread per input backward); average pooling is array code over the padded input
(ops/windows.py: the window geometry it shares with convolution).
"""
from __future__ import annotations

import numba
import numpy as np

from ops import cuda_kernels
from ops.base import ATTRIBUTE, SAMPLE, Op, SplitDim, given_out, register_op
from ops.cpu_layout import flat_row, flat_rows
from ops.windows import check_window, pad, pair, span, strided, window_geometry
from taskrt.geometry import Rect


# The CPU kernels read the unpadded input tile x [N, C, H, W], as flat_rows (x, sn, sc, sh).
# The window of output (oh, ow) starts at input row oh*sh - top and column ow*sw - left (top,
# left: the tile's virtual padding) and is clipped to the tile, which holds every input a
# window reaches (Pool2d.input_rects). Each output row is done in two passes: a vertical one
# over the window's input rows, contiguous and vectorized, folds every column; a horizontal
# one combines the folded columns of each window.
@numba.njit(nogil=True, inline="always")
def _clip(o, stride, pad, kernel, size):
    start = o * stride - pad
    return max(start, 0), min(start + kernel, size)


@numba.njit(nogil=True, cache=True)
def _maxpool_cpu(x, shape, kernel, stride, pads, y, arg):
    """y = the max of each window of x, arg = its flat index ih*W + iw in its plane x[n, c].

    PyTorch's rule: the first maximum in row-major window order, or the last NaN. A window
    with no input in the tile (never for a pool's tiles) gets -inf and -1."""
    n_, c_, h_, w_ = shape
    oh_, ow_ = y.shape[2:]
    (kh, kw), (sh, sw), (top, left) = kernel, stride, pads
    _, xsn, xsc, xsh = x
    col_v = np.empty(w_, y.dtype)  # the best of each column over the window's rows
    col_k = np.empty(w_, np.int32)  # and its flat index
    lowest = y.dtype.type(-np.inf)
    for n in range(n_):
        for c in range(c_):
            plane = n * xsn + c * xsc
            for oh in range(oh_):
                yr, ar = y[n, c, oh], arg[n, c, oh]
                ha, hb = _clip(oh, sh, top, kh, h_)
                if ha >= hb:
                    yr[:] = lowest
                    ar[:] = -1
                    continue
                row = flat_row(x, plane + ha * xsh, w_)
                for iw in range(w_):
                    col_v[iw] = row[iw]
                    col_k[iw] = ha * w_ + iw
                for ih in range(ha + 1, hb):
                    row = flat_row(x, plane + ih * xsh, w_)
                    for iw in range(w_):
                        v, cv = row[iw], col_v[iw]
                        take = (v > cv) | (v != v)  # a later row wins if larger, or a NaN
                        col_v[iw] = v if take else cv
                        col_k[iw] = ih * w_ + iw if take else col_k[iw]
                nans = 0
                for iw in range(w_):
                    nans += col_v[iw] != col_v[iw]
                if nans:
                    _maxpool_row_nan(col_v, col_k, ow_, sw, left, kw, w_, yr, ar)
                    continue
                for ow in range(ow_):
                    wa, wb = _clip(ow, sw, left, kw, w_)
                    if wa >= wb:
                        yr[ow], ar[ow] = lowest, -1
                        continue
                    # branch-free: best by max, where by a (cmov) select; a float select would branch
                    best, where = col_v[wa], col_k[wa]
                    for j in range(wa + 1, wb):
                        v, k = col_v[j], col_k[j]
                        take = (v > best) | ((v == best) & (k < where))  # larger, or as large and earlier
                        best = max(best, v)
                        where = k if take else where
                    if best == 0:  # +0 and -0 tie: the value of the one chosen
                        for j in range(wa, wb):
                            if col_k[j] == where:
                                best = col_v[j]
                    yr[ow], ar[ow] = best, where


@numba.njit(nogil=True, cache=True)
def _maxpool_row_nan(col_v, col_k, ow_, sw, left, kw, w_, yr, ar):
    """The horizontal pass of _maxpool_cpu for an output row whose windows hold NaNs."""
    for ow in range(ow_):
        wa, wb = _clip(ow, sw, left, kw, w_)
        best, where = col_v.dtype.type(-np.inf), -1
        if wa < wb:
            best, where = col_v[wa], col_k[wa]
        for j in range(wa + 1, wb):
            v, k = col_v[j], col_k[j]
            if v != v:  # a NaN: the last one in row-major order
                take = best == best or k > where
            else:
                take = v > best or (v == best and k < where)
            if take:
                best, where = v, k
        yr[ow], ar[ow] = best, where


@numba.njit(nogil=True, cache=True)
def _maxpool_scatter_cpu(dy, arg, out):
    """out[n, c, arg[n, c, oh, ow]] += dy[n, c, oh, ow] over planes out [N, C, H*W]; arg -1 is skipped.

    dy comes as flat_rows (dy, sn, sc, sh)."""
    n_, c_, oh_, ow_ = arg.shape
    _, sn, sc, sh = dy
    for n in range(n_):
        for c in range(c_):
            dst = out[n, c]
            for oh in range(oh_):
                g, ar = flat_row(dy, n * sn + c * sc + oh * sh, ow_), arg[n, c, oh]
                for ow in range(ow_):
                    k = ar[ow]
                    if k >= 0:
                        dst[k] += g[ow]


@numba.njit(nogil=True, cache=True)
def _avgpool_cpu(x, shape, kernel, stride, pads, y):
    """y = the sum of each window of x (flat_rows) over kh*kw (padding counts as zeros), in float64."""
    n_, c_, h_, w_ = shape
    oh_, ow_ = y.shape[2:]
    (kh, kw), (sh, sw), (top, left) = kernel, stride, pads
    _, xsn, xsc, xsh = x
    col = np.empty(w_)  # each column's sum over the window's rows
    scale = 1.0 / (kh * kw)
    for n in range(n_):
        for c in range(c_):
            plane = n * xsn + c * xsc
            for oh in range(oh_):
                ha, hb = _clip(oh, sh, top, kh, h_)
                col[:] = 0.0
                for ih in range(ha, hb):
                    row = flat_row(x, plane + ih * xsh, w_)
                    for iw in range(w_):
                        col[iw] += row[iw]
                for ow in range(ow_):
                    wa, wb = _clip(ow, sw, left, kw, w_)
                    total = 0.0
                    for j in range(wa, wb):
                        total += col[j]
                    y[n, c, oh, ow] = total * scale


@numba.njit(nogil=True, cache=True)
def _avgpool_scatter_cpu(dy, dy_shape, kernel, stride, pads, out):
    """out[n, c, ih, iw] += dy[n, c, oh, ow] / (kh*kw) for every input (ih, iw) of window (oh, ow).

    dy comes as flat_rows (dy, sn, sc, sh); out is [N, C, H, W]."""
    n_, c_, oh_, ow_ = dy_shape
    h_, w_ = out.shape[2:]
    (kh, kw), (sh, sw), (top, left) = kernel, stride, pads
    _, sn, sc, shd = dy
    col = np.empty(w_, out.dtype)  # what each column of the window's rows receives
    share = out.dtype.type(1.0 / (kh * kw))
    for n in range(n_):
        for c in range(c_):
            dst = out[n, c]
            for oh in range(oh_):
                g = flat_row(dy, n * sn + c * sc + oh * shd, ow_)
                col[:] = 0
                for ow in range(ow_):
                    wa, wb = _clip(ow, sw, left, kw, w_)
                    v = g[ow] * share
                    for j in range(wa, wb):
                        col[j] += v
                ha, hb = _clip(oh, sh, top, kh, h_)
                for ih in range(ha, hb):
                    for iw in range(w_):
                        dst[ih, iw] += col[iw]


def _maxpool_scatter_xp(xp, dy, arg, kernel, stride, out) -> None:
    """Route each output gradient to its window's argmax k = i*KW + j in the padded input `out`
    (array code, for the GPU): one masked strided add per window offset."""
    zero = dy.dtype.type(0)
    for k in range(kernel[0] * kernel[1]):
        i, j = divmod(k, kernel[1])
        strided(out, i, j, stride, dy.shape[2:])[...] += xp.where(arg == k, dy, zero)


def window_argmax(xp, xpad, y, kernel, stride):
    """Index k = i*KW + j of the first maximum in each window, or of its last NaN (PyTorch's rules)."""
    arg = xp.zeros(y.shape, xp.int32)
    found = xp.zeros(y.shape, bool)
    for k in range(kernel[0] * kernel[1]):
        win = strided(xpad, *divmod(k, kernel[1]), stride, y.shape[2:])
        hit = ((win == y) & ~found) | (win != win)
        arg = xp.where(hit, xp.int32(k), arg)
        found |= hit
    return arg


@register_op
class Pool2d(Op):
    """PyTorch's max_pool2d / avg_pool2d (count_include_pad=True, floor mode). Every dim splits."""

    kind = "pool2d"
    float_inputs = True
    writes_out = True
    POOL_TYPES = ("max", "avg")

    def __init__(self, name, inputs, kernel, stride=None, padding=0, pool_type: str = "max"):
        k = self.kind
        super().__init__(name, inputs, kernel=pair(k, name, "kernel", kernel, 1),
                         stride=pair(k, name, "stride", kernel if stride is None else stride, 1),
                         padding=pair(k, name, "padding", padding, 0), pool_type=pool_type)

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 1:
            raise self.fail(f"takes 1 input, got {len(in_shapes)}")
        if self.pool_type not in self.POOL_TYPES:
            raise self.fail(f"unknown pool_type {self.pool_type!r}; expected one of {self.POOL_TYPES}")
        (shape,) = in_shapes
        out_hw = check_window(self, shape, self.kernel, self.stride, self.padding)
        if any(2 * p > k for p, k in zip(self.padding, self.kernel)):
            raise self.fail(f"padding {self.padding} must be at most half of kernel {self.kernel}")
        return [(shape[0], shape[1], *out_hw)]

    def split_dims(self):
        return (SplitDim(0, SAMPLE), SplitDim(1, ATTRIBUTE), SplitDim(2, ATTRIBUTE), SplitDim(3, ATTRIBUTE))

    def input_rects(self, tile):
        h, w = self.inputs[0].shape[2:]
        hs = span(tile.lo[2], tile.hi[2], self.stride[0], self.kernel[0], self.padding[0], h, self.tile_shape[2])
        ws = span(tile.lo[3], tile.hi[3], self.stride[1], self.kernel[1], self.padding[1], w, self.tile_shape[3])
        return [Rect((tile.lo[0], tile.lo[1], hs[0], ws[0]), (tile.hi[0], tile.hi[1], hs[1], ws[1]))]

    def flops(self, tile):
        return tile.volume * self.kernel[0] * self.kernel[1]

    def _padded(self, xp, x, tile, in_rect):
        pads = window_geometry(tile, in_rect, self.kernel, self.stride, self.padding)
        fill = -np.inf if self.pool_type == "max" else 0.0
        return pad(xp, x, pads, fill), pads

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None, out=None):
        """On the CPU max pooling saves the argmax of every window (see _maxpool_cpu) for backward."""
        if xp is np:
            return self._forward_cpu(inputs[0], tile, in_rects[0], given_out(out, 0)[0])
        if self._use_cuda(xp, inputs[0]):
            y, arg = cuda_kernels.max_pool_forward(inputs[0], tile.shape[2:], self.kernel, self.stride,
                                                   self._top_left(tile, in_rects[0]))
            return [y], arg
        xpad, _ = self._padded(xp, inputs[0], tile, in_rects[0])
        out_hw = tile.shape[2:]
        kh, kw = self.kernel
        y = strided(xpad, 0, 0, self.stride, out_hw).copy()
        for k in range(1, kh * kw):
            win = strided(xpad, *divmod(k, kw), self.stride, out_hw)
            if self.pool_type == "max":
                xp.maximum(y, win, out=y)
            else:
                y += win
        if self.pool_type == "avg":
            y *= y.dtype.type(1.0 / (kh * kw))
        return [y], None

    def _use_cuda(self, xp, x) -> bool:
        """Whether max pooling runs its CUDA kernels (on a GPU), saving the argmax for backward."""
        return self.pool_type == "max" and cuda_kernels.on_gpu(xp) and cuda_kernels.supports(x)

    def _top_left(self, tile, in_rect) -> tuple[int, int]:
        (top, _), (left, _) = window_geometry(tile, in_rect, self.kernel, self.stride, self.padding)
        return top, left

    def _forward_cpu(self, x, tile, in_rect, y=None):
        pads = self._top_left(tile, in_rect)
        y = np.empty(tile.shape, x.dtype) if y is None else y
        if self.pool_type == "avg":
            _avgpool_cpu(flat_rows(x), x.shape, self.kernel, self.stride, pads, y)
            return [y], None
        arg = np.empty(tile.shape, np.int32)
        _maxpool_cpu(flat_rows(x), x.shape, self.kernel, self.stride, pads, y, arg)
        return [y], arg

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved, out=None):
        (x,), (dy,) = inputs, grad_outputs
        given, wanted = given_out(out, 0)
        if not wanted:  # the model's input: pooling has no weights, so nothing is left to do
            return [None], {}
        if xp is np:
            return self._backward_cpu(x, dy, tile, in_rects[0], saved, given)
        if self._use_cuda(xp, x):
            return [cuda_kernels.max_pool_backward(dy, saved, x.shape, self.kernel, self.stride,
                                                   self._top_left(tile, in_rects[0]))], {}
        kh, kw = self.kernel
        if self.pool_type == "max":
            xpad, pads = self._padded(xp, x, tile, in_rects[0])
            dxpad = xp.zeros(xpad.shape, x.dtype)
            arg = window_argmax(xp, xpad, outputs[0], self.kernel, self.stride)
            _maxpool_scatter_xp(xp, dy, arg, self.kernel, self.stride, dxpad)
        else:  # only the padded shape is needed, not a padded copy of x
            pads = window_geometry(tile, in_rects[0], self.kernel, self.stride, self.padding)
            (top, bottom), (left, right) = pads
            dxpad = xp.zeros(x.shape[:2] + (x.shape[2] + top + bottom, x.shape[3] + left + right), x.dtype)
            share = dy * dy.dtype.type(1.0 / (kh * kw))
            for k in range(kh * kw):
                strided(dxpad, *divmod(k, kw), self.stride, dy.shape[2:])[...] += share
        (top, _), (left, _) = pads
        return [xp.ascontiguousarray(dxpad[:, :, top:top + x.shape[2], left:left + x.shape[3]])], {}

    def _backward_cpu(self, x, dy, tile, in_rect, arg, dx=None):
        if dx is None:
            dx = np.zeros(x.shape, x.dtype)
        else:
            dx.fill(0)
        if self.pool_type == "avg":
            _avgpool_scatter_cpu(flat_rows(dy), dy.shape, self.kernel, self.stride, self._top_left(tile, in_rect), dx)
        else:
            _maxpool_scatter_cpu(flat_rows(dy), arg, dx.reshape(*x.shape[:2], -1))
        return [dx], {}
