"""Saving and loading models: one .npz with the graph as JSON and every array, so that a
reloaded model continues training bit for bit (weights, running stats, optimizer state,
step count, the data-order generator and the resolved tile configs)."""
from __future__ import annotations

import json
import os
import zipfile
import zlib

import numpy as np

from ops.base import OP_REGISTRY
from ops.lower import ConfigError, TileConfig, compute_processors
from ops.optimizers import optimizer_from_dict

#: 2: saved configs' devices are compute devices (TileConfig); 1 numbered every processor
FORMAT = 2


def graph_dict(model) -> dict:
    """The model's inputs and operators (kinds, names, attrs) as plain JSON-able values."""
    return {"format": FORMAT, "seed": model.seed,
            "inputs": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in model.inputs],
            "ops": [{"kind": op.kind, "name": op.name, "inputs": [t.name for t in op.inputs],
                     "attrs": op.attrs()} for op in model.ops],
            "counters": model._counters}


def save(model, path) -> None:
    """One .npz: the graph (JSON), weights, running stats, and after compile the compile settings,
    optimizer state, step count and data-order generator, so training resumes bit for bit. On
    many ranks every rank calls it (collective) and rank 0 writes the file."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"save: a file's path (str or path-like), got {type(path).__name__} {path!r}")
    folder = os.path.dirname(os.fspath(path)) or "."
    if not os.path.isdir(folder):   # (checked on every rank: rank 0's write failing would end them all)
        raise FileNotFoundError(f"save {path}: no folder {folder!r} to write it in")
    if os.path.isdir(path):
        raise IsADirectoryError(f"save {path}: a folder, not a file to write")
    meta = {"graph": graph_dict(model), "compiled": model._compiled, "step": model.step,
            "data_rng": model._data_rng.bit_generator.state}
    arrays = {f"param/{k}": v for k, v in model.parameters().items()}
    arrays.update({f"stat/{k}": v for k, v in model.stats().items()})
    if model._low is not None:
        for p in model._low.params.values():
            for s, region in p.state.items():
                arrays[f"opt/{p.name}/{s}"] = model._low.read(region)
    meta_text = json.dumps(meta, default=_json_default)
    rt = model.rt
    if rt.transport is None:
        _write(path, meta_text, arrays)
    else:   # every rank saves (its reads are collective), rank 0 alone writes, and all wait for it
        rt.launch(_write, args=(path, meta_text, arrays), proc=rt.machine.host_processor(0),
                  name="save").get()


def _write(path, meta_text: str, arrays: dict) -> None:
    """The .npz, written beside `path` and renamed onto it: a reader never sees it half written,
    and a failed write leaves what was there."""
    path = os.fspath(path)
    partial = f"{path}.partial-{os.getpid()}"
    try:
        with open(partial, "wb") as f:
            np.savez(f, meta=np.array(meta_text), **arrays)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def load_new(cls, path, runtime=None, configs: dict | None = None):
    """Model.load(path, runtime=None, configs=None): rebuild, compile and restore a saved model.

    It compiles with the saved configs (the same configs give the same rounding, so training
    continues bit for bit) unless `configs` replaces them, e.g. for a machine with fewer processors."""
    meta, arrays = _read_file(path)
    graph = meta["graph"]
    m = cls(runtime, seed=graph["seed"])
    for t in graph["inputs"]:
        m.input(t["shape"], t["dtype"], t["name"])
    for d in graph["ops"]:
        if d["kind"] not in OP_REGISTRY:
            raise ValueError(f"load {path}: unknown operator kind {d['kind']!r} (an op of your own: import the module "
                             f"that defines it, with @register_op, before loading); known: {sorted(OP_REGISTRY)}")
        op = OP_REGISTRY[d["kind"]](d["name"], [m.tensors[n] for n in d["inputs"]], **d["attrs"])
        m._insert(op)
    m._counters = dict(graph["counters"])
    c = meta["compiled"]
    if c is not None:
        saved = configs is None
        if saved:
            configs = {k: TileConfig.from_dict(v) for k, v in c["configs"].items()}
            if graph["format"] == 1:
                configs = _renumbered(configs, m.rt.machine, path)
        try:
            m.compile(optimizer_from_dict(c["optimizer"]), c["loss"], c["metrics"], configs,
                      output=m.tensors[c["output"]])
        except ConfigError as e:
            if not saved:
                raise
            raise ConfigError(f"load {path}: the configs saved with the model do not fit this runtime's "
                              f"{m.rt.machine!r}: {e} (Model.load(path, configs=...) gives others)") from None
    restore(m, meta, arrays, f"load {path}")
    return m


def _renumbered(configs: dict, machine, path) -> dict:
    """A format-1 file's configs, whose devices were processor indices, in device numbers on
    `machine` (the saved configs fit the machine that loads them, so it is the one they name)."""
    procs = compute_processors(machine)
    out = {}
    for name, config in configs.items():
        strays = [d for d in config.devices or () if d not in procs]
        if strays:
            raise ConfigError(f"load {path}: a file of format 1 places op {name!r} on processor {strays[0]}, not "
                              f"one of the {len(procs)} compute processors of this runtime's {machine!r} "
                              f"(Model.load(path, configs=...) gives others)")
        out[name] = config if config.devices is None else TileConfig(
            config.degrees, tuple(procs.index(d) for d in config.devices))
    return out


def load_into(model, path) -> None:
    """m.load(path): restore weights, stats (and optimizer state, step and data order where both
    the model and the file were compiled) from a file saved from a model with the same graph; a
    file saved before compile leaves the model's optimizer state and step as they are."""
    meta, arrays = _read_file(path)
    mine = json.loads(json.dumps(graph_dict(model), default=_json_default))
    theirs = meta["graph"]
    if (mine["inputs"], mine["ops"]) != (theirs["inputs"], theirs["ops"]):
        raise ValueError(f"load {path}: the file holds a different graph than this model: "
                         f"{_graph_difference(theirs, mine)}")
    restore(model, meta, arrays, f"load {path}")


