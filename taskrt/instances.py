"""Physical instances: the storage of each region in each memory of this rank.

Every (region, memory) pair gets one instance on first use, over the smallest box holding the
rects that memory is asked for (`reserve`, before the nodes that touch them are submitted),
not the whole region: a GPU that runs a quarter of a batch keeps a quarter of its activations,
as Legion's mappers size instances and as strategies/memory.py counts. A rect outside an
instance that exists already makes it grow (`grow`, once the nodes that use it have finished:
the runtime waits for them); a pair never reserved gets the whole region. A task sees a view
of its rect (`part`). Which parts of an instance hold valid data is the analysis's business
(taskrt/analysis.py); this module only allocates, hands out views, copies and folds.
Reduction buffers are private to one task's requirement and live until every part of
them has been folded (a fold may take a part: taskrt/analysis.py folds per sub-rect).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

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
        #: (region uid, memory) -> (the instance, the box of the region it holds)
        self.instances: dict[tuple[int, Memory], tuple[object, Rect]] = {}
        #: (region uid, memory) -> the box its instance is to hold (what reserve was told)
        self.boxes: dict[tuple[int, Memory], Rect] = {}
        self.buffers: dict[tuple[int, int], object] = {}
        self.gpu_devices = gpu_devices or {}
        self._lock = threading.Lock()
        #: (region uid, memory, rect, writable) -> the view tasks get: made once, since a step
        #: asks for the same views every time (dropped when an instance grows)
        self._views: dict[tuple, object] = {}

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
            return key in self.instances

    def grow(self, region: Region, memory: Memory) -> None:
        """Remake (region, memory)'s instance over its widened box, keeping what it held; only
        once no node that uses it is running or queued."""
        key = (region.uid, memory)
        with self._lock:
            old, old_box = self.instances[key]
            box = self.boxes[key]
            self.instances[key] = (self._allocate(box.shape, region.dtype, memory), box)
            self._views.clear()
        self.put(region, old_box, memory, old)

    def _allocate(self, shape, dtype, memory: Memory):
        if memory.kind == "sys":
            return cpu.allocate(shape, dtype)
        return gpu.allocate(shape, dtype, self.gpu_devices[memory])

    def instance(self, region: Region, memory: Memory) -> tuple[object, Rect]:
        """(the instance of region in memory, the box of the region it holds), made on first use."""
        key = (region.uid, memory)
        held = self.instances.get(key)
        if held is None:
            with self._lock:
                held = self.instances.get(key)
                if held is None:
                    box = self.boxes.get(key, region.rect)
                    held = self.instances[key] = (self._allocate(box.shape, region.dtype, memory), box)
        return held

    def part(self, region: Region, rect: Rect, memory: Memory):
        """The view of `rect` in region's instance in memory."""
        if rect.empty:
            return self.xp(memory).empty(rect.shape, region.dtype)
        inst, box = self.instance(region, memory)
        if not box.contains(rect):
            raise RuntimeError(f"{region!r} {rect!r} in memory {memory}: its instance there holds {box!r} only; "
                               f"the rect was not reserved before its node was submitted")
        return inst[rect.slices(box.lo)]

    def view(self, region: Region, rect: Rect, memory: Memory, writable: bool):
        key = (region.uid, memory, rect, writable)
        v = self._views.get(key)
        if v is None:
            v = self.part(region, rect, memory)
            if not writable:
                v = cpu.read_only(v) if memory.kind == "sys" else gpu.read_only(v)
            if len(self._views) >= VIEWS_KEPT:
                self._views.clear()
            self._views[key] = v
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
            self.buffers[key] = _Buffer(buf, rect, rect.volume)
        return buf

    def take_buffer(self, key: tuple[int, int], rect: Rect):
        """The part `rect` of a reduction buffer (folds may take it piece by piece); the
        buffer is freed once every element has been taken."""
        with self._lock:
            b = self.buffers[key]
            b.left -= rect.volume
            if b.left <= 0:
                del self.buffers[key]
        if rect == b.rect:
            return b.array
        return b.array[rect.slices(b.rect.lo)]

    def copy(self, region: Region, rect: Rect, src: Memory, dst: Memory) -> None:
        src_view = self.part(region, rect, src)
        dst_view = self.part(region, rect, dst)
        if src.kind == "sys" and dst.kind == "sys":
            np.copyto(dst_view, src_view)
        else:
            gpu.copy(dst_view, src_view, self.gpu_devices.get(dst))

    def fold(self, region: Region, rect: Rect, dst: Memory, buffer_key: tuple[int, int], redop: str) -> None:
        """dst[rect] op= that part of the task's reduction buffer."""
        self.fold_array(region, rect, dst, self.take_buffer(buffer_key, rect), redop)

    def fold_array(self, region: Region, rect: Rect, dst: Memory, buf, redop: str) -> None:
        """dst[rect] op= buf (a reduction buffer, or one that came from another rank), first
        moving buf into dst's memory when it lives elsewhere."""
        dst_view = self.part(region, rect, dst)
        if dst.kind == "sys":
            if not isinstance(buf, np.ndarray):
                buf = gpu.to_numpy(buf)
        else:
            buf = gpu.to_device(buf, self.gpu_devices[dst])
        fold(self.xp(dst), redop, dst_view, buf)

    def put(self, region: Region, rect: Rect, dst: Memory, array: np.ndarray) -> None:
        """dst[rect] = an array: a host array (data that came from another rank), or one in dst's
        memory (an instance that grew)."""
        dst_view = self.part(region, rect, dst)
        if dst.kind == "sys":
            np.copyto(dst_view, array)
        else:
            gpu.copy(dst_view, array, self.gpu_devices[dst])
