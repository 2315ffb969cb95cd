"""The executor: runs graph nodes on worker threads as their dependences finish.

Run state, all guarded by one lock:
- unfinished: node id -> node, for every node submitted and not yet finished;
- waiting:    node id -> number of unfinished preds, for nodes not yet ready;
- dependents: node id -> ids waiting on it;
- watched:    what threads in `wait_node` / `wait_all` wait for (a node id, or ALL) -> how
              many of them, so that a finish wakes a waiter only when it is what it waits for;
- below:      callbacks due once every node below an id has finished, all of them or those
              that touch one thing (an instance: Runtime.release's collections), and
              `touching`: per such thing, the ids submitted since `track_touches` that touch
              it, in order;
- poisoned:   ids of nodes that failed or depend on one that did (or was skipped), until
              they finish: each is skipped, not run; and `lost`, the ids of all of them since
              the last `forget_failure` (a node submitted after a pred of it was lost is
              poisoned at once).
After a failure only the nodes that depend on it are skipped: the others run, so that what
was issued before the failed node and does not need it (the last step's updates, say) lands.
A ready node goes to the queue of its worker: one thread per local processor (tasks)
and one per local memory (copies and folds into it). Workers call `run_task` /
`run_copy`, then `_finish`, which releases the dependents. Hooks get (node, start, end).
A run may return PENDING instead: it has started something (an MPI message) that ends
later, and whoever sees it end calls `complete(node, start)` (or `fail`), from any thread,
or `resume(node)` to run it again on its worker. Nodes of a type in `inline_types` whose
`inline` is true (cheap to start: posting a message) run in the thread that makes them
ready instead of waiting for their worker, in the order they became ready. A `Join` runs
nothing and has no worker: it finishes as soon as its preds have (Realm's merged event), in
the thread that readies it.
The executor does not know what a task computes, nor whether a copy crosses ranks:
`transport` (taskrt/mpi.py on many ranks) handles nodes that touch another rank.
`on_error`, when set, is called with the TaskError of the first failure.
"""
from __future__ import annotations

import bisect
import heapq
import queue
import threading
import time
import traceback
from collections import deque
from typing import Callable

from .taskgraph import TaskNode

#: returned by run_task / run_copy for a node that finishes later, through Executor.complete
PENDING = object()
#: what `wait_all` watches for in Executor.watched
ALL = "all"


class Join:
    """A node that runs nothing and is not traced: it finishes once its preds have. One
    node id standing for many (the MPI transport's remote nodes with many local ancestors)."""

    __slots__ = ("id",)

    def __init__(self, node_id: int):
        self.id = node_id

    def __repr__(self) -> str:
        return f"Join(#{self.id})"


class TaskError(RuntimeError):
    """A task raised: carries the task's name, point, processor and the original traceback."""

    def __init__(self, node, exc: BaseException, tb: str, rank: int = 0):
        self.node_name = node.name
        self.point = getattr(node, "point", None) or ()   # (a copy has none)
        self.original = exc
        self.traceback_text = tb
        where = getattr(node, "proc", None) or getattr(node, "dst", None)
        super().__init__(f"task {node.name!r} point {list(self.point)} on {where} (rank {rank}) raised "
                         f"{type(exc).__name__}: {exc}\n--- original traceback ---\n{tb}")


