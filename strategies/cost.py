"""The cost model: the seconds each task of a simulated iteration takes on a machine model.

- *Measured*: an op tile's forward and backward kernels run on a device that is here (this
  machine's CPU; a GPU cupy sees), on random arrays at exactly the rects the tile reads (views
  of full-size arrays, as the runtime's instances are, its results written into such views),
  `repeats` times after `warmup` runs; the median is kept in a JSON file by cost key
  (CostKey), so later runs and searches reuse it. `measure_all` measures many with a
  progress bar. Optimizer updates of weight shards are measured the same way.
- *Analytic*, for devices that are not here: a roofline, max(flops / (peak * efficiency of
  the op kind), bytes / memory bandwidth), from the op's own `flops(tile)` and
  `bytes_moved(tile)`; backward is twice forward in both unless the op has
  `backward_flops(tile)` / `backward_bytes(tile)`. `fit_efficiency` fits the efficiencies
  to measurements (`python -m strategies.cost calibrate --machine local --write` refits a
  machine file where its device is here).
- A kernel's seconds, measured or analytic, become its seconds inside a run by the machine's
  `kernel_seconds` (times `kernel_slowdown`, plus a surcharge for short kernels), and every task
  adds its `launch_overhead`. Copies take latency + bytes / bandwidth
  of their link: the bytes occupy the link (the simulator queues copies on
  MachineModel.channel, one at a time), the latency is time in flight that the next copy
  overlaps; fills and folds are tasks on the device, bound by its memory bandwidth.
- A step's batch source (each rank's share, Model.train_on): the app's source measured here
  per sample (`measure_source`) on a device this model measures; elsewhere the batch written
  once at memory bandwidth, as a fill.

Which devices are measured (`CostModel(measured=...)`): False none; True every device whose
kind is here (a CPU always, a GPU where cupy sees one); None (default) the devices that are
this machine's own (the same CPU or GPU model name), so a `local` model is measured and a
p100 model simulated on a laptop is analytic. Kernels are run by strategies/measure.py;
memory accounting is in strategies/memory.py.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ops.base import Op, TensorSpec
from ops.optimizers import SGD
from strategies.machine_model import (DeviceSpec, LinkSpec, MachineError, MachineModel, cpu_name, load_machine,
                                      write_efficiency, write_problem)
from strategies.measure import Backend, Progress, measure_source, measure_tile, measure_update
from taskrt.cores import node_cores
from taskrt.geometry import Rect, as_int
from taskrt.machine import Processor, count_gpus, gpus_from_env

PHASES = ("forward", "backward", "backward_weights", "update")
#: the cost cache's format and kernel generation: raised when the kernels' speed changes (2: Winograd,
#: 1x1 GEMMs, fused row kernels; 3: measured with freed memory kept, taskrt.heap, and kernels that
#: write into the runtime's views; 4: channels-last Winograd, now also on small images; 5: direct
#: convolution for 3x3 layers of few input channels; 6: tiles measured as views of full-size
#: arrays, their results written into such views, as the runtime runs them; 7: strided 3x3
#: convolutions as Winograd over phase rows, the LSTM's recurrent steps in tiles that fit AVX2's
#: registers), so that measurements of the old kernels are not reused
CACHE_VERSION = 7
#: the kind the analytic model files optimizer updates under (its efficiency entry)
UPDATE_KIND = "update"


def default_cache_path() -> Path:
    """TASKRT_COST_CACHE, else $XDG_CACHE_HOME/taskrt/costs.json, else ~/.cache/taskrt/costs.json."""
    env = os.environ.get("TASKRT_COST_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "taskrt" / "costs.json"


def cache_problem(path) -> str | None:
    """Why `path` cannot be a cost cache (a folder stands there), or None: asked before any kernel
    is measured, so that no measurement is lost when the cache is written."""
    if Path(path).is_dir():
        return f"the cost cache {path} is a folder, not a file (TASKRT_COST_CACHE or --cache names the file)"
    return None


def copy_time(nbytes: int, link: LinkSpec) -> float:
    """Seconds one copy of `nbytes` takes on `link`: its latency plus bytes over its bandwidth."""
    return 0.0 if math.isinf(link.bandwidth) else link.latency + transfer_time(nbytes, link)


def transfer_time(nbytes: int, link: LinkSpec) -> float:
    """Seconds the bytes of one copy occupy `link` (its bandwidth term, without the latency)."""
    if math.isinf(link.bandwidth):
        return 0.0
    return _transfer_seconds(nbytes, link.bandwidth)


# The arithmetic of a copy's and a fold's seconds, on numbers or on arrays of many copies
# (CostModel.copy_times): one formula, so that the simulator's vectorized costs equal these.
def _transfer_seconds(nbytes, bandwidth):
    return np.maximum(nbytes, 0) / bandwidth


def _fold_seconds(nbytes, mem_bandwidth, launch_overhead):
    return 3 * nbytes / mem_bandwidth + launch_overhead


def roofline(flops: float, nbytes: float, device: DeviceSpec, efficiency: float) -> float:
    """Kernel seconds: the slower of computing at `efficiency` of peak and moving bytes at full bandwidth."""
    return max(flops / (device.peak_flops * efficiency), nbytes / device.mem_bandwidth)


# ---- cost keys ---------------------------------------------------------------------------------------
def _plain(value):
    """An attribute value as stable JSON data (tuples as lists, numpy scalars as numbers)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in sorted(value.items())}
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


