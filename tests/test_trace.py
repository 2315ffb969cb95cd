"""tools/trace: every command on traces made here by the runtime, the simulator and 2 MPI ranks."""
from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ops import SGD, Model
from ops.lower import TileConfig
from ops.strategy import Strategy, model_fingerprint
from strategies import data_parallel
from strategies.cost import CostModel
from strategies.machine_model import load_machine
from strategies.simulator import SimResult, Simulator
from taskrt import Runtime
from taskrt.tracing import rank_trace_path, read_trace
from tests.test_mpi import assert_every_rank_ok, run_mpi
from tools import trace as tt


def tiny(model: Model) -> Model:
    x = model.input((16, 32), name="x")
    model.softmax(model.dense(model.dense(x, 32, activation="relu", name="d1"), 4, name="d2"))
    return model


def tiny_run(path: str) -> str:
    """Three traced training iterations of `tiny` on two CPU workers with memories of their own,
    written to `path`."""
    rt = Runtime(cpus=2, separate_memories=True, trace=path)
    m = tiny(Model(runtime=rt, seed=0))
    m.compile(optimizer=SGD(lr=0.1), loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    m.fit(rng.normal(size=(64, 32)).astype(np.float32), rng.integers(0, 4, 64), iterations=3, verbose=False)
    m.close()
    rt.shutdown()
    return path


def tiny_simulation(strategy=data_parallel) -> SimResult:
    """`tiny`'s data parallelism (or another strategy) simulated on the local machine model (one
    node), as tiny_run runs it."""
    mm = load_machine("local", nodes=1)
    m = tiny(Model(Runtime(execute=False), weights=False))
    sim = Simulator.for_model(m, mm, CostModel(mm, measured=False))
    return sim.simulate(strategy(m, sim.machine))


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> str:
    return tiny_run(str(tmp_path_factory.mktemp("measured") / "run.jsonl"))


@pytest.fixture(scope="module")
def simulated(tmp_path_factory) -> str:
    return tiny_simulation().write_trace(str(tmp_path_factory.mktemp("sim") / "sim.jsonl"))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> str:
    base = tmp_path_factory.mktemp("mpi") / "run.jsonl"
    proc, _ = run_mpi(2, "traces.py", base)
    assert_every_rank_ok(proc, 2)
    return str(base)


def png_size(path) -> tuple[int, int]:
    data = open(path, "rb").read(24)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = tt.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---- load and merge ------------------------------------------------------------------------------
def test_load_and_phases(measured, simulated):
    t = tt.load(measured)
    assert not t.simulated and t.ranks == [0] and len(t.events) == read_trace(measured)[0]["events"]
    assert [e["start"] for e in t.events] == sorted(e["start"] for e in t.events)
    phases = {tt.phase(e) for e in t.events}
    assert {"forward", "backward", "update", "fill", "copy", "reduce"} <= phases
    s = tt.load(simulated)
    assert s.simulated and all("preds" in e for e in s.events)
    assert tt.phase({"kind": "task", "name": "d1.infer"}) == "inference"
    assert tt.phase({"kind": "task", "name": "lstm.bwd[3]"}) == "backward"  # a chunk of a split sequence


def test_merge_two_ranks_on_one_clock(two_ranks, tmp_path, capsys):
    rc, out, _ = run_cli(capsys, "merge", two_ranks, "-o", tmp_path / "merged.jsonl")
    assert rc == 0 and "ranks [0, 1]" in out
    per_rank = [read_trace(two_ranks.replace(".jsonl", f".rank{r}.jsonl"))[1] for r in range(2)]
    meta, events = read_trace(str(tmp_path / "merged.jsonl"))
    assert meta["ranks"] == [0, 1] and meta["events"] == len(events) == sum(map(len, per_rank))
    assert [e["start"] for e in events] == sorted(e["start"] for e in events)
    merged = tt.load(str(tmp_path / "merged.jsonl"))
    assert merged.ranks == [0, 1]
    # every receive ends after its send started: both ranks count from rank 0's origin
    sends = {e["id"]: e for e in merged.events if e["kind"] == "send"}
    assert sends and all(e["end"] >= sends[e["id"]]["start"] for e in merged.events if e["kind"] == "recv")
    with pytest.raises(tt.TraceError, match="rank 0 is also in"):
        tt.load([two_ranks.replace(".jsonl", ".rank0.jsonl"), str(tmp_path / "merged.jsonl")])


def test_the_ranks_of_two_runs_are_not_merged(two_ranks, tmp_path):
    """Every rank's meta names its run (when rank 0's trace began): rank files of two runs are refused."""
    files = [two_ranks.replace(".jsonl", f".rank{r}.jsonl") for r in range(2)]
    assert tt.load(files).meta["run"] == read_trace(files[0])[0]["run"]
    lines = open(files[1]).read().splitlines(keepends=True)
    meta = json.loads(lines[0])
    other = write(tmp_path, "other.rank1.jsonl", json.dumps({**meta, "run": meta["run"] + 12.5}) + "\n" + "".join(lines[1:]))
    with pytest.raises(tt.TraceError, match=f"{other}:1: of another run than {files[0]} \\(their runs began 12.500 s "
                                            f"apart\\)"):
        tt.load([files[0], other])
    bad = write(tmp_path, "bad.rank1.jsonl", json.dumps({**meta, "run": "yesterday"}) + "\n" + "".join(lines[1:]))
    with pytest.raises(tt.TraceError, match=f"{bad}:1: bad meta 'run': 'yesterday'"):
        tt.load(bad)


def test_a_base_path_stands_for_its_rank_files_or_their_merge(two_ranks, measured, tmp_path, capsys):
    """run.jsonl stands for run.rank0.jsonl, run.rank1.jsonl, ... where no file has its name, and is
    read itself where it is their merge, written after them; a run.jsonl left from another run
    beside them is refused rather than read in their place."""
    base = tmp_path / "run.jsonl"
    for r in range(2):
        shutil.copy(two_ranks.replace(".jsonl", f".rank{r}.jsonl"), tmp_path / f"run.rank{r}.jsonl")
    assert tt.load(base).meta["sources"] == [str(tmp_path / f"run.rank{r}.jsonl") for r in range(2)]
    rc, _, _ = run_cli(capsys, "merge", base, "-o", base)
    assert rc == 0 and tt.load(base).meta["sources"] == [str(base)]
    later = os.path.getmtime(base) + 10
    os.utime(tmp_path / "run.rank1.jsonl", (later, later))   # a new run's rank files
    with pytest.raises(tt.TraceError, match="both it and rank files .* exist, and it is not their merge"):
        tt.load(base)
    shutil.copy(measured, base)   # a one-rank run's trace of the same name
    rc, _, err = run_cli(capsys, "summary", base)
    assert rc == 2 and "name the files to read" in err
    # their merge, and then the merge of another run's files of the same names, both written after them
    rc, _, _ = run_cli(capsys, "merge", *[tmp_path / f"run.rank{r}.jsonl" for r in range(2)], "-o",
                       tmp_path / "merged.jsonl")
    lines = open(tmp_path / "merged.jsonl").read().splitlines(keepends=True)
    meta = json.loads(lines[0])
    for run, read in ((meta["run"], True), (meta["run"] + 60, False)):
        write(tmp_path, "run.jsonl", json.dumps({**meta, "run": run}) + "\n" + "".join(lines[1:]))
        os.utime(base, (later + 10, later + 10))
        if read:
            assert rc == 0 and tt.load(base).meta["sources"] == [str(base)]
        else:
            with pytest.raises(tt.TraceError, match="both it and rank files .* exist, and it is not their merge"):
                tt.load(base)


# ---- chrome --------------------------------------------------------------------------------------
def test_chrome_export_follows_the_format(two_ranks, simulated, tmp_path):
    t = tt.load(two_ranks)
    path = tt.write_chrome(t, str(tmp_path / "c.json"))
    doc = json.load(open(path))
    events = doc["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == len(t.events)
    for e in complete:
        assert {"name", "ph", "ts", "dur", "pid", "tid", "cat", "args"} <= set(e)
        assert isinstance(e["ts"], (int, float)) and e["dur"] >= 0
    # times stay microseconds: the first event's ts is the trace's own start
    assert min(e["ts"] for e in complete) == pytest.approx(t.start_us)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert sorted(names.values()) == sorted(tt.row_label(r) for r in t.rows())
    assert len(set(names)) == len(names) == len(t.rows())
    assert {e["args"]["name"] for e in events if e["name"] == "process_name"} == {"rank 0", "rank 1"}
    assert all((e["pid"], e["tid"]) in names for e in complete)

    s = tt.load(simulated)
    node = next(e for e in s.events if e["name"] == "d2.fwd")
    doc = json.load(open(tt.write_chrome(s, str(tmp_path / "s.json"), flows_for=node["id"])))
    labels = {e["name"] for e in doc["traceEvents"] if e["ph"] == "X"}
    assert {"d1 forward", "d2 backward", "d1 update"} <= labels
    # the model's hand-off before each task, on its track, ending where the task starts
    launches = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["name"] == "launch"]
    by_id = {e["id"]: e for e in s.events}
    assert len(launches) == sum(e["launch"] > 0 for e in s.events) > 0
    for e in launches:
        of = by_id[e["args"]["of"]]
        assert e["ts"] + e["dur"] == pytest.approx(of["start"]) and e["dur"] == of["launch"]
    assert not any(e["name"] == "launch" for e in events)   # a run's trace has none
    assert any(n.startswith("copy:") and n.endswith("B") for n in labels)
    starts = [e for e in doc["traceEvents"] if e["ph"] == "s"]
    ends = [e for e in doc["traceEvents"] if e["ph"] == "f"]
    assert len(starts) == len(ends) >= len(node["preds"])
    assert {e["id"] for e in starts} == {e["id"] for e in ends}
    assert sum(e["ts"] == node["start"] for e in ends) >= len(node["preds"])
    with pytest.raises(tt.TraceError, match="no event with id"):
        tt.write_chrome(s, str(tmp_path / "x.json"), flows_for=10**9)


# ---- images --------------------------------------------------------------------------------------
def test_timeline_png_size(measured, two_ranks, simulated, tmp_path, capsys):
    for source in (measured, two_ranks, simulated):
        t = tt.load(source)
        out = tmp_path / "t.png"
        rc, _, _ = run_cli(capsys, "timeline", source, "-o", out, "--title", "tiny")
        assert rc == 0
        assert png_size(out) == (1400, 160 + 18 * len(t.rows()))
        # a simulation's launches are drawn (and in the legend); a run has none
        assert ("launch" in tt._used_keys([t], tt._colors([t]))) == (source == simulated)


def test_images_are_written_as_png_files_only(measured, simulated, tmp_path, capsys):
    """A timeline asked for as x.pdf used to be a PNG named x.pdf."""
    for argv in (["timeline", measured, "-o", tmp_path / "x.pdf"], ["compare", simulated, measured, "-o", tmp_path / "c.svg"]):
        rc, _, err = run_cli(capsys, *argv)
        assert rc == 2 and "the tools write PNG images only: name the file .png" in err
    assert not list(tmp_path.iterdir())
    for output, said in (("", "is an empty path"), (tmp_path / "no" / "m.jsonl", "does not exist")):
        rc, _, err = run_cli(capsys, "merge", tmp_path / "not read.jsonl", "-o", output)   # (said after reading)
        assert rc == 2 and err.startswith(f"tools.trace: -o {output}: ") and said in err, err


def test_timeline_of_64_processors(tmp_path):
    events = [{"id": i, "name": f"op{i % 7}.fwd", "kind": "task", "op": f"op{i % 7}", "rank": i // 512,
               "proc": f"r{i // 512}.cpu{(i // 8) % 64}", "start": float(i % 8) * 10, "end": float(i % 8) * 10 + 9,
               "bytes": 0, "point": None} for i in range(1024)]
    t = tt.Trace(events)
    assert len(t.rows()) == 128
    assert png_size(tt.write_timeline(t, str(tmp_path / "big.png"))) == (1400, 160 + 18 * 128)


def test_a_timeline_draws_its_busiest_tracks_and_says_how_many_it_left_out(tmp_path):
    """A simulation on 1,024 devices has 20,000-110,000 tracks: its image was 100,000 pixels
    tall, or not made in minutes."""
    events = [{"id": i, "name": "op.fwd", "kind": "task", "op": "op", "rank": 0, "proc": f"r0.cpu{i}",
               "start": 5.0 + i, "end": 5.0 + 2 * i + 1, "bytes": 0, "point": None} for i in range(300)]
    t = tt.Trace(events)
    kept, said = tt.busiest_rows(t, 200)
    assert said == " (the 200 busiest of 300 tracks)" and len(kept.rows()) == 200
    assert {e["proc"] for e in kept.events} == {f"r0.cpu{i}" for i in range(100, 300)}
    assert tt.busiest_rows(kept, 200) == (kept, "")
    assert png_size(tt.write_timeline(t, str(tmp_path / "many.png"))) == (1400, 160 + 18 * tt.MOST_ROWS)


def test_compare(simulated, measured, tmp_path, capsys):
    result = tt.write_compare(tt.load(simulated), tt.load(measured), str(tmp_path / "cmp.png"))
    s, m = tt.load(simulated), tt.load(measured)
    assert png_size(tmp_path / "cmp.png") == (1400, 2 * 160 + 18 * (len(s.rows()) + len(m.rows())))
    # Model.fit from arrays has no batch source: its first forward task marks the iterations
    assert tt.cut_iterations(s, m).marker == {0: "d1.fwd"}
    assert result["per_iteration"] and result["iterations"] == 3 and result["skipped"] == 1
    assert result["tiles_differ"] == []
    ops = {r["name"]: r for r in result["operators"]}
    assert {"d1", "d2", "loss"} <= set(ops) and ops["d1"]["simulated_us"] > 0 and ops["d1"]["measured_us"] > 0
    d1 = ops["d1"]
    assert d1["error"] == pytest.approx((d1["simulated_us"] - d1["measured_us"]) / d1["measured_us"])
    assert {r["name"] for r in result["processors"]} == {"r0.cpu0", "r0.cpu1"}
    phases = {r["name"]: r for r in result["phases"]}
    assert {"d1 forward", "d1 backward", "d1 update"} <= set(phases)
    assert sum(r["simulated_us"] for name, r in phases.items() if name.startswith("d1 ")) == pytest.approx(
        d1["simulated_us"])
    assert result["iteration"]["simulated_us"] == pytest.approx(s.span_us)
    # the hand-off: the model's launch (one rank: no message handling) against the run's waits
    wait = result["task_wait"]
    assert wait["simulated_us"] == pytest.approx(load_machine("local", nodes=1).launch_overhead * 1e6)
    assert wait["measured_us"] == pytest.approx(tt.waits(m, skip=1)["wait_us"]["mean"]) and wait["measured_us"] > 0
    rc, out, _ = run_cli(capsys, "compare", simulated, measured, "-o", tmp_path / "c2.png")
    assert rc == 0 and "iteration time" in out and "r0.cpu1" in out and "the first 1 left out" in out
    assert f"a task's wait for its idle processor (mean) {wait['simulated_us']:.1f} us vs" in out
    rc, out, _ = run_cli(capsys, "compare", simulated, measured, "-o", tmp_path / "c3.png", "--json", "--skip", "0")
    assert json.loads(out)["iterations"] == 3 and json.loads(out)["skipped"] == 0
    rc, out, err = run_cli(capsys, "compare", simulated, measured, "-o", tmp_path / "c4.png", "--skip", "3")
    assert rc == 2 and out == "" and "cannot leave out 3 iteration(s): the measured run has 3" in err
    with pytest.raises(SystemExit):
        tt.main(["compare", simulated, measured, "-o", str(tmp_path / "c5.png"), "--skip", "-1"])
    assert "'-1' is not a whole number >= 0" in capsys.readouterr().err


def _task(i: int, name: str, rank: int, start: float, dur: float) -> dict:
    return {"id": i, "name": name, "kind": "task", "op": name.split(".")[0], "rank": rank, "proc": f"r{rank}.cpu0",
            "start": start, "end": start + dur, "bytes": 0, "point": [rank]}


def _synthetic_run(durations: list[list[list[float]]], gap: float) -> tuple[tt.Trace, tt.Trace]:
    """(a simulated iteration, a measured run) of `source`, `a.fwd` and `b.fwd` on each rank, one
    after another; durations[k][r] = those three tasks' durations in iteration k on rank r. The
    run starts with an `attach` before its first source, and ranks wait `gap` between iterations."""
    names = ("source", "a.fwd", "b.fwd")
    sim = [_task(3 * r + j, names[j], r, 10.0 * j, 10.0) for r in range(len(durations[0])) for j in range(3)]
    events, clock = [], {r: 50.0 for r in range(len(durations[0]))}
    for r in clock:
        events.append(_task(len(events), "attach", r, 0.0, 20.0))
    for per_rank in durations:
        for r, durs in enumerate(per_rank):
            for name, d in zip(names, durs):
                events.append(_task(len(events), name, r, clock[r], d))
                clock[r] += d
            clock[r] += gap
    return tt.Trace(sim, {"simulated": True}), tt.Trace(sorted(events, key=lambda e: e["start"]))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 2).flatmap(lambda ranks: st.lists(
           st.lists(st.lists(st.floats(1.0, 1000.0), min_size=3, max_size=3), min_size=ranks, max_size=ranks),
           min_size=2, max_size=7)),
       st.floats(0.0, 50.0), st.integers(0, 1))
