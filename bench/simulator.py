"""How fast the simulator builds and times graphs, and how fast the search proposes.

    python bench/simulator.py [--quick] [--large]

Measured here, on one core:
- graph building, microseconds per node of one training iteration's graph for a 102-op
  network of conv / batch norm / relu blocks then flat, dense and softmax, data parallel on
  4, 16 and 64 processors (Machine.build(P // 4, 4)): by the runtime over the whole program
  (strategies.graph.build_iteration), by the runtime replaying a recorded training step (the
  third and later steps of Lowering.train_step), from empty segment caches (strategies.segments), from
  full caches (assembly only), and after one op's config changes (the delta a search
  proposal costs); the target is 10 us per node at 64;
- full simulations (the runtime's graph built afresh, costs, timing) and delta simulations
  (through the caches) per second of the same strategies (from data parallel, one random op's
  config redrawn at a time), of the tiny
  Inception-v3 and NMT apps on 16 P100 and 64 K80 devices, and `delta_over_full` (target >= 5
  at 64 devices);
- the search on the tiny Inception-v3 on 64 K80 devices: a real 10,000-proposal search (target
  under 60 s; with --quick, 30 proposals on 4 devices, scaled to 10,000, which overstates it:
  early proposals miss the caches more), seconds per proposal, region analyses per proposal, and the share
  of region cache misses that the canonical cache answered by renaming memories. --large adds
  the tiny transformer app at 64, 256 and 1,024 H100-class devices (per-proposal time against
  devices; target for 10,000 proposals at 1,024: under 10 minutes).
Beside FlexFlow's published figures: its Inception-v3 search on 64 GPUs took 1,278 s with delta
simulation (`flexflow_search_s_over_ours` divides it by our 10,000 proposals' seconds), and its
delta simulation was 2.2 to 6.9 times faster than full. Analytic costs throughout; the tiny
apps at batch 16 (BATCH). Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT

from ops.lower import Lowering, default_config  # noqa: E402
from ops.model import Model  # noqa: E402
from ops.optimizers import SGD  # noqa: E402
from strategies.cost import CostModel  # noqa: E402
from strategies.graph import build_iteration  # noqa: E402
from strategies.random import random_config  # noqa: E402
from strategies.segments import SegmentBuilder  # noqa: E402
from strategies.machine_model import load_machine  # noqa: E402
from strategies.search import STARTS, app_simulator, search  # noqa: E402
from taskrt import Machine, Runtime  # noqa: E402

#: the tiny apps' batch here (every session's figures since session 13 are at 16; the apps' own
#: tiny batches differ: Inception-v3 and the transformer train 8)
BATCH = 16


def conv_net(blocks: int = 33, batch: int = 64) -> Model:
    """3 x blocks ops of conv / batch norm / relu, then flat, dense and softmax (102 ops at 33)."""
    m = Model(Runtime(execute=False), weights=False)
    h = m.input((batch, 3, 32, 32), name="x")
    for _ in range(blocks):
        h = m.relu(m.batch_norm(m.conv2d(h, 16, 3, padding=1)))
    m.softmax(m.dense(m.flat(h), 10))
    return m


def _changes(sim, configs: dict, count: int, seed: int):
    """`count` successive strategies, each with one random op's config redrawn."""
    rng = np.random.default_rng(seed)
    configs = dict(configs)
    for _ in range(count):
        op = sim.ops[int(rng.integers(len(sim.ops)))]
        configs[op.name] = random_config(op, sim.machine, rng)
        yield dict(configs)