class Executor:
    def __init__(self, workers: list, run_task: Callable, run_copy: Callable,
                 hooks: list[Callable] | None = None, worker_setup: Callable | None = None, rank: int = 0):
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.unfinished: dict[int, object] = {}
        self.waiting: dict[int, int] = {}
        self.dependents: dict[int, list[int]] = {}
        self.error: TaskError | None = None
        self.poisoned: set[int] = set()
        self.lost: set[int] = set()
        self.watched: dict[object, int] = {}
        #: set by shutdown once the workers are gone: a wait for what they left unrun ends
        self.stopped = False
        self.run_task = run_task
        self.run_copy = run_copy
        self.hooks = hooks or []
        self.rank = rank
        self.on_error: Callable[[TaskError], None] | None = None
        #: called with each node that did not run to its end, on its worker, and whether it ran
        #: (and failed) or was skipped after a failure: to settle what it would have left for
        #: later nodes
        self.on_lost: Callable[[object, bool], None] | None = None
        self.inline_types: frozenset = frozenset()
        self._inline = threading.local()
        self.queues: dict[object, queue.SimpleQueue] = {}
        self.threads: list[threading.Thread] = []
        for w in workers:
            q = queue.SimpleQueue()
            self.queues[w] = q
            t = threading.Thread(target=self._worker, args=(w, q, worker_setup), name=f"taskrt-{w}", daemon=True)
            t.start()
            self.threads.append(t)
        self._thread_set = frozenset(self.threads)
        #: thing touched (None: anything) -> a heap of (threshold, order, fn): call fn once every
        #: node submitted here with an id below the threshold (that touches it) has finished
        #: (a heap is dropped once empty: no entry, no callback waits)
        self._below: dict[object, list[tuple[int, int, Callable]]] = {}
        self._below_count = 0
        #: every id below it that was submitted here has finished
        self._low = 0
        #: thing touched -> the unfinished ids (and some finished ones) submitted from id
        #: `_tracked_from` on that touch it, ascending; None until track_touches
        self._touching: dict[object, deque] | None = None
        self._tracked_from = 0
        self._touches: Callable | None = None
        #: node id -> what it touches (tracked nodes not yet finished); whether every id below
        #: `_tracked_from` submitted here has finished (and _due then looked at every callback)
        self._touched_by: dict[int, tuple] = {}
        self._untracked_done = False

    def worker_running_here(self) -> str | None:
        """The name of this executor's worker that the calling thread is, or None."""
        here = threading.current_thread()
        return here.name if here in self._thread_set else None

    # ---- submitting and finishing ------------------------------------------------------
    def submit(self, node, preds) -> None:
        """Add a node; it runs once every pred that is still unfinished has finished."""
        self.submit_many(((node, preds),))

    def submit_many(self, items) -> None:
        """submit() for (node, preds) pairs in order, under one hold of the lock (a replayed
        launch's nodes: the lock is what the workers' finishes contend for)."""
        ready = []
        with self.lock:
            unfinished, dependents, waiting = self.unfinished, self.dependents, self.waiting
            lost, poisoned = self.lost, self.poisoned
            for node, preds in items:
                count = 0
                for p in preds:
                    if p in unfinished:
                        dependents.setdefault(p, []).append(node.id)
                        count += 1
                    elif lost and p in lost:   # (submitted after a pred it needs was lost)
                        poisoned.add(node.id)
                unfinished[node.id] = node
                if self._touching is not None:
                    self._track(node, unfinished)
                if count:
                    waiting[node.id] = count
                else:
                    ready.append(node)
        for node in ready:
            self._ready(node)

    def track_touches(self, from_id: int, touches: Callable) -> None:
        """Keep, from node id `from_id` on, what each submitted node touches (touches(node) ->
        hashable things: the runtime's are instances), for when_done_below(..., touched); called
        before any node with that id or a later one is submitted. Later calls change nothing."""
        with self.lock:
            if self._touching is None:
                self._touching, self._tracked_from, self._touches = {}, from_id, touches

    def _track(self, node, unfinished) -> None:
        """Add a node's id to the lists of the things it touches (under the lock), dropping
        finished ids from their fronts as it goes, so that the lists stay short."""
        touching = self._touching
        things = self._touched_by[node.id] = tuple(self._touches(node))
        for thing in things:
            ids = touching.get(thing)
            if ids is None:
                ids = touching[thing] = deque()
            while ids and ids[0] not in unfinished:
                ids.popleft()
            if ids and ids[-1] > node.id:   # (ids come in order; a transport may submit one late)
                bisect.insort(ids, node.id)
            else:
                ids.append(node.id)

    def when_done_below(self, threshold: int, fn: Callable[[], None], touched=None) -> None:
        """Call fn (in whichever thread finds it due) once every node with an id below
        `threshold` has finished, or with `touched`, every such node that touches it (as
        track_touches says, which must have been called); called once all of those this rank
        runs have been submitted, so one that is not unfinished has finished (or is another
        rank's). Nodes with other ids, a transport's future messages, are not counted."""
        if touched is not None and self._touching is None:
            raise RuntimeError(f"when_done_below(..., touched={touched}) before track_touches")
        with self.lock:
            heapq.heappush(self._below.setdefault(touched, []), (threshold, self._below_count, fn))
            self._below_count += 1
            due = self._due((touched,))
        for f in due:
            f()

    def _due(self, touched=()) -> list[Callable]:
        """Pop the callbacks now due (under the lock): those for any node, and those for what a
        node that just finished (or a new callback) touched; all, the moment the last node from
        before tracking began has finished (some may have waited for those alone)."""
        due: list[Callable] = []
        self._pop_due((None, *touched), due)
        if self._touching is not None and not self._untracked_done and self._passed(self._tracked_from, None):
            self._untracked_done = True
            self._pop_due(list(self._below), due)
        return due

    def _pop_due(self, keys, due: list) -> None:
        """Move the due callbacks of the heaps of `keys` to `due`, dropping the heaps emptied."""
        below = self._below
        for key in keys:
            heap = below.get(key)
            if heap is None:
                continue
            while heap and self._passed(heap[0][0], key):
                due.append(heapq.heappop(heap)[2])
            if not heap:
                del below[key]

    def _passed(self, threshold: int, touched) -> bool:
        """Whether every node submitted here below `threshold` (that touches `touched`, when not
        None) has finished; moves the marks on (under the lock)."""
        unfinished, low = self.unfinished, self._low
        top = threshold if touched is None else min(threshold, self._tracked_from)
        while low < top and low not in unfinished:
            low += 1
        self._low = low
        if low < top:
            return False
        if touched is None:
            return True
        ids = self._touching.get(touched)
        while ids and ids[0] not in unfinished:
            ids.popleft()
        return not ids or ids[0] >= threshold

    def _ready(self, node) -> None:
        """Queue a node whose preds have all finished (or post an inline one, or finish a
        Join, right here)."""
        kind = type(node)
        if kind is Join or (self.inline_types and kind in self.inline_types and node.inline):
            # a loop, not recursion: an inline node that finishes at once may ready another.
            # First in, first out: a Join that readies a block's sends posts them in graph
            # order, as the simulator has them (taken last first, alexnet's next iteration sent
            # conv1's weight, needed first, last of a dozen)
            local = self._inline
            pending = getattr(local, "pending", None)
            if pending is not None:
                pending.append(node)
                return
            local.pending = pending = deque([node])
            try:
                while pending:
                    node = pending.popleft()
                    if type(node) is Join:
                        self._finish(node)
                    else:
                        self._run(node, self.run_copy)
            finally:
                local.pending = None
        else:
            self.queues[node.where].put(node)

    def resume(self, node) -> None:
        """Run a PENDING node again, on its worker (its run knows where it left off)."""
        self.queues[node.where].put(node)

    def is_done(self, node_id: int) -> bool:
        return node_id not in self.unfinished

    def _finish(self, node) -> None:
        ready = []
        with self.lock:
            del self.unfinished[node.id]
            poisoned = self.poisoned and node.id in self.poisoned
            if poisoned:
                self.poisoned.discard(node.id)
                self.lost.add(node.id)
            for s in self.dependents.pop(node.id, ()):
                if poisoned:
                    self.poisoned.add(s)
                c = self.waiting[s] - 1
                if c:
                    self.waiting[s] = c
                else:
                    del self.waiting[s]
                    ready.append(self.unfinished[s])
            watched = self.watched
            if watched and (node.id in watched or (ALL in watched and not self.unfinished)):
                self.cond.notify_all()
            touched = self._touched_by.pop(node.id, ()) if self._touched_by else ()
            due = self._due(touched) if self._below else ()
        for fn in due:
            fn()
        for n in ready:
            self._ready(n)

    def _worker(self, where, q: queue.SimpleQueue, setup) -> None:
        if setup is not None:
            setup(where)
        run_task, run_copy = self.run_task, self.run_copy
        while True:
            node = q.get()
            if node is None:
                return
            self._run(node, run_task if type(node) is TaskNode else run_copy)

    def _run(self, node, run: Callable) -> None:
        """Run a node (skipped where it depends on a failure); finish it unless it returned PENDING."""
        if self.poisoned and node.id in self.poisoned:
            self._lost(node, False)
            self._finish(node)
            return
        start = time.perf_counter()
        try:
            if run(node) is PENDING:
                return
        except BaseException as exc:  # the task's error is reported at wait(), never lost
            self._fail(node, exc, traceback.format_exc())
            self._lost(node, True)
        self.complete(node, start)

    def _lost(self, node, ran: bool) -> None:
        """on_lost(node, ran), whose own error is recorded like a task's: the worker must go on,
        or the nodes queued behind this one would never finish."""
        if self.on_lost is None:
            return
        try:
            self.on_lost(node, ran)
        except BaseException as exc:
            self._fail(node, exc, traceback.format_exc())

    def complete(self, node, start: float) -> None:
        """Finish a node whose run returned PENDING; `start` is when its run began."""
        if self.hooks:
            end = time.perf_counter()
            for h in self.hooks:
                h(node, start, end)
        self._finish(node)

    def fail(self, node, exc: BaseException, tb: str) -> None:
        """Finish a PENDING node that failed (after the failure is recorded)."""
        self._fail(node, exc, tb)
        self._finish(node)

    def _fail(self, node, exc: BaseException, tb: str) -> None:
        first = False
        with self.lock:
            self.poisoned.add(node.id)
            if self.error is None:
                self.error = TaskError(node, exc, tb, self.rank)
                first = True
            self.cond.notify_all()
        if first and self.on_error is not None:
            self.on_error(self.error)

    def forget_failure(self) -> list[int]:
        """Go on after a failure (once everything has drained): the ids of the nodes that failed
        or were skipped for it, in order, which are then forgotten with the error."""
        with self.lock:
            lost = sorted(self.lost)
            self.error = None
            self.lost.clear()
            self.poisoned.clear()
        return lost

    # ---- waiting ---------------------------------------------------------------------
    def wait_node(self, node_id: int, timeout: float | None = None) -> None:
        self._wait(node_id, lambda: node_id not in self.unfinished, timeout)

    def wait_all(self, timeout: float | None = None) -> None:
        self._wait(ALL, lambda: not self.unfinished, timeout)

    def _wait(self, what, done: Callable[[], bool], timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            self.watched[what] = self.watched.get(what, 0) + 1
            try:
                # after an error the nodes that need it drain without running, so this ends too
                while not done():
                    if self.stopped:   # (shutdown(wait=False) from another thread: nothing more runs)
                        raise RuntimeError(f"shutdown(wait=False) left {len(self.unfinished)} nodes unrun, and the "
                                           f"workers are gone")
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"{len(self.unfinished)} nodes still unfinished after {timeout} s")
                    self.cond.wait(left if left is not None else 1.0)
            finally:
                left = self.watched.pop(what) - 1
                if left:
                    self.watched[what] = left
        if self.error is not None:
            raise self.error

    def shutdown(self) -> None:
        for q in self.queues.values():
            q.put(None)
        for t in self.threads:
            t.join(timeout=5)
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
