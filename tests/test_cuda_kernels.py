"""ops/cuda_kernels.py's CUDA C++ without a GPU: the source compiled by the host's C++
compiler against a few lines that stand in for CUDA's built-ins, every kernel instantiated for
float and double, and every ElementwiseKernel's body as a host function (a syntax or type error
fails here, not on the first GPU session); and the
kernels of a thread per value (im2col, col2im, max pooling, the LSTM steps), whose threads
never meet, run on the host by looping over blocks and threads, against numpy; those with
block-wide sums (softmax, layer norm) run with a std::thread per CUDA thread, barriers for
__syncthreads and warp shuffles through memory. Needs g++ (the test says so where it is
missing)."""
from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest
from numpy.lib.stride_tricks import sliding_window_view

from ops import cuda_kernels

#: CUDA's built-ins on the host: a launch is a loop over blocks and threads (threads that never
#: meet only); shuffles and barriers compile but are not run
PRELUDE = r"""
#include <algorithm>
#include <cmath>
#include <cstring>
#define __global__
#define __device__
#define __shared__ static
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
static Dim3 blockIdx, blockDim, threadIdx, gridDim;
static void __syncthreads() {}
template<typename T> static T __shfl_down_sync(unsigned, T v, int) { return v; }
static float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
static double rsqrt(double x) { return 1.0 / std::sqrt(x); }
using std::erf; using std::exp; using std::fmax; using std::max; using std::min; using std::sqrt; using std::tanh;
"""

LAUNCHERS = r"""
template<typename... P, typename... A> static void launch(void (*kernel)(P...), long long threads, A... args) {
    blockDim.x = 256;
    gridDim.x = (unsigned)((threads + 255) / 256);
    for (unsigned b = 0; b < gridDim.x; ++b)
        for (unsigned t = 0; t < 256; ++t) {
            blockIdx.x = b;
            threadIdx.x = t;
            kernel(args...);
        }
}
extern "C" {
void im2col_f(const float* x, long long total, int n, int c, int h, int w, int kh, int kw, int sh, int sw,
              int top, int left, int oh, int ow, float* cols) {
    launch(im2col<float>, total, x, total, n, c, h, w, kh, kw, sh, sw, top, left, oh, ow, cols);
}
void col2im_f(const float* cols, long long total, int n, int c, int h, int w, int kh, int kw, int sh, int sw,
              int top, int left, int oh, int ow, float* out) {
    launch(col2im<float>, total, cols, total, n, c, h, w, kh, kw, sh, sw, top, left, oh, ow, out);
}
void max_pool_forward_f(const float* x, long long total, int h, int w, int oh, int ow, int kh, int kw, int sh,
                        int sw, int top, int left, float* y, int* arg) {
    launch(max_pool_forward<float>, total, x, total, h, w, oh, ow, kh, kw, sh, sw, top, left, y, arg);
}
void max_pool_backward_f(const float* dy, const int* arg, long long total, int h, int w, int oh, int ow, int kh,
                         int kw, int sh, int sw, int top, int left, float* dx) {
    launch(max_pool_backward<float>, total, dy, arg, total, h, w, oh, ow, kh, kw, sh, sw, top, left, dx);
}
void lstm_step_forward_d(double* g, long long gs, const double* rec, const double* bias, const double* cp,
                         long long ps, double* c, long long cs, double* tc, long long ts, double* hy, long long hs,
                         double* hc, int batch, int h) {
    launch(lstm_step_forward<double>, (long long)batch * h, g, gs, rec, bias, cp, ps, c, cs, tc, ts, hy, hs, hc,
           batch, h);
}
void lstm_step_backward_d(double* g, long long gs, const double* tc, long long ts, const double* cp, long long ps,
                          const double* dh, long long hs, double* dc, long long cs, double* gc, int batch, int h) {
    launch(lstm_step_backward<double>, (long long)batch * h, g, gs, tc, ts, cp, ps, dh, hs, dc, cs, gc, batch, h);
}
}
"""


