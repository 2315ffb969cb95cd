"""Strategies (ops/strategy.py): files that round-trip, one clear one-line error per kind of
mistake before any work, and compile(strategy=...): a strategy saved, loaded and applied
trains exactly as the one in memory."""
from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from ops import SGD, Model, Strategy, StrategyError, TileConfig, model_fingerprint
from ops.strategy import is_fingerprint, load, save
from strategies import model_parallel, random_strategy
from taskrt import Machine, Runtime

MACHINE4 = Machine.build(1, 4)


@pytest.fixture(scope="module")
def rt():
    with Runtime(cpus=4, separate_memories=True) as rt:
        yield rt


def small_cnn(rt=None, batch=8, seed=0, width=8):
    m = Model(rt if rt is not None else Runtime(execute=False, machine=MACHINE4), seed=seed)
    x = m.input((batch, 3, width, width))
    h = m.relu(m.conv2d(x, 4, 3, padding=1))
    h = m.flat(m.pool2d(h, 2))
    h = m.dense(h, 12, activation="relu")
    m.softmax(m.dense(h, 4))
    return m


def entry(degrees, devices=None) -> dict:
    return {"degrees": degrees} if devices is None else {"degrees": degrees, "devices": devices}


def write(tmp_path, ops: dict, model=None, **extra) -> str:
    """A strategy file for small_cnn's graph (its fingerprint unless `model` is given)."""
    data = {"version": 2, "model": model or model_fingerprint(small_cnn().ops), "ops": ops, **extra}
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data, indent=1))
    return str(path)


def problem(path) -> str:
    """The one-line message of loading `path` and resolving it against small_cnn on 4 processors."""
    m = small_cnn()
    with pytest.raises(StrategyError) as info:
        load(path).resolve(m.ops, MACHINE4)
    err = info.value
    assert err.__cause__ is None and (err.__context__ is None or err.__suppress_context__)
    message = str(err)
    assert "\n" not in message and message.startswith(path), message
    return message


# ---- values and files --------------------------------------------------------------------------
def test_a_strategy_reads_well_and_checks_itself():
    s = Strategy("alexnet", {"conv2d_0": TileConfig((4, 1, 1, 1), (0, 1, 2, 3)), "dense_0": TileConfig((1, 2))})
    assert repr(s) == "Strategy('alexnet', {conv2d_0: 4x1x1x1 on [0, 1, 2, 3], dense_0: 1x2})"
    assert str(s).splitlines() == ["strategy for alexnet (2 ops)", "  conv2d_0  4x1x1x1 on [0, 1, 2, 3]",
                                   "  dense_0   1x2"]
    assert s.replace("dense_0", TileConfig((2, 1))).ops["dense_0"] == TileConfig((2, 1))
    assert s.ops["dense_0"] == TileConfig((1, 2)) and hash(s) == hash(Strategy("alexnet", dict(s.ops)))
    with pytest.raises(TypeError, match=r"map op names to TileConfigs, got 'dense_0': \{'degrees'"):
        Strategy("alexnet", {"dense_0": {"degrees": [1, 2]}})
    with pytest.raises(TypeError, match="non-empty string"):
        Strategy("", {})


def test_files_round_trip_losslessly(tmp_path):
    m = small_cnn()
    s = Strategy(model_fingerprint(m.ops), {"conv2d_0": TileConfig((2, 2, 1, 1), (3, 2, 1, 0)),
                                            "dense_0": TileConfig((1, 3, 1)),
                                            "dense_1": TileConfig((4, 1, 1), (0, 0, 1, 1))})
    text = s.to_json()
    assert text.splitlines()[4] == '    "conv2d_0": {"degrees": [2, 2, 1, 1], "devices": [3, 2, 1, 0]},'
    assert Strategy.from_json(text) == s and list(Strategy.from_json(text).ops) == list(s.ops)
    path = tmp_path / "cnn.json"
    s.save(path)
    back = load(path)
    assert back == s and back.source == str(path) and back.to_json() == text
    save(Strategy("empty", {}), tmp_path / "empty.json")
    assert load(tmp_path / "empty.json") == Strategy("empty", {})


