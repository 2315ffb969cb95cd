"""Instances: each memory holds the box of the rects it is asked for, grows when asked for more,
and hands out views of the right elements; a released region's instances are freed once the
nodes before the release have run, and the nodes after it get new ones."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ops import Model, SGD, TileConfig
from taskrt import READ_WRITE, WRITE, Rect, Region, Runtime, req
from taskrt.instances import InstanceStore
from taskrt.machine import Memory

SYS = Memory("sys", 0, 0)


def test_an_instance_holds_the_box_of_the_rects_its_memory_was_asked_for():
    store = InstanceStore()
    region = Region((10, 6), "float32", "a")
    assert not store.reserve(region, SYS, Rect((2, 0), (4, 3)))
    assert not store.reserve(region, SYS, Rect((5, 1), (7, 6)))
    assert not store.reserve(region, SYS, Rect((3, 1), (4, 2)))   # inside already
    inst, box = store.instance(region, SYS)
    assert box == Rect((2, 0), (7, 6)) and inst.shape == (5, 6)
    store.part(region, Rect((5, 1), (7, 6)), SYS)[...] = 7.0
    store.part(region, Rect((2, 0), (3, 3)), SYS)[...] = 1.0
    assert store.part(region, Rect((6, 5), (7, 6)), SYS)[0, 0] == 7.0
    assert inst[0, :3].tolist() == [1.0, 1.0, 1.0] and inst[3:, 1:].sum() == 7.0 * 10


def test_a_pair_never_reserved_holds_the_whole_region_and_an_empty_rect_has_an_empty_view():
    store = InstanceStore()
    region = Region((4, 3), "int64", "b")
    _, box = store.instance(region, SYS)
    assert box == region.rect
    assert store.part(region, Rect((2, 0), (2, 3)), SYS).shape == (0, 3)
    assert not store.reserve(region, SYS, Rect((9, 9), (9, 9)))   # empty: asks for nothing


def test_a_rect_outside_its_instance_is_refused_with_the_region_rect_and_memory():
    store = InstanceStore()
    region = Region((8,), "float32", "c")
    store.reserve(region, SYS, Rect((0,), (4,)))
    store.instance(region, SYS)
    with pytest.raises(RuntimeError, match=r"Region\('c'.* Rect\(4:6\) in memory r0.sys0: "
                                           r"its instance there holds Rect\(0:4\) only"):
        store.part(region, Rect((4,), (6,)), SYS)


def test_growing_keeps_what_the_instance_held_and_drops_the_old_views():
    store = InstanceStore()
    region = Region((8, 2), "float64", "d")
    store.reserve(region, SYS, Rect((2, 0), (4, 2)))
    old = store.view(region, Rect((2, 0), (4, 2)), SYS, writable=True)
    old[...] = [[1, 2], [3, 4]]
    assert store.reserve(region, SYS, Rect((6, 0), (8, 2)))   # the instance exists: it must grow
    store.grow(region, SYS)
    inst, box = store.instance(region, SYS)
    assert box == Rect((2, 0), (8, 2)) and inst.shape == (6, 2)
    new = store.view(region, Rect((2, 0), (4, 2)), SYS, writable=False)
    assert new.tolist() == [[1, 2], [3, 4]] and not np.shares_memory(new, old)
    again = store.view(region, Rect((2, 0), (4, 2)), SYS, writable=True)   # (the view cached before the grow)
    assert not np.shares_memory(again, old) and np.shares_memory(again, inst)


def test_a_memory_asked_for_more_after_its_instance_was_made_grows_and_keeps_its_data():
    """Processor 1 writes the first half of a region into its own memory and finishes; then it
    updates the whole region, whose second half processor 0 wrote: its instance grows from the
    half to the whole, the first half kept, and the result is the sequential one."""
    with Runtime(cpus=2, separate_memories=True) as rt:
        mem1 = rt.machine.processors[1].memory
        region = rt.region((8,), "int64", "r")
        first, second = Rect((0,), (4,)), Rect((4,), (8,))

        def write(view, value):
            view[...] = value

        def triple_plus_index(view):
            view[...] = view * 3 + np.arange(view.shape[0])

        rt.launch(write, req(region, WRITE, first), args=(5,), proc=1)
        rt.wait()
        assert rt.store.instance(region, mem1)[1] == first
        rt.launch(write, req(region, WRITE, second), args=(2,), proc=0)
        rt.launch(triple_plus_index, req(region, READ_WRITE), proc=1)
        got = rt.read(region)
        assert rt.store.instance(region, mem1)[1] == region.rect
    assert got.tolist() == [15, 16, 17, 18, 10, 11, 12, 13]


def test_a_data_parallel_step_keeps_each_device_s_share_of_the_activations_not_the_batch():
    """Four devices with memories of their own, a dense layer data parallel: each device's
    instances of its input and output hold its quarter of the batch, and the weights whole."""
    with Runtime(cpus=4, separate_memories=True) as rt:
        model = Model(rt, seed=0)
        x = model.input((16, 8), name="x")
        y = model.dense(x, 6, name="fc")
        model.compile(SGD(lr=0.1), loss="mean_squared_error", output=y,
                      configs={"fc": TileConfig((4, 1, 1), (0, 1, 2, 3))})
        rng = np.random.default_rng(0)
        model.fit(rng.standard_normal((16, 8), np.float32), rng.standard_normal((16, 6), np.float32),
                  iterations=2, verbose=False)
        boxes = {}
        for (uid, memory), box in rt.store.boxes.items():
            boxes.setdefault(memory.index, {})[uid] = box
        out = model._low.values[y.name]
        weight = model._low.params["fc.weight"].value
        for device in (1, 2, 3):
            assert boxes[device][out.uid] == Rect((4 * device, 0), (4 * device + 4, 6)), device
            assert boxes[device][weight.uid] == weight.rect


# ---- releases: generations of instances ---------------------------------------------------------
def _write(view, value):
    view[...] = value


def _double_into(src, dst):
    dst[...] = 2 * src


def _wait_on(view, event):
    event.wait(10)


def test_a_released_region_is_freed_once_its_nodes_have_run_and_written_again_into_a_new_instance():
    with Runtime(cpus=2, separate_memories=True) as rt:
        a, b = rt.region((64,), "float64", "a"), rt.region((64,), "float64", "b")
        mem1 = rt.machine.processors[1].memory
        rt.launch(_write, req(a, WRITE), args=(3.0,), proc=1)
        rt.launch(_double_into, req(a, "R"), req(b, WRITE), proc=1)
        rt.release(a)
        rt.wait()
        assert not [k for k in rt.store.instances if k[0] == a.uid and k[1] == mem1]
        assert rt.store.held[mem1] == 64 * 8 and rt.store.high_water[mem1] == 2 * 64 * 8   # b is left
        rt.launch(_write, req(a, WRITE), args=(5.0,), proc=1)
        rt.launch(_double_into, req(a, "R"), req(b, WRITE), proc=1)
        assert rt.read(b).tolist() == [10.0] * 64
        assert [k[2] for k in rt.store.instances if k[0] == a.uid and k[1] == mem1] == [1]


def test_reading_a_released_region_before_writing_it_is_refused_when_issued():
    with Runtime(cpus=2) as rt:
        a, b = rt.region((8,), "float32", "a"), rt.region((8,), "float32", "b")
        rt.launch(_write, req(a, WRITE), args=(1.0,), proc=0)
        rt.release(a)
        rt.launch(_write, req(a, WRITE, Rect((0,), (4,))), args=(2.0,), proc=0)   # half written again
        with pytest.raises(RuntimeError, match=r"Region\('a'.* Rect\(4:8\) is read by launch #\d+ after its "
                                               r"Runtime.release at node #\d+ with nothing written into it since"):
            rt.launch(_double_into, req(a, "R"), req(b, WRITE), proc=1)
        assert rt.read(a, Rect((0,), (4,))).tolist() == [2.0] * 4
        # an index launch whose second point reads the gone half issues none of its points
        issued, halves = rt._next_id, a.partition((2,))
        with pytest.raises(RuntimeError, match=r"Rect\(4:8\) is read by launch #\d+ after its Runtime.release"):
            rt.index_launch(lambda v: float(v.sum()), halves, req(halves, "R"))
        assert rt._next_id == issued


def test_the_old_instances_go_only_once_every_node_before_the_release_has_run():
    """Processor 0 is held up by a task issued before the release; meanwhile processor 1 writes
    the region again and reads it: it works in a new instance, the old one is kept until the
    held-up task finishes (no Runtime.expect_releases came first, so every node before the
    release counts as a user), and freeing it then leaves the new data alone."""
    with Runtime(cpus=2, separate_memories=True) as rt:
        a, b, gate = (rt.region((16,), "float64", n) for n in ("a", "b", "gate"))
        mem1 = rt.machine.processors[1].memory
        event = threading.Event()
        rt.launch(_wait_on, req(gate, WRITE), args=(event,), proc=0)
        rt.launch(_write, req(a, WRITE), args=(1.0,), proc=1)
        rt.release(a)
        rt.launch(_write, req(a, WRITE), args=(7.0,), proc=1)
        rt.launch(_double_into, req(a, "R"), req(b, WRITE), proc=1)
        deadline = time.monotonic() + 10
        while rt.store.held.get(mem1, 0) < 3 * 16 * 8 and time.monotonic() < deadline:   # a's two and b
            time.sleep(0.001)
        assert sorted(k[2] for k in rt.store.instances if k[0] == a.uid) == [0, 1]
        event.set()
        assert rt.read(b).tolist() == [14.0] * 16
        rt.wait()
        assert [k[2] for k in rt.store.instances if k[0] == a.uid and k[1] == mem1] == [1]
        assert rt.read(a).tolist() == [7.0] * 16


def test_each_memory_frees_its_old_instance_once_the_nodes_there_before_the_release_have_run():
    """A region split over two processors with memories of their own, processor 0 held up by a
    task reading its half: the old instance in processor 1's memory is freed as soon as processor
    1's write has run (a device that runs ahead frees as it goes), the one in processor 0's once
    the held-up task has; then the generation is over. (A first release, of a region nothing
    touched, starts counting who touches each instance: before it every node counts.)"""
    with Runtime(cpus=2, separate_memories=True) as rt:
        a, unused = rt.region((16,), "float64", "a"), rt.region((4,), "float64", "unused")
        mem0, mem1 = (p.memory for p in rt.machine.processors)
        rt.release(unused)
        halves = Rect((0,), (8,)), Rect((8,), (16,))
        event = threading.Event()
        rt.launch(_write, req(a, WRITE, halves[0]), args=(1.0,), proc=0)
        rt.launch(_wait_on, req(a, "R", halves[0]), args=(event,), proc=0)
        rt.launch(_write, req(a, WRITE, halves[1]), args=(2.0,), proc=1)
        rt.release(a)
        deadline = time.monotonic() + 10
        store = rt.store
        while not (store.high_water.get(mem1) == 8 * 8 and store.held[mem1] == 0 and store.held.get(mem0) == 8 * 8):
            assert time.monotonic() < deadline, (store.held, store.high_water)   # memory 1 made and freed its half
            time.sleep(0.001)
        assert [k[1:] for k in rt.store.instances if k[0] == a.uid] == [(mem0, 0)]
        assert rt.store.generations[a.uid][0] == 0   # not over: memory 0 holds it still
        event.set()
        rt.wait()
        assert not [k for k in rt.store.instances if k[0] == a.uid]
        assert rt.store.generations[a.uid] == (1, ())
        assert rt.store.generations[unused.uid] == (1, ())


def test_a_program_s_releases_are_replayed_with_its_nodes():
    """A program that writes, reads and releases a region, issued again and again (recorded,
    then reissued whole): each issue's instance is freed, and the results are right."""
    from taskrt.program import Launch
    with Runtime(cpus=2, separate_memories=True) as rt:
        a, b = rt.region((32,), "float64", "a"), rt.region((32,), "float64", "b")
        mem1 = rt.machine.processors[1].memory
        place = {(): rt.machine.processors[1]}
        program = (Launch(_write, ((),), (req(a, WRITE),), "write", placement=place),
                   Launch(_double_into, ((),), (req(a, "R"), req(b, WRITE)), "double", placement=place,
                          releases=(a,)))
        for step in range(5):
            rt.issue_program("step", program, [(float(step),), ()])
            assert rt.read(b).tolist() == [2.0 * step] * 32
            rt.wait()
            assert not [k for k in rt.store.instances if k[0] == a.uid and k[1] == mem1], step
        assert rt.replay_stats["reissued"] >= 2
        assert rt.store.high_water[mem1] == 2 * 32 * 8
