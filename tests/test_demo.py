"""apps/demo: the machine it simulates is the one the runs make, and the whole demo at tiny numbers."""
import json
import struct

import pytest

from apps.demo import machine_setup, run_demo, table, train_mpi
from taskrt.machine import Machine, RankSpec, count_gpus


def test_cpu_setup_matches_the_runs_machine():
    setup = machine_setup(2, gpus=0)
    assert setup.ranks == 2 and setup.gpus_per_rank == 0
    assert setup.flags() == ["--cpus-per-rank", "1", "--gpus-per-rank", "0"]
    # what Machine.discover builds under mpiexec -n 2 with --cpus-per-rank 1 --gpus-per-rank 0
    discovered = Machine.from_ranks([RankSpec(1, ()), RankSpec(1, ())])
    assert setup.machine_model.to_machine().processors == discovered.processors
    assert setup.machine_model.nodes_per_host == 2   # both ranks here: a worker's kernels measured on its share


def test_gpu_setup_one_gpu_a_rank():
    setup = machine_setup(2, gpus=1)
    assert setup.ranks == 1 and setup.gpus_per_rank == 1 and setup.machine_model.device.kind == "gpu"
    two = machine_setup(2, gpus=4)
    discovered = Machine.from_ranks([RankSpec(1, (0,)), RankSpec(1, (1,))])
    assert [(p.kind, p.rank) for p in two.machine_model.to_machine().processors] == \
        [(p.kind, p.rank) for p in discovered.processors]


def test_table_rows():
    text = table([{"name": "searched", "samples_per_s": 400.0, "median_iteration_s": 0.04, "predicted_ms": 5.0}])
    assert text.splitlines()[2].split() == ["searched", "400.0", "40.00", "5.00", "8.00"]


def test_a_failed_run_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="--strategy"):
        train_mpi("mlp", machine_setup(1, gpus=0), 16, 2, ["--strategy", str(tmp_path / "nope.json")],
                  str(tmp_path / "t.jsonl"), timeout=120)


def test_a_strategy_is_told_apart_from_data_parallelism():
    from apps.demo import is_data_parallel
    from strategies.baselines import data_parallel, model_parallel
    from strategies.search import app_graph
    setup = machine_setup(2, gpus=0)
    model, _ = app_graph("mlp", 16, tiny=True)
    machine = setup.machine_model.to_machine()
    assert is_data_parallel("mlp", 16, setup, data_parallel(model, machine))
    assert not is_data_parallel("mlp", 16, setup, model_parallel(model, machine))


def test_run_demo_writes_every_file(tmp_path):
    lines = []
    out = run_demo(budget=12, iterations=4, out_dir=str(tmp_path), gpus=0, say=lines.append)
    assert [r["name"] for r in out["rows"]] == ["searched", "data"]
    assert all(r["samples_per_s"] > 0 and r["predicted_ms"] > 0 for r in out["rows"])
    files = out["files"]
    assert len(files["searched_traces"]) == len(files["data_traces"]) == 2
    for path in [files["strategy"], *files["searched_traces"], *files["data_traces"]]:
        assert (tmp_path / path.split("/")[-1]).exists()
    assert json.load(open(files["strategy"]))["model"] == "mlp"
    chrome = json.load(open(files["chrome"]))
    assert chrome
    with open(files["timeline"], "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and min(struct.unpack(">II", head[16:24])) > 100
    text = "\n".join(lines)
    assert "samples/s" in text and "predicted ms" in text
    assert all(path in text for path in (files["strategy"], files["chrome"], files["timeline"], files["simulated"],
                                         files["compare"]))
    # the searched run against its simulation, iteration by iteration (tools.trace compare)
    with open(files["compare"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    said = [line for line in lines if line.startswith("searched, simulated against traced (median iteration): ")]
    assert len(said) == 1 and "furthest off: " in said[0], lines


def test_where_off_names_the_phases_furthest_off():
    from apps.demo import where_off
    def row(name, sim, meas):
        return {"name": name, "simulated_us": sim, "measured_us": meas, "error": (sim - meas) / meas if meas else None}

    compare = {"per_iteration": True, "iteration": row(None, 3000.0, 6000.0), "task_wait": None,
               "operators": [row("fc1", 1300.0, 200.0)],
               "phases": [row("fc1 forward", 300.0, 200.0), row("source", 900.0, 2000.0),
                          row("loss backward", 300.0, 600.0), row("attach", 0.0, 5.0), row("drop forward", 100.0, 110.0)]}
    assert where_off(compare, most=2) == ("searched, simulated against traced (median iteration): 3.00 ms against "
                                          "6.00 ms; furthest off: source 0.90 against 2.00 ms, loss backward 0.30 "
                                          "against 0.60 ms")
    compare["task_wait"] = row(None, 20.0, 61.4)
    assert "6.00 ms; a task's wait for its worker 20 against 61 us; furthest off: source" in where_off(compare)


def test_run_demo_calibrates_the_runtime_figures_first(tmp_path):
    from strategies.overheads import FIGURES, FIT_GRID
    lines = []
    out = run_demo(budget=8, iterations=3, out_dir=str(tmp_path), gpus=0, say=lines.append, calibrate_on="mlp")
    said = [line for line in lines if line.startswith("calibrated: ")]
    assert len(said) == 1 and "mean error" in said[0], lines
    mm = out["setup"].machine_model
    # (a figure the grid's largest value did not reach goes on past it: strategies.overheads.extended_fit)
    assert all(getattr(mm, k) in FIT_GRID[k] or getattr(mm, k) > max(FIT_GRID[k]) for k in FIGURES)
    assert out["search"].baselines["data"] * 1e3 == pytest.approx(out["rows"][1]["predicted_ms"])
    with pytest.raises(ValueError, match="calibration app 'lenet'"):
        run_demo(budget=8, iterations=3, out_dir=str(tmp_path), gpus=0, calibrate_on="lenet")


@pytest.mark.parametrize("flags, said", [(["--ranks", "0"], "argument --ranks: 0 must be >= 1"),
                                         (["--budget", "0"], "argument --budget: 0 must be >= 1"),
                                         (["--seed", "-1"], "argument --seed: -1 must be >= 0"),
                                         (["--iterations", "x"], "argument --iterations: 'x' is not an integer"),
                                         (["--iterations", "1"], "argument --iterations: 1 must be >= 2"),
                                         (["--out", "/proc/demo"], "--out /proc/demo: cannot be made"),
                                         (["--out", __file__], f"--out {__file__}: is a file, not a folder")])
def test_bad_numbers_are_refused_before_any_work(flags, said, capsys):
    from apps.demo import main
    with pytest.raises(SystemExit) as e:
        main(flags)
    assert e.value.code == 2 and said in capsys.readouterr().err


@pytest.mark.skipif(count_gpus() > 0, reason="where cupy sees GPUs the demo runs one GPU a rank, not a core")
def test_more_ranks_than_cores_is_refused_before_any_work(capsys):
    import os

    from apps.demo import main
    too_many = (os.cpu_count() or 1) + 1
    with pytest.raises(SystemExit) as e:
        main(["--ranks", str(too_many)])
    assert e.value.code == 2 and f"--ranks {too_many}: {too_many} ranks of one CPU worker each need" in \
        capsys.readouterr().err
