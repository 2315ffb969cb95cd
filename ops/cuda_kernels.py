"""Fused GPU kernels (cupy) for the operators whose array code made many passes and launches.

cupy's array code runs one kernel per operation, each a full pass over memory and a Python
launch: gelu's backward was eight of them, a softmax five, an LSTM step fifteen. Here each is
one kernel: element-wise ones as cupy ElementwiseKernels (any strides, broadcasting), per-row
ones (softmax, layer norm) as CUDA C++ with a block per row and warp-shuffle sums, per-channel
sums as ReductionKernels (batch norm's per-channel statistics one ElementwiseKernel over [C]
arrays, not twenty launches), max pooling as one thread per output (forward, with its argmax) and
one per input (backward, gathering the outputs whose argmax it is: no atomics, deterministic),
and convolution's im2col and col2im, with the columns of all samples side by side so that
forward and both gradients are one GEMM each, reading and writing the unpadded tile (col2im
gathers too: one pass, not one per window offset, and no padded buffer to zero and crop).
Sums accumulate in double. Kernels are compiled on first use and cached by cupy on disk.
`on_gpu(xp)` says whether the fused kernels apply: cupy itself, not numpy (nor the numpy under
another name that the tests use to run the array code on the CPU).
"""
from __future__ import annotations

import math

import numpy as np


def on_gpu(xp) -> bool:
    """Whether `xp` is cupy (the fused kernels run), not numpy under any name."""
    return getattr(xp, "__name__", "") == "cupy"


def _cupy():
    import cupy
    return cupy


_MADE: dict = {}


def _made(key, make):
    """The kernel under `key`, made by make() on first use."""
    kernel = _MADE.get(key)
    if kernel is None:
        kernel = _MADE[key] = make()
    return kernel


def _elementwise(name: str, ins: str, outs: str, body: str):
    return _made(name, lambda: _cupy().ElementwiseKernel(ins, outs, body, name))


# ---- activations -------------------------------------------------------------------------------
_SIGMOID = "(T)0.5 * tanh((T)0.5 * {0}) + (T)0.5"   # no overflow for large |a|, as the array code


def activation_forward(name: str, x):
    """y = f(x) for relu, sigmoid, tanh or gelu (exact erf form), one kernel."""
    body = {"relu": "y = x > (T)0 ? x : (T)0",
            "sigmoid": "y = " + _SIGMOID.format("x"),
            "tanh": "y = tanh(x)",
            "gelu": "y = (T)0.5 * x * ((T)1 + erf(x * (T)0.7071067811865476))"}[name]
    return _elementwise(f"taskrt_{name}_forward", "T x", "T y", body)(x)


def activation_backward(name: str, x, y, dy):
    """dL/dx from x, y = f(x) and dL/dy, one kernel: gelu reads x, the others y (x may then be
    None, as an op that fuses one saves only what its backward reads)."""
    if name == "gelu":
        body = ("T cdf = (T)0.5 * ((T)1 + erf(x * (T)0.7071067811865476));"
                "dx = dy * (cdf + x * exp((T)-0.5 * x * x) * (T)0.3989422804014327)")
        return _elementwise("taskrt_gelu_backward", "T x, T dy", "T dx", body)(x, dy)
    body = {"relu": "dx = y > (T)0 ? dy : (T)0",
            "sigmoid": "dx = dy * y * ((T)1 - y)",
            "tanh": "dx = dy * ((T)1 - y * y)"}[name]
    return _elementwise(f"taskrt_{name}_backward", "T y, T dy", "T dx", body)(y, dy)