@dataclass(frozen=True)
class CostKey:
    """What a kernel's time depends on: op kind and attributes, phase, the tile's shape, the
    shapes of the input and weight rects it reads, the inputs' dtypes, and the device (its
    tag and, on CPUs, BLAS threads). `text` is its stable JSON, the disk cache's key."""

    kind: str
    attrs: str
    phase: str
    tile: tuple[int, ...]
    inputs: tuple[tuple[int, ...], ...]
    weights: tuple[tuple[str, tuple[int, ...]], ...]
    dtypes: tuple[str, ...]
    device: str

    def __str__(self) -> str:
        shape = "x".join(map(str, self.tile)) or "scalar"
        return f"{self.kind} {self.phase} [{shape}] on {self.device}"

    @property
    def text(self) -> str:
        return json.dumps([self.kind, json.loads(self.attrs), self.phase, self.tile, self.inputs,
                           [[k, s] for k, s in self.weights], self.dtypes, self.device], separators=(",", ":"))


def op_key(op: Op, phase: str, tile: Rect, device: str) -> CostKey:
    """The cost key of an op tile's forward or backward kernel on a device tag."""
    rects = op.tile_weight_rects(tile)
    return CostKey(op.kind, json.dumps(_plain(op.attrs()), sort_keys=True, separators=(",", ":")), phase,
                   tile.shape, tuple(r.shape for r in op.input_rects(tile)),
                   tuple((k, r.shape) for k, r in sorted(rects.items()) if not r.empty),
                   tuple(t.dtype for t in op.inputs), device)


