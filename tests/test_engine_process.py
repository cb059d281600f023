"""The engine behind a socket (router/engine_proc.py): ``EngineClient`` in front of an
``EngineServer`` serving a real ``Engine`` (PP2 + MTP on the demo checkpoint, in process)
gives PP1's greedy tokens without speculation, the engine's errors with their class and
fields, aborts that free the rows, the engine's metrics, and 503s once the engine is gone.
(``ppspec serve`` / ``ppspec router`` run it in a child process: every test that starts
them, tests/test_pipeline.py among them, goes through it.)"""
import asyncio
import socket

import pytest

from ppspec.argtypes import DEMO_MODEL
from ppspec.bench.served_vs_engine import children_of
from ppspec.router import types
from ppspec.router.engine import Engine
from ppspec.router.engine_proc import EngineClient, EngineServer, _Error, _output_fields
from ppspec.router.llm import LLM
from ppspec.router.pipeline import InProcessPipeline
from ppspec.router.types import ContextLengthError, RequestOutput, SamplingParams, StageDownError

pytestmark = pytest.mark.slow

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [40, 41, 42, 43, 44, 45, 46], [100, 7, 100, 7, 100, 7]]


@pytest.fixture(scope="module")
def reference():
    """PP1 without speculation, greedy: the tokens every other path must give."""
    llm = LLM(DEMO_MODEL, max_rows=4)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    return [o.token_ids for o in outs]


def _served(body):
    """Run ``body(client, engine)`` against a PP2 + MTP engine behind a socket pair, both
    ends on one event loop; returns what it returns."""
    from prometheus_client import CollectorRegistry

    from ppspec.router.metrics import RouterMetrics

    async def main():
        pipe = InProcessPipeline.build(DEMO_MODEL, 2, max_rows=8, kv_tokens=4096, num_speculative_steps=3, use_mtp=True)
        metrics = RouterMetrics(CollectorRegistry(), num_stages=2, num_spec_tokens=3)
        engine = Engine(pipe, model_name="demo", tokenizer=None, speculative_algorithm="mtp", metrics=metrics)
        await engine.start()
        a, b = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=a)
        server = asyncio.ensure_future(EngineServer(engine, reader, writer, metrics.registry).serve())
        client = EngineClient([], tokenizer=None, model_name="demo")
        await client.connect(b)
        try:
            return await body(client, engine, server)
        finally:
            if not server.done():
                await client.close()
                await asyncio.wait_for(server, 60)

    return asyncio.run(main())


async def _tokens(client, rid, prompt, **kw):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **kw)
    ids, last = [], None
    async for out in client.generate(rid, prompt, params):
        ids += out.new_token_ids
        last = out
    return ids, last


def test_the_client_gives_pp1_tokens_and_the_engines_metrics(reference):
    async def body(client, engine, server):
        assert client.max_model_len == engine.max_model_len > 0 and client.spec == "mtp"
        got = await asyncio.gather(*(_tokens(client, f"r{i}", p) for i, p in enumerate(PROMPTS)))
        await client.refresh_metrics()
        from prometheus_client import generate_latest

        return got, generate_latest(client.registry).decode(), (client.health(), engine.health())

    got, text, health = _served(body)
    assert [ids for ids, _ in got] == reference
    assert all(last.finish_reason == "length" and last.num_output_tokens == 24 for _, last in got)
    finished = [line for line in text.splitlines() if line.startswith("ppspec:request_success_total")]
    assert any('finished_reason="length"' in line and line.endswith(" 4.0") for line in finished), finished
    assert health[0] == health[1] and health[0][0]


def test_errors_cross_with_their_class_and_fields():
    async def body(client, engine, server):
        with pytest.raises(ContextLengthError) as too_long:
            await _tokens(client, "long", [5] * (engine.max_model_len + 1))
        with pytest.raises(types.InvalidRequestError) as bad:
            await _tokens(client, "bad", [5, 6], top_p=7.0)
        return too_long.value, bad.value

    too_long, bad = _served(body)
    assert too_long.http_status == 400 and too_long.code == "context_length_exceeded" and too_long.param == "messages"
    assert too_long.limit > 0 and "maximum context length" in str(too_long)
    assert bad.param == "top_p" and bad.http_status == 400
    for e in (StageDownError("stage 1 is down"), types.QueueFullError("full"), ValueError("bug")):
        back = _Error.of(e).exception()
        assert isinstance(back, types.EngineError) and back.http_status == getattr(e, "http_status", 500)
        assert str(e) in str(back)


