"""The runtime on 2 and 4 MPI ranks: each test launches a program of tests/mpi_programs/
with mpiexec and checks that every rank ran it (exit status, an "OK rank R" line per rank),
or, for the failure and divergence programs, that every rank stopped with the right
message within a time bound.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = Path(__file__).resolve().parent / "mpi_programs"
#: a rank that fails must take every rank down within this many seconds (mpiexec start included)
FAILURE_BOUND_S = 30


def _mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError(f"no mpiexec next to {sys.executable} or on PATH: pip install mpich mpi4py")
    return found


def python_path() -> str:
    """The repository first, then whatever PYTHONPATH the test run had."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


def run_mpi(n: int, program, *args, timeout: float = 60, env: dict | None = None):
    """Run tests/mpi_programs/<program> (or the script at an absolute path) on n ranks;
    (CompletedProcess, seconds)."""
    full_env = {**os.environ, "TASKRT_MPI_TIMEOUT": "20", "PYTHONPATH": python_path(), **(env or {})}
    cmd = [_mpiexec(), "-n", str(n), sys.executable, str(PROGRAMS / program), *map(str, args)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT,
                          stdin=subprocess.DEVNULL)
    return proc, time.monotonic() - t0


def output(proc) -> str:
    return f"--- exit status {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


def assert_every_rank_ok(proc, n: int) -> None:
    assert proc.returncode == 0, output(proc)
    # ranks' lines may interleave in mpiexec's output, so look for each rank's mark anywhere
    ranks = {int(r) for r in re.findall(r"OK rank (\d+)", proc.stdout)}
    assert ranks == set(range(n)), f"ranks that printed OK: {sorted(ranks)}\n{output(proc)}"


def assert_stopped(proc, seconds: float) -> None:
    assert proc.returncode != 0, output(proc)
    assert "SHOULD NOT GET HERE" not in proc.stdout, output(proc)
    assert seconds < FAILURE_BOUND_S, f"took {seconds:.1f} s to stop\n{output(proc)}"


# ---- programs that must run on every rank ----------------------------------------------------
@pytest.mark.parametrize("n,examples", [(2, 30), (4, 20)])
def test_random_programs_match_sequential_on_every_rank(n, examples):
    proc, _ = run_mpi(n, "random_programs.py", examples, timeout=120)
    assert_every_rank_ok(proc, n)


@pytest.mark.parametrize("n", [2, 4])
def test_ordering_reductions_reads_halos_and_replay_across_ranks(n):
    proc, _ = run_mpi(n, "regions.py")
    assert_every_rank_ok(proc, n)


@pytest.mark.parametrize("n", [2, 4])
def test_futures_of_tasks_on_other_ranks(n):
    proc, _ = run_mpi(n, "futures.py")
    assert_every_rank_ok(proc, n)


@pytest.mark.parametrize("n", [2, 4])
def test_a_model_split_across_ranks_trains_like_one_process(n):
    proc, _ = run_mpi(n, "model.py", timeout=120)
    assert_every_rank_ok(proc, n)


@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_waiting_for_a_busy_peer_does_not_spin(n):
    proc, _ = run_mpi(n, "waiting.py")
    assert_every_rank_ok(proc, n)


def test_each_rank_writes_its_trace_with_clock_offsets(tmp_path):
    n = 2
    proc, _ = run_mpi(n, "traces.py", tmp_path / "run.jsonl")
    assert_every_rank_ok(proc, n)
    from taskrt.tracing import read_trace
    sends, recvs, runs = {}, {}, set()
    for r in range(n):
        meta, events = read_trace(str(tmp_path / f"run.rank{r}.jsonl"))
        assert meta["rank"] == r and meta["num_ranks"] == n and meta["unit"] == "us"
        runs.add(meta["run"])
        if r == 0:
            assert meta["run"] == meta["wall_origin"], "a run is named by when rank 0's trace began"
        sync = meta["clock_sync"]
        assert sync["reference_rank"] == 0 and sync["min_rtt_us"] >= 0
        if r == 0:
            assert sync["offset_us"] == 0 and meta["clock_offset_us"] == 0
        assert {e["rank"] for e in events} == {r}
        assert all(e["end"] >= e["start"] for e in events)
        sends.update({e["id"]: e for e in events if e["kind"] == "send"})
        recvs.update({e["id"]: e for e in events if e["kind"] == "recv"})
    assert len(runs) == 1, f"the ranks name different runs: {runs}"
    assert sends and set(sends) == set(recvs), "every cross-rank copy shows as a send and a receive"
    for cid, send in sends.items():
        assert send["proc"] == recvs[cid]["proc"] and send["bytes"] == recvs[cid]["bytes"]


# ---- programs that must stop every rank ------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4])
def test_a_failing_task_stops_every_rank_with_its_message(n):
    proc, seconds = run_mpi(n, "failure.py", timeout=FAILURE_BOUND_S + 30)
    assert_stopped(proc, seconds)
    err = proc.stderr
    assert "taskrt: rank 1: a task failed" in err, output(proc)
    assert "'explode_on_rank_1' point [1]" in err and "boom in tile (1,) on purpose" in err, output(proc)
    assert "Traceback" in err and "raise ZeroDivisionError" in err, output(proc)


