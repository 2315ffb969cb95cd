"""Dependence and coherence analysis: turns requirements, in program order, into graph nodes.

For every region the analysis keeps one RegionState:

- users:   rect -> [(privilege, node id)]  who touched which rect since it was last overwritten
           (logical dependences: RAW, WAR, WAW; reads commute, same-op reductions commute);
- pieces:  rect -> {memory: producer id}   disjoint rects and the memories holding valid
           data for each, with the node that made it valid there (None: attached before any
           node). Rects in no piece were never written: they read as zeros everywhere;
- pending: [(rect, redop, buffer, memory, node id)]  reductions not yet folded.

users and pieces are RectMaps and pending a PendingFolds (a RectMap underneath), so an access
finds what overlaps it in the cells of a grid over the region, not by scanning everything:
graph building stays linear in its nodes when producers and readers split a region
differently (taskrt/rectmap.py).

An empty rect touches nothing and orders nothing.
A task's preds are the conflicting users that overlap it, plus the producers of the data
it uses in its own memory; when that data is valid only elsewhere, a CopyNode brings it
in first; pending reductions are folded (a CopyNode with redop) before any access that
does not commute with them, and only the part of them that the access touches: the rest
stays pending for the next reader (Legion folds reduction instances per sub-rect the
same way), so readers of disjoint shards fold their shards in parallel and a weight
replicated over P devices is reduce-scattered. Node ids come in program order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from .geometry import Rect, pairwise_disjoint
from .machine import Memory, Processor
from .privilege import Privilege
from .rectmap import RectMap
from .region import Region
from .taskgraph import CopyNode, PhysicalReq, TaskNode

#: prune finished readers from a rect's user list once it grows past this length (and then each
#: time its length reaches a power of two)
USER_LIST_PRUNE_AT = 16


class PendingFolds:
    """A region's reductions not yet folded: (rect, redop, buffer, memory, node id) entries in
    program order, found by rect through a RectMap (a rect's entries under it by position).

    A position is a tuple: a new entry's is one past the last; the rest of a partly folded
    entry takes the entry's position plus its index among the rest, so it stays where the
    entry was in program order and iteration (sorted by position) sees the list the
    analysis describes."""

    __slots__ = ("_by_rect", "_count", "_next")

    def __init__(self, bounds: Rect | None = None, entries=()):
        self._by_rect = RectMap(bounds)
        self._count = 0
        self._next = 0
        for entry in entries:
            self.append(entry)

    def remap(self, f: Callable[[int | None], int | None]) -> "PendingFolds":
        """A copy with every node id passed through f."""
        if not self._count:
            return PendingFolds(self._by_rect.bounds)
        return PendingFolds(self._by_rect.bounds, [(r, op, (f(b[0]), b[1]), m, f(n)) for r, op, b, m, n in self])

    def append(self, entry: tuple, position: tuple | None = None) -> None:
        if position is None:
            position = (self._next,)
            self._next += 1
        bucket = self._by_rect.get(entry[0])
        if bucket is None:
            bucket = self._by_rect[entry[0]] = {}
        bucket[position] = entry
        self._count += 1

    def remove(self, position: tuple, entry: tuple) -> None:
        bucket = self._by_rect[entry[0]]
        del bucket[position]
        if not bucket:
            del self._by_rect[entry[0]]
        self._count -= 1

    def overlapping(self, rect: Rect) -> list[tuple[tuple, tuple]]:
        """(position, entry) of the entries whose rect overlaps `rect`, in program order."""
        return sorted((kv for _, bucket in self._by_rect.overlapping(rect) for kv in bucket.items()),
                      key=lambda kv: kv[0])

    def __iter__(self):
        return (e for _, e in sorted((kv for bucket in self._by_rect.values() for kv in bucket.items()),
                                     key=lambda kv: kv[0]))

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __repr__(self) -> str:
        return f"PendingFolds({self._count} entries)"


class Users:
    """Who touched one rect since it was last overwritten: the readers' node ids apart from the
    others' (privilege, node id), since a reader conflicts with none of the readers (a weight
    read by P tiles would otherwise be checked P times by each of them)."""

    __slots__ = ("reads", "others")

    def __init__(self, reads: list[int] | None = None, others: list[tuple[Privilege, int]] | None = None):
        self.reads = reads if reads is not None else []
        self.others = others if others is not None else []

    def __len__(self) -> int:
        return len(self.reads) + len(self.others)

    def __repr__(self) -> str:
        return f"Users(reads={self.reads}, others={self.others})"


@dataclass
class RegionState:
    users: RectMap = field(default_factory=RectMap)          # rect -> Users
    users_disjoint: bool = True
    pieces: RectMap = field(default_factory=RectMap)         # rect -> {memory: producer id}
    pending: PendingFolds = field(default_factory=PendingFolds)

    @staticmethod
    def of(region: Region) -> "RegionState":
        """An empty state whose maps index rects over the region's bounds."""
        return RegionState(RectMap(region.rect), True, RectMap(region.rect), PendingFolds(region.rect))

    def abstract(self) -> tuple:
        """The state without node ids: what decides which copies and folds a program makes."""
        pieces = tuple(sorted((r, tuple(sorted(v, key=str))) for r, v in self.pieces.items()))
        pending = tuple((r, op, m) for r, op, _, m, _ in self.pending)
        return pieces, pending

    def remap(self, f: Callable[[int | None], int | None]) -> "RegionState":
        """A copy with every node id passed through f."""
        return RegionState(
            users=RectMap(self.users.bounds, ((r, Users([f(n) for n in u.reads], [(p, f(n)) for p, n in u.others]))
                                              for r, u in self.users.items())),
            users_disjoint=self.users_disjoint,
            pieces=RectMap(self.pieces.bounds, ((r, {m: f(n) for m, n in v.items()}) for r, v in self.pieces.items())),
            pending=self.pending.remap(f),
        )


