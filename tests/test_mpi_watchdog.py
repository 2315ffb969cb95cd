"""taskrt.mpi_watchdog: the no-progress timeout read from the environment."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("value,want", [("abc", None), ("-1", None), ("-5", None), ("inf", None), ("4.5", 4.5), ("0", 0.0),
                                        ("", "default")])
def test_taskrt_mpi_timeout_is_seconds_zero_for_never(monkeypatch, value, want):
    from taskrt.mpi_watchdog import DEFAULT_TIMEOUT_S, timeout_from_env
    monkeypatch.setenv("TASKRT_MPI_TIMEOUT", value)
    if want is None:
        with pytest.raises(ValueError, match=f"TASKRT_MPI_TIMEOUT must be seconds, at least 0 \\(0: never\\), got '{value}'"):
            timeout_from_env()
    else:
        assert timeout_from_env() == (DEFAULT_TIMEOUT_S if want == "default" else want)


@pytest.mark.parametrize("value", ["1", "0.05", "3.9"])
def test_a_timeout_shorter_than_two_heartbeats_is_refused(monkeypatch, value):
    """Under 2 s it ended correct programs whose peer was computing, blaming their task graphs."""
    from taskrt.mpi_watchdog import timeout_from_env
    monkeypatch.setenv("TASKRT_MPI_TIMEOUT", value)
    with pytest.raises(ValueError, match=f"TASKRT_MPI_TIMEOUT must be 0 \\(never\\) or at least 4 seconds .* got '{value}'"):
        timeout_from_env()


@pytest.mark.parametrize("value,match", [
    (1, r"must be 0 \(never\) or at least 4 seconds .* got 1$"),
    (-2.0, r"must be seconds, at least 0 \(0: never\), got -2.0$"),
    ("60", r"must be seconds, at least 0 \(0: never\), got '60'$"),
    (True, r"must be seconds, at least 0 \(0: never\), got True$"),
    (float("nan"), r"must be seconds, at least 0 \(0: never\), got nan$"),
])
def test_the_timeout_argument_of_from_mpi_is_checked_as_the_environment_is(value, match):
    from taskrt.mpi_watchdog import checked_timeout
    with pytest.raises(ValueError, match=r"Runtime.from_mpi: timeout " + match):
        checked_timeout(value)
    assert checked_timeout(0) == 0.0 and checked_timeout(30) == 30.0
