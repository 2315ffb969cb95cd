"""Forward + backward time of the main operators against PyTorch on the CPU, same threads, same run.

Each operator runs its own kernels on the whole tile (the unsplit op), at realistic
shapes; PyTorch runs the equivalent module with the same weights and torch.set_num_threads
equal to our BLAS threads. The two sides run in two child processes of this run, one after
the other: OpenBLAS's and PyTorch's thread pools in one process slow each other down
several times over on a small machine. Ratio = ours / PyTorch (lower is better).
Usage: python bench/ops.py [--quick] [--only NAME ...]. Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

# run as a script, this file's folder comes first on sys.path, and bench/ops.py would
# shadow the ops package: look in the repository root instead
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from ops.attention import MultiHeadAttention
from ops.base import TensorSpec
from ops.conv import Conv2d, Pool2d
from ops.embedding import Embedding
from ops.linear import Dense
from ops.lstm import LSTM
from ops.norm import BatchNorm
from taskrt.geometry import Rect

MATRIX_BOUND = {"conv_alexnet1", "conv_resnet3x3", "dense_4096", "lstm_1024x40", "attention_512"}


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def ours_fwd_bwd(op, inputs, weights, state=None):
    tile = Rect.from_shape(op.tile_shape)
    in_rects = op.input_rects(tile)
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(o.shape).astype(o.dtype) for o in op.outputs]

    def step():
        outs, saved = op.forward(np, tile, inputs, in_rects, weights, training=True,
                                 state=None if state is None else {k: v.copy() for k, v in state.items()})
        op.backward(np, tile, inputs, in_rects, weights, outs, grads, saved)
    return step


def torch_fwd_bwd(module_fn, inputs):
    import torch

    def step():
        xs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
        outs = module_fn(*xs)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        torch.autograd.backward(list(outs), [torch.ones_like(o) for o in outs])
    return step


def cases(quick: bool):
    """(name, our op, our inputs, our weights, our state, torch step builder)."""
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(0)
    s = 4 if quick else 1

    def spec(shape, dtype="float32"):
        return TensorSpec(tuple(shape), dtype, "x")

    def arr(shape):
        return rng.standard_normal(shape).astype(np.float32)

    def t(x):
        return torch.from_numpy(np.ascontiguousarray(x))

    out = []
    # AlexNet's first convolution, batch 64
    shape = (64 // s, 3, 224, 224)
    op = Conv2d("conv1", [spec(shape)], out_channels=96, kernel=(11, 11), stride=(4, 4), padding=(2, 2))
    w = op.init_weights(rng)
    x = arr(shape)
    out.append(("conv_alexnet1", op, [x], w, None,
                lambda x=x, w=w: torch_fwd_bwd(lambda a, ww, bb: F.conv2d(a, ww, bb, stride=4, padding=2),
                                               [t(x), t(w["weight"]), t(w["bias"])])))
    # a ResNet 3x3 convolution
    shape = (32 // s, 64, 56, 56)
    op = Conv2d("res3x3", [spec(shape)], out_channels=64, kernel=(3, 3), stride=(1, 1), padding=(1, 1),
                use_bias=False)
    w = op.init_weights(rng)
    x = arr(shape)
    out.append(("conv_resnet3x3", op, [x], w, None,
                lambda x=x, w=w: torch_fwd_bwd(lambda a, ww: F.conv2d(a, ww, padding=1),
                                               [t(x), t(w["weight"])])))
    # dense 4096 x 4096 at batch 64
    op = Dense("fc", [spec((64, 4096))], out_features=4096)
    w = op.init_weights(rng)
    x = arr((64, 4096))
    out.append(("dense_4096", op, [x], w, None,
                lambda x=x, w=w: torch_fwd_bwd(lambda a, ww, bb: F.linear(a, ww, bb),
                                               [t(x), t(w["weight"]), t(w["bias"])])))
    # LSTM of 1024 units over 40 steps, batch 64
    b = 64 // s
    op = LSTM("lstm", [spec((b, 40, 1024))], hidden_size=1024)
    w = op.init_weights(rng)
    x = arr((b, 40, 1024))
    lstm = torch.nn.LSTM(1024, 1024, batch_first=True)
    with torch.no_grad():
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(lstm, f"{name}_l0").copy_(t(w[name]))
    out.append(("lstm_1024x40", op, [x], w, None,
                lambda x=x, lstm=lstm: torch_fwd_bwd(lambda a: lstm(a)[0], [t(x)])))
    # embedding of 50k x 1024, batch 64 x 40 tokens
    op = Embedding("emb", [spec((64, 40), "int64")], num_embeddings=50000, embedding_dim=1024)
    w = op.init_weights(rng)
    idx = rng.integers(0, 50000, (64, 40))
    out.append(("embedding_50k", op, [idx], w, None,
                lambda idx=idx, w=w: torch_fwd_bwd(lambda ww: F.embedding(t(idx), ww), [t(w["weight"])])))
    # multi-head attention at 512 tokens, E = 512, 8 heads, batch 8
    b = 8 // s if not quick else 2
    op = MultiHeadAttention("mha", [spec((b, 512, 512))] * 3, num_heads=8)
    w = op.init_weights(rng)
    q = arr((b, 512, 512))
    mha = torch.nn.MultiheadAttention(512, 8, batch_first=True)
    with torch.no_grad():
        mha.in_proj_weight.copy_(t(w["in_proj_weight"]))
        mha.in_proj_bias.copy_(t(w["in_proj_bias"]))
        mha.out_proj.weight.copy_(t(w["out_proj_weight"]))
        mha.out_proj.bias.copy_(t(w["out_proj_bias"]))
    out.append(("attention_512", op, [q, q, q], w, None,
                lambda q=q, mha=mha: torch_fwd_bwd(lambda a, k, v: mha(a, k, v, need_weights=False)[0],
                                                   [t(q), t(q), t(q)])))
    # max pooling 3x3 stride 2 (AlexNet/ResNet style)
    shape = (32 // s, 64, 112, 112)
    op = Pool2d("pool", [spec(shape)], kernel=(3, 3), stride=(2, 2), padding=(1, 1), pool_type="max")
    x = arr(shape)
    out.append(("maxpool_3x3", op, [x], {}, None,
                lambda x=x: torch_fwd_bwd(lambda a: F.max_pool2d(a, 3, 2, 1), [t(x)])))
    # batch norm in training mode
    shape = (32 // s, 64, 56, 56)
    op = BatchNorm("bn", [spec(shape)])
    w = op.init_weights(rng)
    state = {k: w.pop(k) for k in list(w) if k.startswith("running")}
    x = arr(shape)
    out.append(("batch_norm", op, [x], w, state,
                lambda x=x, w=w: torch_fwd_bwd(
                    lambda a, g, bb: F.batch_norm(a, torch.zeros(64), torch.ones(64), g, bb, training=True),
                    [t(x), t(w["weight"]), t(w["bias"])])))
    return out


def run_side(side: str, quick: bool, only) -> dict:
    """Time one side for every case in this process: name -> seconds."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    repeats = 2 if quick else 3
    times = {}
    for name, op, inputs, weights, state, torch_step in cases(quick):
        if only and name not in only:
            continue
        step = ours_fwd_bwd(op, inputs, weights, state) if side == "ours" else torch_step()
        times[name] = best_of(step, repeats)
        print(f"  {side:<8}{name:<16}{times[name] * 1e3:>10.1f} ms", file=sys.stderr, flush=True)
    return times


