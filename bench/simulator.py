"""How fast the simulator builds and times graphs, and how fast the search proposes.

    python bench/simulator.py [--quick]

Measured here, on one core:
- graph building: microseconds per graph node of one training iteration's graph
  (strategies.graph.build_iteration: the runtime's lowering and dependence analysis with
  execute=False) for a 102-op network of conv / batch norm / relu blocks then flat, dense and
  softmax, data parallel on 4, 16 and 64 processors (Machine.build(P // 4, 4)); the target is
  10 us per node at 64;
- full simulations per second (graph building, costs and timing) of the tiny Inception-v3 and
  NMT apps at 16 devices of the p100 and k80 models and NMT at 64 (Inception-v3 at 64 with
  --large; analytic costs);
- the search: seconds per simulation for the tiny Inception-v3 on 16 k80 devices, and what
  10,000 proposals would take at that rate (the target, at 64 devices, is under 60 s).
Delta simulation is not built yet, so `delta_over_full` is null. Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT

from ops.lower import default_config  # noqa: E402
from ops.model import Model  # noqa: E402
from strategies.cost import CostModel  # noqa: E402
from strategies.graph import build_iteration  # noqa: E402
from strategies.machine_model import load_machine  # noqa: E402
from strategies.search import app_graph, search  # noqa: E402
from strategies.simulator import Simulator  # noqa: E402
from taskrt import Machine, Runtime  # noqa: E402


def conv_net(blocks: int = 33, batch: int = 64) -> Model:
    """3 x blocks ops of conv / batch norm / relu, then flat, dense and softmax (102 ops at 33)."""
    m = Model(Runtime(execute=False), weights=False)
    h = m.input((batch, 3, 32, 32), name="x")
    for _ in range(blocks):
        h = m.relu(m.batch_norm(m.conv2d(h, 16, 3, padding=1)))
    m.softmax(m.dense(m.flat(h), 10))
    return m


def build_rate(model: Model, processors: int) -> dict:
    """Microseconds per node of one data-parallel iteration graph on `processors` CPUs."""
    machine = Machine.build(max(1, processors // 4), min(4, processors), separate_memories=True)
    ops, inputs, loss = model.training_graph()
    configs = {op.name: default_config(op, machine) for op in ops}
    t0 = time.perf_counter()
    graph = build_iteration(ops, inputs, loss.name, configs, machine)
    seconds = time.perf_counter() - t0
    return {"nodes": len(graph.nodes), "seconds": round(seconds, 3), "us_per_node": round(seconds / len(graph.nodes) * 1e6, 1)}


def simulation_rate(app: str, machine: str, nodes: int, repeats: int) -> dict:
    model, output = app_graph(app, None, tiny=True)
    mm = load_machine(machine, nodes=nodes)
    sim = Simulator.for_model(model, mm, CostModel(mm, measured=False), output=output)
    from strategies import data_parallel
    strategy = data_parallel(model, sim.machine)
    t0 = time.perf_counter()
    for _ in range(repeats):
        result = sim.simulate(strategy)
    seconds = (time.perf_counter() - t0) / repeats
    return {"devices": mm.num_devices, "nodes": len(result.graph.nodes), "seconds": round(seconds, 4),
            "per_s": round(1 / seconds, 3), "predicted_ms": round(result.time * 1e3, 4)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes and proposals (a minute)")
    p.add_argument("--large", action="store_true",
                   help="also Inception-v3 on 64 k80 devices (about 180k nodes: minutes per simulation today)")
    args = p.parse_args(argv)
    net = conv_net(blocks=4 if args.quick else 33)
    out = {"bench": "simulator", "conv_net_ops": len(net.ops), "build": {}, "simulations": {}, "delta_over_full": None}
    for procs in ((4, 16) if args.quick else (4, 16, 64)):
        out["build"][str(procs)] = build_rate(net, procs)
        print(f"build, {len(net.ops)}-op conv net on {procs} processors: {out['build'][str(procs)]}", flush=True)
    cases = [("nmt", "p100", 1)] if args.quick else [
        ("inception_v3", "p100", 4), ("inception_v3", "k80", 4), ("nmt", "p100", 4), ("nmt", "k80", 4),
        ("nmt", "k80", 16)] + ([("inception_v3", "k80", 16)] if args.large else [])
    for app, machine, nodes in cases:
        key = f"{app}/{machine}x{nodes}"
        out["simulations"][key] = simulation_rate(app, machine, nodes, 1 if args.quick else 2)
        print(f"simulate {key}: {out['simulations'][key]}", flush=True)
    model, output = app_graph("inception_v3", None, tiny=True)
    mm = load_machine("k80", nodes=1 if args.quick else 4)
    sim = Simulator.for_model(model, mm, CostModel(mm, measured=False), output=output)
    proposals = 1 if args.quick else 5
    result = search(sim, proposals, seed=0, model=model)
    per = result.seconds / max(1, result.proposals + len(result.baselines) + 1)
    out["search"] = {"app": "inception_v3 (tiny)", "devices": mm.num_devices, "proposals": result.proposals,
                     "seconds": round(result.seconds, 2), "seconds_per_simulation": round(per, 3),
                     "seconds_for_10000_proposals_at_that_rate": round(per * 10000, 1)}
    print(f"search: {out['search']}", flush=True)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
