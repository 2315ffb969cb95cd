"""Optimizers with PyTorch's update rules (torch.optim.SGD, torch.optim.Adam), element-wise only.

An optimizer is a frozen value holding its hyperparameters. The runtime owns the
state arrays (one per name in `state_names()`, shaped like the parameter, made by
`init_state`) and calls `update(xp, param, grad, state, step)` on any tile of a
parameter: the update reads and writes only matching elements of param, grad and
state, so updating the tiles of any partition equals updating the whole. `step`
is the 1-based count of updates so far, the same for every tile. Weight decay is
PyTorch's L2 form: weight_decay * param is added to the gradient.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import numba
import numpy as np


def _check_number(cls_name: str, field: str, value, lo: float, lo_open: bool, hi: float | None = None,
                   hi_open: bool = True) -> None:
    """Raise ValueError naming the field and its value unless lo <(=) value <(=) hi (a Python or
    numpy real number)."""
    ok = (isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))
          and math.isfinite(value))
    if ok:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if not ok:
        left = "(" if lo_open else "["
        right = "" if hi is None else (f"{hi})" if hi_open else f"{hi}]")
        span = f"{left}{lo}, {right or 'inf)'}"
        raise ValueError(f"{cls_name}: {field} must be a number in {span}, got {value!r}")


def _as_floats(optimizer, fields) -> None:
    """The checked hyperparameters of a frozen optimizer as Python floats (a numpy scalar's repr
    would show in saved files and in the launch signatures ranks compare)."""
    for name in fields:
        object.__setattr__(optimizer, name, float(getattr(optimizer, name)))


def _check_step(cls_name: str, step) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ValueError(f"{cls_name}.update: step is 1-based and must be an int >= 1, got {step!r}")


@dataclass(frozen=True)
class SGD:
    """torch.optim.SGD with dampening 0: buf = momentum * buf + g; g = g + momentum * buf if nesterov else buf."""

    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    kind: ClassVar[str] = "sgd"

    def __post_init__(self):
        _check_number("SGD", "lr", self.lr, 0.0, lo_open=True)
        _check_number("SGD", "momentum", self.momentum, 0.0, lo_open=False)
        _check_number("SGD", "weight_decay", self.weight_decay, 0.0, lo_open=False)
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"SGD: nesterov must be a bool, got {self.nesterov!r}")
        if self.nesterov and self.momentum == 0:
            raise ValueError(f"SGD: nesterov=True needs momentum > 0, got momentum={self.momentum!r}")
        _as_floats(self, ("lr", "momentum", "weight_decay"))

    def state_names(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum != 0 else ()

    def init_state(self, xp, param) -> dict[str, Any]:
        return {name: xp.zeros_like(param) for name in self.state_names()}

    def update(self, xp, param, grad, state: dict, step: int) -> None:
        _check_step("SGD", step)
        if _one_pass(xp, param, grad, *state.values()):
            t = param.dtype.type
            buf = state["momentum"].reshape(-1) if self.momentum != 0 else param.reshape(-1)
            _sgd_cpu(param.reshape(-1), grad.reshape(-1), buf, t(self.lr), t(self.momentum), t(self.weight_decay),
                     self.nesterov, step == 1)
            return
        d_p = grad + self.weight_decay * param if self.weight_decay != 0 else grad
        if self.momentum != 0:
            buf = state["momentum"]
            if step == 1:
                buf[...] = d_p
            else:
                buf *= self.momentum
                buf += d_p
            d_p = d_p + self.momentum * buf if self.nesterov else buf
        param -= self.lr * d_p

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)}


def _one_pass(xp, *arrays) -> bool:
    """Whether an update can take its compiled one-pass form: numpy arrays, all C-contiguous
    and all float32 or all float64 (a tile of a weight split by columns is not contiguous)."""
    first = arrays[0]
    return (xp is np and first.dtype in (np.float32, np.float64)
            and all(a.flags.c_contiguous and a.dtype == first.dtype for a in arrays))


@numba.njit(nogil=True, cache=True)
def _sgd_cpu(param, grad, buf, lr, momentum, weight_decay, nesterov, first):
    """SGD.update on contiguous arrays in one pass (numpy's takes several, and a temporary the
    size of the weight): each element's operations in the same order and precision (scalars
    in the arrays' dtype, no fused multiply-adds), so the same bits."""
    for i in range(param.shape[0]):
        d = grad[i]
        if weight_decay != 0:
            d = d + weight_decay * param[i]
        if momentum != 0:
            b = d if first else buf[i] * momentum + d
            buf[i] = b
            d = d + momentum * b if nesterov else b
        param[i] = param[i] - lr * d