def test_compare_takes_medians_over_the_iterations_after_the_skipped(durations, gap, skip):
    sim, run = _synthetic_run(durations, gap)
    c = tt.compare(sim, run, skip)
    kept = durations[skip:]
    assert c["per_iteration"] and c["iterations"] == len(durations) and c["skipped"] == skip
    ops = {r["name"]: r["measured_us"] for r in c["operators"]}
    for j, op in enumerate(("source", "a", "b")):
        assert ops[op] == pytest.approx(np.median([sum(rank[j] for rank in it) for it in kept]))
    assert "attach" not in ops or ops["attach"] == 0.0   # before the first iteration
    # an iteration's time: from when the last rank began it to when the last rank began the next
    # (the last: to the run's end)
    begun = [50.0 + max(sum(sum(it[r]) + gap for it in durations[:k]) for r in range(len(durations[0])))
             for k in range(len(durations))]
    end = max(50.0 + sum(sum(it[r]) + gap for it in durations) - gap for r in range(len(durations[0])))
    times = [b - a for a, b in zip(begun, begun[1:] + [end])]
    assert c["iteration"]["measured_us"] == pytest.approx(np.median(times[skip:]))
    assert c["iteration"]["measured_max_us"] == pytest.approx(max(times[skip:]))
    assert c["iteration"]["measured_each_us"] == pytest.approx(times[skip:])
    assert c["task_time"]["measured_us"] == pytest.approx(np.median([sum(map(sum, it)) for it in kept]))
    # the iteration the picture draws: the run's (not the kept ones') index of the one nearest the median
    kept_times = c["iteration"]["measured_each_us"]   # (as compared above; ties between two go to the first)
    nearest = min(range(len(kept_times)), key=lambda i: (abs(kept_times[i] - np.median(kept_times)), i))
    assert c["median_iteration"] == skip + nearest


