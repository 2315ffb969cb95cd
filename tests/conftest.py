"""Test-wide settings: hypothesis without per-example deadlines (a busy 2-core machine makes
timing meaningless), and, under CI, derandomized so that a run is reproducible. The suite
tests the CPU path, so runtimes it makes take no GPU even where one exists (TASKRT_GPUS=0,
inherited by the MPI programs); tests/test_gpu.py builds GPU machines itself. A session of
many tests starts tests/precompile.py beside it, which fills numba's cache with what the
later tests compile. The tests' own cached kernels (tests/test_blas.py's) get the packages'
refresh of numba's cache (taskrt/jit_cache.py)."""
import os
import subprocess
import sys
from pathlib import Path

from hypothesis import settings

from taskrt import jit_cache

settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

os.environ["TASKRT_GPUS"] = "0"

ROOT = Path(__file__).resolve().parent.parent
jit_cache.refresh(__file__)
_precompile: list[subprocess.Popen] = []


def pytest_configure(config):
    config.addinivalue_line("markers", "real_threshold: a Winograd test that checks the shipped size threshold "
                                       "(tests/test_winograd.py lowers it for the others)")


#: a session of fewer tests does not start tests/precompile.py (a file or two: it would only compete)
PRECOMPILE_FROM_TESTS = 300


def pytest_collection_finish(session):
    if len(session.items) >= PRECOMPILE_FROM_TESTS and os.environ.get("TASKRT_TEST_PRECOMPILE", "1") != "0":
        _precompile.append(subprocess.Popen([sys.executable, "-m", "tests.precompile"], cwd=ROOT,
                                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL))


def pytest_sessionfinish(session):
    for proc in _precompile:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
