"""2-D convolution and pooling on NCHW images, tile-aware with halos.

A tile of the output reads the input rows and columns its windows cover (its halo),
clipped to the input; padding is virtual, so a kernel works out from the tile and its
input rect how many zero (or -inf) rows and columns to add at each edge.
Convolution is im2col (a strided window view copied chunk by chunk) times the weight
matrix in one batched BLAS matmul per chunk; col2im is a numba kernel on the CPU and
plain array code on the GPU. Small images on the CPU (Conv2d._batched) lay the columns of
a chunk's samples side by side instead, [K, samples*OH*OW], built and summed back by numba
kernels from the unpadded tile: forward, the weight gradient and the columns' gradient are
then one GEMM each per chunk where per-sample ones would be thin. 3x3 stride-1 convolutions
with enough channels and pixels are Winograd's (ops/winograd.py). Pooling on the CPU is
direct numba kernels that clip each window to the tile instead of padding it (max pooling
saves its argmax for backward); on the GPU it is array code over the padded input.
"""
from __future__ import annotations

import importlib
import numba
import numpy as np

from ops import cpu_pool, winograd
from ops.base import ATTRIBUTE, PARAMETER, SAMPLE, Op, SplitDim, int_attr, register_op
from ops.cpu_layout import flat_row, flat_rows
from ops.linear import torch_linear_init
from taskrt.geometry import Rect

#: im2col works on batches of samples whose columns take about this many bytes: each core's
#: part of the batch keeps its columns in its share of the L3 cache, beside other work
_CHUNK_BYTES = 2 << 20
#: fewer input channels than this and Winograd's transforms cost more than its GEMMs save
_WINOGRAD_MIN_CHANNELS = 8
#: smaller output images than this (pixels) and im2col is faster: few 4x4 blocks an image make
#: its 36 GEMMs thin (measured on 2 cores: 0.5-0.7x im2col's time at 28x28 and up, 1.1-3x at
#: 16x16 and below with 32 to 512 channels)
_WINOGRAD_MIN_PIXELS = 24 * 24
#: output tiles of at most this many pixels (and a kernel other than 1x1, stride 1 along the
#: width) run with all their samples' columns side by side (Conv2d._batched): one GEMM a chunk
#: where the per-sample ones are thin. Measured on one core, forward + backward, batch 8-32,
#: against im2col per sample: 0.7-0.8x its time for 3x3 from 8x8 to 32x32 (3 to 128 channels),
#: 0.9x for a 1x7 at 28x28, 1.0x for a 5x5 at 27x27 with 96 channels, 0.65x for a 3x3 at 56x56
#: with 3 channels but 1.6-2x at 64x64 and 112x112 with 3-4 (where a sample's columns fill a
#: chunk by themselves)
_BATCHED_MAX_PIXELS = 32 * 32


def _pair(kind: str, name: str, attr: str, value, least: int) -> tuple[int, ...]:
    """3 -> (3, 3); (2, 3) -> (2, 3), each an int >= least (ShapeError naming the op otherwise).
    A wrong length is left for infer_shapes to report."""
    if isinstance(value, (tuple, list)):
        return tuple(int_attr(kind, name, attr, v, least) for v in value)
    v = int_attr(kind, name, attr, value, least)
    return (v, v)


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


