"""Operators and the model API (graph building, compile, fit) on top of taskrt.

`from ops import Model` loads the model API (and with it every operator module) on first
use, so importing a single operator module stays light.
"""
import importlib

from taskrt.jit_cache import refresh as _refresh_jit_cache

_refresh_jit_cache(__file__)   # before any kernel loads its cache

_LAZY = {"Model": "ops.model", "History": "ops.model", "TileConfig": "ops.lower", "ConfigError": "ops.lower",
         "default_config": "ops.lower", "SGD": "ops.optimizers", "Adam": "ops.optimizers",
         "Strategy": "ops.strategy", "StrategyError": "ops.strategy", "model_fingerprint": "ops.strategy"}

__all__ = sorted(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ops' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
