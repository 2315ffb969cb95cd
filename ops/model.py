"""The model API: graph building in the style of FlexFlow and Keras, with PyTorch's layouts.

    m = Model(seed=0)
    x = m.input((8, 3, 16, 16))
    y = m.softmax(m.dense(m.flat(m.relu(m.conv2d(x, 4, 3, padding=1))), 10))
    m.compile(optimizer=SGD(lr=0.1), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    history = m.fit(images, labels, epochs=3)

Tensors are layout-only handles (ops.base.TensorSpec). Shapes include the batch, so a
model runs batches of the size its inputs were declared with. Every op and parameter has
a stable name: given, or `<method>_<i>` in creation order, and `<op>.<weight>` for its
weights ('conv2d_0.weight'). Weights are initialized when an op is added (PyTorch's
initializers, from the model's seeded generator); from `compile` on they live in the
runtime's regions and every operator runs as taskrt tasks (ops/lower.py).
"""
from __future__ import annotations

import bisect
import collections
import functools
import math
import os
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np

from ops.activation import ElementUnary, Softmax
from ops.attention import MultiHeadAttention
from ops import checkpoint
from ops.base import OP_REGISTRY, Op, ShapeError, TensorSpec, training_error
from ops.conv import Conv2d
from ops.pool import Pool2d
from ops.dropout import Dropout
from ops.elementwise import ElementBinary
from ops.embedding import Embedding
from ops.linear import BatchMatmul, Dense
from ops.loss import MeanSquaredError, SparseCategoricalCrossEntropy
from ops.lower import Lowering, TileConfig, default_config, resolve_config
from ops.lstm import LSTM
from ops.norm import BatchNorm, LayerNorm
from ops.optimizers import make_optimizer
from ops.shape import Concat, Flat, Reshape, Split, Transpose
from ops.strategy import Strategy, model_fingerprint
from ops.strategy import load as load_strategy
from taskrt import Runtime
from taskrt.geometry import as_int, as_int_tuple
from taskrt.region import beyond_range, dtype_of_kind

LOSSES = ("sparse_categorical_crossentropy", "mean_squared_error")
METRICS = ("accuracy",)


@dataclass
class History:
    """What `fit` returns: the mean loss (and accuracy, when asked for) of every iteration and epoch."""

    loss: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    epoch_loss: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.loss)


class _dualmethod:
    """`Model.load(path)` builds a model from a file; `m.load(path)` loads a file into `m`."""

    def __init__(self, on_class, on_instance):
        self.on_class, self.on_instance = on_class, on_instance

    def __get__(self, obj, cls):
        if obj is None:
            return functools.wraps(self.on_class)(functools.partial(self.on_class, cls))
        return functools.wraps(self.on_instance)(functools.partial(self.on_instance, obj))


def _recovers(method):
    """A public entry point after whose failed task the runtime stays usable (one process; on
    many ranks a failure ends every rank): the error is raised, the runtime recovered."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except RuntimeError as exc:   # (TaskError among them)
            raise _recovered(self, exc) from None
    return run


def _recovered(model: "Model", exc: RuntimeError) -> RuntimeError:
    """After `exc` left an entry point: the model's runtime made usable again where a task failed,
    in one process (on many ranks a failure ends every rank), its step count taken back to the
    steps that ran whole (Model._rewind) and what lost backwards would have taken dropped; the
    error to raise: the failed task's own (a launch issued after it had failed said only that the
    runtime stopped), else `exc`."""
    rt = model.rt
    failed = None if rt.executor is None else rt.executor.error
    if failed is None or rt.transport is not None:
        return exc
    model._rewind(rt.recover())
    if model._low is not None:
        model._low.forget_saved()
    return failed


class _SourceTask:
    """train_on's task: one rank's share of a batch from `source`, checked and written into the
    inputs and labels. It holds its model weakly: the runtime keeps its task functions, and a
    model held there (as a bound method was) is never collected, nor its own runtime shut down."""

    def __init__(self, model: "Model"):
        self.model = weakref.ref(model)

    def __call__(self, ctx, *views_and_args):
        model = self.model()
        if model is None:
            raise RuntimeError("train_on: the model was collected before this batch was made")
        *views, source, step = views_and_args
        lo, hi = ctx.rects[0].lo[0], ctx.rects[0].hi[0]
        inputs, labels = source(step, lo, hi)
        what = f"train_on: source({step}, {lo}, {hi})"
        arrays, n = model._input_arrays(inputs, what)
        if n != hi - lo:
            raise ValueError(f"{what} gave {n} samples, expected {hi - lo}")
        for view, a in zip(views, [arrays[t.name] for t in model.inputs] + [model._label_array(labels, n, what)]):
            view[...] = a


def _shut_down_dropped(rt: Runtime) -> None:
    """Shut down the runtime of a model collected without close(). A collection can run on one
    of that runtime's workers, which the shutdown joins: there it runs on a thread of its own."""
    workers = rt.executor.threads if rt.executor is not None else ()
    if threading.current_thread() in workers:
        threading.Thread(target=rt.shutdown, name="taskrt-shutdown", daemon=True).start()
    else:
        rt.shutdown()


