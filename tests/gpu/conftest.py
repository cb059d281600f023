"""GPU kernel tests (``make test-gpu``, marker ``gpu``).

Where ppspec is not installed (the GPU machine runs the system python on a bare checkout)
the repository's top-level folders are mapped under the ``ppspec`` namespace here, as
pyproject.toml maps them when installed.
"""
from __future__ import annotations

import os
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import ppspec.kernels  # noqa: F401
except ImportError:
    if _ROOT not in sys.path:
        sys.path.insert(0, _ROOT)
    import ppspec

    if _ROOT not in ppspec.__path__:
        ppspec.__path__.append(_ROOT)  # ppspec.kernels -> <repo>/kernels, as installed


@pytest.fixture(scope="session")
def dev():
    """CUDA; or the CPU under Triton's interpreter (TRITON_INTERPRET=1) for development."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)")