def _instantiations() -> str:
    """An explicit instantiation of every kernel for float and double."""
    lines = []
    for name in cuda_kernels._KERNELS:
        found = re.search(r"template<typename T> __global__ void " + name + r"\(([^)]*)\)", cuda_kernels._SOURCE)
        assert found, f"kernel {name} not in the source"
        params = " ".join(found.group(1).split())
        for t in ("float", "double"):
            lines.append(f"template void {name}<{t}>({params.replace('T*', t + '*')});")
    return "\n".join(lines)


def _compile(folder, text: str, *flags: str, library: bool = True):
    """g++ on `text` with warnings as errors: a shared library (its path), or a syntax check."""
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("no g++ on this machine to compile the CUDA source for the host")
    source, target = folder / "kernels.cpp", folder / "kernels.so"
    source.write_text(text)
    output = ["-shared", "-fPIC", "-o", str(target)] if library else ["-fsyntax-only"]
    done = subprocess.run([compiler, *flags, "-O1", "-Wall", "-Werror", "-Wno-unused-function", *output, str(source)],
                          capture_output=True, text=True)
    assert done.returncode == 0, f"the CUDA code does not compile for the host:\n{done.stderr[-4000:]}"
    return target


@pytest.fixture(scope="module")
def host_kernels(tmp_path_factory):
    text = PRELUDE + cuda_kernels._SOURCE + _instantiations() + LAUNCHERS
    return ctypes.CDLL(str(_compile(tmp_path_factory.mktemp("cuda_host"), text, "-std=c++17")))


def _ll(v):
    return ctypes.c_longlong(v)


def test_every_kernel_compiles_for_float_and_double(host_kernels):
    assert all(hasattr(host_kernels, f) for f in ("im2col_f", "col2im_f", "max_pool_forward_f"))


@pytest.mark.parametrize("kernel,stride,pads", [((3, 3), (1, 1), ((1, 1), (1, 1))), ((3, 3), (2, 2), ((1, 0), (1, 1))),
                                                ((1, 7), (1, 1), ((0, 0), (3, 3))), ((5, 3), (3, 2), ((2, 1), (0, 1)))])
def test_im2col_and_col2im_match_numpy(host_kernels, kernel, stride, pads):
    """On the unpadded input, its (virtual) padding read as zeros: against numpy on a padded copy."""
    rng = np.random.default_rng(0)
    n, c, h, w = 2, 3, 11, 13
    (kh, kw), (sh, sw), ((top, bottom), (left, right)) = kernel, stride, pads
    oh, ow = (h + top + bottom - kh) // sh + 1, (w + left + right - kw) // sw + 1
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    cols = np.empty((c * kh * kw, n * oh * ow), np.float32)
    host_kernels.im2col_f(_ptr(x), _ll(cols.size), n, c, h, w, kh, kw, sh, sw, top, left, oh, ow, _ptr(cols))
    xpad = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)))
    windows = sliding_window_view(xpad, kernel, axis=(2, 3))[:, :, ::sh, ::sw][:, :, :oh, :ow]  # N C OH OW KH KW
    want = windows.transpose(1, 4, 5, 0, 2, 3).reshape(c * kh * kw, n * oh * ow)
    np.testing.assert_array_equal(cols, want)

    # col2im: each column value added back where im2col took it from, the padding's dropped
    g = rng.standard_normal(cols.shape).astype(np.float32)
    out = np.full_like(x, np.nan)   # written, not added to
    host_kernels.col2im_f(_ptr(g), _ll(out.size), n, c, h, w, kh, kw, sh, sw, top, left, oh, ow, _ptr(out))
    want_pad = np.zeros(xpad.shape)
    g6 = g.reshape(c, kh, kw, n, oh, ow).astype(np.float64)
    for i in range(kh):
        for j in range(kw):
            want_pad[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw] += g6[:, i, j].transpose(1, 0, 2, 3)
    np.testing.assert_allclose(out, want_pad[:, :, top:top + h, left:left + w], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel,stride,pads", [((3, 3), (2, 2), (1, 1)), ((2, 2), (2, 2), (0, 0)),
                                                ((3, 3), (1, 1), (1, 1)), ((1, 3), (2, 1), (0, 1))])