# ---- per-row kernels: softmax and layer norm ---------------------------------------------------
_SOURCE = r"""
template<typename T> __device__ T neg_inf();
template<> __device__ float neg_inf<float>() { return -__int_as_float(0x7f800000); }
template<> __device__ double neg_inf<double>() { return -__longlong_as_double(0x7ff0000000000000LL); }

template<typename T> __device__ T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}
template<typename T> __device__ T warp_max(T v) {
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_down_sync(0xffffffffu, v, o));
    return v;
}

// The block's sum (or max) of each thread's v, returned to every thread; blockDim.x is a
// multiple of 32. The trailing barrier lets the next call reuse the shared slots.
template<typename T, bool MAX> __device__ T block_reduce(T v) {
    __shared__ T part[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = MAX ? warp_max(v) : warp_sum(v);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (warp == 0) {
        T w = lane < warps ? part[lane] : (MAX ? neg_inf<T>() : (T)0);
        w = MAX ? warp_max(w) : warp_sum(w);
        if (lane == 0) part[0] = w;
    }
    __syncthreads();
    T r = part[0];
    __syncthreads();
    return r;
}

// y = softmax(x) over rows of n contiguous values, a block per row. period > 0: row r holds the
// scores of query first + r % period, which sees keys 0 .. first + r % period only (others 0).
template<typename T> __global__ void softmax_rows(const T* x, T* y, int n, int period, long long first) {
    const T* xr = x + (long long)blockIdx.x * n;
    T* yr = y + (long long)blockIdx.x * n;
    int limit = n;
    if (period > 0) {
        long long q = first + blockIdx.x % period;
        limit = q + 1 < n ? (int)(q + 1) : n;
    }
    T m = neg_inf<T>();
    for (int i = threadIdx.x; i < limit; i += blockDim.x) m = fmax(m, xr[i]);
    m = block_reduce<T, true>(m);
    double s = 0;
    for (int i = threadIdx.x; i < limit; i += blockDim.x) {
        T e = exp(xr[i] - m);
        yr[i] = e;
        s += e;
    }
    T inv = (T)(1.0 / block_reduce<double, false>(s));
    for (int i = threadIdx.x; i < limit; i += blockDim.x) yr[i] *= inv;
    for (int i = limit + threadIdx.x; i < n; i += blockDim.x) yr[i] = (T)0;
}

// dx = y * (dy - sum(dy * y)) over rows of n contiguous values, a block per row.
template<typename T> __global__ void softmax_grad_rows(const T* y, const T* dy, T* dx, int n) {
    long long base = (long long)blockIdx.x * n;
    double s = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += (double)dy[base + i] * y[base + i];
    T t = (T)block_reduce<double, false>(s);
    for (int i = threadIdx.x; i < n; i += blockDim.x) dx[base + i] = y[base + i] * (dy[base + i] - t);
}

// Layer norm over rows of d contiguous values, a block per row: mean and rstd from two passes
// in double; y = (x - mean) * rstd (* w + b when affine).
template<typename T> __global__ void layer_norm_forward(const T* x, int d, double eps, const T* w, const T* b,
                                                        int affine, T* y, T* mean, T* rstd) {
    long long base = (long long)blockIdx.x * d;
    double s = 0;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += (double)x[base + i];
    double m = block_reduce<double, false>(s) / d;
    double v = 0;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        double t = (double)x[base + i] - m;
        v += t * t;
    }
    double rs = rsqrt(block_reduce<double, false>(v) / d + eps);
    T mt = (T)m, rt = (T)rs;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        T xh = (x[base + i] - mt) * rt;
        y[base + i] = affine ? xh * w[i] + b[i] : xh;
    }
    if (threadIdx.x == 0) {
        mean[blockIdx.x] = mt;
        rstd[blockIdx.x] = rt;
    }
}

// dx of layer norm per row: g = dy (* w when affine), xhat = (x - mean) * rstd,
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)).
template<typename T> __global__ void layer_norm_backward(const T* x, const T* dy, int d, const T* w, int affine,
                                                         const T* mean, const T* rstd, T* dx) {
    long long base = (long long)blockIdx.x * d;
    T m = mean[blockIdx.x], r = rstd[blockIdx.x];
    double sg = 0, sgx = 0;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        T g = affine ? dy[base + i] * w[i] : dy[base + i];
        sg += g;
        sgx += (double)g * ((x[base + i] - m) * r);
    }
    T a = (T)(block_reduce<double, false>(sg) / d);
    T c = (T)(block_reduce<double, false>(sgx) / d);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        T g = affine ? dy[base + i] * w[i] : dy[base + i];
        dx[base + i] = r * (g - a - (x[base + i] - m) * r * c);
    }
}

// Layer norm's weight gradients as column sums of a [rows, d] matrix, in double: a block of
// 32 x 8 threads takes a strip of 32 columns (reads coalesced along a row) over its share of
// the rows; part_w / part_b [gridDim.y, d] get each share's sums of dy * xhat and of dy.
template<typename T> __global__ void layer_norm_weight_grads(const T* x, const T* dy, const T* mean, const T* rstd,
                                                             long long rows, int d, double* part_w,
                                                             double* part_b) {
    __shared__ double sw[8][33], sb[8][33];
    int j = blockIdx.x * 32 + threadIdx.x;
    double aw = 0, ab = 0;
    if (j < d) {
        for (long long r = blockIdx.y * 8LL + threadIdx.y; r < rows; r += 8LL * gridDim.y) {
            T g = dy[r * d + j];
            aw += (double)g * (double)((x[r * d + j] - mean[r]) * rstd[r]);
            ab += g;
        }
    }
    sw[threadIdx.y][threadIdx.x] = aw;
    sb[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y == 0 && j < d) {
        for (int k = 1; k < 8; ++k) {
            aw += sw[k][threadIdx.x];
            ab += sb[k][threadIdx.x];
        }
        part_w[blockIdx.y * (long long)d + j] = aw;
        part_b[blockIdx.y * (long long)d + j] = ab;
    }
}

// Max pooling, a thread per output of [planes, oh, ow] over contiguous [planes, h, w] input whose
// windows start at (o * stride - top/left), clipped to the input: the max (NaN wins, the last
// one, as PyTorch) and its index ih * w + iw in the plane.
template<typename T> __global__ void max_pool_forward(const T* x, long long total, int h, int w, int oh, int ow,
                                                      int kh, int kw, int sh, int sw, int top, int left,
                                                      T* y, int* arg) {
    long long o = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= total) return;
    int ox = o % ow, oy = (o / ow) % oh;
    long long plane = o / ((long long)ow * oh);
    const T* xp = x + plane * h * w;
    int y0 = max(oy * sh - top, 0), y1 = min(oy * sh - top + kh, h);
    int x0 = max(ox * sw - left, 0), x1 = min(ox * sw - left + kw, w);
    T m = neg_inf<T>();
    int best = y0 * w + x0;
    for (int i = y0; i < y1; ++i)
        for (int j = x0; j < x1; ++j) {
            T v = xp[i * w + j];
            if (v > m || v != v) { m = v; best = i * w + j; }
        }
    y[o] = m;
    arg[o] = best;
}

// Its backward, a thread per input: the sum of dy over the outputs whose window holds this
// input and whose argmax it is.
template<typename T> __global__ void max_pool_backward(const T* dy, const int* arg, long long total, int h, int w,
                                                       int oh, int ow, int kh, int kw, int sh, int sw, int top,
                                                       int left, T* dx) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    int ix = i % w, iy = (i / w) % h;
    long long plane = i / ((long long)w * h);
    // outputs o with o * s - pad <= i < o * s - pad + k
    int ya = iy + top - kh + 1, xa = ix + left - kw + 1;
    int oy0 = ya <= 0 ? 0 : (ya + sh - 1) / sh, oy1 = min((iy + top) / sh + 1, oh);
    int ox0 = xa <= 0 ? 0 : (xa + sw - 1) / sw, ox1 = min((ix + left) / sw + 1, ow);
    int me = iy * w + ix;
    const T* dyp = dy + plane * oh * ow;
    const int* ap = arg + plane * oh * ow;
    T s = (T)0;
    for (int a = oy0; a < oy1; ++a)
        for (int b = ox0; b < ox1; ++b)
            if (ap[a * ow + b] == me) s += dyp[a * ow + b];
    dx[i] = s;
}

// Convolution's columns as one matrix [C * kh * kw, N * oh * ow] (row (c, i, j), column
// (n, oy, ox)), a thread per value, from the unpadded input [N, C, h, w] whose windows start at
// (oy * sh - top, ox * sw - left): values outside it are the padding's zeros (no padded copy).
// Forward and both gradients are then one GEMM each, not one per sample.
template<typename T> __global__ void im2col(const T* x, long long total, int n, int c, int h, int w, int kh,
                                           int kw, int sh, int sw, int top, int left, int oh, int ow, T* cols) {
    long long o = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= total) return;
    int ox = o % ow;
    long long r = o / ow;
    int oy = r % oh;
    r /= oh;
    int s = r % n;
    r /= n;
    int j = r % kw;
    r /= kw;
    int i = r % kh;
    long long ch = r / kh;
    int yy = oy * sh + i - top, xx = ox * sw + j - left;
    cols[o] = yy >= 0 && yy < h && xx >= 0 && xx < w ? x[((s * (long long)c + ch) * h + yy) * w + xx] : (T)0;
}

// Its adjoint, a thread per value of the unpadded input [N, C, h, w]: out = the sum of the
// columns' values that im2col copied from it (written, not added: no zeroed buffer first).
template<typename T> __global__ void col2im(const T* cols, long long total, int n, int c, int h, int w, int kh,
                                           int kw, int sh, int sw, int top, int left, int oh, int ow, T* out) {
    long long o = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= total) return;
    int xx = o % w + left, yy = (o / w) % h + top;   // in the padded input's coordinates
    long long plane = o / ((long long)w * h);
    int s = plane / c, ch = plane % c;
    T acc = (T)0;
    for (int i = 0; i < kh; ++i) {
        int dy = yy - i;
        if (dy < 0 || dy % sh != 0 || dy / sh >= oh) continue;
        for (int j = 0; j < kw; ++j) {
            int dx = xx - j;
            if (dx < 0 || dx % sw != 0 || dx / sw >= ow) continue;
            acc += cols[((((long long)ch * kh + i) * kw + j) * n + s) * oh * ow + (long long)(dy / sh) * ow + dx / sw];
        }
    }
    out[o] = acc;
}

template<typename T> __device__ T sigmoid(T a) { return (T)0.5 * tanh((T)0.5 * a) + (T)0.5; }

// One LSTM step, a thread per (sample b, unit j), on rows of b's values (each array's row
// stride given): gates g (the input projections, made the activations in place) plus
// rec = h_{t-1} W_hh^T ([batch, 4h]) plus bias; c = f * c_prev + i * z, tc = tanh(c), hy = o * tc,
// also into hc ([batch, h]), the next step's GEMM input as one block (a strided one is copied).
template<typename T> __global__ void lstm_step_forward(T* g, long long gs, const T* rec, const T* bias,
                                                       const T* cp, long long ps, T* c, long long cs, T* tc,
                                                       long long ts, T* hy, long long hs, T* hc, int batch,
                                                       int h) {
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= (long long)batch * h) return;
    long long b = k / h;
    int j = k % h;
    T* gr = g + b * gs;
    const T* rr = rec + b * 4LL * h;
    T ai = sigmoid(gr[j] + rr[j] + bias[j]);
    T af = sigmoid(gr[h + j] + rr[h + j] + bias[h + j]);
    T az = tanh(gr[2 * h + j] + rr[2 * h + j] + bias[2 * h + j]);
    T ao = sigmoid(gr[3 * h + j] + rr[3 * h + j] + bias[3 * h + j]);
    gr[j] = ai;
    gr[h + j] = af;
    gr[2 * h + j] = az;
    gr[3 * h + j] = ao;
    T cc = af * cp[b * ps + j] + ai * az;
    T t = tanh(cc);
    c[b * cs + j] = cc;
    tc[b * ts + j] = t;
    hy[b * hs + j] = hc[k] = ao * t;
}

// Its backward: the gates' activations become their pre-activation gradients (also into gc,
// [batch, 4h], the GEMM input of dh for the step before), dc that of c_prev; dh includes dy's step.
template<typename T> __global__ void lstm_step_backward(T* g, long long gs, const T* tc, long long ts,
                                                        const T* cp, long long ps, const T* dh, long long hs,
                                                        T* dc, long long cs, T* gc, int batch, int h) {
    long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= (long long)batch * h) return;
    long long b = k / h;
    int j = k % h;
    T* gr = g + b * gs;
    T ai = gr[j], af = gr[h + j], az = gr[2 * h + j], ao = gr[3 * h + j], t = tc[b * ts + j];
    T dhv = dh[b * hs + j];
    T d = dc[b * cs + j] + dhv * ao * ((T)1 - t * t);
    T* gcr = gc + b * 4LL * h;
    gr[3 * h + j] = gcr[3 * h + j] = dhv * t * ao * ((T)1 - ao);
    gr[j] = gcr[j] = d * az * ai * ((T)1 - ai);
    gr[2 * h + j] = gcr[2 * h + j] = d * ai * ((T)1 - az * az);
    gr[h + j] = gcr[h + j] = d * cp[b * ps + j] * af * ((T)1 - af);
    dc[b * cs + j] = d * af;
}
"""
_KERNELS = ("softmax_rows", "softmax_grad_rows", "layer_norm_forward", "layer_norm_backward",
            "layer_norm_weight_grads", "max_pool_forward", "max_pool_backward", "im2col", "col2im",
            "lstm_step_forward", "lstm_step_backward")
