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
from strategies.memory import box_volume, step_holdings
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


def _tiny(app: str, strategy, rt, release: bool = True):
    """A tiny app compiled under a baseline (by name) or a random strategy (by seed), releasing
    its activations unless told not to."""
    import importlib
    module = importlib.import_module(f"apps.{app}")
    model, output = build_model(module.build, dict(module.TINY), 16, runtime=rt)
    s = (BASELINES[strategy](model, rt.machine) if strategy in BASELINES else
         random_strategy(model.ops, rt.machine, np.random.default_rng(strategy), shaped=False))
    model.compile(strategy=s, output=output, release=release)
    return model, batch_source(module.make_batch, model, dict(module.TINY), 0)


def _regions(low) -> dict:
    """uid -> Region of every region a lowering made."""
    out = {r.uid: r for r in list(low.values.values()) + list(low.grads.values())
           + [r for p in low.params.values() for r in (p.value, p.grad, *p.state.values()) if r]
           + list(low.stats.values())}
    for plan in low.plans.values():
        out.update({p.region.uid: p.region for p in list(plan._sums.values()) + list(plan._carries)
                    + list(getattr(plan, "_carry_grads", []))})
    return out


APPS = [("alexnet", "data"), ("alexnet", "model"), ("alexnet", 1), ("transformer", "tensor"), ("rnnlm", 3),
        ("inception_v3", "expert"), ("resnet101", "data")]


@pytest.mark.parametrize("app,strategy", APPS)
def test_the_predicted_memory_is_what_a_run_s_instances_hold(app, strategy):
    """Two steps of a tiny app on four CPU workers with memories of their own: on every device (the
    first one the host too, with the attached weights and the batch), each region's predicted
    bytes are its instances' there, the
    predicted reduction buffers at least the most that were live at once, and once the steps are
    over the devices hold what the model keeps all the time (the activations are freed)."""
    with Runtime(cpus=4, separate_memories=True) as rt:
        model, source = _tiny(app, strategy, rt)
        buffers = _LiveBuffers(rt.store)
        list(model.train_on(source, 2))
        rt.wait()
        regions, held, _, predicted_buffers = step_holdings(model._low, rt.machine)
        made = _regions(model._low)
        transient = {r.name for r in model._low.transient()}
        for memory in rt.machine.memories:
            boxes = {made[uid].name: box.volume * made[uid].dtype.itemsize
                     for (uid, m), box in rt.store.boxes.items() if m == memory}
            want = {name: nbytes for name, (nbytes, _, _) in regions[memory].items()}
            assert boxes == want, (memory, {k: (boxes.get(k), want.get(k)) for k in set(boxes) | set(want)
                                            if boxes.get(k) != want.get(k)})
            assert 0 < buffers.peak[memory] <= predicted_buffers[memory] or buffers.peak[memory] == 0
            kept = sum(nbytes for name, (nbytes, _, _) in regions[memory].items() if name not in transient)
            assert rt.store.held.get(memory, 0) == kept < held[memory].max()


@pytest.mark.parametrize("app,strategy", APPS)
def test_a_step_run_segment_by_segment_holds_what_the_model_counts_at_each_place(app, strategy):
    """A training step issued one segment at a time, waited for, then released as the step
    releases: after each forward, fill and backward segment every device holds the bytes the
    model counts at that place; the peaks are equal."""
    from ops.lower import BACKWARD_PHASE, FORWARD_PHASE, GRAD_FILL_PHASE
    with Runtime(cpus=4, separate_memories=True) as rt:
        model, source = _tiny(app, strategy, rt)
        list(model.train_on(source, 1))
        rt.wait()
        low = model._low
        _, want, _, _ = step_holdings(low, rt.machine)
        n = len(low.ops)
        order = {op.name: i for i, op in enumerate(low.ops)}
        segments = ([low.forward_segment(low.plans[op.name], True, model.batch_size, 2) for op in low.ops]
                    + low.backward_segments() + low.update_segments(2))
        releases = low.release_points(segments)
        peaks: dict = defaultdict(int)
        for s, segment in enumerate(segments):
            low.issue(segment)
            rt.wait()
            place = {FORWARD_PHASE: lambda i: i, GRAD_FILL_PHASE: lambda i: n + i,
                     BACKWARD_PHASE: lambda i: 3 * n - 1 - i}.get(segment.phase) if segment.op else None
            for memory in rt.machine.memories:
                held = rt.store.held.get(memory, 0)
                peaks[memory] = max(peaks[memory], held)
                if place is not None:
                    assert held == want[memory][place(order[segment.op])], (segment, memory)
            rt.release(*releases.get(s, ()))
        for memory in rt.machine.memories:
            assert peaks[memory] == want[memory].max()


@pytest.mark.parametrize("app", ["alexnet", "resnet101"])
def test_steps_run_as_they_come_hold_no_more_than_the_predicted_peak_on_any_device(app):
    """Four data-parallel steps run as the runtime runs them, each device at its own pace: no
    device holds more instance bytes at once than the model's peak (a hair more may come in: the
    next step's fill of the loss output's gradient, 16 bytes, before the last step's goes). Each
    released instance is freed once the nodes that touch it are done; when it waited for every
    node before the release, alexnet held 17% more."""
    with Runtime(cpus=4, separate_memories=True) as rt:
        model, source = _tiny(app, "data", rt)
        list(model.train_on(source, 4))
        rt.wait()
        _, held, _, _ = step_holdings(model._low, rt.machine)
        for memory in rt.machine.memories:
            assert 0 < rt.store.high_water[memory] <= 1.001 * held[memory].max(), (
                memory, rt.store.high_water[memory], held[memory].max())


def test_a_step_releases_its_activations_on_gpus_unless_told_and_the_flag_is_checked():
    from ops import Model
    from ops.lower import releases_by_default
    from taskrt import Machine
    assert releases_by_default(Machine.build(1, 1, gpus_per_rank=2))
    assert not releases_by_default(Machine.build(1, 2))
    with Runtime(cpus=2) as rt:
        model = Model(rt, seed=0)
        model.dense(model.input((4, 3), name="x"), 2, name="fc")
        with pytest.raises(TypeError, match="compile: release must be True, False or None, got str 'yes'"):
            model.compile(release="yes")
        model.compile(loss="mean_squared_error")
        assert model._low.release is False


@pytest.mark.parametrize("app,strategy", [("alexnet", 1), ("resnet101", "data")])
def test_a_step_that_releases_trains_as_one_that_keeps_everything(app, strategy):
    """Three steps with releases and three without, from the same weights and batches: the same
    losses and weights (releases move data into new instances, never change it)."""
    results = []
    for release in (True, False):
        with Runtime(cpus=4, separate_memories=True) as rt:
            model, source = _tiny(app, strategy, rt, release)
            losses = list(model.train_on(source, 3))
            results.append((losses, model.parameters()))
    (released, params_r), (kept, params_k) = results
    np.testing.assert_allclose(released, kept, rtol=1e-6)
    for name in params_k:
        np.testing.assert_allclose(params_r[name], params_k[name], rtol=1e-5, atol=1e-6, err_msg=name)
