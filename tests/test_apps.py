"""The benchmark apps (mlp, alexnet, resnet101, inception_v3, transformer) and their command line.

Sizes: parameter counts and shapes of the full-size graphs (built alone, nothing allocated)
and of the tiny ones against the papers' layer tables written out as formulas here. Runs:
every app --tiny for two iterations, data parallel on 1 rank, with another baseline on 1 or
2 ranks, and under mpiexec -n 2; the tiny MLP and AlexNet learn; one test per bad flag.
"""
from __future__ import annotations

import argparse

import json
import math
import os
import re
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apps import alexnet, inception_v3, mlp, nmt, resnet101, transformer
from apps.__main__ import main as apps_main
from apps.cli import APPS as APP_NAMES, RESULT_FIELDS, SAMPLES_PER_DRAW, batch_source, build_model, count_parameters
from taskrt.machine import count_gpus
from taskrt.tracing import read_trace
from tests.test_mpi import ROOT, _mpiexec, output, python_path

APPS = {"mlp": mlp, "alexnet": alexnet, "resnet101": resnet101, "inception_v3": inception_v3,
        "transformer": transformer}


# ---- the papers' layer tables as parameter formulas ----------------------------------------------
def conv(cin, cout, kh, kw=None, bias=True):
    return cin * cout * kh * (kh if kw is None else kw) + (cout if bias else 0)


def fc(cin, cout):
    return cin * cout + cout


def alexnet_params(s):
    c1, c2, c3, c4, c5 = s["channels"]
    side = (s["image"] + 2 * 2 - 11) // 4 + 1
    for _ in range(3):  # three 3x3/2 max pools; the 5x5 and 3x3 convs keep the size
        side = (side - 3) // 2 + 1
    return (conv(3, c1, 11) + conv(c1, c2, 5) + conv(c2, c3, 3) + conv(c3, c4, 3) + conv(c4, c5, 3)
            + fc(c5 * side * side, s["hidden"]) + fc(s["hidden"], s["hidden"]) + fc(s["hidden"], s["classes"]))


def conv_bn(cin, cout, kh, kw=None):
    """A convolution without bias and its batch norm's scale and shift."""
    return conv(cin, cout, kh, kw, bias=False) + 2 * cout


def resnet_params(s):
    widths, total, cin = s["widths"], conv_bn(3, s["widths"][0], 7), s["widths"][0]
    for w, count in zip(widths, s["blocks"]):
        for i in range(count):
            total += conv_bn(cin, w, 1) + conv_bn(w, w, 3) + conv_bn(w, 4 * w, 1)
            if i == 0:
                total += conv_bn(cin, 4 * w, 1)  # the projection shortcut
            cin = 4 * w
    return total + fc(cin, s["classes"])


def inception_params(s):
    """Szegedy et al.'s modules with the released model's branch widths, each scaled by `width`."""
    c = lambda n: max(1, round(n * s["width"]))  # noqa: E731

    def a(cin, pf):
        return (conv_bn(cin, c(64), 1) + conv_bn(cin, c(48), 1) + conv_bn(c(48), c(64), 5) + conv_bn(cin, c(64), 1)
                + conv_bn(c(64), c(96), 3) + conv_bn(c(96), c(96), 3) + conv_bn(cin, c(pf), 1)), \
            2 * c(64) + c(96) + c(pf)

    def c7(cin, n):
        return (conv_bn(cin, c(192), 1) + conv_bn(cin, c(n), 1) + conv_bn(c(n), c(n), 1, 7)
                + conv_bn(c(n), c(192), 7, 1) + conv_bn(cin, c(n), 1) + 3 * conv_bn(c(n), c(n), 7, 1)
                + conv_bn(c(n), c(192), 1, 7) + conv_bn(cin, c(192), 1)), 4 * c(192)

    def e(cin):
        return (conv_bn(cin, c(320), 1) + conv_bn(cin, c(384), 1) + 2 * conv_bn(c(384), c(384), 1, 3)
                + conv_bn(cin, c(448), 1) + conv_bn(c(448), c(384), 3) + 2 * conv_bn(c(384), c(384), 1, 3)
                + conv_bn(cin, c(192), 1)), c(320) + 4 * c(384) + c(192)

    total = (conv_bn(3, c(32), 3) + conv_bn(c(32), c(32), 3) + conv_bn(c(32), c(64), 3)
             + conv_bn(c(64), c(80), 1) + conv_bn(c(80), c(192), 3))
    cin = c(192)
    for pf in (32, 64, 64):
        n, cin = a(cin, pf)
        total += n
    total += conv_bn(cin, c(384), 3) + conv_bn(cin, c(64), 1) + conv_bn(c(64), c(96), 3) + conv_bn(c(96), c(96), 3)
    cin += c(384) + c(96)
    for n7 in (128, 160, 160, 192):
        n, cin = c7(cin, n7)
        total += n
    if s["aux"]:
        total += conv_bn(cin, c(128), 1) + conv_bn(c(128), c(768), 5) + fc(c(768), s["classes"])
    total += (conv_bn(cin, c(192), 1) + conv_bn(c(192), c(320), 3) + conv_bn(cin, c(192), 1)
              + 2 * conv_bn(c(192), c(192), 1, 7) + conv_bn(c(192), c(192), 3))
    cin += c(320) + c(192)
    for _ in range(2):
        n, cin = e(cin)
        total += n
    return total + fc(cin, s["classes"])


