"""The SOAP optimizer's floor: strategies (values and files: ops.strategy), baselines and random
configs; `from strategies import expert` loads a module on first use."""
import importlib

from taskrt.jit_cache import refresh as _refresh_jit_cache

_refresh_jit_cache(__file__)   # before any kernel loads its cache

_LAZY = {"Strategy": "ops.strategy", "StrategyError": "ops.strategy", "load": "ops.strategy",
         "save": "ops.strategy", "model_fingerprint": "ops.strategy",
         "BASELINES": "strategies.baselines", "data_parallel": "strategies.baselines",
         "model_parallel": "strategies.baselines", "expert": "strategies.baselines",
         "tensor_parallel": "strategies.baselines",
         "random_config": "strategies.random", "random_strategy": "strategies.random",
         "MachineModel": "strategies.machine_model", "DeviceSpec": "strategies.machine_model",
         "LinkSpec": "strategies.machine_model", "MachineError": "strategies.machine_model",
         "load_machine": "strategies.machine_model",
         "CostModel": "strategies.cost", "CostKey": "strategies.cost", "fit_efficiency": "strategies.cost",
         "peak_memory": "strategies.memory", "fits": "strategies.memory"}

__all__ = sorted(_LAZY)


def __getattr__(name):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'strategies' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
