"""Regions and partitions: equal tilings cover exactly once; aliasing is computed."""
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from taskrt import Partition, Rect, Region


@st.composite
def shapes_and_degrees(draw):
    n = draw(st.integers(1, 3))
    shape = [draw(st.integers(1, 9)) for _ in range(n)]
    degrees = [draw(st.integers(1, s)) for s in shape]
    return shape, degrees


@given(shapes_and_degrees())
def test_equal_partition_covers_every_point_once(sd):
    shape, degrees = sd
    region = Region(shape)
    part = Partition.equal(region, degrees)
    count = np.zeros(shape, int)
    for rect in part.rects.values():
        assert not rect.empty
        count[rect.slices()] += 1
    assert (count == 1).all()
    assert part.disjoint and part.complete
    assert len(part) == int(np.prod(degrees))
    sizes = {d: {r.shape[d] for r in part.rects.values()} for d in range(len(shape))}
    assert all(max(s) - min(s) <= 1 for s in sizes.values())


@given(shapes_and_degrees(), st.integers(1, 3))
def test_halo_partitions_are_aliased(sd, halo):
    shape, degrees = sd
    region = Region(shape)
    part = Partition.equal(region, degrees)
    grown = {c: Rect.make([max(0, a - halo) for a in r.lo], [min(s, b + halo) for b, s in zip(r.hi, shape)])
             for c, r in part.rects.items()}
    aliased = Partition(region, grown)
    expect_overlap = len(part) > 1
    assert aliased.aliased == expect_overlap
    assert aliased.complete


def test_incomplete_partition_is_found():
    region = Region((10,))
    part = Partition.from_rects(region, [Rect.make((0,), (4,)), Rect.make((6,), (10,))])
    assert part.disjoint and not part.complete


def test_partition_errors_name_the_problem():
    region = Region((4, 4), name="x")
    with pytest.raises(ValueError, match="outside Region\\('x'"):
        Partition.from_rects(region, [Rect.make((0, 0), (5, 4))])
    with pytest.raises(ValueError, match="degree 5 in dim 0 does not fit extent 4"):
        region.partition((5, 1))
    with pytest.raises(ValueError, match="3-d"):
        Partition.from_rects(region, [Rect.make((0, 0, 0), (1, 1, 1))])
    with pytest.raises(KeyError, match="color \\(9,\\)"):
        region.partition((2, 1))[9]
    with pytest.raises(ValueError, match=r"outside Region\('y'"):   # (a piece from -1: the check of lo was not tested)
        Partition.from_rects(Region((4,), name="y"), [Rect((-1,), (2,)), Rect((2,), (4,))])
    with pytest.raises(TypeError, match=r"Partition.from_rects: partitions a Region, got str 'x'"):
        Partition.from_rects("x", [Rect.make((0, 0), (1, 1))])   # (AttributeError: ... 'ndim')


@pytest.mark.parametrize("kwargs,error,match", [
    ({"shape": (4,), "dtype": None}, ValueError, r"region: dtype must be numeric .*, got None"),   # (it was float64)
    ({"shape": (2**70,)}, ValueError, r"region None: shape \(1180591620717411303424,\) of float32 is 1.18e\+21 "
                                      r"elements, more bytes than an instance can index"),
    ({"shape": (4,), "name": 5}, TypeError, r"region: name must be a string or None, got int 5"),
])
def test_region_arguments_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        Region(**kwargs)


def test_a_partition_alike_has_the_same_pieces_of_a_region_of_the_same_bounds():
    value, grad = Region((6, 4), name="w"), Region((6, 4), "float32", "w.grad")
    part = Partition.from_rects(value, [Rect.make((0, 0), (4, 4)), Rect.make((2, 0), (6, 4))], name="w.tiles")
    alike = part.alike(grad, "w.grad.tiles")
    assert alike.region is grad and alike.name == "w.grad.tiles"
    assert alike.rects == part.rects and alike.aliased and alike.complete
    assert alike.key == (grad.uid, part.key[1])
    with pytest.raises(ValueError, match="Partition.alike: Region\\('b'.* has bounds"):
        part.alike(Region((6, 5), name="b"))


def test_equal_partitions_are_cached():
    region = Region((8,))
    assert region.partition((4,)) is region.partition((4,))


def _checked_piece_by_piece(region, rects):
    """The reference: every color normalized to a tuple of ints and every piece checked alone."""
    out = {}
    for color, rect in rects.items():
        color = tuple(map(int, color)) if isinstance(color, tuple) else (int(color),)
        region.check_rect(rect, f"sub-rect of color {color}")
        out[color] = rect
    return out


@given(shape=st.lists(st.integers(0, 6), min_size=0, max_size=3),
       pieces=st.lists(st.tuples(st.lists(st.integers(-2, 8), min_size=0, max_size=4),
                                 st.lists(st.integers(-2, 8), min_size=0, max_size=4)), min_size=1, max_size=6),
       color_kind=st.sampled_from(["tuple", "int", "numpy"]))
def test_a_partition_checks_all_pieces_at_once_as_one_by_one(shape, pieces, color_kind):
    """Any pieces (out of bounds, empty, of other dims) and colors (tuples, ints, numpy ints): the
    partition holds what checking each piece alone gives, or raises the same error."""
    region = Region(shape, name="r")
    rects = {}
    for i, (lo, hi) in enumerate(pieces):
        n = min(len(lo), len(hi))
        color = {"tuple": (i, 0), "int": i, "numpy": (np.int64(i),)}[color_kind]
        rects[color] = Rect.make(lo[:n], hi[:n])
    try:
        expected = _checked_piece_by_piece(region, rects)
    except (TypeError, ValueError) as e:
        with pytest.raises(type(e), match=re.escape(str(e))):
            Partition(region, rects)
        return
    part = Partition(region, rects)
    assert part.rects == expected and all(type(v) is int for c in part.rects for v in c)


def test_rects_with_bounds_that_are_not_ints_are_refused():
    """A float rect used to pass every check and fail inside its task, stopping the runtime."""
    r = Region((8, 4), "float32", "r")
    with pytest.raises(TypeError, match=r"rect Rect\(0.5:4.5, 0:4\) for Region\('r'.* must have int bounds"):
        r.check_rect(Rect((0.5, 0), (4.5, 4)))
    with pytest.raises(TypeError, match=r"sub-rect of color \(0,\) Rect\(0.5:4.5, 0:4\) .* must have int bounds"):
        Partition.from_rects(r, [Rect((0.5, 0), (4.5, 4))])


def test_partition_colors_are_int_tuples_and_each_is_given_once():
    """Float colors were cast with int(), and two that met lost a piece without a word."""
    r = Region((4,), "float32", "r")
    with pytest.raises(TypeError, match=r"color \(0.2,\) of a partition .* must be ints, got float 0.2"):
        Partition.from_rects(r, {(0.2,): Rect((0,), (2,)), (0.7,): Rect((2,), (4,))})
    with pytest.raises(TypeError, match=r"color 'a' of a partition .* must be ints, got str 'a'"):
        Partition.from_rects(r, {"a": Rect((0,), (2,))})
    with pytest.raises(ValueError, match=r"gives one color twice"):
        Partition.from_rects(r, {0: Rect((0,), (2,)), (0,): Rect((2,), (4,))})
    assert Partition.from_rects(r, {np.int64(1): Rect((0,), (2,))}).colors() == [(1,)]
