"""Random SOAP strategies on every rank of an MPI run train to the numbers of one device.

The models of tests/test_soap_models.py (a CNN with batch norm, an RNN with stacked LSTMs,
a transformer block, a batch-matmul mixer) get one random valid config per op, drawn from
the seed given (strategies.random_config over the whole machine, so tiles, their halos,
partial sums, carries and weight shards land on different ranks). After three SGD steps
the loss and every parameter must equal a one-device run made inside rank 0 (rtol 1e-4),
and every rank must see the same numbers.

mpiexec -n N python soap_models.py SEED [SEED ...]; prints "OK rank R" at the end.
"""
from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from ops import TileConfig
from strategies.random import random_config
from taskrt import Machine, Runtime
from tests.test_soap_models import MODELS, train


def main(seeds: list[int]):
    with Runtime(cpus=1) as rt:
        assert rt.transport is not None and rt.num_ranks >= 2, f"Runtime() under mpiexec: {rt!r}"
        rank = rt.rank
        results = {}
        for seed in seeds:
            for kind in sorted(MODELS):
                m = MODELS[kind](rt)
                rng = np.random.default_rng([seed, len(kind)])
                configs = {op.name: random_config(op, rt.machine, rng) for op in m.ops}
                results[(seed, kind)] = (train(m, kind, configs), {k: str(v) for k, v in configs.items()})
                m.close()
    everyone = MPI.COMM_WORLD.allgather({k: v[0] for k, v in results.items()})
    for r, theirs in enumerate(everyone):
        for key, (loss, params, _) in theirs.items():
            assert loss == results[key][0][0], f"rank {r} saw losses {loss} for {key}, rank {rank} {results[key][0][0]}"
    if rank == 0:
        local = Runtime(machine=Machine.build(1, 1))
        for kind in sorted(MODELS):
            m = MODELS[kind](local)
            want_loss, want_params, want_stats = train(m, kind, {op.name: TileConfig((1,) * len(op.tile_shape))
                                                                  for op in m.ops})
            m.close()
            for seed in seeds:
                (loss, params, stats), configs = results[(seed, kind)]
                where = f"{kind}, seed {seed}, on {MPI.COMM_WORLD.size} ranks, configs {configs}"
                np.testing.assert_allclose(loss, want_loss, rtol=1e-4, err_msg=where)
                for got, want in ((params, want_params), (stats, want_stats)):
                    assert got.keys() == want.keys(), where
                    for k in want:
                        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-6, err_msg=f"{where}: {k}")
        local.shutdown()
    print(f"OK rank {rank}", flush=True)


if __name__ == "__main__":
    main([int(s) for s in sys.argv[1:]])
