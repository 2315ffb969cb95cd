"""strategies.joined: a join equals concatenating every part's arrays, whatever the last join was."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies.joined import Joiner


class Part:
    def __init__(self, columns: np.ndarray):
        self.columns = columns


def _parts(draw_sizes, rows, seed):
    rng = np.random.default_rng(seed)
    return [Part(rng.integers(-50, 50, size=(rows, k))) for k in draw_sizes]


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 6), min_size=1, max_size=12), picks=st.lists(
    st.lists(st.integers(0, 11), max_size=14), min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_every_join_equals_the_concatenation(sizes, picks, seed):
    pool = _parts(sizes, 3, seed)
    joiner = Joiner(3, np.int64)
    for pick in picks:
        parts = [pool[i % len(pool)] for i in pick]
        joined, counts = joiner.join(parts, lambda p: p.columns)
        expect = np.concatenate([p.columns for p in parts], axis=1) if parts else np.zeros((3, 0), np.int64)
        assert np.array_equal(joined, expect)
        assert counts.tolist() == [p.columns.shape[1] for p in parts]


def test_only_parts_the_last_join_lacked_are_asked_for():
    a, b, c = (Part(np.full((2, k), k)) for k in (1, 2, 3))
    joiner = Joiner(2, np.float64)
    asked = []
    joiner.join([a, b], lambda p: asked.append(p) or p.columns)
    joiner.join([b, c, a], lambda p: asked.append(p) or p.columns)
    assert asked == [a, b, c]
    joined, _ = joiner.join([c], lambda p: asked.append(p) or p.columns)
    assert asked == [a, b, c] and joined.tolist() == [[3, 3, 3], [3, 3, 3]]


def test_a_part_of_the_wrong_shape_is_refused():
    joiner = Joiner(2, np.int64)
    with pytest.raises(ValueError, match=r"2 x k, got shape \(3, 1\)"):
        joiner.join([Part(np.zeros((3, 1), np.int64))], lambda p: p.columns)
