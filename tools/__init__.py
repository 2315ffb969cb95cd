"""Tools over task traces and strategies (`python -m tools.trace`, `python -m tools.strategy`)."""
from taskrt.blas_env import quiet_idle_threads

quiet_idle_threads()  # before anything loads numpy (taskrt/blas_env.py)
