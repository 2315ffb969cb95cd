"""Machine models: the devices and links a simulated run is timed on, from JSON files.

A machine model is `nodes` identical nodes of `devices_per_node` devices each (one kind,
one DeviceSpec), the links inside a node and between nodes, and, for GPU machines, the
node's host CPUs and the host <-> GPU link. `to_machine()` turns it into the taskrt
Machine that strategies are written for (one rank per node), and `link`, `channel` and
`device_of` answer the cost model's questions about that Machine's memories and processors.

Shipped files live in strategies/machines/ and load by name (`p100`, `k80`, `h100`,
`local`); any other path loads too. The format (version 1; units are SI base units:
FLOP/s, bytes/s, bytes, seconds):

    {"version": 1, "name": "p100", "notes": ["where each figure comes from", ...],
     "nodes": 4, "devices_per_node": 4,
     "device": {"kind": "gpu", "name": "Tesla P100-SXM2-16GB",
                "peak_flops": 10.6e12, "mem_bandwidth": 732e9, "mem_bytes": 16e9},
     "host": {"kind": "cpu", ...the same fields...},
     "intra_node": {"bandwidth": 20e9, "latency": 5e-6, "shared_by": "pair"},
     "inter_node": {"bandwidth": 12.5e9, "latency": 5e-6, "shared_by": "sender"},
     "host_link": {"bandwidth": 12e9, "latency": 10e-6, "shared_by": "pair"},
     "launch_overhead": 5e-6,
     "efficiency": {"default": 0.5, "dense": 0.7, "conv2d": 0.6},
     "fitted": null}

- `device.kind` is "gpu" or "cpu"; a cpu machine (`local`) has no `host` and no
  `host_link` (its devices are the host's CPU workers, each with a memory of its own).
- `bandwidth` is per direction; `shared_by` says which copies queue for one link:
  "pair" (each ordered pair of endpoints has its own link: NVLink between two GPUs) or
  "sender" (every copy leaving one device, or one node for inter_node, shares it: a
  GPU's NVSwitch port, a node's network card).
- `launch_overhead`: seconds each task costs besides its kernel (a CUDA launch; the
  runtime's Python per task on CPUs).
- `send_overhead`, `receive_overhead` (optional, cpu machines only, default 0): seconds of
  the sending and of the receiving device's processor that a copy between two ranks takes.
  The runtime's MPI handling (posting, completing, its progress thread's wake-ups) runs on
  the cores the workers use, so the simulator charges it to them, before and after the wire:
  at once, beside what the worker runs, whose work then ends that much later.
- `message_delay` (optional, cpu machines only, default 0): seconds a copy between two ranks
  spends in flight besides the link's latency, holding no processor: the runtime's hand-offs
  between its threads (the issuing thread posting the send, the progress thread finding the
  message, the worker waking up to it).
- `nap_first`, `nap_longest`, `nap_share` (optional, cpu machines only, default 0): where a
  node's ranks have no core to spare for their MPI progress threads (Machine.threads_fit_node,
  as the runtime decides), a progress thread naps while nothing ends, the first nap
  `nap_first` seconds, each next one twice the last up to `nap_longest`
  (taskrt/mpi_progress.py), and takes a message that arrived meanwhile when its nap is over.
  A copy between ranks then waits, in flight, `nap_share` times half the nap in effect at how
  long its receiver had gone without a receipt (strategies/timing.py, `Naps`).
- `kernel_slowdown` (optional, default 1): a task's kernel inside a run over the same kernel
  measured alone; on CPUs the rank's issuing and MPI threads and the other ranks share the
  cores. Measured and roofline kernel seconds are multiplied by it.
- `kernel_surcharge`, `kernel_surcharge_cap` (optional, default 0): more time
  inside a run for short kernels: `kernel_surcharge` times the kernel's seconds alone, at most
  `kernel_surcharge_cap` seconds. In a run a kernel of a few microseconds takes several times
  as long as alone, a millisecond's convolution 1.1-1.2 times (docs/accuracy.md, session 39).
  `kernel_seconds` puts the three together.
- `efficiency`: op kind -> the fraction of `peak_flops` its kernels reach ("default" for
  the others), the roofline's compute term (strategies/cost.py); `fitted` says what
  they were fitted on (null: estimates, not fitted).
- `runtime_fitted` (optional): what the five runtime figures above were fitted on, where
  `python -m apps.calibrate --write` fitted them (strategies/overheads.py).
- null (cpu devices only) means "found on this machine when loaded", its nodes the ranks of a
  run here (`mpiexec -n NODES` on this host): `devices_per_node` the CPU workers the runtime
  gives each (TASKRT_CPUS, else the host's cores shared evenly among the nodes, at least one;
  `nodes_per_host` is then the node count), `device.name` the CPU model, `device.mem_bytes`
  the physical memory shared evenly among all the devices.

A file that does not fit gets a MachineError of one line naming the file and the field.
"""
from __future__ import annotations

