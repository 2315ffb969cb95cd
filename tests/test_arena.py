"""strategies.arena: every placement finds each part's own arrays in the store, whatever was
placed before and however often the store was made again."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from strategies.arena import GROWTH, KEEP, Arena, columns_of


class Part:
    def __init__(self, columns: np.ndarray):
        self.columns = columns


def _pool(sizes, rows, seed):
    rng = np.random.default_rng(seed)
    return [Part(rng.integers(-50, 50, size=(rows, k))) for k in sizes]


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=12), picks=st.lists(
    st.lists(st.integers(0, 11), max_size=14), min_size=1, max_size=6), seed=st.integers(0, 2**16),
    least=st.sampled_from([1, 8, 4096]))
def test_each_placement_finds_each_parts_columns(sizes, picks, seed, least):
    pool = _pool(sizes, 3, seed)
    arena = Arena(3, np.int64, min_columns=least)   # a small store: made again often
    for pick in picks:
        parts = [pool[i % len(pool)] for i in pick]
        starts, counts = arena.place(parts, lambda p: p.columns)
        assert counts.tolist() == [p.columns.shape[1] for p in parts]
        for p, a, k in zip(parts, starts, counts):
            assert np.array_equal(arena.store[:, a:a + k], p.columns)
        joined = arena.store[:, columns_of(starts, counts)]
        expect = np.concatenate([p.columns for p in parts], axis=1) if parts else np.zeros((3, 0), np.int64)
        assert np.array_equal(joined, expect)


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(0, 9), min_size=2, max_size=12), length=st.integers(1, 10), changes=st.lists(
    st.lists(st.tuples(st.integers(0, 9), st.integers(0, 11)), max_size=3), min_size=1, max_size=8),
    seed=st.integers(0, 2**16), least=st.sampled_from([1, 8, 4096]))
def test_placements_that_change_a_few_places_of_the_last_find_each_parts_columns(sizes, length, changes, seed,
                                                                                   least):
    """A search's pattern: each graph is the last with a few parts swapped (the slots are then
    taken from the last placement where a part stands where it stood)."""
    pool = _pool(sizes, 2, seed)
    arena = Arena(2, np.int64, min_columns=least)
    parts = [pool[i % len(pool)] for i in range(length)]
    for change in [[]] + changes:
        for at, i in change:
            parts[at % length] = pool[i % len(pool)]
        starts, counts = arena.place(parts, lambda p: p.columns)
        joined = arena.store[:, columns_of(starts, counts)]
        assert np.array_equal(joined, np.concatenate([p.columns for p in parts], axis=1))


@settings(max_examples=80, deadline=None)
@given(sizes=st.lists(st.integers(0, 9), min_size=2, max_size=12), length=st.integers(1, 10), changes=st.lists(
    st.tuples(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 11)), max_size=3), st.integers(0, 2),
              st.booleans()), min_size=1, max_size=8),
    seed=st.integers(0, 2**16), least=st.sampled_from([1, 8, 4096]))
def test_placements_told_what_changed_find_each_parts_columns(sizes, length, changes, seed, least):
    """With a delta (the builder's pattern: the indices that changed, parts added at the end), and
    with a stale one (a placement in between that was not told, or named otherwise: the parts are
    then compared)."""
    pool = _pool(sizes, 2, seed)
    arena = Arena(2, np.int64, min_columns=least)
    parts = [pool[i % len(pool)] for i in range(length)]
    arena.place(parts, lambda p: p.columns, (None, 0, []))
    name = 0
    for change, grow, stale in changes:
        at = sorted({a % len(parts) for a, _ in change})
        for (a, i) in change:
            parts[a % len(parts)] = pool[i % len(pool)]
        parts += [pool[(name + k) % len(pool)] for k in range(grow)]
        if stale:   # a placement the next delta does not know of
            other = [pool[(name + k + 1) % len(pool)] for k in range(len(parts))]
            arena.place(other, lambda p: p.columns)
        starts, counts = arena.place(parts, lambda p: p.columns, (name, name + 1, at))
        name += 1
        joined = arena.store[:, columns_of(starts, counts)]
        assert np.array_equal(joined, np.concatenate([p.columns for p in parts], axis=1))


def test_a_placement_told_what_changed_but_with_fewer_parts_than_the_last_compares_them():
    """A delta says where the parts differ, past the last placement's length all new: it cannot
    describe a shorter placement, which is compared part by part (taken as a delta, the last
    placement's slots did not fit its length)."""
    pool = _pool([3, 2, 4, 1], 2, 0)
    arena = Arena(2, np.int64)
    arena.place(pool[:3], lambda p: p.columns, (None, 0, []))
    starts, counts = arena.place([pool[3], pool[0]], lambda p: p.columns, (0, 1, [0]))
    assert np.array_equal(arena.store[:, columns_of(starts, counts)],
                          np.concatenate([pool[3].columns, pool[0].columns], axis=1))


def test_only_parts_not_placed_are_asked_for_and_a_rebuild_keeps_only_the_last_placement():
    a, b, c, d = (Part(np.full((2, k), k)) for k in (1, 2, 3, 4))
    arena = Arena(2, np.float64, min_columns=6)
    asked = []
    arena.place([a, b, a], lambda p: asked.append(p) or p.columns)
    arena.place([b, c, a], lambda p: asked.append(p) or p.columns)
    assert asked == [a, b, c] and arena.rebuilds == 0 and arena.used == 6
    starts, counts = arena.place([d, c], lambda p: asked.append(p) or p.columns)   # 10 > 6 columns: rebuilt
    assert asked == [a, b, c, d] and arena.rebuilds == 1
    # c stays first (it was placed), then d; the store of 6 columns had no room: made anew
    assert arena.used == 7 and arena.store.shape[1] == GROWTH * 7 and starts.tolist() == [3, 0]
    arena.place([a], lambda p: asked.append(p) or p.columns)   # a went in the rebuild: asked again
    assert asked == [a, b, c, d, a]


def test_a_rebuild_moves_the_kept_parts_down_in_place_while_the_store_has_room():
    """Kept parts move down in the order they stand in the store, whatever the placement's order:
    moved in another order, one would overwrite another before it moved."""
    rng = np.random.default_rng(0)
    f1, p1, p2, p3, f2, fresh = (Part(rng.standard_normal((2, k))) for k in (5, 5, 30, 12, 60, 9))
    arena = Arena(2, np.float64, min_columns=120)
    for part in (f1, p1, p2, p3, f2):   # 112 of 120 columns, p1 at 5, p2 at 10, p3 at 40
        arena.place([part], lambda p: p.columns)
    before = arena.store
    starts, counts = arena.place([p2, p3, p1, fresh], lambda p: p.columns)   # 9 more do not fit
    assert arena.rebuilds == 1 and arena.store is before and KEEP * 56 <= 120
    assert starts.tolist() == [5, 35, 0, 47] and arena.used == 56
    for p, s, k in zip([p2, p3, p1, fresh], starts, counts):
        assert np.array_equal(arena.store[:, s:s + k], p.columns)


def test_a_part_of_the_wrong_shape_is_refused():
    arena = Arena(2, np.int64)
    with pytest.raises(ValueError, match=r"2 x k, got shape \(3, 1\)"):
        arena.place([Part(np.zeros((3, 1), np.int64))], lambda p: p.columns)