class Model:
    """A graph of operators, its weights, and (after `compile`) its lowering onto a taskrt Runtime."""

    _instances = 0

    def __init__(self, runtime: Runtime | None = None, seed: int = 0, weights: bool = True):
        #: False: the graph alone (ops, names, shapes, weight shapes) and no weight values, to count
        #: parameters and check strategies at full size without allocating; it cannot compile
        if not isinstance(weights, bool):
            raise TypeError(f"Model: weights must be True or False, got {type(weights).__name__} {weights!r}")
        seed = as_int("Model: seed", seed, least=0)
        if runtime is not None and not isinstance(runtime, Runtime):
            raise TypeError(f"Model: runtime must be a taskrt Runtime, got {type(runtime).__name__} {runtime!r}")
        self.has_weights = weights
        self.rt = runtime if runtime is not None else Runtime(execute=self.has_weights)
        self._own_runtime = runtime is None
        #: a runtime of its own is shut down when the model is collected without close() (its
        #: workers hold the runtime, not the model); not a replicated one, whose shutdown is collective
        self._shut_when_dropped = (weakref.finalize(self, _shut_down_dropped, self.rt)
                                   if self._own_runtime and self.rt.transport is None else None)
        self.seed = seed
        self.inputs: list[TensorSpec] = []
        self.ops: list[Op] = []
        self.tensors: dict[str, TensorSpec] = {}
        self._counters: dict[str, int] = {}
        self._init_rng = np.random.default_rng(self.seed)
        self._data_rng = np.random.default_rng([self.seed, 1])
        self._values: dict[str, np.ndarray] = {}  # weights and running stats until compile
        self._compiled: dict | None = None
        self._cannot_train: ShapeError | None = None   # (compile: why the graph cannot train, or None)
        self._low: Lowering | None = None
        self._loss_op: Op | None = None
        self._forward_done = False
        #: after compile: the ops (the loss op included) that got the data-parallel default config,
        #: named by neither the strategy nor `configs`
        self.default_ops: list[str] = []
        #: training steps taken: the step an optimizer's update is told (Adam's bias correction)
        self.step = 0
        #: (step, its first node id, the id after its last) of the last steps issued, so that
        #: after a failure the count goes back to the steps that ran whole (_rewind); a step
        #: this far back has finished before the next is issued (its loss is waited for)
        self._issued_steps: collections.deque = collections.deque(maxlen=16)
        self._closed = False
        self._source_task = _SourceTask(self)
        Model._instances += 1
        self._tag = f"model{Model._instances}"

    def __repr__(self) -> str:
        state = f"compiled, step {self.step}" if self._low is not None else "not compiled"
        return f"Model({len(self.inputs)} inputs, {len(self.ops)} ops, {len(self._param_names())} params, {state})"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self) -> None:
        """Shut the runtime down if this model made it (on many ranks: on every rank, as the
        shutdown is collective); on a runtime it was given, free what it holds there (weights,
        gradients, optimizer state, activations) once its work has run. Then it refuses work."""
        if self._own_runtime:
            if self._shut_when_dropped is not None:
                self._shut_when_dropped.detach()
            self.rt.shutdown()
        elif self._low is not None and not self.rt._closed and not self._closed:
            self._low.release_all()
        self._closed = True

    def _check_not_closed(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what}: the model is closed")

    # ---- graph building -------------------------------------------------------------------
    def _name(self, prefix: str, name: str | None) -> str:
        """`name` checked, or the next free `<prefix>_<i>` (the counter moves on when the op is added)."""
        taken = {op.name for op in self.ops} | self.tensors.keys()
        if name is not None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"{prefix}: name must be a non-empty string, got {name!r}")
            if name in taken:
                what = "an op" if any(op.name == name for op in self.ops) else "a tensor"
                raise ValueError(f"{prefix}: name {name!r} is already used in this model (by {what})")
            return name
        i = self._counters.get(prefix, 0)
        while f"{prefix}_{i}" in taken:
            i += 1
        return f"{prefix}_{i}"

    def _count(self, prefix: str, name: str) -> None:
        head, _, tail = name.rpartition("_")
        if head == prefix and tail.isdigit():
            self._counters[prefix] = max(self._counters.get(prefix, 0), int(tail) + 1)

    def _tensor(self, t, what: str) -> TensorSpec:
        if isinstance(t, (tuple, list)) and t and all(isinstance(x, TensorSpec) for x in t):
            raise TypeError(f"{what}: got a {type(t).__name__} of {len(t)} tensors ({', '.join(x.name for x in t)}), "
                            f"where one tensor goes: pass one of them (lstm returns (y, h_n, c_n))")
        if not isinstance(t, TensorSpec) or self.tensors.get(t.name) is not t:
            raise TypeError(f"{what}: {t!r} is not a tensor of this model")
        return t

    def _check_open(self, what: str) -> None:
        if self._low is not None:
            raise RuntimeError(f"{what}: the model is compiled; build the whole graph before compile()")

    def input(self, shape, dtype="float32", name: str | None = None) -> TensorSpec:
        """A model input of `shape` (dim 0 is the batch) and `dtype`."""
        self._check_open("input")
        shape = as_int_tuple("input shape", shape, least=1)
        if len(shape) < 1:
            raise ValueError(f"input shape must have at least 1 dim (the batch), got {shape}")
        dt = dtype_of_kind(dtype, "fiu")
        if dt is None:
            raise ValueError(f"input dtype must be a float or integer dtype (float32, int64, ...), got {dtype!r}")
        if dt.kind == "f" and dt not in (np.float32, np.float64):
            raise ValueError(f"input dtype {dt.name}: the operators compute in float32 or float64")
        t = TensorSpec(shape, dt.name, self._name("input", name))
        self._count("input", t.name)
        self.inputs.append(t)
        self.tensors[t.name] = t
        return t

    def add_op(self, cls: type, *inputs, name: str | None = None, **attrs):
        """Add an operator of class `cls` (an Op subclass registered with @register_op, such as
        one of your own: README, "Writing an operator") on `inputs`, with its attributes; its
        output (a list where it has several), as the built-in builders (dense, conv2d, ...) give."""
        if not (isinstance(cls, type) and issubclass(cls, Op)):
            raise TypeError(f"add_op: takes an Op subclass, got {cls!r}")
        if OP_REGISTRY.get(cls.kind) is not cls:
            raise ValueError(f"add_op: {cls.__name__} (kind {cls.kind!r}) is not registered: decorate it with "
                             f"@ops.base.register_op, which saved models and the tools find it by")
        return self._add(cls, cls.kind, list(inputs), name, **attrs)

    def _add(self, cls, prefix: str, inputs, name: str | None, **attrs):
        self._check_open(prefix)
        specs = [self._tensor(t, f"{prefix} input {i}") for i, t in enumerate(inputs)]
        op = cls(self._name(prefix, name), specs, **attrs)
        for t in op.outputs:
            if t.name in self.tensors:
                raise ValueError(f"{prefix} {op.name!r}: its output would be named {t.name!r}, the name of a tensor "
                                 f"already in this model: name the op or that tensor otherwise")
        self._insert(op)
        self._count(prefix, op.name)
        return op.outputs[0] if len(op.outputs) == 1 else list(op.outputs)

    def _insert(self, op: Op) -> None:
        """Add a built op: its outputs become tensors, its weights and state get initial values."""
        if self.has_weights:
            shapes = {**op.weight_shapes(), **op.state_shapes()}
            try:
                values = op.init_weights(self._init_rng)
            except MemoryError:
                nbytes = sum(math.prod(s) * np.dtype(op.weight_dtype(k)).itemsize for k, s in shapes.items())
                listed = ", ".join(f"{k} {list(s)}" for k, s in shapes.items())
                raise MemoryError(f"{op.kind} {op.name!r}: its weights ({listed}, {nbytes / 2**30:.3g} GiB) do not "
                                  f"fit in this machine's memory; Model(weights=False) builds the graph "
                                  f"alone") from None
            for k, shape in shapes.items():
                v = np.asarray(values[k])
                if v.shape != tuple(shape):
                    raise ValueError(f"{op.kind} {op.name!r}: init_weights gave {k} shape {v.shape}, expected {shape}")
                self._values[f"{op.name}.{k}"] = v.astype(op.weight_dtype(k))
        self.ops.append(op)
        for t in op.outputs:
            self.tensors[t.name] = t

    def conv2d(self, x, out_channels, kernel, stride=1, padding=0, groups=1, use_bias=True, name=None):
        return self._add(Conv2d, "conv2d", [x], name, out_channels=out_channels, kernel=kernel, stride=stride,
                         padding=padding, groups=groups, use_bias=use_bias)

    def pool2d(self, x, kernel, stride=None, padding=0, pool_type="max", name=None):
        return self._add(Pool2d, "pool2d", [x], name, kernel=kernel, stride=stride, padding=padding,
                         pool_type=pool_type)

    def batch_norm(self, x, eps=1e-5, momentum=0.1, relu=False, name=None):
        return self._add(BatchNorm, "batch_norm", [x], name, eps=eps, momentum=momentum, relu=relu)

    def layer_norm(self, x, normalized_shape=None, eps=1e-5, elementwise_affine=True, name=None):
        shape = x.shape[-1:] if normalized_shape is None and isinstance(x, TensorSpec) else normalized_shape
        return self._add(LayerNorm, "layer_norm", [x], name, normalized_shape=shape, eps=eps,
                         elementwise_affine=elementwise_affine)

    def dense(self, x, out_features, use_bias=True, activation=None, name=None):
        return self._add(Dense, "dense", [x], name, out_features=out_features, use_bias=use_bias,
                         activation=activation)

    def embedding(self, x, num_embeddings, embedding_dim, name=None):
        return self._add(Embedding, "embedding", [x], name, num_embeddings=num_embeddings,
                         embedding_dim=embedding_dim)

    def lstm(self, x, hidden_size, h0=None, c0=None, name=None):
        """Returns (y [batch, seq, hidden], h_n, c_n); h0 and c0 come together or not at all."""
        if (h0 is None) != (c0 is None):
            raise ValueError("lstm: give both h0 and c0, or neither")
        inputs = [x] if h0 is None else [x, h0, c0]
        return tuple(self._add(LSTM, "lstm", inputs, name, hidden_size=hidden_size,
                               with_initial_state=h0 is not None))

    def multihead_attention(self, query, key=None, value=None, num_heads=1, use_bias=True, causal=False,
                            name=None):
        """Self-attention when key and value are omitted."""
        key = query if key is None else key
        value = key if value is None else value
        return self._add(MultiHeadAttention, "multihead_attention", [query, key, value], name,
                         num_heads=num_heads, use_bias=use_bias, causal=causal)

    def batch_matmul(self, a, b, name=None):
        return self._add(BatchMatmul, "batch_matmul", [a, b], name)

    def softmax(self, x, axis=-1, name=None):
        return self._add(Softmax, "softmax", [x], name, axis=axis)

    def dropout(self, x, rate=0.5, seed=None, name=None):
        seed = (self.seed * 1_000_003 + len(self.ops)) % 2**64 if seed is None else seed   # (a mask's seed is 64 bits)
        return self._add(Dropout, "dropout", [x], name, rate=rate, seed=seed)

    def concat(self, tensors, axis, name=None):
        if not isinstance(tensors, (list, tuple)):
            raise TypeError(f"concat: tensors must be a list of tensors, got {type(tensors).__name__} {tensors!r}")
        return self._add(Concat, "concat", list(tensors), name, axis=axis)

    def split(self, x, sizes, axis, name=None) -> list[TensorSpec]:
        """torch.split: `sizes` is a list of sizes, or one chunk size (the last chunk may be smaller)."""
        if isinstance(sizes, (int, np.integer)) and not isinstance(sizes, bool) and isinstance(x, TensorSpec) \
                and isinstance(axis, (int, np.integer)) and not isinstance(axis, bool) and \
                -len(x.shape) <= axis < len(x.shape):   # (another axis: the Split op says what is wrong)
            if sizes < 1:
                raise ValueError(f"split: chunk size must be >= 1, got {sizes}")
            extent = x.shape[axis]
            sizes = [min(sizes, extent - a) for a in range(0, extent, sizes)]
        out = self._add(Split, "split", [x], name, sizes=sizes, axis=axis)
        return out if isinstance(out, list) else [out]

    def flat(self, x, name=None):
        return self._add(Flat, "flat", [x], name)

    def reshape(self, x, shape, name=None):
        return self._add(Reshape, "reshape", [x], name, shape=shape)

    def transpose(self, x, perm, name=None):
        return self._add(Transpose, "transpose", [x], name, perm=perm)

    def _binary(self, fn, a, b, name):
        return self._add(ElementBinary, fn, [a, b], name, fn=fn)

    def add(self, a, b, name=None):
        return self._binary("add", a, b, name)

    def subtract(self, a, b, name=None):
        return self._binary("subtract", a, b, name)

    def multiply(self, a, b, name=None):
        return self._binary("multiply", a, b, name)

    def _unary(self, fn, x, name):
        return self._add(ElementUnary, fn, [x], name, fn=fn)

    def relu(self, x, name=None):
        return self._unary("relu", x, name)

    def sigmoid(self, x, name=None):
        return self._unary("sigmoid", x, name)

    def tanh(self, x, name=None):
        return self._unary("tanh", x, name)

    def gelu(self, x, name=None):
        return self._unary("gelu", x, name)

    @property
    def outputs(self) -> list[TensorSpec]:
        """Op outputs that no op consumes, in creation order."""
        used = {t.name for op in self.ops for t in op.inputs}
        return [t for op in self.ops for t in op.outputs if t.name not in used]

    @property
    def batch_size(self) -> int:
        return self.inputs[0].shape[0] if self.inputs else 0

    # ---- compile --------------------------------------------------------------------------
    def training_graph(self, loss: str = "sparse_categorical_crossentropy", output=None, what: str = "compile"):
        """(ops with the loss op last, inputs with the labels last, the loss op): what compile lowers,
        also for the simulator, which lowers it without weights or a running runtime. `output` is the
        tensor the loss applies to (default: the last op's first output); it must keep the batch as
        its dim 0, as every input does. `what` names the caller in errors."""
        if not isinstance(loss, str) or loss not in LOSSES:
            raise ValueError(f"{what}: unknown loss {loss!r}; expected one of {sorted(LOSSES)}")
        out = self.ops[-1].outputs[0] if output is None else self._tensor(output, f"{what} output")
        if np.dtype(out.dtype).kind != "f" or out.name not in {t.name for op in self.ops for t in op.outputs}:
            raise ValueError(f"{what}: the loss needs a float op output, got {out!r}")
        batches = {t.shape[0] for t in self.inputs}
        if len(batches) > 1:
            raise ValueError(f"{what}: inputs disagree on the batch size (dim 0): "
                             f"{[(t.name, t.shape) for t in self.inputs]}")
        if batches and out.shape[0] not in batches:
            raise ValueError(f"{what}: the output {out.name!r} {tuple(out.shape)} does not keep the batch "
                             f"({batches.pop()} samples) as dim 0, and the loss goes by sample: does a transpose "
                             f"move the batch?")
        producer = next(op for op in self.ops if out in op.outputs)
        taken = {op.name for op in self.ops} | {t.name for t in self.inputs}
        labels_name = _free_name("labels", taken)
        if loss == "sparse_categorical_crossentropy":
            labels = TensorSpec(out.shape[:-1], "int64", labels_name)  # [N, C] -> [N]; [N, T, V] -> [N, T]
            loss_op = SparseCategoricalCrossEntropy(_free_name("loss", taken | {labels_name}), [out, labels],
                                                    from_logits=producer.kind != "softmax")
        else:
            labels = TensorSpec(out.shape, out.dtype, labels_name)
            loss_op = MeanSquaredError(_free_name("loss", taken | {labels_name}), [out, labels])
        return self.ops + [loss_op], self.inputs + [labels], loss_op

    def compile(self, optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=(), configs=None,
                output=None, strategy=None, release: bool | None = None) -> None:
        """Choose optimizer, loss and metrics, and lower the graph onto the runtime.

        optimizer: SGD(...), Adam(...), "sgd" or "adam". loss: "sparse_categorical_crossentropy"
        (on a softmax output it reads probabilities, on anything else logits) or
        "mean_squared_error". configs: op name -> TileConfig (default: ops.lower.default_config).
        output: the tensor the loss applies to (default: the last op's first output).
        strategy: a Strategy or the path of a strategy file, checked whole before any work; `configs`
        override the ops it names, and the model's ops it leaves out get the default with a warning
        (`default_ops` lists them, and the loss op).
        release: whether each training step frees every activation and activation gradient after
        its last use (Runtime.release; None: on GPUs only, ops.lower.releases_by_default).
        A graph that cannot train at its shapes (a batch norm with one value a channel) compiles
        for inference: fit, train_on, and forward and backward in training mode refuse it.
        """
        self._check_not_closed("compile")
        if self._low is not None:
            raise RuntimeError("compile: the model is already compiled")
        if not self.has_weights:
            raise RuntimeError("compile: the model was built with weights=False (its graph alone)")
        if not self.ops:
            raise ValueError("compile: the model has no operators")
        opt = make_optimizer(optimizer, "compile")
        for dtype in sorted({str(np.dtype(op.weight_dtype(k))) for op in self.ops for k in op.weight_shapes()}):
            for field_name, value in opt.to_dict().items():   # (an update runs in the weights' dtype)
                if isinstance(value, float) and beyond_range(np.array([value]), dtype) is not None:
                    raise ValueError(f"compile: {type(opt).__name__} {field_name} {value:g} is beyond the range of "
                                     f"{dtype}, the weights' type")
        if release is not None and not isinstance(release, bool):
            raise TypeError(f"compile: release must be True, False or None, got {type(release).__name__} {release!r}")
        if not isinstance(loss, str) or loss not in LOSSES:
            raise ValueError(f"compile: unknown loss {loss!r}; expected one of {sorted(LOSSES)}")
        if not isinstance(metrics, (str, list, tuple, type(None))):
            raise TypeError(f"compile: metrics must be a metric's name or a list of them, got "
                            f"{type(metrics).__name__} {metrics!r}")
        metrics = [metrics] if isinstance(metrics, str) else list(metrics or ())
        if configs is not None and not isinstance(configs, dict):
            raise TypeError(f"compile: configs must be a dict of op name -> TileConfig, got "
                            f"{type(configs).__name__} {configs!r}")
        for mt in metrics:
            if mt not in METRICS:
                raise ValueError(f"compile: unknown metric {mt!r}; expected some of {list(METRICS)}")
        if "accuracy" in metrics and loss != "sparse_categorical_crossentropy":
            raise ValueError(f"compile: metric 'accuracy' needs loss 'sparse_categorical_crossentropy', got {loss!r}")
        graph, inputs, loss_op = self.training_graph(loss, output)
        out = loss_op.inputs[0]
        configs = dict(configs or {})
        known = {op.name: op for op in graph}
        for k in configs:
            if k not in known:
                raise ValueError(f"compile: configs name op {k!r}, which is not in the model; ops are {sorted(known)}")
        machine = self.rt.machine
        planned, defaulted = {}, list(known)
        if strategy is not None:
            planned, defaulted = _strategy(strategy).resolve(graph, machine, fingerprint=model_fingerprint(self.ops))
        resolved = {name: resolve_config(op, configs[name], machine) if name in configs
                    else planned[name] if name in planned else default_config(op, machine)
                    for name, op in known.items()}
        self.default_ops = [name for name in defaulted if name not in configs]
        left_out = [name for name in self.default_ops if name != loss_op.name]
        if strategy is not None and left_out:
            warnings.warn(f"compile: the strategy names no config for {left_out}; they get the data-parallel "
                          f"default", stacklevel=2)
        classify = loss == "sparse_categorical_crossentropy"
        low = Lowering(self.rt, graph, inputs, resolved, opt, loss=loss_op.name,
                       summarize=functools.partial(_loss_summary, classify), tag=self._tag, release=release)
        low.init_values(self._values)   # (on a runtime that has shut down, this raises: nothing is set yet)
        self._compiled = {"optimizer": opt.to_dict(), "loss": loss, "metrics": metrics, "output": out.name,
                          "configs": {k: v.to_dict() for k, v in resolved.items()}}
        self._loss_op, self.optimizer = loss_op, opt
        self._low, self._values = low, {}
        self._cannot_train = training_error(graph)

    @property
    def configs(self) -> dict[str, TileConfig]:
        """The resolved config of every op (the loss included) after compile."""
        self._need_compiled("configs")
        return {k: plan.config for k, plan in self._low.plans.items()}

    def _need_compiled(self, what: str) -> None:
        self._check_not_closed(what)
        if self._low is None:
            raise RuntimeError(f"{what}: call compile() first")

    def _need_trainable(self, what: str) -> None:
        """_need_compiled, and a graph that can train at its shapes (Op.training_problem)."""
        self._need_compiled(what)
        if self._cannot_train is not None:
            raise ShapeError(f"{what}: {self._cannot_train}; predict and evaluate run in inference mode")

    # ---- data checks ------------------------------------------------------------------------
    def _input_arrays(self, inputs, what: str, batch: bool = False) -> tuple[dict[str, np.ndarray], int]:
        """Inputs as {name: array} (from one array, a list in input order, or a dict), checked."""
        if isinstance(inputs, dict):
            unknown = sorted(set(inputs) - {t.name for t in self.inputs})
            if unknown:
                raise ValueError(f"{what}: unknown inputs {unknown}; the model's inputs are "
                                 f"{[t.name for t in self.inputs]}")
            given = inputs
        elif isinstance(inputs, (list, tuple)):
            given = dict(zip((t.name for t in self.inputs), inputs))
            if len(inputs) > len(self.inputs):
                one = (" (a list is one array per input: give the input as one array, np.asarray(...))"
                       if len(self.inputs) == 1 else "")
                raise ValueError(f"{what}: {len(inputs)} input arrays for {len(self.inputs)} inputs{one}")
        else:
            given = {self.inputs[0].name: inputs} if self.inputs else {}
        missing = [t.name for t in self.inputs if t.name not in given]
        if missing:
            raise ValueError(f"{what}: missing inputs {missing}; give one array per input "
                             f"{[t.name for t in self.inputs]}")
        arrays, n = {}, None
        for t in self.inputs:
            a = _numeric(given[t.name], f"{what}: input {t.name!r}")
            if a.shape[1:] != t.shape[1:] or a.ndim != len(t.shape):
                raise ValueError(f"{what}: input {t.name!r} has shape {a.shape}, expected (N,) + {t.shape[1:]}")
            if np.dtype(t.dtype).kind in "iu" and a.dtype.kind not in "iu":
                raise ValueError(f"{what}: input {t.name!r} needs integers ({t.dtype}), got dtype {a.dtype}")
            if n is not None and a.shape[0] != n:
                raise ValueError(f"{what}: inputs have different sample counts ({n} and {a.shape[0]} for {t.name!r})")
            if beyond_range(a, t.dtype) is not None:
                raise ValueError(f"{what}: input {t.name!r} has values that {np.dtype(t.dtype)} cannot hold (largest "
                                 f"magnitude {_largest(a):.3g}); they would become inf")
            _check_finite(a, f"{what}: input {t.name!r}")
            n = a.shape[0]
            arrays[t.name] = a
        if batch and n != self.batch_size:
            raise ValueError(f"{what}: expects one batch of {self.batch_size} samples, got {n}")
        if n == 0:
            raise ValueError(f"{what}: no samples (every input has 0 rows)")
        for op in self.ops:
            for i, t in enumerate(op.inputs):
                bound = op.index_bound(i)
                if bound is not None and t.name in arrays:
                    _check_indices(arrays[t.name], bound, f"{what}: input {t.name!r} ({op.kind} {op.name!r})")
        return arrays, n

    @property
    def _labels(self) -> TensorSpec:
        """The loss's second input: the labels (or targets) tensor."""
        return self._loss_op.inputs[1]

    def _label_array(self, labels, n: int, what: str) -> np.ndarray:
        spec = self._labels
        y = _numeric(labels, f"{what}: labels")
        if self._compiled["loss"] == "sparse_categorical_crossentropy":
            want = (n,) + spec.shape[1:]
            if len(want) == 1 and y.ndim == 2 and y.shape[1] == 1:
                y = y[:, 0]
            if y.shape != want or y.dtype.kind not in "iu":
                count = f"{n} integers" if len(want) == 1 else "integers"
                raise ValueError(f"{what}: labels must be {count} (shape {want}), got shape {y.shape} "
                                 f"dtype {y.dtype}")
            classes = self._loss_op.inputs[0].shape[-1]
            if y.size and (y.min() < 0 or y.max() >= classes):
                bad = y.min() if y.min() < 0 else y.max()
                raise ValueError(f"{what}: label {bad} is out of range for {classes} classes")
        elif y.shape != (n,) + spec.shape[1:]:
            raise ValueError(f"{what}: targets must have shape {(n,) + spec.shape[1:]}, got {y.shape}")
        _check_finite(y, f"{what}: targets")
        return y

    def _attach(self, arrays: dict[str, np.ndarray], labels=None) -> None:
        low = self._low
        for name, a in arrays.items():
            low.attach(low.values[name], a)
        if labels is not None:
            low.attach(low.values[self._labels.name], labels)

    # ---- training and inference ------------------------------------------------------------------
    @_recovers
    def fit(self, inputs, labels, iterations: int | None = None, epochs: int | None = None,
            batch_size: int | None = None, shuffle: bool = True, verbose: bool = True, stream=None,
            stop_on_nan: bool = False) -> History:
        """Train on `inputs` and `labels` for `iterations` batches or `epochs` passes (default 1 epoch).

        Batches have the model's batch size (its inputs' dim 0); an epoch is N // batch batches
        (the remainder is dropped), in a fresh order from the model's generator when `shuffle`.
        Shows one line per epoch, updated in place, unless verbose=False. A loss that is not
        finite is reported (a RuntimeWarning naming the iteration); with `stop_on_nan` training
        stops there (the iteration after it has been issued already and also runs).
        """
        self._need_trainable("fit")
        if iterations is not None:
            iterations = as_int("fit: iterations", iterations, least=1)
        if epochs is not None:
            epochs = as_int("fit: epochs", epochs, least=1)
        if batch_size is not None:
            batch_size = as_int("fit: batch_size", batch_size, least=1)
        for flag, value in (("shuffle", shuffle), ("verbose", verbose), ("stop_on_nan", stop_on_nan)):
            if not isinstance(value, (bool, np.bool_)):
                raise TypeError(f"fit: {flag} must be True or False, got {type(value).__name__} {value!r}")
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise TypeError(f"fit: stream must have write (sys.stdout, say), got {type(stream).__name__} {stream!r}")
        arrays, n = self._input_arrays(inputs, "fit")
        y = self._label_array(labels, n, "fit")
        b = self.batch_size
        if batch_size is not None and batch_size != b:
            raise ValueError(f"fit: batch_size={batch_size}, but the model was built for batches of {b} "
                             f"(its input shapes); declare the inputs with batch {batch_size} instead")
        if n < b:
            raise ValueError(f"fit: {n} samples are fewer than one batch of {b}")
        if iterations is not None and epochs is not None:
            raise ValueError("fit: give iterations or epochs, not both")
        per_epoch = n // b
        total = per_epoch * (1 if epochs is None else int(epochs)) if iterations is None else int(iterations)
        if total < 1:
            raise ValueError(f"fit: nothing to do (iterations={iterations}, epochs={epochs})")
        history = History()
        progress = _Progress(stream or sys.stdout, verbose, total, per_epoch, "accuracy" in self._compiled["metrics"])
        order, pending = None, None
        for it in range(total):
            k = it % per_epoch
            if k == 0:
                order = self._data_rng.permutation(n) if shuffle else np.arange(n)
            idx = order[k * b:(k + 1) * b]
            first = self.rt.issued
            self._attach({name: a[idx] for name, a in arrays.items()}, y[idx])
            futures = self._train_step(first, valid=b)
            if pending is not None and not self._record(history, progress, *pending) and stop_on_nan:
                pending = None
                break
            pending = (it, futures)
        if pending is not None:
            self._record(history, progress, *pending)
        self._forward_done = False
        return history

    def train_on(self, source, iterations: int):
        """Train `iterations` steps on batches made where they are used; an iterator of each step's mean loss.

        `source(step, lo, hi)` returns (inputs, labels) for samples lo..hi-1 of training step `step`'s
        batch (inputs as fit takes them). Before each step every rank calls it in a task on its host
        processor for its equal share of the batch (rank r of R: [r*B//R, (r+1)*B//R)), so with the
        batch split over the ranks no rank makes or receives another rank's samples. A step's loss is
        yielded once the next step is issued, so that steps overlap.
        """
        self._need_trainable("train_on")
        iterations = as_int("train_on: iterations", iterations, least=1)
        check_source(source, "train_on")
        self._low.source_segment(self._source_task)   # checks the inputs' shapes now, not at the first step
        return self._train_steps(source, iterations)

    def _train_steps(self, source, iterations: int):
        """train_on's steps; after a failed task the runtime is recovered, as fit's is."""
        pending = None
        try:
            for _ in range(iterations):
                self._check_not_closed("train_on")   # (a generator outlives close)
                futures = self._train_step(self.rt.issued, valid=self.batch_size, source=(self._source_task, source))
                if pending is not None:
                    yield _mean_loss(pending)
                pending = futures
            self._forward_done = False
            yield _mean_loss(pending)
        except RuntimeError as exc:
            raise _recovered(self, exc) from None

    def _train_step(self, first: int, **kw):
        """Issue the next training step (Lowering.train_step), whose nodes start at id `first`."""
        self.step += 1
        try:
            return self._low.train_step(self.step, **kw)
        finally:   # (also when a failure stopped the runtime halfway through the step's launches)
            self._issued_steps.append((self.step, first, self.rt.issued))

    def _rewind(self, lost: list[int]) -> None:
        """After a failure: the step count back to before the first issued step that lost a node
        (`lost`: the ids of the nodes that failed or were skipped, in order). Every step before
        it ran whole, since a skipped node depends on the failure, which came later."""
        for step, first, end in self._issued_steps:
            i = bisect.bisect_left(lost, first)
            if i < len(lost) and lost[i] < end:
                self.step = step - 1
                break
        self._issued_steps.clear()

    def _record(self, history: History, progress: "_Progress", it: int, futures) -> bool:
        """Add iteration `it`'s loss (and accuracy) to the history; False if the loss is not finite."""
        loss, correct, count = _total(futures)
        history.loss.append(loss / count)
        finite = bool(np.isfinite(loss))
        if not finite:
            warnings.warn(f"fit: the loss of iteration {it + 1} is {loss / count}", RuntimeWarning, stacklevel=3)
        if progress.accuracy:
            history.accuracy.append(correct / count)
        epoch_end = progress.show(it, history)
        if epoch_end is not None:
            history.epoch_loss.append(epoch_end)
        return finite

    def _batches(self, arrays: dict[str, np.ndarray], n: int):
        """(count, padded batch arrays) covering n samples in order; the last batch is zero-padded."""
        b = self.batch_size
        for start in range(0, n, b):
            count = min(b, n - start)
            yield count, {name: _padded(a[start:start + count], b) for name, a in arrays.items()}

    @_recovers
    def predict(self, inputs) -> np.ndarray:
        """The compiled output for any number of samples, in inference mode (batches of the model's size)."""
        self._need_compiled("predict")
        arrays, n = self._input_arrays(inputs, "predict")
        out = self._low.values[self._compiled["output"]]
        parts = []
        for count, batch in self._batches(arrays, n):
            self._attach(batch)
            self._low.infer_step()
            parts.append((count, self._low.read(out, wait=False)))
        return np.concatenate([f.get()[:count] for count, f in parts])

    @_recovers
    def evaluate(self, inputs, labels) -> dict[str, float]:
        """Mean loss (and accuracy when compiled with it) over all samples, in inference mode."""
        self._need_compiled("evaluate")
        arrays, n = self._input_arrays(inputs, "evaluate")
        y = self._label_array(labels, n, "evaluate")
        futures = []
        for start, (count, batch) in zip(range(0, n, self.batch_size), self._batches(arrays, n)):
            self._attach(batch, _padded(y[start:start + count], self.batch_size))
            futures.append(self._low.infer_step(valid=count, with_loss=True))
        loss = correct = count = 0
        for fm in futures:
            a, c, k = _total(fm)
            loss, correct, count = loss + a, correct + c, count + k
        result = {"loss": loss / count}
        if "accuracy" in self._compiled["metrics"]:
            result["accuracy"] = correct / count
        return result

    @_recovers
    def forward(self, inputs, training: bool = True, outputs=None) -> dict[str, np.ndarray]:
        """Run one batch forward (training mode by default, ready for `backward`); returns
        {tensor name: array} for `outputs` (tensors or names; default: self.outputs)."""
        self._need_compiled("forward")
        if not isinstance(training, (bool, np.bool_)):
            raise TypeError(f"forward: training must be True or False, got {type(training).__name__} {training!r}")
        if training:
            self._need_trainable("forward")
        arrays, _ = self._input_arrays(inputs, "forward", batch=True)
        wanted = self.outputs if outputs is None else outputs
        if isinstance(wanted, (str, TensorSpec)):   # one tensor (a name used to be taken letter by letter)
            wanted = [wanted]
        names = [t.name if isinstance(t, TensorSpec) else t for t in wanted]
        for name in names:
            if name not in self._low.values:
                raise ValueError(f"forward: unknown tensor {name!r}")
        self._attach(arrays)
        low = self._low
        if training:   # a forward not followed by backward leaves what it saved: this one replaces it
            self.rt.wait()
            low.saved.clear()
        low.forward(training=training, ops=[op.name for op in self.ops])
        self._forward_done = bool(training)
        futures = {name: low.read(low.values[name], wait=False) for name in names}
        return {name: f.get() for name, f in futures.items()}

    @_recovers
    def backward(self, labels) -> float:
        """After forward(inputs): the loss on `labels` and every gradient (see `gradients`); returns the mean loss."""
        self._need_compiled("backward")
        if not self._forward_done:
            raise RuntimeError("backward: call forward(inputs) (training mode) first")
        y = self._label_array(labels, self.batch_size, "backward")
        self._attach({}, y)
        low = self._low
        futures = low.forward(training=True, ops=[self._loss_op.name], valid=self.batch_size)
        low.backward()
        self._forward_done = False
        loss, _, count = _total(futures)
        return loss / count

    # ---- weights --------------------------------------------------------------------------------
    def _param_names(self) -> list[str]:
        return [f"{op.name}.{k}" for op in self.ops for k in op.weight_shapes()]

    def _stat_names(self) -> list[str]:
        return [f"{op.name}.{k}" for op in self.ops for k in op.state_shapes()]

    def _read_all(self, names: list[str], region_of, what: str) -> dict[str, np.ndarray]:
        self._check_not_closed(what)
        if not self.has_weights:
            raise RuntimeError("the model was built with weights=False (its graph alone): it has no weights to read")
        if self._low is None:
            return {k: self._values[k].copy() for k in names}
        futures = {k: self._low.read(region_of(k), wait=False) for k in names}
        return {k: f.get() for k, f in futures.items()}

    @_recovers
    def parameters(self) -> dict[str, np.ndarray]:
        """Trainable weights by name ('dense_0.weight'), as numpy copies."""
        return self._read_all(self._param_names(), lambda k: self._low.params[k].value, "parameters")

    @_recovers
    def stats(self) -> dict[str, np.ndarray]:
        """Non-trained state by name ('batch_norm_0.running_mean')."""
        return self._read_all(self._stat_names(), lambda k: self._low.stats[k], "stats")

    @_recovers
    def gradients(self) -> dict[str, np.ndarray]:
        """Gradients of the last backward pass (or training step), for weights on the path to the loss."""
        self._need_compiled("gradients")
        names = [k for k in self._param_names() if self._low.params[k].grad is not None]
        return self._read_all(names, lambda k: self._low.params[k].grad, "gradients")

    @_recovers
    def set_parameters(self, values: dict) -> None:
        """Set weights and/or running stats by name; shapes must match exactly (every value is
        checked before any is set)."""
        self._check_not_closed("set_parameters")
        if not self.has_weights:
            raise RuntimeError("set_parameters: the model was built with weights=False (its graph alone)")
        if not isinstance(values, dict):
            raise TypeError(f"set_parameters: values must be a dict of name -> array, got {type(values).__name__}")
        self._put_parameters(self._checked_parameters(values, "set_parameters"))

    def _checked_parameters(self, values: dict, what: str) -> dict[str, np.ndarray]:
        """`values` (name -> array) checked against the model's weights and running stats and cast
        to their dtypes; `what` begins each error."""
        shapes = {f"{op.name}.{k}": (s, op.weight_dtype(k)) for op in self.ops
                  for k, s in {**op.weight_shapes(), **op.state_shapes()}.items()}
        checked = {}
        for k, v in values.items():
            if k not in shapes:
                raise KeyError(f"{what}: unknown parameter {k!r}; known: {sorted(shapes)}")
            v = _numeric(v, f"{what}: {k}")
            if v.shape != tuple(shapes[k][0]):
                raise ValueError(f"{what}: {k} has shape {v.shape}, expected {tuple(shapes[k][0])}")
            if beyond_range(v, shapes[k][1]) is not None:
                raise ValueError(f"{what}: {k} has values that {np.dtype(shapes[k][1])} cannot hold "
                                 f"(largest magnitude {_largest(v):.3g})")
            _check_finite(v, f"{what}: {k}")
            checked[k] = v.astype(shapes[k][1])
        return checked

    def _put_parameters(self, checked: dict[str, np.ndarray]) -> None:
        for k, v in checked.items():
            if self._low is None:
                self._values[k] = v
            else:
                self._low.attach(self._low.params[k].value if k in self._low.params else self._low.stats[k], v)

    # ---- saving and loading (ops/checkpoint.py) -----------------------------------------------
    @_recovers
    def save(self, path) -> None:
        """One .npz: the graph (JSON), weights, running stats, and after compile the compile settings,
        optimizer state, step count and data-order generator, so training resumes bit for bit."""
        self._check_not_closed("save")
        checkpoint.save(self, path)

    def _load_new(cls, path, runtime: Runtime | None = None, configs: dict | None = None) -> "Model":
        """Model.load(path, runtime=None, configs=None): rebuild, compile and restore a saved model.

        It compiles with the saved configs (the same configs give the same rounding, so training
        continues bit for bit) unless `configs` replaces them, e.g. for a machine with fewer processors."""
        return checkpoint.load_new(cls, path, runtime, configs)

    @_recovers
    def _load_into(self, path) -> None:
        """m.load(path): restore weights, stats (and optimizer state, step and data order where both
        the model and the file were compiled) from a file saved from a model with the same graph; a
        file saved before compile leaves the model's optimizer state and step as they are."""
        self._check_not_closed("load")
        checkpoint.load_into(self, path)

    load = _dualmethod(_load_new, _load_into)