class Analyzer:
    """Builds nodes for tasks in program order. `new_id()` gives node ids; `emit(node, preds)`
    receives every node made; `is_done(id)` lets long reader lists forget finished nodes."""

    def __init__(self, new_id: Callable[[], int], emit: Callable, is_done: Callable[[int], bool] = lambda i: False):
        self.new_id = new_id
        self.emit = emit
        self.is_done = is_done
        self.states: dict[int, RegionState] = {}
        #: uid -> (a state with its node ids encoded, the decoding): the end states a replay
        #: installs, made real only when something looks at them (the next replay mostly does not)
        self.deferred: dict[int, tuple[RegionState, Callable]] = {}
        #: region uid -> the node id of its last release (Runtime.release): data made before it
        #: is gone, and reading it is refused
        self.released: dict[int, int] = {}
        #: while a replay block records (taskrt/replay.py): its first node id, and the regions
        #: it reads data of from before it (a block that then releases one is not replayed)
        self.entry_from: int | None = None
        self.entry_reads: set[int] = set()

    def state(self, region: Region) -> RegionState:
        st = self.states.get(region.uid)
        if st is None:
            st = self.lookup(region.uid)
            if st is None:
                st = self.states[region.uid] = RegionState.of(region)
        return st

    def lookup(self, uid: int) -> RegionState | None:
        """Region uid's state (made from its deferred one, if it has one), or None."""
        st = self.states.get(uid)
        if st is None and uid in self.deferred:
            encoded, decode = self.deferred.pop(uid)
            st = self.states[uid] = encoded.remap(decode)
        return st

    def defer(self, uid: int, encoded: RegionState, decode: Callable) -> None:
        """Region uid's state is encoded.remap(decode), made when first asked for."""
        self.states.pop(uid, None)
        self.deferred[uid] = (encoded, decode)

    def abstract(self, uid: int) -> tuple | None:
        """Region uid's state's abstract (without making a deferred state), or None."""
        deferred = self.deferred.get(uid)
        if deferred is not None:
            return deferred[0].abstract()
        st = self.states.get(uid)
        return None if st is None else st.abstract()

    def abstracts(self) -> dict[int, tuple]:
        """Every region's abstract, by uid."""
        return {uid: self.abstract(uid) for uid in [*self.states, *self.deferred]}

    # ---- the entry point -----------------------------------------------------------
    def add_task(self, name: str, proc: Processor, fn, reqs: list[tuple[Region, Rect, Privilege]],
                 args: tuple = (), point: tuple = (), launch: int = -1, extra_preds: Iterable[int] = (),
                 op: str = "", future=None) -> TaskNode:
        mem = proc.memory
        preds = set(extra_preds)
        for region, rect, priv in reqs:
            if rect.empty:
                continue
            st = self.state(region)
            if st.pending:
                self._flush(st, region, rect, priv, mem, preds, launch, op)
            self._logical_preds(st, rect, priv, preds)
            if not priv.is_reduce:
                self._physical_preds(st, region, rect, priv, mem, preds, launch, op)
        node = TaskNode(self.new_id(), name, proc, fn,
                        tuple(PhysicalReq(r, rect, p, mem) for r, rect, p in reqs), args, point, launch, op,
                        future=future)
        if future is not None:
            future.node_id = node.id
        self.emit(node, preds)
        for i, (region, rect, priv) in enumerate(reqs):
            if rect.empty:
                continue
            st = self.state(region)
            self._record_user(st, rect, priv, node.id)
            if priv.writes:
                self._set_valid(st, rect, {mem: node.id})
            elif priv.is_reduce:
                st.pending.append((rect, priv.redop, (node.id, i), mem, node.id))
        return node

    # ---- logical dependences ---------------------------------------------------------
    def _overlapping_users(self, st: RegionState, rect: Rect):
        if st.users_disjoint:
            lst = st.users.get(rect)
            if lst is not None:
                return ((rect, lst),)
        return st.users.overlapping(rect)

    def _logical_preds(self, st: RegionState, rect: Rect, priv: Privilege, preds: set) -> None:
        reading = priv.mode == "R"
        for _, users in self._overlapping_users(st, rect):
            if not reading:
                preds.update(users.reads)
            for p, n in users.others:
                if p.conflicts(priv):
                    preds.add(n)

    def _record_user(self, st: RegionState, rect: Rect, priv: Privilege, node_id: int) -> None:
        users = st.users
        if priv.writes:
            # a writer orders everything after it: users it covers need not be remembered
            over = [r for r, _ in self._overlapping_users(st, rect)]
            doomed = [r for r in over if r != rect and rect.contains(r)]
            for r in doomed:
                del users[r]
            if doomed and not st.users_disjoint:
                st.users_disjoint = pairwise_disjoint(users)
            overlaps_others = len(over) > len(doomed)  # (counts rect itself when it is a user already)
        else:
            known = users.get(rect)
            if known is not None:
                if priv.mode == "R":
                    known.reads.append(node_id)
                else:
                    known.others.append((priv, node_id))
                length = len(known)
                if length > USER_LIST_PRUNE_AT and length & (length - 1) == 0:
                    # at each power of two only, so that readers that are all still running (or
                    # never run: execute=False) cost O(1) an append, not O(length)
                    self._prune(known)
                return
            overlaps_others = st.users_disjoint and users.overlaps_any(rect)
        if rect not in users and st.users_disjoint and overlaps_others:
            st.users_disjoint = False
        users[rect] = Users([node_id]) if priv.mode == "R" else Users(None, [(priv, node_id)])

    def _prune(self, users: Users) -> None:
        """Forget finished users (keeping the last one when all have finished)."""
        done = self.is_done
        last = users.others[-1:] if users.others else None
        reads = [n for n in users.reads if not done(n)]
        others = [(p, n) for p, n in users.others if not done(n)]
        if not reads and not others:
            if last is not None:
                others = last
            else:
                reads = users.reads[-1:]
        users.reads, users.others = reads, others

    # ---- coherence: where valid data lives ---------------------------------------------
    def _overlapping_pieces(self, st: RegionState, rect: Rect):
        v = st.pieces.get(rect)
        if v is not None:
            return [(rect, v)]
        return st.pieces.overlapping(rect)

    def _physical_preds(self, st, region, rect, priv, mem, preds, launch, op) -> None:
        """Depend on whoever made the data valid in `mem`; copy it in first if it is valid elsewhere."""
        released = self.released.get(region.uid) if priv.reads else None
        entry_from = self.entry_from if priv.reads else None
        for prect, valid in self._overlapping_pieces(st, rect):
            if released is not None and _gone(valid, released):
                raise _read_after_release(region, prect, released, launch, op)
            if entry_from is not None and _gone(valid, entry_from):
                self.entry_reads.add(region.uid)
            if mem in valid:
                producer = valid[mem]
                if producer is not None:
                    preds.add(producer)
            elif priv.reads:
                whole = rect.contains(prect)   # (mostly: a reader of a whole weight, of a halo)
                inter = prect if whole else prect.intersect(rect)
                src = choose_source(valid, mem)
                copy = CopyNode(self.new_id(), region, inter, src, mem, launch=launch, op=op)
                self.emit(copy, () if valid[src] is None else (valid[src],))
                if whole:
                    st.pieces.move_to_end(prect, {**valid, mem: copy.id})
                else:
                    del st.pieces[prect]
                    for rest in prect.subtract(inter):
                        st.pieces[rest] = dict(valid)
                    st.pieces[inter] = {**valid, mem: copy.id}
                preds.add(copy.id)

    def has_pending(self, uid: int) -> bool:
        """Whether region uid has reductions not yet folded (without making a deferred state)."""
        deferred = self.deferred.get(uid)
        st = deferred[0] if deferred is not None else self.states.get(uid)
        return st is not None and bool(st.pending)

    def drop_pending(self, region: Region) -> list[tuple[tuple[int, int], Rect]]:
        """Forget the region's reductions not yet folded (it is released: nobody will read them);
        (buffer key, rect) of each part dropped (a partly folded buffer has its other parts' folds
        issued already)."""
        st = self.state(region)
        parts = [(buffer, rect) for rect, _, buffer, _, _ in st.pending]
        if parts:
            st.pending = PendingFolds(region.rect)
        return parts

    def check_released(self, region: Region, rect: Rect, launch: int, op: str) -> None:
        """Refuse a read of `rect` where the region holds only data from before its release: what
        _physical_preds refuses, asked of every point of a launch before any is analyzed, so that a
        refused launch issues nothing."""
        released = self.released.get(region.uid)
        if released is None or rect.empty:
            return
        for prect, valid in self._overlapping_pieces(self.state(region), rect):
            if _gone(valid, released):
                raise _read_after_release(region, prect, released, launch, op)

    def _set_valid(self, st: RegionState, rect: Rect, valid: dict) -> None:
        if rect not in st.pieces:
            for prect, old in self._overlapping_pieces(st, rect):
                del st.pieces[prect]
                for rest in prect.subtract(rect):
                    st.pieces[rest] = old
        st.pieces[rect] = valid

    def _flush(self, st, region, rect, priv, mem, preds, launch, op) -> None:
        """Fold every pending reduction that overlaps `rect` and does not commute with `priv`
        into `mem`, in program order; the accessing task waits for the folds."""
        pending = st.pending
        for position, entry in pending.overlapping(rect):
            prect, redop, buffer, rmem, rnode = entry
            if priv.is_reduce and priv.redop == redop:
                continue
            part = prect.intersect(rect)
            fold_preds = {rnode}
            self._physical_preds(st, region, part, _FOLD_TARGET, mem, fold_preds, launch, op)
            fold = CopyNode(self.new_id(), region, part, rmem, mem, redop=redop, buffer=buffer, launch=launch, op=op)
            self.emit(fold, fold_preds)
            self._set_valid(st, part, {mem: fold.id})
            # the fold writes part in mem: later writers elsewhere must follow it too, or a
            # copy back into mem could land before the fold's stale write (WAW in mem)
            self._record_user(st, part, _FOLD_TARGET, fold.id)
            preds.add(fold.id)
            # the rest of the buffer stays pending, in its place in program order, for
            # whoever reads it next (so each reader of a shard folds only that shard)
            pending.remove(position, entry)
            for i, rest in enumerate(prect.subtract(part)):
                pending.append((rest, redop, buffer, rmem, rnode), position + (i,))


_FOLD_TARGET = Privilege("RW")


def _gone(valid: dict, released: int) -> bool:
    """Whether a piece's valid copies were all made before the release at node `released`."""
    return max((n for n in valid.values() if n is not None), default=-1) < released


def _read_after_release(region: Region, rect: Rect, released: int, launch: int, op: str) -> RuntimeError:
    by = f"launch #{launch}" + (f" of op {op!r}" if op else "")
    return RuntimeError(f"{region!r} {rect!r} is read by {by} after its Runtime.release at node #{released} with "
                        f"nothing written into it since: that data is gone")


def choose_source(valid: dict[Memory, int | None], dst: Memory) -> Memory:
    """Where to copy from: the memory that made the data valid first (a piece's writer comes
    first in `valid`), on whatever rank, so the readers of a shard all copy from its owner
    and no memory that copied it before them becomes a hot spot (weights all-gather evenly).
    Deterministic, so every rank of a replicated program picks the same source."""
    return next(iter(valid))