@numba.njit(nogil=True, cache=True)
def _adam_cpu(param, grad, exp_avg, exp_avg_sq, one_minus_beta1, beta2, one_minus_beta2, step_size, bias2_sqrt, eps,
              weight_decay):
    """Adam.update on contiguous arrays in one pass, each element's operations as numpy's
    expressions do them (same order, scalars in the arrays' dtype): the same bits."""
    for i in range(param.shape[0]):
        g = grad[i]
        if weight_decay != 0:
            g = g + weight_decay * param[i]
        m = exp_avg[i] + one_minus_beta1 * (g - exp_avg[i])
        v = exp_avg_sq[i] * beta2 + one_minus_beta2 * (g * g)
        exp_avg[i] = m
        exp_avg_sq[i] = v
        param[i] = param[i] - step_size * (m / (np.sqrt(v) / bias2_sqrt + eps))


@dataclass(frozen=True)
class Adam:
    """torch.optim.Adam (amsgrad off): bias-corrected first and second moments of the gradient."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    kind: ClassVar[str] = "adam"

    def __post_init__(self):
        _check_number("Adam", "lr", self.lr, 0.0, lo_open=True)
        if not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2:
            raise ValueError(f"Adam: betas must be a pair (beta1, beta2), got {self.betas!r}")
        for i, b in enumerate(self.betas):
            _check_number("Adam", f"betas[{i}]", b, 0.0, lo_open=False, hi=1.0, hi_open=True)
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))
        _check_number("Adam", "eps", self.eps, 0.0, lo_open=True)   # (0 divides by zero where v is)
        _check_number("Adam", "weight_decay", self.weight_decay, 0.0, lo_open=False)
        _as_floats(self, ("lr", "eps", "weight_decay"))

    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def init_state(self, xp, param) -> dict[str, Any]:
        return {name: xp.zeros_like(param) for name in self.state_names()}

    def update(self, xp, param, grad, state: dict, step: int) -> None:
        _check_step("Adam", step)
        beta1, beta2 = self.betas
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        step_size = self.lr / (1 - beta1 ** step)
        bias_correction2_sqrt = math.sqrt(1 - beta2 ** step)
        if _one_pass(xp, param, grad, exp_avg, exp_avg_sq):
            t = param.dtype.type
            _adam_cpu(param.reshape(-1), grad.reshape(-1), exp_avg.reshape(-1), exp_avg_sq.reshape(-1),
                      t(1 - beta1), t(beta2), t(1 - beta2), t(step_size), t(bias_correction2_sqrt), t(self.eps),
                      t(self.weight_decay))
            return
        g = grad + self.weight_decay * param if self.weight_decay != 0 else grad
        exp_avg += (1 - beta1) * (g - exp_avg)  # torch's lerp_(g, 1 - beta1)
        exp_avg_sq *= beta2
        exp_avg_sq += (1 - beta2) * (g * g)
        denom = xp.sqrt(exp_avg_sq) / bias_correction2_sqrt + self.eps
        param -= step_size * (exp_avg / denom)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(d["betas"])
        return {"kind": self.kind, **d}


OPTIMIZERS = {cls.kind: cls for cls in (SGD, Adam)}


def make_optimizer(optimizer, where: str):
    """An optimizer object from a name ('sgd', 'adam': their defaults) or an object with the
    optimizer interface; `where` (the caller) prefixes the error otherwise."""
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"{where}: unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZERS)} "
                             f"or an optimizer object (SGD(...), Adam(...))")
        return OPTIMIZERS[optimizer]()
    if isinstance(optimizer, type):
        raise TypeError(f"{where}: optimizer {optimizer.__name__} is a class: give an object, "
                        f"{optimizer.__name__}(...)")
    for attr in ("update", "state_names", "init_state", "to_dict"):
        if not callable(getattr(optimizer, attr, None)):
            raise TypeError(f"{where}: optimizer must be 'sgd', 'adam' or an optimizer object, got {optimizer!r}")
    return optimizer


def optimizer_from_dict(d: dict[str, Any]):
    """Rebuild an optimizer from its to_dict()."""
    if not isinstance(d, dict) or d.get("kind") not in OPTIMIZERS:
        kind = d.get("kind") if isinstance(d, dict) else d
        raise ValueError(f"unknown optimizer {kind!r}; expected one of {sorted(OPTIMIZERS)}")
    cls = OPTIMIZERS[d["kind"]]
    args = {k: v for k, v in d.items() if k != "kind"}
    if "betas" in args and isinstance(args["betas"], list):
        args["betas"] = tuple(args["betas"])
    try:
        return cls(**args)
    except TypeError as e:
        raise ValueError(f"bad {d['kind']} optimizer settings {args}: {e}") from None
