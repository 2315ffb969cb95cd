"""Samples per second of each tiny app on 1 and 2 ranks against the same network in PyTorch, same run.

Ours: `python -m apps.NAME --tiny`, its cores laid out two ways and the faster one taken (both
reported under "layouts"): every core a CPU processor with one BLAS thread (tasks in parallel),
and one CPU processor using every core (intra-op threads, BLAS's and the kernels' parts, as
PyTorch does). The processors of one process share one interpreter, and on tiny tiles they
spend more waiting for it and waking each other than the parallel kernels save: the tiny
transformer ran 402 samples/s on 2 processors and 1,417 on one. On 1 rank the two layouts
differ; on 2 ranks under mpiexec each rank has half the cores, one core here, and they are the
same. PyTorch: the very graph the app builds, translated op by op
into torch calls with the app's initial weights (so it is the same network), trained on the
same synthetic batches (made per sample by the same generator) with the same optimizer, with
torch.set_num_threads equal to our CPU processors (OpenMP threads that sleep rather than spin
while they wait, OMP_WAIT_POLICY=PASSIVE: spinning threads on a shared machine made PyTorch's
2-thread runs several times slower than its 1-thread ones); 2 ranks: DistributedDataParallel
over gloo, each rank making its half of every batch, with batch norm's statistics summed over
the ranks (SyncBatchNorm's algorithm: one all-reduce of the moments in forward, one of the
gradient sums in backward, as ours does; PyTorch's own SyncBatchNorm runs on GPUs only), since
data parallelism here computes what one device computes on the whole batch; --local-bn gives
DDP's default instead, each rank's statistics of its half, a different network function.
Each side runs in its own child processes, one after
the other. Iterations after the warm-up count. Ratio = ours / PyTorch samples per second
(higher is better, target >= 0.8); for an app below it a traced run of ours says where the
time of a steady-state iteration goes (busy processors, the busiest op kinds, idle time).

    python bench/apps.py [--quick] [--only mlp alexnet ...] [--iterations 20] [--warmup 5] [--local-bn]

Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

# run as a script, this file's folder comes first on sys.path and bench/apps.py would shadow the
# apps package: look in the repository root instead
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT

import importlib  # noqa: E402

from apps.cli import APPS, at_least  # noqa: E402

TARGET = 0.8


# ---- the app's graph as a torch module -----------------------------------------------------------
def synced_batch_norm():
    """Batch norm in training with statistics over every rank of the default process group (the
    algorithm of torch.nn.SyncBatchNorm, which runs on GPUs only): fn(x, weight, bias, eps) ->
    (y, mean, biased variance, samples), float64 moment sums as ours."""
    import torch
    import torch.distributed as dist

    class SyncedBatchNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, bias, eps):
            dims = [0] + list(range(2, x.dim()))
            c = x.shape[1]
            xd = x.double()
            packed = torch.cat([xd.sum(dims), (xd * xd).sum(dims),
                                torch.tensor([x.numel() / c], dtype=torch.float64)])
            dist.all_reduce(packed)
            count = packed[-1]
            mean = packed[:c] / count
            var = (packed[c:2 * c] / count - mean * mean).clamp(min=0)
            shape = [1, c] + [1] * (x.dim() - 2)
            invstd = (var + eps).rsqrt().to(x.dtype).view(shape)
            xhat = (x - mean.to(x.dtype).view(shape)) * invstd
            ctx.save_for_backward(xhat, weight, invstd, count)
            ctx.mark_non_differentiable(mean, var, count)
            return xhat * weight.view(shape) + bias.view(shape), mean, var, count

        @staticmethod
        def backward(ctx, dy, _mean, _var, _count):
            xhat, weight, invstd, count = ctx.saved_tensors
            dims = [0] + list(range(2, dy.dim()))
            c = dy.shape[1]
            local = torch.cat([dy.sum(dims), (dy * xhat).sum(dims)])
            total = local.clone()
            dist.all_reduce(total)
            shape = [1, c] + [1] * (dy.dim() - 2)
            mean_dy = (total[:c] / count).to(dy.dtype).view(shape)
            mean_dy_xhat = (total[c:] / count).to(dy.dtype).view(shape)
            dx = (dy - mean_dy - xhat * mean_dy_xhat) * invstd * weight.view(shape)
            # the weights' gradients from this rank's samples: DDP averages them over the ranks
            return dx, local[c:], local[:c], None

    return SyncedBatchNorm.apply


def torch_network(model, sync_bn: bool = False):
    """A torch.nn.Module running `model`'s ops (built with weights) with torch calls and its weights;
    sync_bn: batch norm in training with statistics over every rank (synced_batch_norm)."""
    import torch
    import torch.nn.functional as F

    activations = {"relu": torch.relu, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "gelu": F.gelu}
    synced = synced_batch_norm() if sync_bn else None

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            values, stats = model.parameters(), model.stats()
            modules = {op.name for op in model.ops if op.kind in ("lstm", "multihead_attention")}
            self.weights = torch.nn.ParameterDict({k.replace(".", ":"): torch.nn.Parameter(torch.from_numpy(v))
                                                   for k, v in values.items() if k.rsplit(".", 1)[0] not in modules})
            for k, v in stats.items():
                self.register_buffer(k.replace(".", ":"), torch.from_numpy(v.copy()))
            self.lstms = torch.nn.ModuleDict()
            self.attention = torch.nn.ModuleDict()
            for op in model.ops:
                if op.kind == "lstm":
                    self.lstms[op.name.replace(".", ":")] = self._lstm(op, values)
                elif op.kind == "multihead_attention":
                    self.attention[op.name.replace(".", ":")] = self._mha(op, values)

        def w(self, op, name):
            key = f"{op.name}:{name}".replace(".", ":")
            return self.weights[key] if key in self.weights else None

        def buffer(self, op, name):
            return getattr(self, f"{op.name}:{name}".replace(".", ":"))

        @staticmethod
        def _lstm(op, values):
            lstm = torch.nn.LSTM(op.inputs[0].shape[-1], op.hidden_size, batch_first=True)
            with torch.no_grad():
                for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
                    getattr(lstm, f"{k}_l0").copy_(torch.from_numpy(values[f"{op.name}.{k}"]))
            return lstm

        @staticmethod
        def _mha(op, values):
            e = op.inputs[0].shape[-1]
            mha = torch.nn.MultiheadAttention(e, op.num_heads, bias=op.use_bias, batch_first=True)
            with torch.no_grad():
                for ours, theirs in (("in_proj_weight", mha.in_proj_weight), ("in_proj_bias", mha.in_proj_bias),
                                     ("out_proj_weight", mha.out_proj.weight), ("out_proj_bias", mha.out_proj.bias)):
                    if theirs is not None:
                        theirs.copy_(torch.from_numpy(values[f"{op.name}.{ours}"]))
            return mha

        def forward(self, inputs: dict, output: str):
            env = dict(inputs)
            for op in model.ops:
                outs = self.run(op, [env[t.name] for t in op.inputs])
                for t, y in zip(op.outputs, outs if isinstance(outs, (list, tuple)) else [outs]):
                    env[t.name] = y
                if output in env:
                    return env[output]
            raise KeyError(output)

        def run(self, op, xs):
            k, w = op.kind, lambda name: self.w(op, name)
            if k == "conv2d":
                return F.conv2d(xs[0], w("weight"), w("bias"), op.stride, op.padding, 1, op.groups)
            if k == "pool2d":
                pool = F.max_pool2d if op.pool_type == "max" else F.avg_pool2d
                return pool(xs[0], op.kernel, op.stride, op.padding)
            if k == "batch_norm":
                running_mean, running_var = self.buffer(op, "running_mean"), self.buffer(op, "running_var")
                if synced is not None and self.training:
                    y, mean, var, count = synced(xs[0], w("weight"), w("bias"), op.eps)
                    with torch.no_grad():
                        running_mean.lerp_(mean.to(running_mean.dtype), op.momentum)
                        running_var.lerp_((var * count / (count - 1)).to(running_var.dtype), op.momentum)
                else:
                    y = F.batch_norm(xs[0], running_mean, running_var, w("weight"), w("bias"), self.training,
                                     op.momentum, op.eps)
                return F.relu(y) if op.relu else y
            if k == "layer_norm":
                return F.layer_norm(xs[0], op.normalized_shape, w("weight"), w("bias"), op.eps)
            if k == "dense":
                y = F.linear(xs[0], w("weight"), w("bias"))
                return y if op.activation is None else activations[op.activation](y)
            if k == "embedding":
                return F.embedding(xs[0], w("weight"))
            if k == "lstm":
                state = None if len(xs) == 1 else (xs[1].unsqueeze(0), xs[2].unsqueeze(0))
                y, (h, c) = self.lstms[op.name.replace(".", ":")](xs[0], state)
                return [y, h[0], c[0]]
            if k == "multihead_attention":
                mask = None
                if op.causal:
                    n = xs[0].shape[1]
                    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
                return self.attention[op.name.replace(".", ":")](*xs, need_weights=False, attn_mask=mask)[0]
            if k == "batch_matmul":
                return torch.bmm(xs[0], xs[1])
            if k == "softmax":
                return F.softmax(xs[0], dim=op.axis)
            if k == "dropout":
                return F.dropout(xs[0], op.rate, self.training)
            if k == "concat":
                return torch.cat(xs, dim=op.axis)
            if k == "split":
                return list(torch.split(xs[0], op.sizes, dim=op.axis))
            if k == "flat":
                return xs[0].flatten(1)
            if k == "reshape":
                return xs[0].reshape(op.outputs[0].shape)
            if k == "transpose":
                return xs[0].permute(*op.perm)
            if k == "binary":
                return {"add": torch.add, "subtract": torch.sub, "multiply": torch.mul}[op.fn](xs[0], xs[1])
            if k == "unary":
                return activations[op.fn](xs[0])
            raise NotImplementedError(f"bench/apps.py: no torch translation for op kind {k!r} ({op.name})")

    return Net()


def torch_side(args) -> dict:
    """Train app `args.app`'s tiny network in PyTorch (DDP over gloo when world > 1) as our run did
    (batch size, optimizer, learning rate, seed); this rank's report."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from apps.cli import batch_source, build_model
    from taskrt import Machine, Runtime

    torch.set_num_threads(args.threads)
    module = importlib.import_module(f"apps.{args.app}")
    b, rank, world = args.batch_size, args.rank, args.world
    model, output = build_model(module.build, module.TINY, b, seed=args.seed,
                                runtime=Runtime(machine=Machine.build(1, 1), execute=False))
    net = torch_network(model, sync_bn=world > 1 and not args.local_bn)
    logits_of = output.name
    producer = next(op for op in model.ops if output in op.outputs)
    if producer.kind == "softmax":
        logits_of = producer.inputs[0].name  # cross entropy on the logits: the same loss as on softmax's output
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
        net = torch.nn.parallel.DistributedDataParallel(net)
    params = [p for p in net.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9) if args.optimizer == "sgd" else \
        torch.optim.Adam(params, lr=args.lr)
    source = batch_source(module.make_batch, model, module.TINY, args.seed)
    lo, hi = rank * b // world, (rank + 1) * b // world
    losses, times = [], []
    start = time.perf_counter()
    for step in range(1, args.iterations + 1):
        inputs, labels = source(step, lo, hi)
        feed = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in inputs.items()}
        logits = net(feed, logits_of)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(labels).reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    if world > 1:
        torch.distributed.destroy_process_group()
    span = times[-1] - (times[args.warmup - 1] if args.warmup else 0.0)
    return {"samples_per_s": b * (args.iterations - args.warmup) / span, "first_loss": losses[0],
            "final_loss": losses[-1]}


