"""taskrt.blas_env: every package of ours sets OPENBLAS_THREAD_TIMEOUT before numpy loads
OpenBLAS, so that its idle threads stop spinning; a process that loaded numpy first is told.
Each case runs in a fresh interpreter (this one loaded numpy long ago)."""
import os
import subprocess
import sys

import pytest

from taskrt.blas_env import THREAD_TIMEOUT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: CPU seconds this process burns while its main thread sleeps 0.2 s after a 2-thread GEMM:
#: OpenBLAS's helper thread spinning, or nothing
SPIN = """
import time
{imports}
from threadpoolctl import threadpool_limits
a = np.ones((1000, 1000), np.float32)
with threadpool_limits(2, user_api="blas"):
    a @ a
    t = time.process_time()
    time.sleep(0.2)
    print(time.process_time() - t)
"""


def run(code: str, timeout: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if timeout is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = timeout
    return subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("package", ["taskrt", "ops", "strategies", "apps", "tools"])
def test_each_package_sets_the_timeout_before_numpy(package):
    done = run(f"import {package}, os, numpy; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [THREAD_TIMEOUT]


def test_a_timeout_the_user_set_is_kept():
    done = run("import taskrt, os; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])", timeout="20")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["20"]


def test_numpy_imported_first_gets_a_warning_that_names_the_variable():
    done = run("import numpy; import taskrt")
    assert done.returncode != 0
    assert "RuntimeWarning" in done.stderr and "OPENBLAS_THREAD_TIMEOUT" in done.stderr
    assert run("import numpy; import taskrt", timeout="16").returncode == 0


def test_idle_blas_threads_sleep_instead_of_spinning():
    quiet = run(SPIN.format(imports="import taskrt\nimport numpy as np"))
    assert quiet.returncode == 0, quiet.stderr
    spinning = run(SPIN.format(imports="import numpy as np"), timeout="28")  # OpenBLAS's default
    assert spinning.returncode == 0, spinning.stderr
    assert float(spinning.stdout) > 0.03, "the check cannot tell: OpenBLAS's threads did not spin by default"
    assert float(quiet.stdout) < 0.02
