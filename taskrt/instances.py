"""Physical instances: the storage of each region in each memory of this rank.

Every (region, memory) pair gets one instance on first use, over the smallest box holding the
rects that memory is asked for (`reserve`, before the nodes that touch them are submitted),
not the whole region: a GPU that runs a quarter of a batch keeps a quarter of its activations,
as Legion's mappers size instances and as strategies/memory.py counts. A rect outside an
instance that exists already makes it grow (`grow`, once the nodes that use it have finished:
the runtime waits for them); a pair never reserved gets the whole region. A task sees a view
of its rect (`part`). Which parts of an instance hold valid data is the analysis's business
(taskrt/analysis.py); this module only allocates, hands out views, copies and folds.

Released regions (Runtime.release: what a training step needs no more, as an activation after
its backward): a release at node id T starts a new generation of the region's instances. A
node asks for the generation of its id (nodes before T use the old instances, nodes from T on
new ones, made on first use), and the old instance in each memory is freed once every node
before T on this rank that touches that instance has finished (`collections`: what the
executor calls): so a step that runs ahead of the one before it never writes into what that one still
reads, no node waits for a free, and a device that runs ahead of the others frees its own
instances as it goes, as strategies/memory.py counts.
Reduction buffers are private to one task's requirement and live until every part of
them has been folded (a fold may take a part: taskrt/analysis.py folds per sub-rect). A task
that failed or was skipped after a failure leaves an empty buffer for each it did not make, so
that its folds, even those issued after Runtime.recover, find one and fold nothing; a release
of a region with reductions pending discards their buffers (`discard`), whose folds never come.
"""
from __future__ import annotations

import bisect
import functools
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .backends import cpu, gpu
from .geometry import Rect
from .machine import Memory
from .privilege import fold, reduction_identity
from .region import Region


#: views kept (see InstanceStore._views) before the store starts over
VIEWS_KEPT = 1 << 16


@dataclass
class _Buffer:
    """A reduction buffer over `rect`, with `left` elements not yet folded."""

    array: object
    rect: Rect
    left: int


