"""The one dispatch rule of every op in ``kernels/``: the GPU implementation for CUDA
tensors where it imports (Triton, fla), the plain-torch reference otherwise."""
from __future__ import annotations

import importlib
from typing import Callable


def pick(on_cuda: bool, module: str, name: str, reference: Callable) -> Callable:
    """``name`` from ``module`` (a path under ``ppspec.kernels``, e.g. ``"norm.triton_norm"``)
    when ``on_cuda`` and that module imports, else ``reference``."""
    if on_cuda:
        try:
            return getattr(importlib.import_module("." + module, __package__), name)
        except ImportError:
            pass
    return reference
