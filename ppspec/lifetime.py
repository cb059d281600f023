"""A child process that ends with its parent (Linux)."""
from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with(parent: int):
    """``preexec_fn`` of a child on Linux: SIGTERM when ``parent`` dies however it dies
    (SIGKILL included, when no handler of its runs), through ``prctl(PR_SET_PDEATHSIG)``,
    so that no child outlives its parent holding a port and memory (a stage or router of
    ``ppspec serve``, a router's extra HTTP server). The child exits
    at once if ``parent`` is already gone. The signal comes when the *thread* that started
    the child ends: start children from the main thread. None (no
    ``preexec_fn``) elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: no dlopen after fork

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)
    return arm
