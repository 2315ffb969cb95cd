"""Test-wide settings: hypothesis without per-example deadlines (a busy 2-core machine makes
timing meaningless), and, under CI, derandomized so that a run is reproducible. The suite
tests the CPU path, so runtimes it makes take no GPU even where one exists (TASKRT_GPUS=0,
inherited by the MPI programs); tests/test_gpu.py builds GPU machines itself."""
import os

from hypothesis import settings

settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

os.environ["TASKRT_GPUS"] = "0"


def pytest_configure(config):
    config.addinivalue_line("markers", "real_threshold: a Winograd test that checks the shipped size threshold "
                                       "(tests/test_winograd.py lowers it for the others)")
