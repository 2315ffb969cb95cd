"""The GIL-free receive loop (taskrt/mpi_native.py) under mpiexec, and the runtime with it
turned off (TASKRT_MPI_NATIVE=0: large receives go back to the Python progress thread).
Nothing here imports mpi4py: this process must not become an MPI process itself."""
from __future__ import annotations

import pytest

from taskrt import Machine
from taskrt.machine import RankSpec
from tests.test_mpi import assert_every_rank_ok, run_mpi


def test_the_loop_copies_every_size_reports_a_truncation_and_naps_while_waiting():
    proc, _ = run_mpi(2, "native.py", timeout=120)
    assert_every_rank_ok(proc, 2)


@pytest.mark.parametrize("program,args", [("random_programs.py", (12,)), ("waiting.py", ())])
def test_the_runtime_without_the_loop(program, args):
    proc, _ = run_mpi(2, program, *args, timeout=120, env={"TASKRT_MPI_NATIVE": "0"})
    assert_every_rank_ok(proc, 2)


def test_the_loop_spins_only_where_the_node_has_a_core_for_every_busy_thread(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    two_nodes = Machine.from_ranks([RankSpec(3, ())] * 4, ["a", "a", "b", "b"])
    assert two_nodes.threads_fit_node(0, extra_per_rank=1)  # node a: 2 ranks x (3 workers + the loop) = 8 cores
    crowded = Machine.from_ranks([RankSpec(3, ())] * 3, ["a", "a", "a"])
    assert not crowded.threads_fit_node(2, extra_per_rank=1)  # 12 busy threads on 8 cores: nap
