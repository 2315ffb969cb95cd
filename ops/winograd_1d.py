"""Winograd F(m, r) along one axis: 1xr and rx1 stride-1 convolutions (Inception's 1x7, 7x1,
1x3 and 3x1) as one GEMM per point of a block, on the CPU.

Along the convolved axis, each block of m outputs comes from the n = m + r - 1 (padded) inputs
under it. With the block's inputs d transformed to B^T d and each filter g to G g, the outputs
are A^T (G g * B^T d), and summed over input channels the elementwise product is one GEMM for
each of the n points xi,

    M[xi] = V[xi] @ U[xi]        [blocks, C] @ [C, OC]  ->  [blocks, OC],

n/m multiplies an output where a direct convolution has r: 8/2 against 7 for F(2, 7), 6/4
against 3 for F(4, 3). Backward is the exact adjoint (two GEMMs per xi), as in ops/winograd.py.

The transforms are small matrices (n x n at most) applied to every block. One numba kernel
gathers each block's places (its n inputs along the axis, all channels) from a row of the image
and applies the matrix to them, writing V[xi] [blocks, C] for every point (B^T for the input,
A for the output's gradient); another applies a matrix to M's points block by block and adds
the results back into the image's rows (A^T for the output, B for the input's gradient;
overlapping blocks share r - 1 inputs).

The matrices are built exactly (fractions) from the interpolation points, by the modified
Toom-Cook construction (one point at infinity; Lavin & Gray, 2015). Float32 results are within
a few 1e-6 of the outputs' scale for the r here (tests/test_winograd_1d.py against float64): F(3, 7)
would save a quarter more multiplies, but its error is 1.2-1.9e-5.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numba
import numpy as np

from ops import winograd

#: filter length r -> (outputs per block m, the finite interpolation points)
POINTS = {
    3: (4, (0, 1, -1, 2, -2)),
    7: (2, (0, 1, -1, 2, -2, Fraction(1, 2), Fraction(-1, 2))),
}


def _poly_times(a: list, b: list) -> list:
    """The coefficients (lowest power first) of the product of two polynomials."""
    out = [Fraction(0)] * (len(a) + len(b) - 1)
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            out[i + j] += x * y
    return out


def _poly_of_roots(roots) -> list:
    """The coefficients of prod (x - root), lowest power first."""
    poly = [Fraction(1)]
    for q in roots:
        poly = _poly_times(poly, [-q, Fraction(1)])
    return poly


def transforms(m: int, r: int, points) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(A^T [m, n], G [n, r], B^T [n, n]) of F(m, r) at the n - 1 finite `points` and infinity:
    y = A^T ((G g) * (B^T d)) is the correlation y[i] = sum_k g[k] d[i + k] of n inputs d."""
    pts = [Fraction(p) for p in points]
    n = m + r - 1
    if len(pts) != n - 1 or len(set(pts)) != len(pts):
        raise ValueError(f"winograd_1d: F({m}, {r}) needs {n - 1} distinct finite points, got {points!r}")
    at = [[p ** i for p in pts] + [Fraction(int(i == m - 1))] for i in range(m)]
    g = []
    for j, p in enumerate(pts):
        scale = math.prod((p - q for k, q in enumerate(pts) if k != j), start=Fraction(1))
        g.append([p ** c / scale for c in range(r)])
    g.append([Fraction(int(c == r - 1)) for c in range(r)])
    bt = [_poly_of_roots(q for k, q in enumerate(pts) if k != j) + [Fraction(0)] for j in range(n - 1)]
    bt.append(_poly_of_roots(pts))
    return tuple(np.array(a, np.float64) for a in (at, g, bt))


#: r -> (m, A^T, G, B^T) in float64
_MATRICES = {r: (m, *transforms(m, r, pts)) for r, (m, pts) in POINTS.items()}
#: (r, dtype) -> (A^T, A, B^T, B, G) in that dtype, contiguous
_CAST: dict = {}


