"""strategies.probe: the runtime's overheads measured under a real mpiexec of 2 ranks."""
from __future__ import annotations

import math
import os

import pytest

from strategies.probe import measure_overheads


def test_the_probe_measures_a_task_a_hop_between_ranks_and_the_issue_of_a_node():
    found = measure_overheads(2)
    assert set(found) == {"issue", "chain", "pingpong"}
    # empty tasks: tens of microseconds to a few milliseconds each on any machine
    assert all(math.isfinite(v) and 1e-6 < v < 0.1 for k, v in found.items() if k != "issue"), found
    # a node issued again is the main thread's Python alone: more than nothing, less than a task's run
    assert 0 < found["issue"] < found["chain"], found


def test_the_ping_pong_needs_two_ranks():
    with pytest.raises(ValueError, match="needs at least 2 ranks, got ranks=1"):
        measure_overheads(1)


def test_the_command_line_refuses_fewer_than_two_ranks_or_more_than_the_cores_before_starting_mpiexec(capsys):
    from strategies.probe import main
    with pytest.raises(SystemExit) as e:
        main(["--ranks", "1"])
    assert e.value.code == 2 and "argument --ranks: 1 must be >= 2" in capsys.readouterr().err
    cores = os.cpu_count() or 1
    with pytest.raises(SystemExit) as e:
        main(["--ranks", str(cores + 1)])
    assert e.value.code == 2 and f"need {cores + 1} cores, this machine has {cores}" in capsys.readouterr().err