def test_compare_a_run_it_cannot_cut_is_averaged():
    sim, run = _synthetic_run([[[5.0, 1.0, 1.0]], [[5.0, 1.0, 1.0]]], 0.0)
    run.events.append(_task(99, "source", 0, 1000.0, 5.0))   # a third source with no iteration after it
    sim.events.append(_task(9, "source", 0, 0.0, 1.0))       # two sources an iteration: 3 is no multiple
    c = tt.compare(sim, run)
    assert not c["per_iteration"] and "rank 0 ran 3 'source' tasks, not a multiple of the 2" in c["why"]
    assert "not cut into iterations (rank 0 ran 3" in tt.format_compare(c)
    assert {r["name"]: r["measured_us"] for r in c["phases"]} == {   # over 2 iterations
        "attach": 10.0, "source": 7.5, "a forward": 1.0, "b forward": 1.0}
    assert c["task_wait"] is None   # no preds in these traces: when a task could start is unknown


def test_compare_says_where_the_two_ran_other_strategies(measured, tmp_path, capsys):
    """The run's tiny model ran data parallel on two workers; a simulation of it with each op on
    one device compared as if it were the same run, op for op."""
    def one_device(model, machine):
        return Strategy(model_fingerprint(model.ops), {op.name: TileConfig((1,) * len(op.tile_shape), (0,))
                                                       for op in model.ops})
    simulated = tiny_simulation(one_device).write_trace(str(tmp_path / "one.jsonl"))
    result = tt.compare(tt.load(simulated), tt.load(measured))
    assert {r["name"]: (r["simulated"], r["measured"]) for r in result["tiles_differ"]} == {
        f"{op} {ph}": (1, 2) for op in ("d1", "d2", "softmax_0") for ph in ("forward", "backward")} | {
        "d1 update": (1, 2)}   # (d1's weight in one shard, not two: d2's has one either way)
    rc, out, _ = run_cli(capsys, "compare", simulated, measured, "-o", tmp_path / "c.png")
    assert rc == 0 and "the two ran other strategies, it seems: 7 operator phase(s) have other tiles " \
                       "(d1 backward: 1 simulated, 2 measured)" in out
    def across(model, machine):   # as many tiles, along another dim: (0, 0, 0) and (0, 1, 0), not (1, 0, 0)
        return Strategy(model_fingerprint(model.ops), {"d1": TileConfig((1, 2, 1), (0, 1))})
    other = tt.compare(tt.load(tiny_simulation(across).write_trace(str(tmp_path / "across.jsonl"))),
                       tt.load(measured))
    assert {"d1 forward", "d1 backward"} <= {r["name"] for r in other["tiles_differ"]}
    assert all(r["simulated"] == r["measured"] == 2 for r in other["tiles_differ"] if r["name"].startswith("d1 f"))


