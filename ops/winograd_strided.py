"""Strided convolutions (the 3x3 stride-2 reductions of ResNet and Inception) as Winograd
F(7, 2) along the width, on the CPU.

Split by position modulo the width stride sw, each input row becomes sw phase rows, and window
column j reads phase (j - left) % sw shifted by (j - left) // sw: a stride-1 correlation whose
taps span two shifts (3 wide at stride 2). Each (window row i, phase pj) is then an input
channel group of a 1x2 stride-1 convolution along the width,

    y[n, o, r, q] = sum over (i, pj, c) and k of g[o, (i, pj, c), k] * P[n, (i, pj, c), r, q + k - left],

where P[n, (i, pj, c), r, t] = x[n, c, sh*r + i - top, pj + sw*t] (0 outside x) and g holds
w[o, c, i, j] at the tap k of its shift (0 where a phase has one tap). The stacked image P is
never made: each chunk of samples is turned channels-last, and one kernel reads every group's
blocks from its rows and writes them transformed into the group's channels of V.

A 3x3 stride-2 convolution of C channels is thus a correlation of 6C channels with 2 taps, in
8/7 multiplies an output each: 6C x 8/7 against 9C for im2col's GEMM (0.76 of its multiplies),
and no columns (the transformed blocks are 8/7 of the 6C phase rows, where im2col writes 9C).
F(7, 2) has the points of the common F(6, 3) (0, +-1, +-2, +-1/2 and infinity), so its input
transform B^T is that one's, written out below with its shared terms; the output's A^T and the
gradient's A go through ops/winograd_1d.py's general kernels (applied to OC channels).
"""
from __future__ import annotations

import functools
import math
from fractions import Fraction

import numba
import numpy as np

from ops import winograd, winograd_1d

#: outputs per block and the finite interpolation points of F(M, 2) (N = M + 1 with infinity)
M = 7
N = M + 1
POINTS = (0, 1, -1, 2, -2, Fraction(1, 2), Fraction(-1, 2))
#: taps of the correlation along the width
R = 2
#: A^T [M, N], G [N, R], B^T [N, N] in float64
AT, G, BT = winograd_1d.transforms(M, R, POINTS)
#: a chunk of samples has about this many bytes of scratch (its image channels-last, its
#: transformed blocks and the GEMMs' products),
_CHUNK_BYTES = 8 << 20
#: and at least this many blocks (rows of the point GEMMs)
_MIN_ROWS = 512
#: dtype -> (A^T, A, G) in that dtype, contiguous
_CAST: dict = {}


def _cast(dtype) -> tuple:
    dtype = np.dtype(dtype)
    if dtype not in _CAST:
        _CAST[dtype] = tuple(np.ascontiguousarray(a, dtype) for a in (AT, AT.T, G))
    return _CAST[dtype]


#: the constants of B^T, in the order of _consts (given to the kernels in the image's dtype:
#: Python floats would make them compute in float64)
_CONSTANTS = (0.25, 0.5, 1.25, 2.0, 2.5, 4.0, 4.25, 5.0, 5.25)
_CONSTS: dict = {}


def _consts(dtype) -> tuple:
    dtype = np.dtype(dtype)
    if dtype not in _CONSTS:
        _CONSTS[dtype] = tuple(dtype.type(v) for v in _CONSTANTS)
    return _CONSTS[dtype]


@numba.njit(nogil=True, inline="always")
def _bt(k, d0, d1, d2, d3, d4, d5, d6, d7):
    """B^T d of one block's 8 places (BT above, its rows paired by the sign of the odd terms);
    k = _consts(dtype)."""
    q, h, f4, two, f2, four, f17, five, f21 = k   # 1/4, 1/2, 5/4, 2, 5/2, 4, 17/4, 5, 21/4
    e1, o1 = d2 + d6 - f17 * d4, d1 + d5 - f17 * d3
    e2, o2 = q * d2 + d6 - f4 * d4, h * d1 + two * d5 - f2 * d3
    e3, o3 = four * d2 + d6 - five * d4, two * d1 + h * d5 - f2 * d3
    return (d6 - d0 + f21 * (d2 - d4), e1 + o1, e1 - o1, e2 + o2, e2 - o2, e3 + o3, e3 - o3,
            d7 - d1 + f21 * (d3 - d5))