# ---- helpers ------------------------------------------------------------------------------------
def _check_indices(a: np.ndarray, bound: int, what: str) -> None:
    """Every value of an index array in [0, bound), or a ValueError naming the first that is not."""
    bad = (a < 0) | (a >= bound)
    if a.size and bool(bad.any()):
        where = tuple(int(k) for k in np.argwhere(bad)[0])
        raise ValueError(f"{what}: index {a[where]} at {where} is out of range [0, {bound})")


def _check_finite(a: np.ndarray, what: str) -> None:
    """A float array without NaN or inf (one would spread through a step into every weight), or a
    ValueError naming the first; two reductions where all are finite."""
    if a.dtype.kind == "f" and a.size and not (np.isfinite(a.min()) and np.isfinite(a.max())):
        where = tuple(int(k) for k in np.argwhere(~np.isfinite(a))[0])
        raise ValueError(f"{what} has {a[where]} at {where}: the data must be finite")


def _largest(a: np.ndarray) -> float:
    """The largest finite magnitude in float array `a` (for an error that names it)."""
    return float(np.abs(a[np.isfinite(a)]).max(initial=0.0))


def check_source(source, what: str) -> None:
    """A batch source is a function source(step, lo, hi) -> (inputs, labels): Model.train_on's,
    and what the simulator times."""
    if not callable(source):
        raise TypeError(f"{what}: source must be a function source(step, lo, hi) -> (inputs, labels), as "
                        f"Model.train_on takes; got {type(source).__name__} {source!r}")


