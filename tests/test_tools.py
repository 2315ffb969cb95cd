"""tools/__init__.py: a tool whose stdout's reader goes away (`| head`) exits quietly."""
import subprocess
import sys

from tests.test_mpi import ROOT, python_path

#: a tool's main that writes far more than a pipe holds, through exit_with
LONG_OUTPUT = ("from tools import exit_with\n"
               "def main():\n"
               "    for _ in range(20000):\n"
               "        print('x' * 100)\n"
               "    return 0\n"
               "exit_with(main)\n")


def test_a_closed_pipe_ends_the_tool_without_a_traceback():
    proc = subprocess.Popen([sys.executable, "-c", LONG_OUTPUT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            cwd=ROOT, env={"PYTHONPATH": python_path(), "PATH": ""})
    assert proc.stdout.readline() == b"x" * 100 + b"\n"
    proc.stdout.close()   # what head does after its line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert err == ""