import json
import math
import os
import platform
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

import numpy as np

from ops.strategy import noting_duplicates
from taskrt.machine import Machine, Memory, Processor, cpus_here, physical_memory

VERSION = 1
MACHINES_DIR = Path(__file__).with_name("machines")
DEVICE_KINDS = ("gpu", "cpu")
SHARING = ("pair", "sender")
_FIELDS = ("version", "name", "notes", "nodes", "devices_per_node", "device", "host", "intra_node", "inter_node",
           "host_link", "launch_overhead", "send_overhead", "receive_overhead", "message_delay", "nap_first",
           "nap_longest", "nap_share", "kernel_slowdown", "kernel_surcharge", "kernel_surcharge_cap", "efficiency",
           "fitted", "runtime_fitted")
_GPU_ONLY = ("host", "host_link")
_CPU_ONLY = ("send_overhead", "receive_overhead", "message_delay", "nap_first", "nap_longest", "nap_share")
_DEVICE_FIELDS = ("kind", "name", "peak_flops", "mem_bandwidth", "mem_bytes")
_LINK_FIELDS = ("bandwidth", "latency", "shared_by")
_MISSING = object()


class MachineError(ValueError):
    """A machine name or file that does not fit; one line naming the file and the field."""


def _si(value: float, unit: str) -> str:
    """`value` with an SI prefix: 10.6e12, 'FLOP/s' -> '10.6 TFLOP/s'."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


@dataclass(frozen=True)
class DeviceSpec:
    """One device's figures: float32 peak (FLOP/s), memory bandwidth (bytes/s) and size (bytes)."""

    kind: str
    name: str
    peak_flops: float
    mem_bandwidth: float
    mem_bytes: int

    def __repr__(self) -> str:
        return (f"DeviceSpec({self.kind} {self.name!r}: {_si(self.peak_flops, 'FLOP/s')}, "
                f"{_si(self.mem_bandwidth, 'B/s')}, {_si(self.mem_bytes, 'B')})")

    @property
    def tag(self) -> str:
        """'kind:name', what cost keys and measurements call this device."""
        return f"{self.kind}:{self.name}"


@dataclass(frozen=True)
class LinkSpec:
    """A link: bandwidth per direction (bytes/s), latency (s), and which copies share it (see module doc)."""

    bandwidth: float
    latency: float
    shared_by: str = "pair"

    def __repr__(self) -> str:
        if math.isinf(self.bandwidth):
            return "LinkSpec(same memory)"
        return f"LinkSpec({_si(self.bandwidth, 'B/s')}, {self.latency * 1e6:.3g} us, per {self.shared_by})"


#: what a "copy" within one memory costs: nothing
SAME_MEMORY = LinkSpec(math.inf, 0.0)


#: the most devices a machine model may have: 4 million took 4 GB and a minute and a half to
#: search the tiny mlp on, and 400 million ran this machine out of memory
MAX_DEVICES = 1 << 20


