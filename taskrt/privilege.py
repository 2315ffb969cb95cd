"""Privileges: how a task may touch a region (Legion's R, WD, RW and Reduce(op))."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: reduction operators: name -> (identity for a dtype, in-place fold dst op= src)
REDUCTION_OPS = {
    "sum": (lambda dt: 0, lambda xp, dst, src: xp.add(dst, src, out=dst)),
    "prod": (lambda dt: 1, lambda xp, dst, src: xp.multiply(dst, src, out=dst)),
    "max": (lambda dt: _lowest(dt), lambda xp, dst, src: xp.maximum(dst, src, out=dst)),
    "min": (lambda dt: _highest(dt), lambda xp, dst, src: xp.minimum(dst, src, out=dst)),
}
_ALIASES = {"+": "sum", "*": "prod"}


def _lowest(dt):
    dt = np.dtype(dt)
    return -np.inf if dt.kind == "f" else False if dt.kind == "b" else np.iinfo(dt).min


def _highest(dt):
    dt = np.dtype(dt)
    return np.inf if dt.kind == "f" else True if dt.kind == "b" else np.iinfo(dt).max


def reduction_problem(op: str, dtype) -> str | None:
    """Why reduction operator `op` cannot fold a region of `dtype`, or None: max and min need
    an ordered dtype (bool, ints, floats), every operator a number or a bool."""
    dt = np.dtype(dtype)
    ordered = op in ("max", "min")
    if dt.kind not in ("biuf" if ordered else "biufc"):
        need = "an ordered dtype (bool, ints or floats)" if ordered else "numbers or bools"
        return f"Reduce({op!r}) needs {need}, got {dt}"
    return None


@dataclass(frozen=True)
class Privilege:
    """READ, WRITE (discard old contents), READ_WRITE, or REDUCE with a named operator."""

    mode: str
    redop: str | None = None
    _hash: int = field(init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self):
        # rebuilt, not restored: a str's hash differs between processes (ranks)
        return (Privilege, (self.mode, self.redop))

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.mode, self.redop)))
        if self.mode not in ("R", "WD", "RW", "Reduce"):
            raise ValueError(f"unknown privilege mode {self.mode!r}; expected R, WD, RW or Reduce")
        if (self.mode == "Reduce") != (self.redop is not None):
            raise ValueError(f"privilege {self.mode!r} with reduction operator {self.redop!r}")
        if self.redop is not None and self.redop not in REDUCTION_OPS:
            raise ValueError(f"unknown reduction operator {self.redop!r}; expected one of {sorted(REDUCTION_OPS)}")

    def __repr__(self) -> str:
        return f"Reduce({self.redop!r})" if self.redop else self.mode

    @property
    def reads(self) -> bool:
        """Needs the current contents of the region."""
        return self.mode in ("R", "RW")

    @property
    def writes(self) -> bool:
        return self.mode in ("WD", "RW")

    @property
    def is_reduce(self) -> bool:
        return self.mode == "Reduce"

    def conflicts(self, other: "Privilege") -> bool:
        """Two accesses to overlapping data must be ordered unless both read, or both reduce with one op."""
        if self.mode == "R":
            return other.mode != "R"
        if self.mode == "Reduce":
            return other.mode != "Reduce" or self.redop != other.redop
        return True


READ = Privilege("R")
WRITE = Privilege("WD")
READ_WRITE = Privilege("RW")


def Reduce(op: str = "sum") -> Privilege:
    """The REDUCE privilege with operator `op` ('sum' or '+', 'prod' or '*', 'max', 'min')."""
    return Privilege("Reduce", _ALIASES.get(op, op))


def as_privilege(value) -> Privilege:
    """Accept a Privilege or its short name ('R', 'WD', 'RW', 'Reduce(+)'); reject anything else by name."""
    if isinstance(value, Privilege):
        return value
    if isinstance(value, str):
        if value in ("R", "WD", "RW"):
            return Privilege(value)
        if value.startswith("Reduce(") and value.endswith(")"):
            return Reduce(value[7:-1].strip("'\""))
    raise ValueError(f"unknown privilege {value!r}; expected READ, WRITE, READ_WRITE or Reduce(op)")


def reduction_identity(op: str, dtype) -> object:
    return REDUCTION_OPS[op][0](dtype)


def fold(xp, op: str, dst, src) -> None:
    """dst op= src, in place."""
    REDUCTION_OPS[op][1](xp, dst, src)
