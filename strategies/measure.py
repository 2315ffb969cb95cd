"""Measuring kernels here: an op tile's forward and backward, or an optimizer update, on random
arrays at exactly the rects the tile reads, timed as the median of a few runs after a warm-up;
and an app's batch source making a rank's share of a batch.

`tile_arrays` builds the arrays as lowering would hand them to the kernels (views of full-size
arrays, as the runtime's instances are; only weights and state with non-empty rects; valid
indices for integer inputs), and a tile's results and input gradients are written into such
views as lowering writes them, inside the timed parts; `Backend` is numpy under the
BLAS thread limit a CPU worker gets, or cupy on GPU 0 with a sync around every timed part;
`Progress` is the one-line progress bar of CostModel.measure_all (strategies/cost.py).
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from ops.base import Op
from taskrt.geometry import Rect
from taskrt.heap import keep_freed_memory


def tile_arrays(op: Op, tile: Rect, rng: np.random.Generator, put=None):
    """Random arrays for one tile: (inputs at its input rects, weights, state), as lowering gives
    them: each a view of its tensor's full-size array (the runtime keeps one full-size instance
    per region and memory and hands a task the view of its rect, strided where the tile is cut
    along an inner dim: taskrt/instances.py), `put` on the backend (default: the host arrays);
    only the weights and state with non-empty rects. Floats are uniform in [0.5, 1.5) (no
    zeros, no negatives under a log); integer inputs are valid indices."""
    put = put or (lambda a: a)

    def floats(rect, shape, dtype):
        return random_floats_at(rng, shape, rect, dtype, put)

    inputs = []
    for i, (spec, rect) in enumerate(zip(op.inputs, op.input_rects(tile))):
        if np.dtype(spec.dtype).kind in "iu":
            bound = op.index_bound(i) or 1  # an integer input that indexes nothing gets zeros
            indices = rng.integers(0, bound, size=rect.shape).astype(spec.dtype)
            inputs.append(in_full_size(spec.shape, rect, indices, put))
        else:
            inputs.append(floats(rect, spec.shape, spec.dtype))
    rects = op.tile_weight_rects(tile)
    shapes = {**op.weight_shapes(), **op.state_shapes()}
    weights = {k: floats(rects[k], shapes[k], op.weight_dtype(k)) for k in op.weight_shapes() if not rects[k].empty}
    state = {k: floats(rects[k], shapes[k], op.weight_dtype(k)) for k in op.state_shapes() if not rects[k].empty}
    return inputs, weights, state or None


def in_full_size(shape, rect: Rect, part, put):
    """The view at `rect` of a full-size array of `shape` on the backend that holds `part` there
    and zeros elsewhere (pages never touched: a tile of a full-size batch draws only its part)."""
    full = np.zeros(shape, part.dtype)
    full[rect.slices()] = part
    return put(full)[rect.slices()]


def random_floats_at(rng, shape, rect: Rect, dtype, put):
    """in_full_size with floats uniform in [0.5, 1.5) at `rect`."""
    return in_full_size(shape, rect, rng.uniform(0.5, 1.5, size=rect.shape).astype(dtype), put)


def instance_views(specs, rects, put) -> list:
    """Per tensor, a view at its rect of a full-size array on the backend (None for an empty rect
    or an integer tensor): where lowering writes a tile's results and gradients."""
    return [None if rect.empty or np.dtype(spec.dtype).kind != "f"
            else put(np.zeros(spec.shape, spec.dtype))[rect.slices()] for spec, rect in zip(specs, rects)]


def _contiguous_or_none(view):
    """What lowering offers a `writes_out` kernel for a result: the view where it is C-contiguous."""
    return view if view is not None and view.flags.c_contiguous else None


def _write_back(views, arrays) -> None:
    """Lowering's copy of each result into its view, where the kernel did not write it there."""
    for view, arr in zip(views, arrays):
        if view is not None and arr is not None and arr is not view:
            view[...] = arr


def _kernel_extras(op: Op) -> dict:
    """The keyword arguments only some kernels take, as lowering passes them to an unsplit
    ordered dim and unshared sums: none of either, step 0."""
    extra = {}
    if op.uses_step:
        extra["step"] = 0
    if op.sum_shapes():
        extra["sums"] = None
    if op.carry_shapes():
        extra["carry"] = None
    return extra


class Backend:
    """Where measurements run: numpy under a BLAS thread limit, or cupy on GPU 0 with syncs."""

    def __init__(self, kind: str, blas_threads: int):
        self.kind, self.blas_threads = kind, blas_threads
        if kind == "gpu":
            from taskrt.backends import gpu
            self.xp = gpu.module()
        else:
            keep_freed_memory()  # as the runtime's workers allocate (a fault a page otherwise)
            self.xp = np

    def context(self):
        if self.kind == "gpu":
            return self.xp.cuda.Device(0)
        from threadpoolctl import threadpool_limits
        return threadpool_limits(limits=self.blas_threads, user_api="blas")

    def put(self, array):
        return array if self.kind == "cpu" or array is None else self.xp.asarray(array)

    def sync(self) -> None:
        if self.kind == "gpu":
            self.xp.cuda.Device().synchronize()


def _median_times(step, runs: int, warmup: int, sync) -> list[float]:
    """Per-part medians of `runs` calls of step() (after `warmup`), where step returns the
    perf_counter marks between its parts (synced before each mark)."""
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(runs):
        marks = step()
        samples.append([b - a for a, b in zip(marks, marks[1:])])
    return [statistics.median(s[i] for s in samples) for i in range(len(samples[0]))]


