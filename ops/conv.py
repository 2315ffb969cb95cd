"""2-D convolution and pooling on NCHW images, tile-aware with halos.

A tile of the output reads the input rows and columns its windows cover (its halo),
clipped to the input; padding is virtual, so a kernel works out from the tile and its
input rect how many zero (or -inf) rows and columns to add at each edge.
Convolution is im2col (a strided window view copied chunk by chunk) times the weight
matrix in one batched BLAS matmul per chunk; col2im and max-pool's gradient scatter
are numba kernels on the CPU and plain array code on the GPU.
"""
from __future__ import annotations

import importlib
import math

import numba
import numpy as np

from ops.base import ATTRIBUTE, PARAMETER, SAMPLE, Op, SplitDim, register_op
from taskrt.geometry import Rect

#: im2col works on batches of samples whose columns take about this many bytes (fits in L3)
_CHUNK_BYTES = 8 << 20


def _pair(value) -> tuple[int, ...]:
    """3 -> (3, 3); (2, 3) -> (2, 3). A wrong length is left for infer_shapes to report."""
    if isinstance(value, (tuple, list)):
        return tuple(int(v) for v in value)
    return (int(value), int(value))


def _check_window(op: Op, shape, kernel, stride, padding) -> tuple[int, int]:
    """Validate an NCHW input and window attributes; return the output (height, width)."""
    if len(shape) != 4:
        raise op.fail(f"expects an NCHW input (4 dims), got shape {tuple(shape)}")
    for label, val, least in (("kernel", kernel, 1), ("stride", stride, 1), ("padding", padding, 0)):
        if len(val) != 2 or min(val) < least:
            raise op.fail(f"{label} must be 2 ints >= {least}, got {val}")
    padded = (shape[2] + 2 * padding[0], shape[3] + 2 * padding[1])
    if kernel[0] > padded[0] or kernel[1] > padded[1]:
        raise op.fail(f"kernel {kernel} is bigger than the padded input {padded}")
    return tuple((p - k) // s + 1 for p, k, s in zip(padded, kernel, stride))


def _span(lo: int, hi: int, stride: int, kernel: int, pad: int, size: int, n_out: int) -> tuple[int, int]:
    """Input range [a, b) that outputs [lo, hi) read along one dim, clipped to [0, size).

    A tile that ends at the last output also takes the trailing inputs no window reaches,
    so the tiles' rects cover the whole input (and its gradient is written everywhere).
    """
    start, stop = lo * stride - pad, (hi - 1) * stride - pad + kernel
    a = min(max(start, 0), size)
    return a, max(size if hi == n_out else min(stop, size), a)


def _edge_pads(lo: int, hi: int, stride: int, kernel: int, pad: int, a: int, b: int) -> tuple[int, int]:
    """Padding (before, after) that extends the input range [a, b) to the windows of outputs [lo, hi).

    `after` is 0 when [a, b) reaches past the last window (see _span)."""
    start, stop = lo * stride - pad, (hi - 1) * stride - pad + kernel
    if b > a:
        return a - start, max(stop - b, 0)
    return stop - start, 0


def _window_geometry(tile: Rect, in_rect: Rect, kernel, stride, padding):
    """Padding of an input tile in H and W: ((top, bottom), (left, right))."""
    return tuple(_edge_pads(tile.lo[d], tile.hi[d], stride[d - 2], kernel[d - 2], padding[d - 2],
                            in_rect.lo[d], in_rect.hi[d]) for d in (2, 3))


def _pad(xp, x, pads, value=0.0):
    if not any(pads[0]) and not any(pads[1]):
        return x
    return xp.pad(x, ((0, 0), (0, 0), pads[0], pads[1]), constant_values=value)


def _strided(xpad, i: int, j: int, stride, out_hw):
    """The input under window offset (i, j) for every output position: [N, C, OH, OW]."""
    (sh, sw), (oh, ow) = stride, out_hw
    return xpad[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]


def _im2col_view(xp, xpad, kernel, stride, out_hw):
    """A strided view [N, C, KH, KW, OH, OW] of every window of a padded input (no copy)."""
    sliding_window_view = importlib.import_module(xp.__name__ + ".lib.stride_tricks").sliding_window_view
    (sh, sw), (oh, ow) = stride, out_hw
    v = sliding_window_view(xpad, kernel, axis=(2, 3))[:, :, :sh * (oh - 1) + 1:sh, :sw * (ow - 1) + 1:sw]
    return v.transpose(0, 1, 4, 5, 2, 3)


@numba.njit(nogil=True, cache=True)
def _col2im_cpu(cols, sh, sw, out):
    """out[n, c, oh*sh + i, ow*sw + j] += cols[n, c, i, j, oh, ow]."""
    n_, c_, kh, kw, oh_, ow_ = cols.shape
    for n in range(n_):
        for c in range(c_):
            for i in range(kh):
                for j in range(kw):
                    for oh in range(oh_):
                        dst, src = out[n, c, oh * sh + i], cols[n, c, i, j, oh]
                        if sw == 1:  # contiguous: lets LLVM vectorize
                            for ow in range(ow_):
                                dst[ow + j] += src[ow]
                        else:
                            for ow in range(ow_):
                                dst[ow * sw + j] += src[ow]


def col2im(xp, cols, stride, out) -> None:
    """Add windows cols [N, C, KH, KW, OH, OW] back into the padded input `out` [N, C, H, W]."""
    if xp is np:
        _col2im_cpu(cols, stride[0], stride[1], out)
        return
    _col2im_xp(xp, cols, stride, out)


def _col2im_xp(xp, cols, stride, out) -> None:
    """col2im as array code: one strided add per window offset."""
    kh, kw, oh, ow = cols.shape[2:]
    for i in range(kh):
        for j in range(kw):
            _strided(out, i, j, stride, (oh, ow))[...] += cols[:, :, i, j]


def _chunks(xp, n: int, bytes_per_sample: int):
    """Sample ranges for im2col: cache-sized batches on the CPU, everything at once on a GPU."""
    step = max(1, _CHUNK_BYTES // max(1, bytes_per_sample)) if xp is np else n
    return [(a, min(n, a + step)) for a in range(0, n, step)]


@register_op
class Conv2d(Op):
    """PyTorch's nn.Conv2d (dilation 1). Splits: batch, out channels, height, width."""

    kind = "conv2d"

    def __init__(self, name, inputs, out_channels: int, kernel, stride=1, padding=0, groups: int = 1,
                 use_bias: bool = True):
        super().__init__(name, inputs, out_channels=int(out_channels), kernel=_pair(kernel), stride=_pair(stride),
                         padding=_pair(padding), groups=int(groups), use_bias=bool(use_bias))

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 1:
            raise self.fail(f"takes 1 input, got {len(in_shapes)}")
        (shape,) = in_shapes
        out_hw = _check_window(self, shape, self.kernel, self.stride, self.padding)
        if self.groups < 1 or self.out_channels < 1:
            raise self.fail(f"groups ({self.groups}) and out_channels ({self.out_channels}) must be >= 1")
        if shape[1] % self.groups or self.out_channels % self.groups:
            raise self.fail(f"in_channels {shape[1]} and out_channels {self.out_channels} must both be "
                            f"divisible by groups {self.groups}")
        return [(shape[0], self.out_channels, *out_hw)]

    @property
    def _per_group(self) -> tuple[int, int]:
        """(input channels, output channels) of one group."""
        return self.inputs[0].shape[1] // self.groups, self.out_channels // self.groups

    def weight_shapes(self):
        shapes = {"weight": (self.out_channels, self._per_group[0], *self.kernel)}
        if self.use_bias:
            shapes["bias"] = (self.out_channels,)
        return shapes

    def init_weights(self, rng):
        """kaiming_uniform(a=sqrt(5)) for the weight and U(+-1/sqrt(fan_in)) for the bias, as PyTorch."""
        bound = 1.0 / math.sqrt(self._per_group[0] * self.kernel[0] * self.kernel[1])
        dtype = self.weight_dtype("weight")
        return {k: rng.uniform(-bound, bound, s).astype(dtype) for k, s in self.weight_shapes().items()}

    def split_dims(self):
        return (SplitDim(0, SAMPLE), SplitDim(1, PARAMETER), SplitDim(2, ATTRIBUTE), SplitDim(3, ATTRIBUTE))

    def _groups_of(self, tile: Rect) -> tuple[int, int]:
        """Groups [g0, g1) that the tile's output channels belong to."""
        ocpg = self._per_group[1]
        return tile.lo[1] // ocpg, (tile.hi[1] - 1) // ocpg + 1

    def input_rects(self, tile):
        n, c, h, w = self.inputs[0].shape
        g0, g1 = self._groups_of(tile)
        icpg = self._per_group[0]
        hs = _span(tile.lo[2], tile.hi[2], self.stride[0], self.kernel[0], self.padding[0], h, self.tile_shape[2])
        ws = _span(tile.lo[3], tile.hi[3], self.stride[1], self.kernel[1], self.padding[1], w, self.tile_shape[3])
        return [Rect((tile.lo[0], g0 * icpg, hs[0], ws[0]), (tile.hi[0], g1 * icpg, hs[1], ws[1]))]

    def weight_rects(self, tile):
        rects = {"weight": Rect((tile.lo[1], 0, 0, 0), (tile.hi[1], self._per_group[0], *self.kernel))}
        if self.use_bias:
            rects["bias"] = Rect((tile.lo[1],), (tile.hi[1],))
        return rects

    def flops(self, tile):
        return 2 * tile.volume * self._per_group[0] * self.kernel[0] * self.kernel[1]

    # ---- kernels -----------------------------------------------------------------
    def _layout(self, tile: Rect):
        """(groups in tile, out channels per group, first tile channel's row in the groups' rows)."""
        g0, g1 = self._groups_of(tile)
        ocpg = self._per_group[1]
        return g1 - g0, ocpg, tile.lo[1] - g0 * ocpg

    def _grouped(self, xp, a, tile: Rect):
        """Rows [N?, OCt, K] of the tile's channels as [N?, G, OC/G, K], zero rows for channels of a
        group outside the tile (a tile may start or end inside a group)."""
        ng, ocpg, off = self._layout(tile)
        oct_ = tile.hi[1] - tile.lo[1]
        lead, k = a.shape[:-2], a.shape[-1]
        if off == 0 and oct_ == ng * ocpg:
            return a.reshape(*lead, ng, ocpg, k)
        full = xp.zeros((*lead, ng * ocpg, k), a.dtype)
        full[..., off:off + oct_, :] = a
        return full.reshape(*lead, ng, ocpg, k)

    def _column_chunks(self, xp, tile: Rect, xpad):
        """Yield (a, b, cols): the im2col matrix [b-a, G, K/G, OH*OW] of samples [a, b), in one reused buffer."""
        n, _, oh, ow = tile.shape
        view = _im2col_view(xp, xpad, self.kernel, self.stride, (oh, ow))
        ng = self._layout(tile)[0]
        chunks = _chunks(xp, n, view[0].size * xpad.itemsize)
        buf = xp.empty((chunks[0][1] - chunks[0][0], *view.shape[1:]), xpad.dtype)
        for a, b in chunks:
            xp.copyto(buf[:b - a], view[a:b])
            yield a, b, buf[:b - a].reshape(b - a, ng, -1, oh * ow)

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        (x,), w = inputs, weights["weight"]
        n, oct_, oh, ow = tile.shape
        ng, ocpg, off = self._layout(tile)
        xpad = _pad(xp, x, _window_geometry(tile, in_rects[0], self.kernel, self.stride, self.padding))
        wg = self._grouped(xp, w.reshape(oct_, -1), tile)
        y = xp.empty((n, oct_, oh * ow), x.dtype)
        for a, b, cols in self._column_chunks(xp, tile, xpad):
            if off == 0 and oct_ == ng * ocpg:
                xp.matmul(wg, cols, out=y[a:b].reshape(b - a, ng, ocpg, oh * ow))
            else:
                y[a:b] = xp.matmul(wg, cols).reshape(b - a, ng * ocpg, oh * ow)[:, off:off + oct_]
        if self.use_bias:
            y += weights["bias"][:, None]
        return [y.reshape(n, oct_, oh, ow)], None

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        (x,), w = inputs, weights["weight"]
        n, oct_, oh, ow = tile.shape
        ng, ocpg, off = self._layout(tile)
        pads = _window_geometry(tile, in_rects[0], self.kernel, self.stride, self.padding)
        xpad = _pad(xp, x, pads)
        wg_t = self._grouped(xp, w.reshape(oct_, -1), tile).swapaxes(-1, -2)
        dy = xp.ascontiguousarray(grad_outputs[0]).reshape(n, oct_, oh * ow)
        dyg = self._grouped(xp, dy, tile)
        gw = xp.zeros((ng, ocpg, w[0].size), x.dtype)
        dxpad = xp.zeros(xpad.shape, x.dtype)
        dcols = None
        for a, b, cols in self._column_chunks(xp, tile, xpad):
            gw += xp.matmul(dyg[a:b], cols.swapaxes(-1, -2)).sum(axis=0)
            dcols = xp.empty_like(cols) if dcols is None else dcols[:b - a]
            xp.matmul(wg_t, dyg[a:b], out=dcols)
            col2im(xp, dcols.reshape(b - a, x.shape[1], *self.kernel, oh, ow), self.stride, dxpad[a:b])
        (top, _), (left, _) = pads
        dx = dxpad[:, :, top:top + x.shape[2], left:left + x.shape[3]]
        grads = {"weight": gw.reshape(ng * ocpg, -1)[off:off + oct_].reshape(w.shape)}
        if self.use_bias:
            grads["bias"] = dy.sum(axis=(0, 2))
        return [xp.ascontiguousarray(dx)], grads


# ---- pooling ------------------------------------------------------------------------
@numba.njit(nogil=True, cache=True)
def _maxpool_scatter_cpu(dy, arg, sh, sw, kw, out):
    """out[n, c, oh*sh + k // kw, ow*sw + k % kw] += dy[n, c, oh, ow] with k = arg[n, c, oh, ow]."""
    n_, c_, oh_, ow_ = dy.shape
    for n in range(n_):
        for c in range(c_):
            for oh in range(oh_):
                for ow in range(ow_):
                    k = arg[n, c, oh, ow]
                    out[n, c, oh * sh + k // kw, ow * sw + k % kw] += dy[n, c, oh, ow]


def _maxpool_scatter_xp(xp, dy, arg, kernel, stride, out) -> None:
    """The scatter as array code (GPU): one masked strided add per window offset."""
    zero = dy.dtype.type(0)
    for k in range(kernel[0] * kernel[1]):
        i, j = divmod(k, kernel[1])
        _strided(out, i, j, stride, dy.shape[2:])[...] += xp.where(arg == k, dy, zero)


def maxpool_scatter(xp, dy, arg, kernel, stride, out) -> None:
    """Route each output gradient to its window's argmax in the padded input `out`."""
    if xp is np:
        _maxpool_scatter_cpu(np.ascontiguousarray(dy), arg, stride[0], stride[1], kernel[1], out)
        return
    _maxpool_scatter_xp(xp, dy, arg, kernel, stride, out)


def window_argmax(xp, xpad, y, kernel, stride):
    """Index k = i*KW + j of the first maximum in each window, or of its last NaN (PyTorch's rules)."""
    arg = xp.zeros(y.shape, xp.int32)
    found = xp.zeros(y.shape, bool)
    for k in range(kernel[0] * kernel[1]):
        win = _strided(xpad, *divmod(k, kernel[1]), stride, y.shape[2:])
        hit = ((win == y) & ~found) | (win != win)
        arg = xp.where(hit, xp.int32(k), arg)
        found |= hit
    return arg


@register_op
class Pool2d(Op):
    """PyTorch's max_pool2d / avg_pool2d (count_include_pad=True, floor mode). Every dim splits."""

    kind = "pool2d"
    POOL_TYPES = ("max", "avg")

    def __init__(self, name, inputs, kernel, stride=None, padding=0, pool_type: str = "max"):
        super().__init__(name, inputs, kernel=_pair(kernel), stride=_pair(kernel if stride is None else stride),
                         padding=_pair(padding), pool_type=pool_type)

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 1:
            raise self.fail(f"takes 1 input, got {len(in_shapes)}")
        if self.pool_type not in self.POOL_TYPES:
            raise self.fail(f"unknown pool_type {self.pool_type!r}; expected one of {self.POOL_TYPES}")
        (shape,) = in_shapes
        out_hw = _check_window(self, shape, self.kernel, self.stride, self.padding)
        if any(2 * p > k for p, k in zip(self.padding, self.kernel)):
            raise self.fail(f"padding {self.padding} must be at most half of kernel {self.kernel}")
        return [(shape[0], shape[1], *out_hw)]

    def split_dims(self):
        return (SplitDim(0, SAMPLE), SplitDim(1, ATTRIBUTE), SplitDim(2, ATTRIBUTE), SplitDim(3, ATTRIBUTE))

    def input_rects(self, tile):
        h, w = self.inputs[0].shape[2:]
        hs = _span(tile.lo[2], tile.hi[2], self.stride[0], self.kernel[0], self.padding[0], h, self.tile_shape[2])
        ws = _span(tile.lo[3], tile.hi[3], self.stride[1], self.kernel[1], self.padding[1], w, self.tile_shape[3])
        return [Rect((tile.lo[0], tile.lo[1], hs[0], ws[0]), (tile.hi[0], tile.hi[1], hs[1], ws[1]))]

    def flops(self, tile):
        return tile.volume * self.kernel[0] * self.kernel[1]

    def _padded(self, xp, x, tile, in_rect):
        pads = _window_geometry(tile, in_rect, self.kernel, self.stride, self.padding)
        fill = -np.inf if self.pool_type == "max" else 0.0
        return _pad(xp, x, pads, fill), pads

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        xpad, _ = self._padded(xp, inputs[0], tile, in_rects[0])
        out_hw = tile.shape[2:]
        kh, kw = self.kernel
        y = _strided(xpad, 0, 0, self.stride, out_hw).copy()
        for k in range(1, kh * kw):
            win = _strided(xpad, *divmod(k, kw), self.stride, out_hw)
            if self.pool_type == "max":
                xp.maximum(y, win, out=y)
            else:
                y += win
        if self.pool_type == "avg":
            y *= y.dtype.type(1.0 / (kh * kw))
        return [y], None

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        (x,), (dy,) = inputs, grad_outputs
        xpad, pads = self._padded(xp, x, tile, in_rects[0])
        dxpad = xp.zeros(xpad.shape, x.dtype)
        kh, kw = self.kernel
        if self.pool_type == "max":
            arg = window_argmax(xp, xpad, outputs[0], self.kernel, self.stride)
            maxpool_scatter(xp, dy, arg, self.kernel, self.stride, dxpad)
        else:
            share = dy * dy.dtype.type(1.0 / (kh * kw))
            for k in range(kh * kw):
                _strided(dxpad, *divmod(k, kw), self.stride, dy.shape[2:])[...] += share
        (top, _), (left, _) = pads
        return [xp.ascontiguousarray(dxpad[:, :, top:top + x.shape[2], left:left + x.shape[3]])], {}