@dataclass(frozen=True)
class MachineModel:
    """`nodes` nodes of `devices_per_node` devices, their links, and the roofline's efficiencies.

    `host` and `host_link` are the node's CPUs and the host <-> GPU link (for a cpu machine,
    the device itself and `intra_node`). `efficiency` maps op kinds to fractions of peak
    ("default" for the rest); treat it as read-only (`with_efficiency` makes a new model).
    """

    name: str
    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    efficiency: Mapping[str, float] = field(hash=False)
    host: DeviceSpec | None = None
    host_link: LinkSpec | None = None
    launch_overhead: float = 0.0
    send_overhead: float = 0.0
    receive_overhead: float = 0.0
    message_delay: float = 0.0
    nap_first: float = 0.0
    nap_longest: float = 0.0
    nap_share: float = 0.0
    kernel_slowdown: float = 1.0
    kernel_surcharge: float = 0.0
    kernel_surcharge_cap: float = 0.0
    #: how many of the nodes share one host's cores: 1 for a machine of separate hosts; a cpu model
    #: whose nodes are the ranks of one machine under mpiexec (the demo's, the apps') has them all
    #: there. A CPU worker's BLAS threads, as measured, are the host's cores over nodes_per_host x
    #: devices_per_node, as the runtime's limit_blas_threads shares them (strategies/cost.py)
    nodes_per_host: int = 1
    notes: tuple[str, ...] = field(default=(), compare=False)
    fitted: str | None = None
    runtime_fitted: str | None = None
    source: str | None = field(default=None, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "efficiency", dict(self.efficiency))
        if isinstance(self.nodes_per_host, bool) or not isinstance(self.nodes_per_host, int) or \
                not 1 <= self.nodes_per_host <= self.nodes:
            raise MachineError(f"{self.source or self.name}: nodes_per_host must be a whole number from 1 to its "
                               f"{self.nodes} node(s), got {self.nodes_per_host!r}")
        if self.nodes * self.devices_per_node > MAX_DEVICES:
            raise MachineError(f"{self.source or self.name}: {_many(self.nodes)} nodes of {self.devices_per_node} "
                               f"devices are {_many(self.nodes * self.devices_per_node)} devices; a machine model "
                               f"has at most {MAX_DEVICES:,} (the simulator's machine alone holds about a kilobyte "
                               f"a device)")
        if self.host is None:
            object.__setattr__(self, "host", self.device)
        if self.host_link is None:
            object.__setattr__(self, "host_link", self.intra_node)

    def __repr__(self) -> str:
        nodes = f"{self.nodes} node" + ("s" if self.nodes != 1 else "")
        return (f"MachineModel({self.name!r}: {nodes} x {self.devices_per_node} {self.device!r}; "
                f"intra {self.intra_node!r}, inter {self.inter_node!r})")

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def kernel_seconds(self, alone):
        """A kernel's seconds inside a run from its seconds `alone` (a float or an array), by this
        model's kernel figures (module function kernel_seconds)."""
        return kernel_seconds(alone, self.kernel_slowdown, self.kernel_surcharge, self.kernel_surcharge_cap)

    def efficiency_of(self, kind: str) -> float:
        """The fraction of peak an op kind's kernels reach (the 'default' entry for kinds not listed)."""
        return self.efficiency.get(kind, self.efficiency["default"])

    def with_nodes(self, nodes: int) -> "MachineModel":
        """This model with `nodes` nodes."""
        _check_nodes(nodes, self.source or self.name)
        return replace(self, nodes=int(nodes), nodes_per_host=min(self.nodes_per_host, int(nodes)))

    def with_efficiency(self, efficiency: Mapping[str, float], fitted: str | None = None) -> "MachineModel":
        """This model with `efficiency` merged over its own (e.g. fitted from measurements)."""
        return replace(self, efficiency={**self.efficiency, **efficiency}, fitted=fitted or self.fitted)

    # ---- the taskrt Machine it stands for --------------------------------------------------------
    def to_machine(self) -> Machine:
        """One rank per node. GPU machines: one CPU (the host) and the GPUs per rank, so the
        strategies' compute processors are the GPUs. CPU machines: the devices are the CPU
        workers, each with a memory of its own (so every copy the runtime makes is seen)."""
        if self.device.kind == "gpu":
            return Machine.build(self.nodes, cpus_per_rank=1, gpus_per_rank=self.devices_per_node)
        return Machine.build(self.nodes, cpus_per_rank=self.devices_per_node, separate_memories=True)

    def device_of(self, processor: Processor) -> DeviceSpec:
        """The figures of the device behind a processor of to_machine(): a GPU, or a CPU (host)."""
        if processor.kind == self.device.kind:
            return self.device
        if processor.kind == "cpu":
            return self.host
        raise MachineError(f"{self.name}: processor {processor} is a {processor.kind}, but this machine has "
                           f"{self.device.kind} devices and a cpu host")

    def route(self, src: Memory, dst: Memory) -> str:
        """Which link a copy from `src` to `dst` crosses: 'same' (one memory), 'inter' (another
        node), 'host' (host <-> GPU inside a node) or 'intra' (two devices of a node)."""
        if src == dst:
            return "same"
        if src.rank != dst.rank:
            return "inter"
        on_host = [self.device.kind == "gpu" and m.kind == "sys" for m in (src, dst)]
        return "host" if on_host[0] != on_host[1] else "intra"

    def link(self, src: Memory, dst: Memory) -> LinkSpec:
        """The figures of the link a copy from `src` to `dst` crosses (SAME_MEMORY: no cost)."""
        return {"same": SAME_MEMORY, "inter": self.inter_node, "host": self.host_link,
                "intra": self.intra_node}[self.route(src, dst)]

    def channel(self, src: Memory, dst: Memory) -> tuple | None:
        """The link a copy occupies while it moves, as a hashable name: copies with equal
        channels run one at a time; None within one memory. Per the link's `shared_by`: the
        ordered (src, dst) pair, or the sender alone (the source node for inter_node)."""
        route = self.route(src, dst)
        if route == "same":
            return None
        sender = self.link(src, dst).shared_by == "sender"
        if route == "inter":
            return ("inter", src.rank) if sender else ("inter", src.rank, dst.rank)
        return (route, src) if sender else (route, src, dst)


