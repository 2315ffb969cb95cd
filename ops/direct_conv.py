"""Direct convolution on the CPU for few input taps: a network's first layer (3 channels, 3x3).

With C * KH * KW small, im2col's columns are larger than the input by that factor, the GEMMs
over them are skinny (16 x 27 by pixels), and a part of the batch makes many short calls
(im2col, GEMMs, transposes, col2im), between which two parts on two threads hand the
interpreter back and forth: on the 2-core VM the two parts together took as long as one
after the other. Here a sample's input is padded once, and its output planes are kept as
wide as the padded input (the last KW - 1 columns of each row are scratch). Every tap
(c, i, j) of the window is then one scaled add of the whole padded plane, shifted by i rows
and j columns, into the output plane: one long vectorized loop, with both planes in L1;
3x3 windows take their nine taps in one pass, and the forward two output channels a pass.
The backward pass reads the same runs the other way: the weight gradient is a dot product
of the two planes per tap, and the input gradient the correlation of the output gradient's
wide plane (zero margins, zero scratch columns) with the flipped window.

A part's forward, and its backward, are each one compiled call that holds no GIL. Stride 1
and one group only; `top` and `left` are the tile's virtual padding, the bottom and right
follow from the shapes.
"""
from __future__ import annotations

import functools

import numba
import numpy as np

from ops.cpu_threads import batch_parts
from ops.per_float import array, compile_per_float


@numba.njit(nogil=True, inline="never", fastmath=True)
def _axpy(dst, src, a, n):
    """dst[:n] += a * src[:n]."""
    for k in range(n):
        dst[k] += a * src[k]


@numba.njit(nogil=True, inline="always")
def _taps(a):
    """The nine taps of a 3x3 window, row by row, as scalars (kept in registers)."""
    return a[0, 0], a[0, 1], a[0, 2], a[1, 0], a[1, 1], a[1, 2], a[2, 0], a[2, 1], a[2, 2]


@numba.njit(nogil=True, inline="never", fastmath=True)
def _axpy3x3(dst, src, wp, a, n):
    """dst[:n] += the 3x3 taps a [3, 3] of src, row i shifted by i * wp and column j by j: nine
    multiply-adds for each load and store of dst."""
    a00, a01, a02, a10, a11, a12, a20, a21, a22 = _taps(a)
    r1 = src[wp:]
    r2 = src[2 * wp:]
    for k in range(n):
        dst[k] += (a00 * src[k] + a01 * src[k + 1] + a02 * src[k + 2]
                   + a10 * r1[k] + a11 * r1[k + 1] + a12 * r1[k + 2]
                   + a20 * r2[k] + a21 * r2[k + 1] + a22 * r2[k + 2])


@numba.njit(nogil=True, inline="never", fastmath=True)
def _axpy3x3_pair(dst, dst2, src, wp, a, b, n):
    """_axpy3x3 into two planes at once (taps a into dst, b into dst2): each load of src serves both."""
    a00, a01, a02, a10, a11, a12, a20, a21, a22 = _taps(a)
    b00, b01, b02, b10, b11, b12, b20, b21, b22 = _taps(b)
    r1 = src[wp:]
    r2 = src[2 * wp:]
    for k in range(n):
        x00, x01, x02 = src[k], src[k + 1], src[k + 2]
        x10, x11, x12 = r1[k], r1[k + 1], r1[k + 2]
        x20, x21, x22 = r2[k], r2[k + 1], r2[k + 2]
        dst[k] += (a00 * x00 + a01 * x01 + a02 * x02 + a10 * x10 + a11 * x11 + a12 * x12
                   + a20 * x20 + a21 * x21 + a22 * x22)
        dst2[k] += (b00 * x00 + b01 * x01 + b02 * x02 + b10 * x10 + b11 * x11 + b12 * x12
                    + b20 * x20 + b21 * x21 + b22 * x22)


@numba.njit(nogil=True, inline="always")
def _correlate_add(dst, src, wp, taps, n):
    """dst[:n] += the correlation of src (rows wp apart) with the window taps [KH, KW]: 3x3 in
    one pass, any other window a scaled add per tap."""
    kh, kw = taps.shape
    if kh == 3 and kw == 3:
        _axpy3x3(dst, src, wp, taps, n)
        return
    for i in range(kh):
        for j in range(kw):
            _axpy(dst, src[i * wp + j:], taps[i, j], n)


