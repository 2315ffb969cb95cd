"""Replay (Legion's tracing): analyze a repeated block of launches once, then re-issue its nodes.

`with rt.replay("step"):` marks a block. The first time (or whenever the region state at
entry differs from the recording's) the block is analyzed normally and recorded: its
launches' keys, its nodes with their preds inside the block, and the analysis state of
every region it touched at entry (without node ids) and at exit. Later entries whose
state matches replay the nodes without any dependence analysis: a fence node stands for
everything issued before the block, every root of the block waits on it, and the exit
state is installed with the block's fresh node ids (deferred: a state is made only when
something looks at it, and the next replay mostly does not). (A fence on just the nodes
that the touched regions' states name would let blocks on other regions overlap, but those
sets are not transitively reduced: each block would carry the sets of the blocks before it.)
A launch that differs from the recording stops the replay with a ReplayMismatch warning:
the launches replayed so far are re-analyzed (without making nodes again) and the block
goes on dynamically.

A block issued by `Runtime.issue_program` (taskrt/program.py) records its list of launches
too. When the same list comes back and the block replays, `reissue` makes every node of
the recording again in one loop over its flattened rows (`Recording.rows`) and hands them
to the executor in batches: the launches are not made, mapped or matched one by one. On many
ranks a rank makes only its own share of the rows, routed once per recording
(taskrt/mpi_routing.py `route_rows`).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from .launch import Future, FutureMap
from .taskgraph import CopyNode, TaskNode


#: nodes a replayed launch emits at a time: together, since each emit takes the executor's
#: lock, but not all of a huge launch at once, so that its first tasks can start meanwhile
EMIT_BATCH = 256


class ReplayMismatch(UserWarning):
    """A replayed block did not repeat the recorded launches; analysis fell back to dynamic."""


@dataclass
class Recording:
    name: str
    first_id: int
    begin_abstract: dict[int, tuple] = field(default_factory=dict)
    launch_keys: list[tuple] = field(default_factory=list)
    emitted: list[tuple] = field(default_factory=list)
    # filled by finish():
    templates: list[list[tuple]] = field(default_factory=list)
    regions: set[int] = field(default_factory=set)
    end_states: dict = field(default_factory=dict)
    replayable: bool = True
    #: regions whose state at exit has the state at entry's abstract (a steady-state step)
    steady: set[int] = field(default_factory=set)
    #: the launch list of an issue_program block (None for a `with` block), its launches'
    #: replication signatures, and the flattened rows that reissue makes nodes from
    program: object = None
    signatures: list = field(default_factory=list)
    #: (nodes emitted before it, launches issued before it, regions) of each Runtime.release
    #: inside the block (a replay's releases are compared with the last two)
    releases: list[tuple[int, int, tuple]] = field(default_factory=list)
    #: its regions' release marks after its last run, recorded or replayed: one released since
    #: (outside the block) holds data gone where the block does not write it, which a replay's
    #: exit state would name as written at its fence, so the block records again
    marks: dict[int, int] = field(default_factory=dict)
    _rows: "Rows | None" = None

    def finish(self, analyzer, launch_ids: list[int]) -> None:
        """Turn what was emitted into per-launch templates with block-relative ids."""
        index = {node.id: i for i, (node, _) in enumerate(self.emitted)}
        by_launch = {lid: k for k, lid in enumerate(launch_ids)}
        # a task's point as its index in the launch's points (the launch key holds them)
        point_index = [{p: i for i, p in enumerate(key[2])} for key in self.launch_keys]
        self.templates = [[] for _ in launch_ids]
        for node, preds in self.emitted:
            inner = tuple(index[p] for p in preds if p in index)
            external = len(inner) < len(preds) or not inner
            slot = None
            if isinstance(node, TaskNode):
                slot = point_index[by_launch[node.launch]][node.point]
                self.regions.update(r.region.uid for r in node.reqs)
            else:
                self.regions.add(node.region.uid)
                if node.buffer is not None and node.buffer[0] not in index:
                    # folds a reduction made before the block: its buffer differs every time
                    self.replayable = False
            self.templates[by_launch[node.launch]].append((node, inner, external, slot))
        for _, _, regions in self.releases:   # (a region the block only releases is the block's too)
            self.regions.update(r.uid for r in regions)

        def encode(nid):
            if nid is None:
                return None
            return index.get(nid, -1)

        states = {uid: analyzer.lookup(uid) for uid in self.regions}
        if any(buffer[0] not in index for st in states.values() if st is not None
               for _, _, buffer, _, _ in st.pending):
            # a reduction made before the block is still pending after it: its buffer is that
            # task's, which a replay's exit state cannot name (it would name the fence)
            self.replayable = False
        self.end_states = {uid: st.remap(encode) for uid, st in states.items() if st is not None}
        self.begin_abstract = {uid: self.begin_abstract.get(uid) for uid in self.regions}
        self.steady = {uid for uid, st in self.end_states.items() if st.abstract() == self.begin_abstract[uid]}
        self.emitted = []

    def rows(self) -> "Rows":
        """The recording's nodes in issue order, with what reissue needs of each (made once)."""
        if self._rows is None:
            self._rows = Rows.of(self)
        return self._rows


