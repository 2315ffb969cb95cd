"""Physical instances: the storage of each region in each memory of this rank.

Every (region, memory) pair gets one full-size instance on first use; a task sees a view
of its rect. Which parts of an instance hold valid data is the analysis's business
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
        self.instances: dict[tuple[int, Memory], object] = {}
        self.buffers: dict[tuple[int, int], object] = {}
        self.gpu_devices = gpu_devices or {}
        self._lock = threading.Lock()
        #: (region uid, memory, rect, writable) -> the view tasks get: made once, since the
        #: instances live as long as the store and a step asks for the same views every time
        self._views: dict[tuple, object] = {}

    def xp(self, memory: Memory):
        return np if memory.kind == "sys" else gpu.module()

    def instance(self, region: Region, memory: Memory):
        key = (region.uid, memory)
        inst = self.instances.get(key)
        if inst is None:
            with self._lock:
                inst = self.instances.get(key)
                if inst is None:
                    if memory.kind == "sys":
                        inst = cpu.allocate(region.shape, region.dtype)
                    else:
                        inst = gpu.allocate(region.shape, region.dtype, self.gpu_devices[memory])
                    self.instances[key] = inst
        return inst

    def view(self, region: Region, rect: Rect, memory: Memory, writable: bool):
        key = (region.uid, memory, rect, writable)
        v = self._views.get(key)
        if v is None:
            v = self.instance(region, memory)[rect.slices()]
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
        src_view = self.instance(region, src)[rect.slices()]
        dst_view = self.instance(region, dst)[rect.slices()]
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
        dst_view = self.instance(region, dst)[rect.slices()]
        if dst.kind == "sys":
            if not isinstance(buf, np.ndarray):
                buf = gpu.to_numpy(buf)
        else:
            buf = gpu.to_device(buf, self.gpu_devices[dst])
        fold(self.xp(dst), redop, dst_view, buf)

    def put(self, region: Region, rect: Rect, dst: Memory, array: np.ndarray) -> None:
        """dst[rect] = a host array (data that came from another rank)."""
        dst_view = self.instance(region, dst)[rect.slices()]
        if dst.kind == "sys":
            np.copyto(dst_view, array)
        else:
            gpu.copy(dst_view, array, self.gpu_devices[dst])