_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


def _raw(name: str, dtype):
    """The CUDA C++ kernel `name` of _SOURCE for float32 or float64 (looked up once: cupy's
    get_function took 4 us of host time a call, the LSTM 80 calls a pass)."""
    key = (name, np.dtype(dtype))
    function = _MADE.get(key)
    if function is None:
        module = _made("module", lambda: _cupy().RawModule(
            code=_SOURCE,
            name_expressions=[f"{k}<{t}>" for k in _KERNELS for t in _TYPES.values()]))
        function = _MADE[key] = module.get_function(f"{name}<{_TYPES[key[1]]}>")
    return function


def supports(*arrays) -> bool:
    """Whether the CUDA C++ kernels take these arrays: one dtype, float32 or float64, not empty."""
    dtype = arrays[0].dtype
    return dtype in _TYPES and arrays[0].size > 0 and all(a.dtype == dtype for a in arrays)


def _threads(n: int) -> int:
    """Threads of a block working on rows of n values: a multiple of 32, at most 256."""
    return min(256, 32 * max(1, math.ceil(n / 32)))


def _blocks(total: int) -> tuple[int]:
    """Blocks of 256 threads for a thread per value of `total`."""
    return (math.ceil(total / 256),)


def _contiguous(a):
    return _cupy().ascontiguousarray(a)


