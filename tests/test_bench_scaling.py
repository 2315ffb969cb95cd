"""bench/scaling.py in its quick mode: 1 and 2 ranks, 2 steps of tiny models, every baseline
and DDP, the sync-bytes graphs; its last line is one JSON object with every key (numbers
unchecked: a benchmark never asserts on a time)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quick_run_prints_every_key():
    env = {**os.environ, "TASKRT_MPI_TIMEOUT": "20"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "scaling.py"), "--quick"], capture_output=True,
                          text=True, timeout=240, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bench"] == "scaling" and result["mode"] == "quick"
    for model in ("cnn", "mlp"):
        for ranks in ("1", "2"):
            row = result["throughput"][model][ranks]
            assert set(row["samples_per_s"]) == {"data", "model", "expert", "tensor", "ddp"}
            assert all(v > 0 for v in row["samples_per_s"].values())
            assert row["best"] in {"data", "model", "expert", "tensor"}
            assert row["ratio_vs_ddp"] > 0
        assert result["ratio_vs_ddp"][model] == result["throughput"][model]["2"]["ratio_vs_ddp"]
        assert result["best_baseline"][model] == result["throughput"][model]["2"]["best"]
    assert set(result["sync_bytes_over_ideal"]) == {"8", "64"}
    assert all(v > 0 for v in result["sync_bytes_over_ideal"].values())