@numba.njit(nogil=True, inline="never", fastmath=True)
def _dots3x3(g, src, wp, n, out):
    """out[i, j] += the dot product of g[:n] with src shifted by i rows and j columns (the
    3x3 taps' weight gradients in one pass over g)."""
    r1 = src[wp:]
    r2 = src[2 * wp:]
    s00 = s01 = s02 = s10 = s11 = s12 = s20 = s21 = s22 = g.dtype.type(0)
    for k in range(n):
        v = g[k]
        s00 += v * src[k]
        s01 += v * src[k + 1]
        s02 += v * src[k + 2]
        s10 += v * r1[k]
        s11 += v * r1[k + 1]
        s12 += v * r1[k + 2]
        s20 += v * r2[k]
        s21 += v * r2[k + 1]
        s22 += v * r2[k + 2]
    out[0, 0] += s00
    out[0, 1] += s01
    out[0, 2] += s02
    out[1, 0] += s10
    out[1, 1] += s11
    out[1, 2] += s12
    out[2, 0] += s20
    out[2, 1] += s21
    out[2, 2] += s22


@numba.njit(nogil=True, inline="never", fastmath=True)
def _dot(a, b, n):
    acc = a.dtype.type(0)
    for k in range(n):
        acc += a[k] * b[k]
    return acc


@numba.njit(nogil=True, inline="always")
def _pad_sample(x, s, top, left, xp):
    """xp [C, Hp, Wp] = sample s of x with zeros around it, `top` rows and `left` columns before."""
    c_, h_, w_ = x.shape[1], x.shape[2], x.shape[3]
    xp[:] = 0
    for c in range(c_):
        for ih in range(h_):
            for iw in range(w_):
                xp[c, top + ih, left + iw] = x[s, c, ih, iw]


@numba.njit(nogil=True, cache=True)
def forward(x, w, bias, top, left, y):
    """y[s, o] = bias[o] + the correlation of x[s] with w[o] (y [N, OC, OH, OW], written);
    x [N, C, H, W], w [OC, C, KH, KW], bias [OC] (zeros for none)."""
    n_, c_ = x.shape[0], x.shape[1]
    oc_, _, kh, kw = w.shape
    oh_, ow_ = y.shape[2], y.shape[3]
    hp, wp = oh_ + kh - 1, ow_ + kw - 1
    run = (oh_ - 1) * wp + ow_
    xp = np.empty((c_, hp, wp), x.dtype)
    wide = np.empty(oh_ * wp, y.dtype)
    wide2 = np.empty(oh_ * wp, y.dtype)
    for s in range(n_):
        _pad_sample(x, s, top, left, xp)
        flat = xp.reshape(c_, hp * wp)
        o = 0
        if kh == 3 and kw == 3:
            for o in range(0, oc_ - 1, 2):
                wide[:] = bias[o]
                wide2[:] = bias[o + 1]
                for c in range(c_):
                    _axpy3x3_pair(wide, wide2, flat[c], wp, w[o, c], w[o + 1, c], run)
                for oh in range(oh_):
                    for ow in range(ow_):
                        y[s, o, oh, ow] = wide[oh * wp + ow]
                        y[s, o + 1, oh, ow] = wide2[oh * wp + ow]
            o = oc_ - oc_ % 2
        for o in range(o, oc_):
            wide[:] = bias[o]
            for c in range(c_):
                _correlate_add(wide, flat[c], wp, w[o, c], run)
            for oh in range(oh_):
                for ow in range(ow_):
                    y[s, o, oh, ow] = wide[oh * wp + ow]


@numba.njit(nogil=True, cache=True)
def backward(x, w, dy, top, left, dx, want_dx):
    """The weight gradient [OC, C, KH, KW] of `forward` for output gradient dy, and (where
    want_dx) the input gradient written into dx [N, C, H, W]. The input gradient is the
    correlation of dy, zero-padded by KH - 1 rows and KW - 1 columns before, with the
    flipped window: the forward's runs again."""
    n_, c_, h_, w_ = x.shape
    oc_, _, kh, kw = w.shape
    oh_, ow_ = dy.shape[2], dy.shape[3]
    hp, wp = oh_ + kh - 1, ow_ + kw - 1
    run = (oh_ - 1) * wp + ow_
    margin = (kh - 1) * wp + kw - 1
    xp = np.empty((c_, hp, wp), x.dtype)
    dxp = np.empty((c_, hp * wp), x.dtype)
    # dy's planes, wide, after `margin` zeros; the scratch columns and the margins stay zero
    wide = np.zeros((oc_, margin + hp * wp + margin), dy.dtype)
    flipped = w[:, :, ::-1, ::-1].copy()
    dw = np.zeros(w.shape, w.dtype)
    for s in range(n_):
        _pad_sample(x, s, top, left, xp)
        flat = xp.reshape(c_, hp * wp)
        for o in range(oc_):
            for oh in range(oh_):
                for ow in range(ow_):
                    wide[o, margin + oh * wp + ow] = dy[s, o, oh, ow]
        for o in range(oc_):
            g = wide[o, margin:]
            for c in range(c_):
                if kh == 3 and kw == 3:
                    _dots3x3(g, flat[c], wp, run, dw[o, c])
                    continue
                for i in range(kh):
                    for j in range(kw):
                        dw[o, c, i, j] += _dot(g, flat[c, i * wp + j:], run)
        if not want_dx:
            continue
        dxp[:] = 0
        for c in range(c_):
            for o in range(oc_):
                _correlate_add(dxp[c], wide[o], wp, flipped[o, c], hp * wp)
        for c in range(c_):
            for ih in range(h_):
                for iw in range(w_):
                    dx[s, c, ih, iw] = dxp[c, (top + ih) * wp + left + iw]
    return dw