def test_an_abandoned_stream_frees_its_rows(reference):
    async def body(client, engine, server):
        params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        it = client.generate("cut", PROMPTS[0], params)
        first = await it.__anext__()
        await it.aclose()  # the HTTP client went away
        for _ in range(500):  # the abort crosses, the round in flight comes back (with MTP the
            # next verify follows the last one: async scheduling), the engine releases the rows
            if not engine.scheduler.requests and not engine.outstanding and engine.settled():
                break
            await asyncio.sleep(0.01)
        rows = [r.info()["rows_in_use"] for r in engine.pipeline.runners]
        after = await _tokens(client, "next", PROMPTS[1])
        return first, rows, after

    first, rows, (ids, _) = _served(body)
    assert first.new_token_ids and rows == [0, 0]
    assert ids == reference[1]  # the engine serves on


def test_requests_end_with_503_when_the_engine_goes_away():
    async def body(client, engine, server):
        params = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
        it = client.generate("r", PROMPTS[0], params)
        await it.__anext__()
        server.cancel()  # the engine process ends: its end of the socket closes
        await asyncio.gather(server, return_exceptions=True)
        with pytest.raises(StageDownError):
            async for _ in it:
                pass
        for _ in range(100):
            if not client.health()[0]:
                break
            await asyncio.sleep(0.01)
        health = client.health()
        with pytest.raises(StageDownError):
            await _tokens(client, "after", PROMPTS[1])
        with pytest.raises(StageDownError):
            await client.flush_cache()
        return health

    ok, detail = _served(body)
    assert not ok and "engine process ended" in detail


