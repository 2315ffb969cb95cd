"""Rect: an n-dimensional half-open box of integer indices, the unit of all region math."""
from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np


#: how a frozen Rect sets its fields once, in __init__
_set = object.__setattr__


@dataclass(frozen=True, order=True, init=False)
class Rect:
    """The box lo[d] <= i[d] < hi[d] in every dimension d; empty when any hi[d] <= lo[d]."""

    lo: tuple[int, ...]
    hi: tuple[int, ...]
    _hash: int = field(init=False, repr=False, compare=False)
    _empty: bool = field(init=False, repr=False, compare=False)

    def __init__(self, lo: tuple[int, ...], hi: tuple[int, ...]):
        # (the generated __init__ and a __post_init__ took 3.5 us a rect on a 2 GHz core, this
        # 2.5: a search makes some 10^5 rects a second. Writing self.__dict__ instead would be
        # faster still, but it gives the object a dict of its own, and reading a field then
        # costs half as much again)
        try:   # (the checks cost nothing where they pass: rects are made by the hundred thousand)
            if len(lo) != len(hi):
                raise ValueError(f"Rect lo {lo} and hi {hi} have different dimensions")
            h = hash((lo, hi))
        except TypeError:
            raise TypeError(f"Rect lo and hi must be tuples of ints, got {lo!r} and {hi!r} (Rect.make takes any "
                            f"sequences)") from None
        _set(self, "lo", lo)
        _set(self, "hi", hi)
        _set(self, "_hash", h)
        # asked for on every access the analysis makes: computed once (the analysis makes
        # hundreds of thousands of rects a graph, so this stays in C: map, not a generator)
        _set(self, "_empty", not all(map(operator.lt, lo, hi)))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        # (the generated one builds two tuples a call: the segment caches compare 10^5 rects a graph)
        if other.__class__ is not Rect:
            return NotImplemented
        return self._hash == other._hash and self.lo == other.lo and self.hi == other.hi

    @staticmethod
    def from_shape(shape: Sequence[int]) -> "Rect":
        """The box [0, shape) covering a whole array of that shape."""
        shape = as_int_tuple("Rect.from_shape: shape", shape, least=0)
        return Rect((0,) * len(shape), shape)

    @staticmethod
    def make(lo: Sequence[int], hi: Sequence[int]) -> "Rect":
        """The box lo <= i < hi from any sequences of ints (floats and strings refused, not cast)."""
        return Rect(as_int_tuple("Rect.make: lo", lo), as_int_tuple("Rect.make: hi", hi))

    def __repr__(self) -> str:
        return "Rect(" + ", ".join(f"{a}:{b}" for a, b in zip(self.lo, self.hi)) + ")"

    @property
    def ndim(self) -> int:
        return len(self.lo)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(max(0, b - a) for a, b in zip(self.lo, self.hi))

    @property
    def volume(self) -> int:
        return 0 if self._empty else math.prod(map(operator.sub, self.hi, self.lo))

    @property
    def empty(self) -> bool:
        return self._empty

    def intersect(self, other: "Rect") -> "Rect":
        if len(self.lo) != len(other.lo):
            self._check_dims(other)
        return Rect(tuple(map(max, self.lo, other.lo)), tuple(map(min, self.hi, other.hi)))

    def overlaps(self, other: "Rect") -> bool:
        """True when the two boxes share at least one point (the analysis's hottest test: no
        allocation, and two comparisons a dim once neither box is empty)."""
        if self._empty or other._empty:
            return False
        for a0, a1, b0, b1 in zip(self.lo, self.hi, other.lo, other.hi):
            if a0 >= b1 or b0 >= a1:
                return False
        return True

    def contains(self, other: "Rect") -> bool:
        """True when every point of `other` lies in self (an empty `other` is contained)."""
        if len(self.lo) != len(other.lo):
            self._check_dims(other)
        if other._empty:
            return True
        # (asked on every write and whole-piece copy the analysis makes: the comparisons stay in C)
        return all(map(operator.le, self.lo, other.lo)) and all(map(operator.le, other.hi, self.hi))

    def contains_point(self, point: Sequence[int]) -> bool:
        return all(a <= p < b for a, b, p in zip(self.lo, self.hi, point))

    def points(self) -> Iterator[tuple[int, ...]]:
        """Every index in the box, in row-major (C) order."""
        return itertools.product(*(range(a, b) for a, b in zip(self.lo, self.hi)))

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        return self.points()

    def slices(self, origin: Sequence[int] | None = None) -> tuple[slice, ...]:
        """Numpy slices selecting this box from an array whose index 0 sits at `origin`."""
        if origin is None:
            return tuple(slice(a, b) for a, b in zip(self.lo, self.hi))
        return tuple(slice(a - o, b - o) for a, b, o in zip(self.lo, self.hi, origin))

    def translate(self, offset: Sequence[int]) -> "Rect":
        return Rect(tuple(a + o for a, o in zip(self.lo, offset)), tuple(b + o for b, o in zip(self.hi, offset)))

    def subtract(self, other: "Rect") -> list["Rect"]:
        """Disjoint boxes covering self minus other (at most 2 * ndim of them)."""
        inter = self.intersect(other)
        if inter.empty:
            return [] if self.empty else [self]
        pieces = []
        lo, hi = list(self.lo), list(self.hi)
        for d in range(self.ndim):
            if lo[d] < inter.lo[d]:
                pieces.append(Rect(tuple(lo), tuple(hi[:d] + [inter.lo[d]] + hi[d + 1:])))
                lo[d] = inter.lo[d]
            if inter.hi[d] < hi[d]:
                pieces.append(Rect(tuple(lo[:d] + [inter.hi[d]] + lo[d + 1:]), tuple(hi)))
                hi[d] = inter.hi[d]
        return pieces

    def union_bbox(self, other: "Rect") -> "Rect":
        """The smallest box holding both."""
        return Rect(tuple(map(min, self.lo, other.lo)), tuple(map(max, self.hi, other.hi)))

    def _check_dims(self, other: "Rect") -> None:
        if self.ndim != other.ndim:
            raise ValueError(f"cannot combine {self!r} ({self.ndim}-d) with {other!r} ({other.ndim}-d)")


