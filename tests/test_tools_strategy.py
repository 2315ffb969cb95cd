"""tools/strategy: show, draw, diff and memory on strategies made here, PNG sizes, and every error case."""
import json
import shutil
import struct

import pytest

from ops.lower import TileConfig
from ops.strategy import Strategy
from strategies.search import app_graph
from tools import strategy as tool


def mlp_strategy(path, **overrides) -> str:
    """The tiny MLP (batch 16): fc1 split over parameters on 2 devices, the rest over samples."""
    model, _ = app_graph("mlp", 16, tiny=True)
    configs = {op.name: TileConfig((2,) + (1,) * (len(op.tile_shape) - 1), (0, 1)) for op in model.ops}
    configs["fc1"] = TileConfig((1, 2, 1), (1, 0))
    configs["drop_in"] = TileConfig((1, 1), (0,))
    configs.update(overrides)
    Strategy("mlp", configs).save(path)
    return str(path)


def run(capsys, *argv):
    """(exit status, stdout, stderr) of the command."""
    try:
        status = tool.main([str(a) for a in argv])
    except SystemExit as e:
        status = e.code
    out = capsys.readouterr()
    return status, out.out, out.err


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_show_without_app_lists_degrees_and_devices(tmp_path, capsys):
    status, out, _ = run(capsys, "show", mlp_strategy(tmp_path / "s.json"))
    assert status == 0
    lines = out.splitlines()
    assert lines[0].endswith("model mlp, 9 ops")
    assert lines[1].split() == ["op", "split", "devices"]
    assert "fc1      1x2x1  1,0" in out and "drop_in  1x1    0" in out


def test_show_with_app_names_soap_kinds_and_shapes(tmp_path, capsys):
    path = mlp_strategy(tmp_path / "s.json", fc2=TileConfig((2, 2, 1), (0, 1, 1, 0)), drop1=TileConfig((1, 2), (0, 1)))
    status, out, _ = run(capsys, "show", path, "--app", "mlp", "--tiny")
    assert status == 0
    table = {line.split()[0]: line.split() for line in out.splitlines()[3:]}
    assert table["fc1"] == ["fc1", "dense", "P2", "1,0", "16x64"]
    assert table["fc2"][:5] == ["fc2", "dense", "S2", "P2", "0,1,1,0"]
    assert table["drop1"][:3] == ["drop1", "dropout", "A2"]
    assert table["drop_in"] == ["drop_in", "dropout", "1", "0", "16x64"]
    assert table["out"][-1] == "16x10"


def test_show_marks_ops_left_to_the_default(tmp_path, capsys):
    Strategy("mlp", {"fc1": TileConfig((2, 1, 1))}).save(tmp_path / "s.json")
    status, out, _ = run(capsys, "show", tmp_path / "s.json", "--app", "mlp", "--tiny")
    assert status == 0
    table = {line.split()[0]: line.split() for line in out.splitlines()[3:]}
    assert table["fc1"][2:4] == ["S2", "default"] and table["fc2"][2:4] == ["default", "default"]
    assert len(table) == 10 and table["loss"][1:4] == ["sparse_categorical_crossentropy", "default", "default"]
    # a file may name the loss op (search() returns every op it simulated): it was "not in --app mlp"
    Strategy("mlp", {"loss": TileConfig((2,), (1, 0))}).save(tmp_path / "loss.json")
    status, out, _ = run(capsys, "show", tmp_path / "loss.json", "--app", "mlp", "--tiny")
    table = {line.split()[0]: line.split() for line in out.splitlines()[3:]}
    assert status == 0 and table["loss"][2:4] == ["S2", "1,0"]


def test_draw_matplotlib_png_of_the_expected_size(tmp_path, capsys):
    png = tmp_path / "g.png"
    status, out, _ = run(capsys, "draw", mlp_strategy(tmp_path / "s.json"), "--app", "mlp", "--tiny",
                         "-o", png, "--engine", "matplotlib")
    assert status == 0 and "matplotlib" in out
    ops, _ = tool.app_ops("mlp", tiny=True)
    w, h = tool.figure_size(ops)
    assert png_size(png) == (round(w * tool.DPI), round(h * tool.DPI))
    assert png_size(png) == (360, 960)  # 10 layers of one op each, the loss op's last


