"""Regions (logical tensors, no storage) and partitions (colors to sub-rects)."""
from __future__ import annotations

import itertools
import math
import operator
from functools import cached_property
from typing import Iterable, Mapping, Sequence

import numpy as np

from .geometry import Rect, as_int_tuple, equal_rects, pairwise_disjoint

Color = tuple[int, ...]


def dtype_of_kind(dtype, kinds: str) -> np.dtype | None:
    """`dtype` as a numpy dtype where numpy understands it and its kind is one of `kinds` (numpy's
    letters: "f" floats, "iu" integers, ...), else None."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return None
    return dt if dt.kind in kinds else None


def beyond_range(array: np.ndarray, dtype) -> tuple[int, ...] | None:
    """Where the first finite value of `array` is that the float or complex `dtype` cannot hold
    (it would become inf, with numpy's warning alone: a wider float, a complex part, or an int
    beyond float16's 65504), or None: asked of what is put into a region or a weight. Nothing
    where the source type cannot exceed it; two reductions a part where everything fits; the
    mask only where something may not."""
    to = np.dtype(dtype)
    if not (array.size and to.kind in "fc" and array.dtype.kind in "iufc"):
        return None
    top = float(np.finfo(to).max)
    if float(np.iinfo(array.dtype).max if array.dtype.kind in "iu" else np.finfo(array.dtype).max) <= top:
        return None
    parts = (array.real, array.imag) if array.dtype.kind == "c" else (array,)
    if not any(np.fmax.reduce(p, axis=None) > top or np.fmin.reduce(p, axis=None) < -top for p in parts):
        return None
    over = np.zeros(array.shape, bool)
    for p in parts:
        over |= (np.abs(p) > top) & np.isfinite(p)
    return tuple(int(k) for k in np.argwhere(over)[0]) if over.any() else None


def numeric_dtype(what: str, dtype) -> np.dtype:
    """`dtype` as a numpy dtype of numbers (bool, integers, floats, complex); anything else (strings,
    objects, dates) names `what` in a ValueError: the runtime's copies, folds and fills work on numbers."""
    dt = None if dtype is None else dtype_of_kind(dtype, "biufc")   # (numpy takes None for float64)
    if dt is None:
        raise ValueError(f"{what}: dtype must be numeric (bool, int, float or complex), got {dtype!r}")
    return dt


class Region:
    """A logical n-d tensor: shape, dtype and name. Data lives in the runtime's instances."""

    _next_uid = itertools.count()

    def __init__(self, shape: Sequence[int], dtype="float32", name: str | None = None):
        if name is not None and not isinstance(name, str):
            raise TypeError(f"region: name must be a string or None, got {type(name).__name__} {name!r}")
        shape = as_int_tuple(f"region {name!r} shape", shape, least=0)
        self.shape = shape
        self.dtype = numeric_dtype(f"region {name!r}" if name else "region", dtype)
        if math.prod(shape) * self.dtype.itemsize >= 1 << 63:
            raise ValueError(f"region {name!r}: shape {shape} of {self.dtype} is {math.prod(shape):.3g} elements, "
                             f"more bytes than an instance can index (2**63)")
        self.uid = next(Region._next_uid)
        self.name = name or f"region{self.uid}"
        self.rect = Rect.from_shape(shape)
        self._equal_partitions: dict[tuple[int, ...], Partition] = {}
        #: the running Runtime whose instances hold this region's data (a weak reference, set by
        #: its first launch on it): another open runtime would read zeros from its own instances
        self.owner = None

    def __repr__(self) -> str:
        return f"Region({self.name!r}, {self.dtype.name}{list(self.shape)})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return self.rect.volume * self.dtype.itemsize

    def check_rect(self, rect: Rect, what: str = "rect") -> None:
        """Raise a clear error unless `rect` is a box inside this region."""
        if not isinstance(rect, Rect):
            raise TypeError(f"{what} for {self!r} must be a Rect, got {type(rect).__name__}")
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in rect.lo + rect.hi):
            raise TypeError(f"{what} {rect!r} for {self!r} must have int bounds, got lo {rect.lo!r}, hi {rect.hi!r}")
        if rect.ndim != self.ndim:
            raise ValueError(f"{what} {rect!r} is {rect.ndim}-d but {self!r} is {self.ndim}-d")
        if not self.rect.contains(rect):
            raise ValueError(f"{what} {rect!r} lies outside {self!r} (bounds {self.rect!r})")

    def partition(self, degrees: Sequence[int]) -> "Partition":
        """The equal partition with `degrees` pieces per dimension (cached, so reuse is cheap)."""
        key = as_int_tuple(f"partition degrees of {self!r}", degrees)
        part = self._equal_partitions.get(key)
        if part is None:
            part = Partition.equal(self, key)
            self._equal_partitions[key] = part
        return part


def int_tuples(colors: list) -> bool:
    """Every color (or launch point) a tuple of Python ints, checked in C (as partitions keep them)."""
    return (set(map(type, colors)) == {tuple}
            and set(map(type, itertools.chain.from_iterable(colors))) <= {int})


