"""bench/sim_accuracy.py's per-strategy diagnosis: where a simulation is furthest from its run's trace."""
from __future__ import annotations

import pytest

from strategies.machine_model import load_machine
from tests.bench_module import load_bench
from tests.test_trace import tiny_run, tiny_simulation
from tools import trace as tt


def test_furthest_off_names_the_phase_and_the_waits(tmp_path):
    run = tiny_run(str(tmp_path / "run.jsonl"))
    result = tiny_simulation()
    bench = load_bench("sim_accuracy")
    off = bench.furthest_off(result, run, str(tmp_path))
    c = tt.compare(tt.load(result.write_trace(str(tmp_path / "again.jsonl"))), tt.load(run))
    row = {r["name"]: r for r in c["phases"]}[off["phase"]]
    assert max(abs(r["simulated_us"] - r["measured_us"]) for r in c["phases"]) == pytest.approx(
        abs(row["simulated_us"] - row["measured_us"]))
    assert off["simulated_ms"] == pytest.approx(row["simulated_us"] / 1e3, abs=1e-3)
    assert off["measured_ms"] == pytest.approx(row["measured_us"] / 1e3, abs=1e-3)
    launch = load_machine("local", nodes=1).launch_overhead * 1e6
    assert off["task_wait_us"][0] == pytest.approx(launch) and off["task_wait_us"][1] > 0
    assert bench.furthest_off(result, str(tmp_path / "no_such_run.jsonl"), str(tmp_path)) is None