def pairwise_disjoint(rects) -> bool:
    """No two of `rects` share a point (empty rects share nothing): sorted by lo, each rect
    is compared only with those that start before it ends in dim 0."""
    rects = sorted((r for r in rects if not r.empty), key=lambda r: r.lo)
    for i, a in enumerate(rects):
        for b in rects[i + 1:]:
            if a.ndim and b.lo[0] >= a.hi[0]:
                break
            if a.overlaps(b):
                return False
    return True


def disjoint_cover(rects, whole: "Rect") -> bool:
    """Whether the non-empty `rects` tile `whole` exactly: no overlaps, no gaps (given that each
    lies inside it)."""
    rects = [r for r in rects if not r.empty]
    return pairwise_disjoint(rects) and sum(r.volume for r in rects) == whole.volume


def equal_rects(shape, degrees) -> dict[tuple[int, ...], Rect]:
    """`degrees[d]` near-equal pieces per dim (cuts at i*extent//degree), by color in row-major order."""
    # the products of each dim's colors, lower and upper cuts run in the same row-major order (a
    # plan at 64 devices makes tens of thousands of tiles: kept in C, no generator per rect)
    los = [[i * ext // deg for i in range(deg)] for ext, deg in zip(shape, degrees)]
    his = [[(i + 1) * ext // deg for i in range(deg)] for ext, deg in zip(shape, degrees)]
    return dict(zip(itertools.product(*map(range, degrees)),
                    map(Rect, itertools.product(*los), itertools.product(*his))))


def shard_degrees(shape, pieces: int) -> tuple[int, ...]:
    """Degrees per dim that cut a box of `shape` into at most `pieces` near-equal shards,
    as many as fit: each dim in turn takes the largest divisor of what is left that its
    extent allows (so 64 shards of a 10 x 512 weight are 8 x 8)."""
    degrees, left = [], max(1, pieces)
    for extent in shape:
        deg = max((d for d in range(1, min(left, extent) + 1) if left % d == 0), default=1)
        degrees.append(deg)
        left //= deg
    return tuple(degrees)


def as_int(what: str, value, least: int | None = None) -> int:
    """`value` as an int, or a TypeError/ValueError naming `what` and the value: floats (even
    4.0), bools and strings are refused rather than truncated or cast."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if least is not None and value < least:
        raise ValueError(f"{what} must be >= {least}, got {value!r}")
    return int(value)


def as_int_tuple(what: str, values, least: int | None = None) -> tuple[int, ...]:
    """A sequence of ints (see `as_int`), e.g. a shape or partition degrees."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{what} must be a sequence of ints, got {type(values).__name__} {values!r}")
    values = tuple(values)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{what} must be ints, got {type(v).__name__} {v!r} in {values!r}")
        if least is not None and v < least:
            raise ValueError(f"{what} must be >= {least}, got {v!r} in {values!r}")
    return tuple(int(v) for v in values)
