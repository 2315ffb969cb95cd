"""Winograd F(4x4, 3x3): a stride-1 3x3 convolution as 36 GEMMs on the CPU (Lavin & Gray, 2015).

Each 4x4 block of outputs comes from the 6x6 block of (padded) input under it: the input
block is transformed, d -> B^T d B, the filter g -> G g G^T, the two are multiplied
elementwise and brought back, m -> A^T m A. Summed over input channels, the elementwise
product is one GEMM for each of the 36 positions xi of a 6x6 block,

    M[xi] = V[xi] @ U[xi]        [blocks, C] @ [C, OC]  ->  [blocks, OC],

a quarter of a direct convolution's multiplies. Backward is the exact adjoint of those
steps (the output gradient transformed by A, two GEMMs per xi, the input gradient brought
back by B and added up where the 6x6 blocks overlap), so it too costs 36 GEMMs of the same
shape per product. Float32 results are within a few 1e-6 of the outputs' scale (measured
against float64 in tests/test_winograd.py). The block transforms are numba kernels whose
inner loops run over a row of blocks' channels: the image goes channels-last once, its columns
split by their place in a block ([N, H, 6, TW, C], see _split_columns), and the blocks are laid
out [36, blocks, C] with block (n, th, tw) at (n * TH + th) * TW + tw, so that the blocks are
each GEMM's long side (OpenBLAS runs a few channels as the long side at 55-65% of its speed).
"""
from __future__ import annotations

import functools
import math

import numba
import numpy as np

from ops import blas, cpu_pool
from ops.cpu_threads import batch_parts
from ops.per_float import array, compile_per_float

#: output block side, filter side and input block side (ALPHA = M + R - 1)
M, R, ALPHA = 4, 3, 6
#: transform matrices of F(4, 3) at the points 0, 1, -1, 2, -2 and infinity
BT = np.array([[4, 0, -5, 0, 1, 0],
               [0, -4, -4, 1, 1, 0],
               [0, 4, -4, -1, 1, 0],
               [0, -2, -1, 2, 1, 0],
               [0, 2, -1, -2, 1, 0],
               [0, 4, 0, -5, 0, 1]], np.float64)
G = np.array([[1 / 4, 0, 0],
              [-1 / 6, -1 / 6, -1 / 6],
              [-1 / 6, 1 / 6, -1 / 6],
              [1 / 24, 1 / 12, 1 / 6],
              [1 / 24, -1 / 12, 1 / 6],
              [0, 0, 1]], np.float64)
AT = np.array([[1, 1, 1, 1, 1, 0],
               [0, 1, -1, 2, -2, 0],
               [0, 1, 1, 4, 4, 0],
               [0, 1, -1, 8, -8, 1]], np.float64)

#: blocks are transformed in batches of samples whose transforms take about this many bytes
#: (they stay in cache between the transforms and the GEMMs)
_CHUNK_BYTES = 2 << 20
#: but a chunk has at least this many blocks (if the batch has them): the GEMMs' long side, and
#: the weight gradient's inner one, which with a few blocks a chunk would be updated in thin
#: rank-k steps (512 channels at 7x7: one sample a chunk took 3x as long as 32)
_MIN_CHUNK_BLOCKS = 256