def _graph_difference(theirs: dict, mine: dict) -> str:
    """The first thing that differs between a file's graph and a model's, in words."""
    if theirs["inputs"] != mine["inputs"]:
        return f"its inputs are {theirs['inputs']}, this model's {mine['inputs']}"
    names = ([o["name"] for o in theirs["ops"]], [o["name"] for o in mine["ops"]])
    if names[0] != names[1]:
        return f"its ops are {names[0]}, this model's {names[1]}"
    for a, b in zip(theirs["ops"], mine["ops"]):
        for key in sorted(set(a) | set(b)):
            there, here = a.get(key), b.get(key)
            if there != here:
                if isinstance(there, dict) and isinstance(here, dict):   # (an op's attrs: name the one)
                    key = next(k for k in sorted(set(there) | set(here)) if there.get(k) != here.get(k))
                    there, here = there.get(key), here.get(key)
                return f"op {a['name']!r} has {key} {there!r} there, {here!r} here"
    return "they differ"


def restore(model, meta: dict, arrays: dict, where: str) -> None:
    """Put a file's arrays (and, when compiled, optimizer state, step and data order) into `model`;
    everything is checked before anything is put in, so a file that does not fit changes nothing.
    `where` ("load PATH") begins each error."""
    values = {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith(("param/", "stat/"))}
    missing = [k for k in model._param_names() + model._stat_names() if k not in values]
    if missing:
        raise ValueError(f"{where}: a damaged model file: no {', '.join(map(repr, missing[:4]))}"
                         f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''}")
    try:
        checked = model._checked_parameters(values, where)
    except KeyError as e:
        raise ValueError(e.args[0]) from None
    compiled = model._low is not None and meta["compiled"] is not None
    states, step, data_order = [], None, None
    if compiled:
        for p in model._low.params.values():
            for s, region in p.state.items():
                key = f"opt/{p.name}/{s}"
                if key not in arrays:
                    raise ValueError(f"{where}: the file has no optimizer state {key!r} (saved with another "
                                     f"optimizer?)")
                state = arrays[key]
                if state.shape != region.shape or state.dtype.kind != "f":
                    raise ValueError(f"{where}: optimizer state {key!r} is {state.dtype}{list(state.shape)}, this "
                                     f"model's {region.dtype}{list(region.shape)}")
                states.append((region, state))
        step = meta["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"{where}: a damaged model file: its step is {step!r}, not a count")
        data_order = np.random.PCG64()
        try:
            data_order.state = meta["data_rng"]
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"{where}: a damaged model file: its data-order generator state does not load "
                             f"({_reason(e)})") from None
    model._put_parameters(checked)
    for region, array in states:
        model._low.attach(region, array)
    if compiled:
        model.step = step
        model._data_rng.bit_generator.state = data_order.state


def _json_default(v):
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    if isinstance(v, (tuple, set)):
        return list(v)
    raise TypeError(f"can't save {type(v).__name__} {v!r} as JSON")


def _read_file(path) -> tuple[dict, dict[str, np.ndarray]]:
    """The meta dict and arrays of a file saved by `save`; anything else (missing, empty,
    truncated, not an npz, an npz that is not a model) is a ValueError naming the path."""
    where = f"load {path}"
    try:
        f = np.load(path, allow_pickle=False)
    except OSError as e:
        raise ValueError(f"{where}: can't read the file: {e.strerror or e}") from None
    except EOFError:
        raise ValueError(f"{where}: not a model file (an .npz written by Model.save): the file is empty") from None
    except (ValueError, zipfile.BadZipFile):
        raise ValueError(f"{where}: not a model file (an .npz written by Model.save): its bytes are not a "
                         f"complete .npz (damaged, truncated, or another format)") from None
    if not isinstance(f, np.lib.npyio.NpzFile):
        raise ValueError(f"{where}: not a model file: it holds one array, not an .npz written by Model.save")
    try:
        with f:
            arrays = {k: f[k] for k in f.files}
    except (EOFError, ValueError, OSError, zipfile.BadZipFile, zlib.error) as e:
        raise ValueError(f"{where}: the file is damaged or truncated: {_reason(e)}") from None
    if "meta" not in arrays:
        raise ValueError(f"{where}: an .npz but not a model file: it has no 'meta' entry "
                         f"(it holds {sorted(arrays)[:6]})")
    try:
        meta = json.loads(str(arrays.pop("meta")))
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: its 'meta' entry is not JSON: {e.msg}") from None
    graph = meta.get("graph") if isinstance(meta, dict) else None
    if not isinstance(graph, dict) or type(graph.get("format")) is not int or graph["format"] not in (1, FORMAT):
        raise ValueError(f"{where}: not a model file of format {FORMAT} (or 1)")
    missing = [k for k in ("compiled", "step", "data_rng") if k not in meta] + [
        k for k in ("inputs", "ops", "seed", "counters") if k not in graph]
    if missing:
        raise ValueError(f"{where}: a damaged model file: no {', '.join(map(repr, missing))}")
    return meta, arrays


def _reason(e: BaseException) -> str:
    return str(e) or type(e).__name__
