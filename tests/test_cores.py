"""taskrt/cores.py: the share of a node's cores each rank gets, and ranks bound to them under
mpiexec (and not where binding is not theirs to do)."""
from __future__ import annotations

import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from taskrt.cores import core_share
from tests.test_mpi import assert_every_rank_ok, run_mpi


@given(cores=st.sets(st.integers(0, 63), min_size=1, max_size=16), ranks=st.sets(st.integers(0, 31), min_size=1,
                                                                               max_size=8))
def test_every_rank_gets_its_own_equal_run_of_cores(cores, ranks):
    ranks = sorted(ranks)
    shares = {r: core_share(sorted(cores, reverse=True), ranks, r) for r in ranks}
    if len(cores) < len(ranks):
        assert set(shares.values()) == {None}
        return
    size = len(cores) // len(ranks)
    assert all(len(s) == size and set(s) <= cores for s in shares.values())
    taken = [c for r in ranks for c in shares[r]]
    assert len(set(taken)) == len(taken) and taken == sorted(taken)   # disjoint, in rank order


def test_a_rank_not_on_the_node_is_refused():
    with pytest.raises(ValueError, match="rank 5 is not among the node's ranks"):
        core_share([0, 1], [0, 1], 5)


def _reports(proc) -> dict[int, dict]:
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["rank"]: r for r in reports}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or len(os.sched_getaffinity(0)) != os.cpu_count(),
                    reason="binding needs a node with two cores or more, all of them this process's")
def test_two_ranks_run_on_their_own_cores_and_get_all_back_after():
    proc, _ = run_mpi(2, "cores.py")
    assert_every_rank_ok(proc, 2)
    reports = _reports(proc)
    every = sorted(os.sched_getaffinity(0))
    share = len(every) // 2
    for rank, report in reports.items():
        assert {tuple(c) for c in report["during"]} == {tuple(every[rank * share:(rank + 1) * share])}, report
        assert {tuple(c) for c in report["after"]} == {tuple(every)}, report
        assert report["node_cores"] == len(every)


@pytest.mark.parametrize("n, env", [(4, {}), (2, {"TASKRT_BIND_CORES": "0"})])
def test_ranks_stay_unbound_when_oversubscribed_or_switched_off(n, env):
    if n <= len(os.sched_getaffinity(0)) and not env:
        pytest.skip(f"{n} ranks fit this node's cores: they bind")
    proc, _ = run_mpi(n, "cores.py", env=env)
    assert_every_rank_ok(proc, n)
    every = sorted(os.sched_getaffinity(0))
    for report in _reports(proc).values():
        assert {tuple(c) for c in report["during"]} == {tuple(every)}, report
