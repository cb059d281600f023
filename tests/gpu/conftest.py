"""GPU kernel tests (``make test-gpu``, marker ``gpu``).

Without a GPU they run under Triton's interpreter (``TRITON_INTERPRET=1``); with
``--compile-for sm_90`` every launch is also compiled for that GPU (Triton's front end and
its bundled ptxas, no GPU needed), which catches what the interpreter lets through, e.g. a
variable that an ``if`` block redefines with another type.

Where ppspec is not installed (the GPU machine runs the system python on a bare checkout)
the repository's top-level folders are mapped under the ``ppspec`` namespace here, as
pyproject.toml maps them when installed.
"""
from __future__ import annotations

import inspect
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


def pytest_addoption(parser):
    parser.addoption("--compile-for", default=None, metavar="sm_NN",
                     help="under TRITON_INTERPRET=1, also compile each kernel launch for this CUDA arch")


def pytest_configure(config):
    arch = config.getoption("--compile-for")
    if arch:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise pytest.UsageError("--compile-for works under TRITON_INTERPRET=1 (on the GPU, launches compile anyway)")
        _compile_every_launch(int(arch.removeprefix("sm_")))


_WORKER = r"""
import importlib, json, os, sys
root = sys.argv[1]
try:
    import ppspec.kernels
except ImportError:
    sys.path.insert(0, root)
    import ppspec
    ppspec.__path__.append(root)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
target = GPUTarget("cuda", int(sys.argv[2]), 32)
for line in sys.stdin:
    r = json.loads(line)
    try:
        if os.path.dirname(r["file"]) not in sys.path:  # a test module's own kernels
            sys.path.append(os.path.dirname(r["file"]))
        fn = getattr(importlib.import_module(r["module"]), r["fn"], None)
        if fn is not None:  # else a kernel made inside a function (a test's probe): not reachable here
            triton.compile(ASTSource(fn=fn, signature=r["sig"], constexprs=r["consts"]), target=target, options=r["opts"])
        out = None
    except Exception as e:  # the compiler's message is the point
        out = f"{type(e).__name__}: {e}"
    print(json.dumps(out), flush=True)
"""


def _compile_every_launch(cc: int) -> None:
    """Wrap the interpreter's launch so that each new specialisation of a kernel (argument
    types and constexpr values) is first compiled for ``sm_<cc>``, in a worker process
    without the interpreter (whose patched ``triton.language`` the compiler cannot use);
    a compile error fails the test that launched it."""
    import json
    import subprocess

    import torch
    from triton.runtime.interpreter import InterpretedFunction

    types = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
             torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
             torch.bool: "i1"}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    worker = subprocess.Popen([sys.executable, "-c", _WORKER, _ROOT, str(cc)], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    seen, run = {}, InterpretedFunction.run

    def arg_type(v):
        if isinstance(v, torch.Tensor):
            return "*" + types[v.dtype]
        if isinstance(v, bool):
            return "i1"
        if isinstance(v, int):
            return "i64" if not -2**31 <= v < 2**31 else "i32"
        return "fp32"

    def checked_run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        bound = dict(zip(self.arg_names, args)) | {k: v for k, v in kwargs.items() if k in params}
        const = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
        req = {"module": self.fn.__module__, "fn": self.fn.__name__, "file": inspect.getfile(self.fn),
               "sig": {n: "constexpr" if n in const else arg_type(v) for n, v in bound.items()},
               "consts": {n: bound[n] for n in const if n in bound},
               "opts": {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}}
        key = json.dumps(req, sort_keys=True)
        if key not in seen:
            worker.stdin.write(key + "\n")
            worker.stdin.flush()
            seen[key] = json.loads(worker.stdout.readline())
        if seen[key] is not None:
            raise AssertionError(f"{self.fn.__name__} does not compile for sm_{cc}: {seen[key]}")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = checked_run
