"""A dict keyed by rects that finds the keys overlapping a rect without scanning them all.

The analysis asks of every access which pieces of a region, and which earlier users, overlap
the accessed rect. A region split by a producer one way and by its readers another holds
many pieces (their intersections), and scanning them on every access made graph building
grow with the square of the device count. Past `GRID_AT` keys, a RectMap also files each key
under the cells of a coarse grid over the region that it covers, with cells along the dims
its keys are cut in; a query then looks only at the keys filed under its own cells.

The grid is built on the first query once the map is that large. Iteration and
`overlapping` keep insertion order (as a dict does: re-assigning a key keeps
its place, deleting and adding it again moves it last), so what the analysis makes does not
depend on whether a map has its grid.
"""
from __future__ import annotations

import math

from .geometry import Rect

#: keys past which a map builds its grid; below, a scan is faster than the bookkeeping
GRID_AT = 24
#: the most grid cells a map has
MAX_CELLS = 1024


class RectMap:
    """Rect -> value, in insertion order, with `overlapping(rect)`; `bounds` is the region's rect."""

    __slots__ = ("bounds", "_items", "_order", "_seq", "_grid", "_cuts", "_dims", "_known")

    def __init__(self, bounds: Rect | None = None, items=()):
        self.bounds = bounds
        self._items: dict[Rect, object] = {}
        self._order: dict[Rect, int] = {}   # a key's place in insertion order, kept while there is a grid
        self._seq = 0
        self._grid: dict[int, set[Rect]] | None = None
        self._cuts: list[int] = []
        self._dims: list[tuple[int, int, int, int, int]] = []   # (dim, start, extent, cuts, stride) of cut dims
        self._known: dict[Rect, list[int]] = {}
        self._items = dict(items)

    # ---- the dict interface the analysis uses ---------------------------------------------------
    def __getitem__(self, rect: Rect):
        return self._items[rect]

    def get(self, rect: Rect, default=None):
        return self._items.get(rect, default)

    def __contains__(self, rect) -> bool:
        return rect in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)

    def items(self):
        return self._items.items()

    def keys(self):
        return self._items.keys()

    def values(self):
        return self._items.values()

    def __setitem__(self, rect: Rect, value) -> None:
        if self._grid is not None and rect not in self._items:
            self._order[rect] = self._seq
            self._seq += 1
            self._file(rect)
        self._items[rect] = value

    def move_to_end(self, rect: Rect, value) -> None:
        """Give key `rect` a new value and the last place in insertion order (what deleting it and
        adding it again does, without refiling it in the grid: its cells are the same)."""
        del self._items[rect]
        self._items[rect] = value
        if self._grid is not None:
            self._order[rect] = self._seq
            self._seq += 1

    def __delitem__(self, rect: Rect) -> None:
        del self._items[rect]
        if self._grid is not None:
            del self._order[rect]
            for cell in self._cells(rect):
                self._grid[cell].discard(rect)

    def __repr__(self) -> str:
        grid = f", grid {self._cuts}" if self._grid is not None else ""
        return f"RectMap({len(self._items)} rects{grid})"

    # ---- queries ------------------------------------------------------------------------------------
    def overlapping(self, rect: Rect) -> list[tuple[Rect, object]]:
        """(key, value) of every key that shares a point with `rect`, in insertion order."""
        items = self._items
        if rect == self.bounds:   # a whole region: every key but an empty one lies in it
            return [(r, v) for r, v in items.items() if not r.empty]
        if self._grid is None and not self._gridded():
            return [(r, v) for r, v in items.items() if r.overlaps(rect)]
        if rect.empty:
            return []
        cells = self._cells(rect)
        if len(cells) * 2 > len(self._grid) or len(cells) > len(items):
            return [(r, v) for r, v in items.items() if r.overlaps(rect)]
        grid = self._grid
        found = set()
        for cell in cells:
            found.update(grid.get(cell, ()))
        hits = [r for r in found if r.overlaps(rect)]
        hits.sort(key=self._order.__getitem__)
        return [(r, items[r]) for r in hits]

    def overlaps_any(self, rect: Rect) -> bool:
        """Whether some key shares a point with `rect`."""
        if self._grid is None and not self._gridded():
            return any(r.overlaps(rect) for r in self._items)
        grid = self._grid
        return any(r.overlaps(rect) for cell in self._cells(rect) for r in grid.get(cell, ()))

    # ---- the grid -------------------------------------------------------------------------------------
    def _gridded(self) -> bool:
        """Build the grid if the map has grown past GRID_AT keys (on the first query after, so a
        map that is only copied, as replay copies states, never pays for one); whether it has one."""
        if len(self._items) >= GRID_AT and self.bounds is not None and self.bounds.ndim:
            self._build_grid()
            return True
        return False

    def _build_grid(self) -> None:
        """Cells along the dims the keys are cut in (by how many distinct starts each dim has),
        at most MAX_CELLS in all, then every key filed."""
        bounds = self.bounds
        starts = [len({r.lo[d] for r in self._items}) for d in range(bounds.ndim)]
        cuts = [1] * bounds.ndim
        budget = MAX_CELLS
        for d in sorted(range(bounds.ndim), key=lambda d: -starts[d]):
            extent = bounds.hi[d] - bounds.lo[d]
            if starts[d] > 1:
                cuts[d] = max(1, min(extent, 2 * (1 << math.ceil(math.log2(starts[d]))), budget))
            budget = max(1, budget // cuts[d])
        self._cuts = cuts
        strides, s = [], 1
        for c in reversed(cuts):
            strides.append(s)
            s *= c
        strides.reverse()
        self._dims = [(d, bounds.lo[d], bounds.hi[d] - bounds.lo[d], cuts[d], strides[d])
                      for d in range(bounds.ndim) if cuts[d] > 1]
        self._known = {}
        self._grid = {}
        self._order = {r: i for i, r in enumerate(self._items)}   # the dict's order is insertion order
        self._seq = len(self._order)
        for r in self._items:
            self._file(r)

    def _file(self, rect: Rect) -> None:
        grid = self._grid
        for cell in self._cells(rect):
            bucket = grid.get(cell)
            if bucket is None:
                bucket = grid[cell] = set()
            bucket.add(rect)

    def _cells(self, rect: Rect) -> list[int]:
        """The grid cells a rect (inside the bounds) covers; none for an empty one. Kept per rect:
        the analysis asks about the same tiles again and again."""
        cells = self._known.get(rect)
        if cells is not None:
            return cells
        if rect.empty:
            return []
        cells = [0]
        lo, hi = rect.lo, rect.hi
        for d, start, extent, cuts, stride in self._dims:
            first = (lo[d] - start) * cuts // extent
            last = (hi[d] - 1 - start) * cuts // extent
            if first == last:
                cells = [c + first * stride for c in cells]
            else:
                cells = [c + k * stride for c in cells for k in range(first, last + 1)]
        self._known[rect] = cells
        return cells
