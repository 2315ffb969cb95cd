"""Compile the kernels that the suite's later tests need into numba's on-disk cache, in a
process of its own beside the suite (tests/conftest.py starts it; TASKRT_TEST_PRECOMPILE=0
does not).

A clean clone has no cache, and on a 2-core 2 GHz VM half of a cold run of the suite was
numba compiling (13.6 min cold against 7.0 warm), while the suite keeps about one core busy.
The tests compile what they call as before; this process compiles, on the other core, what
they come to later, so that they find it cached: the simulator's compiled passes (the region
analysis alone is 90 s; the first search test met them about four minutes in), then the
recurrent apps' LSTM kernels. What it compiles is the same whichever process does it.
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


if __name__ == "__main__":
    with contextlib.redirect_stdout(io.StringIO()):
        simulator()
        recurrent_apps()
