"""Machine models: the shipped files, node counts, the Machine they stand for, links and channels,
and one test per malformed field (one line naming the file and the field)."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest

from ops.lower import compute_processors
from strategies.machine_model import (MAX_DEVICES, SAME_MEMORY, DeviceSpec, MachineError, format_machine, load_machine,
                                      machine_path, shipped_machines, write_efficiency, write_problem)
from taskrt.machine import Memory, physical_memory


def test_every_shipped_machine_loads():
    assert {"p100", "k80", "h100", "local"} <= set(shipped_machines())
    for name in shipped_machines():
        mm = load_machine(name)
        assert mm.name == name and mm.notes and mm.nodes >= 1 and mm.devices_per_node >= 1
        assert 0 < mm.efficiency_of("no such kind") <= 1
        assert mm.device.peak_flops > 0 and mm.device.mem_bandwidth > 0 and mm.device.mem_bytes > 0
        assert name in repr(mm) and "FLOP/s" in repr(mm)


def test_local_has_the_runtimes_naps_and_the_gpu_clusters_none():
    """The local model's naps are the runtime's own constants where a node's cores are shared."""
    from taskrt.mpi_progress import MAX_NAP_S, SHARED_CORE_NAP_S
    local = load_machine("local")
    assert (local.nap_first, local.nap_longest) == (SHARED_CORE_NAP_S, MAX_NAP_S) and 0 < local.nap_share <= 1
    assert all((m.nap_first, m.nap_longest, m.nap_share) == (0, 0, 0) for m in map(load_machine, ("p100", "k80", "h100")))


def test_the_papers_clusters_and_a_modern_one():
    p100, k80, h100 = load_machine("p100"), load_machine("k80"), load_machine("h100")
    assert (p100.nodes, p100.devices_per_node, p100.device.peak_flops) == (4, 4, 10.6e12)
    assert p100.inter_node.bandwidth == 12.5e9  # 100 Gb/s EDR
    assert (k80.nodes, k80.devices_per_node) == (16, 4)
    assert k80.inter_node.bandwidth == pytest.approx(56e9 / 8, rel=0.05)  # 56 Gb/s FDR
    assert h100.devices_per_node == 8 and h100.inter_node.bandwidth == 50e9  # 400 Gb/s
    assert h100.intra_node.bandwidth > p100.intra_node.bandwidth > k80.intra_node.bandwidth


def test_nodes_override_and_a_path_load(tmp_path):
    assert load_machine("k80", nodes=3).nodes == 3
    assert load_machine(machine_path("p100")).name == "p100"
    copied = tmp_path / "mine.json"
    copied.write_text(machine_path("h100").read_text())
    assert load_machine(str(copied), nodes=2).to_machine().num_ranks == 2
    with pytest.raises(MachineError, match=r"nodes must be a whole number >= 1, got 0"):
        load_machine("p100", nodes=0)


def test_a_machine_past_the_device_limit_is_refused_before_anything_is_built():
    most = MAX_DEVICES // 4
    assert load_machine("p100", nodes=most).num_devices == MAX_DEVICES
    with pytest.raises(MachineError, match=r"p100.json: 262,145 nodes of 4 devices are 1,048,580 devices; "
                                           r"a machine model has at most 1,048,576"):
        load_machine("p100", nodes=most + 1)
    with pytest.raises(MachineError, match=r"p100.json: about 1e300 nodes of 4 devices are about 4e300 devices; "):
        load_machine("p100", nodes=10 ** 300)   # (the counts, hundreds of digits, made the line unreadable)


def test_an_unknown_name_lists_the_shipped_ones():
    with pytest.raises(MachineError, match=r"machine 'p101': no such file.*h100, k80, local, p100"):
        load_machine("p101")
    with pytest.raises(MachineError, match=r"machine '/tmp': is a folder, not a machine file"):
        load_machine("/tmp")
    with pytest.raises(MachineError, match=r"machine '': an empty name; the shipped machines are h100, k80"):
        load_machine("")


def test_to_machine_gpu_models_have_a_host_cpu_and_the_gpus_per_rank():
    machine = load_machine("p100", nodes=2).to_machine()
    assert machine.num_ranks == 2
    assert sum(p.kind == "gpu" for p in machine.processors) == 8
    assert sum(p.kind == "cpu" for p in machine.processors) == 2
    assert len(compute_processors(machine)) == 8
    assert all(machine.processors[i].kind == "gpu" for i in compute_processors(machine))


