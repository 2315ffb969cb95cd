"""Forward + backward time of the main operators against PyTorch, same threads, same run.

Each operator runs its own kernels on the whole tile (the unsplit op), at realistic
shapes, and with --tiles also on the tiles strategies make of it (a quarter of the batch,
half the channels: views of the whole arrays, as the runtime hands them over); PyTorch
runs the equivalent module on the same (tile of the) data with the same weights and
torch.set_num_threads equal to our BLAS threads. With --gpu both sides run on the GPU
(cupy against PyTorch CUDA), timed with CUDA events after a warm-up, both in plain float32:
PyTorch's TF32 (on by default for cuDNN's convolutions and RNNs) is switched off, as our
kernels compute in float32 and their tests hold them to float32's error. The two sides run in
child processes of this run, taking turns (--rounds, each case keeping its best):
OpenBLAS's and PyTorch's thread pools in one process slow each other down several times
over on a small machine. Both run with the malloc settings our runtime makes (taskrt.heap:
freed buffers kept for reuse; without them, which of a kernel's allocations fault their pages
in again depends on the allocation history, and one case moved 4x from run to run). Ratio =
ours / PyTorch (lower is better).
Usage: python bench/ops.py [--quick] [--tiles] [--gpu] [--rounds N] [--only NAME ...]. Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

# run as a script, this file's folder comes first on sys.path, and bench/ops.py would
# shadow the ops package: look in the repository root instead
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from ops.attention import MultiHeadAttention
from ops.base import TensorSpec
from ops.conv import Conv2d
from ops.pool import Pool2d
from ops.embedding import Embedding
from ops.linear import Dense
from ops.lstm import LSTM
from ops.activation import ElementUnary, Softmax
from ops.norm import BatchNorm, LayerNorm
from taskrt.geometry import Rect

#: a case runs at least `repeats` times and until its runs add up to this many seconds (at most
#: MAX_REPEATS runs): a sub-millisecond case's best of three moved its ratio by 10% between runs
MIN_SECONDS = 0.25
MAX_REPEATS = 200


def more(times: list, repeats: int) -> bool:
    """Whether a case timed `times` so far runs again."""
    return len(times) < repeats or (sum(times) < MIN_SECONDS and len(times) < MAX_REPEATS)


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    while more(times, repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def tile_rect(op, parts: dict[int, int]) -> Rect:
    """The first tile of `op` when dim d of its tile space is cut into parts[d] equal pieces."""
    shape = op.tile_shape
    hi = [n // parts.get(d, 1) if d in parts else n for d, n in enumerate(shape)]
    return Rect.make([0] * len(shape), hi)


def tile_arrays(op, tile: Rect, inputs, weights, state):
    """What a tile is given: views of the inputs at its input rects, of the weights and state at
    its weight rects (as the runtime hands a tile its pieces of bigger regions)."""
    in_rects = op.input_rects(tile)
    ins = [x[r.slices()] for x, r in zip(inputs, in_rects)]
    wr = op.tile_weight_rects(tile)
    ws = {k: a[wr[k].slices()] for k, a in weights.items() if k in wr and not wr[k].empty}
    st = None if state is None else {k: a[wr[k].slices()] for k, a in state.items() if k in wr}
    return in_rects, ins, ws, st


def ours_fwd_bwd(xp, op, inputs, weights, state=None, tile=None):
    tile = tile or Rect.from_shape(op.tile_shape)
    in_rects, ins, ws, st = tile_arrays(op, tile, inputs, weights, state)
    rng = np.random.default_rng(1)
    grads = [xp.asarray(rng.standard_normal(r.shape).astype(o.dtype))
             for o, r in zip(op.outputs, op.output_rects(tile))]
    # an op that writes its weight gradients into the runtime's buffers is given them, as in training
    extra = {"weight_out": {k: xp.empty_like(w) for k, w in ws.items()}} if op.writes_weight_out else {}

    def step():
        outs, saved = op.forward(xp, tile, ins, in_rects, ws, training=True,
                                 state=None if st is None else {k: v.copy() for k, v in st.items()})
        op.backward(xp, tile, ins, in_rects, ws, outs, grads, saved, **extra)
    return step


def torch_fwd_bwd(module_fn, inputs):
    import torch

    def step():
        xs = [x.detach().requires_grad_(x.is_floating_point()) for x in inputs]
        outs = module_fn(*xs)
        outs = outs if isinstance(outs, (tuple, list)) else (outs,)
        torch.autograd.backward(list(outs), [torch.ones_like(o) for o in outs])
    return step


@dataclass
class Case:
    """One benchmark: our op with its inputs, weights and state (numpy), `torch_step(inputs,
    weights, t)` building PyTorch's step from (tile views of) them with `t` moving an array to
    torch, and the tile variants {label: {tile dim: parts}} also timed with --tiles."""

    name: str
    op: object
    inputs: list
    weights: dict
    torch_step: Callable
    state: dict | None = None
    variants: dict = field(default_factory=lambda: {"batch/4": {0: 4}})


def cases(quick: bool) -> list[Case]:
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(0)
    s = 4 if quick else 1

    def spec(shape, dtype="float32"):
        return TensorSpec(tuple(shape), dtype, "x")

    def arr(shape):
        return rng.standard_normal(shape).astype(np.float32)

    out = []

    def conv(name, shape, cout, kernel, stride, padding, bias=False, variants=None):
        op = Conv2d(name, [spec(shape)], out_channels=cout, kernel=kernel, stride=stride, padding=padding,
                    use_bias=bias)
        w = op.init_weights(rng)

        def step(ins, ws, t):
            args = [t(ins[0]), t(ws["weight"])] + ([t(ws["bias"])] if "bias" in ws else [])
            return torch_fwd_bwd(lambda a, ww, bb=None: F.conv2d(a, ww, bb, stride=stride, padding=padding), args)
        out.append(Case(name, op, [arr(shape)], w, step,
                        variants=variants or {"batch/4": {0: 4}, "cout/2": {1: 2}}))

    # AlexNet's first convolution, batch 64
    conv("conv_alexnet1", (64 // s, 3, 224, 224), 96, (11, 11), (4, 4), (2, 2), bias=True)
    # ResNet convolutions: a 3x3 of stage 1, a bottleneck 1x1 (256 -> 64), a strided 3x3
    conv("conv_resnet3x3", (32 // s, 64, 56, 56), 64, (3, 3), (1, 1), (1, 1))
    conv("conv_1x1", (32 // s, 256, 56, 56), 64, (1, 1), (1, 1), (0, 0))
    conv("conv_3x3_s2", (32 // s, 128, 56, 56), 128, (3, 3), (2, 2), (1, 1))
    # Inception-v3's grid reduction (Mixed_6a's 3x3 stride 2, 288 -> 384, 35x35 -> 17x17)
    conv("conv_3x3_s2_inception", (32 // s, 288, 35, 35), 384, (3, 3), (2, 2), (0, 0))
    # Inception-v3's factorized 1x7 (the 17x17 grid, 192 -> 192)
    conv("conv_1x7", (32 // s, 192, 17, 17), 192, (1, 7), (1, 1), (0, 3))
    # and its 3x1 of the 8x8 grid (384 -> 384)
    conv("conv_3x1", (32 // s, 384, 8, 8), 384, (3, 1), (1, 1), (1, 0))
    # the small CNN of bench/scaling.py, batch 32 per rank: 3 -> 16 on 32x32, 16 -> 32 on 16x16
    conv("conv_small_32", (32 // s, 3, 32, 32), 16, (3, 3), (1, 1), (1, 1), bias=True)
    conv("conv_small_16", (32 // s, 16, 16, 16), 32, (3, 3), (1, 1), (1, 1), bias=True)

    # dense 4096 x 4096 at batch 64
    op = Dense("fc", [spec((64, 4096))], out_features=4096)
    out.append(Case("dense_4096", op, [arr((64, 4096))], op.init_weights(rng),
                    lambda ins, ws, t: torch_fwd_bwd(F.linear, [t(ins[0]), t(ws["weight"]), t(ws["bias"])]),
                    variants={"batch/4": {0: 4}, "out/2": {1: 2}}))

    # LSTM of 1024 units over 40 steps, batch 64
    b = 64 // s
    op = LSTM("lstm", [spec((b, 40, 1024))], hidden_size=1024)

    def lstm_step(ins, ws, t):
        lstm = torch.nn.LSTM(1024, 1024, batch_first=True)
        with torch.no_grad():
            for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                getattr(lstm, f"{name}_l0").copy_(t(ws[name]).cpu())
        lstm = lstm.to(t(ins[0]).device)
        return torch_fwd_bwd(lambda a: lstm(a)[0], [t(ins[0])])
    out.append(Case("lstm_1024x40", op, [arr((b, 40, 1024))], op.init_weights(rng), lstm_step))

    # embedding of 50k x 1024, batch 64 x 40 tokens; and one whose indices repeat (a
    # language model's frequent words: 64 x 40 tokens over 500 distinct rows)
    for name, high in (("embedding_50k", 50000), ("embedding_repeat", 500)):
        op = Embedding(name, [spec((64, 40), "int64")], num_embeddings=50000, embedding_dim=1024)
        idx = rng.integers(0, high, (64, 40))
        out.append(Case(name, op, [idx], op.init_weights(rng),
                        lambda ins, ws, t: torch_fwd_bwd(lambda ww, i=t(ins[0]): F.embedding(i, ww),
                                                         [t(ws["weight"])])))

    # multi-head attention at 512 tokens, E = 512, 8 heads, batch 8
    b = 8 // s if not quick else 2
    op = MultiHeadAttention("mha", [spec((b, 512, 512))] * 3, num_heads=8)
    q = arr((b, 512, 512))

    def mha_step(ins, ws, t):
        mha = torch.nn.MultiheadAttention(512, 8, batch_first=True)
        with torch.no_grad():
            mha.in_proj_weight.copy_(t(ws["in_proj_weight"]).cpu())
            mha.in_proj_bias.copy_(t(ws["in_proj_bias"]).cpu())
            mha.out_proj.weight.copy_(t(ws["out_proj_weight"]).cpu())
            mha.out_proj.bias.copy_(t(ws["out_proj_bias"]).cpu())
        mha = mha.to(t(ins[0]).device)
        return torch_fwd_bwd(lambda a, k, v: mha(a, k, v, need_weights=False)[0], [t(x) for x in ins])
    out.append(Case("attention_512", op, [q, q, q], op.init_weights(rng), mha_step,
                    variants={"batch/2": {0: 2}}))

    # max pooling 3x3 stride 2 (AlexNet/ResNet style)
    shape = (32 // s, 64, 112, 112)
    op = Pool2d("pool", [spec(shape)], kernel=(3, 3), stride=(2, 2), padding=(1, 1), pool_type="max")
    out.append(Case("maxpool_3x3", op, [arr(shape)], {},
                    lambda ins, ws, t: torch_fwd_bwd(lambda a: F.max_pool2d(a, 3, 2, 1), [t(ins[0])]),
                    variants={"batch/4": {0: 4}, "c/2": {1: 2}}))

    # batch norm in training mode
    shape = (32 // s, 64, 56, 56)
    op = BatchNorm("bn", [spec(shape)])
    w = op.init_weights(rng)
    state = {k: w.pop(k) for k in list(w) if k.startswith("running")}

    def bn_step(ins, ws, t):
        c = ws["weight"].shape[0]
        return torch_fwd_bwd(lambda a, g, bb: F.batch_norm(a, torch.zeros(c, device=a.device),
                                                           torch.ones(c, device=a.device), g, bb, training=True),
                             [t(ins[0]), t(ws["weight"]), t(ws["bias"])])
    out.append(Case("batch_norm", op, [arr(shape)], w, bn_step, state=state, variants={"c/2": {1: 2}}))

    # layer norm and softmax at transformer sizes: BERT-base's 768 features over 8 x 512 tokens,
    # the attention scores' softmax over 512 keys (8 x 12 heads x 512 queries)
    shape = (8 // min(s, 2), 512, 768)
    op = LayerNorm("ln", [spec(shape)], normalized_shape=(768,))
    out.append(Case("layer_norm", op, [arr(shape)], op.init_weights(rng),
                    lambda ins, ws, t: torch_fwd_bwd(lambda a, g, bb: F.layer_norm(a, (768,), g, bb),
                                                     [t(ins[0]), t(ws["weight"]), t(ws["bias"])])))
    shape = (8 // min(s, 2), 12, 512, 512)
    op = Softmax("softmax", [spec(shape)])
    out.append(Case("softmax", op, [arr(shape)], {},
                    lambda ins, ws, t: torch_fwd_bwd(lambda a: torch.softmax(a, -1), [t(ins[0])])))
    # gelu over BERT-base's intermediate activations, 3072 features over 8 x 512 tokens
    shape = (8 // min(s, 2), 512, 3072)
    op = ElementUnary("gelu", [spec(shape)], fn="gelu")
    out.append(Case("gelu", op, [arr(shape)], {}, lambda ins, ws, t: torch_fwd_bwd(F.gelu, [t(ins[0])])))
    return out


def timer(side: str, gpu: bool):
    """A best-of-n timer for one side: wall clock on the CPU; CUDA events around the step on
    a GPU (after a synchronize), so only device time counts."""
    if not gpu:
        return best_of
    if side == "ours":
        import cupy

        def event_pair():
            return cupy.cuda.Event(), cupy.cuda.Event()

        def elapsed(e0, e1):
            return cupy.cuda.get_elapsed_time(e0, e1) / 1e3
        sync = cupy.cuda.Device().synchronize
    else:
        import torch

        def event_pair():
            return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def elapsed(e0, e1):
            return e0.elapsed_time(e1) / 1e3
        sync = torch.cuda.synchronize

    def best_of_events(fn, repeats: int) -> float:
        fn()
        sync()
        times = []
        while more(times, repeats):
            e0, e1 = event_pair()
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            times.append(elapsed(e0, e1))
        return min(times)
    return best_of_events


def run_side(side: str, quick: bool, only, tiles: bool, gpu: bool) -> dict:
    """Time one side for every case (and its tile variants with `tiles`) in this process:
    name -> seconds."""
    import torch

    from taskrt.heap import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    repeats = (2 if quick else 3) * (5 if gpu else 1)
    time_it = timer(side, gpu)
    if gpu and side == "ours":
        import cupy as xp
    else:
        xp = np
    device = "cuda" if gpu else "cpu"
    if gpu:
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False

    def t(x):
        x = x.get() if hasattr(x, "get") else x
        return torch.from_numpy(np.ascontiguousarray(x)).to(device)

    times = {}
    for case in cases(quick):
        if only and case.name not in only:
            continue
        inputs = [xp.asarray(x) for x in case.inputs]
        weights = {k: xp.asarray(v) for k, v in case.weights.items()}
        state = None if case.state is None else {k: xp.asarray(v) for k, v in case.state.items()}
        shapes = {case.name: None}
        if tiles:
            shapes.update({f"{case.name}@{label}": parts for label, parts in case.variants.items()})
        for name, parts in shapes.items():
            tile = None if parts is None else tile_rect(case.op, parts)
            if side == "ours":
                step = ours_fwd_bwd(xp, case.op, inputs, weights, state, tile)
            else:
                _, ins, ws, _ = tile_arrays(case.op, tile or Rect.from_shape(case.op.tile_shape),
                                            case.inputs, case.weights, case.state)
                step = case.torch_step(ins, ws, t)
            times[name] = time_it(step, repeats)
            print(f"  {side:<8}{name:<28}{times[name] * 1e3:>10.2f} ms", file=sys.stderr, flush=True)
    return times


def main(argv=None):
    import subprocess

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller batches, fewer repeats")
    parser.add_argument("--only", nargs="*", default=None, help="case names")
    parser.add_argument("--tiles", action="store_true",
                        help="also time each case's tile shapes (a quarter of the batch, half the channels)")
    parser.add_argument("--gpu", action="store_true", help="cupy against PyTorch CUDA on the same GPU")
    parser.add_argument("--rounds", type=int, default=2,
                        help="turns each side takes, alternating; a case keeps its best (default 2)")
    parser.add_argument("--side", choices=["ours", "pytorch"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        print(json.dumps(run_side(args.side, args.quick, args.only, args.tiles, args.gpu)))
        return
    if args.gpu:
        try:
            import cupy
            import torch
            cupy.cuda.runtime.getDeviceCount()
            if not torch.cuda.is_available():
                raise RuntimeError("torch.cuda.is_available() is False")
        except Exception as e:  # noqa: BLE001 - any failure to reach a GPU is one message
            sys.exit(f"bench/ops.py --gpu: no usable GPU here ({type(e).__name__}: {e})")
    if args.rounds < 1:
        sys.exit(f"bench/ops.py --rounds: must be at least 1, got {args.rounds}")
    known = {c.name for c in cases(True)}
    unknown = sorted(set(args.only or ()) - known)
    if unknown:
        sys.exit(f"bench/ops.py --only: unknown case(s) {unknown}; known: {sorted(known)}")
    threads = int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads)}
    flags = ((["--quick"] if args.quick else []) + (["--only", *args.only] if args.only else [])
             + (["--tiles"] if args.tiles else []) + (["--gpu"] if args.gpu else []))
    sides: dict[str, dict[str, float]] = {"ours": {}, "pytorch": {}}
    for _ in range(args.rounds):
        # the sides take turns, and each case keeps its best round: a shared machine's speed
        # drifts by tens of percent within minutes, and one child after the other measured it
        for side in ("ours", "pytorch"):
            out = subprocess.run([sys.executable, __file__, "--side", side, *flags], env=env, check=True,
                                 stdout=subprocess.PIPE, text=True)
            for name, seconds in json.loads(out.stdout.strip().splitlines()[-1]).items():
                sides[side][name] = min(seconds, sides[side].get(name, seconds))
    target = 1.2 if args.gpu else 1.0
    ratios = {}
    print(f"{'operator':<28}{'ours':>12}{'pytorch':>12}{'ratio':>8}  target {target}")
    for name, ours in sides["ours"].items():
        theirs = sides["pytorch"][name]
        ratios[name] = round(ours / theirs, 3)
        print(f"{name:<28}{ours * 1e3:>9.2f} ms{theirs * 1e3:>9.2f} ms{ours / theirs:>8.2f}")
    print(json.dumps({"bench": "ops", "device": "gpu" if args.gpu else "cpu", "threads": threads, "rounds": args.rounds,
                      "unit": "ratio ours/pytorch, forward+backward", "target": target,
                      "worst": max(ratios, key=ratios.get) if ratios else None, "ratios": ratios,
                      "ms": {n: {"ours": round(sides["ours"][n] * 1e3, 3),
                                 "pytorch": round(sides["pytorch"][n] * 1e3, 3)} for n in ratios}}))


if __name__ == "__main__":
    main()
