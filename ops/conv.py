"""2-D convolution on NCHW images, tile-aware with halos (ops/windows.py: the window geometry).

Convolution is im2col (a strided window view copied chunk by chunk) times the weight
matrix in one batched BLAS matmul per chunk; col2im is a numba kernel on the CPU. On a GPU
the columns of all samples lie side by side, [K, N*OH*OW], made and summed back by one CUDA
kernel each (ops/cuda_kernels.py), and forward and both gradients are one GEMM each (the
"gemm" path). Small images on the CPU (Conv2d._batched) lay the columns of
a chunk's samples side by side instead, [K, samples*OH*OW], built and summed back by numba
kernels from the unpadded tile: forward, the weight gradient and the columns' gradient are
then one GEMM each per chunk where per-sample ones would be thin; with strides over 1 those
kernels read the input's phase planes (its entries split by position modulo the stride), where
each window offset is a contiguous read. 3x3 stride-1 convolutions
with enough channels and 4x4 output blocks are Winograd's (ops/winograd.py), so are stride-1 1x7,
7x1, 1x3 and 3x1 ones along their one axis (ops/winograd_1d.py) and 3x3 stride-2 ones along the
width over their phase rows (ops/winograd_strided.py), and those of a few input
channels (a first layer) direct convolution (ops/direct_conv.py). Pooling is ops/pool.py.
"""
from __future__ import annotations

import functools
import importlib
import math
import numba
import numpy as np

from ops import cpu_pool, cuda_kernels, direct_conv, winograd, winograd_1d, winograd_strided
from ops.base import ATTRIBUTE, PARAMETER, SAMPLE, Op, SplitDim, bool_attr, given_out, int_attr, register_op
from ops.linear import torch_linear_init
from ops.windows import check_window, pad, pair, span, strided, window_geometry
from taskrt.geometry import Rect

#: im2col works on batches of samples whose columns take about this many bytes: each core's
#: part of the batch keeps its columns in its share of the L3 cache, beside other work
_CHUNK_BYTES = 2 << 20
#: Winograd (ops/winograd.py) where its transforms cost less than its GEMMs save. Measured on
#: one core, forward + backward, against the im2col paths: 0.33-0.6x their time from 8x8 to
#: 56x56 images with 16 to 512 channels, but 1.2-1.4x for 8 -> 8 channels (0.6x for 8 -> 16 or
#: 16 -> 8), 1.1x for 512 channels at 7x7 with 32 blocks, and 1.0x for 64 channels with 8-16:
#: with few blocks, transforming the filters ([36, C, OC]) is much of the work. So: at least
#: this many input channels,
_WINOGRAD_MIN_CHANNELS = 8
#: this many (input channels x the tile's output channels),
_WINOGRAD_MIN_CHANNEL_PAIRS = 128
#: and this many 4x4 output blocks in the tile
_WINOGRAD_MIN_BLOCKS = 64
#: Winograd along one axis (ops/winograd_1d.py) saves less (8/2 multiplies an output against 7
#: for a 1x7, 6/4 against 3 for a 1x3), so it needs more to pay. Measured on one core, forward
#: + backward, against the batched path: 0.68-0.81x its time with 64 to 384 channels a side and
#: 256 blocks or more (Inception's 1x7 and 7x1 at 17x17, 0.71-0.78x; its 1x3 and 3x1 at 8x8,
#: 0.68-0.70x), but 0.99-1.02x for 32 input channels, 1.3-1.6x for 16 or 8, 1.34x for a 1x3 on
#: 32 channels at 32x32, and 1.04x and 1.27x for 384 -> 384 channels with 128 and 64 blocks
#: (the filters' transforms are then much of the work). So: at least this many input channels,
_WINOGRAD_1D_MIN_CHANNELS = 48
#: this many (input channels x the tile's output channels),
_WINOGRAD_1D_MIN_CHANNEL_PAIRS = 2048
#: and this many blocks in the tile
_WINOGRAD_1D_MIN_BLOCKS = 256
#: a tile's samples are split over the task's cores (Conv2d._in_parts) only where each part has
#: at least this many flops of forward, except on the direct path (one compiled call a part).
#: Below that a part is mostly Python and short numba and BLAS calls, and the parts take turns
#: on the GIL: 16 samples of a 1x1 convolution (96 -> 24 channels at 3x3, 0.66 MFLOP) took 26 us
#: on one thread, but each of two parts took 48 us for its 8. Forward + backward on two cores,
#: one part against two: 117 against 282 us there, 255 against 331 us at 4.2 MFLOP (1x1, 32 ->
#: 64 at 8x8), 446 against 625 us at 4.7 (a Winograd 3x3, 16 -> 16 at 8x8), but 825 against
#: 682 us at 4.7 (a 3x3 on 2x2 images, whose im2col is many short numba loops); 1,031 against
#: 781 us at 12 MFLOP, 803 against 740 us at 18.9. The direct path's 3 -> 16 channels at 32x32
#: (8 samples, 7 MFLOP): 0.79 ms in one part, 0.58 in two
_PART_MIN_FLOPS = 4_000_000
#: the most input channels of a 3x3 stride-1 convolution that runs as direct convolution:
#: one core, forward + backward, direct over the batched im2col path: 3 channels (16 samples,
#: 32x32 -> 16) 0.65, 4 channels 0.67, 8 channels 0.94 of Winograd, 16 channels 2.95
_DIRECT_MAX_CHANNELS = 4
#: output tiles of at most this many pixels (and a kernel other than 1x1) run with all their
#: samples' columns side by side (Conv2d._batched): one GEMM a chunk where the per-sample ones
#: are thin, and no padded copies. Measured on one core, forward + backward, batch 8-32,
#: against im2col per sample: 0.7-0.8x its time for 3x3 from 8x8 to 32x32 (3 to 128 channels),
#: 0.9x for a 1x7 at 28x28, 1.0x for a 5x5 at 27x27 with 96 channels, 0.65x for a 3x3 at 56x56
#: with 3 channels but 1.6-2x at 64x64 and 112x112 with 3-4 (where a sample's columns fill a
#: chunk by themselves). Stride 2, on both cores: 0.63-0.96x for 3x3 reductions to 28x28,
#: 17x17, 14x14 and 7x7 (16 to 512 channels), 0.77x for a 5x5 on 3 channels to 32x32
_BATCHED_MAX_PIXELS = 32 * 32
#: batched tiles of at most this many output pixels make their columns through the window index
#: (_im2col_index_cpu, _col2im_index_cpu) rather than by runs of rows. One core, forward +
#: backward, against the runs: a 3x3 at 3x3 outputs (96 channels, 8 samples) 0.69x, a stride-2
#: 3x3 to 4x4 0.62x (measured before the index was cached), and where a window is one run of its
#: plane (stride 1, "same" width) 0.90-0.97x from 6x6 to 8x8 (a 5x5 at 7x7 0.91x)
_INDEX_MAX_PIXELS = 8 * 8
#: Winograd F(7, 2) over the phase rows of a strided convolution (ops/winograd_strided.py), where
#: its transforms and its GEMMs' shapes pay. Measured on two cores, forward + backward, 3x3
#: stride 2, against the batched path: 0.85-0.89x its time for 128 -> 128 channels from 56x56
#: (8 and 32 samples), 0.86x for 128 -> 64, 0.95x for 256 -> 256 from 28x28 with 16 samples; but
#: 1.09x for 64 -> 64 from 56x56, 1.38x for 32 -> 32, 1.49x for 256 -> 256 from 28x28 with 4
#: samples (112 blocks) and 1.9x for 512 -> 512 from 14x14 (7 outputs a row: one block, thin
#: GEMMs). So: at least this many (input channels x the tile's output channels),
_STRIDED_MIN_CHANNEL_PAIRS = 8192
#: this many blocks of 7 outputs in the tile,
_STRIDED_MIN_BLOCKS = 448
#: and the blocks' outputs at least this much used (17 outputs a row are 3 blocks, 21 outputs)
_STRIDED_MIN_USE = 0.9


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
            strided(out, i, j, stride, (oh, ow))[...] += cols[:, :, i, j]