class _ScriptedEngine:
    """The engine process's end of the socket, played by the test: it says ``ready``, then
    only what the test sends (:meth:`say`); ``heard`` collects what the client sent."""

    def __init__(self, reader, writer):
        self.reader, self.writer, self.heard = reader, writer, []
        self._listen = asyncio.ensure_future(self._read())

    async def _read(self):
        from ppspec.router.engine_proc import _read

        try:
            while True:
                self.heard.append(await _read(self.reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    def say(self, *msg):
        from ppspec.router.engine_proc import _write

        _write(self.writer, msg)


def _scripted(body):
    """Run ``body(client, engine)``: an ``EngineClient`` in front of a :class:`_ScriptedEngine`."""
    from ppspec.router.engine_proc import _write

    async def main():
        a, b = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=a)
        _write(writer, ("ready", {"max_model_len": 64, "spec": "none", "prefix_caching": False,
                                  "health": (True, "1 stage serving"), "eos": [2], "frozen": 0}))
        engine = _ScriptedEngine(reader, writer)
        client = EngineClient([], tokenizer=None, model_name="demo")
        await client.connect(b)
        try:
            return await body(client, engine)
        finally:
            client.closing = True
            await client.close()
            writer.close()

    return asyncio.run(main())


def test_a_hung_engine_ends_the_requests_and_calls_in_flight_and_aborts_them():
    """The engine process stops answering (alive: its socket stays open) with a stream and
    a cache flush in flight. Once it has been silent ENGINE_HUNG_S (the silence is set back
    here, not waited for) both end with StageDownError naming the silence, the request is
    aborted in the engine (the message waits for it in the socket), and what it says after
    it resumes goes nowhere; new calls are refused at once."""
    from ppspec.router import engine_proc

    async def body(client, engine):
        stream = client.generate("r", [5, 6], SamplingParams(max_tokens=8))
        first = asyncio.ensure_future(stream.__anext__())
        flush = asyncio.ensure_future(client.flush_cache())
        await asyncio.sleep(0.1)
        engine.say("out", [("r", _output_fields(RequestOutput("r", [7])))])
        got = (await asyncio.wait_for(first, 30)).new_token_ids
        client._heard -= engine_proc.ENGINE_HUNG_S + 1  # the engine has been silent since, as if stopped
        with pytest.raises(StageDownError) as ended:
            await asyncio.wait_for(stream.__anext__(), 30)
        with pytest.raises(StageDownError) as flushed:
            await asyncio.wait_for(flush, 30)
        with pytest.raises(StageDownError) as refused:
            await client.flush_cache()
        await asyncio.sleep(0.1)  # the abort reaches the engine's end of the socket
        return got, ended.value, flushed.value, refused.value, list(engine.heard), dict(client.queues)

    got, ended, flushed, refused, heard, queues = _scripted(body)
    assert got == [7]
    assert "the engine process has not answered for" in str(ended) and "hung or stopped" in str(ended)
    assert ended.http_status == 503
    assert "has not answered" in str(flushed) and "has not answered" in str(refused)
    assert [m[0] for m in heard] == ["add", "call", "abort"] and heard[2][1:] == ("r", "abort"), heard
    assert queues == {}


def test_an_engine_that_keeps_its_heartbeat_never_has_its_requests_ended(monkeypatch):
    """A healthy engine whose request gets no token for longer than ENGINE_HUNG_S (a long
    prefill; the bound is cut to 0.5 s here) but whose heartbeat comes: the request waits
    and gets its tokens. The client's clock is the test's (4 s of heartbeats 0.1 s apart,
    each read before the clock moves on), so a stalled test process cannot pass for a
    silent engine."""
    import types

    from ppspec.router import engine_proc

    now = [0.0]
    monkeypatch.setattr(engine_proc, "time", types.SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(engine_proc, "ENGINE_HUNG_S", 0.5)
    monkeypatch.setattr(engine_proc, "HEARTBEAT_S", 0.01)  # the silence checks, in real time

    async def heard_now(client):
        while client._heard != now[0]:
            await asyncio.sleep(0.005)

    async def body(client, engine):
        outs = asyncio.ensure_future(_collect_ids(client.generate("r", [5, 6], SamplingParams(max_tokens=2))))
        for _ in range(40):  # 4 s of heartbeats on the client's clock, no output
            now[0] += 0.1
            engine.say("health", True, "1 stage serving")
            await asyncio.wait_for(heard_now(client), 30)
            await asyncio.sleep(0.02)  # the silence checked meanwhile
        engine.say("out", [("r", _output_fields(RequestOutput("r", [7, 8], "length")))])
        return await asyncio.wait_for(outs, 30), [m[0] for m in engine.heard]

    ids, heard = _scripted(body)
    assert ids == [7, 8] and heard == ["add"]



def test_a_paused_http_server_does_not_take_the_engine_for_hung():
    """The HTTP server (this client) paused past ENGINE_HUNG_S (SIGSTOP, then SIGCONT)
    while the engine went on: the engine's messages wait unread in the socket, and the
    resumed loop runs its silence check before its read (uvloop runs due timers first).
    What waits in the socket is the engine speaking: neither ``/health`` nor the silence
    check may take it for hung (it ended the requests in flight with 503 "the engine
    process has not answered ... hung or stopped" and aborted them in a healthy engine).
    Once read, a silence is a silence again."""
    from ppspec.router import engine_proc

    async def body(client, engine):
        outs = asyncio.ensure_future(_collect_ids(client.generate("r", [5, 6], SamplingParams(max_tokens=2))))
        await asyncio.sleep(0.1)
        # no await from here on: the client's loop is as if paused with the engine's
        # message in the socket, its last message heard long ago
        engine.say("out", [("r", _output_fields(RequestOutput("r", [7, 8], "length")))])
        client._heard -= engine_proc.ENGINE_HUNG_S + 1
        waiting = client._silent(), client.health()
        ids = await asyncio.wait_for(outs, 30)
        client._heard -= engine_proc.ENGINE_HUNG_S + 1  # nothing waits now: silent
        return waiting, ids, client.health(), [m[0] for m in engine.heard]

    (silent, health), ids, after, heard = _scripted(body)
    assert silent < engine_proc.ENGINE_SILENT_S and health[0], (silent, health)
    assert ids == [7, 8] and heard == ["add"]
    assert not after[0] and "has not answered" in after[1]


async def _collect_ids(outs):
    ids = []
    async for out in outs:
        ids += out.new_token_ids
    return ids


def _extra_http_servers(router_pid):
    """PIDs of the router's extra HTTP servers (its children with ``--engine-address``)."""
    return [pid for pid, argv in children_of(router_pid) if "--engine-address" in argv]


def test_two_http_servers_share_the_engine_and_one_dying_frees_its_rows(reference, tmp_path):
    """``--api-server-count 2``: the second HTTP server answers alone while the first is
    paused (PP1's tokens); SIGKILLed with streams open, its requests' rows come free on
    every stage and the first serves on."""
    import os
    import signal
    import threading

    import httpx

    from cluster import Cluster

    def completion(url, i):
        r = httpx.post(url + "/v1/completions", timeout=120, json=dict(
            prompt=PROMPTS[i], max_tokens=24, temperature=0, ignore_eos=True, return_token_ids=True))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    with Cluster(DEMO_MODEL, 2, "mtp", router_args=["--api-server-count", "2"], log_dir=str(tmp_path)) as c:
        router = c.procs["router"].pid
        (extra,) = _extra_http_servers(router)
        os.kill(router, signal.SIGSTOP)  # only the second HTTP server accepts now
        try:
            assert [completion(c.url, i) for i in range(len(PROMPTS))] == reference
            opened, streams = threading.Barrier(5), []

            def stream():
                with httpx.stream("POST", c.url + "/v1/completions", timeout=120, json=dict(
                        prompt=PROMPTS[0], max_tokens=2000, temperature=0, ignore_eos=True, stream=True)) as r:
                    lines = r.iter_lines()
                    streams.append(next(lines))
                    opened.wait(60)
                    try:
                        for _ in lines:
                            pass
                    except httpx.HTTPError:
                        pass

            threads = [threading.Thread(target=stream) for _ in range(4)]
            for t in threads:
                t.start()
            opened.wait(60)
            assert c.stage_infos()[0].rows_in_use == 4
            os.kill(extra, signal.SIGKILL)
            for t in threads:
                t.join(60)
        finally:
            os.kill(router, signal.SIGCONT)
        infos = c.wait_rows_free()
        assert [i.rows_in_use for i in infos] == [0, 0] and len(streams) == 4
        assert completion(c.url, 1) == reference[1]
        metrics = httpx.get(c.url + "/metrics", timeout=10).text
    # ended by the engine when their HTTP server went away, not run to their length
    assert 'ppspec:request_success_total{finished_reason="abort"} 4.0' in metrics, metrics


def test_the_router_exits_when_its_engine_process_dies(tmp_path):
    """The engine process killed: its HTTP server answers /health 503 naming it, then
    exits with status 1 (a supervisor, ``ppspec serve`` among them, sees the router gone)
    rather than serving 503 for good."""
    import os
    import signal

    from cluster import Cluster

    with Cluster(DEMO_MODEL, 1, log_dir=str(tmp_path)) as c:
        router = c.procs["router"]
        engine = next(pid for pid, argv in children_of(router.pid) if "--engine-fd" in argv)
        os.kill(engine, signal.SIGKILL)
        assert router.wait(60) == 1
    log = (tmp_path / "router.log").read_text()
    assert "the engine process ended (exit status -9)" in log, log


def test_requests_in_flight_end_with_a_clear_503_when_the_engine_process_dies(tmp_path):
    """The engine process killed with a stream and a plain request in flight: the stream
    ends with an error event naming the engine and ``[DONE]``, the plain request gets a
    503 whose body says the same, as vLLM's requests end with EngineDeadError."""
    import json
    import os
    import signal
    import threading

    import httpx

    from cluster import Cluster

    with Cluster(DEMO_MODEL, 1, log_dir=str(tmp_path)) as c:
        body = dict(prompt=PROMPTS[0], max_tokens=4000, temperature=0, ignore_eos=True)
        engine = next(pid for pid, argv in children_of(c.procs["router"].pid) if "--engine-fd" in argv)
        plain = {}
        waiting = threading.Thread(target=lambda: plain.update(
            r=httpx.post(c.url + "/v1/completions", json=body, timeout=120)))
        waiting.start()
        events = []
        with httpx.stream("POST", c.url + "/v1/completions", json=dict(body, stream=True), timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:  # tokens flow: both requests run
                        os.kill(engine, signal.SIGKILL)
        waiting.join(120)
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert "engine process ended" in error["message"], error
    assert plain["r"].status_code == 503 and "engine process ended" in plain["r"].json()["error"]["message"], \
        plain["r"].text


def test_a_stopped_engine_process_turns_health_503_and_refuses_new_requests(tmp_path):
    """The engine process stopped (SIGSTOP; a deadlock looks the same from outside): its
    HTTP server used to answer /health 200 from the engine's last word and queue new
    requests behind it for ever. It now hears a heartbeat every HEARTBEAT_S; after
    ENGINE_SILENT_S without one /health is 503 naming the engine and a new request a 503.
    Resumed, the engine serves again."""
    import os
    import signal
    import time

    import httpx

    from cluster import Cluster
    from ppspec.router.engine_proc import ENGINE_SILENT_S

    with Cluster(DEMO_MODEL, 1, log_dir=str(tmp_path)) as c:
        body = dict(prompt=PROMPTS[0], max_tokens=4, temperature=0, ignore_eos=True)
        before = httpx.post(c.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        engine = next(pid for pid, argv in children_of(c.procs["router"].pid) if "--engine-fd" in argv)
        os.kill(engine, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + ENGINE_SILENT_S + 60
            while (h := httpx.get(c.url + "/health", timeout=10)).status_code == 200:
                assert time.monotonic() < deadline, "/health stayed 200 with the engine process stopped"
                time.sleep(0.5)
            assert h.status_code == 503 and "the engine process has not answered" in h.text, h.text
            r = httpx.post(c.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 503 and "the engine process has not answered" in r.text, r.text
        finally:
            os.kill(engine, signal.SIGCONT)
        c.wait_healthy(60)
        after = httpx.post(c.url + "/v1/completions", json=body, timeout=60)
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == before, after.text


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_an_engine_process_still_starting_ends_with_its_http_server(sig):
    """The router stopped or killed while its engine process waits for a stage that never
    serves: the engine process ends too. It used to wait out its stages' timeout (300 s)
    holding the router's stderr, and ``ppspec serve`` with a stage that refused its
    settings hung its caller that long."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from cluster import free_port

    router = subprocess.Popen([sys.executable, "-m", "ppspec.cli", "router", "--stages", f"127.0.0.1:{free_port()}",
                               "--port", str(free_port())], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (engine := [pid for pid, argv in children_of(router.pid) if "--engine-fd" in argv]):
        assert router.poll() is None and time.monotonic() < deadline, "the router started no engine process"
        time.sleep(0.2)
    time.sleep(2.0)  # into its start: the engine has sent a stage its first health check
    os.kill(router.pid, getattr(signal, sig))
    # stderr reaches its end only once every process holding it (the engine process too) ended
    _, err = router.communicate(timeout=60)
    with pytest.raises(ProcessLookupError):
        for _ in range(100):  # reaped by init, the pid is gone within moments
            os.kill(engine[0], 0)
            time.sleep(0.1)
    assert "stopped while starting" in err, err


def test_several_http_servers_need_the_engine_process():
    import subprocess
    import sys

    from cluster import free_port

    p = subprocess.run([sys.executable, "-m", "ppspec.cli", "router", "--stages", f"127.0.0.1:{free_port()}",
                        "--port", str(free_port()), "--api-server-count", "2", "--no-engine-process"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--api-server-count above 1 needs --engine-process" in p.stderr, p.stderr


def test_ppspec_serve_with_two_http_servers_starts_and_serves(reference):
    """``ppspec serve --api-server-count 2``: ``/health`` turns 200 (the extra HTTP server
    reached the engine process, whose listening socket stayed open) and completions through
    the shared port give PP1's greedy tokens. The engine process once left its server for
    the extra HTTP servers unreferenced: garbage-collected, it closed the socket, and the
    extra server's connection waited unaccepted, so ``/health`` never turned 200."""
    import httpx

    from ppspec.bench.serving import serving

    args = ["--model", DEMO_MODEL, "--pp-size", "1", "--speculative-algorithm", "mtp", "--api-server-count", "2"]
    with serving(args, 180, "api2") as (url, proc):
        got = []
        for i in range(2 * len(PROMPTS)):
            r = httpx.post(url + "/v1/completions", timeout=120, json=dict(
                prompt=PROMPTS[i % len(PROMPTS)], max_tokens=24, temperature=0, ignore_eos=True,
                return_token_ids=True))
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["token_ids"])
    assert got == reference + reference
