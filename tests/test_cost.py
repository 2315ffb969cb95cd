"""The cost model: roofline numbers by hand, measured times cached on disk and reused, cost keys,
fitted efficiencies, copies, and peak memory of data- and model-parallel strategies by hand."""
from __future__ import annotations

import dataclasses
import io
import json
import math
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ops.base import TensorSpec
from ops.activation import ElementUnary
from ops.embedding import Embedding
from ops.linear import Dense
from ops.loss import SparseCategoricalCrossEntropy
from ops.lstm import LSTM
from ops.lower import Lowering, TileConfig
from ops.optimizers import SGD, Adam
from strategies.cost import CostModel, Measurement, copy_time, fit_efficiency, op_key, roofline, update_work
from strategies.machine_model import SAME_MEMORY, DeviceSpec, LinkSpec, MachineModel, load_machine
from strategies.memory import box_volume, fits, peak_memory
from taskrt import Runtime
from taskrt.geometry import Rect

GPU = DeviceSpec("gpu", "Test GPU", peak_flops=1e12, mem_bandwidth=1e11, mem_bytes=10**9)


def spec(*shape, dtype="float32", name="x"):
    return TensorSpec(tuple(shape), dtype, name)


def gpu_model(**kw) -> MachineModel:
    host = DeviceSpec("cpu", "Test CPU", 1e11, 1e10, 10**10)
    return MachineModel("test", 1, 2, GPU, LinkSpec(1e10, 1e-6), LinkSpec(1e9, 5e-6, "sender"),
                        kw.pop("efficiency", {"default": 0.5, "dense": 0.25}), host=host,
                        host_link=LinkSpec(5e9, 2e-6), launch_overhead=1e-5, **kw)


def cpu_model(mem_bytes: int = 10**9) -> MachineModel:
    device = DeviceSpec("cpu", "Two cores", 1e10, 1e9, mem_bytes)
    return MachineModel("two", 1, 2, device, LinkSpec(1e9, 1e-5), LinkSpec(1e9, 1e-4), {"default": 0.5})


# ---- analytic -----------------------------------------------------------------------------------------
def test_roofline_of_a_compute_bound_dense_by_hand():
    op = Dense("fc", [spec(64, 512)], 256, use_bias=False)
    tile = Rect.from_shape(op.tile_shape)
    cost = CostModel(gpu_model(), measured=False)
    flops = 64 * 256 * 2 * 512
    nbytes = (64 * 512 + 256 * 512 + 64 * 256) * 4
    assert (op.flops(tile), op.bytes_moved(tile)) == (flops, nbytes)
    assert cost.task_time(op, "forward", tile, GPU) == pytest.approx(flops / (1e12 * 0.25) + 1e-5)
    assert cost.task_time(op, "backward", tile, "gpu") == pytest.approx(2 * flops / (1e12 * 0.25) + 1e-5)
    assert cost.stats == {"measured": 0, "cached": 0, "analytic": 2}


def test_roofline_of_a_memory_bound_relu_by_hand():
    op = ElementUnary("relu", [spec(1024, 1024)], "relu")
    tile = Rect.from_shape(op.tile_shape)
    cost = CostModel(gpu_model(), measured=False)
    nbytes = 2 * 1024 * 1024 * 4
    assert cost.analytic_time(op, "forward", tile, GPU) == pytest.approx(nbytes / 1e11)
    half = Rect((0, 0), (512, 1024))
    assert cost.task_time(op, "forward", half, GPU) == pytest.approx(nbytes / 2 / 1e11 + 1e-5)


def test_the_kernel_slowdown_stretches_the_kernel_and_not_the_launch():
    op = Dense("fc", [spec(64, 512)], 256, use_bias=False)
    tile = Rect.from_shape(op.tile_shape)
    kernel = CostModel(gpu_model(), measured=False).analytic_time(op, "forward", tile, GPU)
    slow = CostModel(gpu_model(kernel_slowdown=1.5), measured=False)
    assert slow.task_time(op, "forward", tile, GPU) == pytest.approx(1.5 * kernel + 1e-5)
    for cap in (kernel / 4, 4 * kernel):   # a surcharge of half the kernel, capped below it and above
        short = CostModel(gpu_model(kernel_slowdown=1.5, kernel_surcharge=0.5, kernel_surcharge_cap=cap), measured=False)
        assert short.task_time(op, "forward", tile, GPU) == pytest.approx(1.5 * kernel + min(0.5 * kernel, cap) + 1e-5)