def _inside(region: Region, rects: list) -> bool:
    """Every rect a non-empty Rect of the region's dims, with int bounds, inside its bounds ([0,
    shape)); False leaves the telling apart (and empty rects, which any region holds) to check_rect."""
    if not rects or set(map(type, rects)) != {Rect} or any(map(_EMPTY, rects)):
        return False
    los, his = list(map(_LO, rects)), list(map(_HI, rects))
    if set(map(len, los)) != {region.ndim} or not (int_tuples(los) and int_tuples(his)):
        return False
    if region.ndim == 0:
        return True
    return min(map(min, zip(*los))) >= 0 and all(map(operator.le, map(max, zip(*his)), region.shape))


_EMPTY, _LO, _HI = operator.attrgetter("_empty"), operator.attrgetter("lo"), operator.attrgetter("hi")


class Partition:
    """A map from colors to sub-rects of one region. Disjointness and completeness are computed."""

    def __init__(self, region: Region, rects: Mapping[Color, Rect], name: str | None = None):
        self.region = region
        colors, pieces = list(rects), list(rects.values())
        # the plans make thousands of partitions of 64 or more pieces a graph: both checks run
        # over all pieces at once in C, and only a partition that fails them is gone through
        # piece by piece (normalizing its colors, or naming the piece that does not fit)
        if not int_tuples(colors):
            colors = [as_int_tuple(f"color {color!r} of a partition of {region!r}",
                                   color if isinstance(color, tuple) else (color,)) for color in colors]
            if len(set(colors)) != len(colors):
                raise ValueError(f"a partition of {region!r} gives one color twice: {list(rects)!r} are colors "
                                 f"{colors!r}")
        if not _inside(region, pieces):
            for color, rect in zip(colors, pieces):
                region.check_rect(rect, f"sub-rect of color {color}")
        self.rects: dict[Color, Rect] = dict(zip(colors, pieces))
        self.name = name or f"{region.name}.part"

    @staticmethod
    def equal(region: Region, degrees: Sequence[int]) -> "Partition":
        """Tile a grid of `degrees` pieces per dimension; cuts at i*extent//degree, so tiles differ by at most 1."""
        degrees = as_int_tuple(f"partition degrees of {region!r}", degrees)
        if len(degrees) != region.ndim:
            raise ValueError(f"degrees {degrees} have {len(degrees)} entries but {region!r} is {region.ndim}-d")
        for d, (deg, ext) in enumerate(zip(degrees, region.shape)):
            if deg < 1 or deg > max(ext, 1):
                raise ValueError(f"degree {deg} in dim {d} does not fit extent {ext} of {region!r}")
        return Partition(region, equal_rects(region.shape, degrees), name=f"{region.name}.equal{list(degrees)}")

    @staticmethod
    def from_rects(region: Region, rects: Mapping[Color, Rect] | Iterable[Rect], name: str | None = None) -> "Partition":
        """A partition from explicit rects (a mapping, or a list colored 0, 1, ...); may be aliased."""
        if not isinstance(region, Region):
            raise TypeError(f"Partition.from_rects: partitions a Region, got {type(region).__name__} {region!r}")
        if not isinstance(rects, Mapping):
            rects = {(i,): r for i, r in enumerate(rects)}
        return Partition(region, rects, name)

    def alike(self, region: Region, name: str | None = None) -> "Partition":
        """This partition's pieces as a partition of `region`, whose bounds are this one's region's
        (a value's gradient, an optimizer state): the pieces were checked once, and are not
        again (a simulator's search makes thousands of plans, each a dozen such partitions)."""
        if region.rect != self.region.rect:
            raise ValueError(f"Partition.alike: {region!r} has bounds {region.rect!r}, but {self!r} is of "
                             f"{self.region.rect!r}")
        part = Partition.__new__(Partition)
        part.region, part.rects, part.name = region, self.rects, name or f"{region.name}.part"
        return part

    def __repr__(self) -> str:
        kind = "disjoint" if self.disjoint else "aliased"
        return f"Partition({self.name!r}, {len(self.rects)} {kind} pieces of {self.region!r})"

    def __getitem__(self, color) -> Rect:
        color = color if isinstance(color, tuple) else (color,)
        try:
            return self.rects[color]
        except KeyError:
            raise KeyError(f"color {color} is not in {self!r}; colors are {sorted(self.rects)[:8]}...") from None

    def __len__(self) -> int:
        return len(self.rects)

    def colors(self) -> list[Color]:
        return list(self.rects)

    @cached_property
    def key(self) -> tuple:
        """What identifies the partition where a replayed launch is checked to repeat: its region and
        its pieces by color (made when asked: the simulator's plans make thousands of partitions
        of 64 or more pieces, and sorting them was about a tenth of making one)."""
        return (self.region.uid, tuple(sorted(self.rects.items())))

    @cached_property
    def disjoint(self) -> bool:
        """No two sub-rects share a point (empty sub-rects share nothing)."""
        return pairwise_disjoint(self.rects.values())

    @property
    def aliased(self) -> bool:
        return not self.disjoint

    @cached_property
    def complete(self) -> bool:
        """The sub-rects cover every point of the region."""
        total = self.region.rect.volume
        if self.disjoint:
            return sum(r.volume for r in self.rects.values()) == total
        remaining = [self.region.rect]
        for r in self.rects.values():
            remaining = [p for q in remaining for p in q.subtract(r)]
            if not remaining:
                return True
        return not remaining