def test_compare_refuses_traces_of_different_models():
    """A simulation of one model against a run of another (the mlp's against alexnet's) used to
    print a table of operators that were 100% off on one side or the other."""
    sim, run = _synthetic_run([[[5.0, 1.0, 1.0]], [[5.0, 1.0, 1.0]]], 0.0)
    for e in run.events:
        if e["op"] in ("a", "b"):
            e["op"] = "other_" + e["op"]
    with pytest.raises(tt.TraceError, match=r"different models: 2 of the simulated trace's 3 operators are not in "
                                            r"the measured run \(a, b\)"):
        tt.compare(sim, run)
    run.events[-1]["op"] = "b"   # one of three missing: the same model under another strategy, say
    assert tt.compare(sim, run)["per_iteration"]


def test_compare_refuses_a_run_of_fewer_ranks_than_the_simulation():
    """Rank 0's file alone (run.rank0.jsonl for run.jsonl) used to be compared with a 2-rank
    simulation: rank 1's processors at 0 ms measured, the task time 22% off instead of 65%."""
    sim, run = _synthetic_run([[[5.0, 1.0, 1.0], [5.0, 1.0, 1.0]]] * 2, 0.0)
    one = tt.Trace([e for e in run.events if e["rank"] == 0])
    with pytest.raises(tt.TraceError, match=r"the simulation has ranks \[0, 1\], the measured run \[0\]: give every "
                                            r"rank's file"):
        tt.compare(sim, one)
    assert tt.compare(sim, run)["per_iteration"]