@pytest.mark.parametrize("dtype,itemsize", [("float32", 4), ("float64", 8)])
def test_update_time_counts_the_optimizers_state(dtype, itemsize):
    """Value, gradient and each state read, value and each state written, in the weight's own
    dtype (a fixed 4-byte itemsize timed a float64 weight's update as fast as a float32's)."""
    op = Dense("fc", [spec(8, 100, dtype=dtype)], 100)
    shard = Rect((0, 0), (50, 100))
    mm = gpu_model(efficiency={"default": 1.0})
    for optimizer, states in ((SGD(lr=0.1), 0), (SGD(lr=0.1, momentum=0.9), 1), (Adam(), 2)):
        cost = CostModel(mm, measured=False, optimizer=optimizer)
        nbytes = 5000 * itemsize * (3 + 2 * states)
        assert cost.task_time(op, "update", shard, GPU, param="fc.weight") == pytest.approx(nbytes / 1e11 + 1e-5)


def test_update_work_counts_two_flops_plus_four_a_state_an_element():
    """Adam keeps two states: 2 + 4 * 2 = 10 flops an element, and reads value, gradient and both
    states and writes value and both (7 arrays). Updates are memory bound, so a wrong flop count
    hides from the times: checked here directly."""
    assert update_work(Adam(), 1000, 4) == (10_000.0, 1000 * 4 * 7.0)
    assert update_work(SGD(lr=0.1, momentum=0.9), 1000, 8) == (6_000.0, 1000 * 8 * 5.0)
    assert update_work(SGD(lr=0.1), 1000, 4) == (2_000.0, 1000 * 4 * 3.0)


def test_processors_and_kinds_name_devices():
    mm = gpu_model()
    machine = mm.to_machine()
    cost = CostModel(mm, measured=False)
    gpu = next(p for p in machine.processors if p.kind == "gpu")
    cpu = next(p for p in machine.processors if p.kind == "cpu")
    assert cost.device(gpu) is GPU and cost.device("gpu") is GPU
    assert cost.device(cpu) is mm.host and cost.device("cpu") is mm.host
    with pytest.raises(ValueError, match=r"no 'tpu' device"):
        cost.device("tpu")


def test_a_cpu_worker_is_measured_with_its_share_of_the_hosts_cores(monkeypatch):
    """As the runtime's limit_blas_threads: the host's cores over its ranks' workers."""
    import strategies.cost as cost_module
    monkeypatch.setattr(cost_module, "node_cores", lambda: 8)
    alone = dataclasses.replace(cpu_model(), nodes=2)            # two hosts of two workers each
    shared = dataclasses.replace(alone, devices_per_node=1, nodes_per_host=2)   # two ranks of one host
    assert CostModel(alone).device_tag(alone.device).endswith("/4t")
    assert CostModel(shared).device_tag(shared.device).endswith("/4t")
    assert CostModel(dataclasses.replace(alone, nodes_per_host=2)).device_tag(alone.device).endswith("/2t")
    assert CostModel(gpu_model()).device_tag(gpu_model().host).endswith("/8t")   # a GPU machine's host: all
    assert dataclasses.replace(alone, nodes_per_host=2).with_nodes(1).nodes_per_host == 1
    for wrong in (0, 3, True, 1.0):
        with pytest.raises(ValueError, match=r"two: nodes_per_host must be a whole number from 1 to its 2 node"):
            dataclasses.replace(alone, nodes_per_host=wrong)


def test_copy_fill_and_fold_times():
    link = LinkSpec(1e10, 2e-6)
    assert copy_time(10**6, link) == pytest.approx(2e-6 + 1e-4)
    assert copy_time(0, link) == 2e-6
    assert copy_time(10**9, SAME_MEMORY) == 0.0
    cost = CostModel(gpu_model(), measured=False)
    assert cost.copy_time(10**6, link) == copy_time(10**6, link)
    assert cost.fill_time(10**6, GPU) == pytest.approx(1e-5 + 1e-5)
    assert cost.fold_time(10**6, GPU) == pytest.approx(3e-5 + 1e-5)


