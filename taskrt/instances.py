"""Physical instances: the storage of each region in each memory of this rank.

Every (region, memory) pair gets one full-size instance on first use; a task sees a view
of its rect. Which parts of an instance hold valid data is the analysis's business
(taskrt/analysis.py); this module only allocates, hands out views, copies and folds.
Reduction buffers are private to one task's requirement and live until they are folded.
"""
from __future__ import annotations

import threading

import numpy as np

from .backends import cpu, gpu
from .geometry import Rect
from .machine import Memory
from .privilege import fold, reduction_identity
from .region import Region


class InstanceStore:
    def __init__(self, gpu_devices: dict[Memory, int] | None = None):
        self.instances: dict[tuple[int, Memory], object] = {}
        self.buffers: dict[tuple[int, int], object] = {}
        self.gpu_devices = gpu_devices or {}
        self._lock = threading.Lock()

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
        v = self.instance(region, memory)[rect.slices()]
        if writable:
            return v
        return cpu.read_only(v) if memory.kind == "sys" else gpu.read_only(v)

    def new_buffer(self, key: tuple[int, int], region: Region, rect: Rect, memory: Memory, redop: str):
        """A private reduction buffer for a task's requirement, filled with the operator's identity."""
        identity = reduction_identity(redop, region.dtype)
        if memory.kind == "sys":
            buf = np.full(rect.shape, identity, region.dtype)
        else:
            cp = gpu.module()
            with cp.cuda.Device(self.gpu_devices[memory]):
                buf = cp.full(rect.shape, identity, region.dtype)
        if rect.volume:
            self.buffers[key] = buf
        return buf

    def copy(self, region: Region, rect: Rect, src: Memory, dst: Memory) -> None:
        src_view = self.instance(region, src)[rect.slices()]
        dst_view = self.instance(region, dst)[rect.slices()]
        if src.kind == "sys" and dst.kind == "sys":
            np.copyto(dst_view, src_view)
        else:
            gpu.copy(dst_view, src_view, self.gpu_devices.get(dst))

    def fold(self, region: Region, rect: Rect, dst: Memory, buffer_key: tuple[int, int], redop: str) -> None:
        """dst[rect] op= the task's reduction buffer, then free the buffer."""
        self.fold_array(region, rect, dst, self.buffers.pop(buffer_key), redop)

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
