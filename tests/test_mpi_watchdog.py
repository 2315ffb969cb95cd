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