def test_a_batch_source_is_measured_per_sample_where_the_host_is_measured(tmp_path):
    """A measured source's seconds a sample scale with the share and stretch like kernels; where the
    device is not measured, the batch is written at memory bandwidth as a fill."""
    mm = dataclasses.replace(load_machine("local"), kernel_slowdown=1.5, kernel_surcharge=0.5, kernel_surcharge_cap=1e-4,
                             launch_overhead=1e-4)
    calls = []

    def source(step, lo, hi):
        calls.append((step, lo, hi))
        time.sleep(2e-3)
        return np.zeros((hi - lo, 4), np.float32), np.zeros(hi - lo, np.int64)

    cost = CostModel(mm, cache_path=tmp_path / "c.json")
    assert cost.source_time(8, 10**6, mm.device) == pytest.approx(10**6 / mm.device.mem_bandwidth + 1e-4)
    per_sample = cost.measure_source(source, 4, runs=3)
    assert [c[1:] for c in calls] == [(0, 4)] * 4 and len({c[0] for c in calls}) == 4   # a new step each call
    assert 2e-3 / 4 <= per_sample < 2e-2 / 4
    assert cost.source_time(8, 10**6, mm.device) == pytest.approx(8 * per_sample * 1.5 + min(8 * per_sample * 0.5, 1e-4)
                                                                  + 1e-4)
    analytic = CostModel(mm, measured=False, cache_path=tmp_path / "c.json")
    analytic.source_per_sample = per_sample
    assert analytic.source_time(8, 10**6, mm.device) == pytest.approx(10**6 / mm.device.mem_bandwidth + 1e-4)
    with pytest.raises(ValueError, match="measure_source: samples"):
        cost.measure_source(source, 0)


@given(nbytes=st.lists(st.integers(0, 2**40), min_size=1, max_size=20),
       bandwidths=st.lists(st.sampled_from([1e9, 3.7e9, 1.2e10, 2.5e11, math.inf]), min_size=1, max_size=20),
       folds=st.lists(st.booleans(), min_size=1, max_size=20))
def test_copy_times_of_many_copies_are_transfer_and_fold_times_one_by_one(nbytes, bandwidths, folds):
    """The simulator times a region's copies in one vectorized call: bit for bit what
    transfer_time and fold_time give copy by copy (delta simulation must equal full)."""
    cost = CostModel(gpu_model(), measured=False)
    n = min(len(nbytes), len(bandwidths), len(folds))
    nbytes, bandwidths, folds = nbytes[:n], bandwidths[:n], folds[:n]
    dst_bandwidth = cost.device(GPU).mem_bandwidth
    got = cost.copy_times(np.array(nbytes, np.int64), np.array(bandwidths), np.full(n, dst_bandwidth),
                          np.array(folds))
    for b, bw, fold, seconds in zip(nbytes, bandwidths, folds, got.tolist()):
        one = cost.transfer_time(b, LinkSpec(bw, 1e-6)) if math.isfinite(bw) else 0.0
        if fold:
            one += cost.fold_time(b, GPU)
        assert seconds == one


# ---- which devices are measured ------------------------------------------------------------------
def test_devices_that_are_not_here_are_analytic(tmp_path):
    local = load_machine("local")
    assert CostModel(local, cache_path=tmp_path / "c.json").measures(local.device)
    assert not CostModel(local, measured=False, cache_path=tmp_path / "c.json").measures(local.device)
    p100 = load_machine("p100")
    assert not CostModel(p100).measures(p100.device)  # TASKRT_GPUS=0 in tests, and no P100 here
    assert not CostModel(p100).measures(p100.host)  # another CPU model
    assert CostModel(p100, measured=True).measures(p100.host)  # measured=True: any CPU is measured here
    with pytest.raises(ValueError, match=r"measured must be True, False or None, got 'yes'"):
        CostModel(p100, measured="yes")


# ---- measured and cached -------------------------------------------------------------------------
class CountingDense(Dense):
    """A dense layer that counts its kernel calls (not registered: it is the same op kind)."""

    calls = {"forward": 0, "backward": 0}

    def forward(self, *args, **kwargs):
        CountingDense.calls["forward"] += 1
        return super().forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        CountingDense.calls["backward"] += 1
        return super().backward(*args, **kwargs)


