"""GPU memory through cupy: one device per memory, work issued on the processor's stream."""
from __future__ import annotations

import numpy as np


def module():
    """cupy, or a clear error where it is not installed."""
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError("a GPU memory needs cupy: pip install -e '.[gpu]'") from e
    return cupy


def use_device(device: int) -> None:
    """Make `device` current in this thread, with a non-blocking stream of the thread's own."""
    cp = module()
    cp.cuda.Device(device).use()
    cp.cuda.Stream(non_blocking=True).use()


def synchronize() -> None:
    """Wait for the work this thread issued on its current stream (of its current device)."""
    module().cuda.get_current_stream().synchronize()


def on(device: int):
    """A context in which this thread's cupy work goes to `device` (on its stream there)."""
    return module().cuda.Device(device)


def allocate(shape, dtype, device: int):
    """Zeros on `device`, filled when returned: the allocating thread's stream may be one that a
    task's stream is not ordered after (the submitting thread's, when an instance grows)."""
    cp = module()
    with cp.cuda.Device(device):
        array = cp.zeros(shape, dtype)
        synchronize()
        return array


def to_numpy(array) -> np.ndarray:
    return module().asnumpy(array)


def read_only(view):
    # cupy has no read-only arrays; privileges are still enforced by the analysis
    return view


def to_device(array, device: int):
    """`array` (numpy, or cupy on any device) as a cupy array on `device`, copied only if needed."""
    cp = module()
    if isinstance(array, np.ndarray):
        with cp.cuda.Device(device):
            return cp.asarray(array)
    if array.device.id == device:
        return array
    with cp.cuda.Device(array.device.id):
        src = cp.ascontiguousarray(array)
        synchronize()   # made on the source device's stream, which the peer copy is not ordered after
    with cp.cuda.Device(device):
        staged = cp.empty(src.shape, src.dtype)
        staged.data.copy_from_device(src.data, src.nbytes)
        synchronize()   # src is freed on return: read first
    return staged


def copy(dst_view, src_view, dst_device: int | None) -> None:
    """dst[...] = src across host and devices: host to device, device to host, or peer to peer;
    done when it returns, for the tasks of every stream."""
    if dst_device is None:
        dst_view[...] = to_numpy(src_view)
        return
    with module().cuda.Device(dst_device):
        dst_view[...] = to_device(src_view, dst_device)
        synchronize()