def bert_params(s):
    h, f = s["hidden"], s["ff"]
    embeddings = (s["vocab"] + s["positions"] + s["types"]) * h + 2 * h
    layer = 4 * h * h + 4 * h + 2 * h + fc(h, f) + fc(f, h) + 2 * h
    return embeddings + s["layers"] * layer + fc(h, h) + fc(h, s["classes"])


def mlp_params(s):
    return fc(s["features"], s["hidden"]) + (s["layers"] - 1) * fc(s["hidden"], s["hidden"]) \
        + fc(s["hidden"], s["classes"])


FORMULAS = {"mlp": mlp_params, "alexnet": alexnet_params, "resnet101": resnet_params,
            "inception_v3": inception_params, "transformer": bert_params}
#: full-size counts (torchvision's alexnet, resnet101, inception_v3; BERT-base with a 2-class head)
FULL_COUNTS = {"mlp": 2_913_290, "alexnet": 61_100_840, "resnet101": 44_549_160, "inception_v3": 23_834_568,
               "transformer": 109_482_240 + 768 * 2 + 2}


def shapes(model) -> dict:
    return {op.name: op.outputs[0].shape for op in model.ops}


@pytest.mark.parametrize("name", APPS)
def test_full_size_graph_builds_without_weights(name):
    module = APPS[name]
    tracemalloc.start()
    model, out = build_model(module.build, module.FULL, batch_size=2, weights=False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert count_parameters(model) == FULL_COUNTS[name] == FORMULAS[name](module.FULL)
    assert out.shape == (2, module.FULL["classes"])
    assert peak < 32 << 20, f"{peak / 2**20:.1f} MiB allocated"


def test_inception_aux_head_and_the_papers_grids():
    with_aux, _ = build_model(inception_v3.build, {**inception_v3.FULL, "aux": True}, 2, weights=False)
    assert count_parameters(with_aux) == 27_161_264 == inception_params({**inception_v3.FULL, "aux": True})
    s = shapes(with_aux)
    assert s["maxpool2"] == (2, 192, 35, 35) and s["Mixed_5d"] == (2, 288, 35, 35)
    assert s["Mixed_6e"] == (2, 768, 17, 17) and s["Mixed_7c"] == (2, 2048, 8, 8)
    assert s["aux.fc"] == (2, 1000)


def test_full_size_feature_maps():
    s = shapes(build_model(alexnet.build, alexnet.FULL, 2, weights=False)[0])
    assert s["relu1"] == (2, 64, 55, 55) and s["pool5"] == (2, 256, 6, 6) and s["fc6"] == (2, 4096)
    s = shapes(build_model(resnet101.build, resnet101.FULL, 2, weights=False)[0])
    assert s["pool1"] == (2, 64, 56, 56) and s["layer3.22.relu"] == (2, 1024, 14, 14)
    assert s["layer4.2.relu"] == (2, 2048, 7, 7) and sum(k.endswith(".conv") for k in s) == 1 + 3 * 33 + 4
    s = shapes(build_model(transformer.build, transformer.FULL, 2, weights=False)[0])
    assert s["layer11.output_norm"] == (2, 128, 768) and s["pooler"] == (2, 768)


@pytest.mark.parametrize("name", APPS)
def test_tiny_sizes_follow_the_formulas(name):
    module = APPS[name]
    model, out = build_model(module.build, module.TINY, batch_size=3, weights=False)
    assert count_parameters(model) == FORMULAS[name](module.TINY)
    assert out.shape == (3, module.TINY["classes"])


# ---- running the apps ------------------------------------------------------------------------
def run_here(module, *flags, capsys) -> tuple[dict, list[str]]:
    """Run an app's main in this process; (its report, its stdout lines)."""
    report = module.main([*map(str, flags)])
    lines = capsys.readouterr().out.splitlines()
    assert json.loads(lines[-1]) == report
    return report, lines


def run_mpi_app(n: int, name: str, *flags, timeout: float = 120):
    env = {**os.environ, "TASKRT_MPI_TIMEOUT": "30", "PYTHONPATH": python_path()}
    cmd = [_mpiexec(), "-n", str(n), sys.executable, "-m", f"apps.{name}", *map(str, flags)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
                          stdin=subprocess.DEVNULL)
    return proc, time.monotonic() - t0


def check_report(report: dict, name: str, ranks: int, strategy: str, iterations: int = 2) -> None:
    assert tuple(report) == RESULT_FIELDS
    assert report["app"] == name and report["ranks"] == ranks and report["strategy"] == strategy
    assert report["iterations"] == iterations and report["tiny"] is True
    assert report["samples_per_s"] > 0 and math.isfinite(report["final_loss"])
    assert report["parameters"] == FORMULAS[name](APPS[name].TINY)


#: every app trains data parallel on 1 rank and with another baseline on 1 or 2 ranks, and on 2 ranks
ONE_RANK = [("mlp", "data"), ("mlp", "tensor"), ("alexnet", "data"), ("alexnet", "expert"), ("resnet101", "data"),
            ("inception_v3", "data"), ("transformer", "data"), ("transformer", "tensor")]
TWO_RANKS = [("mlp", "data"), ("alexnet", "expert"), ("resnet101", "expert"), ("inception_v3", "expert"),
             ("transformer", "tensor")]


@pytest.mark.parametrize("name, baseline", ONE_RANK)
def test_tiny_app_on_one_rank(name, baseline, capsys):
    report, lines = run_here(APPS[name], "--tiny", "--iterations", 2, "--cpus-per-rank", 2, "--baseline", baseline,
                             capsys=capsys)
    check_report(report, name, 1, baseline)
    assert [line.split("  ")[0] for line in lines[:-1]] == [f"{name} iteration 1/2", f"{name} iteration 2/2"]


def test_no_strategy_flag_means_data_parallel(capsys):
    report, _ = run_here(mlp, "--tiny", "--iterations", 2, capsys=capsys)
    check_report(report, "mlp", 1, "data")


@pytest.mark.parametrize("name, baseline", TWO_RANKS)
def test_tiny_app_on_two_ranks(name, baseline, tmp_path):
    trace = tmp_path / "run.trace.jsonl"
    proc, _ = run_mpi_app(2, name, "--tiny", "--iterations", 2, "--cpus-per-rank", 1, "--baseline", baseline,
                          "--trace", trace)
    assert proc.returncode == 0, output(proc)
    report = json.loads(proc.stdout.splitlines()[-1])
    check_report(report, name, 2, baseline)
    assert proc.stdout.count('"app"') == 1, output(proc)  # rank 0 alone reports
    for rank in (0, 1):  # each rank made its own share of every batch
        _, events = read_trace(str(tmp_path / f"run.trace.rank{rank}.jsonl"))
        assert sum(e["name"] == "source" for e in events) == 2, rank


def test_float64(capsys):
    report, _ = run_here(mlp, "--tiny", "--iterations", 2, "--dtype", "float64", capsys=capsys)
    assert report["dtype"] == "float64" and math.isfinite(report["final_loss"])


def test_data_is_the_same_on_one_and_two_ranks(capsys):
    one, _ = run_here(mlp, "--tiny", "--iterations", 2, "--cpus-per-rank", 2, "--seed", 5, capsys=capsys)
    proc, _ = run_mpi_app(2, "mlp", "--tiny", "--iterations", 2, "--cpus-per-rank", 1, "--seed", 5)
    assert proc.returncode == 0, output(proc)
    two = json.loads(proc.stdout.splitlines()[-1])
    assert two["first_loss"] == pytest.approx(one["first_loss"], rel=1e-5)
    assert two["final_loss"] == pytest.approx(one["final_loss"], rel=1e-4)


@pytest.mark.parametrize("module", [mlp, nmt], ids=["mlp", "nmt"])
@given(cuts=st.lists(st.integers(0, 21), max_size=4), step=st.integers(0, 3))
@settings(max_examples=15, deadline=None)
def test_a_batch_source_gives_a_sample_the_same_data_in_any_share(module, cuts, step):
    """Shares cut anywhere (as ranks split a batch, across the blocks drawn together) put
    together are the whole batch, input by input; another step draws other data."""
    model, _ = build_model(module.build, module.TINY, 21, weights=False)
    source = batch_source(module.make_batch, model, module.TINY, seed=2)
    whole_inputs, whole_labels = source(step, 0, 21)
    bounds = [0, *sorted(cuts), 21]
    shares = [source(step, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
    assert 21 > SAMPLES_PER_DRAW and list(whole_inputs) == [t.name for t in model.inputs]
    for name, whole in whole_inputs.items():
        assert whole.shape[0] == 21
        np.testing.assert_array_equal(np.concatenate([inputs[name] for inputs, _ in shares]), whole)
    np.testing.assert_array_equal(np.concatenate([labels for _, labels in shares]), whole_labels)
    other_inputs, _ = source(step + 1, 0, 21)
    assert any(not np.array_equal(other_inputs[n], whole_inputs[n]) for n in whole_inputs)


def losses(lines: list[str]) -> list[float]:
    return [float(re.search(r"loss (\S+)", line).group(1)) for line in lines[:-1]]


@pytest.mark.parametrize("name, flags", [("mlp", ["--optimizer", "adam", "--lr", 0.01]),
                                         ("alexnet", ["--optimizer", "adam", "--lr", 0.002])])
def test_tiny_app_learns(name, flags, capsys):
    _, lines = run_here(APPS[name], "--tiny", "--iterations", 40, *flags, capsys=capsys)
    curve = losses(lines)
    first, last = sum(curve[:5]) / 5, sum(curve[-5:]) / 5
    assert last < 0.75 * first, curve


def test_recurrent_apps_default_to_a_smaller_rate_at_full_size(capsys):
    """Adam at 0.01 moves each of a 1024-unit LSTM's weights by about 0.01 a step, which swings
    its gates (the full RNN-TC went 0.69 -> 8.2 in three iterations, PyTorch's alike to 3.4): the
    full sizes default to 0.001, the tiny ones keep 0.01; --lr still wins."""
    from apps import rnntc
    with pytest.raises(SystemExit):
        rnntc.main(["--help"])
    assert "(default: 0.001; 0.01 with --tiny)" in " ".join(capsys.readouterr().out.split())
    assert run_here(rnntc, "--tiny", "--iterations", 1, capsys=capsys)[0]["lr"] == 0.01
    assert run_here(rnntc, "--tiny", "--iterations", 1, "--lr", 0.05, capsys=capsys)[0]["lr"] == 0.05
    assert run_here(mlp, "--tiny", "--iterations", 1, capsys=capsys)[0]["lr"] == 0.01


def test_help_lists_every_flag_with_its_default(capsys):
    with pytest.raises(SystemExit) as e:
        alexnet.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--batch-size", "--iterations", "--tiny", "--strategy", "--baseline", "--trace", "--seed",
                 "--cpus-per-rank", "--gpus-per-rank", "--dtype"):
        assert flag in text
    assert "default: 64; 16 with --tiny" in text and "(default: 10)" in text


# ---- bad flags: one line naming the flag and the value, exit status 2 ----------------------------
def bad(capsys, module, *flags) -> str:
    with pytest.raises(SystemExit) as e:
        module.main([*map(str, flags)])
    assert e.value.code == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("error: ") and "\n" not in err and '"app"' not in captured.out, captured
    return err


def strategy_file(tmp_path, text: str) -> str:
    path = tmp_path / "s.json"
    path.write_text(text)
    return str(path)


def test_unknown_app(capsys):
    with pytest.raises(SystemExit) as e:
        apps_main(["lenet", "--tiny"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == ("error: unknown app 'lenet'; the apps are mlp, alexnet, resnet101, "
                                               "inception_v3, transformer, rnntc, rnnlm, nmt")
    with pytest.raises(SystemExit) as e:   # (its usage went to stdout)
        apps_main([])
    out = capsys.readouterr()
    assert e.value.code == 2 and not out.out and out.err.startswith("error: no app named; usage: python -m apps NAME")


@pytest.mark.parametrize("name", APP_NAMES)
def test_each_app_s_defaults_are_its_app_value(name):
    """What a run trains with and what the simulators of the app take (app_named) is one App."""
    import importlib
    from apps.cli import App, app_named
    module = importlib.import_module(f"apps.{name}")
    assert isinstance(module.APP, App) and app_named(name) is module.APP
    assert module.APP.name == name and module.APP.full is module.FULL and module.APP.tiny is module.TINY
    with pytest.raises(ValueError, match="no app named 'lenet'; the apps are mlp, alexnet"):
        app_named("lenet")


def test_unknown_baseline(capsys):
    assert "argument --baseline: invalid choice: 'pipeline'" in bad(capsys, mlp, "--baseline", "pipeline")


def test_files_the_run_writes_are_checked_before_it_trains(tmp_path, capsys):
    """A trace or exported strategy is written after the work: a missing folder, or a folder
    given as the file, stops the run before it starts instead of losing it at the end."""
    missing = tmp_path / "no" / "t.jsonl"
    assert bad(capsys, mlp, "--tiny", "--trace", missing) == (f"error: --trace {missing}: the folder "
                                                             f"{tmp_path / 'no'} does not exist")
    assert bad(capsys, mlp, "--tiny", "--trace", tmp_path) == f"error: --trace {tmp_path}: is a folder, not a file"
    err = bad(capsys, mlp, "--tiny", "--search-budget", 4, "--export-strategy", tmp_path / "no" / "s.json")
    assert err.startswith("error: --export-strategy ") and "does not exist" in err
    long = tmp_path / ("a" * 300 + ".json")   # (an OSError traceback once the work was done)
    assert bad(capsys, mlp, "--tiny", "--export-strategy", long) == (
        f"error: --export-strategy {long}: the file name is too long (over 255 bytes)")
    same = tmp_path / "out.json"   # (the trace overwrote the strategy, without a word)
    assert bad(capsys, mlp, "--tiny", "--trace", same, "--export-strategy", same) == (
        f"error: --export-strategy {same}: the same file as --trace's: one would overwrite the other")
    spelled = f"{tmp_path}/./out.json"   # (the same file by another path)
    assert bad(capsys, mlp, "--tiny", "--trace", same, "--export-strategy", spelled) == (
        f"error: --export-strategy {spelled}: the same file as --trace's: one would overwrite the other")
    assert bad(capsys, mlp, "--tiny", "--export-strategy", "/dev/full") == (
        "error: --export-strategy /dev/full: cannot write: No space left on device")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")
def test_flags_that_would_train_nothing_sensible_are_refused_and_a_diverged_run_fails(capsys):
    assert bad(capsys, mlp, "--tiny", "--lr", 1e300) == "error: --lr 1e+300: beyond the range of float32, the network's type"
    assert bad(capsys, mlp, "--tiny", "--machine", "").startswith("error: --machine : ")   # (it ran as local)
    with pytest.raises(SystemExit) as e:   # (it printed "final_loss": NaN, not JSON, and exited 0)
        mlp.main(["--tiny", "--iterations", "20", "--lr", "1e30"])   # (inf weights by the second step)
    assert e.value.code == 1
    out = capsys.readouterr()
    assert "{" not in out.out and re.fullmatch(r"error: mlp: the loss is nan at iteration \d+ of 20 \(sgd, --lr 1e\+30\): "
                                               r"training diverged \(a smaller --lr may help\)", out.err.strip())


def test_each_ranks_trace_file_is_checked_before_any_rank_trains(tmp_path):
    """Under mpiexec a rank writes run.rank<r>.jsonl: a folder there on rank 1 alone stops every
    rank with one line naming the file, not rank 1's traceback and an abort once training began."""
    (tmp_path / "run.rank1.jsonl").mkdir()
    proc, _ = run_mpi_app(2, "mlp", "--tiny", "--iterations", 1, "--cpus-per-rank", 1, "--trace",
                          tmp_path / "run.jsonl")
    assert proc.returncode == 2, output(proc)
    assert proc.stderr.strip().splitlines() == [
        f"error: --trace {tmp_path / 'run.jsonl'}: {tmp_path / 'run.rank1.jsonl'} is a folder, not a file (on rank 1)"]


def test_under_mpiexec_only_rank_zero_prints_a_flag_error(capsys, monkeypatch):
    """Every rank finds the same problem and exits 2; one line is printed, not one a rank."""
    monkeypatch.setenv("PMI_SIZE", "2")
    for rank, said in (("1", ""), ("0", "error: argument --batch-size: 0 must be >= 1\n")):
        monkeypatch.setenv("PMI_RANK", rank)
        with pytest.raises(SystemExit) as e:
            mlp.main(["--batch-size", "0"])
        assert e.value.code == 2 and capsys.readouterr().err == said


def test_bad_batch_size_value(capsys):
    assert bad(capsys, mlp, "--batch-size", 0) == "error: argument --batch-size: 0 must be >= 1"


def test_a_batch_a_batch_norm_cannot_train_on_is_refused_before_any_work(capsys):
    """One sample whose last grids are 1x1: a batch norm there has one value a channel."""
    assert bad(capsys, inception_v3, "--tiny", "--batch-size", 1) == (
        "error: --batch-size 1: batch_norm 'Mixed_7a.branch3x3_2.bn': needs more than 1 value per channel in "
        "training, got 1 (input shapes [(1, 40, 1, 1)])")


def test_warmup_must_leave_an_iteration_to_time(capsys):
    assert bad(capsys, mlp, "--tiny", "--iterations", 3, "--warmup", 3) == (
        "error: --warmup 3: must be less than --iterations (3): no iteration would be timed")
    assert run_here(mlp, "--tiny", "--iterations", 1, capsys=capsys)[0]["warmup"] == 0   # the default shrinks
    assert run_here(mlp, "--tiny", "--iterations", 3, "--warmup", 0, capsys=capsys)[0]["warmup"] == 0


def test_strategy_and_baseline_together(capsys):
    err = bad(capsys, mlp, "--strategy", "s.json", "--baseline", "data")
    assert "--baseline" in err and "--strategy" in err


def test_missing_strategy_file(capsys, tmp_path):
    path = tmp_path / "nowhere.json"
    err = bad(capsys, mlp, "--tiny", "--strategy", path)
    assert err == f"error: --strategy {path}: can't read the strategy file: No such file or directory"


def test_malformed_strategy_file(capsys, tmp_path):
    path = strategy_file(tmp_path, '{"version": 2,\n "model": "mlp",\n "ops": {"fc1": }}\n')
    assert bad(capsys, mlp, "--tiny", "--strategy", path).startswith(f"error: --strategy {path}: {path}:3:")


def test_strategy_file_for_another_model(capsys, tmp_path):
    path = strategy_file(tmp_path, '{"version": 2, "model": "alexnet", "ops": {}}')
    err = bad(capsys, mlp, "--tiny", "--strategy", path)
    assert err == f"error: --strategy {path}: made for model 'alexnet', but this model is 'mlp'"


def test_strategy_unknown_operator(capsys, tmp_path):
    path = strategy_file(tmp_path, '{"version": 2, "model": "mlp", "ops": {"fc9": {"degrees": [2, 1, 1]}}}')
    assert "unknown operator 'fc9'" in bad(capsys, mlp, "--tiny", "--strategy", path)


def test_batch_size_the_strategy_cannot_split(capsys, tmp_path):
    path = strategy_file(tmp_path, '{"version": 2, "model": "mlp", "ops": {"fc1": {"degrees": [4, 1, 1]}}}')
    err = bad(capsys, mlp, "--tiny", "--batch-size", 2, "--strategy", path)
    assert err == f"error: --strategy {path}: splits dense 'fc1' 4 ways along the batch, which has 2 samples " \
                  f"(--batch-size)"


def test_strategy_devices_the_machine_lacks(capsys, tmp_path):
    path = strategy_file(tmp_path, '{"version": 2, "model": "mlp", '
                                   '"ops": {"fc1": {"degrees": [2, 1, 1], "devices": [0, 5]}}}')
    err = bad(capsys, mlp, "--tiny", "--cpus-per-rank", 2, "--strategy", path)
    assert err.startswith(f"error: --strategy {path}: dense 'fc1': config 2x1x1 on [0, 5] places tile 1 on "
                          f"device 5, but Machine(1 ranks, 2 cpus, 0 gpus, 1 memories) computes on 2 cpus")


def test_a_strategy_for_a_bigger_machine_names_its_first_problems_and_counts_the_rest(capsys, tmp_path):
    ops = ("fc1", "fc2", "fc3", "out", "drop1")
    configs = ", ".join(f'"{name}": {{"degrees": [2, 1, 1], "devices": [1, 6]}}' for name in ops[:4])
    path = strategy_file(tmp_path, f'{{"version": 2, "model": "mlp", "ops": {{{configs}, '
                                   f'"drop1": {{"degrees": [2, 1], "devices": [1, 6]}}}}}}')
    err = bad(capsys, mlp, "--tiny", "--cpus-per-rank", 2, "--strategy", path)
    assert err.count("places tile 1 on device 6") == 3 and err.endswith("; and 2 more")


def test_more_cpus_than_cores(capsys, monkeypatch):
    cores = os.cpu_count()
    err = bad(capsys, mlp, "--tiny", "--cpus-per-rank", cores + 1)
    assert err.startswith(f"error: --cpus-per-rank {cores + 1}: ") and f"it has {cores}" in err
    monkeypatch.setenv("TASKRT_CPUS", str(cores + 1))   # the flag's default: refused as the flag is
    err = bad(capsys, mlp, "--tiny")
    assert err.startswith(f"error: TASKRT_CPUS={cores + 1}: ") and f"it has {cores}" in err


def test_a_cost_cache_that_is_a_folder(capsys, monkeypatch, tmp_path):
    """It used to be read as no cache, then the run failed with a traceback when it wrote the
    kernels it had measured."""
    monkeypatch.setenv("TASKRT_COST_CACHE", str(tmp_path))
    err = bad(capsys, mlp, "--tiny", "--machine", "local")
    assert err == f"error: the cost cache {tmp_path} is a folder, not a file (TASKRT_COST_CACHE or --cache names the file)"
    assert list(tmp_path.iterdir()) == []


def test_more_gpus_than_the_node_has(capsys):
    want = count_gpus() + 1
    err = bad(capsys, mlp, "--tiny", "--gpus-per-rank", want)
    assert err.startswith(f"error: --gpus-per-rank {want}: ") and f"cupy sees {want - 1}" in err


def test_dtype_the_network_does_not_compute_in(capsys):
    err = bad(capsys, transformer, "--tiny", "--dtype", "float64")
    assert err == "error: --dtype float64: transformer computes in float32 (its inputs are not floats)"


def test_bad_strategy_stops_every_rank_before_work(tmp_path):
    path = strategy_file(tmp_path, '{"version": 2, "model": "alexnet", "ops": {}}')
    proc, seconds = run_mpi_app(2, "mlp", "--tiny", "--cpus-per-rank", 1, "--strategy", path, timeout=60)
    assert proc.returncode != 0 and seconds < 30, output(proc)
    line = f"error: --strategy {path}: made for model 'alexnet', but this model is 'mlp'"
    assert proc.stderr.count(line) == 1 and "iteration" not in proc.stdout, output(proc)   # rank 0 says it


#: rank 0 fails in what it alone does (a search, a prediction) with an error that is not a bad flag
RANK_ZERO_FAILS = ("from apps.cli import _on_rank_zero\n"
                   "def work():\n"
                   "    raise RuntimeError('the search broke')\n"
                   "_on_rank_zero(work, 2)\n"
                   "print('went on')\n")


def test_any_error_of_rank_zeros_work_ends_every_rank():
    env = {**os.environ, "TASKRT_MPI_TIMEOUT": "30", "PYTHONPATH": python_path()}
    t0 = time.monotonic()
    proc = subprocess.run([_mpiexec(), "-n", "2", sys.executable, "-c", RANK_ZERO_FAILS], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0 and time.monotonic() - t0 < 25, output(proc)
    assert "RuntimeError: the search broke" in proc.stderr and "went on" not in proc.stdout, output(proc)


def test_environment_switches_and_gpus_are_checked_with_the_flags(capsys, monkeypatch):
    for switch in ("TASKRT_BIND_CORES", "TASKRT_MPI"):
        monkeypatch.setenv(switch, "abc")
        assert bad(capsys, mlp, "--tiny") == f"error: {switch} must be 0 (off) or 1 (on), got 'abc'"
        monkeypatch.delenv(switch)
    want = count_gpus() + 1
    monkeypatch.setenv("TASKRT_GPUS", str(want))
    err = bad(capsys, mlp, "--tiny")
    assert err.startswith(f"error: TASKRT_GPUS={want}: ") and f"cupy sees {want - 1}" in err


# ---- searching before training (strategies.search through --search-budget) ----------------------
def test_search_budget_searches_trains_with_it_and_exports_it(capsys, tmp_path):
    out = tmp_path / "searched.json"
    report, _ = run_here(mlp, "--tiny", "--iterations", 3, "--search-budget", 8, "--export-strategy", out,
                         capsys=capsys)
    assert report["strategy"] == "searched" and report["predicted_iteration_s"] > 0
    assert set(report) == set(RESULT_FIELDS)
    saved = json.loads(out.read_text())
    assert saved["model"] == "mlp" and "loss" not in saved["ops"]
    again, _ = run_here(mlp, "--tiny", "--iterations", 3, "--strategy", out, capsys=capsys)
    assert again["strategy"] == str(out) and again["predicted_iteration_s"] is None


def test_a_strategy_from_the_search_api_names_the_loss_op_and_trains(capsys, tmp_path):
    """search() returns every op of the simulated graph, the loss op included, as Model.compile
    takes it; the apps refused that op ('unknown operator')."""
    from strategies.machine_model import load_machine
    from strategies.search import app_simulator, search
    _, sim = app_simulator("mlp", load_machine("local"), tiny=True)
    best = search(sim, budget=6, seed=0).best
    assert "loss" in best.ops
    path = tmp_path / "api.json"
    best.save(path)
    report, _ = run_here(mlp, "--tiny", "--iterations", 2, "--warmup", 0, "--strategy", path, capsys=capsys)
    assert report["strategy"] == str(path) and report["iterations"] == 2


def test_search_budget_on_two_ranks_agrees_on_one_strategy(tmp_path):
    out = tmp_path / "searched.json"
    proc, _ = run_mpi_app(2, "mlp", "--tiny", "--iterations", 3, "--cpus-per-rank", 1, "--search-budget", 6,
                          "--export-strategy", out)
    assert proc.returncode == 0, output(proc)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["ranks"] == 2 and report["strategy"] == "searched" and out.exists()


def test_machine_without_a_search_predicts_the_strategy_trained_with(capsys):
    report, lines = run_here(mlp, "--tiny", "--iterations", 3, "--baseline", "model", "--machine", "local",
                             capsys=capsys)
    assert report["strategy"] == "model" and report["predicted_iteration_s"] > 0
    assert lines[-2].startswith("mlp: ") and "predicted" in lines[-2]
    err = bad(capsys, mlp, "--tiny", "--machine", "/no/such.json")
    assert err.startswith("error: --machine /no/such.json:")


def test_the_prediction_simulates_the_optimizer_the_run_trains_with(capsys, monkeypatch):
    """Adam's two states and longer updates are part of the step: the prediction (and a search)
    simulates the run's --optimizer at its rate, not the simulator's default."""
    from ops.optimizers import SGD, Adam
    from strategies.simulator import Simulator
    made = []
    real = Simulator.for_model.__func__

    def spy(cls, *args, **kwargs):
        made.append(real(cls, *args, **kwargs))
        return made[-1]
    monkeypatch.setattr(Simulator, "for_model", classmethod(spy))
    for flags, want in (((), SGD(lr=0.01, momentum=0.9)), (("--optimizer", "adam", "--lr", 0.5), Adam(lr=0.5))):
        run_here(mlp, "--tiny", "--iterations", 2, "--machine", "local", *flags, capsys=capsys)
        assert made[-1].optimizer == want


def test_a_gpu_run_takes_a_gpu_model_of_its_shape_and_places_its_strategies_on_the_same_gpus(tmp_path):
    """A run's GPUs follow its CPU workers (processors 8 and 9 here); a machine model's follow one
    host CPU a rank (1 and 2): a strategy's devices are the GPUs of either (they named processors,
    so a searched strategy ran on the run's CPU workers), and `local` (CPU devices) was taken as a
    model of the GPUs."""
    from apps.cli import FlagError, _machine_model
    from ops import SGD, Model, TileConfig
    from taskrt import Machine, Runtime
    run = Machine.build(1, cpus_per_rank=8, gpus_per_rank=2)
    two = json.loads((ROOT / "strategies" / "machines" / "p100.json").read_text())
    two.update(nodes=1, devices_per_node=2)
    (tmp_path / "p100x2.json").write_text(json.dumps(two))
    mm = _machine_model(argparse.Namespace(machine=str(tmp_path / "p100x2.json")), run)
    for machine, gpus in ((run, (8, 9)), (mm.to_machine(), (1, 2))):
        m = Model(Runtime(machine=machine, execute=False))
        m.dense(m.input((4, 6)), 3, name="fc")
        m.compile(SGD(lr=0.1), configs={"fc": TileConfig((2, 1, 1), (1, 0))})
        assert list(m._low.plans["fc"].placement.values()) == [gpus[1], gpus[0]]
    with pytest.raises(FlagError, match="--machine local: its model's devices are cpus, but this run computes on 2 "
                                        "gpus; give a gpu machine model"):
        _machine_model(argparse.Namespace(machine=None), run)
    with pytest.raises(FlagError, match="its model has 4 node\\(s\\) of 4 gpus, this run 1 rank\\(s\\) of 2"):
        _machine_model(argparse.Namespace(machine="p100"), run)


def test_a_machine_model_that_does_not_match_the_run_is_a_bad_flag(capsys, tmp_path):
    err = bad(capsys, mlp, "--tiny", "--search-budget", 4, "--machine", "p100")
    assert err.startswith("error: --machine p100: its model's devices are gpus, but this run computes on ")
    assert "'--machine local'" in err
    # a model of two GPUs on a run of two CPU workers: the counts agree, the kinds do not (its
    # strategy named the model's processors 1 and 2, and compile failed with a traceback)
    two = json.loads((ROOT / "strategies" / "machines" / "p100.json").read_text())
    two.update(nodes=1, devices_per_node=2)
    path = tmp_path / "p100x2.json"
    path.write_text(json.dumps(two))
    err = bad(capsys, mlp, "--tiny", "--cpus-per-rank", 2, "--search-budget", 4, "--machine", path)
    assert err.startswith(f"error: --machine {path}: its model's devices are gpus, but this run computes on 2 cpus")
    err = bad(capsys, mlp, "--tiny", "--search-budget", 4, "--machine", "/no/such.json")
    assert err.startswith("error: --machine /no/such.json:")
