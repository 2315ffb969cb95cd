"""bench/sim_accuracy.py's per-strategy diagnosis: where a simulation is furthest from its run's trace."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from ops import SGD, Model
from strategies import data_parallel
from strategies.cost import CostModel
from strategies.machine_model import load_machine
from strategies.simulator import Simulator
from taskrt import Runtime
from tests.test_trace import tiny
from tools import trace as tt

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_sim_accuracy", ROOT / "bench" / "sim_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_furthest_off_names_the_phase_and_the_waits(tmp_path):
    run = str(tmp_path / "run.jsonl")
    rt = Runtime(cpus=2, separate_memories=True, trace=run)
    m = tiny(Model(runtime=rt, seed=0))
    m.compile(optimizer=SGD(lr=0.1), loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    m.fit(rng.normal(size=(64, 32)).astype(np.float32), rng.integers(0, 4, 64), iterations=3, verbose=False)
    m.close()
    rt.shutdown()
    mm = load_machine("local", nodes=1)
    sm = tiny(Model(Runtime(execute=False), weights=False))
    sim = Simulator.for_model(sm, mm, CostModel(mm, measured=False))
    result = sim.simulate(data_parallel(sm, sim.machine))

    off = _bench().furthest_off(result, run, str(tmp_path))
    c = tt.compare(tt.load(result.write_trace(str(tmp_path / "again.jsonl"))), tt.load(run))
    row = {r["name"]: r for r in c["phases"]}[off["phase"]]
    assert max(abs(r["simulated_us"] - r["measured_us"]) for r in c["phases"]) == pytest.approx(
        abs(row["simulated_us"] - row["measured_us"]))
    assert off["simulated_ms"] == pytest.approx(row["simulated_us"] / 1e3, abs=1e-3)
    assert off["measured_ms"] == pytest.approx(row["measured_us"] / 1e3, abs=1e-3)
    assert off["task_wait_us"][0] == pytest.approx(mm.launch_overhead * 1e6) and off["task_wait_us"][1] > 0
    assert _bench().furthest_off(result, str(tmp_path / "no_such_run.jsonl"), str(tmp_path)) is None
