"""bench/apps.py's PyTorch peer: on 2 gloo ranks its batch norm sums statistics over the ranks,
so data parallelism computes what one process computes on the whole batch (as ours does)."""
from __future__ import annotations

import os
import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from tests.bench_module import load_bench


def _data():
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.normal(3.0, 2.0, (6, 4, 5, 5)).astype(np.float32))
    w = torch.from_numpy(rng.normal(1.0, 0.3, 4).astype(np.float32))
    b = torch.from_numpy(rng.normal(0.0, 0.3, 4).astype(np.float32))
    up = torch.from_numpy(rng.normal(0.0, 1.0, (6, 4, 5, 5)).astype(np.float32))
    return x, w, b, up


def _rank(rank: int, port: int, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x, w, b, up = _data()
    half = slice(3 * rank, 3 * rank + 3)
    x = x[half].clone().requires_grad_()
    w, b = w.clone().requires_grad_(), b.clone().requires_grad_()
    y, mean, var, count = load_bench("apps").synced_batch_norm()(x, w, b, 1e-5)
    (y * up[half]).sum().backward()
    out.put((rank, y.detach().numpy(), x.grad.numpy(), w.grad.numpy(), b.grad.numpy(), mean.numpy(), var.numpy(),
             float(count)))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_synced_batch_norm_on_two_ranks_is_batch_norm_of_the_whole_batch():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    x, w, b, up = _data()
    x, w, b = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    y = F.batch_norm(x, None, None, w, b, training=True, eps=1e-5)
    (y * up).sum().backward()
    np.testing.assert_allclose(np.concatenate([g[1] for g in got]), y.detach().numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.concatenate([g[2] for g in got]), x.grad.numpy(), rtol=1e-4, atol=1e-5)
    # each rank's weight gradients are its samples' share: DDP adds (averages) them
    np.testing.assert_allclose(got[0][3] + got[1][3], w.grad.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got[0][4] + got[1][4], b.grad.numpy(), rtol=1e-4, atol=1e-5)
    xs = x.detach().double().numpy()
    for g in got:
        np.testing.assert_allclose(g[5], xs.mean(axis=(0, 2, 3)), rtol=1e-9)
        np.testing.assert_allclose(g[6], xs.var(axis=(0, 2, 3)), rtol=1e-7)
        assert g[7] == 6 * 25