def _into(out, result) -> None:
    """out[...] = result unless result is out."""
    if result is not out:
        out[...] = result


# ---- GEMM through cuBLAS directly ------------------------------------------------------------------
# A GEMM written where it belongs: cupy.matmul of a [G, m, k] stack makes a new array, and
# convolution's gradients were stacked from one per group (a copy each, a launch each). On the
# H200 machine's host a cuBLAS call itself takes about 24 us (cupy.matmul 26), so the gain is
# the copies and launches saved, not the call. Column-major: out^T = b^T a^T.
_OP_N, _OP_T = 0, 1
_POINTER_MODE_HOST = 0
_ONE_ZERO = {np.dtype(np.float32): np.array([1, 0], np.float32), np.dtype(np.float64): np.array([1, 0], np.float64)}


def _cublas():
    """cupy's cuBLAS module (imported once: the LSTM calls a GEMM a step)."""
    def load():
        try:
            from cupy.cuda import cublas
        except ImportError:   # (where cupy keeps it only under cupy_backends)
            from cupy_backends.cuda.libs import cublas
        return cublas
    return _made("cublas", load)


def _handle() -> int:
    return _cupy().cuda.device.get_cublas_handle()


def _stream() -> int:
    """The current stream (the runtime's GPU workers each use one of their own)."""
    return _cupy().cuda.get_current_stream().ptr


def _device_ptr(a) -> int:
    """The address of a's first value on the device."""
    return a.data.ptr