def build_rate(model: Model, processors: int, changes: int) -> dict:
    """Microseconds per node of one data-parallel iteration graph on `processors` CPUs, built four
    ways (see the module doc)."""
    machine = Machine.build(max(1, processors // 4), min(4, processors), separate_memories=True)
    ops, inputs, loss = model.training_graph()
    configs = {op.name: default_config(op, machine) for op in ops}
    t0 = time.perf_counter()
    graph = build_iteration(ops, inputs, loss.name, configs, machine)
    runtime = time.perf_counter() - t0
    nodes = len(graph.nodes)
    builder = SegmentBuilder(ops, inputs, loss.name, machine)
    t0 = time.perf_counter()
    builder.build(configs)
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    builder.build(configs)
    warm = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    delta = []
    for _ in range(changes):
        changed = dict(configs)
        op = ops[int(rng.integers(len(ops)))]
        changed[op.name] = random_config(op, machine, rng)
        t0 = time.perf_counter()
        g = builder.build(changed)
        delta.append((time.perf_counter() - t0) / len(g.nodes))

    # last: the replayed steps leave 10^5 nodes a step alive until collected
    replayed = replayed_step_rate(ops, inputs, loss.name, configs, machine)

    def us(seconds):
        return round(seconds / nodes * 1e6, 2)
    return {"nodes": nodes, "runtime_us_per_node": us(runtime), "runtime_replayed_us_per_node": replayed,
            "segments_cold_us_per_node": us(cold),
            "segments_cached_us_per_node": us(warm),
            "one_change_us_per_node": round(float(np.median(delta)) * 1e6, 2) if delta else None}


def replayed_step_rate(ops, inputs, loss: str, configs: dict, machine, steps: int = 5) -> float:
    """Microseconds per node of a training step the runtime replays (Lowering.train_step on an
    execute=False runtime: the first two steps are analyzed, the later ones reissue the
    recorded program): the median over steps 3 to `steps`."""
    rt = Runtime(machine, execute=False)
    low = Lowering(rt, ops, inputs, configs, SGD(lr=0.01, momentum=0.9), loss=loss, tag="replayed")
    rates = []
    for step in range(1, steps + 1):
        for t in inputs:
            rt.fill(low.values[t.name], 0)
        first = rt._next_id
        t0 = time.perf_counter()
        low.train_step(step)
        if step >= 3:
            rates.append((time.perf_counter() - t0) / (rt._next_id - first))
    rt.shutdown()
    return round(float(np.median(rates)) * 1e6, 2)


def simulation_rate(app: str, machine: str, nodes: int, changes: int) -> dict:
    """Full and delta simulations per second of a tiny app: from data parallel, `changes` strategies
    each with one op's config redrawn, each simulated both ways (delta through the caches the
    earlier ones filled, full from scratch); the medians."""
    mm = load_machine(machine, nodes=nodes)
    model, sim = app_simulator(app, mm, BATCH, tiny=True, cost=CostModel(mm, measured=False))
    from strategies import data_parallel
    configs = sim.configs(data_parallel(model, sim.machine))
    first = sim.simulate(configs)  # fills the caches
    full_s, delta_s, sizes = [], [], []
    for changed in _changes(sim, configs, changes, seed=1):
        t0 = time.perf_counter()
        delta = sim.simulate(changed)
        delta_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        full = sim.simulate(changed, delta=False)
        full_s.append(time.perf_counter() - t0)
        if full.time != delta.time:
            raise RuntimeError(f"{app}: delta simulation {delta.time} s, full {full.time} s: they must be equal")
        sizes.append(len(full.graph.nodes))
    full_m, delta_m = float(np.median(full_s)), float(np.median(delta_s))
    return {"devices": mm.num_devices, "nodes_data_parallel": len(first.graph.nodes),
            "nodes_median": int(np.median(sizes)), "full_per_s": round(1 / full_m, 3),
            "delta_per_s": round(1 / delta_m, 3), "delta_over_full": round(full_m / delta_m, 2),
            "predicted_ms_data_parallel": round(first.time * 1e3, 4)}


#: FlexFlow's published figures (Jia et al., SysML 2019), Inception-v3 on 64 GPUs
FLEXFLOW = {"search_s": 1278, "search_full_simulation_s": 8817, "delta_over_full": (2.2, 6.9)}


def search_rate(app: str, machine: str, nodes: int, proposals: int) -> dict:
    mm = load_machine(machine, nodes=nodes)
    model, sim = app_simulator(app, mm, BATCH, tiny=True, cost=CostModel(mm, measured=False))
    t0 = time.perf_counter()
    search(sim, len(STARTS), seed=0, model=model)   # the baselines, every chain's start, and the caches they fill
    setup = time.perf_counter() - t0
    before = dict(sim.builder.stats)
    result = search(sim, proposals, seed=0, model=model)
    per = result.seconds / max(1, result.proposals)
    measured = result.proposals >= 10000
    analyzed = sim.builder.stats["regions_analyzed"] - before["regions_analyzed"]
    renamed = sim.builder.stats["regions_renamed"] - before["regions_renamed"]
    return {"app": f"{app} (tiny)", "devices": mm.num_devices, "setup_s": round(setup, 2),
            "proposals": result.proposals, "seconds": round(result.seconds, 2),
            "seconds_per_proposal": round(per, 4),
            "seconds_for_10000_proposals": round(setup + (result.seconds if measured else per * 10000), 1),
            "seconds_for_10000_measured": measured,
            "region_analyses_per_proposal": round(analyzed / max(1, result.proposals), 2),
            "renamed_share_of_region_misses": round(renamed / max(1, analyzed + renamed), 3),
            "speedup_over_best_baseline": round(result.speedup_over_baselines(), 3)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes and proposals (a minute)")
    p.add_argument("--large", action="store_true", help="also the transformer at 64, 256 and 1,024 h100 devices")
    args = p.parse_args(argv)
    net = conv_net(blocks=4 if args.quick else 33)
    # the process's first build loads the compiled kernels from numba's cache (about half a
    # second, which was most of the first size's figure): one small build first, not reported
    build_rate(conv_net(blocks=1), 4, 0)
    out = {"bench": "simulator", "conv_net_ops": len(net.ops), "build": {}, "simulations": {}}
    for procs in ((4, 16) if args.quick else (4, 16, 64)):
        out["build"][str(procs)] = build_rate(net, procs, 3 if args.quick else 5)
        print(f"build, {len(net.ops)}-op conv net on {procs} processors: {out['build'][str(procs)]}", flush=True)
    cases = [("nmt", "p100", 1)] if args.quick else [
        ("inception_v3", "p100", 4), ("nmt", "p100", 4), ("inception_v3", "k80", 16), ("nmt", "k80", 16)]
    for app, machine, nodes in cases:
        key = f"{app}/{machine}x{nodes}"
        out["simulations"][key] = simulation_rate(app, machine, nodes, 3 if args.quick else 6)
        print(f"simulate {key}: {out['simulations'][key]}", flush=True)
    at_64 = [v["delta_over_full"] for v in out["simulations"].values() if v["devices"] == 64]
    out["delta_over_full"] = min(at_64) if at_64 else None
    out["search"] = search_rate("inception_v3", "k80", 1 if args.quick else 16, 30 if args.quick else 10000)
    print(f"search: {out['search']}", flush=True)
    if args.large:
        out["search_by_devices"] = {}
        for nodes in (8, 32, 128):
            out["search_by_devices"][str(nodes * 8)] = search_rate("transformer", "h100", nodes, 100)
            print(f"search at {nodes * 8} devices: {out['search_by_devices'][str(nodes * 8)]}", flush=True)
    out["flexflow"] = dict(FLEXFLOW)
    out["flexflow_search_s_over_ours"] = round(FLEXFLOW["search_s"] / out["search"]["seconds_for_10000_proposals"], 1)
    if out["delta_over_full"] is not None:
        out["delta_over_full_over_flexflow_best"] = round(out["delta_over_full"] / FLEXFLOW["delta_over_full"][1], 2)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
