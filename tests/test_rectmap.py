"""RectMap answers like a dict scanned in insertion order, with or without its grid."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from taskrt.geometry import Rect
from taskrt.rectmap import GRID_AT, RectMap

BOUNDS = Rect((0, 0, 0), (12, 9, 5))


@st.composite
def rects(draw):
    lo, hi = [], []
    for extent in BOUNDS.hi:
        a = draw(st.integers(0, extent))
        b = draw(st.integers(a, extent))   # empty rects too
        lo.append(a)
        hi.append(b)
    return Rect(tuple(lo), tuple(hi))


ops = st.lists(st.tuples(st.sampled_from(["set", "set", "set", "del", "query"]), rects(), st.integers(0, 9)),
               min_size=1, max_size=4 * GRID_AT)


@settings(max_examples=150, deadline=None)
@given(steps=ops)
def test_a_rectmap_answers_as_a_scanned_dict(steps):
    m, ref = RectMap(BOUNDS), {}
    for kind, rect, value in steps:
        if kind == "set":
            m[rect] = value
            ref[rect] = value
        elif kind == "del" and ref:
            victim = list(ref)[value % len(ref)]
            del m[victim]
            del ref[victim]
        else:
            assert m.overlapping(rect) == [(r, v) for r, v in ref.items() if r.overlaps(rect)]
            assert m.overlaps_any(rect) == any(r.overlaps(rect) for r in ref)
        assert list(m.items()) == list(ref.items())
        assert len(m) == len(ref) and all(r in m for r in ref)


def test_a_large_map_looks_only_at_its_cells():
    m = RectMap(Rect((0, 0), (64, 64)))
    for i in range(64):
        for j in range(4):
            m[Rect((i, 16 * j), (i + 1, 16 * (j + 1)))] = (i, j)
    assert "grid" not in repr(m), "the grid is built on the first query, not while filling"
    got = m.overlapping(Rect((10, 20), (12, 40)))
    assert "grid" in repr(m)
    assert [v for _, v in got] == [(10, 1), (10, 2), (11, 1), (11, 2)]
    assert not m.overlaps_any(Rect((10, 20), (10, 40)))    # empty
