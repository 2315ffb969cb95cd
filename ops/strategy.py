"""Strategies: a parallel config per operator of one model, their JSON files and their checks.

A Strategy is a value: the model it was made for (a name, or the fingerprint of its graph,
see `model_fingerprint`) and op name -> TileConfig. It lives on this floor, beside
TileConfig, so that `Model.compile(strategy=...)` can take one (or a file) without ops
importing strategies; the baselines and the search that make strategies live in strategies/.

The file (version 2) is JSON, one op a line; `devices` may be left out (default placement):

    {"version": 2, "model": "graph:3f0c9a1d2b7e4c55", "ops": {
      "conv2d_0": {"degrees": [4, 1, 1, 1], "devices": [0, 1, 2, 3]}}}

Devices are compute devices (the k-th GPU, else the k-th CPU; see TileConfig), so a file
made on a machine model places its tiles on the same GPUs of a run whatever CPU workers the
run has; version 1 numbered all processors, hosts' CPUs among them, and is refused.

Two checks, both before any work, each problem one line naming the file: `from_json`/`load`
check the file's own form (JSON syntax with its line, fields, types, degrees >= 1, one device
a tile); `Strategy.resolve` checks the entries against a graph and a machine (the model, known
ops, the arity, splittable dims and extents of degrees, devices that exist) through
ops.lower.resolve_config, and says which ops the strategy leaves to the data-parallel default.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ops.base import Op
from ops.lower import ConfigError, TileConfig, default_config, resolve_config
from taskrt.machine import Machine

VERSION = 2
FINGERPRINT_PREFIX = "graph:"
_FIELDS = ("version", "model", "ops")
_CONFIG_FIELDS = ("degrees", "devices")


class StrategyError(ValueError):
    """A strategy (or its file) that does not fit its model or machine; one line per problem."""

    #: the problems one_line names; the rest are counted (a file made for another machine has one
    #: for every op)
    SHOWN = 3

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))

    def one_line(self, path: str | None = None) -> str:
        """The first problems on one line, without the file name `path` that each starts with."""
        prefix = f"{path}: " if path else None
        problems = [p[len(prefix):] if prefix and p.startswith(prefix) else p for p in self.problems]
        more = len(problems) - self.SHOWN
        return "; ".join(problems[:self.SHOWN]) + (f"; and {more} more" if more > 0 else "")


def model_fingerprint(ops: Sequence[Op]) -> str:
    """'graph:' and 16 hex digits hashing every op's kind, name, inputs and shapes, in order.

    Pass the model's own ops (model.ops): the loss op that compile adds is not part of it,
    so a model has the same fingerprint before and after compile."""
    desc = [[op.kind, op.name, [[t.name, list(t.shape)] for t in op.inputs], [list(t.shape) for t in op.outputs]]
            for op in ops]
    digest = hashlib.sha256(json.dumps(desc, separators=(",", ":")).encode()).hexdigest()
    return FINGERPRINT_PREFIX + digest[:16]


def is_fingerprint(model: str) -> bool:
    """Whether a strategy's `model` field is a graph fingerprint rather than a model name."""
    tail = model[len(FINGERPRINT_PREFIX):]
    return model.startswith(FINGERPRINT_PREFIX) and len(tail) == 16 and all(c in "0123456789abcdef" for c in tail)