# ---- running both sides ------------------------------------------------------------------------
def ours(name: str, ranks: int, cpus: int, iterations: int, warmup: int, trace: str | None = None,
         blas: int = 1) -> dict:
    """Our app's report on `ranks` ranks of `cpus` CPU processors with `blas` BLAS threads each."""
    cmd = [sys.executable, "-m", f"apps.{name}", "--tiny", "--iterations", str(iterations), "--warmup", str(warmup),
           "--cpus-per-rank", str(cpus)] + (["--trace", trace] if trace else [])
    if ranks > 1:
        cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", str(ranks)] + cmd
    env = {**os.environ, "TASKRT_GPUS": "0", "TASKRT_BLAS_THREADS": str(blas)}
    out = subprocess.run(cmd, cwd=ROOT, env=env, check=True, text=True, stdout=subprocess.PIPE,
                         stdin=subprocess.DEVNULL)
    return json.loads(out.stdout.splitlines()[-1])


#: tries of the PyTorch side: gloo's processes have died at exit ("terminate called without an
#: active exception") after a run that had finished
TORCH_TRIES = 3


def theirs(name: str, ranks: int, threads: int, iterations: int, warmup: int, mine: dict,
           local_bn: bool = False) -> dict:
    """The PyTorch side on `ranks` processes of `threads` threads, as our run `mine` trained."""
    for attempt in range(TORCH_TRIES):
        port = 29500 + (os.getpid() + 7 * attempt) % 1000
        flags = ["--app", name, "--world", str(ranks), "--port", str(port), "--iterations", str(iterations),
                 "--warmup", str(warmup), "--threads", str(threads), "--batch-size", str(mine["batch_size"]),
                 "--optimizer", mine["optimizer"], "--lr", str(mine["lr"]), "--seed", str(mine["seed"])]
        flags += ["--local-bn"] if local_bn else []
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
        procs = [subprocess.Popen([sys.executable, __file__, "--side", "torch", "--rank", str(r), *flags],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
                 for r in range(ranks)]
        outs = [p.communicate()[0] for p in procs]
        lines = outs[0].splitlines()
        if lines and lines[-1].startswith("{"):
            return json.loads(lines[-1])   # rank 0 reported: a failure after it is gloo's exit
        print(f"  the PyTorch side of {name} on {ranks} ranks failed (exit {[p.returncode for p in procs]}); "
              f"{'trying again' if attempt + 1 < TORCH_TRIES else 'giving up'}", flush=True)
    raise RuntimeError(f"the PyTorch side of {name} on {ranks} ranks failed {TORCH_TRIES} times")


def task_kind(task: str, kinds: dict) -> str:
    """What a task of a model's run does: 'conv2d fwd', 'batch_norm sum grad', 'updates', 'fills', 'data'
    (tasks are named '<op>.<phase>', '<op>.<weight>.update', 'fill:<region>' or 'source')."""
    if task.startswith("fill:"):
        return "fills"
    if task == "source":
        return "data"
    if task.endswith(".update"):
        return "updates"
    head, phase = task, ""
    while head and head not in kinds:
        head, _, last = head.rpartition(".")
        phase = f"{last} {phase}".strip()
    return f"{kinds[head]} {phase}" if head else task


def layouts(cores: int) -> list[tuple[int, int]]:
    """(CPU processors, BLAS threads each) to try on `cores` cores: a processor per core, and one
    processor with every core (the same on one core)."""
    return [(cores, 1)] + ([(1, cores)] if cores > 1 else [])


def where_time_goes(name: str, ranks: int, cpus: int, iterations: int, warmup: int, blas: int = 1) -> str:
    """From a traced run of ours: per steady-state iteration, processor busy time, the op kinds that
    take most of it, and the idle rest (waiting on launches, analysis and copies)."""
    from apps.cli import build_model
    from taskrt.tracing import read_trace

    module = importlib.import_module(f"apps.{name}")
    graph, _ = build_model(module.build, module.TINY, 2, weights=False)
    kinds = {"loss": "loss", **{op.name: op.kind for op in graph.ops}}  # compile names the loss op 'loss'

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "app.trace.jsonl")
        traced = ours(name, ranks, cpus, iterations, warmup, trace=path, blas=blas)
        files = [path] if ranks == 1 else [os.path.join(tmp, f"app.trace.rank{r}.jsonl") for r in range(ranks)]
        events = [e for f in files for e in read_trace(f)[1]]
    sources = sorted(e["start"] for e in events if e["name"] == "source" and e["rank"] == 0)
    t0 = sources[warmup] if len(sources) > warmup else 0.0
    steady = [e for e in events if e["start"] >= t0 and e["kind"] == "task"]
    measured = iterations - warmup
    per_it = traced["mean_iteration_s"] * 1e3
    procs = max(1, ranks * cpus)
    busy = sum(e["end"] - e["start"] for e in steady) / 1e3 / measured / procs
    by_op = defaultdict(float)
    for e in steady:
        by_op[task_kind(e["name"], kinds)] += e["end"] - e["start"]
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:3]
    tops = ", ".join(f"{k} {v / 1e3 / measured / procs:.1f}" for k, v in top)
    return (f"{name} on {ranks} rank(s) of {cpus} processor(s) x {blas} core(s): {per_it:.1f} ms an iteration "
            f"(traced); processors busy {busy:.1f} ms "
            f"({busy / per_it:.0%}; top: {tops} ms), idle {per_it - busy:.1f} ms waiting on the runtime "
            f"(launches, dependence analysis, copies)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", choices=["torch"], help=argparse.SUPPRESS)
    p.add_argument("--app", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=29500, help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--batch-size", type=int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--optimizer", default="sgd", help=argparse.SUPPRESS)
    p.add_argument("--lr", type=float, default=0.01, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--quick", action="store_true", help="fewer iterations (8, 3 of them warm-up), unless given")
    p.add_argument("--only", nargs="+", default=None, choices=APPS, metavar="APP", help="these apps only")
    p.add_argument("--iterations", type=at_least(1), default=None, help="iterations a run (default 20)")
    p.add_argument("--warmup", type=at_least(0), default=None, help="of them left out of the timing (default 5)")
    p.add_argument("--local-bn", action="store_true",
                   help="PyTorch's 2 ranks with DDP's per-rank batch norm statistics (default: summed over ranks)")
    args = p.parse_args(argv)
    args.iterations = args.iterations if args.iterations is not None else 8 if args.quick else 20
    args.warmup = args.warmup if args.warmup is not None else min(3 if args.quick else 5, args.iterations - 1)
    if args.warmup >= args.iterations:
        p.error(f"--warmup {args.warmup}: must be less than --iterations ({args.iterations})")
    if args.side == "torch":
        report = torch_side(args)
        if args.rank == 0:
            print(json.dumps(report), flush=True)
        return
    cores = os.cpu_count() or 1
    names = [n for n in APPS if importlib.util.find_spec(f"apps.{n}") is not None]
    names = [n for n in names if args.only is None or n in args.only]
    ratios, rates, tried, notes = {}, {}, {}, []
    print(f"{'app':<14}{'ranks':>6}{'layout':>8}{'ours/s':>10}{'torch/s':>10}{'ratio':>8}")
    for name in names:
        for ranks in (1, 2):
            threads = max(1, cores // ranks)
            runs = {(cpus, blas): ours(name, ranks, cpus, args.iterations, args.warmup, blas=blas)
                    for cpus, blas in layouts(threads)}
            (cpus, blas), mine = max(runs.items(), key=lambda kv: kv[1]["samples_per_s"])
            peer = theirs(name, ranks, threads, args.iterations, args.warmup, mine, args.local_bn)
            ratio = mine["samples_per_s"] / peer["samples_per_s"]
            ratios.setdefault(name, {})[str(ranks)] = round(ratio, 3)
            rates.setdefault(name, {})[str(ranks)] = {"ours": round(mine["samples_per_s"], 1),
                                                      "torch": round(peer["samples_per_s"], 1)}
            tried.setdefault(name, {})[str(ranks)] = {f"{c}x{b}": round(r["samples_per_s"], 1)
                                                      for (c, b), r in runs.items()}
            print(f"{name:<14}{ranks:>6}{f'{cpus}x{blas}':>8}{mine['samples_per_s']:>10.1f}"
                  f"{peer['samples_per_s']:>10.1f}{ratio:>8.2f}", flush=True)
            if ratio < TARGET:
                notes.append(where_time_goes(name, ranks, cpus, args.iterations, args.warmup, blas))
                print(f"  {notes[-1]}", flush=True)
    print(json.dumps({"bench": "apps", "cores": cores, "iterations": args.iterations, "warmup": args.warmup,
                      "unit": "ratio of samples/s ours/pytorch (higher is better), tiny apps", "target": TARGET,
                      "torch_batch_norm_on_2_ranks": "per rank" if args.local_bn else "summed over ranks",
                      "ratios": ratios, "samples_per_s": rates,
                      "layouts": {"unit": "samples/s of ours per layout, processors x BLAS threads each",
                                  **tried},
                      "short_of_target": notes}))


if __name__ == "__main__":
    main()
