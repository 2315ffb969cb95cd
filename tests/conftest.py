"""Test-wide settings: hypothesis without per-example deadlines (a busy 2-core machine makes
timing meaningless), and, under CI, derandomized so that a run is reproducible."""
import os

from hypothesis import settings

settings.register_profile("dev", deadline=None)
settings.register_profile("ci", deadline=None, derandomize=True, print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