@dataclass(frozen=True)
class Rows:
    """A program block's recorded nodes flattened in issue order (node i is the block's i-th
    node): per node (template, offsets of its preds in the block, whether it waits on the
    fence, its launch's index, its point's index in the launch (tasks) or its fold buffer
    task's offset (copies, -1: none)); the nodes no other node of the block waits for; and per
    launch whose futures are returned, the row of each of its points."""

    rows: tuple
    sinks: tuple[int, ...]
    any_external: bool
    returning: dict[int, tuple[int, ...]]
    _routed: dict = field(default_factory=dict, compare=False, repr=False)

    def routed(self, rank: int, size: int):
        """How rank `rank` of `size` submits the rows (taskrt/mpi_routing.py), made once."""
        routed = self._routed.get(rank)
        if routed is None:
            from .mpi_routing import route_rows
            routed = self._routed[rank] = route_rows(self.rows, rank, size)
        return routed

    @staticmethod
    def of(rec: Recording) -> "Rows":
        rows, waited = [], set()
        returns = {k for k, launch in enumerate(rec.program) if launch.returns}
        returning: dict[int, list] = {k: [None] * len(rec.launch_keys[k][2]) for k in returns}
        for k, templates in enumerate(rec.templates):
            for node, inner, external, slot in templates:
                if type(node) is not TaskNode:
                    slot = -1 if node.buffer is None else node.buffer[0] - rec.first_id
                elif k in returning:
                    returning[k][slot] = len(rows)
                rows.append((node, inner, external, k, slot))
                waited.update(inner)
        sinks = tuple(i for i in range(len(rows)) if i not in waited)
        return Rows(tuple(rows), sinks, any(r[2] for r in rows), {k: tuple(v) for k, v in returning.items()})