@dataclass(frozen=True)
class Strategy:
    """The parallel config of each named op of one model; ops not named get ops.lower.default_config.

    `model` is a model name or a `model_fingerprint`; `source` is the file it was read from
    (it names the file in errors and takes no part in equality).
    """

    model: str
    ops: Mapping[str, TileConfig]
    source: str | None = field(default=None, compare=False)

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise TypeError(f"Strategy model must be a non-empty string (a name or fingerprint), got {self.model!r}")
        ops = dict(self.ops)
        for name, config in ops.items():
            if not isinstance(name, str) or not isinstance(config, TileConfig):
                raise TypeError(f"Strategy ops must map op names to TileConfigs, got {name!r}: {config!r}")
        object.__setattr__(self, "ops", ops)

    def __hash__(self) -> int:
        return hash((self.model, tuple(sorted(self.ops.items()))))

    def __repr__(self) -> str:
        shown = list(self.ops.items())[:4]
        body = ", ".join(f"{name}: {config}" for name, config in shown)
        more = f", ... {len(self.ops) - len(shown)} more" if len(self.ops) > len(shown) else ""
        return f"Strategy({self.model!r}, {{{body}{more}}})"

    def __str__(self) -> str:
        width = max((len(name) for name in self.ops), default=0)
        rows = [f"  {name.ljust(width)}  {config}" for name, config in self.ops.items()]
        return "\n".join([f"strategy for {self.model} ({len(self.ops)} ops)"] + rows)

    def replace(self, name: str, config: TileConfig) -> "Strategy":
        """This strategy with op `name` given `config` (added or replaced)."""
        return Strategy(self.model, {**self.ops, name: config}, self.source)

    # ---- checks against a graph and a machine -----------------------------------------------------
    def resolve(self, ops: Sequence[Op], machine: Machine, name: str | None = None,
                fingerprint: str | None = None) -> tuple[dict[str, TileConfig], list[str]]:
        """(op name -> config with its devices filled in, for every op of `ops`; the names the
        strategy does not name, which get the data-parallel default), after checking every entry.

        `fingerprint` is the model's (default: model_fingerprint(ops); compile passes that of the
        model's own ops, its loss op being extra); `name`, when given, must match a `model` that is
        a name. Raises StrategyError naming each problem."""
        where = self.source or "strategy"
        ops = list(ops)
        fingerprint = fingerprint or model_fingerprint(ops)
        if is_fingerprint(self.model) and self.model != fingerprint:
            raise StrategyError([f"{where}: made for model {self.model}, but this model is {fingerprint} "
                                 f"(its ops, names or shapes differ; the batch size is in the shapes)"])
        if not is_fingerprint(self.model) and name is not None and self.model != name:
            raise StrategyError([f"{where}: made for model {self.model!r}, but this model is {name!r}"])
        by_name = {op.name: op for op in ops}
        problems, resolved = [], {}
        for op_name, config in self.ops.items():
            op = by_name.get(op_name)
            if op is None:
                problems.append(f"{where}: {_unknown_op(op_name, list(by_name))}")
                continue
            try:
                resolved[op_name] = resolve_config(op, config, machine)
            except ConfigError as e:
                problems.append(f"{where}: {e}")
        if problems:
            raise StrategyError(problems)
        configs = {op.name: resolved[op.name] if op.name in resolved else default_config(op, machine) for op in ops}
        return configs, [op.name for op in ops if op.name not in self.ops]

    # ---- files ------------------------------------------------------------------------------------
    def to_json(self) -> str:
        """The file's text, one op a line in this strategy's order."""
        rows = []
        for name, config in self.ops.items():
            entry = {"degrees": list(config.degrees)}
            if config.devices is not None:
                entry["devices"] = list(config.devices)
            rows.append(f"    {json.dumps(name)}: {json.dumps(entry)}")
        ops = "{\n" + ",\n".join(rows) + "\n  }" if rows else "{}"
        return f'{{\n  "version": {VERSION},\n  "model": {json.dumps(self.model)},\n  "ops": {ops}\n}}\n'

    @staticmethod
    def from_json(text: str, source: str | None = None) -> "Strategy":
        """Parse and check a file's text; `source` names it in errors (and in the result)."""
        where = source or "strategy"
        if not isinstance(text, (str, bytes, bytearray)):
            raise StrategyError([f"{where}: a strategy is JSON text, got {type(text).__name__}"])
        duplicates: list[str] = []
        try:
            data = json.loads(text, object_pairs_hook=lambda pairs: noting_duplicates(pairs, duplicates))
        except json.JSONDecodeError as e:
            raise StrategyError([f"{where}:{e.lineno}:{e.colno}: malformed JSON: {e.msg}"]) from None
        except RecursionError:
            raise StrategyError([f"{where}: JSON nested too deeply to be a strategy"]) from None
        problems = [f"{where}: key {key!r} appears twice in one object" for key in duplicates]
        if not isinstance(data, dict):
            raise StrategyError(problems + [f"{where}: a strategy file holds a JSON object, got {type(data).__name__}"])
        problems += [f"{where}: unknown field {k!r}; a strategy file has {', '.join(map(repr, _FIELDS))}"
                     for k in data if k not in _FIELDS]
        problems += [f"{where}: missing field {k!r}" for k in _FIELDS if k not in data]
        version, model, entries = data.get("version"), data.get("model"), data.get("ops")
        if version == 1 and isinstance(version, int) and not isinstance(version, bool):
            problems.append(f"{where}: version 1 numbered a machine's processors, hosts' CPUs among them; version "
                            f"{VERSION} numbers its compute devices (the GPUs, else the CPUs): where the machine has "
                            f"no GPU the numbers are the same, so set 'version' to {VERSION}; else make the strategy "
                            f"again")
        elif "version" in data and (version != VERSION or not isinstance(version, int) or isinstance(version, bool)):
            problems.append(f"{where}: version {version!r} is not supported; this reader knows version {VERSION}")
        if "model" in data and (not isinstance(model, str) or not model):
            problems.append(f"{where}: 'model' must be a model name or fingerprint (a non-empty string), got {model!r}")
        if "ops" in data and not isinstance(entries, dict):
            problems.append(f"{where}: 'ops' must map op names to configs, got {type(entries).__name__}")
        configs = {}
        for name, entry in (entries.items() if isinstance(entries, dict) else ()):
            try:
                configs[name] = _config(name, entry)
            except ConfigError as e:
                problems.append(f"{where}: op {name!r}: {e}")
        if problems:
            raise StrategyError(problems)
        return Strategy(model, configs, source)

    def save(self, path) -> None:
        """Write the file to `path`."""
        save(self, path)