@numba.njit(nogil=True, inline="always")
def _valid_outputs(j, stride, pad, out_n, size):
    """Outputs [lo, hi) along a dim whose window offset j reads inside [0, size): the o with
    0 <= o*stride - pad + j < size."""
    lo = max(0, -((j - pad) // stride))
    hi = min(out_n, (size - 1 + pad - j) // stride + 1)
    return lo, max(lo, hi)


# The kernels below copy (add) runs of a row: every stride-th entry of an input row along the
# width. Their loops index slices that end at the array's end with the loop counter alone: an
# index LLVM cannot prove non-negative keeps numba's wraparound check in the loop, and a
# strided branch inside the contiguous loop stops the vectorizing too (each 2-4x slower,
# measured); so the stride picks a loop per run, and stride 2, the reductions' stride, has one
# with the step a literal, which LLVM vectorizes as interleaved loads and stores (an im2col of
# ResNet's 3x3 stride-2 reduction, 16 samples of 128 channels at 56x56: 16 -> 10 ms; its
# col2im 16 -> 8.7 ms). Where the columns' rows are as long as the input's (stride 1, "same"
# padding: a sample's window offset (i, j) is its input plane shifted) a plane is one run.
@numba.njit(nogil=True, inline="never")
def _copy_run(dst, src, n):
    for k in range(n):
        dst[k] = src[k]


@numba.njit(nogil=True, inline="never")
def _add_run(dst, src, n):
    for k in range(n):
        dst[k] += src[k]


@numba.njit(nogil=True, inline="always")
def _gather_run(dst, src, n, step):
    """dst[k] = src[k * step] for k < n."""
    if step == 1:
        _copy_run(dst, src, n)
    elif step == 2:
        for k in range(n):
            dst[k] = src[2 * k]
    else:
        for k in range(n):
            dst[k] = src[step * k]


@numba.njit(nogil=True, inline="always")
def _scatter_add_run(dst, src, n, step):
    """dst[k * step] += src[k] for k < n."""
    if step == 1:
        _add_run(dst, src, n)
    elif step == 2:
        for k in range(n):
            dst[2 * k] += src[k]
    else:
        for k in range(n):
            dst[step * k] += src[k]


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


@numba.njit(nogil=True, inline="always")
def _plane_run(i, j, top, left, oh_lo, oh_hi, ow_lo, ow_, h_, w_):
    """(start in the flat input plane, length) of the one run that window offset (i, j) reads
    (or, in backward, adds to) when stride 1 and 'same' width make output rows follow input
    rows: from output (oh_lo, ow_lo) to the last valid one, clipped to the plane."""
    start = (oh_lo - top + i) * w_ + ow_lo - left + j
    return start, min((oh_hi - oh_lo) * ow_ - ow_lo, h_ * w_ - start)


@numba.njit(nogil=True, cache=True)
def _im2col_rows_cpu(x, kernel, stride, pads, cols):
    """cols[(c*KH + i)*KW + j, s, oh, ow] = x[s, c, oh*sh - top + i, ow*sw - left + j], 0 where
    that is outside x (the virtual padding); x [N, C, H, W] and cols C-contiguous."""
    n_, c_, h_, w_ = x.shape
    oh_, ow_ = cols.shape[2:]
    (kh, kw), (sh, sw), (top, left) = kernel, stride, pads
    zero = cols.dtype.type(0)
    planes = sh == 1 and sw == 1 and ow_ == w_
    xf = x.reshape(n_, c_, h_ * w_)
    cf = cols.reshape(cols.shape[0], n_, oh_ * ow_)
    for c in range(c_):
        for i in range(kh):
            oh_lo, oh_hi = _valid_outputs(i, sh, top, oh_, h_)
            for j in range(kw):
                ow_lo, ow_hi = _valid_outputs(j, sw, left, ow_, w_)
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
                        start, n = _plane_run(i, j, top, left, oh_lo, oh_hi, ow_lo, ow_, h_, w_)
                        _copy_run(dst[oh_lo * ow_ + ow_lo:], xf[s, c, start:], n)
                        _zero_edges(dst, oh_lo, oh_hi, ow_, ow_lo, ow_hi)
                        continue
                    for oh in range(oh_lo, oh_hi):
                        row = dst[oh * ow_:]
                        for ow in range(ow_lo):
                            row[ow] = zero
                        start = (oh * sh - top + i) * w_ + ow_lo * sw - left + j
                        _gather_run(row[ow_lo:], xf[s, c, start:], ow_hi - ow_lo, sw)
                        for ow in range(ow_hi, ow_):
                            row[ow] = zero


@numba.njit(nogil=True, cache=True)
def _col2im_rows_cpu(cols, kernel, stride, pads, dx):
    """dx[s, c, ih, iw] = the sum of cols[(c*KH + i)*KW + j, s, oh, ow] over the windows (oh, ow)
    and offsets (i, j) with ih = oh*sh - top + i and iw = ow*sw - left + j: the gradient of
    _im2col_rows_cpu, written into dx (no padded copy to crop). cols is overwritten: the
    entries of windows outside dx are zeroed, so that a plane's run adds zeros across rows."""
    n_, c_, h_, w_ = dx.shape
    oh_, ow_ = cols.shape[2:]
    (kh, kw), (sh, sw), (top, left) = kernel, stride, pads
    zero = dx.dtype.type(0)
    planes = sh == 1 and sw == 1 and ow_ == w_
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
                    ow_lo, ow_hi = _valid_outputs(j, sw, left, ow_, w_)
                    r = (c * kh + i) * kw + j
                    if oh_hi == oh_lo or ow_hi == ow_lo:
                        continue
                    if planes:
                        _zero_edges(cf[r, s], oh_lo, oh_hi, ow_, ow_lo, ow_hi)
                        start, n = _plane_run(i, j, top, left, oh_lo, oh_hi, ow_lo, ow_, h_, w_)
                        _add_run(out[start:], cf[r, s, oh_lo * ow_ + ow_lo:], n)
                        continue
                    for oh in range(oh_lo, oh_hi):
                        start = (oh * sh - top + i) * w_ + ow_lo * sw - left + j
                        _scatter_add_run(out[start:], cf[r, s, oh * ow_ + ow_lo:], ow_hi - ow_lo, sw)


@functools.lru_cache(maxsize=256)
def _window_index(kernel, stride, pads, in_hw, out_hw) -> np.ndarray:
    """[KH*KW, OH*OW]: the flat input position (ih * W + iw) that window offset (i, j) reads at
    output (oh, ow), -1 where that is in the padding. The same for every sample and channel, so
    made once per geometry (about 25 us: a tenth of a small convolution's forward and backward)."""
    (kh, kw), (sh, sw), (top, left), (h, w), (oh, ow) = kernel, stride, pads, in_hw, out_hw
    ih = (np.arange(oh) * sh)[None, :, None] - top + np.arange(kh)[:, None, None]   # [KH, OH, 1]
    iw = (np.arange(ow) * sw)[None, None, :] - left + np.arange(kw)[:, None, None]  # [KW, 1, OW]
    ih, iw = ih[:, None], iw[None]                                                   # [KH, 1, OH, 1], [1, KW, 1, OW]
    inside = (ih >= 0) & (ih < h) & (iw >= 0) & (iw < w)
    index = np.where(inside, ih * w + iw, -1).reshape(kh * kw, oh * ow).astype(np.int64)
    index.flags.writeable = False   # shared by every call of this geometry
    return index


# Small planes (the late layers of a tiny network: 3x3 to 8x8 outputs) have rows of a few
# entries, and the run kernels above spend their time on each run's bounds and calls. There a
# gather through the window index (_window_index) does im2col in one loop per row of columns,
# and a scatter-add through it col2im.
@numba.njit(nogil=True, inline="always")
def _index_views(planes, cols, index):
    """(planes [N, C, H*W], cols [C*KK, N, OH*OW]): flat views of the index kernels' image side (x
    or dx, [N, C, H, W]) and column side ([C*KK, N, OH, OW]), both C-contiguous."""
    n_, c_ = planes.shape[0], planes.shape[1]
    return (planes.reshape(n_, c_, planes.shape[2] * planes.shape[3]),
            cols.reshape(c_ * index.shape[0], n_, index.shape[1]))


@numba.njit(nogil=True, cache=True)
def _im2col_index_cpu(x, index, cols):
    """cols[c*KK + t, s, p] = x[s, c].flat[index[t, p]], 0 where index is -1."""
    xf, cf = _index_views(x, cols, index)
    n_, c_, (kk, npos) = x.shape[0], x.shape[1], index.shape
    zero = cols.dtype.type(0)
    for c in range(c_):
        for t in range(kk):
            where = index[t]
            for s in range(n_):
                src = xf[s, c]
                dst = cf[c * kk + t, s]
                for p in range(npos):
                    q = where[p]
                    dst[p] = src[q] if q >= 0 else zero


@numba.njit(nogil=True, cache=True)
def _col2im_index_cpu(cols, index, dx):
    """dx[s, c].flat[index[t, p]] summed over cols[c*KK + t, s, p] where index is not -1: the
    gradient of _im2col_index_cpu, written into dx."""
    df, cf = _index_views(dx, cols, index)
    n_, c_, (kk, npos) = dx.shape[0], dx.shape[1], index.shape
    zero = dx.dtype.type(0)
    for s in range(n_):
        for c in range(c_):
            out = df[s, c]
            for k in range(out.shape[0]):
                out[k] = zero
            for t in range(kk):
                where = index[t]
                src = cf[c * kk + t, s]
                for p in range(npos):
                    q = where[p]
                    if q >= 0:
                        out[q] += src[p]


@numba.njit(nogil=True, inline="always")
def _scatter_run(dst, src, n, step):
    """dst[k * step] = src[k] for k < n."""
    if step == 1:
        _copy_run(dst, src, n)
    elif step == 2:
        for k in range(n):
            dst[2 * k] = src[k]
    else:
        for k in range(n):
            dst[step * k] = src[k]


# Strides over 1 (the reductions): a window offset reads every stride-th input entry, runs of
# gathers a row. Split by their positions modulo the stride, x's planes become sh x sw phase
# planes, and window offset (i, j) reads one of them shifted: a stride-1 read, so each output
# row is one contiguous run, and where the phase planes are as wide as the output rows (ResNet's
# reductions) all of it is one, as for stride 1 with 'same' padding. One sample of ResNet's 3x3
# reduction (128 channels, 56x56 -> 28x28), one core: im2col 0.89-1.2 -> 0.50-0.55 ms, the
# split included; col2im 1.14-1.43 -> 0.49-0.66 ms.
@numba.njit(nogil=True, inline="always")
def _phase_shift(i, pad, stride):
    """(phase, shift) of window offset i along a dim: input index o*stride - pad + i is index
    o + shift of phase plane `phase` (the shift may be negative)."""
    d = i - pad
    return d % stride, d // stride


@numba.njit(nogil=True, cache=True)
def _split_phases_cpu(x, phases):
    """phases[s, c, pi, pj, r, q] = x[s, c, pi + r*sh, pj + q*sw], 0 where that is beyond x
    (phases [N, C, sh, sw, ceil(H / sh), ceil(W / sw)]). Width stride 2 splits a row into its
    two phases in one pass (one sample of ResNet's 3x3 reduction, 128 channels at 56x56: 0.30 ->
    0.19-0.24 ms against a gather per phase)."""
    n_, c_, h_, w_ = x.shape
    sh, sw, hp, wp = phases.shape[2:]
    zero = phases.dtype.type(0)
    for s in range(n_):
        for c in range(c_):
            for pi in range(sh):
                for r in range(hp):
                    ih = pi + r * sh
                    if ih >= h_:
                        for pj in range(sw):
                            row = phases[s, c, pi, pj, r]
                            for q in range(wp):
                                row[q] = zero
                        continue
                    src = x[s, c, ih]
                    if sw == 2:
                        even, odd = phases[s, c, pi, 0, r], phases[s, c, pi, 1, r]
                        done = w_ // 2
                        for q in range(done):
                            even[q] = src[2 * q]
                            odd[q] = src[2 * q + 1]
                        if w_ % 2:
                            even[done] = src[w_ - 1]
                            odd[done] = zero
                            done += 1
                        for q in range(done, wp):
                            even[q] = zero
                            odd[q] = zero
                        continue
                    for pj in range(sw):
                        row = phases[s, c, pi, pj, r]
                        n_q = (w_ - pj + sw - 1) // sw if pj < w_ else 0
                        _gather_run(row, src[pj:], n_q, sw)
                        for q in range(n_q, wp):
                            row[q] = zero


@numba.njit(nogil=True, cache=True)
def _merge_phases_cpu(phases, dx):
    """dx[s, c, pi + r*sh, pj + q*sw] = phases[s, c, pi, pj, r, q] at every position of dx: the
    inverse of _split_phases_cpu."""
    n_, c_, h_, w_ = dx.shape
    sh, sw = phases.shape[2:4]
    for s in range(n_):
        for c in range(c_):
            for pi in range(min(sh, h_)):
                for pj in range(min(sw, w_)):
                    plane = phases[s, c, pi, pj]
                    n_q = (w_ - pj + sw - 1) // sw
                    for r in range((h_ - pi + sh - 1) // sh):
                        _scatter_run(dx[s, c, pi + r * sh, pj:], plane[r], n_q, sw)


@numba.njit(nogil=True, cache=True)
def _im2col_phases_cpu(x, kernel, pads, cols, phases):
    """_im2col_rows_cpu for strides over 1, through x's phase planes (made in `phases`, whose
    shape gives the stride). Its per-offset steps are the row kernel's, written out in both: one
    shared helper made the row kernel's im2col 3-19% slower (interleaved A/B, four shapes),
    inlined or not."""
    n_ = x.shape[0]
    c_, sh, sw, hp, wp = phases.shape[1:]
    oh_, ow_ = cols.shape[2:]
    (kh, kw), (top, left) = kernel, pads
    zero = cols.dtype.type(0)
    _split_phases_cpu(x, phases)
    planes = ow_ == wp
    pf = phases.reshape(n_, c_, sh, sw, hp * wp)
    cf = cols.reshape(cols.shape[0], n_, oh_ * ow_)
    for c in range(c_):
        for i in range(kh):
            pi, di = _phase_shift(i, top, sh)
            oh_lo, oh_hi = _valid_outputs(di, 1, 0, oh_, hp)
            for j in range(kw):
                pj, dj = _phase_shift(j, left, sw)
                ow_lo, ow_hi = _valid_outputs(dj, 1, 0, ow_, wp)
                r = (c * kh + i) * kw + j
                for s in range(n_):
                    dst, src = cf[r, s], pf[s, c, pi, pj]
                    for k in range(oh_lo * ow_):
                        dst[k] = zero
                    for k in range(oh_hi * ow_, oh_ * ow_):
                        dst[k] = zero
                    if oh_hi == oh_lo or ow_hi == ow_lo:
                        for k in range(oh_lo * ow_, oh_hi * ow_):
                            dst[k] = zero
                        continue
                    if planes:
                        start, n = _plane_run(di, dj, 0, 0, oh_lo, oh_hi, ow_lo, ow_, hp, wp)
                        _copy_run(dst[oh_lo * ow_ + ow_lo:], src[start:], n)
                        _zero_edges(dst, oh_lo, oh_hi, ow_, ow_lo, ow_hi)
                        continue
                    for oh in range(oh_lo, oh_hi):
                        row = dst[oh * ow_:]
                        for ow in range(ow_lo):
                            row[ow] = zero
                        _copy_run(row[ow_lo:], src[(oh + di) * wp + ow_lo + dj:], ow_hi - ow_lo)
                        for ow in range(ow_hi, ow_):
                            row[ow] = zero


@numba.njit(nogil=True, cache=True)
def _col2im_phases_cpu(cols, kernel, pads, dx, phases):
    """_col2im_rows_cpu for strides over 1: the columns' runs added into phase planes (in
    `phases`, zeroed first; their shape gives the stride), which are then merged into dx. cols is
    overwritten as there."""
    n_, c_ = dx.shape[:2]
    sh, sw, hp, wp = phases.shape[2:]
    oh_, ow_ = cols.shape[2:]
    (kh, kw), (top, left) = kernel, pads
    zero = dx.dtype.type(0)
    planes = ow_ == wp
    pf = phases.reshape(n_, c_, sh, sw, hp * wp)
    cf = cols.reshape(cols.shape[0], n_, oh_ * ow_)
    for s in range(n_):
        for c in range(c_):
            for pi in range(sh):
                for pj in range(sw):
                    plane = pf[s, c, pi, pj]
                    for k in range(hp * wp):
                        plane[k] = zero
            for i in range(kh):
                pi, di = _phase_shift(i, top, sh)
                oh_lo, oh_hi = _valid_outputs(di, 1, 0, oh_, hp)
                for j in range(kw):
                    pj, dj = _phase_shift(j, left, sw)
                    ow_lo, ow_hi = _valid_outputs(dj, 1, 0, ow_, wp)
                    r = (c * kh + i) * kw + j
                    if oh_hi == oh_lo or ow_hi == ow_lo:
                        continue
                    plane = pf[s, c, pi, pj]
                    if planes:
                        _zero_edges(cf[r, s], oh_lo, oh_hi, ow_, ow_lo, ow_hi)
                        start, n = _plane_run(di, dj, 0, 0, oh_lo, oh_hi, ow_lo, ow_, hp, wp)
                        _add_run(plane[start:], cf[r, s, oh_lo * ow_ + ow_lo:], n)
                        continue
                    for oh in range(oh_lo, oh_hi):
                        _add_run(plane[(oh + di) * wp + ow_lo + dj:], cf[r, s, oh * ow_ + ow_lo:], ow_hi - ow_lo)
    _merge_phases_cpu(phases, dx)


def _bias_grad(xp, dy):
    """dy [N, C, H, W] summed over all but C: each sample's pixels as a matrix-vector product,
    then the samples (BLAS's matrix-vector product is 3x numpy's sum over axes (0, 2, 3))."""
    n, c = dy.shape[:2]
    return (dy.reshape(n, c, -1) @ xp.ones(dy.shape[2] * dy.shape[3], dy.dtype)).sum(axis=0)


def _summed(values: list):
    """The sum of the parts' gradients; one part's as it is (sum() starts with 0 + it: a pass more)."""
    return values[0] if len(values) == 1 else sum(values)


def _group_gemms(xp, pairs):
    """[a @ b for each (a, b) pair] as one [G, m, n] array, each written in place by a cuBLAS call
    (ops/cuda_kernels.py gemm; stacking products made a copy and a launch more a group)."""
    first, second = pairs[0]
    out = xp.empty((len(pairs), first.shape[0], second.shape[1]), first.dtype)
    for g, (a, b) in enumerate(pairs):
        cuda_kernels.gemm(a, b, out[g])
    return out


def _chunks(xp, n: int, bytes_per_sample: int):
    """Sample ranges for im2col: on the CPU as few batches of at most _CHUNK_BYTES as there can
    be, of even sizes, the largest first (the kernels size their scratch by the first): 16
    samples that fit 14 a chunk go as 8 + 8, not 14 + 2, whose second GEMM is a sliver;
    everything at once on a GPU."""
    step = max(1, _CHUNK_BYTES // max(1, bytes_per_sample)) if xp is np else n
    parts = -(-n // step)
    size, extra = divmod(n, parts)  # the first `extra` chunks take one sample more
    cuts = [i * size + min(i, extra) for i in range(parts + 1)]
    return list(zip(cuts, cuts[1:]))


@register_op
class Conv2d(Op):
    """PyTorch's nn.Conv2d (dilation 1). Splits: batch, out channels, height, width."""

    kind = "conv2d"
    float_inputs = True
    writes_out = True

    def __init__(self, name, inputs, out_channels: int, kernel, stride=1, padding=0, groups: int = 1,
                 use_bias: bool = True):
        k = self.kind
        super().__init__(name, inputs, out_channels=int_attr(k, name, "out_channels", out_channels),
                         kernel=pair(k, name, "kernel", kernel, 1), stride=pair(k, name, "stride", stride, 1),
                         padding=pair(k, name, "padding", padding, 0), groups=int_attr(k, name, "groups", groups),
                         use_bias=bool_attr(k, name, "use_bias", use_bias))

    def infer_shapes(self, in_shapes):
        if len(in_shapes) != 1:
            raise self.fail(f"takes 1 input, got {len(in_shapes)}")
        (shape,) = in_shapes
        out_hw = check_window(self, shape, self.kernel, self.stride, self.padding)
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
        hs = span(tile.lo[2], tile.hi[2], self.stride[0], self.kernel[0], self.padding[0], h, self.tile_shape[2])
        ws = span(tile.lo[3], tile.hi[3], self.stride[1], self.kernel[1], self.padding[1], w, self.tile_shape[3])
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
        """How a tile runs: "direct" (see _direct), "winograd" (see _winograd), "winograd_1d" (see
        _winograd_1d), "winograd_strided" (see _winograd_strided), "batched" (see _batched), "gemm"
        (on a GPU, see _forward_gemm) or "columns": im2col per sample and one batched matmul per
        chunk (_forward_columns). A 1x1 stride-1 convolution on a GPU takes "columns", whose
        columns are the input itself: on an H200 the "gemm" path's im2col, transposes and col2im
        made it 1.7x PyTorch's, "columns" 0.97x."""
        if (cuda_kernels.on_gpu(xp) and np.dtype(self.inputs[0].dtype) in (np.float32, np.float64)
                and (self.kernel, self.stride) != ((1, 1), (1, 1))):
            return "gemm"
        if self._direct(xp):
            return "direct"
        if self._winograd(xp, tile):
            return "winograd"
        if self._winograd_1d(xp, tile):
            return "winograd_1d"
        if self._winograd_strided(xp, tile):
            return "winograd_strided"
        return "batched" if self._batched(xp, tile) else "columns"

    def _direct(self, xp) -> bool:
        """Whether tiles run as direct convolution (ops/direct_conv.py): 3x3 stride-1 convolutions
        of one group on the CPU with at most _DIRECT_MAX_CHANNELS input channels (a first layer),
        whose im2col columns would be mostly copies."""
        return (xp is np and self.kernel == (3, 3) and self.stride == (1, 1) and self.groups == 1
                and self.inputs[0].shape[1] <= _DIRECT_MAX_CHANNELS)

    def _winograd(self, xp, tile: Rect) -> bool:
        """Whether a tile runs as Winograd F(4x4, 3x3) (ops/winograd.py): 3x3 stride-1 convolutions
        of one group on the CPU, with enough channels and blocks for its transforms to pay."""
        if not (xp is np and self.kernel == (3, 3) and self.stride == (1, 1) and self.groups == 1):
            return False
        n, oct_, oh, ow = tile.shape
        c = self.inputs[0].shape[1]
        th, tw = winograd.blocks((oh, ow))
        return (c >= _WINOGRAD_MIN_CHANNELS and c * oct_ >= _WINOGRAD_MIN_CHANNEL_PAIRS
                and n * th * tw >= _WINOGRAD_MIN_BLOCKS)

    def _winograd_1d(self, xp, tile: Rect) -> bool:
        """Whether a tile runs as Winograd along one axis (ops/winograd_1d.py): 1xr and rx1
        stride-1 convolutions of one group on the CPU, not padded across their axis, with an r
        the module has, and enough channels and blocks."""
        kh, kw = self.kernel
        if not (xp is np and self.stride == (1, 1) and self.groups == 1 and 1 in (kh, kw)):
            return False
        r, across = (kw, self.padding[0]) if kh == 1 else (kh, self.padding[1])
        if across != 0 or not winograd_1d.supports(r):
            return False
        n, oct_, oh, ow = tile.shape
        length, rows = (ow, oh) if kh == 1 else (oh, ow)
        c = self.inputs[0].shape[1]
        return (c >= _WINOGRAD_1D_MIN_CHANNELS and c * oct_ >= _WINOGRAD_1D_MIN_CHANNEL_PAIRS
                and n * rows * winograd_1d.blocks(length, r) >= _WINOGRAD_1D_MIN_BLOCKS)

    def _winograd_strided(self, xp, tile: Rect) -> bool:
        """Whether a tile runs as Winograd F(7, 2) along the width over its phase rows
        (ops/winograd_strided.py): strided convolutions of one group on the CPU whose window
        columns span two shifts of a phase (3 wide at stride 2), with enough channels and
        blocks, and output rows that fill their blocks."""
        if not (xp is np and self.groups == 1 and winograd_strided.supports(self.kernel, self.stride)):
            return False
        n, oct_, oh, ow = tile.shape
        t = -(-ow // winograd_strided.M)
        return (self.inputs[0].shape[1] * oct_ >= _STRIDED_MIN_CHANNEL_PAIRS and n * oh * t >= _STRIDED_MIN_BLOCKS
                and ow >= _STRIDED_MIN_USE * winograd_strided.M * t)

    def _along(self, a):
        """A 1xr or rx1 convolution's image `a` [N, C, H, W] with the convolved axis last (a view)."""
        return a if self.kernel[0] == 1 else a.swapaxes(2, 3)

    def _along_pads(self, pads) -> tuple[int, int]:
        """(r, the virtual padding before the convolved axis) of a 1xr or rx1 convolution."""
        return (self.kernel[1], pads[1][0]) if self.kernel[0] == 1 else (self.kernel[0], pads[0][0])

    @staticmethod
    def _filters_1d(w):
        """winograd_1d's transform of the weights [OC, C, 1, r] or [OC, C, r, 1]."""
        return winograd_1d.filter_transform(w.reshape(*w.shape[:2], -1))

    def _filters_strided(self, w, pads, channels_last: bool = False):
        """winograd_strided's transform of the weights, stacked for the tile's left padding."""
        g = winograd_strided.stacked_filters(w, self.stride, pads[1][0])
        return winograd_strided.filter_transform(g, channels_last)

    def _pads(self, tile: Rect, in_rect: Rect):
        """The tile's virtual padding ((top, bottom), (left, right)) of its input rect."""
        return window_geometry(tile, in_rect, self.kernel, self.stride, self.padding)

    def _column_chunks(self, xp, tile: Rect, xpad):
        """Yield (a, b, cols): the im2col matrix [b-a, G, K/G, OH*OW] of samples [a, b) of xpad, in
        one reused buffer; for a 1x1 kernel the (strided) input itself, all samples at once."""
        n, (oh, ow) = xpad.shape[0], tile.shape[2:]
        ng = self._layout(tile)[0]
        if self.kernel == (1, 1):
            cols = xp.ascontiguousarray(strided(xpad, 0, 0, self.stride, (oh, ow)))
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
        the CPU, for tiles of at most _BATCHED_MAX_PIXELS output pixels and kernels other than 1x1
        (whose columns are the input itself)."""
        return xp is np and self.kernel != (1, 1) and tile.shape[2] * tile.shape[3] <= _BATCHED_MAX_PIXELS

    def _phased(self) -> bool:
        """Whether the batched path's im2col goes through phase planes (_im2col_phases_cpu): for
        strides over 1 whose windows overlap, where a plane split costs less than the gathers it
        saves."""
        (kh, kw), (sh, sw) = self.kernel, self.stride
        return (sh > 1 or sw > 1) and kh * kw > sh * sw

    def _index_of(self, tile: Rect, x, pads) -> np.ndarray | None:
        """The window index of a batched tile of at most _INDEX_MAX_PIXELS outputs (its im2col and
        col2im go through it), else None."""
        out_hw = tuple(tile.shape[2:])
        if out_hw[0] * out_hw[1] > _INDEX_MAX_PIXELS:
            return None
        return _window_index(self.kernel, self.stride, (pads[0][0], pads[1][0]), x.shape[2:], out_hw)

    def _sample_columns(self, tile: Rect, x, pads, index):
        """Yield (a, b, cols, phases): the im2col matrix [K, (b-a)*OH*OW] of samples [a, b) of the
        unpadded input tile x, the samples side by side in the column index, in one reused
        buffer, and the phase planes' scratch that made it (None for stride 1 and where `index`,
        the tile's window index from _index_of or None, makes the columns; col2im reuses it)."""
        n, c, h, w = x.shape
        oh, ow = tile.shape[2:]
        k = c * self.kernel[0] * self.kernel[1]
        chunks = _chunks(np, n, k * oh * ow * x.itemsize)
        most = chunks[0][1] - chunks[0][0]
        buf = np.empty(k * most * oh * ow, x.dtype)
        x = np.ascontiguousarray(x)
        top_left = (pads[0][0], pads[1][0])
        phased = index is None and self._phased()
        if phased:
            sh, sw = self.stride
            plane = (sh, sw, -(-h // sh), -(-w // sw))
            phase_buf = np.empty(most * c * math.prod(plane), x.dtype)
        for a, b in chunks:
            cols = buf[:k * (b - a) * oh * ow].reshape(k, b - a, oh, ow)
            phases = None
            if index is not None:
                _im2col_index_cpu(x[a:b], index, cols)
            elif phased:
                phases = phase_buf[:(b - a) * c * math.prod(plane)].reshape(b - a, c, *plane)
                _im2col_phases_cpu(x[a:b], self.kernel, top_left, cols, phases)
            else:
                _im2col_rows_cpu(x[a:b], self.kernel, self.stride, top_left, cols)
            yield a, b, cols.reshape(k, -1), phases

    def _forward_batched(self, tile, x, pads, w, bias, y) -> None:
        """y [N, OCt, OH*OW] as one GEMM per group and chunk of samples, the weight rows times the
        chunk's columns [K, n*OH*OW], transposed into y with the bias (if not None) added."""
        oct_, oh, ow = tile.shape[1:]
        ng, ocpg, off = self._layout(tile)
        wg = self._grouped(np, w.reshape(oct_, -1), tile)
        out = None
        for a, b, cols, _ in self._sample_columns(tile, x, pads, self._index_of(tile, x, pads)):
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
        index = self._index_of(tile, x, pads)
        dyt_buf = None
        for a, b, cols, phases in self._sample_columns(tile, x, pads, index):
            m = b - a
            dyt_buf = np.empty(oct_ * m * oh * ow, x.dtype) if dyt_buf is None else dyt_buf
            dyt = dyt_buf[:oct_ * m * oh * ow].reshape(oct_, m, oh, ow)
            np.copyto(dyt, dy[a:b].transpose(1, 0, 2, 3))
            dyg = self._grouped(np, dyt.reshape(oct_, -1), tile)
            colsg = cols.reshape(ng, -1, cols.shape[1])
            gw += np.matmul(dyg, colsg.swapaxes(-1, -2))
            if dx is None:
                continue
            np.matmul(wg_t, dyg, out=colsg)
            if index is not None:
                _col2im_index_cpu(cols.reshape(-1, m, oh, ow), index, dx[a:b])
            elif phases is None:
                _col2im_rows_cpu(cols.reshape(-1, m, oh, ow), self.kernel, self.stride, top_left, dx[a:b])
            else:
                _col2im_phases_cpu(cols.reshape(-1, m, oh, ow), self.kernel, top_left, dx[a:b], phases)
        return gw.reshape(ng * ocpg, -1)[off:off + oct_].reshape(w.shape)

    @staticmethod
    def _on_one_blas_thread(fn, *args, **kwargs):
        """fn(*args, **kwargs) with BLAS on one thread: for the small GEMMs of Winograd's filter
        transforms, done once for all the parts (BLAS's own threads would spin on in the cores
        the parts take)."""
        with cpu_pool.blas_on_one_thread():
            return fn(*args, **kwargs)

    def _most_parts(self, tile: Rect) -> int:
        """How many parts a tile's samples may be cut into off the direct path: each has at least
        _PART_MIN_FLOPS of forward."""
        return max(1, self.flops(tile) // _PART_MIN_FLOPS)

    def _in_parts(self, xp, work, tile: Rect) -> list:
        """work(a, b) over the tile's samples: on the CPU in parts, one per core of the task
        (ops/cpu_pool.py) with at least _PART_MIN_FLOPS each; on a GPU all at once."""
        n = tile.shape[0]
        if xp is not np:
            return [work(0, n)]
        return cpu_pool.in_parts(work, n, most=self._most_parts(tile))

    def forward(self, xp, tile, inputs, in_rects, weights, training=True, state=None, out=None):
        (x,), w = inputs, weights["weight"]
        n, oct_, oh, ow = tile.shape
        pads = self._pads(tile, in_rects[0])
        given = given_out(out, 0)[0]
        y = xp.empty((n, oct_, oh * ow), x.dtype) if given is None else given.reshape(n, oct_, oh * ow)
        path, bias = self._path(xp, tile), weights["bias"] if self.use_bias else None
        ut = self._on_one_blas_thread(self._filters_1d, w) if path == "winograd_1d" else None
        r, left = self._along_pads(pads)
        us = self._on_one_blas_thread(self._filters_strided, w, pads, True) if path == "winograd_strided" else None
        direct_bias = (np.zeros(oct_, x.dtype) if bias is None else bias) if path == "direct" else None

        def samples(a, b):
            if path == "winograd_1d":
                winograd_1d.forward(self._along(x[a:b]), r, left, self._along(y[a:b].reshape(b - a, oct_, oh, ow)),
                                    bias, ut)
            elif path == "winograd_strided":
                winograd_strided.forward(x[a:b], self.kernel, self.stride, (pads[0][0], pads[1][0]),
                                         y[a:b].reshape(b - a, oct_, oh, ow), bias, us)
            elif path == "batched":
                self._forward_batched(tile, x[a:b], pads, w, bias, y[a:b])
            else:
                self._forward_columns(xp, tile, pad(xp, x[a:b], pads), w, y[a:b])
        if path == "gemm":
            self._forward_gemm(xp, tile, x, pads, w, y)
        elif path == "winograd":  # (these two run their parts in one compiled call)
            winograd.forward(x, w, (pads[0][0], pads[1][0]), y.reshape(n, oct_, oh, ow), bias, self._most_parts(tile))
        elif path == "direct":
            direct_conv.forward_in_parts(x, w, direct_bias, pads[0][0], pads[1][0], y.reshape(n, oct_, oh, ow))
        else:
            self._in_parts(xp, samples, tile)
        if bias is not None and path in ("columns", "gemm"):
            y += bias[:, None]
        return [y.reshape(n, oct_, oh, ow) if given is None else given], None

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

    def _forward_gemm(self, xp, tile, x, pads, w, y) -> None:
        """y [N, OCt, OH*OW] as one GEMM (one per group) over the columns of all samples side
        by side (ops/cuda_kernels.py, from the unpadded tile): the weight rows times [K, N*OH*OW]."""
        n, oct_, oh, ow = tile.shape
        ng, ocpg, off = self._layout(tile)
        corner = (pads[0][0], pads[1][0])
        cols = cuda_kernels.im2col(x, self.kernel, self.stride, corner, (oh, ow)).reshape(ng, -1, n * oh * ow)
        yt = xp.matmul(self._grouped(xp, w.reshape(oct_, -1), tile), cols)  # [G, OC/G, N*OH*OW]
        y[...] = yt.reshape(ng * ocpg, n, oh * ow)[off:off + oct_].transpose(1, 0, 2)

    def _backward_gemm(self, xp, tile, x, pads, w, dy, dx):
        """dw, and dx written, as GEMMs over the columns of all samples side by side: dw = dy^T
        times the columns' transpose, the columns' gradient = the weight rows' transpose times dy^T,
        gathered into dx by col2im."""
        n, (oct_, oh, ow) = x.shape[0], tile.shape[1:]
        ng, ocpg, off = self._layout(tile)
        corner = (pads[0][0], pads[1][0])
        cols = cuda_kernels.im2col(x, self.kernel, self.stride, corner, (oh, ow)).reshape(ng, -1, n * oh * ow)
        dyt = xp.ascontiguousarray(dy.reshape(n, oct_, oh * ow).transpose(1, 0, 2)).reshape(oct_, n * oh * ow)
        dyg = self._grouped(xp, dyt, tile)   # [G, OC/G, N*OH*OW]
        gw = _group_gemms(xp, [(dyg[g], cols[g].T) for g in range(ng)])
        if dx is not None:
            wg = self._grouped(xp, w.reshape(oct_, -1), tile)
            dcols = _group_gemms(xp, [(wg[g].T, dyg[g]) for g in range(ng)])
            cuda_kernels.col2im(dcols, self.kernel, self.stride, corner, (oh, ow), dx)
        return gw.reshape(ng * ocpg, -1)[off:off + oct_].reshape(w.shape)

    def backward_reads(self):
        return (True,), (False,)   # x for the weight's gradient; y is not needed

    def backward(self, xp, tile, inputs, in_rects, weights, outputs, grad_outputs, saved, out=None):
        (x,), w, dy = inputs, weights["weight"], grad_outputs[0]
        pads = self._pads(tile, in_rects[0])
        given, wanted = given_out(out, 0)
        dx = None if not wanted else xp.empty(x.shape, x.dtype) if given is None else given
        path = self._path(xp, tile)
        # Winograd's parts share the transformed filters and add their gradients, turned into dw once
        u = self._on_one_blas_thread(self._filters_1d, w) if path == "winograd_1d" else None
        r, left = self._along_pads(pads)
        us = self._on_one_blas_thread(self._filters_strided, w, pads) if path == "winograd_strided" else None

        def samples(a, b):
            """(the weight's gradient, the bias's) over samples a..b-1, dx's rows written."""
            dx_ab = None if dx is None else dx[a:b]  # None: no one reads dx (the model's input)
            gb = _bias_grad(xp, dy[a:b]) if self.use_bias else 0
            if path == "winograd_1d":
                return winograd_1d.transformed_backward(self._along(x[a:b]), r, left, u, self._along(dy[a:b]),
                                                        None if dx_ab is None else self._along(dx_ab)), gb
            if path == "winograd_strided":
                return winograd_strided.transformed_backward(x[a:b], self.kernel, self.stride, (pads[0][0], pads[1][0]),
                                                             us, dy[a:b], dx_ab), gb
            if path == "batched":
                return self._backward_batched(tile, x[a:b], pads, w, dy[a:b], dx_ab), gb
            if path == "gemm":
                return self._backward_gemm(xp, tile, x[a:b], pads, w, dy[a:b], dx_ab), gb
            return self._backward_columns(xp, tile, x[a:b], pads, w, dy[a:b], dx_ab), gb
        if path in ("winograd", "direct"):  # (these two run their parts in one compiled call)
            gw = (winograd.backward(x, w, dy, (pads[0][0], pads[1][0]), dx, self._most_parts(tile))
                  if path == "winograd" else
                  direct_conv.backward_in_parts(x, w, dy, pads[0][0], pads[1][0], dx))
            parts = [(gw, self._on_one_blas_thread(_bias_grad, xp, dy) if self.use_bias else 0)]
        else:
            parts = self._in_parts(xp, samples, tile)
        gw = _summed([g for g, _ in parts])
        if path == "winograd_1d":
            gw = self._on_one_blas_thread(winograd_1d.filter_gradient, gw, r).reshape(w.shape)
        if path == "winograd_strided":
            gw = winograd_strided.filters_of_stacked(self._on_one_blas_thread(winograd_strided.filter_gradient, gw),
                                                     w.shape, self.stride, pads[1][0])
        grads = {"weight": gw}
        if self.use_bias:   # (summed in the parts: a threaded BLAS call here would leave OpenBLAS's threads spinning)
            grads["bias"] = _summed([gb for _, gb in parts])
        return [dx], grads

    def _backward_columns(self, xp, tile, x, pads, w, dy, dx):
        """dw, and dx written, through the columns: dw sums dy times each sample's columns, and
        the columns' gradient (weight rows times dy) goes back into the input (col2im; for a 1x1
        stride-1 kernel on an unpadded tile it is the input gradient itself)."""
        n, (oct_, oh, ow) = x.shape[0], tile.shape[1:]
        ng, ocpg, off = self._layout(tile)
        xpad = pad(xp, x, pads)
        wg_t = self._grouped(xp, w.reshape(oct_, -1), tile).swapaxes(-1, -2)
        dyg = self._grouped(xp, xp.ascontiguousarray(dy).reshape(n, oct_, oh * ow), tile)
        gw = xp.zeros((ng, ocpg, w[0].size), x.dtype)
        direct = self.kernel == (1, 1) and self.stride == (1, 1) and xpad is x
        dxpad = dx if direct or dx is None else xp.zeros(xpad.shape, x.dtype)
        dcols = None
        for a, b, cols in self._column_chunks(xp, tile, xpad):
            gw += xp.matmul(dyg[a:b], cols.swapaxes(-1, -2)).sum(axis=0)
            if dx is None:
                continue
            if direct:
                xp.matmul(wg_t, dyg[a:b], out=dxpad[a:b].reshape(cols.shape))
                continue
            dcols = xp.empty_like(cols) if dcols is None else dcols[:b - a]
            xp.matmul(wg_t, dyg[a:b], out=dcols)
            col2im(xp, dcols.reshape(b - a, x.shape[1], *self.kernel, oh, ow), self.stride, dxpad[a:b])
        if not direct and dx is not None:
            (top, _), (left, _) = pads
            dx[...] = dxpad[:, :, top:top + x.shape[2], left:left + x.shape[3]]
        return gw.reshape(ng * ocpg, -1)[off:off + oct_].reshape(w.shape)
