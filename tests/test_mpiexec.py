"""taskrt.mpiexec: a module run under this environment's mpiexec, its last JSON line read back."""
from __future__ import annotations

import pytest

from taskrt.mpiexec import run_module_json


def test_the_report_is_the_last_json_line(tmp_path, monkeypatch):
    (tmp_path / "reporter.py").write_text(
        "import json, os\nprint('starting')\nprint(json.dumps({'size': int(os.environ['PMI_SIZE'])}))\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    assert run_module_json(2, "reporter", [], timeout=60) == {"size": 2}


def test_a_failed_run_names_the_command_and_shows_its_output():
    with pytest.raises(RuntimeError, match=r"(?s)-m no_such_module_here exited [1-9].*No module named"):
        run_module_json(1, "no_such_module_here", [], timeout=60)


def test_the_module_runs_in_the_callers_folder(tmp_path, monkeypatch):
    """So that relative paths given to it mean the caller's files: the demo's default --out
    (traces) run from another folder trained with a strategy file of the repository's."""
    (tmp_path / "where.py").write_text("import json, os\nprint(json.dumps({'cwd': os.getcwd()}))\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert run_module_json(1, "where", [], timeout=60) == {"cwd": str(tmp_path)}