# ---- summary and critical path -------------------------------------------------------------------
def test_summary(measured, two_ranks, capsys):
    t = tt.load(measured)
    s = tt.summary(t)
    rows = {r["proc"]: r for r in s["rows"]}
    cpu0 = rows["r0.cpu0"]
    tasks = [e for e in t.events if e["proc"] == "r0.cpu0"]
    assert cpu0["busy_us"] == pytest.approx(sum(e["end"] - e["start"] for e in tasks))
    assert cpu0["idle_us"] == pytest.approx(s["span_us"] - cpu0["busy_us"], abs=1e-3)
    assert 0 < cpu0["utilization"] <= 1 and cpu0["copy_us"] == 0
    link = next(r for r in s["rows"] if r["link"])
    assert link["copy_us"] > 0 and link["busy_us"] == 0
    assert s["operators"][0]["time_us"] >= s["operators"][-1]["time_us"]
    assert sum(o["share"] for o in tt.summary(t, top=100)["operators"]) == pytest.approx(1.0)
    rc, out, _ = run_cli(capsys, "summary", measured)
    assert rc == 0 and "r0.cpu0" in out and "d1" in out and "rank" in out
    rc, out, _ = run_cli(capsys, "summary", two_ranks, "--json")
    assert rc == 0 and set(json.loads(out)["ranks"]) == {"0", "1"}


def test_utilization_counts_a_span_nested_in_another_once_and_not_as_the_end():
    """A link carries copies side by side, so a short copy can lie inside a long one: the busy
    union of (0, 10) and (2, 3) is 10 us (taking the inner end as the union's end made it 3,
    and the link look idle for most of a copy)."""
    assert tt._union_us([(0.0, 10.0), (2.0, 3.0)]) == 10.0
    assert tt._union_us([(0.0, 10.0), (2.0, 3.0), (4.0, 12.0), (20.0, 25.0)]) == 17.0
    link = "r0.sys0->r1.sys0"
    events = [_task(0, "a.fwd", 0, 0.0, 20.0), _message(1, "send", "copy:x", link, 0.0, 20.0),
              _message(2, "send", "copy:y", link, 5.0, 8.0)]
    rows = {r["proc"]: r for r in tt.summary(tt.Trace(events))["rows"]}
    assert rows[link]["utilization"] == 1.0 and rows[link]["idle_us"] == 0.0
    assert rows[link]["copy_us"] == 23.0   # each copy in full


def test_a_ranks_copy_time_is_the_sum_of_its_copies():
    """The per-rank totals add each of the rank's tracks' copy time: rank 0 sends 5 + 7 us on one
    link and 4 us on another, rank 1 receives nothing but sends 2 us (a row left out of the
    total used to leave a rank's copy_us at 0)."""
    events = sorted([_task(0, "a.fwd", 0, 0.0, 30.0), _task(1, "b.fwd", 1, 0.0, 30.0),
                     _message(2, "send", "copy:x", "r0.sys0->r1.sys0", 0.0, 5.0),
                     _message(3, "send", "copy:y", "r0.sys0->r1.sys0", 10.0, 17.0),
                     _message(4, "send", "copy:z", "r0.sys0->r2.sys0", 1.0, 5.0),
                     _message(5, "send", "copy:w", "r1.sys0->r0.sys0", 3.0, 5.0)], key=lambda e: e["start"])
    ranks = tt.summary(tt.Trace(events))["ranks"]
    assert ranks["0"]["copy_us"] == 16.0 and ranks["0"]["busy_us"] == 30.0
    assert ranks["1"]["copy_us"] == 2.0 and ranks["1"]["events"] == 2


def test_the_critical_path_of_a_trace_without_preds_ends_where_events_take_no_time():
    """Guessed from timing alone, two events of no length at one time each waited on the other,
    and the walk back went round them for ever."""
    events = [_task(0, "a", 0, 0.0, 10.0), _task(1, "z1", 0, 10.0, 0.0), _task(2, "z2", 0, 10.0, 0.0),
              _task(3, "b", 0, 10.0, 10.0)]
    for e, proc in zip(events, range(4)):
        e["proc"] = f"r0.cpu{proc}"
    path = tt.critical_path(tt.Trace(events))
    assert [p["name"] for p in path] == ["a", "z1", "z2", "b"]
    assert sum(p["duration_us"] for p in path) == pytest.approx(20.0)


