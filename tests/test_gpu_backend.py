"""The GPU backend's ordering rules, against a cupy stand-in that logs what runs on which device
and when a stream is waited for (tests/test_gpu.py runs the real thing where there is a GPU):
work issued on a thread's stream that tasks on other streams are not ordered after is waited
for before the function returns."""
from __future__ import annotations

import types

import numpy as np
import pytest

from taskrt.backends import gpu


class FakeArray:
    """A device array: a numpy array and the device it lives on."""

    def __init__(self, array: np.ndarray, device: int):
        self.array, self.device = array, types.SimpleNamespace(id=device)
        self.shape, self.dtype, self.nbytes = array.shape, array.dtype, array.nbytes

    def __array__(self, dtype=None, copy=None):
        return self.array

    def __getitem__(self, key):
        return FakeArray(self.array[key], self.device.id)

    def __setitem__(self, key, value):
        LOG.append(("write", CURRENT[-1]))
        self.array[key] = np.asarray(value)

    @property
    def data(self):
        def copy_from_device(src, nbytes):
            LOG.append(("peer copy", CURRENT[-1]))
            self.array.reshape(-1)[:] = src.array.reshape(-1)
        return types.SimpleNamespace(copy_from_device=copy_from_device, array=self.array)


LOG: list[tuple[str, int]] = []   # (event, device) in the order they happened
CURRENT = [0]                      # the device stack of `with Device(d)`


class Device:
    def __init__(self, device: int):
        self.id = device

    def __enter__(self):
        CURRENT.append(self.id)

    def __exit__(self, *exc):
        CURRENT.pop()


def on_device(array) -> FakeArray:
    return FakeArray(np.array(array), CURRENT[-1])


def logged(event, make):
    def run(*args, **kwargs):
        LOG.append((event, CURRENT[-1]))
        return on_device(make(*args, **kwargs))
    return run


def fake_cupy():
    stream = types.SimpleNamespace(synchronize=lambda: LOG.append(("wait", CURRENT[-1])))
    cuda = types.SimpleNamespace(Device=Device, get_current_stream=lambda: stream)
    return types.SimpleNamespace(cuda=cuda, zeros=logged("zeros", np.zeros), empty=logged("empty", np.empty),
                                 asarray=logged("upload", np.asarray),
                                 ascontiguousarray=logged("contiguous", np.ascontiguousarray),
                                 asnumpy=np.asarray)


@pytest.fixture(autouse=True)
def fake(monkeypatch):
    monkeypatch.setattr(gpu, "module", fake_cupy)
    LOG.clear()
    CURRENT[:] = [0]


def waited_after(event: str, device: int) -> bool:
    """Whether every `event` on `device` is followed, later, by a wait on that device."""
    last = max((i for i, e in enumerate(LOG) if e == (event, device)), default=None)
    return last is not None and ("wait", device) in LOG[last + 1:]


def test_an_allocation_is_filled_before_it_is_handed_out():
    """An instance that grew was made on the submitting thread's stream, which the tasks'
    streams are not ordered after."""
    array = gpu.allocate((2, 3), "float32", 1)
    assert array.device.id == 1 and waited_after("zeros", 1)


def test_a_copy_into_a_device_is_done_when_it_returns():
    dst = gpu.allocate((4,), "float32", 1)
    LOG.clear()
    gpu.copy(dst, np.arange(4, dtype="float32"), 1)
    assert np.array_equal(np.asarray(dst), np.arange(4)) and waited_after("write", 1)


def test_a_peer_copy_waits_for_its_staging_copy_and_keeps_it_until_read():
    """The staging copy of a strided source ran on the source device's stream, which the peer
    copy on the destination's was not ordered after, and was freed while the copy could be pending."""
    with Device(0):
        src = on_device(np.arange(12, dtype="float32").reshape(3, 4))[:, ::2]
    LOG.clear()
    moved = gpu.to_device(src, 1)
    assert np.array_equal(np.asarray(moved), np.asarray(src)) and moved.device.id == 1
    staged, copied = LOG.index(("contiguous", 0)), LOG.index(("peer copy", 1))
    assert ("wait", 0) in LOG[staged:copied] and waited_after("peer copy", 1)