# ---- loading -----------------------------------------------------------------------------------
def shipped_machines() -> list[str]:
    """The names of the files in strategies/machines/."""
    return sorted(p.stem for p in MACHINES_DIR.glob("*.json"))


def machine_path(name_or_path) -> Path:
    """The file of a shipped name, or the path itself; MachineError naming both when neither exists."""
    text = str(name_or_path)
    if not text.strip():
        raise MachineError(f"machine {text!r}: an empty name; the shipped machines are "
                           f"{', '.join(shipped_machines())}, or give a file's path")
    shipped = MACHINES_DIR / f"{text}.json"
    if os.sep not in text and shipped.exists():
        return shipped
    path = Path(text)
    if path.is_file():
        return path
    if path.is_dir():
        raise MachineError(f"machine {text!r}: is a folder, not a machine file")
    raise MachineError(f"machine {text!r}: no such file, and not a shipped machine ({', '.join(shipped_machines())})")


def load_machine(name_or_path, nodes: int | None = None) -> MachineModel:
    """The machine model of a shipped name (p100, k80, h100, local) or a file; `nodes` overrides
    the file's node count (before the fields found here are found: `local` with 2 nodes is a
    2-rank run on this host)."""
    path = machine_path(name_or_path)
    where = str(path)
    try:
        text = path.read_bytes().decode()
    except OSError as e:
        raise MachineError(f"{where}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise MachineError(f"{where}: not a text file ({e.reason} at byte {e.start})") from None
    duplicates: list[str] = []
    try:
        data = json.loads(text, object_pairs_hook=lambda pairs: noting_duplicates(pairs, duplicates))
    except json.JSONDecodeError as e:
        raise MachineError(f"{where}:{e.lineno}:{e.colno}: malformed JSON: {e.msg}") from None
    except RecursionError:
        raise MachineError(f"{where}: JSON nested too deeply to be a machine file") from None
    if duplicates:
        raise MachineError(f"{where}: field {duplicates[0]!r} appears twice in one object")
    if nodes is not None and isinstance(data, dict) and data.get("devices_per_node", 0) is None:
        _check_nodes(nodes, where)   # (the fields found here depend on the node count)
        data = {**data, "nodes": int(nodes)}
    model = from_dict(data, where)
    return model if nodes is None else model.with_nodes(nodes)


def write_efficiency(path, efficiency: Mapping[str, float], fitted: str) -> None:
    """Replace a machine file's 'efficiency' and 'fitted' fields (what calibration fitted), keeping
    the rest as written; the file is checked before and after."""
    write_fields(path, {"efficiency": dict(sorted(efficiency.items())), "fitted": fitted})


def write_problem(path) -> str | None:
    """Why the machine file `path` (a name or a path) should not be written with fitted figures,
    or None: it cannot be written, or it is a shipped file of an installed package (which a
    reinstall puts back as it was)."""
    path = machine_path(path).resolve()
    if {"site-packages", "dist-packages"} & set(path.parts):
        return (f"{path} is the installed package's own file; copy it (cp {path} my-machine.json) and give "
                f"--machine my-machine.json")
    if not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK):
        return f"{path} cannot be written here; copy it and give --machine with the copy's path"
    return None