def test_the_critical_path_goes_through_a_message_to_its_sender():
    """A receipt is posted before its sender's task ends and waits inside its event: the walk
    back dropped every pred of it (they end after its start) and stopped on rank 1, the wait
    counted as the receipt's work; and messages on one link were chained to each other."""
    def event(i, name, kind, rank, proc, start, end, preds):
        return {"id": i, "name": name, "kind": kind, "op": name.split(".")[0], "rank": rank, "proc": proc,
                "start": start, "end": end, "bytes": 64, "point": None, "preds": preds}
    link = "r0.sys0->r1.sys0"
    events = [event(1, "a.fwd", "task", 0, "r0.cpu0", 0.0, 100.0, []),
              event(2, "copy:x", "send", 0, link, 100.0, 105.0, [1]),
              event(2, "copy:x", "recv", 1, link, 10.0, 120.0, [1]),
              event(4, "copy:y", "send", 0, link, 101.0, 130.0, []),
              event(3, "b.fwd", "task", 1, "r1.cpu0", 125.0, 200.0, [2])]
    path = tt.critical_path(tt.Trace(sorted(events, key=lambda e: e["start"])))
    assert [(p["name"], p["kind"]) for p in path] == [("a.fwd", "task"), ("copy:x", "send"), ("copy:x", "recv"),
                                                      ("b.fwd", "task")]
    assert [p["duration_us"] for p in path] == pytest.approx([100.0, 5.0, 15.0, 75.0])


def test_critical_path_of_the_simulation_sets_its_time(simulated, measured, capsys):
    s = tt.load(simulated)
    path = tt.critical_path(s)
    assert path[-1]["end_us"] == pytest.approx(s.end_us)
    assert all(a["end_us"] <= b["start_us"] + tt.EPS_US for a, b in zip(path, path[1:]))
    # the simulator starts each node when its last pred or its track frees: no waits on the chain
    # but each node's launch, the runtime's hand-off that its event starts after
    by_id = {e["id"]: e for e in s.events}
    assert [p["wait_us"] for p in path] == pytest.approx([by_id[p["id"]]["launch"] for p in path], abs=0.01)
    launch = load_machine("local", nodes=1).launch_overhead * 1e6
    assert [by_id[p["id"]]["launch"] for p in path if p["kind"] == "task"] == pytest.approx(
        [launch] * sum(p["kind"] == "task" for p in path))
    assert sum(p["duration_us"] + p["wait_us"] for p in path) == pytest.approx(s.span_us, rel=1e-3)
    assert sum(p["share"] for p in path) < 1
    for a, b in zip(path, path[1:]):
        e = by_id[b["id"]]
        assert a["id"] in e["preds"] or a["proc"] == b["proc"]
    m = tt.load(measured)
    mpath = tt.critical_path(m)
    assert mpath[-1]["end_us"] == m.end_us and 0 < sum(p["share"] for p in mpath) <= 1
    rc, out, _ = run_cli(capsys, "critical-path", simulated)
    assert rc == 0 and "critical path" in out and "d1.fwd" in out
    rc, out, _ = run_cli(capsys, "critical-path", measured, "--json")
    assert len(json.loads(out)) == len(mpath)


def _message(i: int, kind: str, name: str, link: str, start: float, end: float, nbytes: int = 64) -> dict:
    src, dst = (int(end_[1]) for end_ in link.split("->"))
    return {"id": i, "name": name, "kind": kind, "op": "", "rank": src if kind == "send" else dst, "proc": link,
            "start": start, "end": end, "bytes": nbytes, "point": None}


def test_messages_pair_each_send_with_its_receipt_in_order(two_ranks, measured, simulated, capsys):
    there, back = "r0.sys0->r1.sys0", "r1.sys0->r0.sys0"
    events = [_message(0, "recv", "copy:x", there, -50.0, 30.0), _message(1, "send", "copy:x", there, 0.0, 5.0),
              _message(2, "recv", "copy:x", there, 10.0, 180.0), _message(3, "send", "copy:x", there, 100.0, 104.0),
              _message(4, "send", "copy:y", back, 200.0, 201.0), _message(5, "recv", "copy:y", back, 150.0, 260.0),
              _message(6, "send", "copy:y", back, 300.0, 301.0), _task(7, "a.fwd", 0, 0.0, 1.0)]
    m = tt.messages(tt.Trace(sorted(events, key=lambda e: e["start"])))
    assert m["messages"] == 3 and m["unpaired"] == 1
    assert m["links"][there] == {"messages": 2, "flight_us": {"p10": 30.0, "median": 55.0, "p90": 80.0, "mean": 55.0}}
    assert m["links"][back]["messages"] == 1 and m["links"][back]["flight_us"]["median"] == 60.0
    assert m["flight_us"]["mean"] == pytest.approx(170 / 3) and m["median_bytes"] == 64
    real = tt.messages(tt.load(two_ranks))
    assert real["messages"] > 0 and real["flight_us"]["median"] > 0
    rc, out, _ = run_cli(capsys, "messages", two_ranks)
    assert rc == 0 and "r0.sys0->r1.sys0" in out and "median" in out
    for one_sided in (measured, simulated):
        rc, _, err = run_cli(capsys, "messages", one_sided)
        assert rc == 2 and "no messages between ranks" in err
    rc, _, err = run_cli(capsys, "messages", rank_trace_path(two_ranks, 0))
    assert rc == 2 and "give every rank's file" in err


