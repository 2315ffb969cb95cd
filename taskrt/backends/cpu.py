"""Host memory: numpy arrays."""
from __future__ import annotations

import numpy as np


def allocate(shape, dtype):
    # np.zeros maps fresh pages lazily, so a full-size instance only costs what is touched
    return np.zeros(shape, dtype)


def read_only(view):
    view = view.view()
    view.flags.writeable = False
    return view
