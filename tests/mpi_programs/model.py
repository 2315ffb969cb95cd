"""A model trained on every rank of an MPI run gives the numbers of a one-process run.

The same small CNN is trained for a few iterations twice: on the replicated runtime, with
its convolutions split over batch and height so that neighbouring tiles (and their halos
and gradient reductions) live on different ranks, and on a plain single-process runtime
made inside rank 0 (a Machine given, so it does not join the MPI run). Losses and
parameters must agree to float32 rounding (reductions may fold in another order).

mpiexec -n N (N >= 2); prints "OK rank R" at the end.
"""
from __future__ import annotations

import shutil
import tempfile

import numpy as np
from mpi4py import MPI

from ops import SGD, Model, TileConfig
from taskrt import Machine, Runtime


def build_and_train(rt, configs, images, labels, iterations):
    m = Model(runtime=rt, seed=3)
    x = m.input((8, 1, 8, 8), name="images")
    h = m.relu(m.batch_norm(m.conv2d(x, 4, 3, padding=1, name="conv1"), name="bn1"))
    h = m.relu(m.conv2d(h, 4, 3, padding=1, name="conv2"))
    m.softmax(m.dense(m.flat(m.pool2d(h, 2)), 3, name="fc"))
    m.compile(optimizer=SGD(lr=0.05, momentum=0.9), loss="sparse_categorical_crossentropy", configs=configs,
              release=True)
    history = m.fit(images, labels, iterations=iterations, verbose=False, shuffle=False)
    params = m.parameters()
    if rt.rank > 0:
        # a rank's instances of conv1's output hold the box of its tiles and its readers' rows, not
        # the batch: at most half of it on 2 ranks and on 4; and none is left once the steps are
        # over (each step releases its activations)
        region = m._low.values["conv1.out"]
        memory = rt.machine.host_memory(rt.rank)
        box = rt.store.boxes[(region.uid, memory)]
        assert 2 * box.volume <= region.rect.volume, f"rank {rt.rank} holds {box!r} of {region!r}"
        rt.wait()
        left = [key for key in rt.store.instances if key[:2] == (region.uid, memory)]
        assert not left, f"rank {rt.rank} still holds {left} of {region!r} after the steps"
    m.close()
    return history.loss, params


def assert_matches_one_process(losses, params, configs, images, labels, iterations, loss_tol, param_tol):
    """Train the same model on a plain single-process runtime (made here, a Machine given, so
    it does not join the MPI run) and compare; the tolerances are (rtol, atol) pairs."""
    local = Runtime(machine=Machine.build(1, 2, separate_memories=True))
    want_losses, want_params = build_and_train(local, configs, images, labels, iterations)
    local.shutdown()
    np.testing.assert_allclose(losses, want_losses, rtol=loss_tol[0], atol=loss_tol[1])
    for k in want_params:
        np.testing.assert_allclose(params[k], want_params[k], rtol=param_tol[0], atol=param_tol[1], err_msg=k)


def save_and_load_on_every_rank(rt, folder):
    """Every rank saves (collective) and at once loads the file: when every rank wrote it, a
    rank could read it half written (a file of some MB: 'damaged or truncated')."""
    m = Model(runtime=rt, seed=1)
    h = m.dense(m.input((8, 64), name="x"), 512, activation="relu")
    m.dense(m.dense(h, 512, activation="relu"), 3)
    m.compile(optimizer=SGD(lr=0.05))
    path = f"{folder}/big.npz"
    for _ in range(3):
        m.save(path)
        again = Model.load(path, runtime=rt)
        for k, v in m.parameters().items():
            assert np.array_equal(again.parameters()[k], v), f"rank {rt.rank}: {k} changed in a save and load"
        again.close()
    m.close()


def main():
    rng = np.random.default_rng(7)
    images = rng.standard_normal((32, 1, 8, 8)).astype(np.float32)
    labels = rng.integers(0, 3, 32)
    with Runtime(cpus=1) as rt:
        n = rt.num_ranks
        assert rt.transport is not None and n >= 2, f"Runtime() under mpiexec: {rt!r}"
        # 2 x 2 tiles: tile i on processor i*n//4, so the tiles of one conv span every rank
        configs = {"conv1": TileConfig((2, 1, 2, 1)), "conv2": TileConfig((2, 1, 2, 1)),
                   "fc": TileConfig((1, min(3, n), 1))}
        losses, params = build_and_train(rt, configs, images, labels, iterations=6)
        rank = rt.rank
        folder = MPI.COMM_WORLD.bcast(tempfile.mkdtemp() if rank == 0 else None)
        save_and_load_on_every_rank(rt, folder)
    if rank == 0:   # (after the runtime's shutdown: every rank is done with the file)
        shutil.rmtree(folder)
    everyone = MPI.COMM_WORLD.allgather((losses, params))
    for r, (other_losses, other_params) in enumerate(everyone):
        assert other_losses == losses, f"rank {r} saw losses {other_losses}, rank {rank} {losses}"
        for k in params:
            assert np.array_equal(other_params[k], params[k]), f"rank {r} reads another {k}"
    if rank == 0:
        assert_matches_one_process(losses, params, {"conv1": TileConfig((2, 1, 2, 1))}, images, labels, 6,
                                   loss_tol=(1e-5, 1e-6), param_tol=(1e-4, 1e-6))
    print(f"OK rank {rank}", flush=True)


if __name__ == "__main__":
    main()