@numba.njit(nogil=True, inline="always")
def _valid_outputs(j, stride, pad, out_n, size):
    """Outputs [lo, hi) along a dim whose window offset j reads inside [0, size): the o with
    0 <= o*stride - pad + j < size."""
    lo = max(0, -((j - pad) // stride))
    hi = min(out_n, (size - 1 + pad - j) // stride + 1)
    return lo, max(lo, hi)


# The kernels below take windows of width stride 1 only. Their inner loops copy (add) runs
# of a row, and index slices that end at the array's end with the loop counter alone: an
# index LLVM cannot prove non-negative keeps numba's wraparound check in the loop, and a
# strided branch beside the contiguous one stops the vectorizing too (each 2-4x slower,
# measured). Where the columns' rows are as long as the input's (stride 1, "same" padding:
# a sample's window offset (i, j) is its input plane shifted) a plane is one run.
@numba.njit(nogil=True, inline="never")
def _copy_run(dst, src, n):
    for k in range(n):
        dst[k] = src[k]


@numba.njit(nogil=True, inline="never")
def _add_run(dst, src, n):
    for k in range(n):
        dst[k] += src[k]


@numba.njit(nogil=True, inline="always")
def _zero_edges(plane, oh_lo, oh_hi, ow_, ow_lo, ow_hi):
    """Zero columns [0, ow_lo) and [ow_hi, OW) of rows [oh_lo, oh_hi) of a flat plane of rows of
    OW: a few scalar stores a row, where a slice per row would cost more than the stores."""
    zero = plane.dtype.type(0)
    for oh in range(oh_lo, oh_hi):
        for ow in range(ow_lo):
            plane[oh * ow_ + ow] = zero
        for ow in range(ow_hi, ow_):
            plane[oh * ow_ + ow] = zero


@numba.njit(nogil=True, cache=True)
def _im2col_rows_cpu(x, kernel, sh, pads, cols):
    """cols[(c*KH + i)*KW + j, s, oh, ow] = x[s, c, oh*sh - top + i, ow - left + j], 0 where that
    is outside x (the virtual padding); x [N, C, H, W] and cols C-contiguous."""
    n_, c_, h_, w_ = x.shape
    oh_, ow_ = cols.shape[2:]
    (kh, kw), (top, left) = kernel, pads
    zero = cols.dtype.type(0)
    planes = sh == 1 and ow_ == w_
    xf = x.reshape(n_, c_, h_ * w_)
    cf = cols.reshape(cols.shape[0], n_, oh_ * ow_)
    for c in range(c_):
        for i in range(kh):
            oh_lo, oh_hi = _valid_outputs(i, sh, top, oh_, h_)
            for j in range(kw):
                ow_lo, ow_hi = _valid_outputs(j, 1, left, ow_, w_)
                r = (c * kh + i) * kw + j
                for s in range(n_):
                    dst = cf[r, s]
                    for k in range(oh_lo * ow_):
                        dst[k] = zero
                    for k in range(oh_hi * ow_, oh_ * ow_):
                        dst[k] = zero
                    if oh_hi == oh_lo or ow_hi == ow_lo:
                        for k in range(oh_lo * ow_, oh_hi * ow_):
                            dst[k] = zero
                        continue
                    if planes:  # one run from (oh_lo, ow_lo), then the columns outside x zeroed
                        start = (oh_lo - top + i) * w_ + ow_lo - left + j
                        n = min((oh_hi - oh_lo) * ow_ - ow_lo, h_ * w_ - start)
                        _copy_run(dst[oh_lo * ow_ + ow_lo:], xf[s, c, start:], n)
                        _zero_edges(dst, oh_lo, oh_hi, ow_, ow_lo, ow_hi)
                        continue
                    for oh in range(oh_lo, oh_hi):
                        row = cols[r, s, oh]
                        for ow in range(ow_lo):
                            row[ow] = zero
                        _copy_run(row[ow_lo:], x[s, c, oh * sh - top + i, ow_lo - left + j:], ow_hi - ow_lo)
                        for ow in range(ow_hi, ow_):
                            row[ow] = zero


@numba.njit(nogil=True, cache=True)
def _col2im_rows_cpu(cols, kernel, sh, pads, dx):
    """dx[s, c, ih, iw] = the sum of cols[(c*KH + i)*KW + j, s, oh, ow] over the windows (oh, ow)
    and offsets (i, j) with ih = oh*sh - top + i and iw = ow - left + j: the gradient of
    _im2col_rows_cpu, written into dx (no padded copy to crop). cols is overwritten: the
    entries of windows outside dx are zeroed, so that a plane's run adds zeros across rows."""
    n_, c_, h_, w_ = dx.shape
    oh_, ow_ = cols.shape[2:]
    (kh, kw), (top, left) = kernel, pads
    zero = dx.dtype.type(0)
    planes = sh == 1 and ow_ == w_
    df = dx.reshape(n_, c_, h_ * w_)
    cf = cols.reshape(cols.shape[0], n_, oh_ * ow_)
    for s in range(n_):
        for c in range(c_):
            out = df[s, c]
            for k in range(h_ * w_):
                out[k] = zero
            for i in range(kh):
                oh_lo, oh_hi = _valid_outputs(i, sh, top, oh_, h_)
                for j in range(kw):
                    ow_lo, ow_hi = _valid_outputs(j, 1, left, ow_, w_)
                    r = (c * kh + i) * kw + j
                    if oh_hi == oh_lo or ow_hi == ow_lo:
                        continue
                    if planes:
                        _zero_edges(cf[r, s], oh_lo, oh_hi, ow_, ow_lo, ow_hi)
                        start = (oh_lo - top + i) * w_ + ow_lo - left + j
                        n = min((oh_hi - oh_lo) * ow_ - ow_lo, h_ * w_ - start)
                        _add_run(out[start:], cf[r, s, oh_lo * ow_ + ow_lo:], n)
                        continue
                    for oh in range(oh_lo, oh_hi):
                        _add_run(dx[s, c, oh * sh - top + i, ow_lo - left + j:], cols[r, s, oh, ow_lo:], ow_hi - ow_lo)


def _bias_grad(xp, dy):
    """dy [N, C, H, W] summed over all but C: each sample's pixels as a matrix-vector product,
    then the samples (BLAS's matrix-vector product is 3x numpy's sum over axes (0, 2, 3))."""
    n, c = dy.shape[:2]
    return (dy.reshape(n, c, -1) @ xp.ones(dy.shape[2] * dy.shape[3], dy.dtype)).sum(axis=0)


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
        k = self.kind
        super().__init__(name, inputs, out_channels=int_attr(k, name, "out_channels", out_channels),
                         kernel=_pair(k, name, "kernel", kernel, 1), stride=_pair(k, name, "stride", stride, 1),
                         padding=_pair(k, name, "padding", padding, 0), groups=int_attr(k, name, "groups", groups),
                         use_bias=bool(use_bias))

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
        fan_in = self._per_group[0] * self.kernel[0] * self.kernel[1]
        return {k: torch_linear_init(rng, s, fan_in, self.weight_dtype(k)) for k, s in self.weight_shapes().items()}

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
        """(groups in tile, rows per group, first tile channel's row in the groups' rows).

        A tile inside one group has just its own rows (a half of the out channels is half
        the work); a tile over several groups pads the ones it holds in part with zero rows."""
        g0, g1 = self._groups_of(tile)
        if g1 - g0 == 1:
            return 1, tile.hi[1] - tile.lo[1], 0
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

    def _path(self, xp, tile: Rect) -> str:
        """How a tile runs: "winograd" (see _winograd), "batched" (see _batched), or "columns":
        im2col per sample and one batched matmul per chunk (_forward_columns)."""
        if self._winograd(xp):
            return "winograd"
        return "batched" if self._batched(xp, tile) else "columns"

    def _winograd(self, xp) -> bool:
        """Whether tiles run as Winograd F(4x4, 3x3) (ops/winograd.py): 3x3 stride-1 convolutions
        of one group on the CPU, with enough input channels and output pixels for its transforms
        to pay."""
        out = self.outputs[0].shape
        return (xp is np and self.kernel == (3, 3) and self.stride == (1, 1) and self.groups == 1
                and self.inputs[0].shape[1] >= _WINOGRAD_MIN_CHANNELS and out[2] * out[3] >= _WINOGRAD_MIN_PIXELS)

    def _pads(self, tile: Rect, in_rect: Rect):
        """The tile's virtual padding ((top, bottom), (left, right)) of its input rect."""
        return _window_geometry(tile, in_rect, self.kernel, self.stride, self.padding)

    def _column_chunks(self, xp, tile: Rect, xpad):
        """Yield (a, b, cols): the im2col matrix [b-a, G, K/G, OH*OW] of samples [a, b) of xpad, in
        one reused buffer; for a 1x1 kernel the (strided) input itself, all samples at once."""
        n, (oh, ow) = xpad.shape[0], tile.shape[2:]
        ng = self._layout(tile)[0]
        if self.kernel == (1, 1):
            cols = xp.ascontiguousarray(_strided(xpad, 0, 0, self.stride, (oh, ow)))
            yield 0, n, cols.reshape(n, ng, -1, oh * ow)
            return
        view = _im2col_view(xp, xpad, self.kernel, self.stride, (oh, ow))
        chunks = _chunks(xp, n, view[0].size * xpad.itemsize)
        buf = xp.empty((chunks[0][1] - chunks[0][0], *view.shape[1:]), xpad.dtype)
        for a, b in chunks:
            xp.copyto(buf[:b - a], view[a:b])
            yield a, b, buf[:b - a].reshape(b - a, ng, -1, oh * ow)

    def _batched(self, xp, tile: Rect) -> bool:
        """Whether a tile runs with the columns of its samples side by side (_forward_batched): on
        the CPU, for tiles of at most _BATCHED_MAX_PIXELS output pixels, kernels other than 1x1
        (whose columns are the input itself) and stride 1 along the width (the kernels copy
        runs of rows, see _im2col_rows_cpu)."""
        return (xp is np and self.kernel != (1, 1) and self.stride[1] == 1
                and tile.shape[2] * tile.shape[3] <= _BATCHED_MAX_PIXELS)

    def _sample_columns(self, tile: Rect, x, pads):
        """Yield (a, b, cols): the im2col matrix [K, (b-a)*OH*OW] of samples [a, b) of the unpadded
        input tile x, the samples side by side in the column index, in one reused buffer."""
        n, (oh, ow) = x.shape[0], tile.shape[2:]
        k = x.shape[1] * self.kernel[0] * self.kernel[1]
        chunks = _chunks(np, n, k * oh * ow * x.itemsize)
        buf = np.empty(k * (chunks[0][1] - chunks[0][0]) * oh * ow, x.dtype)
        x = np.ascontiguousarray(x)
        for a, b in chunks:
            cols = buf[:k * (b - a) * oh * ow].reshape(k, b - a, oh, ow)
            _im2col_rows_cpu(x[a:b], self.kernel, self.stride[0], (pads[0][0], pads[1][0]), cols)
            yield a, b, cols.reshape(k, -1)

    def _forward_batched(self, tile, x, pads, w, bias, y) -> None:
        """y [N, OCt, OH*OW] as one GEMM per group and chunk of samples, the weight rows times the
        chunk's columns [K, n*OH*OW], transposed into y with the bias (if not None) added."""
        oct_, oh, ow = tile.shape[1:]
        ng, ocpg, off = self._layout(tile)
        wg = self._grouped(np, w.reshape(oct_, -1), tile)
        out = None
        for a, b, cols in self._sample_columns(tile, x, pads):
            out = np.empty(ng * ocpg * cols.shape[1], x.dtype) if out is None else out
            yt = np.matmul(wg, cols.reshape(ng, -1, cols.shape[1]),
                           out=out[:ng * ocpg * cols.shape[1]].reshape(ng, ocpg, -1))
            rows = yt.reshape(ng * ocpg, b - a, oh * ow)[off:off + oct_].transpose(1, 0, 2)
            if bias is None:
                np.copyto(y[a:b], rows)
            else:
                np.add(rows, bias[:, None], out=y[a:b])

    def _backward_batched(self, tile, x, pads, w, dy, dx):
        """dw, and dx written, as _forward_batched does it: per chunk, dy transposed to [OCt,
        n*OH*OW], dw += dy times the columns and the columns' gradient (weight rows times dy, in
        the columns' buffer) summed into dx (_col2im_rows_cpu)."""
        oct_, oh, ow = tile.shape[1:]
        ng, ocpg, off = self._layout(tile)
        wg_t = self._grouped(np, w.reshape(oct_, -1), tile).swapaxes(-1, -2)
        gw = np.zeros((ng, ocpg, w[0].size), x.dtype)
        top_left = (pads[0][0], pads[1][0])
        dyt_buf = None
        for a, b, cols in self._sample_columns(tile, x, pads):
            m = b - a
            dyt_buf = np.empty(oct_ * m * oh * ow, x.dtype) if dyt_buf is None else dyt_buf
            dyt = dyt_buf[:oct_ * m * oh * ow].reshape(oct_, m, oh, ow)
            np.copyto(dyt, dy[a:b].transpose(1, 0, 2, 3))
            dyg = self._grouped(np, dyt.reshape(oct_, -1), tile)
            colsg = cols.reshape(ng, -1, cols.shape[1])
            gw += np.matmul(dyg, colsg.swapaxes(-1, -2))
            np.matmul(wg_t, dyg, out=colsg)
            _col2im_rows_cpu(cols.reshape(-1, m, oh, ow), self.kernel, self.stride[0], top_left, dx[a:b])
        return gw.reshape(ng * ocpg, -1)[off:off + oct_].reshape(w.shape)

    @staticmethod
    def _in_parts(xp, work, n: int) -> list:
        """work(a, b) over the samples: on the CPU in parts, one per core of the task
        (ops/cpu_pool.py); on a GPU all at once."""
        return cpu_pool.in_parts(work, n) if xp is np else [work(0, n)]

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None):
        (x,), w = inputs, weights["weight"]
        n, oct_, oh, ow = tile.shape
        pads = self._pads(tile, in_rects[0])
        y = xp.empty((n, oct_, oh * ow), x.dtype)
        path, bias = self._path(xp, tile), weights["bias"] if self.use_bias else None

        def samples(a, b):
            if path == "winograd":
                winograd.forward(x[a:b], w, (pads[0][0], pads[1][0]), y[a:b].reshape(b - a, oct_, oh, ow))
            elif path == "batched":
                self._forward_batched(tile, x[a:b], pads, w, bias, y[a:b])
            else:
                self._forward_columns(xp, tile, _pad(xp, x[a:b], pads), w, y[a:b])
        self._in_parts(xp, samples, n)
        if bias is not None and path != "batched":
            y += bias[:, None]
        return [y.reshape(n, oct_, oh, ow)], None

    def _forward_columns(self, xp, tile, xpad, w, y) -> None:
        """y [N, OCt, OH*OW] = the tile's weight rows times the columns of each sample of xpad."""
        oct_, oh, ow = tile.shape[1:]
        ng, ocpg, off = self._layout(tile)
        wg = self._grouped(xp, w.reshape(oct_, -1), tile)
        for a, b, cols in self._column_chunks(xp, tile, xpad):
            if off == 0 and oct_ == ng * ocpg:
                xp.matmul(wg, cols, out=y[a:b].reshape(b - a, ng, ocpg, oh * ow))
            else:
                y[a:b] = xp.matmul(wg, cols).reshape(b - a, ng * ocpg, oh * ow)[:, off:off + oct_]

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        (x,), w, dy = inputs, weights["weight"], grad_outputs[0]
        pads = self._pads(tile, in_rects[0])
        dx = xp.empty(x.shape, x.dtype)
        path = self._path(xp, tile)

        def samples(a, b):
            if path == "winograd":
                return winograd.backward(x[a:b], w, dy[a:b], (pads[0][0], pads[1][0]), dx[a:b])
            if path == "batched":
                return self._backward_batched(tile, x[a:b], pads, w, dy[a:b], dx[a:b])
            return self._backward_columns(xp, tile, x[a:b], pads, w, dy[a:b], dx[a:b])
        gw = sum(self._in_parts(xp, samples, x.shape[0]))
        grads = {"weight": gw}
        if self.use_bias:
            grads["bias"] = _bias_grad(xp, dy)
        return [dx], grads

    def _backward_columns(self, xp, tile, x, pads, w, dy, dx):
        """dw, and dx written, through the columns: dw sums dy times each sample's columns, and
        the columns' gradient (weight rows times dy) goes back into the input (col2im; for a 1x1
        stride-1 kernel on an unpadded tile it is the input gradient itself)."""
        n, (oct_, oh, ow) = x.shape[0], tile.shape[1:]
        ng, ocpg, off = self._layout(tile)
        xpad = _pad(xp, x, pads)
        wg_t = self._grouped(xp, w.reshape(oct_, -1), tile).swapaxes(-1, -2)
        dyg = self._grouped(xp, xp.ascontiguousarray(dy).reshape(n, oct_, oh * ow), tile)
        gw = xp.zeros((ng, ocpg, w[0].size), x.dtype)
        direct = self.kernel == (1, 1) and self.stride == (1, 1) and xpad is x
        dxpad = dx if direct else xp.zeros(xpad.shape, x.dtype)
        dcols = None
        for a, b, cols in self._column_chunks(xp, tile, xpad):
            gw += xp.matmul(dyg[a:b], cols.swapaxes(-1, -2)).sum(axis=0)
            if direct:
                xp.matmul(wg_t, dyg[a:b], out=dxpad[a:b].reshape(cols.shape))
                continue
            dcols = xp.empty_like(cols) if dcols is None else dcols[:b - a]
            xp.matmul(wg_t, dyg[a:b], out=dcols)
            col2im(xp, dcols.reshape(b - a, x.shape[1], *self.kernel, oh, ow), self.stride, dxpad[a:b])
        if not direct:
            (top, _), (left, _) = pads
            dx[...] = dxpad[:, :, top:top + x.shape[2], left:left + x.shape[3]]
        return gw.reshape(ng * ocpg, -1)[off:off + oct_].reshape(w.shape)


# ---- pooling ------------------------------------------------------------------------
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
        _strided(out, i, j, stride, dy.shape[2:])[...] += xp.where(arg == k, dy, zero)


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
        k = self.kind
        super().__init__(name, inputs, kernel=_pair(k, name, "kernel", kernel, 1),
                         stride=_pair(k, name, "stride", kernel if stride is None else stride, 1),
                         padding=_pair(k, name, "padding", padding, 0), pool_type=pool_type)

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
        """On the CPU max pooling saves the argmax of every window (see _maxpool_cpu) for backward."""
        if xp is np:
            return self._forward_cpu(inputs[0], tile, in_rects[0])
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

    def _top_left(self, tile, in_rect) -> tuple[int, int]:
        (top, _), (left, _) = _window_geometry(tile, in_rect, self.kernel, self.stride, self.padding)
        return top, left

    def _forward_cpu(self, x, tile, in_rect):
        pads = self._top_left(tile, in_rect)
        y = np.empty(tile.shape, x.dtype)
        if self.pool_type == "avg":
            _avgpool_cpu(flat_rows(x), x.shape, self.kernel, self.stride, pads, y)
            return [y], None
        arg = np.empty(tile.shape, np.int32)
        _maxpool_cpu(flat_rows(x), x.shape, self.kernel, self.stride, pads, y, arg)
        return [y], arg

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved):
        (x,), (dy,) = inputs, grad_outputs
        if xp is np:
            return self._backward_cpu(x, dy, tile, in_rects[0], saved)
        kh, kw = self.kernel
        if self.pool_type == "max":
            xpad, pads = self._padded(xp, x, tile, in_rects[0])
            dxpad = xp.zeros(xpad.shape, x.dtype)
            arg = window_argmax(xp, xpad, outputs[0], self.kernel, self.stride)
            _maxpool_scatter_xp(xp, dy, arg, self.kernel, self.stride, dxpad)
        else:  # only the padded shape is needed, not a padded copy of x
            pads = _window_geometry(tile, in_rects[0], self.kernel, self.stride, self.padding)
            (top, bottom), (left, right) = pads
            dxpad = xp.zeros(x.shape[:2] + (x.shape[2] + top + bottom, x.shape[3] + left + right), x.dtype)
            share = dy * dy.dtype.type(1.0 / (kh * kw))
            for k in range(kh * kw):
                _strided(dxpad, *divmod(k, kw), self.stride, dy.shape[2:])[...] += share
        (top, _), (left, _) = pads
        return [xp.ascontiguousarray(dxpad[:, :, top:top + x.shape[2], left:left + x.shape[3]])], {}

    def _backward_cpu(self, x, dy, tile, in_rect, arg):
        dx = np.zeros(x.shape, x.dtype)
        if self.pool_type == "avg":
            _avgpool_scatter_cpu(flat_rows(dy), dy.shape, self.kernel, self.stride, self._top_left(tile, in_rect), dx)
        else:
            _maxpool_scatter_cpu(flat_rows(dy), arg, dx.reshape(*x.shape[:2], -1))
        return [dx], {}