@numba.njit(nogil=True, inline="always")
def _b(k, z0, z1, z2, z3, z4, z5, z6, z7):
    """B z of one block's 8 points (the transpose of _bt): the gradients of its 8 places."""
    q, h, f4, two, f2, four, f17, five, f21 = k
    a1, s1 = z1 + z2, z1 - z2
    a2, s2 = z3 + z4, z3 - z4
    a3, s3 = z5 + z6, z5 - z6
    return (-z0, s1 + h * s2 + two * s3 - z7, f21 * z0 + a1 + q * a2 + four * a3,
            f21 * z7 - f17 * s1 - f2 * s2 - f2 * s3, -f21 * z0 - f17 * a1 - f4 * a2 - five * a3,
            s1 + two * s2 + h * s3 - f21 * z7, z0 + a1 + a2 + a3, z7)


def _shifts(kw: int, sw: int, left: int) -> list[tuple[int, int]]:
    """(phase, shift) of each window column j: input column sw*q - left + j is column q + shift
    of phase row `phase`."""
    return [((j - left) % sw, (j - left) // sw) for j in range(kw)]


def _taps(kw: int, sw: int, left: int) -> tuple[int, list[tuple[int, int, int]]]:
    """(the correlation's virtual left padding, and per window column j: (j, its phase, its tap
    of the 2-tap correlation)): the shifts counted from the least."""
    shifts = _shifts(kw, sw, left)
    first = min(d for _, d in shifts)
    return -first, [(j, pj, d - first) for j, (pj, d) in enumerate(shifts)]


@functools.lru_cache(maxsize=None)
def supports(kernel, stride) -> bool:
    """Whether a convolution with this kernel and stride is a 2-tap correlation of its phases
    here, whatever a tile's virtual left padding: a width stride over 1 and window columns over
    two shifts of a phase."""
    kw, sw = kernel[1], stride[1]
    if sw < 2:
        return False
    for left in range(sw):
        shifts = [d for _, d in _shifts(kw, sw, left)]
        if max(shifts) - min(shifts) + 1 != R:
            return False
    return True


def stacked_filters(w, stride, left: int):
    """g [OC, G*C, 2] of w [OC, C, KH, KW]: channel group g = i*sw + pj holds the window row i's
    taps of phase pj at their shifts, zero where the phase has none."""
    oc, c, kh, kw = w.shape
    sw = stride[1]
    g = np.zeros((oc, kh, sw, c, R), w.dtype)
    for j, pj, k in _taps(kw, sw, left)[1]:
        g[:, :, pj, :, k] = w[:, :, :, j].transpose(0, 2, 1)
    return g.reshape(oc, kh * sw * c, R)


def filters_of_stacked(g, shape, stride, left: int):
    """The inverse of stacked_filters on gradients: dw [OC, C, KH, KW] from dg [OC, G*C, 2]."""
    oc, c, kh, kw = shape
    sw = stride[1]
    g = g.reshape(oc, kh, sw, c, R)
    dw = np.empty(shape, g.dtype)
    for j, pj, k in _taps(kw, sw, left)[1]:
        dw[:, :, :, j] = g[:, :, pj, :, k].transpose(0, 2, 1)
    return dw


def filter_transform(g, channels_last: bool = False):
    """U = G g of the stacked filters g [OC, GC, 2], as [N, OC, GC] (one GEMM), or contiguous
    [N, GC, OC] with channels_last (forward's GEMMs take it so: read transposed, OpenBLAS ran
    [M, 768] x [768, 128] at half its speed)."""
    oc, gc, r = g.shape
    u = np.matmul(_cast(g.dtype)[2], g.reshape(oc * gc, r).T).reshape(-1, oc, gc)
    return np.ascontiguousarray(u.swapaxes(1, 2)) if channels_last else u


def filter_gradient(du):
    """dg [OC, GC, 2] from du [N, OC, GC], the gradient of U = filter_transform(g)."""
    n, oc, gc = du.shape
    return np.matmul(du.reshape(n, oc * gc).T, _cast(du.dtype)[2]).reshape(oc, gc, R)


# The image is turned channels-last, a chunk of samples at a time, so that the kernels below
# read and write each pixel's channels as one run. (Gathered channel by channel from NCHW, each
# channel's row is on a page of its own at 56x56: one sample's rows of one group, 128 channels,
# took 2.6 of the split's 5.3 ms.) numpy's copy of the transposed view does the turn (8 samples of
# 128 channels at 56x56: 3.6 ms, a numba loop 6.0); the way back is a numba loop (6.4 ms, numpy 8.9).
@numba.njit(nogil=True, cache=True)
def _channels_first(xl, out):
    """out[n, c, h, w] = xl[n, h, w, c], 16 channels at a time (each plane written in order)."""
    n_, c_, h_, w_ = out.shape
    for n in range(n_):
        for c0 in range(0, c_, 16):
            c1 = min(c_, c0 + 16)
            for h in range(h_):
                for c in range(c0, c1):
                    row = out[n, c, h]
                    for w in range(w_):
                        row[w] = xl[n, h, w, c]


@numba.njit(nogil=True, cache=True, error_model="numpy", fastmath={"contract"})
def _split(xl, kh, sh, sw, top, k, out):
    """out[p, n, r, t, g*C + c] = (B^T d)[p] where d[s] = xl[n, sh*r + i - top, pj + sw*(M*t + s), c],
    for each group g = i*sw + pj (0 for rows outside xl). xl [N, H, WP, C] is the image padded
    with zero columns, sw * the correlation's left padding before it and enough after, so that
    every place is inside it; out [N, N_samples, OH, T, G*C]."""
    n_, h_, _, c_ = xl.shape
    oh_, t_ = out.shape[2], out.shape[3]
    for n in range(n_):
        for r in range(oh_):
            for i in range(kh):
                ih = sh * r + i - top
                for pj in range(sw):
                    g0 = (i * sw + pj) * c_
                    if ih < 0 or ih >= h_:
                        for p in range(N):
                            for t in range(t_):
                                dst = out[p, n, r, t]
                                for c in range(c_):
                                    dst[g0 + c] = 0
                        continue
                    row = xl[n, ih]
                    for t in range(t_):
                        j = pj + sw * M * t
                        s0, s1, s2, s3 = row[j], row[j + sw], row[j + 2 * sw], row[j + 3 * sw]
                        s4, s5, s6, s7 = row[j + 4 * sw], row[j + 5 * sw], row[j + 6 * sw], row[j + 7 * sw]
                        o0, o1, o2, o3 = out[0, n, r, t], out[1, n, r, t], out[2, n, r, t], out[3, n, r, t]
                        o4, o5, o6, o7 = out[4, n, r, t], out[5, n, r, t], out[6, n, r, t], out[7, n, r, t]
                        for c in range(c_):
                            v = _bt(k, s0[c], s1[c], s2[c], s3[c], s4[c], s5[c], s6[c], s7[c])
                            o0[g0 + c], o1[g0 + c], o2[g0 + c], o3[g0 + c] = v[0], v[1], v[2], v[3]
                            o4[g0 + c], o5[g0 + c], o6[g0 + c], o7[g0 + c] = v[4], v[5], v[6], v[7]


@numba.njit(nogil=True, cache=True, error_model="numpy", fastmath={"contract"})
def _merge_add(z, kh, sh, sw, top, k, dxl):
    """The adjoint of _split: dxl[n, sh*r + i - top, pj + sw*(M*t + s), c] += (B z)[s] where
    z[p] = z[p, n, r, t, g*C + c] (dxl padded as _split's xl). z [N, N_samples, OH, T, G*C].
    A block's 8 gradients go through `grads` first: added into the row's 8 places directly, the
    loop read and wrote 8 runs of one array, which LLVM left unvectorized (4x the time).)"""
    n_, h_, _, c_ = dxl.shape
    oh_, t_ = z.shape[2], z.shape[3]
    grads = np.empty((N, c_), dxl.dtype)
    for n in range(n_):
        for r in range(oh_):
            for i in range(kh):
                ih = sh * r + i - top
                if ih < 0 or ih >= h_:
                    continue
                row = dxl[n, ih]
                for pj in range(sw):
                    g0 = (i * sw + pj) * c_
                    for t in range(t_):
                        j = pj + sw * M * t
                        z0, z1, z2, z3 = z[0, n, r, t], z[1, n, r, t], z[2, n, r, t], z[3, n, r, t]
                        z4, z5, z6, z7 = z[4, n, r, t], z[5, n, r, t], z[6, n, r, t], z[7, n, r, t]
                        for c in range(c_):
                            e = g0 + c
                            v = _b(k, z0[e], z1[e], z2[e], z3[e], z4[e], z5[e], z6[e], z7[e])
                            grads[0, c], grads[1, c], grads[2, c], grads[3, c] = v[0], v[1], v[2], v[3]
                            grads[4, c], grads[5, c], grads[6, c], grads[7, c] = v[4], v[5], v[6], v[7]
                        for s in range(N):
                            dst, src = row[j + s * sw], grads[s]
                            for c in range(c_):
                                dst[c] += src[c]


def _chunks(n: int, bytes_per_sample: int, blocks_per_sample: int) -> list[tuple[int, int]]:
    """Sample ranges of at least _MIN_ROWS blocks (the point GEMMs' rows; at 224 rows OpenBLAS
    ran [224, 768] x [768, 128] at half its speed) and about _CHUNK_BYTES of scratch."""
    step = max(1, _CHUNK_BYTES // max(1, bytes_per_sample), -(-_MIN_ROWS // blocks_per_sample))
    return [(a, min(n, a + step)) for a in range(0, n, step)]


class _Plan:
    """One call's geometry: the blocks, the padded channels-last image and the chunks' buffers
    (the image, its transformed blocks, and the point GEMMs' products on the output's channels)."""

    def __init__(self, x, kernel, stride, top_left, out_shape):
        n, c, h, w = x.shape
        self.oc, self.oh, ow = out_shape
        self.kh, (self.sh, self.sw) = kernel[0], stride
        self.top = top_left[0]
        self.t = -(-ow // M)
        self.gc = kernel[0] * stride[1] * c
        # columns of the padded image: x's column 0 at pad, the last block's last place inside
        self.pad = self.sw * _taps(kernel[1], self.sw, top_left[1])[0]
        self.wp = max(self.pad + w, self.sw * (M * self.t + 1))
        blocks = self.oh * self.t
        sizes = {"x": (h * self.wp * c,), "v": (N, blocks * self.gc), "m": (N, blocks * self.oc)}
        per_sample = sum(math.prod(v) for v in sizes.values()) * x.itemsize
        self.chunks = _chunks(n, per_sample, blocks)
        self.buf = winograd.Buffers(x.dtype, self.chunks[0][1] - self.chunks[0][0], sizes)

    def image(self, x, a: int, b: int):
        """The padded channels-last scratch [b-a, H, WP, C] of samples [a, b) (not filled)."""
        return self.buf.get("x", b - a, (b - a, x.shape[2], self.wp, x.shape[1]))

    def transformed(self, x, a: int, b: int):
        """(xl, v): samples [a, b) of x channels-last (padded) and their stacked blocks
        transformed, v [N, (b-a)*OH*T, G*C]."""
        xl = self.image(x, a, b)
        xl[:, :, :self.pad] = 0
        xl[:, :, self.pad + x.shape[3]:] = 0
        np.copyto(xl[:, :, self.pad:self.pad + x.shape[3]], x[a:b].transpose(0, 2, 3, 1))
        v = self.buf.get("v", b - a, (N, -1, self.gc))
        _split(xl, self.kh, self.sh, self.sw, self.top, _consts(x.dtype), self.blocks(v, b - a))
        return xl, v

    def products(self, a: int, b: int):
        """The scratch [N, (b-a)*OH*T, OC] of samples [a, b)'s point GEMMs on the output's channels."""
        return self.buf.get("m", b - a, (N, -1, self.oc))

    def blocks(self, z, samples: int):
        """z [N, samples*OH*T, K] as [N, samples, OH, T, K] (a view)."""
        return z.reshape(N, samples, self.oh, self.t, z.shape[-1])


def forward(x, kernel, stride, top_left, y, bias, ut) -> None:
    """y [N, OC, OH, OW] = the convolution of x [N, C, H, W] (virtual padding top_left) with the
    filters whose transform is ut = filter_transform(stacked_filters(w, ...), True), plus bias."""
    plan = _Plan(x, kernel, stride, top_left, y.shape[1:])
    bias = np.empty(0, x.dtype) if bias is None else bias
    at = _cast(x.dtype)[0]
    for a, b in plan.chunks:
        _, v = plan.transformed(x, a, b)
        prod = np.matmul(v, ut, out=plan.products(a, b))
        winograd_1d.merge_transformed(plan.blocks(prod, b - a), at, 0, M, bias, y[a:b])


def transformed_backward(x, kernel, stride, top_left, u, dy, dx):
    """The gradient dU [N, OC, GC] of the transformed stacked filters u = filter_transform(g)
    (parts of a batch add theirs; filter_gradient and filters_of_stacked turn the sum into dw),
    with dx written unless it is None."""
    plan = _Plan(x, kernel, stride, top_left, dy.shape[1:])
    a_ = _cast(x.dtype)[1]
    du = None
    for a, b in plan.chunks:
        xl, v = plan.transformed(x, a, b)
        dm = plan.products(a, b)
        winograd_1d.split_transformed(dy[a:b], 0, M, a_, plan.blocks(dm, b - a))
        if du is None:
            du = np.matmul(dm.swapaxes(1, 2), v)
        else:
            du += np.matmul(dm.swapaxes(1, 2), v)
        if dx is None:
            continue
        np.matmul(dm, u, out=v)   # v and xl are free now: the gradients go through them
        xl[...] = 0
        _merge_add(plan.blocks(v, b - a), plan.kh, plan.sh, plan.sw, plan.top, _consts(x.dtype), xl)
        _channels_first(xl[:, :, plan.pad:plan.pad + x.shape[3]], dx[a:b])
    return du