def test_local_is_this_machines_cpu_workers_with_memories_of_their_own(monkeypatch):
    monkeypatch.setenv("TASKRT_CPUS", "3")
    mm = load_machine("local")
    assert mm.devices_per_node == 3 and mm.device.kind == "cpu" and mm.host is mm.device
    machine = mm.to_machine()
    assert [p.kind for p in machine.processors] == ["cpu"] * 3
    assert len({p.memory for p in machine.processors}) == 3
    assert len(compute_processors(machine)) == 3
    assert load_machine("local", nodes=2).to_machine().num_ranks == 2


def test_local_on_several_nodes_is_a_run_of_as_many_ranks_here(monkeypatch):
    """`--machine local --nodes 2` searched for 2 ranks of every core each, which `mpiexec -n 2` here
    does not run: its ranks share the host's cores (Machine.discover), and so do the model's nodes."""
    monkeypatch.delenv("TASKRT_CPUS", raising=False)
    cores = os.cpu_count()
    one, two = load_machine("local"), load_machine("local", nodes=2)
    assert (one.nodes, one.devices_per_node, one.nodes_per_host) == (1, cores, 1)
    assert (two.nodes, two.devices_per_node, two.nodes_per_host) == (2, max(1, cores // 2), 2)
    assert two.device.mem_bytes == physical_memory() // (2 * two.devices_per_node)
    monkeypatch.setenv("TASKRT_CPUS", "3")   # as the runtime gives each rank
    assert load_machine("local", nodes=4).devices_per_node == 3
    assert load_machine("p100", nodes=2).nodes_per_host == 1


def test_links_same_memory_host_intra_and_inter_node():
    mm = load_machine("p100", nodes=2)
    host, g0, g1 = Memory("sys", 0, 0), Memory("gpu", 0, 0), Memory("gpu", 0, 1)
    far = Memory("gpu", 1, 0)
    assert mm.link(g0, g0) is SAME_MEMORY
    assert mm.link(g0, g1) == mm.intra_node
    assert mm.link(host, g1) == mm.host_link and mm.link(g1, host) == mm.host_link
    assert mm.link(g0, far) == mm.inter_node and mm.link(host, far) == mm.inter_node
    local = load_machine("local")
    assert local.link(Memory("sys", 0, 0), Memory("sys", 0, 1)) == local.intra_node


def test_channels_name_the_link_a_copy_queues_on():
    p100 = load_machine("p100", nodes=2)  # NVLink per pair, InfiniBand per node
    g0, g1, g2 = (Memory("gpu", 0, i) for i in range(3))
    far0, far1 = Memory("gpu", 1, 0), Memory("gpu", 1, 1)
    assert p100.channel(g0, g0) is None
    assert p100.channel(g0, g1) != p100.channel(g0, g2) != p100.channel(g1, g0)
    assert p100.channel(g0, far0) == p100.channel(g1, far1) == ("inter", 0)
    h100 = load_machine("h100")  # NVSwitch: a GPU's port is shared by its copies
    assert h100.channel(g0, g1) == h100.channel(g0, g2) != h100.channel(g1, g2)


def test_device_of_a_processor():
    mm = load_machine("k80", nodes=1)
    machine = mm.to_machine()
    kinds = {p.kind: mm.device_of(p) for p in machine.processors}
    assert kinds["gpu"] is mm.device and kinds["cpu"] is mm.host and mm.host.kind == "cpu"
    local = load_machine("local")
    assert all(local.device_of(p) is local.device for p in local.to_machine().processors)


def test_a_kernels_seconds_in_a_run_add_a_capped_surcharge_to_the_slowdown():
    mm = dataclasses.replace(load_machine("local"), kernel_slowdown=1.2, kernel_surcharge=1.0, kernel_surcharge_cap=200e-6)
    alone = np.array([0.0, 10e-6, 100e-6, 200e-6, 1e-3, 10e-3])
    expect = alone * 1.2 + np.array([0.0, 10e-6, 100e-6, 200e-6, 200e-6, 200e-6])
    np.testing.assert_allclose(mm.kernel_seconds(alone), expect, rtol=1e-12)
    assert [mm.kernel_seconds(float(a)) for a in alone] == pytest.approx(list(expect), rel=1e-12)
    plain = load_machine("p100")
    assert plain.kernel_surcharge == plain.kernel_surcharge_cap == 0.0 and plain.kernel_seconds(1e-3) == 1e-3


def test_device_spec_repr_is_readable():
    d = DeviceSpec("gpu", "X", 10.6e12, 732e9, 16_000_000_000)
    assert repr(d) == "DeviceSpec(gpu 'X': 10.6 TFLOP/s, 732 GB/s, 16 GB)"


def test_write_efficiency_keeps_the_rest_of_the_file(tmp_path):
    path = tmp_path / "local.json"
    path.write_text(machine_path("local").read_text())
    write_efficiency(path, {"default": 0.25, "dense": 0.5}, "cpu:test, 2 ops")
    data = json.loads(path.read_text())
    assert data["devices_per_node"] is None and data["device"]["name"] is None
    mm = load_machine(path)
    assert mm.efficiency == {"default": 0.25, "dense": 0.5} and mm.fitted == "cpu:test, 2 ops"


def test_a_shipped_file_of_an_installed_package_is_not_written(tmp_path):
    """Calibration wrote its figures into site-packages, where a reinstall undoes them (or, read
    only, it failed after all its runs); in a source tree the shipped files are the project's."""
    installed = tmp_path / "lib" / "python3.11" / "site-packages" / "strategies" / "machines" / "k80.json"
    installed.parent.mkdir(parents=True)
    installed.write_text(machine_path("k80").read_text())
    assert "is the installed package's own file; copy it" in write_problem(installed)
    own = tmp_path / "mine.json"
    own.write_text(machine_path("k80").read_text())
    assert write_problem(own) is None
    with pytest.raises(MachineError, match="no such file"):
        write_problem(tmp_path / "none.json")


# ---- malformed files: one line naming the file and the field ------------------------------------
def _p100() -> dict:
    return json.loads(machine_path("p100").read_text())


def _local() -> dict:
    return json.loads(machine_path("local").read_text())


def _set(data: dict, dotted: str, value) -> dict:
    data = copy.deepcopy(data)
    *path, last = dotted.split(".")
    target = data
    for k in path:
        target = target[k]
    target[last] = value
    return data


def _drop(data: dict, dotted: str) -> dict:
    data = copy.deepcopy(data)
    *path, last = dotted.split(".")
    target = data
    for k in path:
        target = target[k]
    del target[last]
    return data


BAD = [
    ("version", lambda: _set(_p100(), "version", 2), "must be 1"),
    ("version", lambda: _drop(_p100(), "version"), "missing field"),
    ("version", lambda: _set(_p100(), "version", True), "must be 1"),
    ("devices", lambda: _set(_p100(), "devices", 4), "unknown field"),
    ("name", lambda: _set(_p100(), "name", ""), "non-empty string"),
    ("notes", lambda: _set(_p100(), "notes", [1, 2]), "list of strings"),
    ("version", lambda: _set(_p100(), "version", 1.0), "must be 1, got 1.0"),
    ("nodes", lambda: _set(_p100(), "nodes", 0), "whole number >= 1"),
    ("nodes", lambda: _set(_p100(), "nodes", "4"), "whole number >= 1"),
    ("nodes", lambda: _drop(_p100(), "nodes"), "missing field"),
    ("devices_per_node", lambda: _set(_p100(), "devices_per_node", 2.5), "whole number >= 1"),
    ("devices_per_node", lambda: _set(_p100(), "devices_per_node", None), "only for cpu devices"),
    ("device", lambda: _set(_p100(), "device", [1]), "must be an object"),
    ("device.kind", lambda: _set(_p100(), "device.kind", "tpu"), "must be one of"),
    ("device.peak_flops", lambda: _set(_p100(), "device.peak_flops", -1), "positive number"),
    ("device.mem_bandwidth", lambda: _set(_p100(), "device.mem_bandwidth", "fast"), "positive number"),
    ("device.mem_bytes", lambda: _drop(_p100(), "device.mem_bytes"), "missing field"),
    ("device.name", lambda: _set(_p100(), "device.name", None), "only for a machine's cpu devices"),
    ("device.clock", lambda: _set(_p100(), "device.clock", 1e9), "unknown field"),
    ("host", lambda: _drop(_p100(), "host"), "missing field"),
    ("host", lambda: _set(_local(), "host", _p100()["host"]), "only for gpu machines"),
    ("host.mem_bytes", lambda: _set(_p100(), "host.mem_bytes", None), "only for a machine's cpu devices"),
    ("host.kind", lambda: _set(_p100(), "host.kind", "gpu"), "must be 'cpu'"),
    ("intra_node.bandwidth", lambda: _set(_p100(), "intra_node.bandwidth", 0), "positive number"),
    ("inter_node.latency", lambda: _set(_p100(), "inter_node.latency", -1e-6), "a number >= 0"),
    ("host_link.shared_by", lambda: _set(_p100(), "host_link.shared_by", "all"), "must be one of"),
    ("inter_node.speed", lambda: _set(_p100(), "inter_node.speed", 1), "unknown field"),
    ("host_link", lambda: _set(_local(), "host_link", _p100()["host_link"]), "only for gpu machines"),
    ("launch_overhead", lambda: _set(_p100(), "launch_overhead", -1), "a number >= 0"),
    ("send_overhead", lambda: _set(_p100(), "send_overhead", 1e-4), "only for cpu machines"),
    ("receive_overhead", lambda: _set(_local(), "receive_overhead", -1e-4), "a number >= 0"),
    ("message_delay", lambda: _set(_p100(), "message_delay", 1e-4), "only for cpu machines"),
    ("message_delay", lambda: _set(_local(), "message_delay", "fast"), "a number >= 0"),
    ("nap_first", lambda: _set(_p100(), "nap_first", 1e-4), "only for cpu machines"),
    ("nap_share", lambda: _set(_local(), "nap_share", -0.5), "a number >= 0"),
    ("nap_share", lambda: _set(_local(), "nap_share", 1e9), "a share from 0 to 1"),
    ("device.mem_bytes", lambda: _set(_p100(), "device.mem_bytes", 0.5), "at least 1, got 0.5"),
    ("device.mem_bytes", lambda: _set(_p100(), "device.mem_bytes", 1.5), "a whole number of bytes, at least 1, got 1.5"),
    ("intra_node.latency", lambda: _set(_p100(), "intra_node.latency", 10 ** 400), "a number >= 0"),
    ("device.peak_flops", lambda: _set(_p100(), "device.peak_flops", -10 ** 400), "a positive number"),
    ("nap_longest", lambda: _set(_set(_local(), "nap_first", 1e-3), "nap_longest", 1e-4), "at least nap_first"),
    ("kernel_slowdown", lambda: _set(_local(), "kernel_slowdown", 0), "a positive number"),
    ("kernel_surcharge", lambda: _set(_local(), "kernel_surcharge", -0.5), "a number >= 0"),
    ("kernel_surcharge_cap", lambda: _set(_p100(), "kernel_surcharge_cap", "long"), "a number >= 0"),
    ("efficiency", lambda: _set(_p100(), "efficiency", {"dense": 0.5}), "'default' entry"),
    ("efficiency.dense", lambda: _set(_p100(), "efficiency.dense", 1.5), "fraction in (0, 1]"),
    ("efficiency.densee", lambda: _set(_p100(), "efficiency.densee", 0.5), "is not an op kind"),
    ("fitted", lambda: _set(_p100(), "fitted", 3), "string or null"),
]


def test_a_whole_float_is_a_count_and_a_link_without_sharing_is_its_pair_s(tmp_path):
    """JSON writers put 2.0 for 2 (taken as 2); a link that says nothing of its sharing carries
    one pair's transfers (the shipped files all say, so the default was never read)."""
    path = tmp_path / "m.json"
    path.write_text(json.dumps(_drop(_set(_p100(), "nodes", 2.0), "intra_node.shared_by")))
    mm = load_machine(str(path))
    assert mm.nodes == 2 and type(mm.nodes) is int and mm.intra_node.shared_by == "pair"
    assert mm.inter_node.shared_by == load_machine("p100").inter_node.shared_by


@pytest.mark.parametrize("field,make,says", BAD, ids=[f"{f}:{s}" for f, _, s in BAD])
def test_a_malformed_field_is_one_line_naming_file_and_field(tmp_path, field, make, says):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(make()))
    with pytest.raises(MachineError) as info:
        load_machine(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}: ") and f"'{field}'" in message and says in message
    assert "\n" not in message


def test_malformed_json_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"version": 1,\n "name": "x",,\n}')
    with pytest.raises(MachineError, match=rf"^{path}:2:\d+: malformed JSON"):
        load_machine(str(path))
    path.write_text("[1, 2]")
    with pytest.raises(MachineError, match=rf"^{path}: a machine file holds a JSON object, got list"):
        load_machine(str(path))


def test_a_binary_a_deeply_nested_or_a_twice_keyed_file_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(MachineError, match=rf"^{path}: not a text file \(invalid start byte at byte 0\)$"):
        load_machine(str(path))
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(MachineError, match=rf"^{path}: JSON nested too deeply to be a machine file$"):
        load_machine(str(path))
    text = (Path(__file__).parent.parent / "strategies" / "machines" / "k80.json").read_text()
    path.write_text(text.replace('"nodes": ', '"nodes": 2, "nodes": ', 1))
    with pytest.raises(MachineError, match=rf"^{path}: field 'nodes' appears twice in one object$"):
        load_machine(str(path))


def test_shipped_files_are_written_as_write_efficiency_writes_them():
    for name in shipped_machines():
        text = machine_path(name).read_text()
        assert format_machine(json.loads(text)) == text, name
