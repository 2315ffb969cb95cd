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