def test_measured_times_are_cached_on_disk_and_reused(tmp_path):
    path = tmp_path / "costs.json"
    mm = load_machine("local")
    op = CountingDense("fc", [spec(16, 32)], 24, activation="relu")
    tile = Rect((0, 0, 0), (8, 24, 32))
    CountingDense.calls.update(forward=0, backward=0)
    cost = CostModel(mm, cache_path=path, repeats=3, warmup=1)
    fwd = cost.task_time(op, "forward", tile, mm.device)
    bwd = cost.task_time(op, "backward", tile, mm.device)
    assert fwd > mm.launch_overhead and bwd > mm.launch_overhead
    assert CountingDense.calls == {"forward": 4, "backward": 4}  # one warm-up and 3 runs, both phases at once
    assert cost.stats == {"measured": 1, "cached": 1, "analytic": 0}
    entries = json.loads(path.read_text())["entries"]
    key = cost.key(op, "forward", tile, mm.device)
    # the cache keeps the kernel alone; a task adds the run's slowdown and its launch
    assert mm.kernel_seconds(entries[key.text]["seconds"]) == pytest.approx(fwd - mm.launch_overhead)
    again = CostModel(mm, cache_path=path)
    assert again.task_time(op, "forward", tile, mm.device) == fwd
    assert again.task_time(op, "backward", tile, mm.device) == bwd
    assert CountingDense.calls == {"forward": 4, "backward": 4}
    assert again.stats == {"measured": 0, "cached": 2, "analytic": 0}


def test_a_kernel_too_big_for_the_device_is_timed_by_the_roofline_not_run(tmp_path, monkeypatch):
    """A search at a huge batch on `local` asked the measured model for tiles of petabytes, and
    the measurement's allocation crashed it: such a tile (twice its forward's bytes over the
    device's memory) is not run; nor is one this machine cannot allocate, once it failed."""
    mm = dataclasses.replace(load_machine("local"), device=dataclasses.replace(load_machine("local").device,
                                                                                mem_bytes=10_000))
    op = CountingDense("fc", [spec(16, 32)], 24)
    big, small = Rect((0, 0, 0), (16, 24, 32)), Rect((0, 0, 0), (2, 2, 32))
    CountingDense.calls.update(forward=0, backward=0)
    cost = CostModel(mm, cache_path=tmp_path / "costs.json", repeats=1, warmup=0)
    assert not cost.runnable(op, "forward", big, mm.device) and cost.runnable(op, "forward", small, mm.device)
    t = cost.task_time(op, "backward", big, mm.device)
    assert t == mm.kernel_seconds(cost.analytic_time(op, "backward", big, mm.device)) + mm.launch_overhead
    assert cost.measure_all([(op, "forward", big, mm.device)]) == 0
    assert CountingDense.calls == {"forward": 0, "backward": 0} and cost.stats["analytic"] == 1

    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 22.7 PiB")
    import strategies.cost as cost_module
    monkeypatch.setattr(cost_module, "measure_tile", no_memory)
    t = cost.task_time(op, "forward", small, mm.device)
    assert t == mm.kernel_seconds(cost.analytic_time(op, "forward", small, mm.device)) + mm.launch_overhead
    assert not cost.runnable(op, "backward", small, mm.device)   # not tried again, either phase
    assert cost.stats == {"measured": 1, "cached": 0, "analytic": 2}
    assert not (tmp_path / "costs.json").exists() or "fc" not in (tmp_path / "costs.json").read_text()