def main(argv=None):
    import subprocess

    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller batches, fewer repeats")
    parser.add_argument("--only", nargs="*", default=None)
    parser.add_argument("--side", choices=["ours", "pytorch"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        print(json.dumps(run_side(args.side, args.quick, args.only)))
        return
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads)}
    flags = (["--quick"] if args.quick else []) + (["--only", *args.only] if args.only else [])
    sides = {}
    for side in ("ours", "pytorch"):
        out = subprocess.run([sys.executable, __file__, "--side", side, *flags], env=env, check=True,
                             stdout=subprocess.PIPE, text=True)
        sides[side] = json.loads(out.stdout.strip().splitlines()[-1])
    ratios = {}
    print(f"{'operator':<16}{'ours':>12}{'pytorch':>12}{'ratio':>8}  target")
    for name, ours in sides["ours"].items():
        theirs = sides["pytorch"][name]
        ratios[name] = round(ours / theirs, 3)
        print(f"{name:<16}{ours * 1e3:>9.1f} ms{theirs * 1e3:>9.1f} ms{ours / theirs:>8.2f}  "
              f"{'1.5' if name in MATRIX_BOUND else '3'}")
    print(json.dumps({"bench": "ops", "threads": threads, "unit": "ratio ours/pytorch, forward+backward",
                      "ratios": ratios,
                      "ms": {n: {"ours": round(sides["ours"][n] * 1e3, 2),
                                 "pytorch": round(sides["pytorch"][n] * 1e3, 2)} for n in ratios}}))


if __name__ == "__main__":
    main()
