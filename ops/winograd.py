"""Winograd F(4x4, 3x3): a stride-1 3x3 convolution as 36 GEMMs on the CPU (Lavin & Gray, 2015).

Each 4x4 block of outputs comes from the 6x6 block of (padded) input under it: the input
block is transformed, d -> B^T d B, the filter g -> G g G^T, the two are multiplied
elementwise and brought back, m -> A^T m A. Summed over input channels, the elementwise
product is one GEMM for each of the 36 positions xi of a 6x6 block,

    M[xi] = U[xi] @ V[xi]        [OC, C] @ [C, blocks]  ->  [OC, blocks],

a quarter of a direct convolution's multiplies. Backward is the exact adjoint of those
steps (the output gradient transformed by A, two GEMMs per xi, the input gradient brought
back by B and added up where the 6x6 blocks overlap), so it too costs 36 GEMMs of the same
shape per product. Float32 results are within a few 1e-6 of the outputs' scale (measured
against float64 in tests/test_winograd.py). The block transforms are numba kernels over
contiguous rows; blocks are laid out [36, channels, blocks] with block (n, th, tw) at
(n * TH + th) * TW + tw, so the GEMMs read and write whole rows.
"""
from __future__ import annotations

import numba
import numpy as np

from ops.cpu_layout import flat_row, flat_rows

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


# Each kernel below works a plane (n, c) at a time: it gathers the plane's blocks into (or
# scatters them from) rows z[xi, c, blocks of the plane], one row per position xi of a block,
# through a padded copy of the plane; the transforms then run along those rows, contiguous and
# vectorized: first across the blocks' columns (xi = 6*i + j, j varies), then down their rows.
@numba.njit(nogil=True, cache=True)
def _input_to_blocks(x, shape, pads, n_blocks, k, out):
    """out[6*i + j, c, (n*TH + th)*TW + tw] = (B^T d B)[i, j] for the 6x6 block d of x at padded
    row 4*th and column 4*tw: x [N, C, H, W] (flat_rows) padded virtually by pads (top, left)
    and with zeros past its end."""
    n_, c_, h_, w_ = shape
    top, left = pads
    th_, tw_ = n_blocks
    nb = th_ * tw_
    _, sn, sc, sh = x
    plane = np.zeros((4 * th_ + 2, 4 * tw_ + 2), out.dtype)
    rows = min(h_, plane.shape[0] - top)
    take = max(0, min(w_, plane.shape[1] - left))
    blk = np.empty((36, nb), out.dtype)
    across = np.empty((36, nb), out.dtype)
    for n in range(n_):
        for c in range(c_):
            start = n * sn + c * sc
            for ih in range(rows):
                plane[top + ih, left:left + take] = flat_row(x, start + ih * sh, take)
            for i in range(6):
                for j in range(6):
                    dst = blk[6 * i + j]
                    for th in range(th_):
                        src = plane[4 * th + i]
                        for tw in range(tw_):
                            dst[th * tw_ + tw] = src[4 * tw + j]
            for i in range(6):
                r = 6 * i
                for t in range(nb):
                    (across[r, t], across[r + 1, t], across[r + 2, t], across[r + 3, t], across[r + 4, t],
                     across[r + 5, t]) = _bt(blk[r, t], blk[r + 1, t], blk[r + 2, t], blk[r + 3, t], blk[r + 4, t],
                                             blk[r + 5, t], k)
            for j in range(6):
                for t in range(nb):
                    (blk[j, t], blk[6 + j, t], blk[12 + j, t], blk[18 + j, t], blk[24 + j, t],
                     blk[30 + j, t]) = _bt(across[j, t], across[6 + j, t], across[12 + j, t], across[18 + j, t],
                                           across[24 + j, t], across[30 + j, t], k)
            for xi in range(36):
                out[xi, c, n * nb:(n + 1) * nb] = blk[xi]