class InstanceStore:
    def __init__(self, gpu_devices: dict[Memory, int] | None = None):
        #: (region uid, memory, generation) -> (the instance, the box of the region it holds)
        self.instances: dict[tuple[int, Memory, int], tuple[object, Rect]] = {}
        #: (region uid, memory) -> the box its instances are to hold (what reserve was told)
        self.boxes: dict[tuple[int, Memory], Rect] = {}
        self.buffers: dict[tuple[int, int], object] = {}
        #: buffer key -> elements of it discarded before its task ran (see discard)
        self._discarded: dict[tuple[int, int], int] = {}
        self.gpu_devices = gpu_devices or {}
        self._lock = threading.Lock()
        #: region uid -> (its oldest generation still in use, the node ids of its releases not yet
        #: collected, in order); regions never released have none (generation 0)
        self.generations: dict[int, tuple[int, tuple[int, ...]]] = {}
        #: (region uid, generation) -> how many memories have yet to free their instance of it;
        #: region uid -> its generations freed in every memory, not yet the oldest
        self._uncollected: dict[tuple[int, int], int] = {}
        self._collected: dict[int, set[int]] = {}
        #: region uid -> the memories of this rank it was reserved in (its instances can be there)
        self._reserved: dict[int, set[Memory]] = {}
        #: region uid -> the keys of its instances in `instances`
        self._of_region: dict[int, set[tuple[int, Memory, int]]] = {}
        #: bytes each memory's instances hold now, and the most they have held
        self.held: dict[Memory, int] = {}
        self.high_water: dict[Memory, int] = {}
        #: (region uid, memory, generation) -> (rect, writable) -> the view tasks get: made once,
        #: since a step asks for the same views every time (dropped with the instance)
        self._views: dict[tuple, dict] = {}

    def xp(self, memory: Memory):
        return np if memory.kind == "sys" else gpu.module()

    def reserve(self, region: Region, memory: Memory, rect: Rect) -> bool:
        """Widen the box that (region, memory)'s instance holds to take in `rect`; called before
        a node touching it is submitted. True when the instance exists already and is smaller:
        the caller waits for every node submitted so far, then calls grow."""
        if rect.empty:
            return False
        key = (region.uid, memory)
        box = self.boxes.get(key)
        if box is not None and box.contains(rect):
            return False
        with self._lock:
            box = self.boxes.get(key)
            self.boxes[key] = rect if box is None else box.union_bbox(rect)
            if box is None:
                self._reserved.setdefault(region.uid, set()).add(memory)
            return any(k[1] == memory for k in self._of_region.get(region.uid, ()))

    def grow(self, region: Region, memory: Memory) -> None:
        """Remake (region, memory)'s instances over its widened box, keeping what they held; only
        once no node that uses them is running or queued."""
        uid = region.uid
        box = self.boxes[(uid, memory)]
        for key in [k for k in self._of_region.get(uid, ()) if k[1] == memory]:
            with self._lock:
                old, old_box = self.instances[key]
                new = self._allocate(box.shape, region.dtype, memory)
                self.instances[key] = (new, box)
                self._views.pop(key, None)
                self._count(memory, new.nbytes - old.nbytes)
            self.put(region, old_box, memory, old, at=self._first_id(uid, key[2]))

    def _allocate(self, shape, dtype, memory: Memory):
        if memory.kind == "sys":
            return cpu.allocate(shape, dtype)
        return gpu.allocate(shape, dtype, self.gpu_devices[memory])

    def _count(self, memory: Memory, nbytes: int) -> None:
        """Add nbytes to what memory's instances hold (under the lock)."""
        held = self.held[memory] = self.held.get(memory, 0) + nbytes
        if held > self.high_water.get(memory, 0):
            self.high_water[memory] = held

    # ---- generations: what a release starts ------------------------------------------------
    def generation_of(self, uid: int, at: int) -> int:
        """The generation of region uid's instances that node id `at` uses."""
        gens = self.generations.get(uid)
        if gens is None:
            return 0
        oldest, releases = gens
        return oldest + bisect.bisect_right(releases, at)

    def _first_id(self, uid: int, gen: int) -> int:
        """A node id that uses generation gen of region uid (what grow copies with)."""
        oldest, releases = self.generations.get(uid, (0, ()))
        return releases[gen - oldest - 1] if gen > oldest else -1

    def release(self, region: Region, at: int) -> int:
        """Nodes from id `at` on use a new generation of region's instances; returns the
        generation that ends there, which collections(region, gen) frees."""
        with self._lock:
            oldest, releases = self.generations.get(region.uid, (0, ()))
            if releases and at < releases[-1]:
                raise RuntimeError(f"{region!r} released at node #{at}, before its release at #{releases[-1]}")
            self.generations[region.uid] = (oldest, releases + (at,))
            return oldest + len(releases)

    def collections(self, region: Region, gen: int) -> list[tuple[Memory, Callable[[], None]]]:
        """(memory, free) for each memory that can hold generation `gen` of region's instances:
        free() frees that one (to be called once the nodes of the generation that touch the
        memory have finished; all of them have been submitted, so reserved, by now). The
        generation is over once every memory has freed it."""
        uid = region.uid
        with self._lock:
            memories = sorted(self._reserved.get(uid, ()), key=str)
            if memories:
                self._uncollected[(uid, gen)] = len(memories)
            else:
                self._generation_over(uid, gen)
        return [(memory, functools.partial(self._collect, uid, memory, gen)) for memory in memories]

    def _collect(self, uid: int, memory: Memory, gen: int) -> None:
        """Free generation gen of region uid's instance in memory (if one was made)."""
        key = (uid, memory, gen)
        with self._lock:
            held = self.instances.pop(key, None)
            if held is not None:
                self._of_region[uid].discard(key)
                self._views.pop(key, None)
                self._count(memory, -held[0].nbytes)
            left = self._uncollected.pop((uid, gen)) - 1
            if left:
                self._uncollected[(uid, gen)] = left
            else:
                self._generation_over(uid, gen)

    def _generation_over(self, uid: int, gen: int) -> None:
        """Generation gen of region uid is freed everywhere: the oldest in use moves on past the
        generations that are (under the lock; one assignment: readers see old or new)."""
        over = self._collected.setdefault(uid, set())
        over.add(gen)
        oldest, releases = self.generations[uid]
        first = oldest
        while oldest in over:
            over.discard(oldest)
            oldest += 1
        if oldest != first:
            self.generations[uid] = (oldest, releases[oldest - first:])

    def instance(self, region: Region, memory: Memory, at: int = -1) -> tuple[object, Rect]:
        """(the instance of region in memory that node id `at` uses, the box of the region it
        holds), made on first use."""
        key = (region.uid, memory, self.generation_of(region.uid, at))
        held = self.instances.get(key)
        if held is None:
            with self._lock:
                held = self.instances.get(key)
                if held is None:
                    box = self.boxes.get(key[:2], region.rect)
                    held = self.instances[key] = (self._allocate(box.shape, region.dtype, memory), box)
                    self._of_region.setdefault(region.uid, set()).add(key)
                    self._count(memory, held[0].nbytes)
        return held

    def part(self, region: Region, rect: Rect, memory: Memory, at: int = -1):
        """The view of `rect` in region's instance in memory (the one node id `at` uses)."""
        if rect.empty:
            return self.xp(memory).empty(rect.shape, region.dtype)
        inst, box = self.instance(region, memory, at)
        if not box.contains(rect):
            raise RuntimeError(f"{region!r} {rect!r} in memory {memory}: its instance there holds {box!r} only; "
                               f"the rect was not reserved before its node was submitted")
        return inst[rect.slices(box.lo)] if rect.lo else inst[...]   # (a 0-d region: an array, not a scalar)

    def view(self, region: Region, rect: Rect, memory: Memory, writable: bool, at: int = -1):
        """part(), made once per instance (read-only unless writable)."""
        key = (region.uid, memory, self.generation_of(region.uid, at))
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = {}
        v = views.get((rect, writable))
        if v is None:
            v = self.part(region, rect, memory, at)
            if not writable:
                v = cpu.read_only(v) if memory.kind == "sys" else gpu.read_only(v)
            if len(views) >= VIEWS_KEPT:
                views.clear()
            views[(rect, writable)] = v
        return v

    def new_buffer(self, key: tuple[int, int], region: Region, rect: Rect, memory: Memory, redop: str):
        """A private reduction buffer for a task's requirement, filled with the operator's identity."""
        identity = reduction_identity(redop, region.dtype)
        if memory.kind == "sys":
            buf = np.zeros(rect.shape, region.dtype) if identity == 0 else np.full(rect.shape, identity, region.dtype)
        else:
            cp = gpu.module()
            with cp.cuda.Device(self.gpu_devices[memory]):
                buf = cp.full(rect.shape, identity, region.dtype)
        if rect.volume:
            self._keep(key, _Buffer(buf, rect, rect.volume))
        return buf

    def skip_buffer(self, key: tuple[int, int], rect: Rect) -> None:
        """The buffer of a task skipped after a failure, or that failed: it holds nothing (what
        a failed task had put in it is dropped), so that the folds issued for it, before or
        after Runtime.recover, fold nothing."""
        if not rect.volume:
            return
        with self._lock:
            made = self.buffers.get(key)
            if made is not None:
                made.array = None
                return
        self._keep(key, _Buffer(None, rect, rect.volume))

    def _keep(self, key: tuple[int, int], buffer: _Buffer) -> None:
        """Keep a task's buffer for its folds, less what a release discarded of it already."""
        with self._lock:
            buffer.left -= self._discarded.pop(key, 0)
            if buffer.left > 0:
                self.buffers[key] = buffer

    def discard(self, parts) -> None:
        """Parts (key, rect) of reduction buffers whose folds will never come (Runtime.release of
        their region while they were pending): taken as a fold takes them, so that a buffer goes
        once its other parts are folded, or counted against it if its task has not run yet."""
        with self._lock:
            for key, rect in parts:
                b = self.buffers.get(key)
                if b is None:
                    self._discarded[key] = self._discarded.get(key, 0) + rect.volume
                    continue
                b.left -= rect.volume
                if b.left <= 0:
                    del self.buffers[key]

    def take_buffer(self, key: tuple[int, int], rect: Rect):
        """The part `rect` of a reduction buffer (folds may take it piece by piece); the
        buffer is freed once every element has been taken. None for a skipped task's."""
        with self._lock:
            b = self.buffers[key]
            b.left -= rect.volume
            if b.left <= 0:
                del self.buffers[key]
        if rect == b.rect or b.array is None:
            return b.array
        return b.array[rect.slices(b.rect.lo)]

    def copy(self, region: Region, rect: Rect, src: Memory, dst: Memory, at: int = -1) -> None:
        src_view = self.part(region, rect, src, at)
        dst_view = self.part(region, rect, dst, at)
        if src.kind == "sys" and dst.kind == "sys":
            np.copyto(dst_view, src_view)
        else:
            gpu.copy(dst_view, src_view, self.gpu_devices.get(dst))

    def fold(self, region: Region, rect: Rect, dst: Memory, buffer_key: tuple[int, int], redop: str,
             at: int = -1) -> None:
        """dst[rect] op= that part of the task's reduction buffer (nothing if the task was skipped)."""
        buf = self.take_buffer(buffer_key, rect)
        if buf is not None:
            self.fold_array(region, rect, dst, buf, redop, at)

    def fold_array(self, region: Region, rect: Rect, dst: Memory, buf, redop: str, at: int = -1) -> None:
        """dst[rect] op= buf (a reduction buffer, or one that came from another rank), first
        moving buf into dst's memory when it lives elsewhere."""
        dst_view = self.part(region, rect, dst, at)
        if dst.kind == "sys":
            fold(np, redop, dst_view, buf if isinstance(buf, np.ndarray) else gpu.to_numpy(buf))
            return
        device = self.gpu_devices[dst]
        with gpu.on(device):   # (the caller's thread may work on another device: a transport's)
            fold(self.xp(dst), redop, dst_view, gpu.to_device(buf, device))
            gpu.synchronize()   # done when it returns, for the tasks of every stream

    def put(self, region: Region, rect: Rect, dst: Memory, array: np.ndarray, at: int = -1) -> None:
        """dst[rect] = an array: a host array (data that came from another rank), or one in dst's
        memory (an instance that grew)."""
        dst_view = self.part(region, rect, dst, at)
        if dst.kind == "sys":
            np.copyto(dst_view, array)
        else:
            gpu.copy(dst_view, array, self.gpu_devices[dst])
