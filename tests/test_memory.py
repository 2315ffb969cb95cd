"""Peak memory: the boxes it counts, and what it predicts against what a run's instances hold."""
from __future__ import annotations

import itertools
import threading
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apps.cli import batch_source, build_model
from strategies.baselines import BASELINES
from strategies.memory import _holdings, box_volume
from strategies.random import random_strategy
from taskrt import Rect, Runtime


def points(rects) -> set:
    """Every point of the rects, one by one."""
    return {p for r in rects for p in itertools.product(*(range(a, b) for a, b in zip(r.lo, r.hi)))}


@st.composite
def rect_lists(draw):
    ndim = draw(st.integers(1, 3))
    bounds = st.tuples(st.integers(0, 5), st.integers(0, 5))
    out = []
    for _ in range(draw(st.integers(1, 5))):
        dims = [sorted(draw(bounds)) for _ in range(ndim)]
        if draw(st.booleans()):   # some empty ones
            dims[0] = [dims[0][0], dims[0][0]]
        out.append(Rect(tuple(a for a, _ in dims), tuple(b for _, b in dims)))
    if draw(st.booleans()):   # a repeated rect
        out.append(out[0])
    return out


@settings(max_examples=300, deadline=None)
@given(rects=rect_lists())
def test_box_volume_spans_the_points_of_the_rects(rects):
    got = points(rects)
    want = np.prod([max(p[d] for p in got) - min(p[d] for p in got) + 1 for d in range(rects[0].ndim)]) if got else 0
    assert box_volume(rects) == want


def test_box_volume_of_a_region_s_rects():
    halves = [Rect((0, 0), (2, 4)), Rect((2, 0), (4, 4))]
    assert box_volume(halves) == 16 and box_volume(halves + halves) == 16
    assert box_volume([halves[0], Rect((3, 3), (4, 4))]) == 16   # the gap between them is held too
    assert box_volume([Rect((), ())]) == 1 and box_volume([Rect((), ()), Rect((), ())]) == 1


class _LiveBuffers:
    """The most bytes of reduction buffers live at once in each memory of a runtime's store."""

    def __init__(self, store):
        self.live, self.peak, self.sizes = defaultdict(int), defaultdict(int), {}
        self.lock = threading.Lock()
        new, take = store.new_buffer, store.take_buffer

        def new_buffer(key, region, rect, memory, redop):
            buf = new(key, region, rect, memory, redop)
            with self.lock:
                self.sizes[key] = (memory, buf.nbytes)
                self.live[memory] += buf.nbytes
                self.peak[memory] = max(self.peak[memory], self.live[memory])
            return buf

        def take_buffer(key, rect):
            part = take(key, rect)
            with self.lock:
                if key not in store.buffers and key in self.sizes:
                    memory, nbytes = self.sizes.pop(key)
                    self.live[memory] -= nbytes
            return part

        store.new_buffer, store.take_buffer = new_buffer, take_buffer


@pytest.mark.parametrize("app,strategy", [("alexnet", "data"), ("alexnet", "model"), ("alexnet", 1),
                                          ("transformer", "tensor"), ("rnnlm", 3), ("inception_v3", "expert")])
def test_the_predicted_memory_is_what_a_run_s_instances_hold(app, strategy):
    """Two steps of a tiny app on four CPU workers with memories of their own: on every device but
    the one that attaches the data, each region's predicted bytes are its instance's there, and
    the predicted reduction buffers at least the most that were live at once."""
    import importlib
    module = importlib.import_module(f"apps.{app}")
    with Runtime(cpus=4, separate_memories=True) as rt:
        model, output = build_model(module.build, dict(module.TINY), 16, runtime=rt)
        s = (BASELINES[strategy](model, rt.machine) if strategy in BASELINES else
             random_strategy(model.ops, rt.machine, np.random.default_rng(strategy), shaped=False))
        model.compile(strategy=s, output=output)
        buffers = _LiveBuffers(rt.store)
        list(model.train_on(batch_source(module.make_batch, model, dict(module.TINY), 0), 2))
        rt.wait()
        predicted, predicted_buffers = _holdings(model._low, rt.machine)
        names = {r.uid: r.name for r in list(model._low.values.values()) + list(model._low.grads.values())
                 + [r for p in model._low.params.values() for r in (p.value, p.grad, *p.state.values()) if r]
                 + list(model._low.stats.values())}
        for plan in model._low.plans.values():
            names.update({p.region.uid: p.region.name for p in list(plan._sums.values()) + list(plan._carries)
                          + list(getattr(plan, "_carry_grads", []))})
        for memory in rt.machine.memories[1:]:
            held = {names[uid]: inst.nbytes for (uid, m), (inst, _) in rt.store.instances.items() if m == memory}
            want = {name: box_volume(rects) * itemsize for name, (rects, itemsize) in predicted[memory].items()}
            assert held == want, (memory, {k: (held.get(k), want.get(k)) for k in set(held) | set(want)
                                           if held.get(k) != want.get(k)})
            assert 0 < buffers.peak[memory] <= predicted_buffers[memory] or buffers.peak[memory] == 0
