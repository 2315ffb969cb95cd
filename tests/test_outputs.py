"""taskrt.outputs: a file written at the end of some work is checked before it."""
from __future__ import annotations

import os

import pytest

from taskrt.outputs import folder_problem, output_problem


def test_a_writable_path_has_no_problem_and_nothing_is_left_behind(tmp_path):
    assert output_problem(str(tmp_path / "new.json")) is None
    assert os.listdir(tmp_path) == []
    existing = tmp_path / "old.json"
    existing.write_text("kept")
    assert output_problem(str(existing)) is None and existing.read_text() == "kept"
    assert folder_problem(str(tmp_path)) is None


@pytest.mark.parametrize("path,why", [
    ("", "is an empty path"),
    ("/no/such/folder/x.json", "the folder /no/such/folder does not exist"),
    ("/proc/x.json", "cannot write in the folder /proc"),
])
def test_problems_name_the_folder(path, why):
    assert output_problem(path).startswith(why)


def test_a_name_of_the_folder_s_longest_is_taken_and_one_byte_more_refused(tmp_path):
    longest = os.pathconf(str(tmp_path), "PC_NAME_MAX")
    assert output_problem(str(tmp_path / ("a" * longest))) is None
    assert output_problem(str(tmp_path / ("a" * (longest + 1)))) == f"the file name is too long (over {longest} bytes)"


def test_a_folder_is_not_a_file(tmp_path):
    assert output_problem(str(tmp_path)) == "is a folder, not a file"
