"""Peak memory's union of rects, against counting the points."""
from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from strategies.memory import union_volume
from taskrt import Rect


def points(rects) -> set:
    """Every point of the rects, one by one."""
    return {p for r in rects for p in itertools.product(*(range(a, b) for a, b in zip(r.lo, r.hi)))}


@st.composite
def rect_lists(draw):
    ndim = draw(st.integers(1, 3))
    bounds = st.tuples(st.integers(0, 5), st.integers(0, 5))
    out = []
    for _ in range(draw(st.integers(1, 5))):
        dims = [sorted(draw(bounds)) for _ in range(ndim)]
        if draw(st.booleans()):   # some empty ones
            dims[0] = [dims[0][0], dims[0][0]]
        out.append(Rect(tuple(a for a, _ in dims), tuple(b for _, b in dims)))
    if draw(st.booleans()):   # a repeated rect
        out.append(out[0])
    return out


@settings(max_examples=300, deadline=None)
@given(rects=rect_lists())
def test_union_volume_counts_each_point_once(rects):
    assert union_volume(rects) == len(points(rects))