def _operand(a) -> tuple[int, int] | None:
    """(op, ld) of the column-major cuBLAS operand that is the transpose of the 2-D view a: N over
    its rows where they are contiguous (ld the row stride), T over its columns where those are;
    None for any other layout."""
    isz, (r, c), (s0, s1) = a.itemsize, a.shape, a.strides
    if (s1 == isz or c == 1) and (r == 1 or (s0 % isz == 0 and s0 >= c * isz)):
        return _OP_N, (max(c, 1) if r == 1 else s0 // isz)
    if (s0 == isz or r == 1) and (c == 1 or (s1 % isz == 0 and s1 >= r * isz)):
        return _OP_T, (max(r, 1) if c == 1 else s1 // isz)
    return None


def _two_d(a, b, out) -> None:
    if a.ndim != 2 or b.ndim != 2 or out.ndim != 2:
        raise ValueError(f"gemm: needs 2-D arrays, got shapes {a.shape} @ {b.shape} into {out.shape}")


def gemm(a, b, out, accumulate: bool = False):
    """out = a @ b, or out += a @ b with `accumulate`, for 2-D cupy arrays of one dtype (float32 or
    float64) in one cuBLAS call: out's rows must be contiguous; a and b may be transposed views
    (copied first only where neither their rows nor their columns are contiguous). Returns out."""
    _two_d(a, b, out)
    a = a if _operand(a) is not None else _contiguous(a)
    b = b if _operand(b) is not None else _contiguous(b)
    gemm_call(a, b, out, accumulate)()
    return out


def gemm_call(a, b, out, accumulate: bool = False):
    """gemm(a, b, out, accumulate) as a function of no arguments, its checks, layouts and addresses
    worked out once: for a GEMM repeated on the same arrays (the LSTM's steps), whose values are
    read when it is called. a and b must have contiguous rows or columns."""
    _two_d(a, b, out)
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2 or out.shape != (m, n):
        raise ValueError(f"gemm: shapes {a.shape} @ {b.shape} into {out.shape} do not match")
    if not a.dtype == b.dtype == out.dtype or out.dtype not in _ONE_ZERO:
        raise ValueError(f"gemm: needs float32 or float64 alike, got {a.dtype}, {b.dtype} into {out.dtype}")
    placed, op_a, op_b = _operand(out), _operand(a), _operand(b)
    if placed is None or placed[0] != _OP_N:
        raise ValueError(f"gemm: out's rows must be contiguous, got shape {out.shape} strides {out.strides}")
    if m == 0 or n == 0 or (k == 0 and accumulate):
        return lambda: None
    if k == 0:
        return lambda: out.fill(0)
    for name, x, op in (("a", a, op_a), ("b", b, op_b)):
        if op is None:
            raise ValueError(f"gemm: {name} needs contiguous rows or columns, got shape {x.shape} strides {x.strides}")
    cublas, handle = _cublas(), _handle()
    one = _ONE_ZERO[out.dtype].ctypes.data
    call = cublas.sgemm if out.dtype == np.float32 else cublas.dgemm
    args = (handle, op_b[0], op_a[0], n, m, k, one, _device_ptr(b), op_b[1], _device_ptr(a), op_a[1],
            one if accumulate else one + out.itemsize, _device_ptr(out), placed[1])

    def run():
        cublas.setStream(handle, _stream())
        cublas.setPointerMode(handle, _POINTER_MODE_HOST)
        call(*args)
    return run


def softmax_rows_(x, out, causal_first: int | None = None) -> None:
    """out = softmax(x) over the last axis (see ops.activation.softmax_rows_), one kernel."""
    cp = _cupy()
    n = x.shape[-1]
    rows = x.size // n
    src = _contiguous(x)
    dst = out if out.flags.c_contiguous else cp.empty(x.shape, x.dtype)
    period, first = (0, 0) if causal_first is None else (x.shape[-2], causal_first)
    _raw("softmax_rows", x.dtype)((rows,), (_threads(n),), (src, dst, np.int32(n), np.int32(period),
                                                            np.int64(first)))
    _into(out, dst)


def softmax_grad_rows(y, dy, out=None):
    """dx = y * (dy - rowsum(dy * y)) over the last axis, into `out` or a new array, one kernel."""
    cp = _cupy()
    n = y.shape[-1]
    dst = cp.empty(y.shape, y.dtype) if out is None or not out.flags.c_contiguous else out
    _raw("softmax_grad_rows", y.dtype)((y.size // n,), (_threads(n),), (_contiguous(y), _contiguous(dy), dst,
                                                                        np.int32(n)))
    if out is None:
        return dst
    _into(out, dst)
    return out


def layer_norm_forward(x, d: int, eps: float, weight, bias):
    """(y, mean, rstd) of layer norm over the last d values of each row of x (weight and bias
    of d values, or None), one kernel; mean and rstd one per row, in x's dtype."""
    cp = _cupy()
    src = _contiguous(x)
    rows = x.size // d
    y, mean, rstd = cp.empty(x.shape, x.dtype), cp.empty(rows, x.dtype), cp.empty(rows, x.dtype)
    affine = weight is not None
    w = _contiguous(weight) if affine else y
    b = _contiguous(bias) if affine else y
    _raw("layer_norm_forward", x.dtype)((rows,), (_threads(d),), (src, np.int32(d), np.float64(eps), w, b,
                                                                  np.int32(affine), y, mean, rstd))
    return y, mean, rstd


def layer_norm_backward(x, dy, d: int, weight, mean, rstd):
    """(dx, dweight, dbias) of layer norm (the last two None without weight): dx in one kernel, the
    weight gradients as column sums in double."""
    cp = _cupy()
    src, g = _contiguous(x), _contiguous(dy)
    rows = x.size // d
    dx = cp.empty(x.shape, x.dtype)
    affine = weight is not None
    w = _contiguous(weight) if affine else dx
    _raw("layer_norm_backward", x.dtype)((rows,), (_threads(d),), (src, g, np.int32(d), w, np.int32(affine),
                                                                   mean, rstd, dx))
    if not affine:
        return dx, None, None
    # column sums (cupy's sum over axis 0 gave each column one block: 2x PyTorch's whole backward)
    shares = max(1, min(64, rows // 64))
    part_w, part_b = cp.empty((shares, d)), cp.empty((shares, d))
    _raw("layer_norm_weight_grads", x.dtype)((math.ceil(d / 32), shares), (32, 8), (
        src, g, mean, rstd, np.int64(rows), np.int32(d), part_w, part_b))
    return dx, part_w.sum(axis=0), part_b.sum(axis=0)


def max_pool_forward(x, out_hw, kernel, stride, top_left):
    """(y, argmax) of max pooling over x [N, C, H, W] with windows at o * stride - top_left,
    clipped to x; argmax the flat index ih * W + iw of each window's max in its plane."""
    cp = _cupy()
    src = _contiguous(x)
    n, c, h, w = x.shape
    y = cp.empty((n, c) + tuple(out_hw), x.dtype)
    arg = cp.empty(y.shape, cp.int32)
    total = y.size
    if total:
        _raw("max_pool_forward", x.dtype)(_blocks(total), (256,), (
            src, np.int64(total), np.int32(h), np.int32(w), np.int32(out_hw[0]), np.int32(out_hw[1]),
            np.int32(kernel[0]), np.int32(kernel[1]), np.int32(stride[0]), np.int32(stride[1]),
            np.int32(top_left[0]), np.int32(top_left[1]), y, arg))
    return y, arg


def max_pool_backward(dy, arg, x_shape, kernel, stride, top_left):
    """dx [N, C, H, W] of max pooling from dy and the forward's argmax."""
    cp = _cupy()
    dx = cp.empty(tuple(x_shape), dy.dtype)
    _, _, h, w = x_shape
    oh, ow = dy.shape[2:]
    total = dx.size
    if total:
        _raw("max_pool_backward", dy.dtype)(_blocks(total), (256,), (
            _contiguous(dy), _contiguous(arg), np.int64(total), np.int32(h), np.int32(w), np.int32(oh),
            np.int32(ow), np.int32(kernel[0]), np.int32(kernel[1]), np.int32(stride[0]), np.int32(stride[1]),
            np.int32(top_left[0]), np.int32(top_left[1]), dx))
    return dx


def im2col(x, kernel, stride, top_left, out_hw):
    """The columns [C * KH * KW, N * OH * OW] of the unpadded input x [N, C, H, W] whose windows
    start at o * stride - top_left (the padding read as zeros), one kernel."""
    cp = _cupy()
    n, c, h, w = x.shape
    cols = cp.empty((c * kernel[0] * kernel[1], n * out_hw[0] * out_hw[1]), x.dtype)
    if cols.size:
        _raw("im2col", x.dtype)(_blocks(cols.size), (256,), (
            _contiguous(x), np.int64(cols.size), np.int32(n), np.int32(c), np.int32(h), np.int32(w),
            np.int32(kernel[0]), np.int32(kernel[1]), np.int32(stride[0]), np.int32(stride[1]),
            np.int32(top_left[0]), np.int32(top_left[1]), np.int32(out_hw[0]), np.int32(out_hw[1]), cols))
    return cols


def col2im(cols, kernel, stride, top_left, out_hw, out) -> None:
    """out [N, C, H, W] = im2col's adjoint of cols [C * KH * KW, N * OH * OW], a thread per value
    of out (written into a C-contiguous out, else through a new array)."""
    cp = _cupy()
    n, c, h, w = out.shape
    dst = out if out.flags.c_contiguous else cp.empty(out.shape, out.dtype)
    if out.size:
        _raw("col2im", out.dtype)(_blocks(out.size), (256,), (
            _contiguous(cols), np.int64(out.size), np.int32(n), np.int32(c), np.int32(h), np.int32(w),
            np.int32(kernel[0]), np.int32(kernel[1]), np.int32(stride[0]), np.int32(stride[1]),
            np.int32(top_left[0]), np.int32(top_left[1]), np.int32(out_hw[0]), np.int32(out_hw[1]), dst))
    _into(out, dst)


# ---- batch norm: per-channel sums and the element-wise passes ----------------------------------
def _reduction(name: str, ins: str, expr: str):
    return _made(name, lambda: _cupy().ReductionKernel(ins, "float64 s", expr, "a + b", "s = a", "0", name))


def _sum_by_channel(kernel, arrays, per_channel):
    """kernel's per-channel sums over arrays [N, C, ...] (or [N, C]), per_channel float64 [C]
    its parameter: over each sample's pixels first, a contiguous run per channel where the
    array is (one pass at memory speed; summed over axes (0, 2, 3) at once, cupy gave each
    channel one block, 40x slower), then over the samples."""
    x = arrays[0]
    if x.ndim == 2:
        return kernel(*arrays, per_channel.reshape(1, -1), axis=0)
    rows = [a.reshape(a.shape[0], a.shape[1], -1) for a in arrays]
    return kernel(*rows, per_channel.reshape(1, -1, 1), axis=2).sum(axis=0)


def batch_norm_moments(x, center):
    """Per channel, in double: sum(x - center) and sum((x - center)^2), center float64 [C]."""
    s = _sum_by_channel(_reduction("taskrt_bn_sum", "T x, float64 c", "(double)x - c"), [x], center)
    ss = _sum_by_channel(_reduction("taskrt_bn_sum_sq", "T x, float64 c", "((double)x - c) * ((double)x - c)"),
                         [x], center)
    return s, ss


def batch_norm_statistics(m1, m2, count: float, center, weight, bias, eps: float, moments: bool):
    """Per channel, one kernel over [C] arrays (a launch each had cost more than the passes
    over x): (mean, var, invstd) in double and (scale, shift) in weight's dtype, y = x * scale
    + shift. moments: m1, m2 are sums of x - center and its square over count values (var
    below 0 by rounding is 0, a NaN stays); else they are the mean and variance."""
    body = ("double mu = m1, v = m2;"
            "if (moments) { mu = m1 / cnt; v = m2 / cnt - mu * mu; v = v < 0 ? 0.0 : v; mu += (double)ctr; }"
            "mean = mu; var = v; invstd = 1.0 / sqrt(v + eps);"
            "double sc = (double)w * invstd; scale = (T)sc; shift = (T)((double)b - mu * sc)")
    kernel = _elementwise("taskrt_bn_statistics", "float64 m1, float64 m2, T ctr, T w, T b, float64 cnt, "
                          "float64 eps, int32 moments", "float64 mean, float64 var, float64 invstd, T scale, T shift",
                          body)
    return kernel(m1, m2, center, weight, bias, float(count), float(eps), int(moments))


def batch_norm_running_update(running_mean, running_var, mean, var, momentum: float, unbias: float) -> None:
    """running = (1 - momentum) * running + momentum * batch stat (var times unbias), in place,
    rounded as numpy rounds it (1 - momentum and its product in the stats' dtype)."""
    body = ("T mt = (T)mom;"
            "rm = (T)((double)(((T)1 - mt) * rm) + (double)mt * mean);"
            "rv = (T)((double)(((T)1 - mt) * rv) + (double)mt * var * unbias)")
    kernel = _elementwise("taskrt_bn_running", "float64 mean, float64 var, float64 mom, float64 unbias",
                          "T rm, T rv", body)
    kernel(mean, var, float(momentum), float(unbias), running_mean, running_var)


def batch_norm_grad_coefficients(sum_g, sum_gx, weight, mean, invstd, count: float):
    """Per channel, one kernel: dx's coefficients c0..c3 (batch_norm_dx) in weight's dtype and
    dgamma = sum(g * (x - mean)) * invstd in double."""
    body = ("double dg = sgx * invstd; double sc = (double)w * invstd;"
            "c0 = (T)sc; c1 = (T)(-sc * invstd * dg / cnt); c2 = (T)mean; c3 = (T)(-sc * sg / cnt); dgamma = dg")
    kernel = _elementwise("taskrt_bn_grad_coefficients", "float64 sg, float64 sgx, T w, float64 mean, "
                          "float64 invstd, float64 cnt", "T c0, T c1, T c2, T c3, float64 dgamma", body)
    return kernel(sum_g, sum_gx, weight, mean, invstd, float(count))


def batch_norm_apply(x, scale, shift, relu: bool):
    """y = x * scale + shift (then relu), scale and shift broadcasting per channel."""
    body = "T v = x * s + b; y = v > (T)0 ? v : (T)0" if relu else "y = x * s + b"
    return _elementwise(f"taskrt_bn_apply_{int(relu)}", "T x, T s, T b", "T y", body)(x, scale, shift)


def batch_norm_grad_sums(x, dy, y, mean, relu: bool):
    """Per channel, in double: sum(g) and sum(g * (x - mean)), g = dy where y > 0 if relu, else
    dy; mean float64 [C]."""
    g = "(y > (T)0 ? (double)dy : 0.0)" if relu else "(double)dy"
    ins = "T x, T dy, T y, float64 m"
    sum_g = _sum_by_channel(_reduction(f"taskrt_bn_sum_g_{int(relu)}", ins, g), [x, dy, y], mean)
    sum_gx = _sum_by_channel(_reduction(f"taskrt_bn_sum_gx_{int(relu)}", ins, f"{g} * ((double)x - m)"),
                             [x, dy, y], mean)
    return sum_g, sum_gx


def batch_norm_dx(x, dy, y, c0, c1, c2, c3, relu: bool, training: bool):
    """dx = c0 * g (+ c1 * (x - c2) + c3 in training), g as in batch_norm_grad_sums, the c's
    broadcasting per channel."""
    g = "(y > (T)0 ? dy : (T)0)" if relu else "dy"
    body = f"dx = c0 * {g}" + (" + c1 * (x - c2) + c3" if training else "")
    return _elementwise(f"taskrt_bn_dx_{int(relu)}{int(training)}", "T x, T dy, T y, T c0, T c1, T c2, T c3",
                        "T dx", body)(x, dy, y, c0, c1, c2, c3)


# ---- LSTM steps ---------------------------------------------------------------------------------
# Raw kernels given each array's row stride: a step is called seq times a pass, and an
# ElementwiseKernel's indexing of 16 strided views cost more host time than the step's GEMM.
def _row_stride(a) -> np.int64:
    """a's row stride in values; its rows must be contiguous (the LSTM's own arrays are)."""
    if a.ndim != 2 or a.strides[1] != a.itemsize:
        raise ValueError(f"LSTM step kernels need [batch, n] views with contiguous rows, got shape {a.shape} "
                         f"strides {a.strides}")
    return np.int64(a.strides[0] // a.itemsize)


def _rows_in(a, dtype):
    """a as [batch, n] rows of dtype with contiguous rows (a copy only where it is not)."""
    if a.dtype != dtype or a.strides[1] != a.itemsize:
        return _cupy().ascontiguousarray(a, dtype=dtype)
    return a


def _steps_of(a) -> tuple[int, int, np.int64]:
    """(the address of a[:, 0], bytes from one step to the next, the row stride in values) of a
    [batch, seq, n] array whose last axis is contiguous (the LSTM's own arrays are)."""
    if a.ndim != 3 or a.strides[2] != a.itemsize or a.strides[0] % a.itemsize:
        raise ValueError(f"LSTM steps need [batch, seq, n] arrays with contiguous rows, got shape {a.shape} "
                         f"strides {a.strides}")
    return _device_ptr(a), a.strides[1], np.int64(a.strides[0] // a.itemsize)


def lstm_forward_steps(gates, bias, w_hh, h0, c0, cs, tanh_cs, y) -> None:
    """Every step of an LSTM tile forward, on [batch, seq, .] arrays: per step the recurrent GEMM
    (rec = h_{t-1} w_hh^T, cuBLAS) and the step kernel (gates += rec + bias, made the activations
    in place; c_t = f c_{t-1} + i g, tanh(c_t), y_t = o tanh(c_t), also into the block the next
    GEMM reads). A step's kernel arguments are addresses worked out once from the strides, not
    views made and checked each step (the steps are host-bound: on the H200 machine the GEMM's
    cuBLAS call and the kernel's launch took about 24 us of host time each, the GPU a few)."""
    cp = _cupy()
    batch, seq, h = cs.shape
    if not cs.size:
        return
    dtype = cs.dtype
    rec, h_block = cp.empty((batch, 4 * h), dtype), cp.empty((batch, h), dtype)
    bias, h_prev, c0 = _contiguous(bias.astype(dtype, copy=False)), _rows_in(h0, dtype), _rows_in(c0, dtype)
    w_t = w_hh.astype(dtype, copy=False).T
    kernel, grid, sizes = _raw("lstm_step_forward", dtype), _blocks(batch * h), (np.int32(batch), np.int32(h))
    (g0, g_step, gs), (c_at, c_step, c_rows), (t_at, t_step, ts), (y_at, y_step, ys) = map(
        _steps_of, (gates, cs, tanh_cs, y))
    c_prev, ps = _device_ptr(c0), _row_stride(c0)
    first_gemm, step_gemm = gemm_call(h_prev, w_t, rec), gemm_call(h_block, w_t, rec)
    for t in range(seq):
        (step_gemm if t else first_gemm)()
        kernel(grid, (256,), (np.uint64(g0 + t * g_step), gs, rec, bias, np.uint64(c_prev), ps,
                              np.uint64(c_at + t * c_step), c_rows, np.uint64(t_at + t * t_step), ts,
                              np.uint64(y_at + t * y_step), ys, h_block, *sizes))
        c_prev, ps = c_at + t * c_step, c_rows


def lstm_backward_steps(gates, tanh_cs, cs, c0, dy, w_hh, dh, dc) -> None:
    """Every step of an LSTM tile backward, last to first (the arrays as lstm_forward_steps left
    them; dy [batch, seq, h] or None; dh, dc [batch, h] with contiguous rows, the carried
    gradients, left as those of h0 and c0): per step dh += dy_t, the step kernel (the gates'
    activations become their pre-activation gradients, also into a block; dc becomes that of
    c_{t-1}) and the GEMM dh = block w_hh (cuBLAS)."""
    cp = _cupy()
    batch, seq, h = cs.shape
    if not cs.size:
        return
    dtype = cs.dtype
    block = cp.empty((batch, 4 * h), dtype)
    w, c0 = w_hh.astype(dtype, copy=False), _rows_in(c0, dtype)
    kernel, grid, sizes = _raw("lstm_step_backward", dtype), _blocks(batch * h), (np.int32(batch), np.int32(h))
    (g0, g_step, gs), (t_at, t_step, ts), (c_at, c_step, c_rows) = map(_steps_of, (gates, tanh_cs, cs))
    hs, dcs = _row_stride(dh), _row_stride(dc)
    step_gemm = gemm_call(block, w, dh)
    for t in range(seq - 1, -1, -1):
        if dy is not None:
            dh += dy[:, t]
        c_prev, ps = (c_at + (t - 1) * c_step, c_rows) if t > 0 else (_device_ptr(c0), _row_stride(c0))
        kernel(grid, (256,), (np.uint64(g0 + t * g_step), gs, np.uint64(t_at + t * t_step), ts, np.uint64(c_prev),
                              ps, dh, hs, dc, dcs, block, *sizes))
        step_gemm()
