"""The networks of the FlexFlow paper and more, each runnable with `python -m apps.NAME`."""
from taskrt.blas_env import quiet_idle_threads

quiet_idle_threads()  # before anything loads numpy (taskrt/blas_env.py)