def test_max_pool_kernels_match_the_cpu_op(host_kernels, kernel, stride, pads):
    from ops.base import TensorSpec
    from ops.pool import Pool2d
    from taskrt.geometry import Rect
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 9, 11)).astype(np.float32)
    x[0, 0, 0, :3] = 1.5   # a tie: the first maximum wins
    x[1, 2, 4, 4] = np.nan  # NaN wins
    op = Pool2d("pool", [TensorSpec(x.shape, "float32", "x")], kernel=kernel, stride=stride, padding=pads)
    tile = Rect.from_shape(op.tile_shape)
    (in_rect,) = op.input_rects(tile)
    (want_y,), want_arg = op.forward(np, tile, [x], [in_rect], {})
    dy = rng.standard_normal(tile.shape).astype(np.float32)
    (want_dx,), _ = op.backward(np, tile, [x], [in_rect], {}, [want_y], [dy], want_arg)

    top, left = op._top_left(tile, in_rect)
    (_, _, h, w), (oh, ow) = x.shape, tile.shape[2:]
    y, arg = np.empty(tile.shape, np.float32), np.empty(tile.shape, np.int32)
    host_kernels.max_pool_forward_f(_ptr(x), _ll(y.size), h, w, oh, ow, *kernel, *stride, top, left, _ptr(y),
                                    _ptr(arg))
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(arg, want_arg)
    dx = np.empty_like(x)
    host_kernels.max_pool_backward_f(_ptr(dy), _ptr(arg), _ll(dx.size), h, w, oh, ow, *kernel, *stride, top, left,
                                     _ptr(dx))
    np.testing.assert_allclose(dx, want_dx, rtol=1e-6, atol=1e-6)


