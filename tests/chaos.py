"""Chaos soak: a keyed PP3 + MTP pipeline under sustained mixed traffic while its processes
are killed, paused and replaced; afterwards it must answer as before and hold nothing.

Traffic (``--workers`` clients at once): greedy and seeded completions, chats, streams (some
dropped by the client after a few chunks), ``n`` > 1, stop strings, and hostile requests
(malformed JSON, ids outside the vocabulary, bad parameters, a lone surrogate, raw framing
attacks: both Content-Length and Transfer-Encoding, an oversized declared body, garbage).
Faults, in turn until ``--duration`` seconds are up (each kind at least once): SIGSTOP a stage for a few seconds then
SIGCONT, SIGKILL a stage and start it again, SIGKILL the router and start a new one on its
port. Every answer must be a success, a 4xx for the hostile ones, or a 503 while a fault
lasts; a stream ends with ``[DONE]`` (or the client dropped it). After the soak: greedy
answers equal those before it, every stage holds no row, KV page or pending commit, and no
process of the pipeline is left once it stops.

    python tests/chaos.py --duration 600            # the soak (a checkpoint is made if none given)
    python -m pytest tests/test_chaos.py            # its short form, in ``make test``

Prints a JSON summary; exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import Cluster  # noqa: E402

GREEDY = [[5 + i, 6, 7, 8 + i] * 3 for i in range(6)]
HOSTILE_JSON = [
    b"{not json",
    json.dumps({"prompt": [10**9], "max_tokens": 4}).encode(),
    json.dumps({"prompt": "hi", "max_tokens": -1}).encode(),
    json.dumps({"prompt": "hi", "temperature": "hot"}).encode(),
    json.dumps({"prompt": "hi", "max_tokens": 10**12}).encode(),
    b'{"prompt": "Hello", "model": "\\ud800"}',
    json.dumps({"prompt": "", "max_tokens": 4}).encode(),
    json.dumps({"prompt": "hi", "logit_bias": {"99999999999": 1}}).encode(),
]
RAW = [
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03garbage\r\n\r\n",
]


class Soak:
    def __init__(self, model: str, duration: float, log_dir: str, workers: int = 6, seed: int = 0):
        self.duration, self.workers, self.rng = duration, workers, random.Random(seed)
        key = os.path.join(log_dir, "pipeline-key")
        with open(key, "w") as f:
            f.write(os.urandom(16).hex())
        os.chmod(key, 0o600)
        args = ["--pipeline-key-file", key]
        self.c = Cluster(model, 3, "mtp", log_dir=log_dir, max_rows=16, kv_tokens=8192, stage_args=args,
                         router_args=args + ["--stall-timeout", "4", "--step-timeout", "60"])
        self.outcomes: Counter = Counter()
        self.violations: list[str] = []
        self.faults: list[str] = []
        self.in_fault = False
        self.inflight = 0  # requests sent and not yet answered
        self.served = 0  # successful answers to well-formed requests

    # ---- traffic
    def _judge(self, kind: str, status: int, text: str = "") -> None:
        self.outcomes[f"{kind} {status}"] += 1
        hostile = kind.startswith("hostile")
        ok = status == 200 and not hostile or hostile and 400 <= status < 500 or status == 503
        self.served += status == 200 and not hostile
        if not ok:
            self.violations.append(f"{kind}: HTTP {status}: {text[:200]}")

    async def _one(self, client: httpx.AsyncClient) -> None:
        url = self.c.url
        kind = self.rng.choice(["greedy", "seeded", "chat", "stream", "drop", "n", "stop", "hostile", "raw"])
        prompt = self.rng.choice(GREEDY)
        body = dict(prompt=prompt, max_tokens=self.rng.randint(4, 40), ignore_eos=True)
        if kind == "greedy":
            body["temperature"] = 0.0
        elif kind in ("seeded", "n"):
            body.update(temperature=0.8, top_p=0.9, seed=self.rng.randrange(1 << 30), n=2 if kind == "n" else 1)
        elif kind == "stop":
            body.update(temperature=0.0, stop=["a", "e"], ignore_eos=False)
        if kind == "chat":
            r = await client.post(url + "/v1/chat/completions", json=dict(
                messages=[{"role": "user", "content": "Hello there"}], max_tokens=12, temperature=0.7, seed=3))
            return self._judge(kind, r.status_code, r.text)
        if kind in ("stream", "drop"):
            async with client.stream("POST", url + "/v1/completions", json=dict(body, stream=True)) as r:
                if r.status_code != 200:
                    return self._judge(kind, r.status_code, (await r.aread()).decode(errors="replace"))
                lines = []
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        lines.append(line[6:])
                        if kind == "drop" and len(lines) >= 2:
                            return self._judge(kind, 200)  # the client goes away mid-stream
                ended = bool(lines) and lines[-1] == "[DONE]"
                return self._judge(kind, 200 if ended else 599, "stream without [DONE]: " + "|".join(lines[-2:]))
        if kind == "hostile":
            data = self.rng.choice(HOSTILE_JSON)
            r = await client.post(url + "/v1/completions", content=data, headers={"content-type": "application/json"})
            return self._judge(kind, r.status_code, r.text)
        if kind == "raw":
            return self._judge("hostile raw", await asyncio.to_thread(self._raw, self.rng.choice(RAW)))
        r = await client.post(url + "/v1/completions", json=body)
        self._judge(kind, r.status_code, r.text)

    def _raw(self, data: bytes) -> int:
        """Status of the answer to raw bytes; 400 when the server just closes (TLS garbage)."""
        try:
            with socket.create_connection(("127.0.0.1", self.c.port), timeout=60) as s:
                s.sendall(data)
                head = s.recv(64)
        except OSError:
            return 503 if self.in_fault else 400  # the router was being replaced
        if not head:
            return 400
        return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 599

    async def traffic(self, stop: asyncio.Event) -> None:
        limits = httpx.Limits(max_connections=self.workers * 2)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            async def worker():
                while not stop.is_set():
                    before = self.outcomes.total()
                    self.inflight += 1
                    try:
                        await self._one(client)
                    except httpx.TransportError as e:  # the router itself was killed: no answer at all
                        self.outcomes[f"transport {type(e).__name__}"] += 1
                        if not self.in_fault:
                            self.violations.append(f"transport error outside a fault: {e!r}")
                    finally:
                        self.inflight -= 1
                    if self.in_fault and self.outcomes.total() > before:
                        await asyncio.sleep(0.3)  # a pipeline down answers at once: do not spin
            await asyncio.gather(*(worker() for _ in range(self.workers)))

    # ---- faults
    async def _wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=5) as client:
            while True:
                try:
                    if (await client.get(self.c.url + "/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"not healthy {timeout:.0f} s after the fault {self.faults[-1]}")
                await asyncio.sleep(0.2)

    async def _fault(self, what: str) -> None:
        c = self.c
        k = self.rng.randrange(c.pp)
        while self.inflight == 0:  # strike with requests in flight
            await asyncio.sleep(0.02)
        self.in_fault = True
        self.faults.append((f"{what} stage{k}" if what != "replace router" else what) + f" ({self.inflight} in flight)")
        if what == "pause":
            c.kill(f"stage{k}", signal.SIGSTOP)
            await asyncio.sleep(self.rng.uniform(1.0, 3.0))
            c.kill(f"stage{k}", signal.SIGCONT)
        elif what == "kill":
            c.kill(f"stage{k}", signal.SIGKILL)
            await asyncio.to_thread(c.procs[f"stage{k}"].wait)
            await asyncio.sleep(0.5)
            c.start_stage(k)
        else:
            c.kill("router", signal.SIGKILL)
            await asyncio.to_thread(c.procs["router"].wait)
            c.start_router()
        await self._wait_healthy()
        self.in_fault = False

    async def chaos(self, stop: asyncio.Event, t_end: float) -> None:
        kinds = ["pause", "kill", "replace router"]
        i = 0
        async def some_served(n: int) -> None:  # traffic flows between faults
            target, deadline = self.served + n, time.monotonic() + 30
            while self.served < target and time.monotonic() < deadline:
                await asyncio.sleep(0.05)

        while time.monotonic() < t_end or i < len(kinds):  # each kind at least once
            await some_served(self.workers)
            await self._fault(kinds[i % len(kinds)])
            i += 1
        await some_served(self.workers)
        stop.set()

    # ---- checks
    async def greedy(self) -> list[str]:
        async with httpx.AsyncClient(timeout=120) as client:
            rs = await asyncio.gather(*(client.post(self.c.url + "/v1/completions", json=dict(
                prompt=p, max_tokens=24, temperature=0.0, ignore_eos=True)) for p in GREEDY))
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
        return [r.json()["choices"][0]["text"] for r in rs]

    def leaked(self) -> list[str]:
        ports = "|".join(str(p) for p in [*self.c.stage_ports, self.c.port])
        p = subprocess.run(["pgrep", "-af", f"ppspec.cli (stage|router) .*--port ({ports})( |$)"],
                           capture_output=True, text=True)
        return p.stdout.splitlines()

    def run(self) -> dict:
        t0 = time.monotonic()
        self.c.start()
        try:
            before = asyncio.run(self.greedy())

            async def soak():
                stop = asyncio.Event()
                await asyncio.gather(self.traffic(stop), self.chaos(stop, time.monotonic() + self.duration))
                await self._wait_healthy()

            asyncio.run(soak())
            after = asyncio.run(self.greedy())
            infos = self.c.wait_rows_free(timeout=60)
            held = [(i.rows_in_use, i.kv_pages_used, i.pending_commits) for i in infos]
        finally:
            self.c.stop()
        leaked = self.leaked()
        checks = {
            "answers within the rules": not self.violations,
            "greedy answers unchanged": after == before,
            "nothing held on the stages": all(h == (0, 0, 0) for h in held),
            "no process left": not leaked,
            "every fault kind ran": {f.split(" (")[0].split(" stage")[0] for f in self.faults}
            >= {"pause", "kill", "replace router"},
            "traffic served between faults": self.served >= self.workers * (len(self.faults) + 1),
        }
        return {"ok": all(checks.values()), "checks": checks, "seconds": round(time.monotonic() - t0, 1),
                "faults": self.faults, "outcomes": dict(sorted(self.outcomes.items())),
                "violations": self.violations[:20], "held (rows, pages, pending) per stage": held, "leaked": leaked}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint with an MTP head and a tokenizer (default: a random one)")
    ap.add_argument("--duration", type=float, default=300.0, help="seconds of traffic and faults")
    ap.add_argument("--workers", type=int, default=6, help="clients at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default=None, help="where the processes' logs go (default: a temporary folder)")
    a = ap.parse_args(argv)
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="ppspec-chaos-")
    model = a.model
    if model is None:
        from checkpoints import make_checkpoint

        model = make_checkpoint("qwen3_5_ratio2_7l", log_dir)
    summary = Soak(model, a.duration, log_dir, a.workers, a.seed).run()
    print(json.dumps(summary, indent=1))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
