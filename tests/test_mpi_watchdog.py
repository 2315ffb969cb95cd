"""taskrt.mpi_watchdog: the no-progress timeout read from the environment."""
from __future__ import annotations

import pytest


@pytest.mark.parametrize("value,want", [("abc", None), ("-1", None), ("-5", None), ("inf", None), ("2.5", 2.5), ("0", 0.0),
                                        ("", "default")])
def test_taskrt_mpi_timeout_is_seconds_zero_for_never(monkeypatch, value, want):
    from taskrt.mpi_watchdog import DEFAULT_TIMEOUT_S, timeout_from_env
    monkeypatch.setenv("TASKRT_MPI_TIMEOUT", value)
    if want is None:
        with pytest.raises(ValueError, match=f"TASKRT_MPI_TIMEOUT must be seconds, at least 0 \\(0: never\\), got '{value}'"):
            timeout_from_env()
    else:
        assert timeout_from_env() == (DEFAULT_TIMEOUT_S if want == "default" else want)