def test_a_cache_that_is_a_folder_is_refused_before_any_measuring(tmp_path, capsys):
    """It used to be read as no cache, then calibrate's measuring ended in a traceback from the write."""
    from strategies.cost import main
    with pytest.raises(ValueError, match=f"CostModel: the cost cache {tmp_path} is a folder, not a file"):
        CostModel(load_machine("local"), cache_path=tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--cache", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"error: the cost cache {tmp_path} is a folder" in err
    assert list(tmp_path.iterdir()) == []


def _record_out(monkeypatch, cls, method: str) -> list:
    """The `out=` that each call of cls.method is given, in a list, the method spied on for the test."""
    seen = []
    original = getattr(cls, method)

    def spy(self, *args, out=None, **kw):
        seen.append(out)
        return original(self, *args, out=out, **kw)
    monkeypatch.setattr(cls, method, spy)
    return seen


def test_a_backward_of_the_weight_gradients_alone_is_measured_with_the_input_gradient_skipped(tmp_path,
                                                                                                monkeypatch):
    mm = load_machine("local")
    op = Dense("fc", [spec(16, 32)], 24, activation="relu")
    tile = Rect.from_shape(op.tile_shape)
    seen = _record_out(monkeypatch, Dense, "backward")
    cost = CostModel(mm, cache_path=tmp_path / "costs.json", repeats=2, warmup=0)
    assert cost.task_time(op, "backward_weights", tile, mm.device) > mm.launch_overhead
    assert seen == [[False], [False]]  # every run told that no one reads dx
    assert cost.key(op, "backward_weights", tile, mm.device) != cost.key(op, "backward", tile, mm.device)
    cost.task_time(op, "backward", tile, mm.device)
    # the full backward is offered dx's place, as lowering offers it: a C-contiguous view of the input's
    assert [(len(o), o[0].shape, o[0].flags.c_contiguous) for o in seen[2:]] == [(1, (16, 32), True)] * 2
    flops = {ph: cost.work(op, ph, tile)[0] for ph in ("forward", "backward", "backward_weights")}
    assert flops["backward_weights"] == flops["forward"] < flops["backward"]


@pytest.mark.parametrize("steps", [(0, 4), (4, 8), (8, 12), (0, 12)])
def test_an_lstm_chunk_of_its_steps_is_measured_with_the_carries_lowering_hands_it(tmp_path, monkeypatch, steps):
    """A tile that is a chunk of the ordered dim gets carry arrays at its carry rects, forward and
    backward (the LSTM refuses a middle chunk without them); the whole dim gets carry=None."""
    mm = load_machine("local")
    op = LSTM("lstm", [TensorSpec((4, 12, 8), "float32", "x")], hidden_size=6)
    tile = Rect((0, steps[0], 0), (4, steps[1], 6))
    seen = []
    forward, backward = LSTM.forward, LSTM.backward

    def spy_forward(self, *args, carry=None, **kw):
        seen.append(("forward", None if carry is None else {k: v.shape for k, v in carry.items()}))
        return forward(self, *args, carry=carry, **kw)

    def spy_backward(self, *args, carry=None, **kw):
        seen.append(("backward", None if carry is None else {k: v.shape for k, v in carry.items()}))
        return backward(self, *args, carry=carry, **kw)

    monkeypatch.setattr(LSTM, "forward", spy_forward)
    monkeypatch.setattr(LSTM, "backward", spy_backward)
    cost = CostModel(mm, cache_path=tmp_path / "costs.json", repeats=2, warmup=0)
    assert cost.task_time(op, "forward", tile, mm.device) > mm.launch_overhead
    carry = None if steps == (0, 12) else {"state": (2, 4, 6)}
    assert seen == [("forward", carry), ("backward", carry)] * 2


def test_measure_all_measures_each_key_once_with_a_progress_line(tmp_path):
    mm = load_machine("local")
    emb = Embedding("emb", [spec(6, 5, dtype="int64", name="idx")], 50, 8)
    dense = Dense("fc", [spec(6, 5, 8)], 16)
    loss = SparseCategoricalCrossEntropy("loss", [spec(6, 16), spec(6, dtype="int64", name="labels")],
                                         from_logits=True)
    halves = [Rect((0, 0, 0, 0), (3, 5, 8, 50)), Rect((3, 0, 0, 0), (6, 5, 8, 50))]  # same shape: one key
    tasks = [(emb, ph, r, mm.device) for r in halves for ph in ("forward", "backward")]
    tasks += [(dense, "forward", Rect.from_shape(dense.tile_shape), mm.device),
              (loss, "backward", Rect.from_shape(loss.tile_shape), mm.device),
              (dense, "update", Rect((0, 0), (8, 8)), mm.device, "weight")]
    out = io.StringIO()
    cost = CostModel(mm, cache_path=tmp_path / "costs.json", repeats=1, warmup=0, progress=out)
    assert cost.measure_all(tasks) == 4  # emb, dense, loss (forward and backward each), the update
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("measuring 4 kernels on cpu:") and lines[-1].startswith("measured 4 kernels on cpu:")
    assert cost.measure_all(tasks) == 0
    assert all(cost.task_time(*t) > 0 for t in tasks)
    assert cost.stats["measured"] == 4


def test_progress_rewrites_one_line_on_a_terminal(tmp_path):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    mm = load_machine("local")
    ops = [ElementUnary(f"relu{i}", [spec(4, 8 + i)], "relu") for i in range(3)]
    cost = CostModel(mm, cache_path=tmp_path / "costs.json", repeats=1, warmup=0, progress=out)
    cost.measure_all([(op, "forward", Rect.from_shape(op.tile_shape), "cpu") for op in ops])
    text = out.getvalue()
    assert text.count("\n") == 1 and text.count("\r") >= 3 and "measured 3 kernels" in text


# ---- cost keys ------------------------------------------------------------------------------------
def test_cost_keys_are_stable_text():
    op = Dense("fc", [spec(64, 512)], 256)
    key = op_key(op, "forward", Rect((0, 0, 0), (32, 256, 512)), "cpu:X/1t")
    assert key.text == ('["dense",{"activation":null,"out_features":256,"use_bias":true},"forward",[32,256,512],'
                        '[[32,512]],[["bias",[256]],["weight",[256,512]]],["float32"],"cpu:X/1t"]')
    assert key == op_key(Dense("other", [spec(64, 512, name="y")], 256), "forward",
                         Rect((32, 0, 0), (64, 256, 512)), "cpu:X/1t")
    assert hash(key) == hash(op_key(op, "forward", Rect((0, 0, 0), (32, 256, 512)), "cpu:X/1t"))
    assert str(key) == "dense forward [32x256x512] on cpu:X/1t"


def test_cost_keys_tell_shapes_attrs_phases_dtypes_and_devices_apart():
    tile = Rect((0, 0, 0), (32, 256, 512))
    base = op_key(Dense("fc", [spec(64, 512)], 256), "forward", tile, "cpu:X/1t")
    others = [
        op_key(Dense("fc", [spec(64, 512)], 256), "forward", Rect((0, 0, 0), (16, 256, 512)), "cpu:X/1t"),
        op_key(Dense("fc", [spec(64, 512)], 256, activation="relu"), "forward", tile, "cpu:X/1t"),
        op_key(Dense("fc", [spec(64, 512)], 256, use_bias=False), "forward", tile, "cpu:X/1t"),
        op_key(Dense("fc", [spec(64, 512)], 256), "backward", tile, "cpu:X/1t"),
        op_key(Dense("fc", [spec(64, 512, dtype="float64")], 256), "forward", tile, "cpu:X/1t"),
        op_key(Dense("fc", [spec(64, 512)], 256), "forward", tile, "cpu:X/2t"),
        # a bias-less tile of a partial (reduce) group reads no bias
        op_key(Dense("fc", [spec(64, 1024)], 256), "forward", Rect((0, 0, 512), (32, 256, 1024)), "cpu:X/1t"),
    ]
    texts = {base.text} | {k.text for k in others}
    assert len(texts) == 1 + len(others)


# ---- fitting ---------------------------------------------------------------------------------------
def test_fit_efficiency_recovers_known_efficiencies():
    rng = np.random.default_rng(0)
    truth = {"dense": 0.37, "conv2d": 0.61}
    samples = []
    for kind, eff in truth.items():
        for _ in range(6):
            flops, nbytes = float(rng.uniform(1e9, 1e11)), float(rng.uniform(1e5, 1e7))
            samples.append(Measurement(kind, flops, nbytes, roofline(flops, nbytes, GPU, eff)))
    for _ in range(4):  # memory-bound: any efficiency above a bound explains them
        nbytes = float(rng.uniform(1e8, 1e9))
        samples.append(Measurement("unary", nbytes / 4, nbytes, roofline(nbytes / 4, nbytes, GPU, 0.5)))
    fitted = fit_efficiency(samples, GPU)
    assert fitted["dense"] == pytest.approx(0.37, rel=1e-4)
    assert fitted["conv2d"] == pytest.approx(0.61, rel=1e-4)
    assert 0.0 < fitted["default"] <= 1.0
    for s in samples:
        if s.kind == "unary":
            assert roofline(s.flops, s.bytes, GPU, fitted["unary"]) == pytest.approx(s.seconds)
    with pytest.raises(ValueError, match="no measurements"):
        fit_efficiency([], GPU)


def test_kernels_faster_than_the_device_s_peak_are_said_to_be():
    """The local machine file's peak is one CPU's: on a faster core every efficiency came out 1.0
    with no word of why."""
    samples = [Measurement("dense", 1e10, 1.0, roofline(1e10, 1.0, GPU, 1.0) / 2)]   # twice the peak
    with pytest.warns(UserWarning, match=r"a dense kernel ran at 2000 GFLOP/s, over DeviceSpec\(gpu .*'s peak "
                                         r"of 1000: efficiencies stop at 1, so raise the machine file's device "
                                         r"peak_flops"):
        assert fit_efficiency(samples, GPU)["dense"] == 1.0


def test_fit_efficiency_is_a_least_squares_fit_of_noisy_times():
    rng = np.random.default_rng(1)
    samples = []
    for _ in range(40):
        flops = float(rng.uniform(1e9, 1e11))
        samples.append(Measurement("dense", flops, 1.0, roofline(flops, 1.0, GPU, 0.5) * rng.uniform(0.95, 1.05)))
    assert fit_efficiency(samples, GPU)["dense"] == pytest.approx(0.5, rel=0.02)


# ---- memory -----------------------------------------------------------------------------------------
def _mlp():
    """x [8, 16] -> dense 32 -> dense 4 -> cross-entropy with labels [8], no biases."""
    x, labels = spec(8, 16), spec(8, dtype="int64", name="labels")
    fc1 = Dense("fc1", [x], 32, use_bias=False)
    fc2 = Dense("fc2", [fc1.outputs[0]], 4, use_bias=False)
    loss = SparseCategoricalCrossEntropy("loss", [fc2.outputs[0], labels], from_logits=True)
    return [fc1, fc2, loss]


def test_peak_memory_data_parallel_by_hand():
    ops = _mlp()
    dp = {"fc1": TileConfig((2, 1, 1), (0, 1)), "fc2": TileConfig((2, 1, 1), (0, 1)),
          "loss": TileConfig((2,), (0, 1))}
    peak = peak_memory((ops, dp), cpu_model(), optimizer=SGD(lr=0.1, momentum=0.9))
    activations = (4 * 16 + 4 * 32 + 4 * 4 + 4) * 4 + 4 * 8  # x, h, y, loss rows; labels (int64)
    gradients = (4 * 32 + 4 * 4 + 4) * 4  # of h, y and the loss: each device's rows
    weights = (32 * 16 + 4 * 32) * 4  # each device holds every weight, and sums its whole gradient in a buffer
    # the gradients are folded into the weights' shards, where momentum lives too: fc1.weight (2 KiB)
    # in two halves; fc2.weight (512 B, under two of ops.lower.MIN_SHARD_BYTES) whole, on device 1
    # (the second update turns to it)
    shards = {0: 32 * 16 * 4 // 2, 1: 32 * 16 * 4 // 2 + 4 * 32 * 4}
    # device 0 is rank 0's host too: it keeps the momentum attached there whole at the start
    # (fc1's other half, fc2's) and the whole batch the source writes (x's and the labels' other rows)
    host = {0: 32 * 16 * 4 // 2 + 4 * 32 * 4 + 4 * 16 * 4 + 4 * 8, 1: 0}
    assert peak == {d: activations + gradients + 2 * weights + 2 * shards[d] + host[d] for d in (0, 1)}
    assert peak == {0: 10464, 1: 9664}
    # on GPUs (processors 1 and 2, after the host CPU) a step releases its activations, and a buffer
    # lives from its backward until folded: the peak is at fc1's backward, when both weights' buffers
    # are live and y, the loss's rows and their gradients are gone; the host keeps the weights and
    # their momentum whole, as attached, and the whole batch
    freed = 2 * (4 * 4 * 4 + 4 * 4)
    released = peak_memory((ops, dp), gpu_model(), optimizer=SGD(lr=0.1, momentum=0.9))
    on_host = 2 * weights + 8 * 16 * 4 + 8 * 8
    assert released == {0: on_host, **{d + 1: activations + gradients - freed + 2 * weights + 2 * shards[d]
                                       for d in (0, 1)}}


def test_peak_memory_model_parallel_by_hand():
    ops = _mlp()
    mp = {"fc1": TileConfig((1, 1, 1), (0,)), "fc2": TileConfig((1, 1, 1), (1,)), "loss": TileConfig((1,), (1,))}
    peak = peak_memory((ops, mp), cpu_model(), optimizer=SGD(lr=0.1, momentum=0.9))
    w1, w2 = 32 * 16 * 4, 4 * 32 * 4
    # one tile a weight writes its whole gradient: no buffer, no shards
    # device 0, rank 0's host, also keeps fc2's weight and momentum attached there, and the labels
    host = 2 * w2 + 8 * 8
    assert peak == {0: (8 * 16 + 8 * 32) * 4 + 8 * 32 * 4 + 3 * w1 + host,  # x, h, h's gradient; fc1's weight,
                    1: (8 * 32 + 8 * 4 + 8) * 4 + 8 * 8 + (8 * 32 + 8 * 4 + 8) * 4 + 3 * w2}  # gradient, momentum;
    assert peak == {0: 9792, 1: 3968}                          # h, y, loss, labels, their gradients; fc2's three
    # released (on GPUs, processors 1 and 2): the first peaks at fc1's backward, as before, less
    # what the host keeps (both weights and their momentum as attached, the batch); the second at
    # fc2's, once the loss's rows and their gradient are gone
    released = peak_memory((ops, mp), gpu_model(), optimizer=SGD(lr=0.1, momentum=0.9))
    assert released == {0: 2 * (w1 + w2) + 8 * 16 * 4 + 8 * 8, 1: 9792 - host, 2: 3968 - 64}
    dp = {"fc1": TileConfig((2, 1, 1), (0, 1)), "fc2": TileConfig((2, 1, 1), (0, 1)),
          "loss": TileConfig((2,), (0, 1))}
    small = cpu_model(mem_bytes=9700)
    assert fits((ops, dp), small, optimizer=SGD(lr=0.1))
    assert not fits((ops, mp), small, optimizer=SGD(lr=0.1, momentum=0.9))


def test_peak_memory_of_a_lowering_and_without_optimizer_state():
    ops = _mlp()
    mm = cpu_model()
    machine = mm.to_machine()
    mp = {"fc1": TileConfig((1, 1, 1), (0,)), "fc2": TileConfig((1, 1, 1), (1,)), "loss": TileConfig((1,), (1,))}
    with Runtime(machine, execute=False) as rt:
        low = Lowering(rt, ops, [ops[0].inputs[0], ops[2].inputs[1]], mp, optimizer=SGD(lr=0.1), loss="loss")
        assert peak_memory(low, mm) == {0: 9792 - 2048 - 512, 1: 3968 - 512}  # plain SGD keeps no state


def test_box_volume_is_the_smallest_box_holding_the_rects():
    a, b = Rect((0, 0), (4, 4)), Rect((2, 2), (6, 6))
    assert box_volume([a, b]) == 36
    assert box_volume([a, a, Rect((4, 0), (8, 4))]) == 32
    assert box_volume([Rect((0,), (0,))]) == 0 and box_volume([]) == 0
    assert box_volume([a, Rect((9, 9), (9, 9)), Rect((1, 1), (2, 2))]) == 16   # an empty rect adds nothing


def test_calibrate_command_refuses_bad_flags_before_measuring(capsys):
    from strategies.cost import main
    for argv, says in ((["calibrate", "--machine", "nosuch"], "--machine nosuch: machine 'nosuch': no such file"),
                       (["calibrate", "--machine", "p100"], "--machine p100: its device"),
                       (["calibrate", "--repeats", "0"], "--repeats 0: must be at least 1")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err


def test_a_tile_is_measured_as_the_runtime_hands_it_a_view_and_writes_its_results(monkeypatch):
    """A tile cut along its last dim reads a strided view of a full-size array (the runtime's
    instance), and what its kernels return is written into views of full-size arrays, as
    lowering does (values checked: the views hold the kernels' results)."""
    from strategies import measure
    op = ElementUnary("r", [spec(4, 6, 8)], "relu")
    tile = Rect((0, 0, 2), (4, 6, 6))
    seen, written = [], []
    forward, write_back = ElementUnary.forward, measure._write_back

    def spy(self, xp, tile, inputs, *args, **kw):
        seen.append((inputs[0].shape, inputs[0].flags.c_contiguous, inputs[0].base.shape))
        return forward(self, xp, tile, inputs, *args, **kw)

    def spy_write(views, arrays):
        write_back(views, arrays)
        written.append([(v.shape, v.flags.c_contiguous, np.array_equal(v, a)) for v, a in zip(views, arrays)])

    monkeypatch.setattr(ElementUnary, "forward", spy)
    monkeypatch.setattr(measure, "_write_back", spy_write)
    measure.measure_tile(op, tile, measure.Backend("cpu", 1), runs=1, warmup=0)
    assert seen == [((4, 6, 4), False, (4, 6, 8))]
    assert written == [[((4, 6, 4), False, True)]] * 2   # the output, then the input's gradient


@pytest.mark.parametrize("hi, offered", [((8, 24, 32), True), ((16, 12, 32), False)])
def test_a_writes_out_kernel_is_offered_its_view_only_where_lowering_would(monkeypatch, hi, offered):
    """Lowering offers a `writes_out` kernel the view of its result where that is C-contiguous (a
    tile cut along the batch), else None (cut along an inner dim): the measurement does the same."""
    from strategies import measure
    op = Dense("fc", [spec(16, 32)], 24)
    seen = _record_out(monkeypatch, Dense, "forward")
    measure.measure_tile(op, Rect((0, 0, 0), hi), measure.Backend("cpu", 1), runs=1, warmup=0)
    assert len(seen) == 1 and len(seen[0]) == 1   # one run; the tile space is (batch, out, in)
    assert all((o[0] is not None) == offered for o in seen)
    assert all(o[0] is None or (o[0].shape == hi[:2] and o[0].base.shape == (16, 24)) for o in seen)