def _carry_rects(op: Op, tile: Rect) -> dict[str, Rect]:
    """The carry rects a tile is handed (name -> rect), as lowering hands them: where it is a
    chunk of the op's ordered dim, not all of it (then a kernel takes carry=None)."""
    d = op.ordered_dim()
    if d is None or not op.carry_shapes() or tile.shape[d] == op.tile_shape[d]:
        return {}
    return op.carry_rects(tile)


def _carry_arrays(op: Op, rects: dict[str, Rect], rng, put) -> dict:
    """Fresh arrays at the carry rects (the kernels overwrite them), in the op's output dtype."""
    dtype = op.outputs[0].dtype
    return {k: put(rng.uniform(0.5, 1.5, size=r.shape).astype(dtype)) for k, r in rects.items()}


def measure_tile(op: Op, tile: Rect, backend: Backend, runs: int = 5, warmup: int = 1,
                 seed: int = 0, input_grads: bool = True) -> tuple[float, float]:
    """Median (forward, backward) kernel seconds of one op tile; every run does a training forward
    then a backward on the arrays and saved values that forward made. input_grads=False times a
    backward told that no one reads the input gradients (out=False, ops with writes_out)."""
    rng = np.random.default_rng(seed)
    put = backend.put
    inputs, weights, state = tile_arrays(op, tile, rng, put)
    in_rects = op.input_rects(tile)
    out_rects = op.output_rects(tile)
    grads = []
    for spec, rect in zip(op.outputs, out_rects):
        float_out = np.dtype(spec.dtype).kind == "f" and not rect.empty
        grads.append(random_floats_at(rng, spec.shape, rect, spec.dtype, put) if float_out else None)
    out_views = instance_views(op.outputs, out_rects, put)
    grad_views = instance_views(op.inputs, in_rects, put) if input_grads else [None] * len(op.inputs)
    extra = _kernel_extras(op)
    bwd_extra = {k: v for k, v in extra.items() if k != "step"}
    if op.writes_out:
        extra["out"] = [_contiguous_or_none(v) for v in out_views]
        bwd_extra["out"] = [_contiguous_or_none(v) if input_grads else False for v in grad_views]
    xp, sync = backend.xp, backend.sync
    carry_rects = _carry_rects(op, tile)

    def step():
        st = None if state is None else {k: v.copy() for k, v in state.items()}
        if carry_rects:   # what the chunk before left (forward) and the one after (backward)
            extra["carry"], bwd_extra["carry"] = (_carry_arrays(op, carry_rects, rng, put) for _ in range(2))
        sync()
        t0 = time.perf_counter()
        outs, saved = op.forward(xp, tile, inputs, in_rects, weights, training=True, state=st, **extra)
        _write_back(out_views, outs)
        sync()
        t1 = time.perf_counter()
        grad_inputs, _ = op.backward(xp, tile, inputs, in_rects, weights, outs, grads, saved, **bwd_extra)
        _write_back(grad_views, grad_inputs)
        sync()
        return [t0, t1, time.perf_counter()]

    with backend.context():
        fwd, bwd = _median_times(step, runs, warmup, sync)
    return fwd, bwd


def measure_update(optimizer, shard: Rect, dtype: str, backend: Backend, runs: int = 5,
                   warmup: int = 1) -> float:
    """Median seconds of one optimizer update of a weight shard (a step past the first)."""
    rng = np.random.default_rng(0)
    put = backend.put
    value, grad = (put(rng.uniform(0.5, 1.5, size=shard.shape).astype(dtype)) for _ in range(2))
    state = {s: put(rng.uniform(0.5, 1.5, size=shard.shape).astype(dtype)) for s in optimizer.state_names()}

    def step():
        backend.sync()
        t0 = time.perf_counter()
        optimizer.update(backend.xp, value, grad, state, 2)
        backend.sync()
        return [t0, time.perf_counter()]

    with backend.context():
        return _median_times(step, runs, warmup, backend.sync)[0]


def measure_source(source, samples: int, runs: int = 5, warmup: int = 1) -> float:
    """Median seconds of `source(step, 0, samples)` (a batch source as Model.train_on takes it),
    a new step each call, as a rank makes its share of a batch."""
    steps = iter(range(1, runs + warmup + 1))

    def step():
        t0 = time.perf_counter()
        source(next(steps), 0, samples)
        return [t0, time.perf_counter()]

    return _median_times(step, runs, warmup, None)[0]


# ---- progress -----------------------------------------------------------------------------------
class Progress:
    """One line rewritten in place (\\r) on a terminal; elsewhere a line at the start, about every
    tenth, and at the end; nothing without a stream."""

    def __init__(self, stream, total: int, what: str):
        self.stream, self.total, self.what = stream, total, what
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.width, self.t0 = 0, time.perf_counter()
        self.every = max(1, total // 10)
        if stream is not None and not self.tty:
            self._write(f"measuring {total} {what}\n")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def show(self, done: int, label: str) -> None:
        if self.stream is None:
            return
        if self.tty:
            line = f"\rmeasuring {self.what}: {done}/{self.total} {label}"
            self.width = max(self.width, len(line))
            self._write(line.ljust(self.width))
        elif done and done % self.every == 0 and done < self.total:
            self._write(f"  {done}/{self.total} {label}\n")

    def close(self) -> None:
        if self.stream is None:
            return
        line = f"measured {self.total} {self.what} in {time.perf_counter() - self.t0:.1f} s"
        self._write(("\r" + line.ljust(self.width) if self.tty else line) + "\n")
