"""Where a convolution's time goes on a GPU: each phase of Conv2d's "gemm" path timed alone
with CUDA events (best of several after a warm-up), beside the whole forward and backward and
PyTorch's (cuDNN, TF32 off) on the same shapes. Needs cupy and PyTorch CUDA.
Usage: python bench/gpu_conv_phases.py [--rounds N]. Last line: one JSON object (ms).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the ops package, not bench/ops.py

from ops import cuda_kernels
from ops.base import TensorSpec
from ops.conv import Conv2d
from taskrt.geometry import Rect

#: (name, input shape, out channels, kernel, stride, padding), as in bench/ops.py
CASES = [("conv_resnet3x3", (32, 64, 56, 56), 64, (3, 3), (1, 1), (1, 1)),
         ("conv_3x3_s2", (32, 128, 56, 56), 128, (3, 3), (2, 2), (1, 1)),
         ("conv_1x1", (32, 256, 56, 56), 64, (1, 1), (1, 1), (0, 0)),
         ("conv_3x1", (32, 384, 8, 8), 384, (3, 1), (1, 1), (1, 0))]


def best_ms(fn, rounds: int) -> float:
    import cupy
    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(rounds):
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        times.append(cupy.cuda.get_elapsed_time(e0, e1))
    return round(min(times), 3)


def phases(case, rounds: int) -> dict:
    import cupy as cp
    import torch
    import torch.nn.functional as F

    name, shape, cout, kernel, stride, padding = case
    op = Conv2d(name, [TensorSpec(shape, "float32", "x")], out_channels=cout, kernel=kernel, stride=stride,
                padding=padding, use_bias=False)
    rng = np.random.default_rng(0)
    x = cp.asarray(rng.standard_normal(shape, dtype=np.float32))
    w = cp.asarray(op.init_weights(rng)["weight"])
    tile = Rect.from_shape(op.tile_shape)
    (in_rect,) = op.input_rects(tile)
    pads = op._pads(tile, in_rect)
    n, oc, oh, ow = tile.shape
    corner = (pads[0][0], pads[1][0])
    cols = cuda_kernels.im2col(x, kernel, stride, corner, (oh, ow))
    w2 = w.reshape(oc, -1)
    yt = w2 @ cols
    dy = cp.asarray(rng.standard_normal(tile.shape, dtype=np.float32))
    dyt = cp.ascontiguousarray(dy.reshape(n, oc, -1).transpose(1, 0, 2)).reshape(oc, -1)
    dcols = w2.T @ dyt
    dx = cp.empty(shape, cp.float32)
    out = {
        "im2col": best_ms(lambda: cuda_kernels.im2col(x, kernel, stride, corner, (oh, ow)), rounds),
        "gemm_forward": best_ms(lambda: w2 @ cols, rounds),
        "y_transpose": best_ms(lambda: cp.ascontiguousarray(yt.reshape(oc, n, -1).transpose(1, 0, 2)), rounds),
        "dy_transpose": best_ms(lambda: cp.ascontiguousarray(dy.reshape(n, oc, -1).transpose(1, 0, 2)), rounds),
        "gemm_weight_grad": best_ms(lambda: dyt @ cols.T, rounds),
        "gemm_columns_grad": best_ms(lambda: w2.T @ dyt, rounds),
        "col2im": best_ms(lambda: cuda_kernels.col2im(dcols, kernel, stride, corner, (oh, ow), dx), rounds),
    }
    y = cp.empty((n, oc, oh * ow), cp.float32)
    out["forward"] = best_ms(lambda: op._forward_gemm(cp, tile, x, pads, w, y), rounds)
    out["backward"] = best_ms(lambda: op._backward_gemm(cp, tile, x, pads, w, dy, dx), rounds)
    torch.backends.cudnn.allow_tf32 = False
    tx = torch.as_tensor(x, device="cuda").requires_grad_(True)
    tw = torch.as_tensor(w, device="cuda").requires_grad_(True)
    tdy = torch.as_tensor(dy, device="cuda")

    def torch_step():
        torch.autograd.backward([F.conv2d(tx, tw, stride=stride, padding=padding)], [tdy])
    out["pytorch_forward_backward"] = best_ms(torch_step, rounds)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="timed runs of each phase (default 10)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        sys.exit(f"bench/gpu_conv_phases.py --rounds: must be at least 1, got {args.rounds}")
    from taskrt.machine import count_gpus
    if count_gpus() == 0:  # (make bench runs every benchmark; this one has nothing to time here)
        print(json.dumps({"bench": "gpu_conv_phases", "skipped": "no GPU visible through cupy"}))
        return
    results = {}
    for case in CASES:
        results[case[0]] = phases(case, args.rounds)
        print(case[0], results[case[0]], file=sys.stderr, flush=True)
    print(json.dumps({"bench": "gpu_conv_phases", "unit": "ms, best of --rounds", "cases": results}))


if __name__ == "__main__":
    main()