class ReplayBlock:
    """One `with rt.replay(name)` entry: recording, replaying, or fallen back to dynamic."""

    def __init__(self, runtime, name: str):
        self.rt = runtime
        self.name = name
        self.mode = "dynamic"
        self.recording: Recording | None = None
        self.launch_ids: list[int] = []
        self.specs: list = []
        self.new_ids: list[int] | range = []
        self.fence_id: int | None = None
        #: the launch list when issue_program runs the block; whether reissue made its nodes
        self.program = None
        self.reissued = False
        #: while replaying, the releases made so far: (launches issued before it, regions, node
        #: id it starts at), and each released region's release mark before the block's first
        self.releases: list[tuple[int, tuple, int]] = []
        self.released_before: dict[int, int | None] = {}

    # ---- entering and leaving ----------------------------------------------------------
    def __enter__(self):
        rt = self.rt
        rt._issuing.acquire()   # (through the block: no other thread's launch falls inside it)
        try:
            return self._enter()
        except BaseException:
            rt._issuing.release()
            raise

    def _enter(self):
        rt = self.rt
        if rt._replay is not None:
            raise RuntimeError(f"replay block {self.name!r} opened inside replay block {rt._replay.name!r}")
        rec = rt._recordings.get(self.name)
        if rec is not None and rec.replayable and not _released_since(rt, rec) \
                and all(_unchanged_since_replay(rt, rec, uid) or _abstract(rt, uid) == rec.begin_abstract[uid]
                        for uid in rec.regions):
            self.mode = "replaying"
            self.recording = rec
            self.fence_id = rt._emit_fence(f"replay-fence:{self.name}")
            rt.replay_stats["replayed"] += 1
        else:
            self.mode = "recording"
            self.recording = Recording(self.name, rt._next_id, rt.analyzer.abstracts())
            rt.analyzer.entry_from, rt.analyzer.entry_reads = rt._next_id, set()
            rt.replay_stats["recorded"] += 1
        rt._replay = self
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            return self._exit(exc_type)
        finally:
            self.rt._issuing.release()

    def _exit(self, exc_type) -> bool:
        rt = self.rt
        rt._replay = None
        rt.analyzer.entry_from = None
        if exc_type is not None and not self.reissued:
            # a recording made so far is dropped (its launches were analyzed as they came); the
            # launches replayed so far were not analyzed, and the launches after must see them
            if self.mode == "replaying":
                self._fall_back(f"the block raised {exc_type.__name__}")
            return False
        if self.mode == "recording":
            self.recording.program = self.program
            self.recording.finish(rt.analyzer, self.launch_ids)
            if rt.analyzer.entry_reads & {r.uid for _, _, regions in self.recording.releases for r in regions}:
                self.recording.replayable = False   # (it reads data from before it, then lets it go)
            rt._recordings[self.name] = self.recording
        elif self.mode == "replaying":
            if self.reissued:
                self._install_end_state()
            elif len(self.specs) != len(self.recording.launch_keys):
                self._fall_back(f"the block ended after {len(self.specs)} launches; the recording has "
                                f"{len(self.recording.launch_keys)}")
            elif len(self.releases) != len(self.recording.releases):
                self._fall_back(f"the block made {len(self.releases)} releases; the recording has "
                                f"{len(self.recording.releases)}")
            else:
                if self.program is not None and self.program is not self.recording.program:
                    # launch by launch the same as the recording: next time reissue it
                    self.recording.program, self.recording._rows = self.program, None
                self._install_end_state()
        rec = rt._recordings.get(self.name)
        if rec is not None:
            released = rt.analyzer.released
            rec.marks = {uid: released[uid] for uid in rec.regions if uid in released} if released else {}
        return False

    # ---- issuing launches ----------------------------------------------------------------
    def on_emit(self, node, preds) -> None:
        if self.mode == "recording":
            self.recording.emitted.append((node, preds))

    def on_release(self, regions) -> None:
        """Called by Runtime.release before the release takes effect."""
        if self.mode == "recording":
            self.recording.releases.append((len(self.recording.emitted), len(self.launch_ids), tuple(regions)))
        elif self.mode == "replaying":   # (for _fall_back, which re-analyzes around them)
            recorded = self.recording.releases
            k = len(self.releases)
            if k >= len(recorded) or recorded[k][1:] != (len(self.specs), tuple(regions)):
                self._fall_back(f"a release of {', '.join(repr(r.name) for r in regions)} after launch "
                                f"#{len(self.specs)} that the recording does not make there")
                return
            released = self.rt.analyzer.released
            for region in regions:
                self.released_before.setdefault(region.uid, released.get(region.uid))
            self.releases.append((len(self.specs), tuple(regions), self.rt._next_id))

    def issue(self, spec) -> None:
        """Called by the runtime for each launch inside the block."""
        rt = self.rt
        if self.mode == "recording":
            self.recording.launch_keys.append(spec.key())
            self.recording.signatures.append(spec.signature)
            self.launch_ids.append(spec.launch_id)
            rt._analyze(spec)
            return
        if self.mode == "dynamic":
            rt._analyze(spec)
            return
        k = len(self.specs)
        keys = self.recording.launch_keys
        if k >= len(keys) or keys[k] != spec.key():
            what = f"launch #{k} {spec.name!r}"
            if k >= len(keys):
                recorded = "nothing"
            else:
                parts = ("task function", "name", "launch domain", "requirements", "processors")
                differ = [p for p, a, b in zip(parts, keys[k], spec.key()) if a != b]
                recorded = f"{keys[k][1]!r} with another {', '.join(differ)}"
            self._fall_back(f"{what} does not match the recording, which has {recorded} there")
            rt._analyze(spec)
            return
        self.specs.append(spec)
        self._instantiate(k, spec)

    def _instantiate(self, k: int, spec) -> None:
        """Launch k's recorded nodes with fresh ids, this launch's args and futures, emitted together."""
        rt = self.rt
        new_ids, fence, first = self.new_ids, self.fence_id, self.recording.first_id
        items = []
        for node, inner, external, i in self.recording.templates[k]:
            nid = rt._new_id()
            new_ids.append(nid)
            preds = [new_ids[j] for j in inner]
            if external:
                preds.append(fence)
            if type(node) is TaskNode:
                fut = spec.futures[i]
                new = TaskNode(nid, node.name, node.proc, node.fn, node.reqs, spec.args[i], node.point,
                               spec.launch_id, node.op, node.kind, fut)
                fut.node_id = nid
                preds.extend(spec.extra_preds[i])
            else:
                buf = None if node.buffer is None else (new_ids[node.buffer[0] - first], node.buffer[1])
                new = CopyNode(nid, node.region, node.rect, node.src, node.dst, node.redop, buf, spec.launch_id,
                               node.op)
            items.append((new, tuple(preds)))
            if len(items) == EMIT_BATCH:
                rt._emit_many(items)
                items = []
        rt._emit_many(items)

    def can_reissue(self, launches) -> bool:
        """Whether this entry replays a recording made of this very launch list."""
        return self.mode == "replaying" and self.recording.program is launches

    def reissue(self, args) -> list:
        """Make every node of the recorded program again, with fresh ids, args[k] for launch
        k's tasks and futures for its returning launches, emitted in batches; the FutureMaps
        (None for launches that do not return)."""
        rt, rec = self.rt, self.recording
        rows = rec.rows()
        fence = self.fence_id
        base = rt._next_id
        rt._next_id += len(rows.rows)
        self.new_ids = range(base, base + len(rows.rows))
        first_launch = rt._launch_count
        rt._launch_count += len(rec.launch_keys)
        # before the nodes: each node finds its generation
        gens = [rt._start_generation(regions, base + count) for count, _, regions in rec.releases]
        transport = rt.transport
        if transport is not None:
            transport.on_signatures(rec.signatures)
        futures: dict[int, list] = {}
        out: list = [None] * len(rec.launch_keys)
        for k, task_rows in rows.returning.items():
            _, _, points, _, procs = rec.launch_keys[k]
            futures[k] = [Future(rt, base + i, proc.rank) for proc, i in zip(procs, task_rows)]
            out[k] = FutureMap(dict(zip(points, futures[k])))

        def make(i: int):
            """Row i's node, with id base + i."""
            node, _, _, k, slot = rows.rows[i]
            if type(node) is TaskNode:
                return TaskNode(base + i, node.name, node.proc, node.fn, node.reqs, args[k], node.point,
                                first_launch + k, node.op, node.kind, futures[k][slot] if k in futures else None)
            return CopyNode(base + i, node.region, node.rect, node.src, node.dst, node.redop,
                            None if slot < 0 else (base + slot, node.buffer[1]), first_launch + k, node.op)

        offset = base.__add__
        if transport is not None and not rt.graph.keep:
            # only this rank's share of the rows, routed once per recording (mpi_routing.route_rows)
            transport.submit_rows(rows.rows, rows.routed(transport.rank, transport.size), base, fence, make,
                                  rt.tracer)
        else:
            items = []
            for i, (_, inner, external, _, _) in enumerate(rows.rows):
                preds = tuple(map(offset, inner))
                items.append((make(i), preds + (fence,) if external else preds))
                if len(items) == EMIT_BATCH:
                    rt._emit_many(items, sinks=False)
                    items = []
            rt._emit_many(items, sinks=False)
        rt._add_sinks(map(offset, rows.sinks), fence if rows.any_external else None)
        # after the nodes: collection counts on them being submitted
        for (count, _, regions), ended in zip(rec.releases, gens):
            rt._collect_when_done(regions, base + count, ended)
        self.reissued = True
        rt.replay_stats["reissued"] += 1
        return out

    def _install_end_state(self) -> None:
        rt, fence = self.rt, self.fence_id

        def decode(e):
            if e is None:
                return None
            return fence if e < 0 else self.new_ids[e]

        for uid, st in self.recording.end_states.items():
            rt.analyzer.defer(uid, st, decode)

    def _fall_back(self, why: str) -> None:
        """Re-analyze the launches replayed so far onto the nodes already issued, then go dynamic."""
        warnings.warn(ReplayMismatch(f"replay {self.name!r}: {why}; falling back to dynamic analysis "
                                     "and recording the block again next time"), stacklevel=4)
        rt = self.rt
        rt.replay_stats["mismatches"] += 1
        ids = iter(self.new_ids)
        analyzer = rt.analyzer
        saved = analyzer.new_id, analyzer.emit
        analyzer.new_id, analyzer.emit = (lambda: next(ids)), (lambda node, preds: None)
        released = analyzer.released
        after = {uid: released.get(uid) for uid in self.released_before}
        _set_marks(released, self.released_before)   # each release again where it came, below
        try:
            upcoming = iter(self.releases)
            release = next(upcoming, None)
            for k, spec in enumerate(self.specs):
                while release is not None and release[0] <= k:
                    _set_marks(released, {region.uid: release[2] for region in release[1]})
                    release = next(upcoming, None)
                rt._analyze(spec, shadow=True)
        finally:
            analyzer.new_id, analyzer.emit = saved
            _set_marks(released, after)
        rt._recordings.pop(self.name, None)
        self.mode = "dynamic"


def _set_marks(released: dict, marks: dict) -> None:
    """Set each region's release mark (the analyzer's `released`; None: no release)."""
    for uid, at in marks.items():
        if at is None:
            released.pop(uid, None)
        else:
            released[uid] = at


def _released_since(rt, rec: Recording) -> bool:
    """Whether a region the block touches was released since its last run: a replay would read
    gone data unchecked, or name it as written at its fence."""
    released = rt.analyzer.released
    if not released and not rec.marks:
        return False
    return any(released.get(uid) != rec.marks.get(uid) for uid in rec.regions)


def _unchanged_since_replay(rt, rec: Recording, uid: int) -> bool:
    """Whether region uid still holds, unlooked-at, the state the recording's last replay
    installed, and that state is the one the recording starts from: no need to compare abstracts."""
    deferred = rt.analyzer.deferred.get(uid)
    return deferred is not None and uid in rec.steady and deferred[0] is rec.end_states[uid]


def _abstract(rt, uid: int):
    """Region uid's abstract, as the entry check compares it with the recording's (one place, so
    tests can count the comparisons)."""
    return rt.analyzer.abstract(uid)