def test_the_fingerprint_hashes_kinds_names_and_shapes():
    a, b = small_cnn(), small_cnn(seed=5)
    fp = model_fingerprint(a.ops)
    assert is_fingerprint(fp) and fp == model_fingerprint(b.ops) and not is_fingerprint("graph:alexnet")
    assert model_fingerprint(small_cnn(batch=4).ops) != fp
    assert model_fingerprint(small_cnn(width=10).ops) != fp
    renamed = small_cnn()
    renamed.ops[-1].name = "head"
    assert model_fingerprint(renamed.ops) != fp
    assert not is_fingerprint("graph:abc") and not is_fingerprint("graph:") and not is_fingerprint(fp + "0")


def test_the_fingerprint_tells_the_inputs_of_an_op_apart_by_name():
    """concat(a, b) and concat(b, a) of like tensors are other graphs (the same shapes each)."""
    prints = []
    for order in ((0, 1), (1, 0)):
        m = Model(Runtime(execute=False), weights=False)
        ab = [m.input((4, 3), name="a"), m.input((4, 3), name="b")]
        m.concat([ab[i] for i in order], axis=1, name="c")
        prints.append(model_fingerprint(m.ops))
    assert prints[0] != prints[1]


def test_resolve_fills_in_devices_and_names_the_ops_left_to_the_default():
    m = small_cnn()
    s = Strategy(model_fingerprint(m.ops), {"dense_0": TileConfig((1, 4, 1)),
                                            "conv2d_0": TileConfig((2, 1, 1, 1), (3, 1))})
    configs, defaulted = s.resolve(m.ops, MACHINE4)
    assert list(configs) == [op.name for op in m.ops]
    assert configs["dense_0"] == TileConfig((1, 4, 1), (0, 1, 2, 3))
    assert configs["conv2d_0"] == TileConfig((2, 1, 1, 1), (3, 1))
    assert configs["relu_0"] == TileConfig((4, 1, 1, 1), (0, 1, 2, 3))
    assert defaulted == ["relu_0", "pool2d_0", "flat_0", "dense_1", "softmax_0"]
    named = Strategy("cnn", {})
    assert named.resolve(m.ops, MACHINE4, name="cnn")[1] == [op.name for op in m.ops]


# ---- one test per loader error -----------------------------------------------------------------
def test_malformed_json_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"version": 2,\n "model": "cnn",\n "ops": {"dense_0": {"degrees": [1, 2],}}\n}\n')
    message = problem(str(path))
    assert message.startswith(f"{path}:3:") and "malformed JSON" in message