def write_fields(path, fields: Mapping[str, object]) -> None:
    """Replace some top-level fields of a machine file (a name or a path), keeping the rest as
    written; the file is checked before and after, and replaced at once."""
    path = machine_path(path)
    data = json.loads(path.read_text())
    from_dict(data, str(path))
    data.update(fields)
    from_dict(data, str(path))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(format_machine(data))
    os.replace(tmp, path)


def format_machine(data: dict) -> str:
    """A machine file's text: one top-level field a line (notes one a line), objects on one line,
    large and small numbers in engineering notation (78.4e9, 80e-6)."""
    lines = []
    for k, v in data.items():
        if k == "notes" and isinstance(v, list):
            body = ",\n".join(f"    {json.dumps(n)}" for n in v)
            lines.append(f'  "notes": [\n{body}\n  ]')
        else:
            lines.append(f"  {json.dumps(k)}: {_json(v)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _json(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_json(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float) and value != 0 and math.isfinite(value) and not 1e-3 <= abs(value) < 1e4:
        exp = 3 * math.floor(math.log10(abs(value)) / 3)
        text = f"{value / 10 ** exp:.12g}e{exp}"
        if float(text) == value:
            return text
    return json.dumps(value)


def kernel_seconds(alone, slowdown: float, surcharge: float, cap: float):
    """A kernel's seconds inside a run from its seconds `alone` (a float or an array): `slowdown`
    times them, plus `surcharge` times them up to `cap` seconds."""
    extra = alone * surcharge
    return alone * slowdown + (np.minimum(extra, cap) if isinstance(extra, np.ndarray) else min(extra, cap))


def _many(n: int) -> str:
    """A count for a message: with thousands separators, or its order of magnitude when huge."""
    digits = str(n)
    return f"{n:,}" if n < 10**12 else f"about {digits[0]}e{len(digits) - 1}"


def _check_nodes(nodes, where: str) -> None:
    if isinstance(nodes, bool) or not isinstance(nodes, (int, np.integer)) or nodes < 1:
        raise MachineError(f"{where}: nodes must be a whole number >= 1, got {nodes!r}")


def from_dict(data, where: str = "machine") -> MachineModel:
    """Check a version-1 object field by field and build the model (`where` names it in errors)."""
    if not isinstance(data, dict):
        raise MachineError(f"{where}: a machine file holds a JSON object, got {type(data).__name__}")
    _known(data, _FIELDS, "", where, "a machine file")
    if "version" not in data:
        raise MachineError(f"{where}: missing field 'version' (this format is version {VERSION})")
    if data["version"] != VERSION or not isinstance(data["version"], int) or isinstance(data["version"], bool):
        raise MachineError(f"{where}: field 'version' must be {VERSION}, got {data['version']!r}")
    name = _string(data, "name", "", where)
    notes = data.get("notes", [])
    if isinstance(notes, str):
        notes = [notes]
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise MachineError(f"{where}: field 'notes' must be a string or a list of strings, got {notes!r}")
    device = _device(_object(data, "device", "", where), "device.", where, discover=True)
    cpu = device.kind == "cpu"
    for k in _GPU_ONLY:
        if cpu and k in data:
            raise MachineError(f"{where}: field {k!r} is only for gpu machines; a cpu machine's host is its devices")
        if not cpu and k not in data:
            raise MachineError(f"{where}: missing field {k!r} (a gpu machine needs its host and host link)")
    for k in _CPU_ONLY:
        if not cpu and k in data:
            raise MachineError(f"{where}: field {k!r} is only for cpu machines, whose workers handle the messages")
    nodes = _count("nodes", data.get("nodes", _MISSING), where)
    devices = data.get("devices_per_node", _MISSING)
    if devices is _MISSING:
        raise MachineError(f"{where}: missing field 'devices_per_node'")
    here = devices is None   # (the nodes are the ranks of a run on this host)
    if here:
        if not cpu:
            raise MachineError(f"{where}: field 'devices_per_node' may be null (found here) only for cpu devices")
        devices = cpus_here(nodes)
    devices = _count("devices_per_node", devices, where)
    if device.mem_bytes is None:
        device = replace(device, mem_bytes=_physical_memory(where) // (devices * (nodes if here else 1)))
    efficiency = _object(data, "efficiency", "", where)
    if "default" not in efficiency:
        raise MachineError(f"{where}: field 'efficiency' needs a 'default' entry (for op kinds not listed)")
    kinds = _op_kinds()
    for kind, frac in efficiency.items():
        if kind != "default" and kind not in kinds:
            raise MachineError(f"{where}: field 'efficiency.{kind}': {kind!r} is not an op kind; the kinds are "
                               f"{', '.join(sorted(kinds))} (and 'default' for the rest)")
        if not _number(frac) or not 0 < frac <= 1:
            raise MachineError(f"{where}: field 'efficiency.{kind}' must be a fraction in (0, 1], got {frac!r}")
    fitted, runtime_fitted = (data.get(key) for key in ("fitted", "runtime_fitted"))
    for key, value in (("fitted", fitted), ("runtime_fitted", runtime_fitted)):
        if value is not None and not isinstance(value, str):
            raise MachineError(f"{where}: field {key!r} must be a string or null, got {value!r}")
    host = None if cpu else _device(_object(data, "host", "", where), "host.", where, discover=False)
    if host is not None and host.kind != "cpu":
        raise MachineError(f"{where}: field 'host.kind' must be 'cpu' (a node's host runs the runtime), got "
                           f"{host.kind!r}")
    naps = {k: _positive(data, k, "", where, zero=True) if k in data else 0.0
            for k in ("nap_first", "nap_longest", "nap_share")}
    if naps["nap_share"] > 1:
        raise MachineError(f"{where}: field 'nap_share' must be a share from 0 to 1, got {naps['nap_share']!r}")
    if naps["nap_longest"] < naps["nap_first"]:
        raise MachineError(f"{where}: field 'nap_longest' must be at least nap_first ({naps['nap_first']}), got "
                           f"{naps['nap_longest']}")
    return MachineModel(
        name=name, nodes=nodes, devices_per_node=devices, nodes_per_host=nodes if here else 1,
        device=device, intra_node=_link(data, "intra_node", where), inter_node=_link(data, "inter_node", where),
        efficiency={k: float(v) for k, v in efficiency.items()},
        host=host,
        host_link=None if cpu else _link(data, "host_link", where),
        launch_overhead=_positive(data, "launch_overhead", "", where, zero=True),
        send_overhead=_positive(data, "send_overhead", "", where, zero=True) if "send_overhead" in data else 0.0,
        receive_overhead=(_positive(data, "receive_overhead", "", where, zero=True)
                          if "receive_overhead" in data else 0.0),
        message_delay=_positive(data, "message_delay", "", where, zero=True) if "message_delay" in data else 0.0,
        **naps,
        kernel_slowdown=_positive(data, "kernel_slowdown", "", where) if "kernel_slowdown" in data else 1.0,
        kernel_surcharge=(_positive(data, "kernel_surcharge", "", where, zero=True)
                          if "kernel_surcharge" in data else 0.0),
        kernel_surcharge_cap=(_positive(data, "kernel_surcharge_cap", "", where, zero=True)
                              if "kernel_surcharge_cap" in data else 0.0),
        notes=tuple(notes), fitted=fitted, runtime_fitted=runtime_fitted, source=where)


def _op_kinds() -> set[str]:
    """The operator kinds an efficiency may name (every operator module registers its kind)."""
    import importlib

    from ops.base import OP_REGISTRY
    importlib.import_module("ops.model")   # (it imports every operator module)
    return set(OP_REGISTRY)


def _number(v) -> bool:
    """Whether v is a finite JSON number (an integer too large for a float is not)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _known(data: dict, fields: tuple, prefix: str, where: str, what: str) -> None:
    for k in data:
        if k not in fields:
            raise MachineError(f"{where}: unknown field {prefix + k!r}; {what} has {', '.join(map(repr, fields))}")


def _object(data: dict, key: str, prefix: str, where: str) -> dict:
    value = data.get(key, _MISSING)
    if value is _MISSING:
        raise MachineError(f"{where}: missing field {prefix + key!r}")
    if not isinstance(value, dict):
        raise MachineError(f"{where}: field {prefix + key!r} must be an object, got {value!r}")
    return value


def _string(data: dict, key: str, prefix: str, where: str) -> str:
    value = data.get(key, _MISSING)
    if value is _MISSING:
        raise MachineError(f"{where}: missing field {prefix + key!r}")
    if not isinstance(value, str) or not value:
        raise MachineError(f"{where}: field {prefix + key!r} must be a non-empty string, got {value!r}")
    return value


def _positive(data: dict, key: str, prefix: str, where: str, zero: bool = False) -> float:
    value = data.get(key, _MISSING)
    if value is _MISSING:
        raise MachineError(f"{where}: missing field {prefix + key!r}")
    if not _number(value) or value < 0 or (value == 0 and not zero):
        least = "a number >= 0" if zero else "a positive number"
        raise MachineError(f"{where}: field {prefix + key!r} must be {least}, got {value!r}")
    return float(value)


def _count(key: str, value, where: str) -> int:
    if value is _MISSING:
        raise MachineError(f"{where}: missing field {key!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MachineError(f"{where}: field {key!r} must be a whole number >= 1, got {value!r}")
    return value


def _device(data: dict, prefix: str, where: str, discover: bool) -> DeviceSpec:
    _known(data, _DEVICE_FIELDS, prefix, where, "a device")
    kind = _string(data, "kind", prefix, where)
    if kind not in DEVICE_KINDS:
        raise MachineError(f"{where}: field '{prefix}kind' must be one of {DEVICE_KINDS}, got {kind!r}")
    found = {k for k in ("name", "mem_bytes") if k in data and data[k] is None}
    if found and not (discover and kind == "cpu"):
        k = sorted(found)[0]
        raise MachineError(f"{where}: field '{prefix}{k}' may be null (found here) only for a machine's cpu devices")
    name = cpu_name() if "name" in found else _string(data, "name", prefix, where)
    mem = None if "mem_bytes" in found else _positive(data, "mem_bytes", prefix, where)
    if mem is not None and (mem < 1 or not mem.is_integer()):
        raise MachineError(f"{where}: field '{prefix}mem_bytes' must be a whole number of bytes, at least 1, got "
                           f"{data['mem_bytes']!r}")
    return DeviceSpec(kind, name, _positive(data, "peak_flops", prefix, where),
                      _positive(data, "mem_bandwidth", prefix, where), None if mem is None else int(mem))


def _link(data: dict, key: str, where: str) -> LinkSpec:
    link = _object(data, key, "", where)
    prefix = f"{key}."
    _known(link, _LINK_FIELDS, prefix, where, "a link")
    shared = link.get("shared_by", "pair")
    if shared not in SHARING:
        raise MachineError(f"{where}: field '{prefix}shared_by' must be one of {SHARING}, got {shared!r}")
    return LinkSpec(_positive(link, "bandwidth", prefix, where), _positive(link, "latency", prefix, where, zero=True),
                    shared)


# ---- this machine --------------------------------------------------------------------------------
def cpu_name() -> str:
    """This machine's CPU model, as /proc/cpuinfo (or the platform) names it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _physical_memory(where: str) -> int:
    """This machine's physical memory in bytes."""
    size = physical_memory()
    if size is None:
        raise MachineError(f"{where}: field 'device.mem_bytes' is null (found here), but this platform does not "
                           f"tell its memory size; give it in bytes")
    return size