@numba.njit(nogil=True, cache=True, parallel=True)
def _forward_parts(x, w, bias, top, left, y, cuts):
    """`forward` on each part [cuts[i], cuts[i+1]) of the samples, in parallel."""
    for i in numba.prange(len(cuts) - 1):
        forward(x[cuts[i]:cuts[i + 1]], w, bias, top, left, y[cuts[i]:cuts[i + 1]])


@numba.njit(nogil=True, cache=True, parallel=True)
def _backward_parts(x, w, dy, top, left, dx, want_dx, dw, cuts):
    """`backward` on each part [cuts[i], cuts[i+1]) of the samples in parallel, part i's weight
    gradient into dw[i]."""
    for i in numba.prange(len(cuts) - 1):
        a, b = cuts[i], cuts[i + 1]
        dw[i] = backward(x[a:b], w, dy[a:b], top, left, dx[a:b] if want_dx else dx, want_dx)


@functools.cache   # the types' construction alone took 15 us a call
def _compile(dtype) -> None:
    """The four kernels compiled for float type `dtype` (ops/per_float.py), for contiguous
    arrays: strided ones made their loops over a row scalar (10-14% slower) and doubled the
    compile time (12 s a version of _backward_parts); a tile's strided view is copied instead."""
    i64, boolean, cuts = numba.types.int64, numba.types.boolean, array(np.int64, 1)

    def contiguous(signature):
        return lambda t: [signature(lambda ndim, written=False: array(t, ndim, written, "C"))]

    compile_per_float(forward, contiguous(lambda a: (a(4), a(4), a(1), i64, i64, a(4, True))), dtype)
    compile_per_float(_forward_parts, contiguous(lambda a: (a(4), a(4), a(1), i64, i64, a(4, True), cuts)), dtype)
    compile_per_float(backward, contiguous(lambda a: (a(4), a(4), a(4), i64, i64, a(4, True), boolean)), dtype)
    compile_per_float(_backward_parts, contiguous(lambda a: (a(4), a(4), a(4), i64, i64, a(4, True), boolean,
                                                             a(5, True), cuts)), dtype)


def _written(out):
    """out itself if it is contiguous, else a contiguous array of its shape to copy into it."""
    return out if out.flags.c_contiguous else np.empty(out.shape, out.dtype)


def forward_in_parts(x, w, bias, top, left, y) -> None:
    """`forward` with the samples cut into parts, one per core of the task, in one compiled call
    (a part on cpu_pool's threads paid a wakeup and the GIL's handoffs each way)."""
    _compile(x.dtype)
    x, w, bias, out = np.ascontiguousarray(x), np.ascontiguousarray(w), np.ascontiguousarray(bias), _written(y)
    threads, cuts = batch_parts(x.shape[0])
    if threads == 1:
        forward(x, w, bias, top, left, out)
    else:
        _forward_parts(x, w, bias, top, left, out, cuts)
    if out is not y:
        y[...] = out


def backward_in_parts(x, w, dy, top, left, dx=None):
    """`backward` with the samples cut into parts, one per core of the task: the weight gradient
    (the parts' summed), and dx written unless it is None."""
    _compile(x.dtype)
    x, w, dy = np.ascontiguousarray(x), np.ascontiguousarray(w), np.ascontiguousarray(dy)
    want_dx = dx is not None
    out = _written(dx) if want_dx else np.empty((0,) * 4, x.dtype)
    threads, cuts = batch_parts(x.shape[0])
    if threads == 1:
        dw = backward(x, w, dy, top, left, out, want_dx)
    else:
        dw = np.empty((threads, *w.shape), w.dtype)
        _backward_parts(x, w, dy, top, left, out, want_dx, dw, cuts)
        dw = dw.sum(axis=0)
    if want_dx and out is not dx:
        dx[...] = out
    return dw