def test_lstm_step_kernels_match_the_array_code(host_kernels):
    """One step forward and backward on strided [batch, .] views, as ops/lstm.py hands them over."""
    from ops.lstm import _step_backward_xp, _step_forward_xp
    rng = np.random.default_rng(2)
    batch, seq, h, t = 3, 4, 5, 2
    gates = rng.standard_normal((batch, seq, 4 * h))
    rec, bias = rng.standard_normal((batch, 4 * h)), rng.standard_normal(4 * h)
    cs, tanh_cs, y = (np.zeros((batch, seq, h)) for _ in range(3))
    cs[:, t - 1] = rng.standard_normal((batch, h))
    want = [a.copy() for a in (gates, cs, tanh_cs, y)]
    _step_forward_xp(np, want[0][:, t], rec, bias, want[1][:, t - 1], want[1][:, t], want[2][:, t], want[3][:, t],
                     np.empty((batch, h)))
    hc = np.empty((batch, h))
    lib, step = host_kernels, seq * 4 * h
    lib.lstm_step_forward_d(_ptr(gates, t * 4 * h), _ll(step), _ptr(rec), _ptr(bias), _ptr(cs, (t - 1) * h),
                            _ll(seq * h), _ptr(cs, t * h), _ll(seq * h), _ptr(tanh_cs, t * h), _ll(seq * h),
                            _ptr(y, t * h), _ll(seq * h), _ptr(hc), batch, h)
    for got, w in zip((gates, cs, tanh_cs, y), want):
        np.testing.assert_allclose(got, w, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(hc, want[3][:, t], rtol=1e-12)

    dh, dc = rng.standard_normal((batch, h)), rng.standard_normal((batch, h))
    want_g, want_dc = gates.copy(), dc.copy()
    _step_backward_xp(np, want_g[:, t], tanh_cs[:, t], cs[:, t - 1], dh, want_dc, np.empty((batch, h)))
    gc = np.empty((batch, 4 * h))
    lib.lstm_step_backward_d(_ptr(gates, t * 4 * h), _ll(step), _ptr(tanh_cs, t * h), _ll(seq * h),
                             _ptr(cs, (t - 1) * h), _ll(seq * h), _ptr(dh), _ll(h), _ptr(dc), _ll(h), _ptr(gc),
                             batch, h)
    np.testing.assert_allclose(gates, want_g, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dc, want_dc, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(gc, want_g[:, t], rtol=1e-12, atol=1e-12)


def _ptr(a, offset: int = 0):
    """A pointer to a's value at flat `offset` (a C-contiguous array)."""
    assert a.flags.c_contiguous
    return ctypes.c_void_p(a.ctypes.data + offset * a.itemsize)


_C_TYPES = {"float64": "double", "float32": "float", "int32": "int"}


def _recorded_elementwise_kernels(monkeypatch) -> dict:
    """Every ElementwiseKernel the module makes, as {name: (ins, outs, body)}: each function
    that makes one is called with numpy stand-ins, the kernels recorded instead of compiled."""
    made = {}

    def record(name, ins, outs, body):
        made[name] = (ins, outs, body)
        return lambda *args: tuple(np.zeros(1) for _ in outs.split(","))
    monkeypatch.setattr(cuda_kernels, "_elementwise", record)
    a = np.zeros(3)
    for name in ("relu", "sigmoid", "tanh", "gelu"):
        cuda_kernels.activation_forward(name, a)
        cuda_kernels.activation_backward(name, a, a, a)
    cuda_kernels.batch_norm_statistics(a, a, 4.0, a, a, a, 1e-5, moments=True)
    cuda_kernels.batch_norm_running_update(a, a, a, a, 0.1, 4 / 3)
    cuda_kernels.batch_norm_grad_coefficients(a, a, a, a, a, 4.0)
    for relu in (False, True):
        cuda_kernels.batch_norm_apply(a, a, a, relu)
        for training in (False, True):
            cuda_kernels.batch_norm_dx(a, a, a, a, a, a, a, relu, training)
    return made


def _as_function(name, ins, outs, body) -> str:
    """An ElementwiseKernel as a host function of its parameters (outputs by reference)."""
    def params(spec, ref):
        out = []
        for p in spec.split(","):
            kind, var = p.split()
            out.append(f"{_C_TYPES.get(kind, kind)}{'&' if ref else ''} {var}")
        return out
    args = ", ".join(params(ins, False) + params(outs, True))
    return f"template<typename T> void {name}({args}) {{ {body}; }}\n"


def test_every_elementwise_kernel_compiles_for_float_and_double(monkeypatch, tmp_path):
    made = _recorded_elementwise_kernels(monkeypatch)
    assert len(made) == 17, sorted(made)  # 4 activations each way, 3 of batch norm, 2 applies, 4 dx
    source = PRELUDE + "".join(_as_function(n, *spec) for n, spec in made.items())
    source += "".join(f"template void {n}<{t}>({', '.join(_instantiated_params(spec, t))});\n"
                      for n, spec in made.items() for t in ("float", "double"))
    _compile(tmp_path, source, "-std=c++17", library=False)


def _instantiated_params(spec, t) -> list[str]:
    ins, outs, _ = spec
    types = []
    for group, ref in ((ins, ""), (outs, "&")):
        for p in group.split(","):
            kind = p.split()[0]
            types.append(f"{t if kind == 'T' else _C_TYPES[kind]}{ref}")
    return types


#: CUDA's built-ins with real threads: a block is one std::thread per CUDA thread, __syncthreads a
#: barrier of the block, a warp shuffle an exchange through memory between two barriers of the warp
THREADED_PRELUDE = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __shared__ static
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
static thread_local Dim3 blockIdx, threadIdx;
static Dim3 blockDim, gridDim;
static std::barrier<>* block_barrier;
static std::barrier<>* warp_barriers[32];
static double exchange[1024];
static void __syncthreads() { block_barrier->arrive_and_wait(); }
template<typename T> static T __shfl_down_sync(unsigned, T v, int o) {
    unsigned me = threadIdx.x + blockDim.x * threadIdx.y, lane = me & 31, n = blockDim.x * blockDim.y;
    exchange[me] = (double)v;
    warp_barriers[me >> 5]->arrive_and_wait();
    T r = lane + o < 32 && me + o < n ? (T)exchange[me + o] : v;
    warp_barriers[me >> 5]->arrive_and_wait();
    return r;
}
static float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
static double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
static double rsqrt(double x) { return 1.0 / std::sqrt(x); }
using std::erf; using std::exp; using std::fmax; using std::max; using std::min; using std::sqrt; using std::tanh;
"""

THREADED_LAUNCHERS = r"""
template<typename... P, typename... A>
static void launch(void (*kernel)(P...), unsigned gx, unsigned gy, unsigned bx, unsigned by, A... args) {
    blockDim = {bx, by, 1};
    gridDim = {gx, gy, 1};
    unsigned n = bx * by;
    for (unsigned y = 0; y < gy; ++y)
        for (unsigned x = 0; x < gx; ++x) {
            std::barrier<> block(n);
            block_barrier = &block;
            std::vector<std::unique_ptr<std::barrier<>>> warps;
            for (unsigned w = 0; w * 32 < n; ++w) {
                warps.emplace_back(new std::barrier<>(std::min(32u, n - 32 * w)));
                warp_barriers[w] = warps.back().get();
            }
            std::vector<std::thread> threads;
            for (unsigned t = 0; t < n; ++t)
                threads.emplace_back([&, t] {
                    blockIdx = {x, y, 0};
                    threadIdx = {t % bx, t / bx, 0};
                    kernel(args...);
                });
            for (auto& t : threads) t.join();
        }
}
extern "C" {
void softmax_rows_f(const float* x, float* y, int n, int period, long long first, unsigned rows, unsigned threads) {
    launch(softmax_rows<float>, rows, 1, threads, 1, x, y, n, period, first);
}
void softmax_grad_rows_f(const float* y, const float* dy, float* dx, int n, unsigned rows, unsigned threads) {
    launch(softmax_grad_rows<float>, rows, 1, threads, 1, y, dy, dx, n);
}
void layer_norm_forward_d(const double* x, int d, double eps, const double* w, const double* b, int affine, double* y,
                          double* mean, double* rstd, unsigned rows, unsigned threads) {
    launch(layer_norm_forward<double>, rows, 1, threads, 1, x, d, eps, w, b, affine, y, mean, rstd);
}
void layer_norm_backward_d(const double* x, const double* dy, int d, const double* w, int affine, const double* mean,
                           const double* rstd, double* dx, unsigned rows, unsigned threads) {
    launch(layer_norm_backward<double>, rows, 1, threads, 1, x, dy, d, w, affine, mean, rstd, dx);
}
void layer_norm_weight_grads_d(const double* x, const double* dy, const double* mean, const double* rstd,
                               long long rows, int d, double* part_w, double* part_b, unsigned shares) {
    launch(layer_norm_weight_grads<double>, (unsigned)((d + 31) / 32), shares, 32, 8, x, dy, mean, rstd, rows, d,
           part_w, part_b);
}
}
"""


@pytest.fixture(scope="module")
def threaded_kernels(tmp_path_factory):
    text = THREADED_PRELUDE + cuda_kernels._SOURCE + THREADED_LAUNCHERS
    return ctypes.CDLL(str(_compile(tmp_path_factory.mktemp("cuda_threads"), text, "-std=c++20", "-pthread")))


@pytest.mark.parametrize("n", [1, 37, 300])
@pytest.mark.parametrize("causal_first", [None, 2])
def test_softmax_kernels_match_numpy(threaded_kernels, n, causal_first):
    from ops.activation import softmax_grad_rows, softmax_rows_
    rng = np.random.default_rng(3)
    x = (4 * rng.standard_normal((2, 3, n))).astype(np.float32)
    want = np.empty_like(x)
    softmax_rows_(np, x, want, causal_first)
    y = np.empty_like(x)
    period, first = (0, 0) if causal_first is None else (x.shape[-2], causal_first)
    threaded_kernels.softmax_rows_f(_ptr(x), _ptr(y), n, period, _ll(first), 6, cuda_kernels._threads(n))
    np.testing.assert_allclose(y, want, rtol=2e-6, atol=1e-7)

    dy = rng.standard_normal(x.shape).astype(np.float32)
    dx = np.empty_like(x)
    threaded_kernels.softmax_grad_rows_f(_ptr(y), _ptr(dy), _ptr(dx), n, 6, cuda_kernels._threads(n))
    np.testing.assert_allclose(dx, softmax_grad_rows(np, want, dy), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("d", [5, 33, 300])
@pytest.mark.parametrize("affine", [False, True])
def test_layer_norm_kernels_match_the_cpu_op(threaded_kernels, d, affine):
    from ops.base import TensorSpec
    from ops.norm import LayerNorm
    from taskrt.geometry import Rect
    rng = np.random.default_rng(4)
    x = 3 + rng.standard_normal((2, 3, d))
    op = LayerNorm("ln", [TensorSpec(x.shape, "float64", "x")], normalized_shape=(d,), elementwise_affine=affine)
    weights = {k: rng.standard_normal(v.shape) for k, v in op.init_weights(rng).items()}
    tile = Rect.from_shape(op.tile_shape)
    (want_y,), saved = op.forward(np, tile, [x], op.input_rects(tile), weights)
    dy = rng.standard_normal(x.shape)
    (want_dx,), want_grads = op.backward(np, tile, [x], op.input_rects(tile), weights, [want_y], [dy], saved)

    rows, threads = 6, cuda_kernels._threads(d)
    w = weights["weight"] if affine else x
    b = weights["bias"] if affine else x
    y, mean, rstd = np.empty_like(x), np.empty(rows), np.empty(rows)
    threaded_kernels.layer_norm_forward_d(_ptr(x), d, ctypes.c_double(op.eps), _ptr(w), _ptr(b), int(affine),
                                          _ptr(y), _ptr(mean), _ptr(rstd), rows, threads)
    np.testing.assert_allclose(y, want_y, rtol=1e-12, atol=1e-12)
    dx = np.empty_like(x)
    threaded_kernels.layer_norm_backward_d(_ptr(x), _ptr(dy), d, _ptr(w), int(affine), _ptr(mean), _ptr(rstd),
                                           _ptr(dx), rows, threads)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-10, atol=1e-10)
    if affine:
        shares = 2
        part_w, part_b = np.empty((shares, d)), np.empty((shares, d))
        threaded_kernels.layer_norm_weight_grads_d(_ptr(x), _ptr(dy), _ptr(mean), _ptr(rstd), _ll(rows), d,
                                                   _ptr(part_w), _ptr(part_b), shares)
        np.testing.assert_allclose(part_w.sum(axis=0), want_grads["weight"], rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(part_b.sum(axis=0), want_grads["bias"], rtol=1e-10, atol=1e-10)


# ---- the host-side code around the kernels: cuBLAS calls and launches from addresses -----------------
class FakeCublas:
    """cuBLAS's GEMM by its definition (column-major operands at addresses, op N or T, leading
    dimensions checked as cuBLAS checks them), in numpy, on host memory."""

    def __init__(self):
        self.calls = 0

    def setPointerMode(self, handle, mode):
        assert mode == cuda_kernels._POINTER_MODE_HOST

    def setStream(self, handle, stream):
        assert stream == 7   # the fixture's current stream

    def sgemm(self, *args):
        self._gemm(np.float32, *args)

    def dgemm(self, *args):
        self._gemm(np.float64, *args)

    def _gemm(self, dtype, handle, op_a, op_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        ctype = np.ctypeslib.as_ctypes_type(dtype)
        isz = np.dtype(dtype).itemsize

        def matrix(address, rows, cols, ld):
            assert ld >= max(1, rows), f"cuBLAS refuses ld {ld} for {rows} rows"
            flat = np.ctypeslib.as_array((ctype * ((cols - 1) * ld + rows)).from_address(address))
            return np.lib.stride_tricks.as_strided(flat, (rows, cols), (isz, ld * isz))
        left = matrix(a, *((m, k) if op_a == 0 else (k, m)), lda)
        right = matrix(b, *((k, n) if op_b == 0 else (n, k)), ldb)
        out = matrix(c, m, n, ldc)
        al, be = ctype.from_address(alpha).value, ctype.from_address(beta).value
        product = al * ((left if op_a == 0 else left.T) @ (right if op_b == 0 else right.T))
        out[...] = product if be == 0 else product + be * out   # beta 0: out's values are not read
        self.calls += 1


def _host_launcher(lib, name, dtype):
    """A host build's kernel as cupy's RawKernel is called: (grid, block, args), arrays and
    np.uint64 addresses as pointers."""
    function = getattr(lib, f"{name}_{'f' if np.dtype(dtype) == np.float32 else 'd'}")

    def launch(grid, block, args):
        converted = []
        for a in args:
            if isinstance(a, np.ndarray):
                converted.append(ctypes.c_void_p(a.ctypes.data))
            elif isinstance(a, np.uint64):
                converted.append(ctypes.c_void_p(int(a)))
            elif isinstance(a, np.int64):
                converted.append(ctypes.c_longlong(int(a)))
            else:
                converted.append(ctypes.c_int(int(a)))
        function(*converted)
    return launch


@pytest.fixture
def on_host(monkeypatch, host_kernels):
    """ops/cuda_kernels.py's host side run on numpy arrays: cuBLAS as FakeCublas, raw kernels
    from the host build, addresses those of the numpy arrays."""
    blas = FakeCublas()
    monkeypatch.setattr(cuda_kernels, "_cupy", lambda: np)
    monkeypatch.setattr(cuda_kernels, "_cublas", lambda: blas)
    monkeypatch.setattr(cuda_kernels, "_handle", lambda: 0)
    monkeypatch.setattr(cuda_kernels, "_stream", lambda: 7)
    monkeypatch.setattr(cuda_kernels, "_device_ptr", lambda a: a.ctypes.data)
    monkeypatch.setattr(cuda_kernels, "_raw", lambda name, dtype: _host_launcher(host_kernels, name, dtype))
    return blas


def _layout(a, kind):
    """a (2-D) as a view of the given layout with the same values."""
    if kind == "rows":
        return a
    if kind == "columns":   # contiguous columns: the transpose of a C-contiguous array
        return np.ascontiguousarray(a.T).T
    if kind == "wide":      # rows inside a wider array (row stride above the width)
        wide = np.zeros((a.shape[0], a.shape[1] + 3), a.dtype)
        wide[:, 1:1 + a.shape[1]] = a
        return wide[:, 1:1 + a.shape[1]]
    big = np.zeros((a.shape[0] * 2, a.shape[1] * 2), a.dtype)   # "strided": neither contiguous, copied first
    big[::2, ::2] = a
    return big[::2, ::2]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("a_kind,b_kind", [("rows", "rows"), ("columns", "rows"), ("rows", "columns"),
                                           ("columns", "columns"), ("wide", "wide"), ("strided", "columns")])
@pytest.mark.parametrize("m,k,n", [(5, 7, 3), (1, 4, 6), (6, 4, 1), (3, 1, 2), (1, 1, 1)])
def test_gemm_matches_numpy(on_host, dtype, a_kind, b_kind, m, k, n):
    rng = np.random.default_rng(m * 100 + k * 10 + n)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    out = _layout(rng.standard_normal((m, n)).astype(dtype), "wide")
    before = out.copy()
    tol = 1e-5 if dtype == "float32" else 1e-12
    cuda_kernels.gemm(_layout(a, a_kind), _layout(b, b_kind), out, accumulate=True)
    np.testing.assert_allclose(out, before + a @ b, rtol=tol, atol=tol)
    out[...] = np.nan   # beta 0: overwritten, never read
    cuda_kernels.gemm(_layout(a, a_kind), _layout(b, b_kind), out)
    np.testing.assert_allclose(out, a @ b, rtol=tol, atol=tol)
    assert on_host.calls == 2


def test_gemm_refuses_what_it_cannot_do(on_host):
    a, b = np.ones((2, 3)), np.ones((3, 4))
    with pytest.raises(ValueError, match=r"shapes \(2, 3\) @ \(3, 4\) into \(2, 5\)"):
        cuda_kernels.gemm(a, b, np.empty((2, 5)))
    with pytest.raises(ValueError, match="float32 or float64 alike"):
        cuda_kernels.gemm(a.astype(np.float32), b, np.empty((2, 4)))
    with pytest.raises(ValueError, match="out's rows must be contiguous"):
        cuda_kernels.gemm(a, b, np.empty((4, 2)).T)
    out = np.full((2, 4), 7.0)
    cuda_kernels.gemm(np.ones((2, 0)), np.ones((0, 4)), out)   # k = 0: zeros, no call
    assert (out == 0).all() and on_host.calls == 0


@pytest.mark.parametrize("with_dy", [True, False])
def test_lstm_passes_match_the_array_code(on_host, with_dy):
    """A whole forward and backward pass of steps (addresses worked out once, cuBLAS GEMMs)
    against ops/lstm.py's array code on numpy, h0 and c0 given as strided views."""
    from ops.lstm import _backward_steps_xp, _forward_steps_xp
    rng = np.random.default_rng(5)
    batch, seq, h = 3, 4, 5
    gates = rng.standard_normal((batch, seq, 4 * h))
    bias, w_hh = rng.standard_normal(4 * h), rng.standard_normal((4 * h, h))
    h0, c0 = (rng.standard_normal((h, batch)).T for _ in range(2))   # columns contiguous: copied into rows
    arrays = [np.zeros((batch, seq, h)) for _ in range(3)]
    want = [gates.copy()] + [a.copy() for a in arrays]
    _forward_steps_xp(np, want[0], bias, w_hh, h0, c0, *want[1:])
    cuda_kernels.lstm_forward_steps(gates, bias, w_hh, h0, c0, *arrays)
    for got, w in zip([gates] + arrays, want):
        np.testing.assert_allclose(got, w, rtol=1e-12, atol=1e-12)
    assert on_host.calls == seq

    cs, tanh_cs, _ = arrays
    dy = rng.standard_normal((batch, seq, h)) if with_dy else None
    dh, dc = rng.standard_normal((batch, h)), rng.standard_normal((batch, h))
    want_g, want_dh, want_dc = gates.copy(), dh.copy(), dc.copy()
    _backward_steps_xp(np, want_g, tanh_cs, cs, c0, dy, w_hh, want_dh, want_dc)
    cuda_kernels.lstm_backward_steps(gates, tanh_cs, cs, c0, dy, w_hh, dh, dc)
    for got, w in ((gates, want_g), (dh, want_dh), (dc, want_dc)):
        np.testing.assert_allclose(got, w, rtol=1e-12, atol=1e-12)
    assert on_host.calls == 2 * seq


@pytest.mark.parametrize("kernel,stride,padding,groups", [(3, 1, 1, 1), (3, 2, 1, 2), ((1, 7), 1, (0, 3), 1),
                                                          (1, 2, 0, 1), (3, 1, 1, 8)])
def test_conv_gemm_path_matches_the_cpu(on_host, monkeypatch, kernel, stride, padding, groups):
    """Conv2d's GPU path (im2col and col2im from the host build, the gradients' GEMMs through gemm)
    against the same op on the CPU, forward and backward, float32."""
    import types

    from ops.base import TensorSpec
    from ops.conv import Conv2d
    from taskrt.geometry import Rect
    gpu = types.SimpleNamespace(**{k: getattr(np, k) for k in dir(np) if not k.startswith("__")})
    monkeypatch.setattr(cuda_kernels, "on_gpu", lambda xp: xp is gpu)
    rng = np.random.default_rng(3)
    shape = (3, 8, 9, 10)
    op = Conv2d("c", [TensorSpec(shape, "float32", "x")], out_channels=16, kernel=kernel, stride=stride,
                padding=padding, groups=groups, use_bias=True)
    weights = {k: rng.standard_normal(s).astype(np.float32) for k, s in op.weight_shapes().items()}
    x = rng.standard_normal(shape).astype(np.float32)
    tile = Rect.from_shape(op.outputs[0].shape)
    in_rects = op.input_rects(tile)
    dy = rng.standard_normal(op.outputs[0].shape).astype(np.float32)
    assert op._path(gpu, tile) == "gemm"
    results = []
    for xp in (np, gpu):
        (y,), saved = op.forward(xp, tile, [x], in_rects, weights)
        (dx,), grads = op.backward(xp, tile, [x], in_rects, weights, [y], [dy], saved)
        results.append((y, dx, grads["weight"], grads["bias"]))
    for cpu, on_gpu in zip(*results):
        np.testing.assert_allclose(on_gpu, cpu, rtol=2e-4, atol=2e-4)
    assert on_host.calls == 2 * groups   # backward's two products a group (forward: cupy's batched matmul)
