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


ops = st.lists(st.tuples(st.sampled_from(["set", "set", "set", "del", "move", "query"]),
                         st.one_of(rects(), st.just(BOUNDS)), st.integers(0, 9)),
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
        elif kind == "move" and ref:
            # move_to_end is deleting the key and setting it again
            victim = list(ref)[value % len(ref)]
            m.move_to_end(victim, -value)
            del ref[victim]
            ref[victim] = -value
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


def test_a_moved_key_comes_last_with_or_without_the_grid():
    for size in (4, 64):   # below GRID_AT keys (scanned) and above (the grid)
        m = RectMap(Rect((0, 0), (size, 4)))
        for i in range(size):
            m[Rect((i, 0), (i + 1, 4))] = i
        query = Rect((1, 1), (3, 2))
        assert [v for _, v in m.overlapping(query)] == [1, 2]
        m.move_to_end(Rect((1, 0), (2, 4)), "moved")
        assert [v for _, v in m.overlapping(query)] == [2, "moved"]
        assert list(m.values())[-1] == "moved" and len(m) == size
        assert [v for _, v in m.overlapping(m.bounds)][-2:] == [size - 1, "moved"]