def update_key(optimizer, shard: Rect, dtype: str, device: str) -> CostKey:
    """The cost key of an optimizer update of a weight shard: the optimizer's kind and which of its
    terms are on (hyperparameters that are zero skip work; their values do not change the kernel)."""
    terms = {k: (v != 0 if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
             for k, v in optimizer.to_dict().items()}
    return CostKey(UPDATE_KIND, json.dumps(_plain(terms), sort_keys=True, separators=(",", ":")), "update",
                   shard.shape, (shard.shape,), (), (dtype,), device)


def _run_phase(phase: str) -> str:
    """The phase of the kernel run that measures a task of `phase`: a tile's forward and backward
    run together (as 'forward'); an update and a weight-gradient-only backward alone."""
    return phase if phase in ("update", "backward_weights") else "forward"


# ---- work of a task (the analytic model's inputs) ---------------------------------------------------
def work(op: Op, phase: str, tile: Rect, forward: tuple[float, float] | None = None) -> tuple[float, float]:
    """(flops, bytes) of an op tile's forward or backward kernel; a backward of the weight
    gradients alone ('backward_weights') is charged forward's work (one product of the two).
    `forward`: the tile's forward (flops, bytes), where the caller has them."""
    flops, nbytes = forward if forward is not None else (float(op.flops(tile)), float(op.bytes_moved(tile)))
    if phase in ("forward", "backward_weights"):
        return flops, nbytes
    return (float(op.backward_flops(tile)) if hasattr(op, "backward_flops") else 2 * flops,
            float(op.backward_bytes(tile)) if hasattr(op, "backward_bytes") else 2 * nbytes)


def update_work(optimizer, volume: int, itemsize: int) -> tuple[float, float]:
    """(flops, bytes) of updating `volume` elements: read value, gradient and each state, write
    value and each state; about 2 flops plus 4 per state an element."""
    states = len(optimizer.state_names())
    return float(volume * (2 + 4 * states)), float(volume * itemsize * (3 + 2 * states))


# ---- the disk cache -------------------------------------------------------------------------------
def read_cache(path: Path) -> dict:
    """The entries of a cache file, key text -> {seconds, kind, flops, bytes, device} ({} when
    there is none, or one that is not ours: it is rebuilt)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        print(f"taskrt: ignoring the cost cache {path}: {e}", file=sys.stderr)
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or not isinstance(data.get("entries"), dict):
        print(f"taskrt: ignoring the cost cache {path}: not a version-{CACHE_VERSION} cost cache", file=sys.stderr)
        return {}
    return data["entries"]


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on path + '.lock' (POSIX; elsewhere no lock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "w") as f:
        try:
            import fcntl
            fcntl.flock(f, fcntl.LOCK_EX)
        except ImportError:
            pass
        yield


def write_cache(path: Path, new: dict) -> dict:
    """Merge `new` entries into the file under its lock and replace it atomically; returns the merged entries."""
    with _locked(path):
        entries = {**read_cache(path), **new}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "entries": entries}, indent=0, sort_keys=True))
        os.replace(tmp, path)
    return entries


@dataclass(frozen=True)
class Measurement:
    """One measured kernel, with the analytic model's flops and bytes for it: what fits efficiencies."""

    kind: str
    flops: float
    bytes: float
    seconds: float


# ---- the cost model -------------------------------------------------------------------------------
class CostModel:
    """Task, copy, fill and fold seconds on one machine model; see the module docstring.

    `cache_path`: the measurements file (default_cache_path()); `optimizer`: whose updates
    `task_time(..., "update", ...)` times (default SGD with momentum 0.9); `progress`: the
    stream measure_all reports on (default stderr; False for none). `stats` counts the
    kernels measured and the times served from the cache and from the roofline.
    """

    def __init__(self, machine_model: MachineModel, measured: bool | None = None, cache_path=None, *,
                 repeats: int = 5, warmup: int = 1, optimizer=None, progress=None):
        if not isinstance(machine_model, MachineModel):
            raise TypeError(f"CostModel: machine_model must be a MachineModel (load_machine(name)), got "
                            f"{type(machine_model).__name__} {machine_model!r}")
        if measured not in (True, False, None):
            raise ValueError(f"CostModel measured must be True, False or None, got {measured!r}")
        if not isinstance(repeats, int) or repeats < 1 or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"CostModel needs repeats >= 1 and warmup >= 0, got repeats={repeats!r}, "
                             f"warmup={warmup!r}")
        self.machine_model = machine_model
        self.measured = measured
        self.cache_path = Path(cache_path) if cache_path is not None else default_cache_path()
        problem = cache_problem(self.cache_path)
        if problem is not None:
            raise ValueError(f"CostModel: {problem}")
        self.repeats, self.warmup = repeats, warmup
        self.optimizer = optimizer if optimizer is not None else SGD(lr=0.01, momentum=0.9)
        self.progress = sys.stderr if progress is None else (None if progress is False else progress)
        self.stats = {"measured": 0, "cached": 0, "analytic": 0}
        self._entries: dict | None = None
        self._backends: dict[str, Backend] = {}
        self._here: dict[str, str | None] = {}
        #: (op, phase, tile, device name, param) of kernels this machine could not allocate (runnable)
        self._unrunnable: set[tuple] = set()
        #: (op, tile) -> forward (flops, bytes): a tile's phases share them (work)
        self._forward_work: dict[tuple, tuple[float, float]] = {}
        #: seconds a sample of the app's batch source takes here (measure_source); None: not measured
        self.source_per_sample: float | None = None

    def __repr__(self) -> str:
        mode = {True: "measured", False: "analytic", None: "measured where here"}[self.measured]
        return f"CostModel({self.machine_model.name!r}, {mode}, cache {self.cache_path})"

    # ---- devices -------------------------------------------------------------------------------
    def device(self, device: DeviceSpec | Processor | str) -> DeviceSpec:
        """A DeviceSpec from itself, a processor of machine_model.to_machine(), or a kind ('cpu', 'gpu')."""
        if isinstance(device, DeviceSpec):
            return device
        if isinstance(device, Processor):
            return self.machine_model.device_of(device)
        mm = self.machine_model
        if device == mm.device.kind:
            return mm.device
        if device == "cpu":
            return mm.host
        raise ValueError(f"{mm.name}: no {device!r} device (its devices are {mm.device.kind}s, its host a cpu)")

    def _local_name(self, kind: str) -> str | None:
        """The model name of this machine's device of `kind` (None: there is none here; TASKRT_GPUS=0
        hides the GPUs)."""
        if kind not in self._here:
            name = None
            if kind == "cpu":
                name = cpu_name()
            elif gpus_from_env() != 0 and count_gpus() > 0:
                import cupy
                raw = cupy.cuda.runtime.getDeviceProperties(0)["name"]
                name = raw.decode() if isinstance(raw, bytes) else str(raw)
            self._here[kind] = name
        return self._here[kind]

    def measures(self, device: DeviceSpec | Processor | str) -> bool:
        """Whether this model measures tasks on `device` rather than using the roofline."""
        device = self.device(device)
        here = self._local_name(device.kind)
        if self.measured is False or here is None:
            return False
        return self.measured is True or device.name == here

    def _blas_threads(self, device: DeviceSpec) -> int:
        """The BLAS threads a CPU worker of this model gets: the host's cores shared among the devices
        of the nodes on it (as the runtime's limit_blas_threads shares them among the ranks there and
        their workers), all of them for a GPU machine's host."""
        cores = node_cores()
        mm = self.machine_model
        if device is mm.device and device.kind == "cpu":
            return max(1, cores // (mm.nodes_per_host * mm.devices_per_node))
        return cores

    def device_tag(self, device: DeviceSpec) -> str:
        """What measurements on `device` are filed under: this machine's device name, and on CPUs
        the BLAS threads."""
        tag = f"{device.kind}:{self._local_name(device.kind)}"
        return f"{tag}/{self._blas_threads(device)}t" if device.kind == "cpu" else tag

    def _backend(self, device: DeviceSpec) -> Backend:
        tag = self.device_tag(device)
        if tag not in self._backends:
            self._backends[tag] = Backend(device.kind, self._blas_threads(device))
        return self._backends[tag]

    # ---- the cache -------------------------------------------------------------------------------
    @property
    def entries(self) -> dict:
        """Cached measurements: key text -> {seconds, kind, flops, bytes, device}."""
        if self._entries is None:
            self._entries = read_cache(self.cache_path)
        return self._entries

    def _store(self, new: dict) -> None:
        if new:
            self._entries = write_cache(self.cache_path, new)

    def measurements(self, device: DeviceSpec | Processor | str | None = None) -> list[Measurement]:
        """The cached measurements made on `device` (the model's device by default), for fit_efficiency."""
        tag = self.device_tag(self.device(device if device is not None else self.machine_model.device))
        return [Measurement(e["kind"], e["flops"], e["bytes"], e["seconds"]) for e in self.entries.values()
                if e.get("device") == tag]

    # ---- task times ---------------------------------------------------------------------------------
    def key(self, op: Op, phase: str, rect: Rect, device, param: str | None = None, optimizer=None) -> CostKey:
        """The cost key of a task (for an update, `rect` is the shard of weight `param`)."""
        spec = self.device(device)
        tag = self.device_tag(spec) if self.measures(spec) else spec.tag
        if phase == "update":
            return update_key(optimizer or self.optimizer, rect, self._param_dtype(op, param), tag)
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        return op_key(op, phase, rect, tag)

    @staticmethod
    def _param_dtype(op: Op, param: str | None) -> str:
        if param is None:
            return "float32"
        short = param.rsplit(".", 1)[-1] if param not in op.weight_shapes() else param
        return op.weight_dtype(short)

    def work(self, op: Op, phase: str, rect: Rect, param: str | None = None, optimizer=None) -> tuple[float, float]:
        """(flops, bytes) the analytic model charges a task."""
        if phase == "update":
            itemsize = np.dtype(self._param_dtype(op, param)).itemsize
            return update_work(optimizer or self.optimizer, rect.volume, itemsize)
        forward = self._forward_work.get((op, rect))
        if forward is None:   # a search costs each new tile's forward and backward: one count
            forward = self._forward_work[(op, rect)] = work(op, "forward", rect)
        return work(op, phase, rect, forward)

    def analytic_time(self, op: Op, phase: str, rect: Rect, device, param: str | None = None,
                      optimizer=None) -> float:
        """The roofline kernel seconds of a task (without the launch overhead)."""
        spec = self.device(device)
        flops, nbytes = self.work(op, phase, rect, param, optimizer)
        kind = UPDATE_KIND if phase == "update" else op.kind
        return roofline(flops, nbytes, spec, self.machine_model.efficiency_of(kind))

    def task_time(self, op: Op, phase: str, rect: Rect, device, param: str | None = None,
                  optimizer=None) -> float:
        """Seconds of a task: `op`'s tile `rect` in phase 'forward', 'backward' or
        'backward_weights' (no input gradient: strategies.graph.BACKWARD_WEIGHTS), or in phase
        'update' the optimizer update of shard `rect` of weight `param` ('weight' or
        'op.weight'), on `device` (a DeviceSpec, a processor, or a kind): its kernel, measured
        or analytic, as inside a run (the machine's kernel_seconds), plus its launch overhead."""
        spec = self.device(device)
        mm = self.machine_model
        entry = None
        if self.measures(spec) and self.runnable(op, phase, rect, spec, param, optimizer):
            key = self.key(op, phase, rect, spec, param, optimizer)
            entry = self.entries.get(key.text)
            if entry is None:
                self._store(self._measure([(op, phase, rect, spec, param, optimizer)], None))
                entry = self.entries.get(key.text)   # (None: it ran out of memory here)
            else:
                self.stats["cached"] += 1
        if entry is None:
            self.stats["analytic"] += 1
            kernel = self.analytic_time(op, phase, rect, spec, param, optimizer)
            return mm.kernel_seconds(kernel) + mm.launch_overhead
        return mm.kernel_seconds(entry["seconds"]) + mm.launch_overhead

    def runnable(self, op: Op, phase: str, rect: Rect, device, param: str | None = None, optimizer=None) -> bool:
        """Whether a measurement of the task would fit `device`'s memory: a tile's forward and
        backward hold its arrays and their gradients (twice its forward's bytes), an update its
        own bytes. One that would not is timed by the roofline (a strategy with it does not fit
        the device either), so that a search at a huge batch is not killed measuring it."""
        spec = self.device(device)
        if (op, _run_phase(phase), rect, spec.name, param) in self._unrunnable:
            return False
        if phase == "update":
            nbytes = self.work(op, phase, rect, param, optimizer)[1]
        else:
            nbytes = 2 * self.work(op, "forward", rect)[1]
        return nbytes <= spec.mem_bytes

    def measure_all(self, tasks: Iterable[Sequence]) -> int:
        """Measure every task (op, phase, rect, device[, param]) that this model measures and the
        cache lacks, with a progress bar, and file them; returns how many kernels ran (a tile's
        forward and backward are one run)."""
        jobs: dict[str, tuple] = {}
        for task in tasks:
            op, phase, rect, device, *rest = task
            spec = self.device(device)
            if not self.measures(spec):
                continue
            param = rest[0] if rest else None
            if self.key(op, phase, rect, spec, param).text in self.entries:
                continue
            run = _run_phase(phase)
            if self.runnable(op, run, rect, spec, param):
                jobs.setdefault(self.key(op, run, rect, spec, param).text, (op, run, rect, spec, param, None))
        if not jobs:
            return 0
        todo = list(jobs.values())
        progress = Progress(self.progress, len(todo), f"kernels on {self.device_tag(todo[0][3])}")
        self._store(self._measure(todo, progress))
        progress.close()
        return len(todo)

    def _measure(self, todo: list, progress: Progress | None) -> dict:
        """Run the kernels of `todo` (op, phase, rect, spec, param, optimizer): an update, or a
        tile's forward and backward together. Returns the new cache entries; a kernel whose
        arrays this machine cannot allocate has none, and is not tried again (runnable)."""
        new: dict = {}
        for i, job in enumerate(todo):
            if progress is not None:
                progress.show(i, str(self.key(*job)))
            try:
                new.update(self._measure_one(*job))
            except MemoryError:
                op, phase, rect, spec, param, _ = job
                self._unrunnable.add((op, _run_phase(phase), rect, spec.name, param))
        if progress is not None:
            progress.show(len(todo), "")
        return new

    def _measure_one(self, op: Op, phase: str, rect: Rect, spec: DeviceSpec, param: str | None, optimizer) -> dict:
        """The cache entries of one job of _measure."""
        backend = self._backend(spec)
        self.stats["measured"] += 1
        if phase == "update":
            opt = optimizer or self.optimizer
            key = self.key(op, phase, rect, spec, param, opt)
            seconds = measure_update(opt, rect, self._param_dtype(op, param), backend, self.repeats, self.warmup)
            return {key.text: self._entry(key, seconds, self.work(op, phase, rect, param, opt))}
        if phase == "backward_weights":  # the weight gradients alone: a run of its own
            key = self.key(op, phase, rect, spec)
            seconds = measure_tile(op, rect, backend, self.repeats, self.warmup, input_grads=False)[1]
            return {key.text: self._entry(key, seconds, work(op, phase, rect))}
        times = measure_tile(op, rect, backend, self.repeats, self.warmup)
        keys = [self.key(op, ph, rect, spec) for ph in ("forward", "backward")]
        return {key.text: self._entry(key, seconds, work(op, key.phase, rect)) for key, seconds in zip(keys, times)}

    @staticmethod
    def _entry(key: CostKey, seconds: float, flops_bytes: tuple[float, float]) -> dict:
        return {"seconds": seconds, "kind": key.kind, "flops": flops_bytes[0], "bytes": flops_bytes[1],
                "device": key.device}

    # ---- batch sources ---------------------------------------------------------------------------
    def measure_source(self, source, samples: int, runs: int = 5) -> float:
        """Time `source(step, 0, samples)` (the batch source Model.train_on takes) here and keep its
        seconds a sample for source_time on the devices this model measures; returns them."""
        samples = as_int("measure_source: samples", samples, least=1)
        self.source_per_sample = measure_source(source, samples, runs, self.warmup) / samples
        return self.source_per_sample

    def source_time(self, samples: int, nbytes: int, device) -> float:
        """A source task making `samples` samples (`nbytes` of inputs and labels) on `device`: the
        measured seconds a sample (measure_source) as inside a run (kernel_seconds) where this model
        measures the device, else the batch written once at the device's memory bandwidth (a
        loader that has the data at hand); plus the launch overhead."""
        mm = self.machine_model
        if self.source_per_sample is not None and self.measures(device):
            return mm.kernel_seconds(samples * self.source_per_sample) + mm.launch_overhead
        return nbytes / self.device(device).mem_bandwidth + mm.launch_overhead

    # ---- copies, fills and folds ---------------------------------------------------------------------
    copy_time = staticmethod(copy_time)
    transfer_time = staticmethod(transfer_time)

    def fill_time(self, nbytes: int, device) -> float:
        """A fill task (zeros, ones) writing `nbytes` on `device`."""
        return nbytes / self.device(device).mem_bandwidth + self.machine_model.launch_overhead

    def fold_time(self, nbytes: int, device) -> float:
        """Folding a reduction buffer of `nbytes` into its target on `device` (read both, write one);
        a fold from another memory also pays its copy on the link."""
        return _fold_seconds(nbytes, self.device(device).mem_bandwidth, self.machine_model.launch_overhead)

    def copy_times(self, nbytes: np.ndarray, link_bandwidth: np.ndarray, dst_bandwidth: np.ndarray,
                   fold: np.ndarray) -> np.ndarray:
        """Seconds each of many copies occupies its link: transfer_time (bytes over `link_bandwidth`,
        inf within one memory) and, where `fold`, fold_time on a device of `dst_bandwidth`. The
        same arithmetic as those two, element by element, so the same seconds."""
        transfer = _transfer_seconds(nbytes, link_bandwidth)
        return np.where(fold, transfer + _fold_seconds(nbytes, dst_bandwidth, self.machine_model.launch_overhead),
                        transfer)


# ---- fitting efficiencies ------------------------------------------------------------------------------
def _fit_one(samples: list[Measurement], device: DeviceSpec) -> float:
    """The efficiency in (0, 1] minimizing the squared relative error of the roofline over `samples`;
    where the error is flat (memory-bound samples) the largest such efficiency."""
    c = np.array([s.flops / device.peak_flops for s in samples])
    m = np.array([s.bytes / device.mem_bandwidth for s in samples])
    t = np.array([s.seconds for s in samples])

    def error(e: float) -> float:
        rel = (np.maximum(c / e, m) - t) / t
        return float(rel @ rel)

    grid = np.logspace(-5, 0, 501)
    errs = np.array([error(e) for e in grid])
    best = int(len(grid) - 1 - np.argmin(errs[::-1]))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(80):
        a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
        if error(a) < error(b):
            hi = b
        else:
            lo = a
    e = (lo + hi) / 2
    return float(min(1.0, e if error(e) <= errs[best] else grid[best]))


def fit_efficiency(measurements: Iterable[Measurement], device: DeviceSpec) -> dict[str, float]:
    """Op kind -> the fraction of `device`'s peak that makes the roofline best match the measured
    kernel seconds (least squares of the relative error), and 'default' from all of them."""
    by_kind: dict[str, list[Measurement]] = {}
    every = []
    for s in measurements:
        if s.seconds > 0:
            by_kind.setdefault(s.kind, []).append(s)
            every.append(s)
    if not every:
        raise ValueError("fit_efficiency: no measurements with positive times")
    fastest = max(every, key=lambda s: s.flops / s.seconds)
    if fastest.flops / fastest.seconds > device.peak_flops:
        warnings.warn(f"fit_efficiency: a {fastest.kind} kernel ran at {fastest.flops / fastest.seconds / 1e9:.4g} "
                      f"GFLOP/s, over {device!r}'s peak of {device.peak_flops / 1e9:.4g}: efficiencies stop at 1, "
                      f"so raise the machine file's device peak_flops to this machine's", stacklevel=2)
    fitted = {kind: _fit_one(samples, device) for kind, samples in sorted(by_kind.items())}
    fitted["default"] = _fit_one(every, device)
    return fitted


# ---- calibration ---------------------------------------------------------------------------------------
def calibration_ops() -> list[Op]:
    """Representative ops of every kind the apps use, at sizes that take milliseconds on a CPU core."""
    from ops.activation import ElementUnary, Softmax
    from ops.attention import MultiHeadAttention
    from ops.conv import Conv2d
    from ops.pool import Pool2d
    from ops.dropout import Dropout
    from ops.elementwise import ElementBinary
    from ops.embedding import Embedding
    from ops.linear import BatchMatmul, Dense
    from ops.loss import SparseCategoricalCrossEntropy
    from ops.lstm import LSTM
    from ops.norm import BatchNorm, LayerNorm

    def t(*shape, dtype="float32", name="x"):
        return TensorSpec(tuple(shape), dtype, name)

    seq = t(8, 32, 256)
    return [Dense("dense_a", [t(64, 512)], 512), Dense("dense_b", [t(128, 1024)], 1024, activation="relu"),
            Dense("dense_c", [t(32, 256)], 1000),
            Conv2d("conv_a", [t(4, 64, 28, 28)], 64, (3, 3), padding=1),
            Conv2d("conv_b", [t(4, 3, 64, 64)], 32, (5, 5), stride=2, padding=2),
            Pool2d("pool", [t(8, 64, 28, 28)], (2, 2)), BatchNorm("bn", [t(8, 64, 28, 28)]),
            BatchMatmul("bmm", [t(16, 64, 64, name="a"), t(16, 64, 64, name="b")]),
            LSTM("lstm", [t(16, 10, 256)], 256), MultiHeadAttention("mha", [seq, seq, seq], 4),
            Embedding("emb", [t(64, 20, dtype="int64")], 4000, 128), LayerNorm("ln", [seq], 256),
            Softmax("softmax", [t(64, 1000)]), ElementUnary("relu", [t(64, 4096)], "relu"),
            ElementBinary("add", [t(64, 4096), t(64, 4096, name="y")], "add"), Dropout("dropout", [t(64, 4096)], 0.5),
            SparseCategoricalCrossEntropy("loss", [t(64, 1000), t(64, dtype="int64", name="labels")],
                                          from_logits=True)]


def calibrate(cost: CostModel, ops: Sequence[Op] | None = None) -> dict[str, float]:
    """Measure every op of `ops` (calibration_ops()) whole, forward and backward, on the model's
    device, and fit its efficiencies to those measurements; returns them."""
    mm = cost.machine_model
    if not cost.measures(mm.device):
        raise ValueError(f"calibrate: {mm.device!r} is not here to measure (this machine has "
                         f"cpu {cost._local_name('cpu')!r}, gpu {cost._local_name('gpu')!r})")
    ops = list(ops if ops is not None else calibration_ops())
    tasks = [(op, phase, Rect.from_shape(op.tile_shape), mm.device) for op in ops for phase in ("forward", "backward")]
    cost.measure_all(tasks)
    samples = []
    for op, phase, rect, device in tasks:
        entry = cost.entries[cost.key(op, phase, rect, device).text]
        samples.append(Measurement(entry["kind"], entry["flops"], entry["bytes"], entry["seconds"]))
    return fit_efficiency(samples, mm.device)


def main(argv: Sequence[str] | None = None) -> int:
    from tools import LineParser
    parser = LineParser(prog="python -m strategies.cost",
                        description="Fit a machine model's efficiencies to kernels measured here.")
    sub = parser.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="measure the calibration ops and fit the roofline's efficiencies")
    cal.add_argument("--machine", default="local", help="a shipped machine name or a machine file (default local)")
    cal.add_argument("--cache", default=None, help="the measurements file (default: TASKRT_COST_CACHE, else "
                                                    "$XDG_CACHE_HOME/taskrt/costs.json, else ~/.cache/taskrt/costs.json)")
    cal.add_argument("--repeats", type=int, default=5, help="timed runs of each kernel (at least 1)")
    cal.add_argument("--write", action="store_true", help="write the fitted efficiencies into the machine file")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: must be at least 1")
    problem = cache_problem(args.cache if args.cache is not None else default_cache_path())
    if problem is not None:
        parser.error(problem)
    try:
        mm = load_machine(args.machine)
    except MachineError as e:
        parser.error(f"--machine {args.machine}: {e}")
    cost = CostModel(mm, measured=True, cache_path=args.cache, repeats=args.repeats)
    if not cost.measures(mm.device):
        parser.error(f"--machine {args.machine}: its device, {mm.device!r}, is not here to measure")
    unwritable = write_problem(mm.source) if args.write else None
    if unwritable is not None:
        parser.error(f"--write: {unwritable}")
    fitted = calibrate(cost)
    for kind, frac in sorted(fitted.items()):
        print(f"{kind:34s} {frac:.4f}")
    if args.write:
        note = f"{cost.device_tag(mm.device)}, {len(calibration_ops())} ops, {date.today().isoformat()}"
        write_efficiency(mm.source, {k: round(v, 4) for k, v in fitted.items()}, note)
        print(f"wrote the efficiencies into {mm.source}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