#: the longest strategy file read (1,024 devices' configs for a thousand ops take a few MiB)
MAX_CHARS = 64 << 20


def save(strategy: Strategy, path) -> None:
    """Write `strategy` as a JSON strategy file."""
    with open(path, "w") as f:
        f.write(strategy.to_json())


def load(path) -> Strategy:
    """Read and check a strategy file (its form; `Strategy.resolve` checks it against a model)."""
    if not isinstance(path, (str, os.PathLike)):   # open() takes an int as a descriptor, and closes it
        raise TypeError(f"strategy load: a file's path (str or path-like), got {type(path).__name__} {path!r}")
    where = str(path)
    try:
        with open(path) as f:
            text = f.read(MAX_CHARS + 1)   # (not all of /dev/zero)
    except OSError as e:
        raise StrategyError([f"{where}: can't read the strategy file: {e.strerror}"]) from None
    except UnicodeDecodeError as e:
        raise StrategyError([f"{where}: not a text file ({e.reason} at byte {e.start})"]) from None
    if len(text) > MAX_CHARS:
        raise StrategyError([f"{where}: over {MAX_CHARS >> 20} Mi characters, not a strategy file"])
    return Strategy.from_json(text, source=where)


def noting_duplicates(pairs: list[tuple[str, object]], duplicates: list[str]) -> dict:
    """json's object hook: a dict, recording keys given twice (json.loads would keep the last silently)."""
    out = {}
    for k, v in pairs:
        if k in out:
            duplicates.append(k)
        out[k] = v
    return out


def _config(name: str, entry) -> TileConfig:
    """One op's entry of a file as a TileConfig; raises ConfigError naming what is wrong."""
    if not isinstance(entry, dict):
        raise ConfigError(f"a config is an object with 'degrees' and optional 'devices', got {entry!r}")
    unknown = [k for k in entry if k not in _CONFIG_FIELDS]
    if unknown:
        raise ConfigError(f"unknown field {unknown[0]!r}; a config has 'degrees' and optional 'devices'")
    if "degrees" not in entry:
        raise ConfigError("missing field 'degrees'")
    for k in _CONFIG_FIELDS:
        if k in entry and entry[k] is not None and not isinstance(entry[k], list):
            raise ConfigError(f"{k!r} must be a list of ints, got {entry[k]!r}")
    if entry["degrees"] is None:
        raise ConfigError("'degrees' must be a list of ints, got null")
    return TileConfig.from_dict(entry)


def _unknown_op(name: str, known: list[str]) -> str:
    """'unknown operator' with the nearest names of the model's ops (or a few of them)."""
    near = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
    if near:
        return f"unknown operator {name!r}; nearest: {', '.join(map(repr, near))}"
    shown = ", ".join(map(repr, known[:8])) + (", ..." if len(known) > 8 else "")
    return f"unknown operator {name!r}; the model's ops are {shown}"
