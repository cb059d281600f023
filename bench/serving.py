"""``ppspec serve`` as a benchmark's server: started on a free loopback port in a process
group of its own, handed over once ``/health`` answers 200, stopped on leaving (shared by
``served_vs_engine`` and ``prefix_served``)."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from ppspec.argtypes import free_ports


def first_token_rows(url: str, since: int = 0) -> dict:
    """The server's first-token paths recorded from number ``since`` on
    (``GET /v1/trace/first_tokens``; router/first_tokens.py)."""
    r = httpx.get(url + "/v1/trace/first_tokens", params={"since": since}, timeout=60)
    r.raise_for_status()
    return r.json()


def first_token_mark(url: str) -> int:
    """How many first-token paths the server has recorded: the ``since`` of
    :func:`first_token_rows` for the requests sent after this call."""
    return first_token_rows(url, 1 << 62)["total"]


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def serving(args: list[str], startup_timeout: float, name: str, env: dict | None = None, cwd: str | None = None):
    """``ppspec serve ARGS --port P`` on a free port, its output in a temporary log file;
    yields ``(url, process)`` once ``/health`` answers 200, and stops it (SIGINT to its
    process group, SIGKILL after 30 s) on leaving. ``cwd``: run it from that folder (a
    baseline checkout on ``PYTHONPATH``: ``python -m`` puts the working directory first on
    ``sys.path``, so the current checkout's root would shadow it). Raises RuntimeError
    naming the log when it exits or is not healthy in time."""
    with serving_all([(args, name)], startup_timeout, env, cwd) as [(url, proc)]:
        yield url, proc


@contextlib.contextmanager
def serving_all(servers: list[tuple[list[str], str]], startup_timeout: float, env: dict | None = None,
                cwd: str | None = None):
    """:func:`serving` of every ``(args, name)`` of ``servers`` at once (they start side by
    side): yields their ``(url, process)`` in that order once every one is healthy."""
    procs, logs = [], []
    try:
        for (args, name), port in zip(servers, free_ports("127.0.0.1", len(servers))):
            url = f"http://127.0.0.1:{port}"
            log = tempfile.NamedTemporaryFile("w+", prefix=f"serve-{name}-", suffix=".log", delete=False)
            logs.append(log)
            procs.append((url, subprocess.Popen([sys.executable, "-m", "ppspec.cli", "serve", *args, "--port",
                                                 url.rsplit(":", 1)[1]], env=env, stdout=log,
                                                stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd), name))
        deadline = time.monotonic() + startup_timeout
        for (url, proc, name), log in zip(procs, logs):
            while not healthy(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"ppspec serve ({name}) did not start; its log: {log.name}")
                time.sleep(0.2)
        yield [(url, proc) for url, proc, _ in procs]
    finally:
        for _, proc, _ in procs:
            try:
                os.killpg(proc.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        for _, proc, _ in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for log in logs:
            log.close()
