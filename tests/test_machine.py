"""Machine building and the environment variables that size it."""
from __future__ import annotations

import pytest

from taskrt import Machine
from taskrt.machine import gpus_from_env, mpi_rank_from_env, mpi_world_size_from_env


@pytest.mark.parametrize("kwargs,match", [
    ({"hosts": "ab"}, r"Machine: hosts must be a sequence of host names, one a rank, got 'ab'"),   # (it was ('a', 'b'))
    ({"hosts": ["a", 3]}, r"Machine: hosts must be a sequence of host names"),
    ({"separate_memories": "yes"}, r"Machine: separate_memories must be True or False, got str 'yes'"),
])
def test_build_refuses_what_is_not_a_flag_or_host_names(kwargs, match):
    with pytest.raises(TypeError, match=match):
        Machine.build(2, 1, **kwargs)


def test_build_gives_each_rank_its_processors_and_memories():
    m = Machine.build(2, cpus_per_rank=2, gpus_per_rank=1, separate_memories=True)
    assert [(p.rank, p.kind) for p in m.processors] == [(0, "cpu"), (0, "cpu"), (0, "gpu"),
                                                        (1, "cpu"), (1, "cpu"), (1, "gpu")]
    assert len({p.memory for p in m.processors}) == 6
    assert m.host_processor(1) == m.processors[3]


@pytest.mark.parametrize("value,want", [("", None), (" ", None), ("0", 0), ("2", 2)])
def test_taskrt_gpus_is_a_count_or_unset(monkeypatch, value, want):
    monkeypatch.setenv("TASKRT_GPUS", value)
    assert gpus_from_env() == want


@pytest.mark.parametrize("env, size, rank", [({}, 1, 0), ({"PMI_SIZE": "4", "PMI_RANK": "3"}, 4, 3),
                                             ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}, 2, 1),
                                             ({"PMI_SIZE": "4", "PMI_RANK": "3", "TASKRT_MPI": "0"}, 1, 0)])
def test_the_ranks_mpiexec_started_read_from_the_environment(monkeypatch, env, size, rank):
    for var in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE",
                "MV2_COMM_WORLD_RANK", "PMIX_SIZE", "PMIX_RANK", "TASKRT_MPI"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert (mpi_world_size_from_env(), mpi_rank_from_env()) == (size, rank)


def test_a_bad_taskrt_gpus_names_the_value(monkeypatch):
    monkeypatch.setenv("TASKRT_GPUS", "all")
    with pytest.raises(ValueError, match="TASKRT_GPUS .*'all'"):
        Machine.local(cpus=1)


def test_taskrt_gpus_zero_gives_a_cpu_machine(monkeypatch):
    monkeypatch.setattr("taskrt.machine.count_gpus", lambda: 2)  # as if two GPUs were visible
    monkeypatch.setenv("TASKRT_GPUS", "0")
    assert {p.kind for p in Machine.local(cpus=2).processors} == {"cpu"}


def test_runtime_takes_a_gpu_count(monkeypatch):
    from taskrt import Runtime
    monkeypatch.setattr("taskrt.machine.count_gpus", lambda: 2)  # as if two GPUs were visible
    monkeypatch.delenv("TASKRT_GPUS")
    with Runtime(cpus=2, gpus=0) as rt:
        assert [p.kind for p in rt.machine.processors] == ["cpu", "cpu"]


def test_values_pickled_in_another_process_hash_as_made_here():
    """Memory, Processor, Privilege and Requirement keep their hashes (dict keys everywhere),
    and a str's hash differs between processes: one that another rank pickled must still find
    the equal one made here."""
    import pickle
    import subprocess
    import sys

    code = ("import pickle, sys; from taskrt.machine import Memory, Processor; from taskrt.privilege import "
            "Privilege; m = Memory('sys', 1, 0); sys.stdout.buffer.write(pickle.dumps("
            "(m, Processor('cpu', 1, 2, m), Privilege('Reduce', 'sum'))))")
    env = {**__import__("os").environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, check=True, env=env,
                         cwd=__import__("os").path.dirname(__import__("os").path.dirname(__file__))).stdout
    from taskrt.machine import Memory, Processor
    from taskrt.privilege import Privilege
    here = Memory("sys", 1, 0)
    for theirs, mine in zip(pickle.loads(out), (here, Processor("cpu", 1, 2, here), Privilege("Reduce", "sum"))):
        assert theirs == mine and hash(theirs) == hash(mine) and {mine: 1}[theirs] == 1


@pytest.mark.parametrize("value", ["abc", "0", "-1", "1.5"])
def test_a_bad_taskrt_cpus_names_the_value(monkeypatch, value):
    from taskrt.machine import cpus_from_env
    monkeypatch.setenv("TASKRT_CPUS", value)
    with pytest.raises(ValueError, match=f"TASKRT_CPUS must be a count of CPU workers \\(1, 2, ...\\), got '{value}'"):
        cpus_from_env()
    with pytest.raises(ValueError, match="TASKRT_CPUS"):
        Machine.local()



@pytest.mark.parametrize("value,off", [("", False), ("1", False), ("0", True), (" 0 ", True)])
def test_switches_are_0_or_1(monkeypatch, value, off):
    from taskrt.machine import switched_off
    monkeypatch.setenv("TASKRT_KEEP_HEAP", value)
    assert switched_off("TASKRT_KEEP_HEAP") is off


def test_a_switch_set_to_anything_else_names_it(monkeypatch):
    """Any value but 0 used to mean on ('maybe', 'off', 'false' included)."""
    from taskrt.machine import switched_off
    for value in ("maybe", "off", "false"):
        monkeypatch.setenv("TASKRT_MPI", value)
        with pytest.raises(ValueError, match=rf"TASKRT_MPI must be 0 \(off\) or 1 \(on\), got '{value}'"):
            switched_off("TASKRT_MPI")