@numba.njit(nogil=True, cache=True)
def _grad_to_blocks(dy, shape, n_blocks, k, out):
    """out[6*i + j, c, (n*TH + th)*TW + tw] = (A g A^T)[i, j] for the 4x4 block g of dy
    [N, C, OH, OW] (flat_rows) at row 4*th and column 4*tw, zeros past its end."""
    n_, c_, h_, w_ = shape
    th_, tw_ = n_blocks
    nb = th_ * tw_
    _, sn, sc, sh = dy
    plane = np.zeros((4 * th_, 4 * tw_), out.dtype)
    gathered = np.empty((16, nb), out.dtype)
    across = np.empty((24, nb), out.dtype)
    blk = np.empty((36, nb), out.dtype)
    for n in range(n_):
        for c in range(c_):
            start = n * sn + c * sc
            for ih in range(h_):
                plane[ih, :w_] = flat_row(dy, start + ih * sh, w_)
            for i in range(4):
                for j in range(4):
                    dst = gathered[4 * i + j]
                    for th in range(th_):
                        src = plane[4 * th + i]
                        for tw in range(tw_):
                            dst[th * tw_ + tw] = src[4 * tw + j]
            for i in range(4):
                r, q = 4 * i, 6 * i
                for t in range(nb):
                    (across[q, t], across[q + 1, t], across[q + 2, t], across[q + 3, t], across[q + 4, t],
                     across[q + 5, t]) = _a(gathered[r, t], gathered[r + 1, t], gathered[r + 2, t],
                                            gathered[r + 3, t], k)
            for j in range(6):
                for t in range(nb):
                    blk[j, t], blk[6 + j, t], blk[12 + j, t], blk[18 + j, t], blk[24 + j, t], blk[30 + j, t] = _a(
                        across[j, t], across[6 + j, t], across[12 + j, t], across[18 + j, t], k)
            for xi in range(36):
                out[xi, c, n * nb:(n + 1) * nb] = blk[xi]


@numba.njit(nogil=True, cache=True)
def _blocks_to_output(z, n_blocks, k, out):
    """out[n, c, 4*th + r, 4*tw + s] = (A^T z_block A)[r, s] for every block z_block =
    z[:, c, (n*TH + th)*TW + tw] (6x6); out [N, C, OH, OW], what falls past its end dropped."""
    n_, c_, h_, w_ = out.shape
    th_, tw_ = n_blocks
    nb = th_ * tw_
    zc = np.empty((36, nb), out.dtype)
    across = np.empty((24, nb), out.dtype)
    done = np.empty((16, nb), out.dtype)
    plane = np.empty((4 * th_, 4 * tw_), out.dtype)
    for n in range(n_):
        for c in range(c_):
            for xi in range(36):
                zc[xi] = z[xi, c, n * nb:(n + 1) * nb]
            for i in range(6):
                r, q = 6 * i, 4 * i
                for t in range(nb):
                    across[q, t], across[q + 1, t], across[q + 2, t], across[q + 3, t] = _at(
                        zc[r, t], zc[r + 1, t], zc[r + 2, t], zc[r + 3, t], zc[r + 4, t], zc[r + 5, t], k)
            for j in range(4):
                for t in range(nb):
                    done[j, t], done[4 + j, t], done[8 + j, t], done[12 + j, t] = _at(
                        across[j, t], across[4 + j, t], across[8 + j, t], across[12 + j, t], across[16 + j, t],
                        across[20 + j, t], k)
            for r in range(4):
                for s in range(4):
                    src = done[4 * r + s]
                    for th in range(th_):
                        dst = plane[4 * th + r]
                        for tw in range(tw_):
                            dst[4 * tw + s] = src[th * tw_ + tw]
            out[n, c] = plane[:h_, :w_]


@numba.njit(nogil=True, cache=True)
def _blocks_to_input(z, n_blocks, pads, k, out):
    """out[n, c, 4*th + i - top, 4*tw + j - left] += (B z_block B^T)[i, j] for every block
    z_block = z[:, c, (n*TH + th)*TW + tw] (6x6): the adjoint of _input_to_blocks. out
    [N, C, H, W]; what falls outside it is dropped, and the overlapping blocks add up."""
    n_, c_, h_, w_ = out.shape
    top, left = pads
    th_, tw_ = n_blocks
    nb = th_ * tw_
    plane = np.empty((4 * th_ + 2, 4 * tw_ + 2), out.dtype)
    rows = min(h_, plane.shape[0] - top)
    take = max(0, min(w_, plane.shape[1] - left))
    zc = np.empty((36, nb), out.dtype)
    across = np.empty((36, nb), out.dtype)
    done = np.empty((36, nb), out.dtype)
    for n in range(n_):
        for c in range(c_):
            for xi in range(36):
                zc[xi] = z[xi, c, n * nb:(n + 1) * nb]
            for i in range(6):
                r = 6 * i
                for t in range(nb):
                    (across[r, t], across[r + 1, t], across[r + 2, t], across[r + 3, t], across[r + 4, t],
                     across[r + 5, t]) = _b(zc[r, t], zc[r + 1, t], zc[r + 2, t], zc[r + 3, t], zc[r + 4, t],
                                            zc[r + 5, t], k)
            for j in range(6):
                for t in range(nb):
                    (done[j, t], done[6 + j, t], done[12 + j, t], done[18 + j, t], done[24 + j, t],
                     done[30 + j, t]) = _b(across[j, t], across[6 + j, t], across[12 + j, t], across[18 + j, t],
                                           across[24 + j, t], across[30 + j, t], k)
            plane[:] = 0
            for i in range(6):
                for j in range(6):
                    src = done[6 * i + j]
                    for th in range(th_):
                        dst = plane[4 * th + i]
                        for tw in range(tw_):
                            dst[4 * tw + j] += src[th * tw_ + tw]
            for ih in range(rows):
                out[n, c, ih, :take] += plane[top + ih, left:left + take]