def test_json_nested_too_deeply_names_the_file(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('{"a": ' * 5000 + "1" + "}" * 5000)
    assert problem(str(path)) == f"{path}: JSON nested too deeply to be a strategy"


def test_load_takes_a_path_not_a_file_descriptor(tmp_path):
    with open(write(tmp_path, {}), "rb") as f:
        with pytest.raises(TypeError, match=r"strategy load: a file's path \(str or path-like\), got int"):
            load(f.fileno())
        assert f.read(1) == b"{"   # still open: load did not take it over


def test_an_unknown_operator_gets_the_nearest_names(tmp_path):
    message = problem(write(tmp_path, {"dense_2": entry([1, 2])}))
    assert message.endswith("unknown operator 'dense_2'; nearest: 'dense_1', 'dense_0'"), message
    message = problem(write(tmp_path, {"lstm": entry([1])}))
    assert "unknown operator 'lstm'; the model's ops are 'conv2d_0', 'relu_0'," in message


def test_degrees_of_the_wrong_arity(tmp_path):
    message = problem(write(tmp_path, {"conv2d_0": entry([4, 1])}))
    assert "conv2d 'conv2d_0': config 4x1 has 2 degrees but the op's tile space (8, 4, 8, 8) has 4 dims" in message


def test_degrees_on_a_dimension_that_may_not_be_split(tmp_path):
    message = problem(write(tmp_path, {"softmax_0": entry([1, 2])}))
    assert ("softmax 'softmax_0': config 1x2 splits dim 1 2 ways, but dim 1 may not be split; "
            "splittable dims: dim 0 (sample)") in message


def test_degrees_larger_than_the_extent(tmp_path):
    message = problem(write(tmp_path, {"dense_1": entry([1, 5, 1])}))
    assert "dense 'dense_1': config 1x5x1 splits dim 1 (parameter) 5 ways, more than its extent 4" in message


def test_a_device_list_of_the_wrong_length(tmp_path):
    message = problem(write(tmp_path, {"dense_0": entry([1, 2], [0, 1, 2])}))
    assert message.endswith("op 'dense_0': TileConfig (1, 2) has 2 tiles but 3 devices (0, 1, 2)"), message


def test_devices_the_machine_does_not_have(tmp_path):
    message = problem(write(tmp_path, {"dense_0": entry([1, 2, 1], [0, 4])}))
    assert ("dense 'dense_0': config 1x2x1 on [0, 4] places tile 1 on device 4, but Machine(1 ranks, 4 cpus, "
            "0 gpus, 1 memories) computes on 4 cpus: devices 0..3") in message


def test_a_file_for_another_model(tmp_path):
    other = model_fingerprint(small_cnn(batch=4).ops)
    message = problem(write(tmp_path, {"dense_0": entry([1, 2])}, model=other))
    assert message == (f"{tmp_path / 's.json'}: made for model {other}, but this model is "
                       f"{model_fingerprint(small_cnn().ops)} (its ops, names or shapes differ; the batch size is "
                       f"in the shapes)")
    with pytest.raises(StrategyError, match=r"made for model 'resnet', but this model is 'cnn'$"):
        load(write(tmp_path, {}, model="resnet")).resolve(small_cnn().ops, MACHINE4, name="cnn")


def test_fields_of_the_wrong_form(tmp_path):
    cases = [(dict(version=3), "version 3 is not supported; this reader knows version 2"),
             (dict(version=2.0), "version 2.0 is not supported; this reader knows version 2"),
             (dict(version=1), "version 1 numbered a machine's processors, hosts' CPUs among them; version 2 numbers "
                               "its compute devices (the GPUs, else the CPUs): where the machine has no GPU the "
                               "numbers are the same, so set 'version' to 2; else make the strategy again"),
             (dict(extra=True), "unknown field 'extra'; a strategy file has 'version', 'model', 'ops'"),
             (dict(model=3), "'model' must be a model name or fingerprint (a non-empty string), got 3"),
             (dict(ops=[1]), "'ops' must map op names to configs, got list"),
             (dict(ops={"dense_0": [1, 2]}), "op 'dense_0': a config is an object with 'degrees'"),
             (dict(ops={"dense_0": {"degree": [1, 2]}}), "op 'dense_0': unknown field 'degree'"),
             (dict(ops={"dense_0": {"devices": [0]}}), "op 'dense_0': missing field 'degrees'"),
             (dict(ops={"dense_0": entry("1x2")}), "op 'dense_0': 'degrees' must be a list of ints, got '1x2'"),
             (dict(ops={"dense_0": entry([1, 2.0])}), "op 'dense_0': TileConfig degrees must be ints, got (1, 2.0)"),
             (dict(ops={"dense_0": entry([0, 1])}), "op 'dense_0': TileConfig degrees must all be >= 1, got (0, 1)")]
    for fields, expected in cases:
        data = {"version": 2, "model": "cnn", "ops": {}, **fields}
        path = tmp_path / "s.json"
        path.write_text(json.dumps(data))
        with pytest.raises(StrategyError) as info:
            load(path)
        assert str(info.value) == f"{path}: {expected}" or str(info.value).startswith(f"{path}: {expected}"), \
            (str(info.value), expected)
    path.write_text('{"version": 2, "ops": {}, "ops": {}}')
    with pytest.raises(StrategyError) as info:
        load(path)
    assert info.value.problems == [f"{path}: key 'ops' appears twice in one object", f"{path}: missing field 'model'"]


def test_a_missing_file_and_an_endless_one(tmp_path, monkeypatch):
    with pytest.raises(StrategyError, match=r"nope.json: can't read the strategy file: No such file"):
        load(tmp_path / "nope.json")
    monkeypatch.setattr("ops.strategy.MAX_CHARS", 1 << 20)
    with pytest.raises(StrategyError, match=r"^/dev/zero: over 1 Mi characters, not a strategy file$"):
        load("/dev/zero")   # (read it all: killed for memory)


def test_every_problem_of_a_file_is_named_on_its_own_line(tmp_path):
    path = write(tmp_path, {"dense_2": entry([1, 2]), "dense_1": entry([1, 5, 1]), "conv2d_0": entry([9, 1, 1, 1])})
    with pytest.raises(StrategyError) as info:
        load(path).resolve(small_cnn().ops, MACHINE4)
    lines = str(info.value).splitlines()
    assert lines == info.value.problems and len(lines) == 3 and all(line.startswith(path) for line in lines)
    assert "'dense_2'" in lines[0] and "'dense_1'" in lines[1] and "9 ways, more than its extent 8" in lines[2]
    one = info.value.one_line(path)   # what a command's error line says: the file named by the command
    assert one == "; ".join(line[len(path) + 2:] for line in lines)
    many = StrategyError([f"{path}: problem {i}" for i in range(5)])
    assert many.one_line(path) == "problem 0; problem 1; problem 2; and 2 more"
    assert many.one_line() == f"{path}: problem 0; {path}: problem 1; {path}: problem 2; and 2 more"


# ---- compile(strategy=...) -----------------------------------------------------------------------
def test_a_bad_strategy_stops_compile_before_any_work(rt, tmp_path):
    m = small_cnn(rt)
    issued = rt._next_id
    with pytest.raises(StrategyError, match=r"unknown operator 'dense_2'; nearest"):
        m.compile(SGD(lr=0.1), strategy=write(tmp_path, {"dense_2": entry([1, 2])}))
    with pytest.raises(StrategyError, match="malformed JSON"):
        (tmp_path / "bad.json").write_text("{")
        m.compile(SGD(lr=0.1), strategy=tmp_path / "bad.json")
    with pytest.raises(TypeError, match=r"strategy must be a Strategy or the path of a strategy file, got 3"):
        m.compile(SGD(lr=0.1), strategy=3)
    assert rt._next_id == issued and repr(m).endswith("not compiled)")


def test_compile_says_which_ops_get_the_default_and_configs_override(rt):
    m = small_cnn(rt)
    s = Strategy(model_fingerprint(m.ops), {"dense_0": TileConfig((1, 4, 1)), "dense_1": TileConfig((1, 2, 1))})
    with pytest.warns(UserWarning, match=r"names no config for \['conv2d_0', 'relu_0', 'pool2d_0', 'flat_0'\]; "
                                         r"they get the data-parallel default"):
        m.compile(SGD(lr=0.1), strategy=s, configs={"dense_1": TileConfig((2, 1, 1)), "softmax_0": TileConfig((1, 1))})
    assert m.default_ops == ["conv2d_0", "relu_0", "pool2d_0", "flat_0", "loss"]
    assert m.configs["dense_0"] == TileConfig((1, 4, 1), (0, 1, 2, 3))
    assert m.configs["dense_1"] == TileConfig((2, 1, 1), (0, 2)) and m.configs["softmax_0"] == TileConfig((1, 1), (0,))
    full = small_cnn(rt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        full.compile(SGD(lr=0.1), strategy=model_parallel(full, rt.machine))
    assert full.default_ops == ["loss"]


def train(rt, strategy, x, y) -> tuple[Model, list[float]]:
    m = small_cnn(rt, seed=3)
    m.compile(SGD(lr=0.1, momentum=0.9), strategy=strategy)
    return m, m.fit(x, y, iterations=4, verbose=False).loss


@pytest.mark.parametrize("make", [model_parallel, lambda m, machine: random_strategy(m, machine, 7)],
                         ids=["model_parallel", "random"])
def test_a_strategy_written_read_back_and_applied_gives_the_same_run(rt, tmp_path, make):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((16, 3, 8, 8)).astype(np.float32)
    y = rng.integers(0, 4, 16)
    s = make(small_cnn(rt, seed=3), rt.machine)
    path = tmp_path / "s.json"
    s.save(path)
    a, a_loss = train(rt, s, x, y)
    b, b_loss = train(rt, str(path), x, y)
    assert b.configs == a.configs and a_loss == b_loss
    for k, v in a.parameters().items():
        assert np.array_equal(b.parameters()[k], v), k
    one, _ = train(rt, Strategy(s.model, {op.name: TileConfig((1,) * len(op.tile_shape), (0,))
                                          for op in small_cnn().ops}), x, y)
    for k, v in one.parameters().items():
        np.testing.assert_allclose(a.parameters()[k], v, rtol=1e-4, atol=1e-5, err_msg=k)


def test_from_json_wants_text():
    with pytest.raises(StrategyError, match=r"strategy: a strategy is JSON text, got int"):
        Strategy.from_json(5)