def _numeric(value, what: str) -> np.ndarray:
    """`value` as an array of numbers (bool, int or float); strings and objects are refused."""
    try:
        a = np.asarray(value)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{what} is not an array of numbers: {e}") from None
    if a.dtype.kind not in "biuf":
        raise ValueError(f"{what} must hold numbers, got dtype {a.dtype} (e.g. {a.flat[0]!r})" if a.size
                         else f"{what} must hold numbers, got dtype {a.dtype}")
    return a


def _strategy(strategy) -> Strategy:
    """compile's strategy argument: a Strategy, or a path to load one from."""
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, (str, os.PathLike)):
        return load_strategy(strategy)
    raise TypeError(f"compile: strategy must be a Strategy or the path of a strategy file, got {strategy!r}")


def _free_name(base: str, taken: set[str]) -> str:
    if base not in taken:
        return base
    i = 0
    while f"{base}_{i}" in taken:
        i += 1
    return f"{base}_{i}"


def _loss_summary(classify: bool, xp, tile, inputs, outputs, valid):
    """Run in each loss tile's forward: (sum of its valid samples' losses, correct predictions, count).

    A sample with many positions (labels [N, T]) counts the fraction of them predicted right."""
    n = tile.shape[0]
    keep = n if valid is None else max(0, min(n, valid - tile.lo[0]))
    total = float(outputs[0][:keep].sum(dtype=np.float64))
    correct = 0
    if classify and keep:
        hits = inputs[0][:keep].argmax(axis=-1) == inputs[1][:keep]
        correct = int(hits.sum()) if hits.ndim == 1 else float(hits.reshape(keep, -1).mean(axis=1).sum())
    return total, correct, keep


