"""Command-line tools over traces and strategy files (tools/trace.py, tools/strategy.py)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn


def fail(message: str) -> NoReturn:
    """One line on stderr (`error: ...`) and exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


class LineParser(argparse.ArgumentParser):
    """argparse whose bad flag is one line (fail), without the usage block (the apps' own parser
    does the same and agrees on it over MPI's ranks)."""

    def error(self, message):
        fail(message)


def exit_with(main) -> None:
    """sys.exit(main()), quietly where the reader of stdout went away (`... | head`): Python's
    own recipe, stdout pointed at /dev/null so that the exit's flush does not fail again."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    sys.exit(code)


def png_problem(path: str) -> str | None:
    """Why `path` will not do for an image the tools draw (they write PNG alone), or None."""
    if str(path).lower().endswith(".png"):
        return None
    return "the tools write PNG images only: name the file .png"