def test_layers_edges_and_colours_of_a_branching_graph():
    model, _ = app_graph("inception_v3", 4, tiny=True)
    ops = model.ops
    layers = tool.layers(ops)
    depth = {name: d for d, layer in enumerate(layers) for name in layer}
    assert all(depth[a] < depth[b] for a, b in tool.edges(ops))
    assert max(map(len, layers)) > 1
    strategy = Strategy("inception_v3", {ops[0].name: TileConfig((1,) * len(ops[0].tile_shape), (0,))})
    groups = tool.device_groups(strategy, ops)
    colours = tool.colours(groups)
    assert groups[ops[0].name] == "0" and groups[ops[1].name] == "default"
    assert colours["default"] == "#bbbbbb" and len(set(colours.values())) == len(colours)


def test_device_lists_are_ranges_and_many_sets_get_colours_of_their_own(tmp_path):
    """A strategy on 1,024 devices listed every device (3,000 characters a row of show, a legend
    entry drawn over the graph), and tab10's colours repeated from the eleventh set on."""
    assert tool.number_ranges([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10,11"
    assert tool.number_ranges(list(range(1024))) == "0-1023" and tool.number_ranges([3, 2, 1]) == "3,2,1"
    assert tool.devices_text(TileConfig((4, 1), (4, 5, 6, 7))) == "4-7" and tool.number_ranges([]) == ""
    groups = {f"op{i}": tool.number_ranges(range(i, i + 8)) for i in range(40)}
    colours = tool.colours(groups)
    assert len(set(colours.values())) == 40
    entries = tool.legend_entries(colours)
    assert len(entries) == tool.LEGEND_ENTRIES and entries[-1] == ("and 29 more device sets", "white")
    assert entries[0] == ("devices 0-7", colours["0-7"])
    assert tool.legend_entries({"0,2,4,6,8,10,12,14,16": "#000000"}) == [("devices 0,2,4,6,8,10,12,14,16", "#000000")]
    assert tool.legend_entries({",".join(map(str, range(0, 40, 2))): "#000000"})[0][0] == (
        "devices 0,2,4,6,8,10,12,14,16,18 ...")


def test_dot_source_names_every_op_and_edge(tmp_path):
    model, _ = app_graph("mlp", 16, tiny=True)
    text = tool.dot_source(tool.read(mlp_strategy(tmp_path / "s.json")), model.ops, "t")
    assert text.startswith("digraph") and text.count("->") == len(tool.edges(model.ops)) == 8
    assert '"fc1" [label="fc1\\ndense P2\\ndevices 0,1"' in text


@pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz's dot is not on PATH")
def test_draw_dot_writes_a_png(tmp_path, capsys):
    png = tmp_path / "g.png"
    status, out, _ = run(capsys, "draw", mlp_strategy(tmp_path / "s.json"), "--app", "mlp", "--tiny",
                         "-o", png, "--engine", "dot")
    assert status == 0 and "dot" in out
    w, h = png_size(png)
    assert w > 50 and h > 9 * 30


def test_diff(tmp_path, capsys):
    a = mlp_strategy(tmp_path / "a.json")
    b = mlp_strategy(tmp_path / "b.json", fc2=TileConfig((1, 2, 1), (0, 1)))
    assert run(capsys, "diff", a, a) == (0, "no differences\n", "")
    status, out, _ = run(capsys, "diff", a, b)
    assert status == 1 and out == "fc2: 2x1x1 on [0, 1] -> 1x2x1 on [0, 1]\n"
    Strategy("mlp", {"fc1": TileConfig((2, 1, 1))}).save(tmp_path / "c.json")
    status, out, _ = run(capsys, "diff", tmp_path / "c.json", a)
    lines = out.splitlines()
    assert status == 1 and lines[0] == "fc1: 2x1x1 -> 1x2x1 on [1, 0]" and len(lines) == 9
    assert "drop_in: (not named) -> 1x1 on [0]" in lines
    Strategy("rnntc", {"fc1": TileConfig((2, 1, 1))}).save(tmp_path / "d.json")
    status, out, _ = run(capsys, "diff", tmp_path / "d.json", tmp_path / "c.json")
    assert status == 1 and out == "model: rnntc -> mlp\n"


def test_memory_gives_each_device_s_peak_where_it_falls_and_its_largest_regions(tmp_path, capsys):
    """On a local model of two devices, then on one whose devices hold 20 kB (over: exit 1)."""
    from strategies.machine_model import machine_path
    local = json.loads(machine_path("local").read_text())
    for mem_bytes, want in ((None, 0), (20_000, 1)):
        local.update(devices_per_node=2, device={**local["device"], "mem_bytes": mem_bytes})
        (tmp_path / "m.json").write_text(json.dumps(local))
        status, out, _ = run(capsys, "memory", mlp_strategy(tmp_path / "s.json"), "--app", "mlp", "--tiny",
                             "--machine", tmp_path / "m.json", "--top", "2")
        lines = out.splitlines()
        heads = [line for line in lines if line.startswith("device ")]
        assert status == want and [h.split(":")[0] for h in heads] == ["device 0", "device 1"], out
        assert all(", everything kept for the whole step" in h for h in heads)   # on CPUs nothing is released
        assert ("OVER" in out) == bool(want) and len(lines) == 2 + 2 * 2
        # (device 0 is the host too, where the momentum was attached whole at the start)
        assert all(line.startswith("    ") and line.endswith((".weight", ".weight.momentum"))
                   for line in lines if line not in heads)
    # on GPUs the rows are the strategy's devices, and the host of each node beside them (they were
    # numbered as processors: the host 0 and the GPUs 1 to 4, where the file says 0 to 3)
    Strategy("mlp", {"fc1": TileConfig((4, 1, 1), (3, 2, 1, 0))}).save(tmp_path / "gpus.json")
    status, out, _ = run(capsys, "memory", tmp_path / "gpus.json", "--app", "mlp", "--tiny", "--machine", "p100",
                         "--nodes", "1", "--top", "1")
    heads = [line.split(":")[0] for line in out.splitlines() if not line.startswith(" ")]
    assert status == 0 and heads == ["host of node 0", "device 0", "device 1", "device 2", "device 3"], out
    held = {}   # device 0's bytes at its peak: Adam keeps two states a weight, SGD one; float64 twice the bytes
    for flags in (("--optimizer", "sgd"), ("--optimizer", "adam"), ("--dtype", "float64")):
        _, out, _ = run(capsys, "memory", mlp_strategy(tmp_path / "s.json"), "--app", "mlp", "--tiny", "--machine",
                        tmp_path / "m.json", *flags)
        held[flags[1]] = float(out.split(":")[1].split()[0])
    assert held["adam"] > held["sgd"] and held["float64"] > 1.9 * held["sgd"]
    model, _ = app_graph("mlp", 16, tiny=True)
    assert tool.place_name(0, model.ops) == f"forward of {model.ops[0].name}"
    assert tool.place_name(len(model.ops), model.ops) == f"gradient fills of {model.ops[0].name}"
    assert tool.place_name(3 * len(model.ops) - 1, model.ops) == f"backward of {model.ops[0].name}"


@pytest.mark.parametrize("case", ["missing", "malformed", "bad field", "unknown app", "other model", "unknown op",
                                  "arity", "fingerprint", "diff missing", "no output", "no app", "bad engine",
                                  "no command", "bad batch", "unsplittable dim", "over the extent", "unwritable",
                                  "sizes without an app", "memory without an app", "memory bad machine",
                                  "memory for another machine", "memory top", "memory nodes", "draw svg"])
def test_errors_one_line_exit_2(tmp_path, capsys, case):
    good = mlp_strategy(tmp_path / "s.json")
    bad = tmp_path / "bad.json"
    argv = {"missing": ["show", tmp_path / "nope.json"],
            "malformed": ["show", bad],
            "bad field": ["show", bad],
            "unknown app": ["show", good, "--app", "lenet"],
            "other model": ["show", bad, "--app", "alexnet", "--tiny"],
            "unknown op": ["show", bad, "--app", "mlp", "--tiny"],
            "arity": ["draw", bad, "--app", "mlp", "--tiny", "-o", tmp_path / "g.png"],
            "fingerprint": ["show", bad, "--app", "mlp", "--tiny"],
            "diff missing": ["diff", good, tmp_path / "nope.json"],
            "no output": ["draw", good, "--app", "mlp"],
            "no app": ["draw", good, "-o", tmp_path / "g.png"],
            "bad engine": ["draw", good, "--app", "mlp", "-o", tmp_path / "g.png", "--engine", "svg"],
            "no command": [],
            "bad batch": ["show", good, "--app", "mlp", "--batch-size", "0"],
            "unsplittable dim": ["show", bad, "--app", "mlp", "--tiny"],
            "over the extent": ["draw", bad, "--app", "mlp", "--tiny", "-o", tmp_path / "g.png"],
            "unwritable": ["draw", good, "--app", "mlp", "--tiny", "-o", tmp_path / "nope" / "g.png"],
            "sizes without an app": ["show", good, "--batch-size", "4"],
            "memory without an app": ["memory", good],
            "memory bad machine": ["memory", good, "--app", "mlp", "--tiny", "--machine", tmp_path / "nope.json"],
            "memory for another machine": ["memory", bad, "--app", "mlp", "--tiny"],
            "memory top": ["memory", good, "--app", "mlp", "--tiny", "--top", "-1"],
            "memory nodes": ["memory", good, "--app", "mlp", "--tiny", "--nodes", "0"],
            "draw svg": ["draw", good, "--app", "mlp", "--tiny", "-o", tmp_path / "g.svg"]}[case]
    ops = app_graph("mlp", 16, tiny=True)[0].ops
    text = {"malformed": '{"version": 2,\n "model": "mlp", "ops": {',
            "bad field": '{"version": 2, "model": "mlp", "ops": {"fc1": {"degrees": [0, 1, 1]}}}',
            "other model": Strategy("mlp", {}).to_json(),
            "unknown op": Strategy("mlp", {"fc9": TileConfig((2, 1, 1))}).to_json(),
            "arity": Strategy("mlp", {"fc1": TileConfig((2, 1))}).to_json(),
            "fingerprint": Strategy("graph:0123456789abcdef", {}).to_json(),
            # the apps refuse these two; show and draw used to print them
            "unsplittable dim": Strategy("mlp", {"fc1": TileConfig((1, 1, 2))}).to_json(),
            "over the extent": Strategy("mlp", {"fc1": TileConfig((32, 1, 1))}).to_json(),
            # one problem an op: the line names three and counts the rest
            "memory for another machine": Strategy("mlp", {op.name: TileConfig((2,) + (1,) * (len(op.tile_shape) - 1),
                                                                               (6, 7)) for op in ops}).to_json()}.get(case)
    if text is not None:
        bad.write_text(text)
    status, out, err = run(capsys, *argv)
    assert status == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert not (tmp_path / "g.png").exists() and not (tmp_path / "g.svg").exists()
    expect = {"missing": "nope.json: can't read", "malformed": "malformed JSON", "bad field": "'fc1'",
              "unknown app": "--app lenet: unknown app", "other model": "not --app alexnet",
              "unknown op": "'fc9' is not in --app mlp", "arity": "3 tile dims, the strategy gives 2",
              "fingerprint": "graph:0123456789abcdef", "diff missing": "nope.json", "no output": "-o",
              "no app": "--app", "bad engine": "--engine", "no command": "command",
              "bad batch": "--batch-size 0: must be at least 1",
              "unsplittable dim": "splits dim 2 2 ways, but dim 2 may not be split",
              "over the extent": "splits dim 0 (sample) 32 ways, more than its extent 16",
              "unwritable": "the folder",
              "sizes without an app": "--batch-size 4: sizes the app given with --app, and none is",
              "memory without an app": "--app", "memory bad machine": "nope.json",
              "memory for another machine": "more (is it for another machine than --machine local?)",
              "memory top": "--top -1: must be at least 0", "memory nodes": "--nodes 0: must be at least 1",
              "draw svg": "-o " + str(tmp_path / "g.svg") + ": the tools write PNG images only"}[case]
    assert expect in err
    assert err.count("bad.json") <= 1, "the file named once"
