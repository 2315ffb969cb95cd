"""Whether a file that some work writes at its end can be written, checked before the work.

A trace, a strategy or a report written after minutes of training or search is lost when its
path turns out wrong only then; the apps, the search and the runtime ask here first.
"""
from __future__ import annotations

import os
import tempfile


def output_problem(path: str) -> str | None:
    """Why a file written at the end of some work could not be (its folder is missing or cannot
    be written in, or it is a folder or a file that cannot be written), or None: checked before
    the work, so that none is lost to a typo in the name."""
    if not path:
        return "is an empty path"
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        return f"the folder {folder} does not exist"
    longest = os.pathconf(folder, "PC_NAME_MAX")
    if len(os.fsencode(os.path.basename(path))) > longest:
        return f"the file name is too long (over {longest} bytes)"
    if os.path.isdir(path):
        return "is a folder, not a file"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else "cannot be written (permission denied)"
    return folder_problem(folder)


def folder_problem(folder: str) -> str | None:
    """Why no file can be made in the existing folder `folder` (found by making one, a temporary
    file with its own name: os.access says yes to root everywhere), or None."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder):
            return None
    except OSError as e:
        return f"cannot write in the folder {folder}: {e.strerror}"