def blocks(out_hw) -> tuple[int, int]:
    """(TH, TW): how many 4x4 output blocks cover an output of out_hw (the last ones stick out)."""
    return -(-out_hw[0] // M), -(-out_hw[1] // M)


# The 1-D transforms of F(4, 3) written out (B^T, B, A^T, A applied to 6 or 4 values), so that
# the kernels below are straight-line vector code. `k` holds the constants 2, 4, 5, 8 in the
# data's dtype (a literal would make numba compute in float64).
@numba.njit(nogil=True, inline="always")
def _bt(d0, d1, d2, d3, d4, d5, k):
    """B^T d: the input transform."""
    k2, k4, k5 = k[0], k[1], k[2]
    return (k4 * d0 - k5 * d2 + d4, d3 + d4 - k4 * (d1 + d2), k4 * (d1 - d2) + d4 - d3,
            k2 * (d3 - d1) + d4 - d2, k2 * (d1 - d3) + d4 - d2, k4 * d1 - k5 * d3 + d5)


@numba.njit(nogil=True, inline="always")
def _b(v0, v1, v2, v3, v4, v5, k):
    """B v: the adjoint of the input transform (for the input gradient)."""
    k2, k4, k5 = k[0], k[1], k[2]
    return (k4 * v0, k4 * (v2 + v5 - v1) + k2 * (v4 - v3), -k5 * v0 - k4 * (v1 + v2) - v3 - v4,
            v1 - v2 + k2 * (v3 - v4) - k5 * v5, v0 + v1 + v2 + v3 + v4, v5)


@numba.njit(nogil=True, inline="always")
def _at(m0, m1, m2, m3, m4, m5, k):
    """A^T m: the output transform, 6 values to 4."""
    k2, k4, k8 = k[0], k[1], k[3]
    p, q = m1 + m2, m1 - m2
    r, s = m3 + m4, m3 - m4
    return m0 + p + r, q + k2 * s, p + k4 * r, q + k8 * s + m5


@numba.njit(nogil=True, inline="always")
def _a(d0, d1, d2, d3, k):
    """A d: the adjoint of the output transform, 4 values to 6 (for the output gradient)."""
    k2, k4, k8 = k[0], k[1], k[3]
    p, q = d0 + d2, d1 + d3
    r, s = d0 + k4 * d2, k2 * d1 + k8 * d3
    return d0, p + q, p - q, r + s, r - s, d3


# The kernels below keep the channels innermost, and the columns of an image split by their
# place in a block: xs[n, row, s, tw, c] holds column 4*tw + s, so that for one row of blocks
# and one place s the blocks' channels lie side by side, [TW * C] contiguous. Every transform
# then runs along such rows, vectorized, whatever the image size (a plane of a 16x16 image
# has just 16 blocks; a loop over them paid its fixed costs 16 x 16 times a sample). The
# image goes into and out of that layout through one transposing pass each way, a row of
# the image at a time: the row's channels are copied into (or summed in) a block [W, C] in
# cache, so that the image is read and written along its rows. (Channel by channel at one
# pixel strides the image by a plane, 4 KiB at 32x32, where every access missed the cache:
# 4-7x the time.)
@numba.njit(nogil=True, cache=True)
def _split_columns(x, top, left, out):
    """out[n, i, s, t, c] = x[n, c, i - top, 4*t + s - left] where that lies inside x, 0
    elsewhere: x [N, C, H, W] (any strides) into out [N, HP, S, T, C]."""
    n_, c_, h_, w_ = x.shape
    hp, s_, t_ = out.shape[1:4]
    zero = out.dtype.type(0)
    block = np.empty((w_, c_), out.dtype)   # block[w, c] = x[n, c, i - top, w]
    for n in range(n_):
        for i in range(hp):
            ih = i - top
            inside = 0 <= ih < h_
            if inside:
                for c in range(c_):
                    row = x[n, c, ih]
                    for w in range(w_):
                        block[w, c] = row[w]
            for s in range(s_):
                for t in range(t_):
                    iw = 4 * t + s - left
                    dst = out[n, i, s, t]
                    if inside and 0 <= iw < w_:
                        src = block[iw]
                        for c in range(c_):
                            dst[c] = src[c]
                    else:
                        for c in range(c_):
                            dst[c] = zero


@numba.njit(nogil=True, cache=True)
def _merge_columns(z, top, left, bias, out):
    """out[n, c, i, j] = the sum of z[n, i + top, s, t, c] over the (s, t) inside z with
    4*t + s = j + left (two where blocks overlap, else one or none), plus bias[c] unless bias is
    empty: the adjoint of _split_columns, z [N, HP, S, T, C] into out [N, C, H, W] (any strides)."""
    n_, c_, h_, w_ = out.shape
    hp, s_, t_ = z.shape[1:4]
    b = bias if bias.size else np.zeros(c_, out.dtype)
    block = np.empty((w_, c_), out.dtype)   # block[j, c] = out[n, c, i, j]
    for n in range(n_):
        for i in range(h_):
            zi = i + top
            for j in range(w_):
                acc = block[j]
                t, s = divmod(j + left, 4)
                if zi < hp and t < t_:
                    src = z[n, zi, s, t]
                    for c in range(c_):
                        acc[c] = src[c] + b[c]
                else:
                    for c in range(c_):
                        acc[c] = b[c]
                if zi < hp and s + 4 < s_ and 1 <= t <= t_:  # the last block's overlap
                    src = z[n, zi, s + 4, t - 1]
                    for c in range(c_):
                        acc[c] += src[c]
            for c in range(c_):
                row = out[n, c, i]
                for j in range(w_):
                    row[j] = block[j, c]


@numba.njit(nogil=True, cache=True)
def _input_transform(xs, k, v):
    """v[6*i + j, (n*TH + th)*TW + tw, c] = (B^T d B)[i, j] for the 6x6 block d of the padded
    image at row 4*th and column 4*tw: xs [N, HP, 6, TW, C] as _split_columns makes it."""
    n_, hp, _, t_, c_ = xs.shape
    th_ = (hp - 2) // 4
    ln = t_ * c_
    xf = xs.reshape(n_, hp, 6, ln)
    vf = v.reshape(36, -1)
    down = np.empty((6, 6, ln), v.dtype)  # B^T down the block's rows: [i, s, tw * C + c]
    for n in range(n_):
        for th in range(th_):
            r = 4 * th
            for s in range(6):
                d0, d1, d2, d3, d4, d5 = xf[n, r, s], xf[n, r + 1, s], xf[n, r + 2, s], xf[n, r + 3, s], \
                    xf[n, r + 4, s], xf[n, r + 5, s]
                o0, o1, o2, o3, o4, o5 = down[0, s], down[1, s], down[2, s], down[3, s], down[4, s], down[5, s]
                for q in range(ln):
                    o0[q], o1[q], o2[q], o3[q], o4[q], o5[q] = _bt(d0[q], d1[q], d2[q], d3[q], d4[q], d5[q], k)
            a = (n * th_ + th) * ln
            for i in range(6):
                e = down[i]
                o0, o1, o2, o3, o4, o5 = (vf[6 * i, a:a + ln], vf[6 * i + 1, a:a + ln], vf[6 * i + 2, a:a + ln],
                                          vf[6 * i + 3, a:a + ln], vf[6 * i + 4, a:a + ln], vf[6 * i + 5, a:a + ln])
                for q in range(ln):
                    o0[q], o1[q], o2[q], o3[q], o4[q], o5[q] = _bt(e[0, q], e[1, q], e[2, q], e[3, q], e[4, q],
                                                                   e[5, q], k)


@numba.njit(nogil=True, cache=True)
def _grad_transform(gs, k, dm):
    """dm[6*i + j, (n*TH + th)*TW + tw, c] = (A g A^T)[i, j] for the 4x4 block g of the output
    gradient at row 4*th and column 4*tw: gs [N, 4TH, 4, TW, C] as _split_columns makes it."""
    n_, h4, _, t_, c_ = gs.shape
    th_ = h4 // 4
    ln = t_ * c_
    gf = gs.reshape(n_, h4, 4, ln)
    mf = dm.reshape(36, -1)
    down = np.empty((6, 4, ln), dm.dtype)  # A down the block's rows: [i, s, tw * C + c]
    for n in range(n_):
        for th in range(th_):
            r = 4 * th
            for s in range(4):
                d0, d1, d2, d3 = gf[n, r, s], gf[n, r + 1, s], gf[n, r + 2, s], gf[n, r + 3, s]
                o0, o1, o2, o3, o4, o5 = down[0, s], down[1, s], down[2, s], down[3, s], down[4, s], down[5, s]
                for q in range(ln):
                    o0[q], o1[q], o2[q], o3[q], o4[q], o5[q] = _a(d0[q], d1[q], d2[q], d3[q], k)
            a = (n * th_ + th) * ln
            for i in range(6):
                e = down[i]
                o0, o1, o2, o3, o4, o5 = (mf[6 * i, a:a + ln], mf[6 * i + 1, a:a + ln], mf[6 * i + 2, a:a + ln],
                                          mf[6 * i + 3, a:a + ln], mf[6 * i + 4, a:a + ln], mf[6 * i + 5, a:a + ln])
                for q in range(ln):
                    o0[q], o1[q], o2[q], o3[q], o4[q], o5[q] = _a(e[0, q], e[1, q], e[2, q], e[3, q], k)


@numba.njit(nogil=True, cache=True)
def _output_transform(m, k, ys):
    """ys[n, 4*th + r, s, tw, c] = (A^T M A)[r, s] for each block's 6x6 products M =
    m[:, (n*TH + th)*TW + tw, c]; ys [N, 4TH, 4, TW, C] (columns split as _split_columns)."""
    n_, h4, _, t_, c_ = ys.shape
    th_ = h4 // 4
    ln = t_ * c_
    yf = ys.reshape(n_, h4, 4, ln)
    mf = m.reshape(36, -1)
    down = np.empty((4, 6, ln), ys.dtype)  # A^T down the block's rows: [r, j, tw * C + c]
    for n in range(n_):
        for th in range(th_):
            a = (n * th_ + th) * ln
            for j in range(6):
                e0, e1, e2, e3, e4, e5 = (mf[j, a:a + ln], mf[6 + j, a:a + ln], mf[12 + j, a:a + ln],
                                          mf[18 + j, a:a + ln], mf[24 + j, a:a + ln], mf[30 + j, a:a + ln])
                o0, o1, o2, o3 = down[0, j], down[1, j], down[2, j], down[3, j]
                for q in range(ln):
                    o0[q], o1[q], o2[q], o3[q] = _at(e0[q], e1[q], e2[q], e3[q], e4[q], e5[q], k)
            for r in range(4):
                e = down[r]
                o = yf[n, 4 * th + r]
                for q in range(ln):
                    o[0, q], o[1, q], o[2, q], o[3, q] = _at(e[0, q], e[1, q], e[2, q], e[3, q], e[4, q], e[5, q], k)


@numba.njit(nogil=True, cache=True)
def _input_grad_transform(dv, k, dxs):
    """dxs[n, 4*th + i, j, tw, c] = the sum of (B Z B^T)[i, j] over the blocks Z =
    dv[:, (n*TH + th)*TW + tw, c] (6x6) that cover that row: the adjoint of _input_transform.
    Rows overlap by two from one row of blocks to the next (columns do not: each block has its
    own six in dxs); dxs [N, HP, 6, TW, C] is written whole, the blocks cover its rows."""
    n_, hp, _, t_, c_ = dxs.shape
    th_ = (hp - 2) // 4
    ln = t_ * c_
    df = dxs.reshape(n_, hp, 6, ln)
    vf = dv.reshape(36, -1)
    down = np.empty((6, 6, ln), dxs.dtype)  # B down the block's rows: [i, j, tw * C + c]
    for n in range(n_):
        for th in range(th_):
            a = (n * th_ + th) * ln
            for j in range(6):
                e0, e1, e2, e3, e4, e5 = (vf[j, a:a + ln], vf[6 + j, a:a + ln], vf[12 + j, a:a + ln],
                                          vf[18 + j, a:a + ln], vf[24 + j, a:a + ln], vf[30 + j, a:a + ln])
                o0, o1, o2, o3, o4, o5 = down[0, j], down[1, j], down[2, j], down[3, j], down[4, j], down[5, j]
                for q in range(ln):
                    o0[q], o1[q], o2[q], o3[q], o4[q], o5[q] = _b(e0[q], e1[q], e2[q], e3[q], e4[q], e5[q], k)
            for i in range(6):
                e = down[i]
                o0, o1, o2, o3, o4, o5 = (df[n, 4 * th + i, 0], df[n, 4 * th + i, 1], df[n, 4 * th + i, 2],
                                          df[n, 4 * th + i, 3], df[n, 4 * th + i, 4], df[n, 4 * th + i, 5])
                if i < 2 and th > 0:  # rows the row of blocks above wrote too
                    for q in range(ln):
                        f0, f1, f2, f3, f4, f5 = _b(e[0, q], e[1, q], e[2, q], e[3, q], e[4, q], e[5, q], k)
                        o0[q] += f0
                        o1[q] += f1
                        o2[q] += f2
                        o3[q] += f3
                        o4[q] += f4
                        o5[q] += f5
                else:
                    for q in range(ln):
                        o0[q], o1[q], o2[q], o3[q], o4[q], o5[q] = _b(e[0, q], e[1, q], e[2, q], e[3, q], e[4, q],
                                                                      e[5, q], k)


#: dtype -> the transforms' constants in it (made once: 3 us a call, and every part asks)
_CONSTS: dict = {}


def _consts(dtype) -> tuple:
    """The transforms' constants 2, 4, 5, 8 in `dtype`."""
    dtype = np.dtype(dtype)
    if dtype not in _CONSTS:
        _CONSTS[dtype] = tuple(dtype.type(v) for v in (2, 4, 5, 8))
    return _CONSTS[dtype]


def sample_chunks(n: int, bytes_per_sample: int, blocks_per_sample: int) -> list[tuple[int, int]]:
    """Sample ranges whose transformed blocks take about _CHUNK_BYTES (they stay in cache), and
    hold at least _MIN_CHUNK_BLOCKS blocks (ops/winograd_1d.py's chunks too)."""
    step = max(1, _CHUNK_BYTES // max(1, bytes_per_sample), -(-_MIN_CHUNK_BLOCKS // blocks_per_sample))
    return [(a, min(n, a + step)) for a in range(0, n, step)]


#: kron(G, G) [36, 9] by dtype: G g G^T of a 3x3 filter g is kron(G, G) @ g.ravel()
_KRON: dict = {}


def _kron(dtype):
    dtype = np.dtype(dtype)
    if dtype not in _KRON:
        _KRON[dtype] = np.kron(G, G).astype(dtype)
    return _KRON[dtype]


def filter_transform(w, channels_last: bool = False):
    """U = G g G^T of each 3x3 filter g of w [OC, C, 3, 3], as [36, OC, C], or [36, C, OC] with
    channels_last: every filter at once, one GEMM with kron(G, G)."""
    oc, c = w.shape[:2]
    if channels_last:
        return (_kron(w.dtype) @ w.transpose(1, 0, 2, 3).reshape(c * oc, 9).T).reshape(ALPHA * ALPHA, c, oc)
    return (_kron(w.dtype) @ w.reshape(oc * c, 9).T).reshape(ALPHA * ALPHA, oc, c)


def filter_gradient(du):
    """dw [OC, C, 3, 3] from du [36, C, OC], the gradient of U = filter_transform(w, channels_last=True):
    G^T dU G for each filter, one GEMM with kron(G, G)^T."""
    c, oc = du.shape[1:]
    dw = (_kron(du.dtype).T @ du.reshape(ALPHA * ALPHA, c * oc)).reshape(3, 3, c, oc)
    return np.ascontiguousarray(dw.transpose(3, 2, 0, 1))


class Buffers:
    """Scratch arrays sized for the first (largest) chunk of samples, handed out per chunk as
    contiguous arrays of that chunk's size (ops/winograd_1d.py's too)."""

    def __init__(self, dtype, samples: int, per_sample: dict[str, tuple]):
        self.per_sample = {name: math.prod(shape) for name, shape in per_sample.items()}
        self.flat = {name: np.empty(samples * size, dtype) for name, size in self.per_sample.items()}

    def get(self, name: str, samples: int, shape: tuple):
        return self.flat[name][:samples * self.per_sample[name]].reshape(shape)


def _buffers(x, n_blocks, scratch: dict) -> tuple[int, Buffers]:
    """(samples a chunk, buffers for a chunk) for the image x split by columns ("x", [HP, 6, TW, C]
    a sample), its blocks transformed ("v", [36, TH*TW, C] a sample) and `scratch` (name ->
    shape a sample)."""
    th, tw = n_blocks
    sizes = {"x": (4 * th + 2, 6, tw, x.shape[1]), "v": (ALPHA * ALPHA, th * tw, x.shape[1]), **scratch}
    chunks = sample_chunks(x.shape[0], sum(math.prod(s) for s in sizes.values()) * x.itemsize, th * tw)
    step = chunks[0][1] - chunks[0][0]
    return step, Buffers(x.dtype, step, sizes)


def _transformed_input(x, top_left, n_blocks, scratch: dict):
    """Per chunk of samples [a, b) of x: (a, b, xs, v, buf), the padded image split by columns
    (xs [b-a, HP, 6, TW, C]), its blocks transformed (v [36, (b-a)*TH*TW, C]), and buffers for
    `scratch` (name -> shape per sample) that the chunk's other steps take from buf."""
    n, c = x.shape[:2]
    th, tw = n_blocks
    step, buf = _buffers(x, n_blocks, scratch)
    k = _consts(x.dtype)
    for a in range(0, n, step):
        b = min(n, a + step)
        xs = buf.get("x", b - a, (b - a, 4 * th + 2, 6, tw, c))
        _split_columns(x[a:b], top_left[0], top_left[1], xs)
        v = buf.get("v", b - a, (ALPHA * ALPHA, (b - a) * th * tw, c))
        _input_transform(xs, k, v)
        yield a, b, xs, v, buf


@numba.njit(nogil=True, inline="always")
def _point_gemms(gemm, trans_a, a, b, c, beta):
    """c[xi] = a[xi] @ b[xi] + beta c[xi] for each of the 36 points (a[xi] transposed with
    trans_a): the arrays [36, rows, cols], C-contiguous, through BLAS (ops/blas.py)."""
    m, n = c.shape[1], c.shape[2]
    k = a.shape[1] if trans_a else a.shape[2]
    one = c.dtype.type(1)
    for xi in range(ALPHA * ALPHA):
        gemm(blas.ROW_MAJOR, blas.TRANS if trans_a else blas.NO_TRANS, blas.NO_TRANS, m, n, k, one,
             a.ctypes.data + xi * a.strides[0], a.shape[2], b.ctypes.data + xi * b.strides[0], n,
             beta, c.ctypes.data + xi * c.strides[0], n)


@numba.njit(nogil=True, cache=True)
def _forward_compiled(gemm, x, top, left, ut, bias, y, k, step, xs_flat, v_flat, m_flat, ys_flat):
    """`forward` as one compiled call (no GIL from start to end): the same steps, chunk by chunk
    of `step` samples, with the GEMMs through BLAS and the scratch arrays cut from the flat
    buffers."""
    n, c, oc = x.shape[0], x.shape[1], ut.shape[2]
    th, tw = (y.shape[2] + M - 1) // M, (y.shape[3] + M - 1) // M
    zero = y.dtype.type(0)
    for a in range(0, n, step):
        b = min(n, a + step)
        p = (b - a) * th * tw
        xs = xs_flat[:(b - a) * (4 * th + 2) * 6 * tw * c].reshape((b - a, 4 * th + 2, 6, tw, c))
        _split_columns(x[a:b], top, left, xs)
        v = v_flat[:ALPHA * ALPHA * p * c].reshape((ALPHA * ALPHA, p, c))
        _input_transform(xs, k, v)
        m = m_flat[:ALPHA * ALPHA * p * oc].reshape((ALPHA * ALPHA, p, oc))
        _point_gemms(gemm, False, v, ut, m, zero)
        ys = ys_flat[:(b - a) * 4 * th * 4 * tw * oc].reshape((b - a, 4 * th, 4, tw, oc))
        _output_transform(m, k, ys)
        _merge_columns(ys, 0, 0, bias, y[a:b])


@numba.njit(nogil=True, cache=True)
def _backward_compiled(gemm, x, top, left, u, dy, dx, k, step, xs_flat, v_flat, g_flat, m_flat, du):
    """`transformed_backward` as one compiled call: du [36, C, OC] written, and dx unless it is
    empty (no one reads it)."""
    n, c, oc = x.shape[0], x.shape[1], u.shape[1]
    th, tw = (dy.shape[2] + M - 1) // M, (dy.shape[3] + M - 1) // M
    zero, one = du.dtype.type(0), du.dtype.type(1)
    for a in range(0, n, step):
        b = min(n, a + step)
        p = (b - a) * th * tw
        xs = xs_flat[:(b - a) * (4 * th + 2) * 6 * tw * c].reshape((b - a, 4 * th + 2, 6, tw, c))
        _split_columns(x[a:b], top, left, xs)
        v = v_flat[:ALPHA * ALPHA * p * c].reshape((ALPHA * ALPHA, p, c))
        _input_transform(xs, k, v)
        gs = g_flat[:(b - a) * 4 * th * 4 * tw * oc].reshape((b - a, 4 * th, 4, tw, oc))
        _split_columns(dy[a:b], 0, 0, gs)
        dm = m_flat[:ALPHA * ALPHA * p * oc].reshape((ALPHA * ALPHA, p, oc))
        _grad_transform(gs, k, dm)
        _point_gemms(gemm, True, v, dm, du, zero if a == 0 else one)
        if dx.size:  # v and xs are free now: the input's gradient goes through them
            _point_gemms(gemm, False, dm, u, v, zero)
            _input_grad_transform(v, k, xs)
            _merge_columns(xs, top, left, np.empty(0, dx.dtype), dx[a:b])


@numba.njit(nogil=True, inline="always")
def _share(flat, i, parts):
    """Part i's share of a flat buffer cut into `parts` equal shares."""
    size = flat.size // parts
    return flat[i * size:(i + 1) * size]


@numba.njit(nogil=True, cache=True, parallel=True)
def _forward_parts(gemm, x, top, left, ut, bias, y, k, step, xs_flat, v_flat, m_flat, ys_flat, cuts):
    """_forward_compiled on each part [cuts[i], cuts[i+1]) of the samples in parallel, each with
    its share of the buffers."""
    parts = len(cuts) - 1
    for i in numba.prange(parts):
        a, b = cuts[i], cuts[i + 1]
        _forward_compiled(gemm, x[a:b], top, left, ut, bias, y[a:b], k, step, _share(xs_flat, i, parts),
                          _share(v_flat, i, parts), _share(m_flat, i, parts), _share(ys_flat, i, parts))


@numba.njit(nogil=True, cache=True, parallel=True)
def _backward_parts(gemm, x, top, left, u, dy, dx, k, step, xs_flat, v_flat, g_flat, m_flat, du, cuts):
    """_backward_compiled on each part [cuts[i], cuts[i+1]) of the samples in parallel, part i's
    dU into du[i]."""
    parts = len(cuts) - 1
    for i in numba.prange(parts):
        a, b = cuts[i], cuts[i + 1]
        _backward_compiled(gemm, x[a:b], top, left, u, dy[a:b], dx[a:b] if dx.size else dx, k, step,
                           _share(xs_flat, i, parts), _share(v_flat, i, parts), _share(g_flat, i, parts),
                           _share(m_flat, i, parts), du[i])


@functools.cache   # the types' construction alone took 15 us a call
def _compile(dtype) -> None:
    """The four compiled kernels for float type `dtype`, where numba can call its GEMM
    (ops/per_float.py)."""
    i64, cuts = numba.types.int64, array(np.int64, 1)

    def start(t):   # the arguments every kernel starts with: the GEMM, x (contiguous: 1-2% faster), top, left
        return numba.typeof(blas.gemm(t)), array(t, 4, layout="C"), i64, i64

    def each(signature):   # one version: y, dy and dx strided (a cout tile's are), measured 1-2% slower
        return lambda t: [] if blas.gemm(t) is None else [signature(t)]

    def forward_args(t):   # ... ut, bias, y, the constants, step, the four scratch buffers
        return (*start(t), array(t, 3, layout="C"), array(t, 1), array(t, 4, True),
                numba.typeof(_consts(t)), i64, *[array(t, 1, True, "C")] * 4)

    def backward_args(t):   # ... u, dy, dx, the constants, step, the four scratch buffers
        return (*start(t), array(t, 3, layout="C"), array(t, 4), array(t, 4, True),
                numba.typeof(_consts(t)), i64, *[array(t, 1, True, "C")] * 4)

    compile_per_float(_forward_compiled, each(forward_args), dtype)
    compile_per_float(_forward_parts, each(lambda t: (*forward_args(t), cuts)), dtype)
    compile_per_float(_backward_compiled, each(lambda t: (*backward_args(t), array(t, 3, True, "C"))), dtype)
    compile_per_float(_backward_parts, each(lambda t: (*backward_args(t), array(t, 4, True, "C"), cuts)), dtype)


def forward(x, w, top_left, y, bias=None, most_parts: int = 1) -> None:
    """y [N, OC, OH, OW] = the stride-1 3x3 convolution of x [N, C, H, W] (padded virtually by
    top_left = (top, left), zeros past its end) with w [OC, C, 3, 3], plus bias [OC] if given;
    the samples cut into at most `most_parts` parts, one per core of the task."""
    n, oc = x.shape[0], w.shape[0]
    th, tw = blocks(y.shape[2:])
    bias = np.empty(0, x.dtype) if bias is None else bias
    scratch = {"m": (ALPHA * ALPHA, th * tw, oc), "y": (4 * th, 4, tw, oc)}
    gemm = blas.gemm(x.dtype)
    if gemm is None:
        with cpu_pool.blas_on_one_thread():
            ut = filter_transform(w, channels_last=True)
        cpu_pool.in_parts(lambda a, b: _forward_matmul(x[a:b], ut, top_left, y[a:b], bias, scratch), n, most_parts)
        return
    _compile(x.dtype)
    x = np.ascontiguousarray(x)
    threads, cuts = batch_parts(n, most_parts)
    step, buf = _buffers(x[:cuts[1]], (th, tw), scratch)
    flat = {name: np.empty(threads * a.size, a.dtype) for name, a in buf.flat.items()}
    with cpu_pool.blas_on_one_thread():
        ut = filter_transform(w, channels_last=True)
        args = (gemm, x, top_left[0], top_left[1], ut, bias, y, _consts(x.dtype), step,
                flat["x"], flat["v"], flat["m"], flat["y"])
        if threads == 1:
            _forward_compiled(*args)
        else:
            _forward_parts(*args, cuts)


def _forward_matmul(x, ut, top_left, y, bias, scratch: dict) -> None:
    """`forward` of one part where numpy's BLAS cannot be called from numba: the compiled steps
    with np.matmul between them."""
    oc = ut.shape[2]
    th, tw = blocks(y.shape[2:])
    k = _consts(x.dtype)
    for a, b, _, v, buf in _transformed_input(x, top_left, (th, tw), scratch):
        m = np.matmul(v, ut, out=buf.get("m", b - a, (ALPHA * ALPHA, (b - a) * th * tw, oc)))
        ys = buf.get("y", b - a, (b - a, 4 * th, 4, tw, oc))
        _output_transform(m, k, ys)
        _merge_columns(ys, 0, 0, bias, y[a:b])


def backward(x, w, dy, top_left, dx, most_parts: int = 1):
    """dw [OC, C, 3, 3] of `forward` for output gradient dy [N, OC, OH, OW], and dx [N, C, H, W]
    written (unless dx is None); the samples cut into at most `most_parts` parts, one per core
    of the task, whose filter gradients (transformed) are added and turned into dw once."""
    n, c, oc = x.shape[0], x.shape[1], w.shape[0]
    th, tw = blocks(dy.shape[2:])
    scratch = {"g": (4 * th, 4, tw, oc), "m": (ALPHA * ALPHA, th * tw, oc)}
    gemm = blas.gemm(x.dtype)
    if gemm is None:
        with cpu_pool.blas_on_one_thread():
            u = filter_transform(w)
        du = sum(cpu_pool.in_parts(lambda a, b: _backward_matmul(x[a:b], u, dy[a:b], top_left,
                                                                 None if dx is None else dx[a:b], scratch),
                                   n, most_parts))
        with cpu_pool.blas_on_one_thread():
            return filter_gradient(du)
    _compile(x.dtype)
    x = np.ascontiguousarray(x)
    threads, cuts = batch_parts(n, most_parts)
    step, buf = _buffers(x[:cuts[1]], (th, tw), scratch)
    flat = {name: np.empty(threads * a.size, a.dtype) for name, a in buf.flat.items()}
    du = np.empty((threads, ALPHA * ALPHA, c, oc), x.dtype)
    with cpu_pool.blas_on_one_thread():
        u = filter_transform(w)
        args = (gemm, x, top_left[0], top_left[1], u, dy, np.empty((0, 0, 0, 0), x.dtype) if dx is None else dx,
                _consts(x.dtype), step, flat["x"], flat["v"], flat["g"], flat["m"])
        if threads == 1:
            _backward_compiled(*args, du[0])
        else:
            _backward_parts(*args, du, cuts)
        return filter_gradient(du[0] if threads == 1 else du.sum(axis=0))


def _backward_matmul(x, u, dy, top_left, dx, scratch: dict):
    """`backward` of one part up to the filter gradient, where numpy's BLAS cannot be called from
    numba: dU [36, C, OC], the gradient of the transformed filters u = filter_transform(w)
    [36, OC, C], with dx written (unless dx is None)."""
    c, oc = x.shape[1], u.shape[1]
    th, tw = blocks(dy.shape[2:])
    k = _consts(x.dtype)
    du = np.empty((ALPHA * ALPHA, c, oc), x.dtype)
    for a, b, xs, v, buf in _transformed_input(x, top_left, (th, tw), scratch):
        gs = buf.get("g", b - a, (b - a, 4 * th, 4, tw, oc))
        _split_columns(dy[a:b], 0, 0, gs)
        dm = buf.get("m", b - a, (ALPHA * ALPHA, (b - a) * th * tw, oc))
        _grad_transform(gs, k, dm)
        if a == 0:
            np.matmul(v.swapaxes(1, 2), dm, out=du)
        else:
            du += np.matmul(v.swapaxes(1, 2), dm)
        if dx is not None:  # v and xs are free now: the input's gradient goes through them
            np.matmul(dm, u, out=v)
            _input_grad_transform(v, k, xs)
            _merge_columns(xs, top_left[0], top_left[1], np.empty(0, x.dtype), dx[a:b])
    return du
