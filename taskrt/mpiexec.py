"""Running a Python module under this environment's mpiexec and reading its JSON report.

The mpich wheel puts `mpiexec` beside the interpreter; the module runs in the caller's folder
(so the paths given to it mean what they mean to the caller) with the repository root on
PYTHONPATH, and rank 0's last line of output is a JSON object (the apps' report,
strategies.probe's figures).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_module_json(ranks: int, module: str, args: list[str], timeout: float = 600) -> dict:
    """`mpiexec -n ranks python -m module *args`: the JSON object it printed last; a run that
    fails or prints none raises RuntimeError with the command and its last lines of output."""
    cmd = [str(Path(sys.executable).with_name("mpiexec")), "-n", str(ranks), sys.executable, "-m", module, *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not lines[-1].startswith("{"):
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{tail}")
    return json.loads(lines[-1])