def _padded(a: np.ndarray, rows: int) -> np.ndarray:
    """`a` with zero rows appended up to `rows`."""
    if a.shape[0] == rows:
        return a
    return np.concatenate([a, np.zeros((rows - a.shape[0],) + a.shape[1:], a.dtype)])


def _mean_loss(futures) -> float:
    loss, _, count = _total(futures)
    return loss / count


def _total(futures) -> tuple[float, int, int]:
    loss = correct = count = 0
    for value in futures.get().values():
        loss, correct, count = loss + value[0], correct + value[1], count + value[2]
    return loss, correct, count


class _Progress:
    """One line per epoch, rewritten in place (\\r) after every iteration on a terminal, written
    once at the epoch's end elsewhere (a log); nothing when disabled."""

    def __init__(self, stream, enabled: bool, total: int, per_epoch: int, accuracy: bool):
        self.stream, self.enabled = stream, enabled
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.total, self.per_epoch, self.accuracy = total, per_epoch, accuracy
        self.epochs = -(-total // per_epoch)
        self.width = 0

    def show(self, it: int, history: History) -> float | None:
        """Show iteration `it` (0-based); returns the epoch's mean loss when it ends the epoch."""
        epoch, k = divmod(it, self.per_epoch)
        done = k + 1
        losses = history.loss[it - k:it + 1]
        mean = sum(losses) / len(losses)
        last = it + 1 == self.total or done == self.per_epoch
        if self.enabled and (self.tty or last):
            line = f"epoch {epoch + 1}/{self.epochs}  {done}/{self.per_epoch}  loss {mean:.4f}"
            line = "\r" + line if self.tty else line
            if self.accuracy:
                accs = history.accuracy[it - k:it + 1]
                line += f"  accuracy {sum(accs) / len(accs):.3f}"
            self.width = max(self.width, len(line))
            self.stream.write(line.ljust(self.width) + ("\n" if last else ""))
            self.stream.flush()
        return mean if last else None
