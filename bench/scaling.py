"""Training throughput on 1 and 2 ranks against PyTorch DDP, and weight-sync bytes per memory.

    python bench/scaling.py [--quick] [--iterations 5] [--trials 4] [--rounds 2]
    python bench/scaling.py --profile DIR [--strategies cnn:data,mlp:expert]   # where the time goes

Two models, the same on both sides (float32, synthetic data, SGD with momentum 0.9, the
same global batch, cross-entropy on logits):

- cnn: conv 3->16 3x3, batch norm + relu, max pool 2, conv 16->32, batch norm + relu, max
  pool 2, dense 2048->128 relu, dense 128->10; batch 64 of 3x32x32;
- mlp: dense 512->1024 relu, 1024->1024 relu, 1024->10; batch 128.

Ours runs under `mpiexec -n R` (R = 1, 2) with `Runtime(cpus=C)`, C = the cores per rank
(2 // R here), one BLAS thread per processor, once per baseline of strategies.BASELINES,
trained by `Model.train_on` (each rank makes its own share of every batch). The peer is
torch.nn.parallel.DistributedDataParallel over R processes (gloo on 127.0.0.1),
torch.set_num_threads(C), each process on its own 1/R of the batch. Both read every
step's loss. Each side runs in child processes of this one (`--worker ours|ddp`, one JSON
line each: one MPI job runs every model and baseline in turn, one process group every
model), `--rounds` times, the sides in turn. A worker times `--trials` runs of
`--iterations` steps after `--warmup` untimed ones, each from the first rank's start to
the last rank's end; the best is kept. It also reads every thread's CPU time
(/proc/self/task/*/schedstat) over its timed steps: `cpu_ms_per_step` is what the busiest
rank's threads used together per step. On a machine that others use too, wall time
favours the side with more runnable threads (ours has seven a rank, each with its own
share of the cores), so CPU time is the steadier comparison; both are reported.

Then, from graphs built with `Runtime(Machine.build(ranks, per_rank, separate_memories=True),
execute=False)` (strategies.graph.build_iteration), the data-parallel MLP's second training
step (the first starts from where the weights were put): bytes of weight values and
gradients copied into and out of each memory, the largest over memories divided by the
ideal 2(P-1)/P of the weights' bytes, at P = 8 and 64 on one rank and on several (the
worst of the layouts per P).

Last line: one JSON object. `ratio_vs_ddp[model]`: our best baseline's throughput over
DDP's at 2 ranks (target >= 0.8), `best_baseline[model]` names it; `cpu_ratio_vs_ddp`:
DDP's CPU ms per step over that baseline's; `sync_bytes_over_ideal[P]` (target <= 1.1);
`load_avg`: the machine's 1-minute load before and after. `--profile DIR` instead traces
the 2-rank runs (the runtime's trace, one file per rank in DIR) and prints, per step, the
time with a task running, with only messages in flight and with neither, the cross-rank
copies by size with their time from send to arrival, and each thread's CPU; and DDP's
step with and without its all-reduce. What that showed: docs/scaling.md.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np

# run as a script, this file's folder comes first on sys.path, and bench/ops.py would
# shadow the ops package: look in the repository root instead (as bench/ops.py does)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT

CORES = 2  # the machine this benchmark is sized for; each run gets CORES // ranks per rank
LR, MOMENTUM = 0.01, 0.9

SIZES = {
    "full": {"cnn": {"batch": 64, "image": 32, "channels": (16, 32), "hidden": 128, "classes": 10},
             "mlp": {"batch": 128, "features": 512, "widths": (1024, 1024), "classes": 10}},
    "quick": {"cnn": {"batch": 8, "image": 8, "channels": (4, 8), "hidden": 16, "classes": 4},
              "mlp": {"batch": 16, "features": 32, "widths": (64, 64), "classes": 4}},
}
# the MLP whose graphs count weight-sync bytes: a batch of at least P = 64, so that every
# processor holds a replica. Nothing runs, but building a graph costs time in the number of
# tiles and folds (64 x 64 per weight at P = 64), so the quick one has two small layers; its
# shards are too small to divide evenly, and its ratio is not a measurement.
SYNC_MLP = {"full": SIZES["full"]["mlp"], "quick": {"batch": 64, "features": 16, "widths": (16,), "classes": 4}}


# ---- the models, ours and PyTorch's ---------------------------------------------------------
def build_ours(rt, name: str, size: dict, weights: bool = True):
    from ops import Model

    m = Model(runtime=rt, seed=0, weights=weights)
    b = size["batch"]
    if name == "cnn":
        c1, c2 = size["channels"]
        x = m.input((b, 3, size["image"], size["image"]), name="x")
        h = m.pool2d(m.batch_norm(m.conv2d(x, c1, 3, padding=1), relu=True), 2)
        h = m.pool2d(m.batch_norm(m.conv2d(h, c2, 3, padding=1), relu=True), 2)
        h = m.dense(m.flat(h), size["hidden"], activation="relu")
    else:
        h = m.input((b, size["features"]), name="x")
        for w in size["widths"]:
            h = m.dense(h, w, activation="relu")
    m.dense(h, size["classes"])
    return m


def build_torch(name: str, size: dict):
    from torch import nn

    if name == "cnn":
        c1, c2 = size["channels"]
        flat = c2 * (size["image"] // 4) ** 2
        return nn.Sequential(nn.Conv2d(3, c1, 3, padding=1), nn.BatchNorm2d(c1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(c1, c2, 3, padding=1), nn.BatchNorm2d(c2), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(flat, size["hidden"]), nn.ReLU(),
                             nn.Linear(size["hidden"], size["classes"]))
    layers, width = [], size["features"]
    for w in size["widths"]:
        layers += [nn.Linear(width, w), nn.ReLU()]
        width = w
    return nn.Sequential(*layers, nn.Linear(width, size["classes"]))


def synthetic(name: str, size: dict, batches: int = 2):
    """`batches` batches of float32 inputs and int64 labels, the same for both sides."""
    rng = np.random.default_rng(0)
    n = size["batch"] * batches
    shape = (n, 3, size["image"], size["image"]) if name == "cnn" else (n, size["features"])
    return rng.standard_normal(shape).astype(np.float32), rng.integers(0, size["classes"], n)


def batch_source(name: str, size: dict):
    """`source(step, lo, hi)` for Model.train_on: samples lo..hi-1 of a step's batch, made on the
    rank that uses them (as each DDP process holds its own share)."""
    x, y = synthetic(name, size)
    b = size["batch"]

    def source(step, lo, hi):
        k = step % (len(x) // b) * b
        return x[k + lo:k + hi], y[k + lo:k + hi]

    return source


# ---- workers: one process per side and rank count, one JSON line ------------------------------
# Each worker runs every (model, strategy) it is given in turn, so that a run of the benchmark
# starts 2 MPI jobs and 3 PyTorch processes rather than one per measurement (a start costs
# 3-5 s here: imports, MPI, the runtime's start-up and numba's cache).
def best_span(steps, trials: int, barrier, gather) -> float:
    """The shortest of `trials` runs of steps(), each from the first rank's start to the last
    rank's end: barrier() lines the ranks up, gather((t0, t1)) returns every rank's pair."""
    best = float("inf")
    for _ in range(trials):
        barrier()
        t0 = time.perf_counter()
        steps()
        t1 = time.perf_counter()
        spans = gather((t0, t1))
        best = min(best, max(e for _, e in spans) - min(s for s, _ in spans))
    return best


def thread_cpu() -> dict[str, list[int]]:
    """Per thread of this process, by its Python name (the rest together as 'other'): [ns on a
    core, ns runnable but waiting for one] so far, from /proc/self/task/*/schedstat (Linux; {}
    elsewhere)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run, wait = f.read().split()[:2]
        except (OSError, ValueError):
            continue
        row = out[names.get(int(tid), "other")]
        row[0] += int(run)
        row[1] += int(wait)
    return dict(out)


def cpu_per_step(before: dict, after: dict, steps: int) -> dict[str, list[float]]:
    """thread_cpu() differences as [ms on a core, ms waiting for one] per step, busiest first."""
    rows = {k: [round((v[i] - before.get(k, (0, 0))[i]) / steps / 1e6, 2) for i in (0, 1)] for k, v in after.items()}
    return dict(sorted(((k, v) for k, v in rows.items() if v[0] + v[1] >= 0.01), key=lambda kv: -kv[1][0]))


def busiest_rank_cpu(per_rank: list[dict]) -> float:
    """The most CPU ms a step that any rank's threads used together (cpu_per_step rows)."""
    return round(max(sum(row[0] for row in threads.values()) for threads in per_rank), 1)


def ours_worker(args, sizes: dict) -> dict:
    from ops import SGD
    from strategies import BASELINES
    from taskrt import Runtime

    seconds, cpu = {}, {}
    with Runtime(cpus=args.cpus, trace=args.trace) as rt:
        comm = rt.transport.world if rt.transport is not None else None
        offset = rt.transport.clock_offset_s if comm is not None else 0.0  # this rank's clock - rank 0's

        def barrier():
            if comm is not None:
                comm.Barrier()

        def gather(span):
            t0, t1 = span
            return comm.allgather((t0 - offset, t1 - offset)) if comm is not None else [span]

        for run in args.runs.split(","):
            model, strategy = run.split(":")
            source = batch_source(model, sizes[model])
            m = build_ours(rt, model, sizes[model])
            m.compile(optimizer=SGD(lr=LR, momentum=MOMENTUM), strategy=BASELINES[strategy](m, rt.machine))

            def steps(n):
                for _ in m.train_on(source, n):  # each step's loss, read once the next is issued
                    pass
                rt.wait()

            steps(args.warmup)
            before = thread_cpu()
            seconds[run] = best_span(lambda: steps(args.iterations), args.trials, barrier, gather)
            mine = cpu_per_step(before, thread_cpu(), args.trials * args.iterations)
            cpu[run] = comm.allgather(mine) if comm is not None else [mine]
        rank = rt.rank
    return {"rank": rank, "seconds": seconds, "cpu_ms_per_step": cpu}


def ddp_worker(args, sizes: dict) -> dict:
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(args.cpus)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world)

    def gather(span):
        spans = [None] * args.world  # the processes of one machine read the same monotonic clock
        dist.all_gather_object(spans, span)
        return spans

    seconds, no_sync, cpu = {}, {}, {}
    for model_name in args.runs.split(","):
        size = sizes[model_name]
        torch.manual_seed(0)
        model = DistributedDataParallel(build_torch(model_name, size))
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        loss_fn = torch.nn.CrossEntropyLoss()
        x, y = synthetic(model_name, size)
        b, share = size["batch"], size["batch"] // args.world  # this rank's part of each global batch
        mine = slice(args.rank * share, (args.rank + 1) * share)
        batches = [(torch.from_numpy(x[k * b:(k + 1) * b][mine]), torch.from_numpy(y[k * b:(k + 1) * b][mine]))
                   for k in range(len(x) // b)]

        def steps(n, sync=True):
            with contextlib.nullcontext() if sync else model.no_sync():
                for i in range(n):
                    xb, yb = batches[i % len(batches)]
                    opt.zero_grad(set_to_none=True)
                    loss = loss_fn(model(xb), yb)
                    loss.backward()
                    opt.step()
                    loss.item()  # as our train_on reads every step's loss

        steps(args.warmup)
        before = thread_cpu()
        seconds[model_name] = best_span(lambda: steps(args.iterations), args.trials, dist.barrier, gather)
        cpu[model_name] = gather(cpu_per_step(before, thread_cpu(), args.trials * args.iterations))
        if args.no_sync:  # the same steps without the gradient all-reduce: DDP's compute alone
            no_sync[model_name] = best_span(lambda: steps(args.iterations, sync=False), args.trials, dist.barrier,
                                            gather)
    dist.destroy_process_group()
    return {"rank": args.rank, "seconds": seconds, "no_sync_seconds": no_sync, "cpu_ms_per_step": cpu}


# ---- the parent: launch the runs, collect their lines -----------------------------------------
def mpiexec() -> str:
    path = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    path = path if os.path.exists(path) else shutil.which("mpiexec")
    if path is None:
        raise SystemExit("bench/scaling.py needs mpiexec (pip install mpich mpi4py)")
    return path


def worker_env(cpus: int) -> dict:
    threads = str(cpus)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
            "TASKRT_GPUS": "0", "TASKRT_BLAS_THREADS": "1", "OMP_NUM_THREADS": threads,
            "OPENBLAS_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "GLOO_SOCKET_IFNAME": "lo"}


def last_json(out: str, what: str) -> dict:
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{what}: no JSON line in its output:\n{out}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ours(ranks: int, runs: list[str], common: list, timeout: float) -> dict:
    """Rank 0's line ("seconds" per 'model:strategy' run) from one `mpiexec -n ranks` job."""
    cpus = CORES // ranks
    cmd = [mpiexec(), "-n", str(ranks), sys.executable, os.path.abspath(__file__), "--worker", "ours",
           "--runs", ",".join(runs), "--cpus", str(cpus), *common]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(cpus), timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd=ROOT)
    what = f"ours on {ranks} ranks ({cmd[3:]})"
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return last_json(proc.stdout, what)


def run_ddp(ranks: int, models: list[str], common: list, timeout: float) -> dict:
    """Rank 0's line ("seconds" per model) from `ranks` PyTorch processes in one gloo process group."""
    cpus, port = CORES // ranks, free_port()
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", "ddp", "--runs", ",".join(models),
                               "--cpus", str(cpus), "--rank", str(r), "--world", str(ranks), "--port", str(port),
                               *common],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=worker_env(cpus),
                              stdin=subprocess.DEVNULL, cwd=ROOT)
             for r in range(ranks)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    what = f"ddp on {ranks} ranks"
    for p, (out, err) in zip(procs, outs):
        if p.returncode != 0:
            raise RuntimeError(f"{what} failed ({p.returncode}):\n{out}\n{err}")
    return last_json(outs[0][0], what)


# ---- where the time goes: the runtime's traces ------------------------------------------------
def _union(intervals) -> list[list[float]]:
    out: list[list[float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return out


def _covered(intervals) -> float:
    return sum(hi - lo for lo, hi in intervals)


def _minus(a: list, b: list) -> list[list[float]]:
    """The parts of the disjoint sorted intervals `a` that no interval of `b` covers."""
    out = []
    for lo, hi in a:
        cur = lo
        for blo, bhi in b:
            if bhi <= cur or blo >= hi:
                continue
            if blo > cur:
                out.append([cur, blo])
            cur = max(cur, bhi)
        if cur < hi:
            out.append([cur, hi])
    return out


def size_class(nbytes: int) -> str:
    return "<4KiB" if nbytes < 4096 else "<64KiB" if nbytes < 65536 else "<1MiB" if nbytes < 1 << 20 else ">=1MiB"


def trace_split(prefix: str, ranks: int, steps: int) -> dict:
    """Over the last `steps` steps of the rank traces PREFIX.rank<R>.jsonl (a step starts at its
    `source` task), per rank and step: ms with a task or fold running (compute), with only
    messages in flight (waiting on the other rank or on the copy), with neither (the runtime's
    own Python between tasks); and the cross-rank copies a step by size class with the median
    ms from posting the send to the end of the receive (clocks aligned to rank 0's)."""
    from taskrt.tracing import read_trace

    events = {r: read_trace(f"{prefix}.rank{r}.jsonl")[1] for r in range(ranks)}
    t0 = sorted(e["start"] for e in events[0] if e["name"] == "source")[-steps]
    split = {}
    for r, evs in events.items():
        evs = [e for e in evs if e["start"] >= t0]
        span = max(e["end"] for e in evs) - t0
        busy = _union((e["start"], e["end"]) for e in evs if e["kind"] in ("task", "reduce"))
        messages = _union((e["start"], e["end"]) for e in evs if e["kind"] in ("send", "recv"))
        waiting = _covered(_minus(messages, busy))
        split[f"rank{r}"] = {k: round(v / steps / 1e3, 2) for k, v in {
            "step_ms": span, "compute_ms": _covered(busy), "messages_only_ms": waiting,
            "neither_ms": span - _covered(busy) - waiting}.items()}
    sends = {e["id"]: e for evs in events.values() for e in evs if e["kind"] == "send" and e["start"] >= t0}
    recvs = {e["id"]: e for evs in events.values() for e in evs if e["kind"] == "recv"}
    latency = collections.defaultdict(list)
    for nid, send in sends.items():
        if nid in recvs:
            latency[size_class(send["bytes"])].append(recvs[nid]["end"] - send["start"])
    split["copies_per_step"] = {k: {"count": round(len(v) / steps, 1), "median_ms": round(float(np.median(v)) / 1e3, 2)}
                                for k, v in sorted(latency.items())}
    split["copy_MB_per_step"] = round(sum(e["bytes"] for e in sends.values()) / steps / 1e6, 2)
    return split


def profile(args, sizes: dict, strategies: dict, common: list, out_dir: str) -> dict:
    """The 2-rank runs once more, traced: our split per model and strategy (trace_split), and
    DDP's step with and without its all-reduce (model.no_sync)."""
    os.makedirs(out_dir, exist_ok=True)
    report = {}
    for model in args.models.split(","):
        for strategy in strategies[model]:
            prefix = os.path.join(out_dir, f"{model}.{strategy}")
            line = run_ours(2, [f"{model}:{strategy}"], common + ["--trials", "1", "--trace", prefix + ".jsonl"], 900)
            report[f"{model}:{strategy}"] = {**trace_split(prefix, 2, args.iterations),
                                             "cpu_ms_per_step": line["cpu_ms_per_step"][f"{model}:{strategy}"]}
    ddp = run_ddp(2, args.models.split(","), common + ["--trials", str(args.trials), "--no-sync"], 900)
    for model, sec in ddp["seconds"].items():
        report[f"{model}:ddp"] = {"step_ms": round(sec / args.iterations * 1e3, 2),
                                  "no_sync_step_ms": round(ddp["no_sync_seconds"][model] / args.iterations * 1e3, 2),
                                  "cpu_ms_per_step": ddp["cpu_ms_per_step"][model]}
    return report


# ---- weight-sync bytes from graphs that are built, not run ------------------------------------
def sync_over_ideal(ranks: int, per_rank: int, size: dict) -> float:
    """The data-parallel MLP's steady-state step (strategies.graph.build_iteration: the second of
    two, on a runtime with execute=False) on ranks x per_rank processors with separate memories:
    the most weight bytes into or out of one memory over 2(P-1)/P of the weights' bytes."""
    from ops import SGD
    from strategies import data_parallel
    from strategies.graph import build_iteration, weight_sync_bytes
    from taskrt.machine import Machine

    machine = Machine.build(ranks, per_rank, separate_memories=True)
    p = ranks * per_rank
    with build_ours(None, "mlp", size, weights=False) as m:  # the graph alone, no weight values
        ops, inputs, loss = m.training_graph()
    configs, _ = data_parallel(ops, machine).resolve(ops, machine)
    graph = build_iteration(ops, inputs, loss.name, configs, machine, SGD(lr=LR, momentum=MOMENTUM))
    into, out = weight_sync_bytes(graph.nodes, graph.lowering.params.values())
    params = graph.lowering.params.values()
    ideal = 2 * (p - 1) / p * sum(int(np.prod(q.value.shape)) * q.value.dtype.itemsize for q in params)
    return max(max(into.values()), max(out.values())) / ideal


# ---- main ---------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny models, 2 iterations (for the test)")
    ap.add_argument("--iterations", type=int, default=None, help="timed steps a trial (default 5, quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3, quick 1)")
    ap.add_argument("--trials", type=int, default=None, help="timed runs of --iterations steps in a process, "
                                                              "the best kept (default 4, quick 1)")
    ap.add_argument("--rounds", type=int, default=None, help="times each side runs, in turn, the best kept "
                                                              "(default 2, quick 1)")
    ap.add_argument("--models", default="cnn,mlp")
    ap.add_argument("--strategies", default="data,model,expert,tensor")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--profile", metavar="DIR", default=None,
                    help="instead of the benchmark: trace the 2-rank runs of --strategies (model:strategy,... "
                         "or strategies for every model) into DIR and print where the time goes")
    ap.add_argument("--worker", choices=("ours", "ddp"), help="(internal) run as a worker")
    ap.add_argument("--runs", help="worker: model:strategy,... for ours, model,... for ddp")
    ap.add_argument("--cpus", type=int, default=1, help="worker: processors (threads) per rank")
    ap.add_argument("--rank", type=int, default=0, help="ddp worker: its rank")
    ap.add_argument("--world", type=int, default=1, help="ddp worker: the number of ranks")
    ap.add_argument("--port", type=int, default=0, help="ddp worker: the gloo rendezvous port on 127.0.0.1")
    ap.add_argument("--trace", default=None, help="ours worker: the runtime's trace path (one file per rank)")
    ap.add_argument("--no-sync", action="store_true", help="ddp worker: also time the steps under model.no_sync()")
    args = ap.parse_args(argv)
    for flag, least, default in (("iterations", 1, (2, 5)), ("trials", 1, (1, 4)), ("rounds", 1, (1, 2)),
                                 ("warmup", 0, (1, 3))):
        value = getattr(args, flag)
        if value is None:
            setattr(args, flag, default[0] if args.quick else default[1])
        elif value < least:
            ap.error(f"--{flag} {value}: must be at least {least}")
    if not args.worker:
        check_choices(ap, args)
    return args


def check_choices(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--models, --strategies (model:strategy with --profile) and --ranks name what there is, before
    any run starts."""
    from strategies import BASELINES
    models = args.models.split(",")
    for m in models:
        if m not in SIZES["full"]:
            ap.error(f"--models {args.models}: no model {m!r}; there are {', '.join(SIZES['full'])}")
    for entry in args.strategies.split(","):
        model, _, strategy = entry.rpartition(":") if args.profile else ("", "", entry)
        if model and model not in models:
            ap.error(f"--strategies {args.strategies}: {entry!r} names model {model!r}, not one of --models")
        if strategy not in BASELINES:
            ap.error(f"--strategies {args.strategies}: no baseline {strategy!r}; there are {', '.join(BASELINES)}")
    for r in args.ranks.split(","):
        if not r.isdigit() or not 1 <= int(r) <= CORES:
            ap.error(f"--ranks {args.ranks}: {r!r} is not a rank count from 1 to {CORES} (this benchmark gives "
                     f"each of R ranks {CORES} // R cores)")


def benchmark(args, sizes: dict, models: list[str], strategies: list[str]) -> dict:
    """Throughput and CPU per step of every baseline and of DDP, per model and rank count."""
    rank_counts = [int(r) for r in args.ranks.split(",")]
    common = ["--iterations", str(args.iterations), "--warmup", str(args.warmup), "--trials", str(args.trials)] + (
        ["--quick"] if args.quick else [])
    timeout = 120 if args.quick else 900
    throughput = {m: {} for m in models}
    print(f"{'model':<6}{'ranks':>6}  {'run':<8}{'samples/s':>11}{'ms/step':>9}{'CPU ms/step':>13}")
    for ranks in rank_counts:
        seconds, cpu = {}, {}  # "model:run" -> the best over rounds
        for _ in range(args.rounds):  # the sides in turn, so that a busy spell of the machine meets both
            ours = run_ours(ranks, [f"{m}:{s}" for m in models for s in strategies], common, timeout)
            theirs = run_ddp(ranks, models, common, timeout)
            lines = [(k, ours, k) for k in ours["seconds"]] + [(f"{k}:ddp", theirs, k) for k in theirs["seconds"]]
            for key, line, k in lines:
                seconds[key] = min(line["seconds"][k], seconds.get(key, float("inf")))
                cpu[key] = min(busiest_rank_cpu(line["cpu_ms_per_step"][k]), cpu.get(key, float("inf")))
        for m in models:
            runs = strategies + ["ddp"]
            rate = {k: round(args.iterations * sizes[m]["batch"] / seconds[f"{m}:{k}"], 1) for k in runs}
            for k in runs:
                print(f"{m:<6}{ranks:>6}  {k:<8}{rate[k]:>11.1f}{seconds[f'{m}:{k}'] / args.iterations * 1e3:>9.1f}"
                      f"{cpu[f'{m}:{k}']:>13.1f}", flush=True)
            best = max(strategies, key=lambda s: rate[s])
            throughput[m][str(ranks)] = {"samples_per_s": rate, "best": best,
                                         "ratio_vs_ddp": round(rate[best] / rate["ddp"], 3),
                                         "cpu_ratio_vs_ddp": round(cpu[f"{m}:ddp"] / cpu[f"{m}:{best}"], 3),
                                         "cpu_ms_per_step": {k: cpu[f"{m}:{k}"] for k in runs}}
    return throughput


def sync_ratios(quick: bool) -> dict[str, float]:
    """sync_over_ideal at P = 8 and 64, the worst of one-rank and several-rank layouts (the
    quick mode builds the one-rank layout only)."""
    layouts = {8: [(1, 8), (2, 4)], 64: [(1, 64), (8, 8)]}  # P -> (ranks, processors per rank)
    size = SYNC_MLP["quick" if quick else "full"]
    sync = {}
    for p, shapes in layouts.items():
        ratios = {f"{r}x{c}": round(sync_over_ideal(r, c, size), 4) for r, c in shapes[:1 if quick else None]}
        sync[str(p)] = max(ratios.values())
        print(f"weight sync, P = {p}: most bytes into or out of a memory / ideal: {ratios}", flush=True)
    return sync


def main() -> None:
    args = parse_args()
    mode = "quick" if args.quick else "full"
    sizes = SIZES[mode]
    if args.worker:
        result = (ours_worker if args.worker == "ours" else ddp_worker)(args, sizes)
        if result["rank"] == 0:
            print(json.dumps(result), flush=True)
        if args.worker == "ddp":
            # the run is over and reported; gloo's threads now and then abort the interpreter's
            # teardown ("terminate called without an active exception", SIGABRT), so skip it
            sys.stderr.flush()
            os._exit(0)
        return

    models = args.models.split(",")
    if args.profile:
        wanted = args.strategies.split(",")
        chosen = {m: [s.split(":")[1] for s in wanted if s.startswith(f"{m}:")] or
                  [s for s in wanted if ":" not in s] for m in models}
        common = ["--iterations", str(args.iterations), "--warmup", str(args.warmup)] + (
            ["--quick"] if args.quick else [])
        report = profile(args, sizes, chosen, common, args.profile)
        for k, v in report.items():
            print(k, json.dumps(v))
        print(json.dumps({"bench": "scaling-profile", "mode": mode, "iterations": args.iterations,
                          "load_avg": round(os.getloadavg()[0], 2), **report}))
        return

    load_before = os.getloadavg()[0]  # other work on the machine slows the runs down; say how much
    throughput = benchmark(args, sizes, models, args.strategies.split(","))
    sync = sync_ratios(args.quick)
    top = str(max(int(r) for r in args.ranks.split(",")))
    result = {"bench": "scaling", "mode": mode, "iterations": args.iterations, "warmup": args.warmup,
              "trials": args.trials, "rounds": args.rounds, "cores": CORES, "throughput": throughput,
              "ratio_vs_ddp": {m: throughput[m][top]["ratio_vs_ddp"] for m in models},
              "cpu_ratio_vs_ddp": {m: throughput[m][top]["cpu_ratio_vs_ddp"] for m in models},
              "best_baseline": {m: throughput[m][top]["best"] for m in models},
              "sync_bytes_over_ideal": sync, "load_avg": [round(load_before, 2), round(os.getloadavg()[0], 2)]}
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