def _cast(r: int, dtype) -> tuple:
    key = (r, np.dtype(dtype))
    if key not in _CAST:
        _, at, g, bt = _MATRICES[r]
        _CAST[key] = tuple(np.ascontiguousarray(a, dtype) for a in (at, at.T, bt, bt.T, g))
    return _CAST[key]


def supports(r: int) -> bool:
    """Whether a filter of length r has a transform here."""
    return r in _MATRICES


def blocks(length: int, r: int) -> int:
    """How many blocks of m outputs cover `length` outputs (the last one may stick out)."""
    return -(-length // _MATRICES[r][0])


# The two kernels below go through a row of the image at a time, all channels: the row is
# copied into (or summed in) a block [W, C] in cache, so that each place gets a contiguous run
# of channels and the image is read and written a row at a time. (Channel by channel at one
# pixel strides the image by a plane, 4 KiB at 32x32, where every access missed the cache:
# 5-12x the time.)
@numba.njit(nogil=True, cache=True, error_model="numpy", fastmath={"contract"})
def split_transformed(x, left, m, mat, out):
    """out[p, n, h, t, c] = sum over s of mat[p, s] * x[n, c, h, m*t + s - left] (0 outside x):
    the S places of each block (t) of a row, mat [P, S] applied to them in cache. (A split into
    places and a GEMM with the matrix over them made a buffer 4 times the image more; one
    core, 16 samples of Inception's 1x7: 3.6 against 4.6 ms.) x [N, C, H, W] (any strides),
    out [P, N, H, T, C]."""
    n_, c_, h_, w_ = x.shape
    p_, s_ = mat.shape
    t_ = out.shape[3]
    block = np.empty((w_, c_), out.dtype)   # block[w, c] = x[n, c, h, w]
    acc = np.empty(c_, out.dtype)
    for n in range(n_):
        for h in range(h_):
            for c in range(c_):
                row = x[n, c, h]
                for w in range(w_):
                    block[w, c] = row[w]
            for t in range(t_):
                for p in range(p_):
                    acc[:] = 0
                    for s in range(s_):
                        iw = m * t + s - left
                        k = mat[p, s]
                        if 0 <= iw < w_ and k != 0:
                            src = block[iw]
                            for c in range(c_):
                                acc[c] += k * src[c]
                    dst = out[p, n, h, t]
                    for c in range(c_):
                        dst[c] = acc[c]


@numba.njit(nogil=True, cache=True, error_model="numpy", fastmath={"contract"})
def merge_transformed(z, mat, left, m, bias, out):
    """out[n, c, h, j] = bias[c] (none if bias is empty) + the sum over the places (s, t) with
    m*t + s = j + left of sum over p of mat[s, p] * z[p, n, h, t, c]: mat [S, P] applied to each
    block and the places added into the row, in cache (the adjoint of split_transformed with
    mat transposed). z [P, N, H, T, C], out [N, C, H, W] (any strides)."""
    n_, c_, h_, w_ = out.shape
    s_, p_ = mat.shape
    t_ = z.shape[3]
    b = bias if bias.size else np.zeros(c_, out.dtype)
    block = np.empty((w_, c_), out.dtype)   # block[j, c] = out[n, c, h, j]
    for n in range(n_):
        for h in range(h_):
            for j in range(w_):
                acc = block[j]
                for c in range(c_):
                    acc[c] = b[c]
            for t in range(t_):
                for s in range(s_):
                    j = m * t + s - left
                    if 0 <= j < w_:
                        acc = block[j]
                        for p in range(p_):
                            k = mat[s, p]
                            if k != 0:
                                src = z[p, n, h, t]
                                for c in range(c_):
                                    acc[c] += k * src[c]
            for c in range(c_):
                row = out[n, c, h]
                for j in range(w_):
                    row[j] = block[j, c]


def filter_transform(g):
    """U = G g of each filter g [OC, C, r] (the taps of a 1xr or rx1 filter in order), as
    [n, OC, C]: one GEMM for all of them, the filters read in place (as g^T)."""
    oc, c, r = g.shape
    return np.matmul(_cast(r, g.dtype)[4], g.reshape(oc * c, r).T).reshape(-1, oc, c)


def filter_gradient(du, r: int):
    """dg [OC, C, r] from du [n, OC, C], the gradient of U = filter_transform(g): one GEMM,
    dU^T G, whose result is dg in place."""
    n, oc, c = du.shape
    return np.matmul(du.reshape(n, oc * c).T, _cast(r, du.dtype)[4]).reshape(oc, c, r)


def _transformed_input(x, r: int, left: int, t_: int, scratch: dict):
    """Per chunk of samples [a, b) of x [N, C, H, W] (ops/winograd.py's chunks and buffers):
    (a, b, v, buf): the image's blocks transformed (v [n, (b-a)*H*T, C]), and buffers for
    `scratch` (name -> (points, size per sample)) that the chunk's other steps take from buf."""
    m = _MATRICES[r][0]
    n = m + r - 1
    c, h = x.shape[1], x.shape[2]
    sizes = {"v": (n, h * t_ * c), **scratch}
    chunks = winograd.sample_chunks(x.shape[0], sum(p * per for p, per in sizes.values()) * x.itemsize, h * t_)
    buf = winograd.Buffers(x.dtype, chunks[0][1] - chunks[0][0], sizes)
    bt = _cast(r, x.dtype)[2]
    for a, b in chunks:
        v = buf.get("v", b - a, (n, -1, c))
        split_transformed(x[a:b], left, m, bt, v.reshape(n, b - a, h, t_, c))
        yield a, b, v, buf


def forward(x, r: int, left: int, y, bias, u) -> None:
    """y [N, OC, H, OW] = the stride-1 correlation along the last axis of x [N, C, H, W] (padded
    virtually by `left`, zeros past its end) with the filters whose transform is
    u = filter_transform(g), plus bias [OC] if not None. For an rx1 convolution the caller
    passes x and y with their last two axes swapped (views)."""
    oc, h, ow = y.shape[1:]
    m = _MATRICES[r][0]
    n, t_ = m + r - 1, blocks(ow, r)
    at = _cast(r, x.dtype)[0]
    bias = np.empty(0, x.dtype) if bias is None else bias
    ut = u.swapaxes(1, 2)   # [n, C, OC], read transposed by the GEMMs
    scratch = {"m": (n, h * t_ * oc)}
    for a, b, v, buf in _transformed_input(x, r, left, t_, scratch):
        prod = np.matmul(v, ut, out=buf.get("m", b - a, (n, -1, oc)))
        merge_transformed(prod.reshape(n, b - a, h, t_, oc), at, 0, m, bias, y[a:b])


def transformed_backward(x, r: int, left: int, u, dy, dx):
    """The gradient dU [n, OC, C] of the transformed filters u = filter_transform(g) [n, OC, C]
    (parts of a batch add theirs; filter_gradient turns the sum into dg), with dx written unless
    it is None. Axes as in `forward`."""
    c, (oc, h, ow) = x.shape[1], dy.shape[1:]
    m = _MATRICES[r][0]
    n, t_ = m + r - 1, blocks(ow, r)
    _, a_, _, b_, _ = _cast(r, x.dtype)
    du = None
    scratch = {"m": (n, h * t_ * oc)}
    for a, b, v, buf in _transformed_input(x, r, left, t_, scratch):
        dm = buf.get("m", b - a, (n, -1, oc))
        split_transformed(dy[a:b], 0, m, a_, dm.reshape(n, b - a, h, t_, oc))
        if du is None:
            du = np.matmul(dm.swapaxes(1, 2), v)
        else:
            du += np.matmul(dm.swapaxes(1, 2), v)
        if dx is not None:  # v is free now: the input's gradient goes through it
            np.matmul(dm, u, out=v)
            merge_transformed(v.reshape(n, b - a, h, t_, c), b_, left, m, np.empty(0, x.dtype), dx[a:b])
    return du
