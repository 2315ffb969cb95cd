"""Rect algebra properties, checked against explicit point sets."""
from hypothesis import given
from hypothesis import strategies as st

from taskrt import Rect
from taskrt.geometry import disjoint_cover, equal_rects


@st.composite
def rects(draw, ndim=None):
    n = ndim if ndim is not None else draw(st.integers(1, 3))
    lo = [draw(st.integers(-3, 5)) for _ in range(n)]
    hi = [draw(st.integers(-3, 8)) for _ in range(n)]
    return Rect.make(lo, hi)


@st.composite
def rect_pairs(draw):
    n = draw(st.integers(1, 3))
    return draw(rects(n)), draw(rects(n))


def points(r: Rect) -> set:
    return set(r.points()) if not r.empty else set()


@given(rect_pairs())
def test_intersection_is_common_points(pair):
    a, b = pair
    assert points(a.intersect(b)) == points(a) & points(b)
    assert a.overlaps(b) == bool(points(a) & points(b))


@given(rect_pairs())
def test_contains_matches_point_sets(pair):
    a, b = pair
    assert a.contains(b) == (points(b) <= points(a))


@given(st.one_of(rect_pairs(), st.tuples(rects(), rects())))
def test_equality_and_order_are_those_of_the_bounds(pair):
    a, b = pair
    same = Rect.make(a.lo, a.hi)
    assert a == same and hash(a) == hash(same) and not a != same
    assert (a == b) == ((a.lo, a.hi) == (b.lo, b.hi)) and (a != b) == ((a.lo, a.hi) != (b.lo, b.hi))
    assert (a < b) == ((a.lo, a.hi) < (b.lo, b.hi))
    assert a != (a.lo, a.hi) and not a == None  # noqa: E711 (a Rect equals only Rects)


@given(rects())
def test_volume_counts_points(r):
    assert r.volume == len(points(r))
    assert r.empty == (r.volume == 0)


@given(st.integers(1, 2).flatmap(lambda n: st.tuples(rects(n), st.lists(rects(n), max_size=4))))
def test_disjoint_cover_is_every_point_of_the_whole_once(case):
    """Checked by counting each point's covers (dropping the overlap test left two copies of one
    half taken for a cover of the whole)."""
    whole, pieces = case
    pieces = [p.intersect(whole) for p in pieces]   # (its contract: each piece lies inside)
    covers = [sum(q in points(p) for p in pieces) for q in points(whole)]
    assert disjoint_cover(pieces, whole) == all(c == 1 for c in covers)


def test_disjoint_cover_refuses_a_piece_twice():
    half = Rect((0,), (2,))
    assert not disjoint_cover([half, half], Rect((0,), (4,)))
    assert disjoint_cover([half, Rect((2,), (4,))], Rect((0,), (4,)))


@given(rect_pairs())
def test_subtract_gives_disjoint_cover_of_difference(pair):
    a, b = pair
    pieces = a.subtract(b)
    covered = [points(p) for p in pieces]
    assert set().union(*covered) == points(a) - points(b)
    assert sum(len(c) for c in covered) == len(points(a) - points(b))


@given(rect_pairs())
def test_union_bbox_holds_both(pair):
    a, b = pair
    box = a.union_bbox(b)
    assert box.contains(a) and box.contains(b)


def test_slices_relative_to_origin():
    r = Rect.make((2, 3), (4, 7))
    assert r.slices() == (slice(2, 4), slice(3, 7))
    assert r.slices((2, 0)) == (slice(0, 2), slice(3, 7))
    assert r.shape == (2, 4)


def test_mismatched_dimensions_name_both_rects():
    import pytest
    with pytest.raises(ValueError, match=r"Rect\(0:2\).*Rect\(0:1, 0:1\)"):
        Rect.make((0,), (2,)).intersect(Rect.make((0, 0), (1, 1)))
    with pytest.raises(ValueError, match="different dimensions"):
        Rect((0, 0), (1,))


@given(st.lists(st.tuples(st.integers(0, 9), st.integers(1, 4)), min_size=0, max_size=4))
def test_equal_rects_cut_each_dim_at_i_extent_over_degree_in_row_major_order(dims):
    """equal_rects against one color at a time: color c's box is [c[d]*ext//deg, (c[d]+1)*ext//deg)
    in every dim d, and the colors come in row-major order."""
    shape = tuple(ext for ext, _ in dims)
    degrees = tuple(max(1, min(deg, ext)) for ext, deg in dims)
    got = equal_rects(shape, degrees)
    colors = [()]
    for deg in degrees:
        colors = [c + (i,) for c in colors for i in range(deg)]
    assert list(got) == colors
    for color, rect in got.items():
        assert rect == Rect(tuple(c * e // d for c, e, d in zip(color, shape, degrees)),
                            tuple((c + 1) * e // d for c, e, d in zip(color, shape, degrees)))


def test_rect_bounds_are_int_tuples_refused_not_cast():
    import pytest
    with pytest.raises(TypeError, match=r"Rect lo and hi must be tuples of ints, got \[0, 0\] and \[4, 4\]"):
        Rect([0, 0], [4, 4])
    with pytest.raises(TypeError, match=r"Rect lo and hi must be tuples of ints, got 0 and 4"):
        Rect(0, 4)   # (object of type 'int' has no len())
    with pytest.raises(TypeError, match=r"Rect.make: hi must be ints, got float 2.7"):
        Rect.make((0,), (2.7,))
    with pytest.raises(TypeError, match=r"Rect.make: lo must be ints, got str '0'"):
        Rect.make(("0",), ("3",))
    with pytest.raises(ValueError, match=r"Rect.from_shape: shape must be >= 0, got -3"):
        Rect.from_shape((-3,))
    with pytest.raises(TypeError, match=r"got float 2.9"):
        Rect.from_shape((2.9,))
    assert Rect.make([0, 1], (2, 3)) == Rect((0, 1), (2, 3))