def _consts(dtype) -> tuple:
    """The transforms' constants 2, 4, 5, 8 in `dtype`."""
    return tuple(np.dtype(dtype).type(v) for v in (2, 4, 5, 8))


def _sample_chunks(n: int, bytes_per_sample: int) -> list[tuple[int, int]]:
    """Sample ranges whose transformed blocks take about _CHUNK_BYTES (they stay in cache)."""
    step = max(1, _CHUNK_BYTES // max(1, bytes_per_sample))
    return [(a, min(n, a + step)) for a in range(0, n, step)]


def filter_transform(w):
    """U [36, OC, C] = G g G^T of each 3x3 filter g of w [OC, C, 3, 3]."""
    g = G.astype(w.dtype)
    return np.einsum("ai,ocij,bj->aboc", g, w, g, optimize=True).reshape(ALPHA * ALPHA, *w.shape[:2])


def _input_blocks(x, top_left, n_blocks):
    """V [36, C, N*TH*TW]: the input blocks of x [N, C, H, W] (padded by top_left), transformed."""
    n, c = x.shape[:2]
    v = np.empty((ALPHA * ALPHA, c, n * n_blocks[0] * n_blocks[1]), x.dtype)
    _input_to_blocks(flat_rows(x), x.shape, top_left, n_blocks, _consts(x.dtype), v)
    return v


def forward(x, w, top_left, y) -> None:
    """y [N, OC, OH, OW] = the stride-1 3x3 convolution of x [N, C, H, W] (padded virtually by
    top_left = (top, left), zeros past its end) with w [OC, C, 3, 3]."""
    n, c = x.shape[:2]
    oc = w.shape[0]
    nb = blocks(y.shape[2:])
    k = _consts(x.dtype)
    u = filter_transform(w)
    per_sample = ALPHA * ALPHA * (c + oc) * nb[0] * nb[1] * x.itemsize
    for a, b in _sample_chunks(n, per_sample):
        _blocks_to_output(np.matmul(u, _input_blocks(x[a:b], top_left, nb)), nb, k, y[a:b])


def backward(x, w, dy, top_left, dx):
    """dw [OC, C, 3, 3] of `forward` for output gradient dy [N, OC, OH, OW], and dx [N, C, H, W]
    written (unless dx is None)."""
    n, c = x.shape[:2]
    oc = w.shape[0]
    nb = blocks(dy.shape[2:])
    k = _consts(x.dtype)
    u_t = filter_transform(w).swapaxes(1, 2)
    du = np.zeros((ALPHA * ALPHA, oc, c), x.dtype)
    if dx is not None:
        dx[...] = 0
    per_sample = ALPHA * ALPHA * (2 * c + oc) * nb[0] * nb[1] * x.itemsize
    for a, b in _sample_chunks(n, per_sample):
        dm = np.empty((ALPHA * ALPHA, oc, (b - a) * nb[0] * nb[1]), x.dtype)
        _grad_to_blocks(flat_rows(dy[a:b]), dy[a:b].shape, nb, k, dm)
        v = _input_blocks(x[a:b], top_left, nb)
        du += np.matmul(dm, v.swapaxes(1, 2))
        if dx is not None:
            _blocks_to_input(np.matmul(u_t, dm, out=v), nb, top_left, k, dx[a:b])
    g = G.astype(x.dtype)
    dw = np.einsum("ai,aboc,bj->ocij", g, du.reshape(ALPHA, ALPHA, oc, c), g, optimize=True)
    return dw