def test_messages_by_the_receivers_quiet_time(two_ranks, capsys):
    """Each flight goes by how long the receiving rank had been without a receipt when the message
    was sent (its progress thread's naps grow meanwhile): first, quiet 70 us, quiet 820 us,
    and a receive posted after its send."""
    there = "r0.sys0->r1.sys0"
    events = [_message(0, "recv", "copy:x", there, -50.0, 30.0), _message(1, "send", "copy:x", there, 0.0, 5.0),
              _message(2, "recv", "copy:x", there, 10.0, 180.0), _message(3, "send", "copy:x", there, 100.0, 104.0),
              _message(4, "recv", "copy:z", there, 900.0, 1400.0), _message(5, "send", "copy:z", there, 1000.0, 1001.0),
              _message(6, "send", "copy:w", there, 2000.0, 2001.0), _message(7, "recv", "copy:w", there, 2100.0, 2300.0)]
    m = tt.messages(tt.Trace(sorted(events, key=lambda e: e["start"])))
    by = m["by_quiet"]
    assert list(by) == ["0-100", "700-1500", "first", "posted after"]
    assert [(v["messages"], v["flight_us"]["median"]) for v in by.values()] == [(1, 80.0), (1, 400.0), (1, 30.0),
                                                                               (1, 300.0)]
    assert sum(v["messages"] for v in tt.messages(tt.load(two_ranks))["by_quiet"].values()) == \
        tt.messages(tt.load(two_ranks))["messages"]
    rc, out, _ = run_cli(capsys, "messages", two_ranks)
    assert rc == 0 and "by the receiving rank's quiet time" in out


def test_messages_by_their_size(two_ranks, capsys):
    """Each flight goes by its message's bytes: under 4 KiB, 4-64 KiB (4 KiB itself), 64 KiB-1 MiB
    (none here: left out), 1-16 MiB and more."""
    there = "r0.sys0->r1.sys0"
    sizes_flights = [(100, 30.0), (4096, 50.0), (60_000, 70.0), (2 << 20, 400.0), (20 << 20, 900.0), (300, 10.0)]
    events = []
    for k, (nbytes, flight) in enumerate(sizes_flights):
        name = f"copy:m{k}"
        events += [_message(2 * k, "recv", name, there, 1000.0 * k - 5.0, 1000.0 * k + flight, nbytes),
                   _message(2 * k + 1, "send", name, there, 1000.0 * k, 1000.0 * k + 1.0, nbytes)]
    by = tt.messages(tt.Trace(sorted(events, key=lambda e: e["start"])))["by_size"]
    assert list(by) == ["0-4 KiB", "4-64 KiB", "1-16 MiB", "16 MiB+"]
    assert [(v["messages"], v["flight_us"]["median"]) for v in by.values()] == [(2, 20.0), (2, 60.0), (1, 400.0),
                                                                              (1, 900.0)]
    real = tt.messages(tt.load(two_ranks))
    assert sum(v["messages"] for v in real["by_size"].values()) == real["messages"]
    rc, out, _ = run_cli(capsys, "messages", two_ranks)
    assert rc == 0 and "by the message's size" in out


def _with_preds(event: dict, *preds: int) -> dict:
    return {**event, "preds": list(preds)}


def test_waits_count_tasks_that_found_their_processor_idle(measured, simulated, two_ranks, capsys):
    """b waits 40 us on an idle cpu0 after a; c, ready as early, queues behind b (left out); d's
    pred is not in the trace (left out); e waits 5 us on cpu1; f's pred is another rank's node
    (left out). In a run no task starts before its pred ends; in a simulation a task's wait is
    its launch (the model's launch_overhead, before its event), but where a processor handled a
    message."""
    events = [_task(0, "a.fwd", 0, 0.0, 10.0), _with_preds(_task(1, "b.fwd", 0, 50.0, 20.0), 0),
              _with_preds(_task(2, "c.fwd", 0, 70.0, 5.0), 0), _with_preds(_task(3, "d.fwd", 0, 90.0, 5.0), 99),
              _with_preds({**_task(4, "e.fwd", 0, 15.0, 1.0), "proc": "r0.cpu1"}, 0),
              _with_preds(_task(5, "f.fwd", 1, 30.0, 1.0), 0)]
    w = tt.waits(tt.Trace(sorted(events, key=lambda e: e["start"])), top=1)
    assert w["tasks"] == 6 and w["counted"] == 2
    assert w["processors"] == {"r0.cpu0": {"tasks": 1, "wait_us": {"p10": 40.0, "median": 40.0, "p90": 40.0,
                                                                   "mean": 40.0}},
                               "r0.cpu1": {"tasks": 1, "wait_us": {"p10": 5.0, "median": 5.0, "p90": 5.0, "mean": 5.0}}}
    assert [(r["name"], r["wait_us"]) for r in w["longest"]] == [("b.fwd", 40.0)]
    again = events + [_with_preds(_task(6, "b.fwd", 0, 200.0, 1.0), 3)]   # b's second run waits 105 us for d
    w = tt.waits(tt.Trace(sorted(again, key=lambda e: e["start"])), skip=1)
    assert w["tasks"] == 7 and w["counted"] == 1 and w["longest"][0]["wait_us"] == 105.0
    run = tt.waits(tt.load(measured), top=10 ** 6)   # every counted task among the longest
    assert len(run["longest"]) == run["counted"] > 0 and min(r["wait_us"] for r in run["longest"]) >= 0
    sim = tt.waits(tt.load(simulated))
    launch = load_machine("local", nodes=1).launch_overhead * 1e6
    assert sim["counted"] > 0 and sim["wait_us"]["median"] == pytest.approx(launch)
    rc, out, _ = run_cli(capsys, "waits", two_ranks, "--top", "3", "--skip", "1")
    assert rc == 0 and "idle processor" in out and "r1.cpu0" in out
    assert len(out.split("the longest:")[1].strip().splitlines()) == 3
    with pytest.raises(tt.TraceError, match="names its preds"):
        tt.waits(tt.Trace([_task(0, "a.fwd", 0, 0.0, 1.0)]))
    with pytest.raises(tt.TraceError, match="no task started on an idle processor"):
        tt.waits(tt.Trace([_with_preds(_task(0, "a.fwd", 0, 0.0, 1.0), 7)]))
    with pytest.raises(tt.TraceError, match="first 1 runs left out"):
        tt.waits(tt.Trace(sorted(events, key=lambda e: e["start"])), skip=1)


