"""Compile the kernels that the suite's later tests need into numba's on-disk cache, in a
process of its own beside the suite (tests/conftest.py starts it; TASKRT_TEST_PRECOMPILE=0
does not).

A clean clone has no cache, and on a 2-core 2 GHz VM half of a cold run of the suite was
numba compiling (13.6 min cold against 7.0 warm), while the suite keeps about one core busy.
The tests compile what they call as before; this process compiles, on the other core, what
they come to later, so that they find it cached: the simulator's compiled passes (the region
analysis alone is 90 s; the first search test met them about four minutes in), then the
recurrent apps' LSTM kernels and the LSTM's float64 ones that tests/test_lstm.py runs. What it
compiles is the same whichever process does it.
"""
from __future__ import annotations

import contextlib
import io


def simulator() -> None:
    """A short search of tiny Inception-v3 on 8 K80s: the segment builder, the region analysis,
    the layout, the schedule and the costing."""
    from strategies.cost import CostModel
    from strategies.machine_model import load_machine
    from strategies.search import app_graph, search
    from strategies.simulator import Simulator

    model, output = app_graph("inception_v3", tiny=True)
    machine = load_machine("k80", nodes=2)
    search(Simulator.for_model(model, machine, CostModel(machine, measured=False), output=output), 20, seed=0,
           model=model)


def recurrent_apps() -> None:
    """One training iteration of each tiny recurrent app on this process."""
    from apps import nmt, rnnlm, rnntc

    for app in (rnntc, rnnlm, nmt):
        app.main(["--tiny", "--iterations", "1"])


def lstm_float64() -> None:
    """The LSTM op's float64 steps, on one thread and cut into parts of the hidden units (as
    tests/test_lstm.py runs them)."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    import ops.lstm as lstm_module
    from tests.test_lstm import lstm_case, run_path

    op, xs, w, gs = lstm_case(3, 2, 3, 17, True, 0, np.float64)
    old = lstm_module.PARALLEL_MIN_MACS
    try:
        for least in (1 << 62, 0):
            lstm_module.PARALLEL_MIN_MACS = least
            with threadpool_limits(3, user_api="blas"):
                run_path(np, op, xs, w, gs)
    finally:
        lstm_module.PARALLEL_MIN_MACS = old


if __name__ == "__main__":
    with contextlib.redirect_stdout(io.StringIO()):
        simulator()
        recurrent_apps()
        lstm_float64()
