"""taskrt.heap: freed large buffers are reused, not faulted in again; the cycle collector runs less often."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# In a fresh process (the test process's malloc has been set by every Runtime before it): 20
# rounds of a step's pattern, 16 buffers of 1 MiB allocated and touched, then all freed; print
# the page faults of the last 19 rounds.
PROGRAM = """
import resource, sys
import numpy as np
from taskrt import heap
print(heap.keep_freed_memory())
def step():
    bufs = [np.ones(1 << 18, np.float32) for _ in range(16)]
    del bufs
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(19):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES = (16 << 20) // 4096  # faults of one round whose buffers all come from the kernel


def faults(keep: str) -> tuple[str, int]:
    env = {**os.environ, "TASKRT_KEEP_HEAP": keep, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, env=env, timeout=120,
                         check=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings; Linux only")
def test_a_freed_buffer_is_reused_and_the_setting_can_be_turned_off():
    kept, reused = faults("1")
    if kept == "False":
        pytest.skip("this C library is not glibc: nothing to set")
    off, returned = faults("0")
    assert off == "False"
    assert reused < PAGES, reused  # 19 rounds, fewer faults than one fresh round
    assert returned > 10 * PAGES, returned  # the default: the freed heap is trimmed, each round faults again


def thresholds_after(keep: str, before: str) -> str:
    """gc's thresholds in a fresh process after `before` ran and then collect_cycles_less()."""
    program = f"import gc\n{before}\nfrom taskrt import heap\nprint(heap.collect_cycles_less(), gc.get_threshold())"
    env = {**os.environ, "TASKRT_KEEP_HEAP": keep, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=120,
                          check=True).stdout.strip()


def test_the_cycle_collector_runs_less_unless_the_user_set_it_or_said_no():
    from taskrt.heap import YOUNG_THRESHOLD

    assert thresholds_after("1", "") == f"True ({YOUNG_THRESHOLD}, 10, 10)"
    assert thresholds_after("0", "") == "False (700, 10, 10)"
    assert thresholds_after("1", "gc.set_threshold(5000, 5, 5)") == "False (5000, 5, 5)"


def test_a_runtime_that_executes_collects_cycles_less():
    program = ("import gc\nfrom taskrt import Runtime\n"
               "with Runtime(cpus=1, execute=False):\n    print(gc.get_threshold()[0])\n"
               "with Runtime(cpus=1):\n    print(gc.get_threshold()[0])\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=120,
                         check=True).stdout.split()
    from taskrt.heap import YOUNG_THRESHOLD

    assert out == ["700", str(YOUNG_THRESHOLD)]  # building graphs only changes nothing


def test_a_segment_builder_collects_cycles_less():
    """The simulator's graph builder makes graphs of 10^5 nodes, as a search's Simulator does."""
    program = ("import gc\nfrom strategies.segments import SegmentBuilder\nfrom tests.test_simulator import mlp\n"
               "from taskrt import Machine\nops, inputs, loss = mlp(batch=8, width=16).training_graph()\n"
               "print(gc.get_threshold()[0])\nSegmentBuilder(ops, inputs, loss.name, Machine.build(1, 2))\n"
               "print(gc.get_threshold()[0])\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=120,
                         check=True, cwd=ROOT).stdout.split()
    from taskrt.heap import YOUNG_THRESHOLD

    assert out == ["700", str(YOUNG_THRESHOLD)]