# ---- bad input -----------------------------------------------------------------------------------
def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_bad_traces_give_one_line_and_a_nonzero_exit(measured, tmp_path, capsys):
    lines = open(measured).read().splitlines(keepends=True)
    cut_mid = write(tmp_path, "cut.jsonl", "".join(lines[:5]) + lines[5][:20])
    cut_line = write(tmp_path, "short.jsonl", "".join(lines[:5]))
    cases = {
        write(tmp_path, "empty.jsonl", ""): ":1: empty file",
        write(tmp_path, "meta.jsonl", lines[0]): ":2: no events",
        cut_mid: ":6: truncated",
        cut_line: "truncated: the meta line says",
        write(tmp_path, "csv.jsonl", "proc,start,end\nr0.cpu0,1,2\n"): ":1: not JSON",
        write(tmp_path, "deep.jsonl", "[" * 100_000 + "]" * 100_000 + "\n"): ":1: not a taskrt trace: JSON nested",
        write(tmp_path, "metarank.jsonl", lines[0].replace('"rank": 0', '"rank": "0"', 1) + lines[1]):
            ":1: bad meta 'rank': '0'",
        write(tmp_path, "other.jsonl", '{"traceEvents": []}\n'): ":1: not a taskrt trace",
        write(tmp_path, "keys.jsonl", lines[0] + '{"id": 1, "name": "x"}\n'): ":2: not a taskrt event",
        write(tmp_path, "times.jsonl", lines[0] + lines[1].replace('"end": ', '"end": -')): ":2: bad times",
        str(tmp_path / "missing.jsonl"): "cannot read",
    }
    # fields of the wrong type used to reach the commands (a TypeError deep in summary)
    event = json.loads(lines[1])
    for i, (key, value) in enumerate([("proc", 5), ("name", None), ("bytes", "abc"), ("rank", "0"), ("preds", None),
                                      ("id", 1.5), ("kind", ""), ("kind", "frob"), ("point", ["a"]), ("start", float("nan"))]):
        bad = json.dumps({**event, key: value})
        cases[write(tmp_path, f"field{i}.jsonl", lines[0] + bad + "\n")] = \
            ":2: bad times" if key == "start" else f":2: bad '{key}'"
    with open(tmp_path / "binary.jsonl", "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n\xff\xfe")
    cases[str(tmp_path / "binary.jsonl")] = "is not UTF-8 text"
    for path, message in cases.items():
        with pytest.raises(tt.TraceError, match=message) as info:
            tt.load(path)
        assert path in str(info.value) and "\n" not in str(info.value)
        for command in (["summary"], ["critical-path"], ["timeline", "-o", tmp_path / "x.png"],
                        ["chrome", "-o", tmp_path / "x.json"], ["merge", "-o", tmp_path / "x.jsonl"]):
            rc, out, err = run_cli(capsys, command[0], path, *command[1:])
            assert rc == 2 and out == "" and err.count("\n") == 1 and path in err and message.strip(":") in err
        rc, _, err = run_cli(capsys, "compare", path, measured, "-o", tmp_path / "x.png")
        assert rc == 2 and path in err
    with pytest.raises(tt.TraceError, match="simulated trace with a measured"):
        sim_meta = json.dumps({"kind": "meta", "rank": 1, "simulated": True, "events": 1})
        tt.load([measured, write(tmp_path, "sim1.jsonl", sim_meta + "\n" + lines[1].replace('"rank": 0', '"rank": 1'))])


def test_compare_wants_the_simulation_first(simulated, measured, tmp_path, capsys):
    """The two traces swapped used to be compared, with a 7377% iteration error."""
    for args, which in (((measured, simulated), "the first trace is a measured run"),
                        ((simulated, simulated), "the second trace is a simulation")):
        with pytest.raises(tt.TraceError, match=which):
            tt.compare(*map(tt.load, args))
        rc, _, err = run_cli(capsys, "compare", *args, "-o", tmp_path / "x.png")
        assert rc == 2 and which in err


@pytest.mark.parametrize("top", ["0", "-3", "x"])
def test_summary_top_is_a_count_of_at_least_one(measured, top, capsys):
    with pytest.raises(SystemExit) as e:
        tt.main(["summary", measured, "--top", top])
    assert e.value.code == 2 and "--top" in capsys.readouterr().err


def test_trace_summary_alias(measured, capsys):
    from tools import trace_summary

    assert trace_summary.main([measured]) == 0
    assert "r0.cpu0" in capsys.readouterr().out
    s = trace_summary.summarize(read_trace(measured)[1])
    assert set(s["by_proc"]) >= {"r0.cpu0", "r0.cpu1"} and "r0.cpu0" in trace_summary.format_summary(s)


def test_quantiles_are_the_nearest_ranks():
    """p10 and p90 of 0..20 are 2 and 18 (nearest ranks), the median 10 and the mean 10."""
    assert tt._quantiles([float(v) for v in range(20, -1, -1)]) == {"p10": 2.0, "median": 10.0, "p90": 18.0,
                                                                   "mean": 10.0}


def test_a_trace_says_its_clock_offset(tmp_path):
    """What a rank's clock was moved by to match rank 0's (the merge reads the events as moved)."""
    from taskrt.tracing import TraceRecorder
    path = tmp_path / "t.jsonl"
    TraceRecorder(rank=1, clock_offset=5.0).write(str(path))
    meta, _ = read_trace(str(path))
    assert meta["clock_offset_us"] == 5.0 and meta["rank"] == 1
