"""ppspec: pipeline-parallel speculative decoding for hybrid linear-attention LMs.

The top-level folders of the repository are installed under this namespace:
``ppspec.proto``, ``ppspec.stage_server``, ``ppspec.router``, ``ppspec.kernels``,
``ppspec.bench``. ``ppspec.LLM`` is the single-process Python API.
"""

import os as _os
import sys as _sys

__version__ = "0.1.0"


def _checkout_root_off_path() -> None:
    """In a checkout, map its top-level folders under ``ppspec`` and take its root off ``sys.path``.

    Python puts the working directory on ``sys.path`` for ``python -m`` and ``-c`` (so for
    ``python -m pytest``, ``-m ppspec.cli`` and every child the launchers start from the
    checkout). There the folders ``kernels/``, ``proto/``, ``router/``, ``bench/``,
    ``stage_server/`` would import under their bare names and shadow third-party packages:
    transformers >= 5.25 imports Hugging Face's ``kernels`` package from every model.
    Our code imports them only as ``ppspec.<folder>``, which ``__path__`` resolves here to the
    same folders as pyproject.toml's package-dir (also where the checkout is not installed:
    the GPU machine runs its system python on one). An installed copy (its parent is
    site-packages, with no pyproject.toml) is left alone.
    """
    root = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))
    if not _os.path.isfile(_os.path.join(root, "pyproject.toml")):
        return
    if root not in __path__:
        __path__.append(root)
    _sys.path[:] = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != root]


_checkout_root_off_path()


def __getattr__(name):
    # Lazy: importing ppspec must not pull torch into light processes (the bench client).
    if name in ("LLM", "SamplingParams"):
        from ppspec.router import llm, types

        return {"LLM": llm.LLM, "SamplingParams": types.SamplingParams}[name]
    raise AttributeError(name)