@pytest.mark.parametrize("mode,what", [("read", r"node #\d+; messages it waits for: copy #\d+ from rank 1"),
                                       ("shutdown", r"every rank to shut down\. Every rank must")])
def test_a_rank_that_exits_with_its_runtime_open_stops_the_rank_waiting_for_it_at_once(mode, what):
    # with the no-progress timeout at 60 s, only the exiting rank's notice ends the run in time
    proc, seconds = run_mpi(2, "early_exit.py", mode, timeout=FAILURE_BOUND_S + 70, env={"TASKRT_MPI_TIMEOUT": "60"})
    assert_stopped(proc, seconds)
    assert re.search(r"taskrt: rank 1 ended its program with its Runtime open \(no rt.shutdown\(\), no `with "
                     r"Runtime.from_mpi\(\)`\) while rank 0 waits for " + what, proc.stderr), output(proc)


DIVERGENCES = {
    # mode: (what rank 1 made at the first differing launch, what the others made there)
    "extra": (r"launch #2: rank 1 made 'only_on_rank_1'", r"launch #2: rank \d made 'everyone'"),
    "other": (r"launch #2: rank 1 made 'only_on_rank_1'", r"launch #2: rank \d made 'everyone'"),
    "fewer": (r"launch #3: rank 1 made 'read:x'", r"launch #3: rank \d made '<lambda>'"),
    "wait": (r"launch #1: rank 1 made 'only_on_rank_1'", r"launch #1: rank 0 made 'everyone'"),
    "end": (r"launch #1: rank 1 made 'only_on_rank_1'", r"launch #1: rank 0 made no launch"),
    "late": (r"launch #1: rank 1 made no launch", r"launch #1: rank 0 made 'only_on_rank_0'"),
    # found by the compiled receive loop: a 128 KiB tile into a 64 KiB receive
    "size": (r"launch #0: rank 1 made 'attach:x'.*float64\[16384\]", r"copy #\d+ .* from rank 0 did not fit"),
    "small": (r"launch #0: rank 1 made 'attach:x'.*float64\[8\]", r"copy #\d+ .* from rank 0 did not fit"),
    # found by the rank asked for a value (it said 'no longer holds its Future', naming no launch)
    "get": (r"launch #0: rank 1 made '<lambda>' .*@r0\.cpu0", r"rank 0 asked for the value of task #0, of which "
                                                             r"rank 1 has no Future"),
    # the same launches with another learning rate on rank 1 (it trained a mix of both, silently)
    "lr": (r"rank 1 made 'dense_0\.weight\.update' fn=\S+ of SGD\(lr=0\.2,",
           r"rank 0 made 'dense_0\.weight\.update' fn=\S+ of SGD\(lr=0\.1,"),
}


@pytest.mark.parametrize("mode,n", [("extra", 2), ("extra", 4), ("other", 4), ("fewer", 2), ("wait", 2),
                                    ("end", 4), ("late", 2), ("size", 2), ("small", 2), ("get", 2), ("lr", 2)])
def test_ranks_that_make_different_launches_stop_and_say_where(mode, n):
    proc, seconds = run_mpi(n, "divergence.py", mode, timeout=FAILURE_BOUND_S + 30)
    assert_stopped(proc, seconds)
    err = proc.stderr
    assert "control replication diverged" in err, output(proc)
    for pattern in DIVERGENCES[mode]:
        assert re.search(pattern, err), f"{pattern!r} not in the report\n{output(proc)}"


@pytest.mark.parametrize("mode, said", [
    ("lr", "error: --lr differs between the ranks (0.01 on rank 0, 2.0 on rank 1): every rank takes the same flags"),
    ("bad", "error: argument --iterations: 'abc' is not an integer (on rank 1)")])
def test_an_app_whose_flags_differ_on_one_rank_stops_every_rank_with_one_line(mode, said):
    """Another --lr trained a model no rank asked for; a flag only rank 1 could not parse left rank 0
    waiting in MPI's start until the job was killed."""
    proc, seconds = run_mpi(2, "app_flags.py", mode, timeout=FAILURE_BOUND_S + 30)
    assert_stopped(proc, seconds)
    assert proc.returncode == 2 and proc.stderr.strip() == said, output(proc)


def test_a_message_that_never_comes_ends_in_an_error_not_a_hang():
    proc, seconds = run_mpi(2, "lost_message.py", 4, timeout=FAILURE_BOUND_S + 30)
    assert_stopped(proc, seconds)
    assert "with no progress on this rank" in proc.stderr, output(proc)
    # whichever rank gives up first reports: rank 1 waits for the copy, rank 0 for its value
    waits = r"messages it waits for: (copy #\d+ from rank 0|the value of task #\d+ from rank 1)"
    assert re.search(waits, proc.stderr), output(proc)


def test_benchmark_prints_its_json_last(tmp_path):
    """bench/copy_bandwidth.py runs on 2 ranks and ends with one JSON line (numbers unchecked)."""
    proc, _ = run_mpi(2, ROOT / "bench" / "copy_bandwidth.py", "--max-mib", 1, "--trials", 1, timeout=120)
    assert proc.returncode == 0, output(proc)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "copy_bandwidth" and set(summary["sizes"]) >= {"1KiB", "1MiB"}
    assert summary["ratio_1MiB"] > 0 and summary["chain_ratio_1MiB"] > 0
