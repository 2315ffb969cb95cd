"""taskrt.replication: the launch log that ranks compare to find where they diverged."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from taskrt.replication import LaunchLog


@settings(max_examples=60, deadline=None)
@given(signatures=st.lists(st.text(max_size=12), max_size=40), cuts=st.lists(st.integers(0, 40), max_size=6),
       keep=st.integers(1, 16))
def test_adding_signatures_in_batches_logs_what_adding_them_one_at_a_time_does(signatures, cuts, keep):
    one, batched = LaunchLog(keep), LaunchLog(keep)
    for s in signatures:
        one.add(s)
    bounds = sorted({0, len(signatures), *[c for c in cuts if c <= len(signatures)]})
    for lo, hi in zip(bounds, bounds[1:]):
        batched.add_many(signatures[lo:hi])
    assert (batched.count, batched.hash, batched.base, list(batched.entries)) == \
        (one.count, one.hash, one.base, list(one.entries))
    assert all(batched.hash_at(c) == one.hash_at(c) for c in range(len(signatures) + 2))
    assert batched.window(0, len(signatures)) == one.window(0, len(signatures))


def test_a_launch_s_signature_names_its_first_and_last_point_s_processor():
    """Ranks that put a launch's last point on other processors diverge: the signature says so."""
    from types import SimpleNamespace
    from taskrt.replication import launch_signature

    def spec(last_proc):
        return SimpleNamespace(fn=None, reqs=[], name="f", points=[(0,), (1,)], procs=["r0.cpu0", last_proc])
    assert launch_signature(spec("r0.cpu1")) != launch_signature(spec("r1.cpu0"))
    assert launch_signature(spec("r0.cpu1")) == launch_signature(spec("r0.cpu1"))


def _describe(mine: list[str], theirs: list[str], keep: int) -> str:
    """Rank 0's report of where it and rank 1 diverged, from their logs of these signatures."""
    from taskrt.replication import ReplicationCheck
    logs = [LaunchLog(keep), LaunchLog(keep)]
    for log, signatures in zip(logs, (mine, theirs)):
        log.add_many(signatures)
    check = ReplicationCheck(logs[0], 0, 2, report=None)
    return check.describe(1, 0, len(mine), logs[1].window(0, len(theirs)), "a test")


def test_the_report_names_the_first_launch_the_ranks_made_otherwise():
    said = _describe(["a", "b", "c", "d"], ["a", "b", "x", "d"], keep=8)
    assert "launch #2: rank 0 made c" in said and "launch #2: rank 1 made x" in said


def test_a_divergence_older_than_the_launches_kept_is_said_to_be():
    """The running hashes differ at every launch after a divergence: compared by hash, the first
    launch kept was named, made alike ('c' and 'c') by both ranks."""
    said = _describe(["a", "b", "c", "d"], ["x", "b", "c", "d"], keep=2)
    assert "the launches kept by both ranks (from #2) agree; the difference is older than the last" in said
    assert "launch #2" not in said
