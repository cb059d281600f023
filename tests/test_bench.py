"""``ppspec bench`` against a stub OpenAI server whose timings and counts we know.

The stub (a raw ASGI app on uvicorn in a background thread, on a free loopback port)
streams, for a request with ``max_tokens = M``: nothing for FIRST s, then chunks of K
tokens (the word "tok ") every GAP s until M tokens are out, then a usage chunk and
``[DONE]``. So a request has ceil(M/K) chunks, TTFT = FIRST, ITL = GAP,
e2e = FIRST + GAP * (chunks - 1), TPOT = GAP * (chunks - 1) / (M - 1). Its /metrics
serves spec-decode counters that grow by known amounts per request.
"""
from __future__ import annotations

import asyncio
import collections
import json
import math
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import httpx
import pytest
import uvicorn

from ppspec.bench import BenchError
from ppspec.bench import client as client_mod
from ppspec.bench.cli import main as bench_main
from ppspec.bench.dataset import (
    TokenCounter,
    first_exchange,
    load_sharegpt,
    parse_truncated_json_array,
    sample_sharegpt,
)
from ppspec.bench.metrics import parse_spec_counters, percentile, spec_decode_summary, summarize_ms
from ppspec.bench.runner import arrival_offsets, normalize_base_url
from ppspec.router.first_tokens import FIELDS  # the rows the stub serves, as a ppspec router does

FIRST = 0.050  # s to the first content chunk
GAP = 0.020  # s between chunks
# No test asserts a wall-clock window: the client's figures are checked against the times
# the stub recorded on the same clock (a client latency cannot be shorter than the stub's
# own, as the client stamps before sending and after receiving), and the arithmetic of the
# figures against timestamps injected into ``compute_results``.
MODEL = "stub-model"

# Counters of the stub's /metrics: a baseline, and what each finished request adds.
BASE = {"drafts": 100.0, "draft_tokens": 300.0, "accepted": 50.0, "pos": [30.0, 15.0, 5.0]}
PER_REQ = {"drafts": 4.0, "draft_tokens": 12.0, "accepted": 6.0, "pos": [3.0, 2.0, 1.0]}


# --------------------------------------------------------------------------- stub server



class Stub:
    """State and options of one stub server."""

    def __init__(self, tokens_per_chunk=1, usage=True, metrics="spec", mode="openai", trace=False):
        self.k = tokens_per_chunk
        self.trace = trace  # serve GET /v1/trace/first_tokens as a ppspec router does
        self.traced: list[list] = []  # its rows: one per POST, stamped as the router's fields
        self.usage = usage
        self.metrics = metrics  # "spec" | "plain" | "404"
        # "openai" | "html" | "html-completions" | "unknown-model" | "open-after-done" (the
        # stream's body does not end after [DONE]: the stub waits up to 60 s for the client to go)
        self.mode = mode
        self.gone_after_done = 0  # open-after-done: streams the client closed itself
        self.requests: list[dict] = []  # bodies of POSTs
        self.arrivals: list[float] = []  # perf_counter at each POST (same clock as the client)
        # per prompt: perf_counter at its POST and at the sends of its text chunks
        self.times: dict[str, tuple[float, list[float]]] = {}
        self.open = self.max_open = 0  # streams open now / at most at once
        self.clients: list[tuple] = []  # (host, port) of each POST's connection
        self.spans: list[tuple] = []  # (host, port, handler entered, last byte sending) of each stream (perf_counter s)
        self.done = 0
        self.lock = threading.Lock()

    def metrics_text(self) -> str:
        n = self.done
        lines = [
            "# HELP ppspec:num_requests_running Running requests.",
            "# TYPE ppspec:num_requests_running gauge",
            'ppspec:num_requests_running{model_name="stub-model"} 0.0',
            "# HELP ppspec:e2e_request_latency_seconds E2E latency.",
            "# TYPE ppspec:e2e_request_latency_seconds histogram",
            'ppspec:e2e_request_latency_seconds_bucket{le="1.0"} 3.0',
            'ppspec:e2e_request_latency_seconds_bucket{le="+Inf"} 3.0',
            "ppspec:e2e_request_latency_seconds_count 3.0",
            "ppspec:e2e_request_latency_seconds_sum 1.5",
        ]
        if self.metrics == "spec":
            def counter(name, total, labels=""):
                # split over two stages to check that label sets are summed
                sep = "," if labels else ""
                return [
                    f"# TYPE ppspec:spec_decode_{name} counter",
                    f'ppspec:spec_decode_{name}_total{{stage="0"{sep}{labels}}} {total * 0.25}',
                    f'ppspec:spec_decode_{name}_total{{stage="1"{sep}{labels}}} {total * 0.75}',
                    f'ppspec:spec_decode_{name}_created{{stage="0"{sep}{labels}}} 1.7e9',
                ]
            lines += counter("num_drafts", BASE["drafts"] + n * PER_REQ["drafts"])
            lines += counter("num_draft_tokens", BASE["draft_tokens"] + n * PER_REQ["draft_tokens"])
            lines += counter("num_accepted_tokens", BASE["accepted"] + n * PER_REQ["accepted"])
            lines.append("# TYPE ppspec:spec_decode_num_accepted_tokens_per_pos counter")
            for i, (b, d) in enumerate(zip(BASE["pos"], PER_REQ["pos"])):
                lines.append(
                    f'ppspec:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {b + n * d}'
                )
        return "\n".join(lines) + "\n"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path, method = scope["path"], scope["method"]

        async def reply(status, ctype, payload: bytes):
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", ctype.encode())]})
            await send({"type": "http.response.body", "body": payload})

        html = b"<!doctype html><html><body><h1>Welcome to nginx!</h1></body></html>"
        if self.mode == "html":
            return await reply(200, "text/html; charset=utf-8", html)
        if method == "GET" and path == "/v1/models":
            models = {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "stub"}]}
            return await reply(200, "application/json", json.dumps(models).encode())
        if method == "GET" and path == "/v1/trace/first_tokens" and self.trace:
            since = int(urllib.parse.parse_qs(scope["query_string"].decode()).get("since", ["0"])[0])
            with self.lock:
                got = {"total": len(self.traced), "fields": list(FIELDS),
                       "rows": [r for r in self.traced if r[0] >= since]}
            return await reply(200, "application/json", json.dumps(got).encode())
        if method == "GET" and path == "/metrics":
            if self.metrics == "404":
                return await reply(404, "text/plain", b"Not Found")
            return await reply(200, "text/plain; version=0.0.4", self.metrics_text().encode())
        if method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
            if self.mode == "html-completions":
                return await reply(200, "text/html", html)
            req = json.loads(body)
            if self.mode == "unknown-model":
                err = {"error": {"message": f"The model `{req['model']}` does not exist.",
                                 "type": "NotFoundError", "param": "model", "code": 404}}
                return await reply(404, "application/json", json.dumps(err).encode())
            with self.lock:
                self.requests.append(req)
                self.arrivals.append(time.perf_counter())
                conn = tuple(scope.get("client") or ())
                self.clients.append(conn)
                self.open += 1
                self.max_open = max(self.max_open, self.open)
            try:
                return await self.stream(req, path.endswith("chat/completions"), send, receive,
                                         span=(conn, time.perf_counter()))
            finally:
                with self.lock:
                    self.open -= 1
        return await reply(404, "application/json", b'{"detail": "Not Found"}')

    async def stream(self, req, chat, send, receive, span=None):
        t0 = time.perf_counter()
        m = int(req["max_tokens"])
        prompt = req["messages"][0]["content"] if chat else req["prompt"]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})

        async def event(obj):
            data = obj if isinstance(obj, str) else json.dumps(obj)
            await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})

        if chat:  # the opening role-only chunk: must not count as the first token
            await event({"object": "chat.completion.chunk",
                         "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        sent, i = 0, 0
        sends: list[float] = []
        self.times[prompt] = (t0, sends)  # the test request's entry is replaced by the run's
        while sent < m:
            await asyncio.sleep(max(0.0, t0 + FIRST + i * GAP - time.perf_counter()))
            sends.append(time.perf_counter())
            if i == 0 and self.trace:
                with self.lock:  # queued at t0, admitted 1 ms later per request before it, sent 2 ms on
                    k0 = len(self.traced)
                    adm = t0 + 0.001 * (k0 + 1)
                    self.traced.append([k0, t0, adm, adm, adm + 0.002, sends[0], 1, 0, 1, 0, 0])
            k = min(self.k, m - sent)
            text = "tok " * k
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
            choice["finish_reason"] = "length" if sent + k == m else None
            await event({"object": "chat.completion.chunk" if chat else "text_completion", "choices": [choice]})
            sent += k
            i += 1
        if self.usage and req.get("stream_options", {}).get("include_usage"):
            n_in = len(prompt.split())
            await event({"choices": [], "usage": {"prompt_tokens": n_in, "completion_tokens": m,
                                                  "total_tokens": n_in + m}})
        with self.lock:
            self.done += 1
        await event("[DONE]")
        if self.mode == "open-after-done":
            try:
                msg = await asyncio.wait_for(receive(), 60)
                self.gone_after_done += msg["type"] == "http.disconnect"
                return
            except asyncio.TimeoutError:
                pass
        if span is not None:  # just before the stream's last byte: the next request on its
            # connection can only come after the client read it
            with self.lock:
                self.spans.append((*span[0], span[1], time.perf_counter()))
        await send({"type": "http.response.body", "body": b""})


class Serve:
    """Run an ASGI app on uvicorn in a background thread on a free loopback port."""

    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 10
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("stub server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(5)
        self.sock.close()


# --------------------------------------------------------------------------- helpers

PROMPT_WORDS = [5, 6, 7, 8, 9, 10, 11, 12]
REPLY_WORDS = [30, 31, 32, 33, 34, 35, 36, 37]


def write_dataset(path: Path) -> Path:
    """A ShareGPT-format file, cut off mid-string like the packaged one."""
    recs = []
    for i, (p, r) in enumerate(zip(PROMPT_WORDS, REPLY_WORDS)):
        recs.append({"id": f"c{i}", "conversations": [
            {"from": "human", "value": " ".join(f"p{i}w{j}" for j in range(p))},
            {"from": "gpt", "value": " ".join(f"r{i}w{j}" for j in range(r))},
        ]})
    text = json.dumps(recs, indent=2)
    text = text[: text.rindex("]")]  # drop the closing bracket...
    text += ',\n  {"id": "broken", "conversations": [{"from": "human", "value": "cut off he'
    path.write_text(text)
    return path


@pytest.fixture
def dataset(tmp_path):
    return write_dataset(tmp_path / "sharegpt.json")


def run_bench(url, dataset, tmp_path, *extra, name="result.json", progress=False):
    out = tmp_path / name
    argv = ["--base-url", url, "--dataset", "sharegpt", "--dataset-path", str(dataset),
            "--seed", "3", "--output", str(out), "--save-detailed", *extra]
    if not progress:
        argv.append("--no-progress")
    rc = bench_main(argv)
    assert rc == 0
    return json.loads(out.read_text())


def prompt_of(stub, q):
    """The prompt of a result row: the dataset's prompts differ in their number of words."""
    by_words = {len(p.split()): p for p in (x.get("prompt") or x["messages"][0]["content"] for x in stub.requests)}
    return by_words[q["input_tokens"]]


def assert_after_stub(r, stub):
    """Each request's TTFT and e2e are at least the stub's own, from its POST to its first /
    last text chunk (recorded on the client's clock: the client stamps before sending and after
    receiving), which in turn are at least the stub's schedule (less a timer's early firing);
    e2e = TTFT + sum(ITL)."""
    for q in r["requests"]:
        arrived, sends = stub.times[prompt_of(stub, q)]
        assert q["ttft_ms"] >= (sends[0] - arrived) * 1e3 and sends[0] - arrived >= FIRST - 1e-3
        assert q["e2el_ms"] >= (sends[-1] - arrived) * 1e3
        assert q["chunks"] == len(sends) and len(q["itl_ms"]) == len(sends) - 1
        assert math.isclose(q["e2el_ms"], q["ttft_ms"] + sum(q["itl_ms"]), rel_tol=1e-9)


@pytest.fixture(autouse=True)
def _fast_gil_handoff():
    # stub server and client share one process: hand the GIL over quickly
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    yield
    sys.setswitchinterval(old)


# --------------------------------------------------------------------------- ShareGPT parser


def test_parse_truncated_json_array():
    text = '[\n {"a": 1},\n {"b": [1, 2, {"c": "x,]"}]},\n {"d": "cut off in the mid'
    assert parse_truncated_json_array(text) == [{"a": 1}, {"b": [1, 2, {"c": "x,]"}]}]
    assert parse_truncated_json_array('[{"a": 1}, {"b": 2}]') == [{"a": 1}, {"b": 2}]
    assert parse_truncated_json_array('[{"a": 1}, {"b": 2') == [{"a": 1}]
    assert parse_truncated_json_array("[]") == []
    assert parse_truncated_json_array("[") == []
    with pytest.raises(BenchError):
        parse_truncated_json_array('{"not": "an array"}')


def test_sample_from_truncated_file(dataset):
    records = load_sharegpt(dataset)
    assert len(records) == len(PROMPT_WORDS)  # the broken tail is dropped
    counter = TokenCounter()
    s = sample_sharegpt(records, 5, seed=1, counter=counter)
    assert len(s) == 5 and len({x.prompt for x in s}) == 5
    for x in s:
        i = int(x.prompt.split()[0][1:].split("w")[0])
        assert x.prompt_len == PROMPT_WORDS[i] and x.output_len == REPLY_WORDS[i] == x.reference_len
    assert [x.prompt for x in sample_sharegpt(records, 5, 1, counter)] == [x.prompt for x in s]
    assert [x.prompt for x in sample_sharegpt(records, 5, 2, counter)] != [x.prompt for x in s]
    with pytest.raises(BenchError, match="only 6 usable prompts"):
        sample_sharegpt(records, 8, 0, counter, max_input_len=10)  # prompts of 11, 12 words skipped
    capped = sample_sharegpt(records, 6, 0, counter, max_output_len=32, max_input_len=10)
    assert {x.output_len for x in capped} <= {30, 31, 32} and max(x.reference_len for x in capped) > 32


def test_first_exchange_roles():
    conv = {"conversations": [{"from": "gpt", "value": "hello"}, {"from": "human", "value": "q"},
                              {"from": "gpt", "value": "a"}]}
    assert first_exchange(conv) == ("q", "a")
    assert first_exchange({"conversations": [{"from": "human", "value": "q"}]}) is None
    assert first_exchange({"conversations": [{"from": "human", "value": " "}, {"from": "gpt", "value": "a"}]}) is None
    assert first_exchange({"id": "x"}) is None


def test_tokenizer_counts(tmp_path, dataset):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # splits "a,b" into 3 tokens
    tok.save(str(tmp_path / "tokenizer.json"))
    counter = TokenCounter(tmp_path)
    assert counter.source == "tokenizer"
    assert counter.count("hello world, hello") == 4 and TokenCounter().count("hello world, hello") == 3
    s = sample_sharegpt(load_sharegpt(dataset), 3, 0, counter)
    assert all(x.prompt_len == len(x.prompt.split()) and x.output_len >= 30 for x in s)
    with pytest.raises(BenchError, match="no tokenizer.json"):
        TokenCounter(tmp_path / "nowhere")


def test_packaged_sharegpt_parses():
    records = load_sharegpt()
    assert 17_000 < len(records) < 18_500  # ~17,600 before the cut
    s = sample_sharegpt(records, 20, seed=0, counter=TokenCounter(), max_output_len=64)
    assert len(s) == 20 and all(4 <= x.output_len <= 64 for x in s)


# --------------------------------------------------------------------------- pure functions


def test_percentiles_and_summary():
    v = [1.0, 2.0, 3.0, 4.0]
    assert percentile(v, 50) == 2.5 and percentile(v, 0) == 1.0 and percentile(v, 100) == 4.0
    assert math.isclose(percentile(v, 90), 3.7)
    s = summarize_ms([0.001, 0.002, 0.003, 0.004])
    assert math.isclose(s["mean"], 2.5) and math.isclose(s["p50"], 2.5) and math.isclose(s["p99"], 3.97)
    assert summarize_ms([]) == {"mean": None, "std": None, "p50": None, "p90": None, "p99": None}


def test_figures_from_injected_timestamps():
    """TTFT, ITL, TPOT, e2e, throughput and concurrency are computed from the recorded
    timestamps alone: here injected, two waves of two requests of the stub's shape."""
    from ppspec.bench.client import RequestResult
    from ppspec.bench.dataset import SampleRequest
    from ppspec.bench.metrics import compute_results

    m, results, t0 = 10, [], 100.0
    for i, start in enumerate((0.0, 0.001, 0.230, 0.232)):
        chunks = [start + FIRST + j * GAP + 0.001 * i for j in range(m)]
        r = RequestResult(success=True, start=t0 + start, num_chunks=m, completion_tokens=m, prompt_tokens=5 + i,
                          ttft=chunks[0] - start, e2el=chunks[-1] - start,
                          itl=[b - a for a, b in zip(chunks, chunks[1:])])
        results.append(r)
    samples = [SampleRequest(prompt=f"p{i}", prompt_len=5 + i, output_len=m, reference_len=m) for i in range(4)]
    duration = 0.232 + FIRST + (m - 1) * GAP + 0.003
    f = compute_results(results, samples, duration, "server", None, start=t0)
    e2e = [FIRST + (m - 1) * GAP + 0.001 * i for i in range(4)]
    ttft = [FIRST + 0.001 * i for i in range(4)]
    assert f["completed"] == 4 and f["total_output_tokens"] == 4 * m and f["total_input_tokens"] == 26
    assert f["ttft_ms"]["mean"] == pytest.approx(sum(ttft) / 4 * 1e3)
    assert f["ttft_ms"]["p50"] == pytest.approx(percentile(sorted(ttft), 50) * 1e3)
    assert f["e2el_ms"]["mean"] == pytest.approx(sum(e2e) / 4 * 1e3)
    assert f["itl_ms"]["mean"] == pytest.approx(GAP * 1e3) and f["itl_ms"]["p99"] == pytest.approx(GAP * 1e3)
    assert f["tpot_ms"]["mean"] == pytest.approx(GAP * 1e3)
    assert f["mean_concurrency"] == pytest.approx(sum(e2e) / duration)
    assert f["request_throughput"] == pytest.approx(4 / duration)
    assert f["output_throughput"] == pytest.approx(4 * m / duration)
    assert [q["send_s"] for q in f["_per_request"]] == pytest.approx([0.0, 0.001, 0.230, 0.232])


def test_metrics_parsing_and_summary():
    stub = Stub()
    before = parse_spec_counters(stub.metrics_text())
    assert before == {"drafts": 100.0, "draft_tokens": 300.0, "accepted": 50.0,
                      "per_pos": {0: 30.0, 1: 15.0, 2: 5.0}}
    stub.done = 10
    after = parse_spec_counters(stub.metrics_text())
    s = spec_decode_summary(before, after)
    assert s["num_drafts"] == 40 and s["num_draft_tokens"] == 120 and s["num_accepted_tokens"] == 60
    assert s["mean_accept_length"] == 2.5 and s["acceptance_rate"] == 0.5
    assert s["accepted_per_position"] == [30.0, 20.0, 10.0]
    assert s["acceptance_per_position"] == [0.75, 0.5, 0.25]
    # a server without the counters, or without /metrics: nulls
    none = spec_decode_summary(parse_spec_counters("up 1\n"), parse_spec_counters("up 1\n"))
    assert none["mean_accept_length"] is None and none["acceptance_per_position"] is None
    assert spec_decode_summary(None, None, "GET /metrics: HTTP 404")["metrics_error"] == "GET /metrics: HTTP 404"
    # vLLM's names, with --metrics-prefix vllm:
    vllm = "vllm:spec_decode_num_drafts_total 8\nvllm:spec_decode_num_accepted_tokens_total 12\n"
    assert parse_spec_counters(vllm, "vllm:")["drafts"] == 8 and parse_spec_counters(vllm)["drafts"] is None


def test_reads_the_routers_own_metrics():
    """The counters as ppspec's router exports them (router/metrics.py) parse as intended."""
    from prometheus_client import CollectorRegistry

    import ppspec.router.metrics as rm
    m = rm.RouterMetrics(CollectorRegistry(), num_stages=2, num_spec_tokens=3)
    before = parse_spec_counters(m.exposition()[0].decode())
    m.on_verify_requests([3, 3, 3, 3], [4, 1, 2, 3])  # accepted 3 + 0 + 1 + 2 drafts
    s = spec_decode_summary(before, parse_spec_counters(m.exposition()[0].decode()))
    assert s["num_drafts"] == 4 and s["num_draft_tokens"] == 12 and s["num_accepted_tokens"] == 6
    assert s["mean_accept_length"] == 2.5 and s["acceptance_rate"] == 0.5
    assert s["acceptance_per_position"] == [0.75, 0.5, 0.25]


def test_arrivals_and_urls():
    a = arrival_offsets(2000, 10.0, seed=5)
    assert a == arrival_offsets(2000, 10.0, seed=5) and a != arrival_offsets(2000, 10.0, seed=6)
    assert a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:]))
    assert abs(a[-1] / 1999 - 0.1) < 0.01  # mean gap 1/rate
    assert arrival_offsets(3, math.inf, 0) == [0.0, 0.0, 0.0]
    assert normalize_base_url("http://h:8000/v1/") == "http://h:8000"
    assert normalize_base_url(" https://h/api ") == "https://h/api"
    for bad in ("h:8000", "ftp://h", "http://", "http://h:99999999"):
        with pytest.raises(BenchError):
            normalize_base_url(bad)


# --------------------------------------------------------------------------- runs against the stub


def test_one_token_chunks_concurrency(dataset, tmp_path):
    stub = Stub(tokens_per_chunk=1)
    m, n = 10, 4
    with Serve(stub) as srv:
        r = run_bench(srv.url, dataset, tmp_path, "--num-prompts", str(n), "--max-concurrency", "2",
                      "--max-output-len", str(m), "--label", "stub-k1")
    # what was asked of the server: the test request, then n requests capped at m tokens
    assert len(stub.requests) == n + 1
    for req in stub.requests[1:]:
        assert req["max_tokens"] == m and req["ignore_eos"] is True and req["stream"] is True
        assert req["model"] == MODEL and req["stream_options"] == {"include_usage": True}
    assert r["completed"] == n and r["failed"] == 0 and r["errors"] == []
    assert r["model"] == MODEL and r["label"] == "stub-k1" and r["max_concurrency"] == 2
    assert r["request_rate"] is None and r["command"].startswith("ppspec bench --base-url")
    # token counts (server usage)
    assert r["token_count_source"] == {"input": "server", "output": "server"}
    assert r["total_output_tokens"] == n * m
    assert r["total_input_tokens"] == sum(q["input_tokens"] for q in r["requests"])
    assert r["total_input_tokens"] == sum(len(q["prompt"].split()) for q in stub.requests[1:])
    assert r["tokens_per_chunk"] == 1.0
    for q in r["requests"]:
        assert q["output_tokens"] == m and q["chunks"] == m and len(q["itl_ms"]) == m - 1
        assert math.isclose(q["tpot_ms"], (q["e2el_ms"] - q["ttft_ms"]) / (m - 1), rel_tol=1e-9)
    # timings against the stub's recorded ones; at most 2 streams open at once, so the run
    # lasts at least two requests back to back, and the mean concurrency is at most 2
    assert_after_stub(r, stub)
    assert 1 <= stub.max_open <= 2
    # each concurrent slot keeps one connection and a stream read to its end gives it back:
    # the n requests ride on at most two connections (not one new connection each)
    assert len(set(stub.clients[1:])) <= 2 < n
    assert r["router_ttft"] is None  # no router's stamps from a server without them
    e2e = sorted(q["e2el_ms"] for q in r["requests"])
    assert r["duration_s"] * 1e3 >= e2e[0] + e2e[1]
    assert r["mean_concurrency"] <= 2.0 + 1e-9
    assert r["ttft_ms"]["p50"] <= r["ttft_ms"]["p90"] <= r["ttft_ms"]["p99"]
    assert math.isclose(r["request_throughput"], n / r["duration_s"])
    assert math.isclose(r["output_throughput"], n * m / r["duration_s"])
    assert math.isclose(r["input_throughput"], r["total_input_tokens"] / r["duration_s"])
    # speculative-decoding counters: only the n benchmark requests (not the test request)
    sd = r["spec_decode"]
    assert sd["num_drafts"] == n * PER_REQ["drafts"] and sd["num_accepted_tokens"] == n * PER_REQ["accepted"]
    assert sd["mean_accept_length"] == 2.5 and sd["acceptance_rate"] == 0.5
    assert sd["acceptance_per_position"] == [0.75, 0.5, 0.25] and sd["metrics_error"] is None


def test_multi_token_chunks_chat_no_usage(dataset, tmp_path):
    """Speculation-like chunks of 3 tokens on the chat endpoint; counts from the text."""
    stub = Stub(tokens_per_chunk=3, usage=False, metrics="plain")
    m, n = 10, 3  # chunks of 3, 3, 3, 1 tokens
    with Serve(stub) as srv:
        r = run_bench(srv.url + "/v1", dataset, tmp_path, "--num-prompts", str(n), "--endpoint", "chat",
                      "--max-output-len", str(m))
    assert all("messages" in q for q in stub.requests)
    assert r["completed"] == n and r["endpoint"] == "chat"
    assert r["token_count_source"] == {"input": "whitespace", "output": "whitespace"}
    assert r["total_output_tokens"] == n * m
    assert r["total_input_tokens"] == sum(len(q["messages"][0]["content"].split()) for q in stub.requests[1:])
    assert r["tokens_per_chunk"] == m / 4
    for q in r["requests"]:
        assert q["chunks"] == 4 and len(q["itl_ms"]) == 3 and q["output_tokens"] == m
    # the role-only first chunk arrives at once but does not count: TTFT is at least the stub's
    # wait for the first text chunk
    assert_after_stub(r, stub)
    for q in r["requests"]:
        assert math.isclose(q["tpot_ms"], (q["e2el_ms"] - q["ttft_ms"]) / (m - 1), rel_tol=1e-9)
    # all at once: no request waited for another
    assert stub.max_open <= n and r["duration_s"] * 1e3 >= max(q["e2el_ms"] for q in r["requests"])
    # /metrics without spec-decode counters: nulls, no error
    sd = r["spec_decode"]
    assert sd["mean_accept_length"] is None and sd["acceptance_per_position"] is None
    assert sd["num_drafts"] is None and sd["metrics_error"] is None


def test_a_stream_kept_open_past_done_costs_its_connection_not_a_hung_request(dataset, tmp_path, monkeypatch):
    """The client reads on after [DONE] to the body's end (to keep the connection), but a
    server that never ends the body gets it closed after ``DRAIN_S``: every request still
    succeeds, each stream closed by the client (the stub would wait 60 s)."""
    monkeypatch.setattr(client_mod, "DRAIN_S", 0.2)
    stub = Stub(mode="open-after-done")
    with Serve(stub) as srv:
        r = run_bench(srv.url, dataset, tmp_path, "--num-prompts", "2", "--max-concurrency", "1",
                      "--max-output-len", "4")
    assert r["completed"] == 2 and r["failed"] == 0
    assert stub.gone_after_done == 3  # the test request and the two


def test_poisson_arrivals_follow_seed(dataset, tmp_path):
    stub = Stub(metrics="404")
    n, rate, seed = 6, 20.0, 3
    with Serve(stub) as srv:
        r = run_bench(srv.url, dataset, tmp_path, "--num-prompts", str(n), "--request-rate", str(rate),
                      "--max-output-len", "4", progress=True)
    assert r["request_rate"] == rate and r["completed"] == n
    expected = arrival_offsets(n, rate, seed)
    # each request was sent no earlier than its offset after the run's start (the runner's
    # recorded send times; a timer may fire up to the clock's resolution early), and the
    # sends came in the schedule's order (the sleeping tasks wake in deadline order)
    sends = [q["send_s"] for q in r["requests"]]
    assert all(t >= e - 1e-3 for t, e in zip(sends, expected)), (sends, expected)
    assert sorted(range(n), key=sends.__getitem__) == sorted(range(n), key=expected.__getitem__)
    assert expected == arrival_offsets(n, rate, seed) and expected != arrival_offsets(n, rate, seed + 1)
    assert r["duration_s"] >= expected[-1] + FIRST + 3 * GAP - 0.005
    assert r["spec_decode"]["mean_accept_length"] is None
    assert r["spec_decode"]["metrics_error"] == "GET /metrics: HTTP 404"
    # kept-alive connections carry one stream after another (no request pipelined behind
    # a stream still being sent), and no more connections than requests
    by_conn = collections.defaultdict(list)
    for host, port, opened, closed in stub.spans:
        by_conn[(host, port)].append((opened, closed))
    for spans in by_conn.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans
    assert len(stub.spans) == n + 1 and len(by_conn) <= n


def test_plots(dataset, tmp_path):
    stub = Stub(tokens_per_chunk=2)
    results = []
    with Serve(stub) as srv:
        for c in (1, 2):
            results.append(run_bench(srv.url, dataset, tmp_path, "--num-prompts", "2", "--max-concurrency",
                                     str(c), "--max-output-len", "4", "--label", "stub", name=f"c{c}.json"))
    other = dict(results[0], label=None, spec_decode=dict(results[0]["spec_decode"], acceptance_per_position=None))
    (tmp_path / "other.json").write_text(json.dumps(other))
    out = tmp_path / "plots"
    files = [str(tmp_path / f) for f in ("c1.json", "c2.json", "other.json")]
    assert bench_main(["--plot", *files, "--plot-out", str(out)]) == 0
    for name in ("throughput_vs_concurrency.png", "latency_percentiles.png", "acceptance_per_position.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


# --------------------------------------------------------------------------- error paths


def _expect_error(capsys, argv, *needles):
    rc = bench_main(argv)
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ppspec bench: error:"), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _free_port() -> int:
    from cluster import free_port

    return free_port()


@pytest.mark.parametrize("url", ["not a url", "localhost:8000", "ftp://127.0.0.1:8000", "http://:80"])
def test_bad_url(capsys, dataset, url):
    _expect_error(capsys, ["--base-url", url, "--dataset-path", str(dataset), "--num-prompts", "2"],
                  "invalid --base-url")


def test_closed_port(capsys, dataset):
    url = f"http://127.0.0.1:{_free_port()}"
    _expect_error(capsys, ["--base-url", url, "--dataset-path", str(dataset), "--num-prompts", "2",
                           "--no-progress"], "cannot reach", "connection refused")


def test_html_server(capsys, dataset):
    with Serve(Stub(mode="html")) as srv:
        _expect_error(capsys, ["--base-url", srv.url, "--dataset-path", str(dataset), "--num-prompts", "2",
                               "--no-progress"], "does not look like an OpenAI-compatible server", "text/html")


def test_html_completions(capsys, dataset):
    with Serve(Stub(mode="html-completions")) as srv:
        _expect_error(capsys, ["--base-url", srv.url, "--dataset-path", str(dataset), "--num-prompts", "2",
                               "--no-progress"], "did not answer like an OpenAI API")


def test_not_http_server(capsys, dataset):
    """A TCP port that answers with bytes that are not HTTP (e.g. a gRPC stage's port)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]

    def serve():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00garbage, not HTTP\r\n\r\n")

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        _expect_error(capsys, ["--base-url", f"http://127.0.0.1:{port}", "--dataset-path", str(dataset),
                               "--num-prompts", "2", "--no-progress"], "cannot reach", "HTTP")
    finally:
        srv.close()


def test_unknown_model(capsys, dataset):
    with Serve(Stub(mode="unknown-model")) as srv:
        _expect_error(capsys, ["--base-url", srv.url, "--model", "nope", "--dataset-path", str(dataset),
                               "--num-prompts", "2", "--no-progress"], "HTTP 404", "`nope` does not exist")


def test_plot_errors(capsys, tmp_path):
    _expect_error(capsys, ["--plot", str(tmp_path / "missing.json")], "cannot read")
    (tmp_path / "x.json").write_text('{"a": 1}')
    _expect_error(capsys, ["--plot", str(tmp_path / "x.json")], "not a ppspec bench result")


def test_usage_errors(capsys):
    assert bench_main([]) == 2
    assert bench_main(["--num-prompts", "many"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_cli_dispatch_without_torch(tmp_path):
    """``ppspec bench`` through the top-level CLI, in a fresh interpreter: no torch import."""
    code = (
        "import sys\n"
        "from ppspec.cli import main\n"
        "rc = main(['bench', '--base-url', 'http://127.0.0.1:%d', '--dataset-path', sys.argv[1],"
        " '--num-prompts', '1', '--no-progress'])\n"
        "import ppspec.bench.plot, ppspec.bench.runner\n"
        "assert 'torch' not in sys.modules, 'bench imported torch'\n"
        "sys.exit(rc)\n" % _free_port()
    )
    p = subprocess.run([sys.executable, "-c", code, str(write_dataset(tmp_path / "d.json"))],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stderr
    assert "connection refused" in p.stderr and "Traceback" not in p.stderr


def test_host_split_of_a_step_adds_up(capsys):
    """``profile_host --case 1b`` (here its CPU check on the demo checkpoint, the graphs'
    padded path run eagerly): per step the host time before the launch, the launch to the
    step's end and the commit are positive where they exist and add up to the wall time; a
    decode commits nothing, a verify round does. One timed step, so that each column is that
    step's own split (medians of several need not add up) and the check holds at any load."""
    from ppspec.bench.profile_host import main as profile_host

    profile_host(["--case", "1b", "--device", "cpu", "--batch", "4", "--steps", "1"])
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("decode", "verify"):
            rows[cells[0]] = [float(c) for c in cells[1:]]
    assert set(rows) == {"decode", "verify"}
    for mode, (wall, before, after, commit) in rows.items():
        assert 0 < before < wall and 0 < after < wall
        assert (commit > 0) == (mode == "verify")
        # the printed columns are rounded to 1 us each
        assert before + after + commit == pytest.approx(wall, abs=2.5e-3)



def test_host_split_of_a_mixed_step_adds_up(capsys):
    """``profile_host --case mixed`` on the CPU (demo checkpoint, 4 decodes beside a 128-token
    chunk in one mixed graph, its forward eager): the host time before the launch and after
    it are positive and, with the eager forward and logits, add up to the wall time of one
    timed step; a CPU has no device to read (0 reads), and the long bucket forced for the
    tool's runner is the CPU's none again after it."""
    from ppspec.bench.profile_host import main as profile_host
    from ppspec.stage_server import graphs

    profile_host(["--case", "mixed", "--device", "cpu", "--batch", "4", "--chunk", "128", "--steps", "1"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| median of 1 |"))
    wall, before, after, forward, reads = (float(c) for c in line.strip("|").split("|")[1:])
    assert 0 < before < wall and 0 < after < wall and 0 < forward < wall and reads == 0
    assert before + after + forward == pytest.approx(wall, abs=2.5e-3)
    assert graphs.PrefillGraphs._long_tokens(False, 4096) == []


def test_host_split_refuses_a_batch_its_graphs_do_not_hold():
    import torch

    from ppspec.bench.gpu_bench import prefilled_steps
    from ppspec.bench.profile_host import step_split
    from ppspec.router.llm import DEMO_MODEL

    r, step, _ = prefilled_steps(torch, DEMO_MODEL, 4, 16, device="cpu", dtype=torch.float32, cuda_graph_max_bs=2)
    with pytest.raises(ValueError, match="above the largest decode graph"):
        step_split(r, step, "decode", 2, 4)


def test_decode_and_verify_are_timed_in_alternating_blocks():
    """gpu_bench's 1B row times a decode step and a verify round in alternating blocks, both
    runners alive (here the demo checkpoint on the CPU): one ratio per block, the runner
    returned is the decode one (no speculation), and the medians are real step times."""
    import torch

    from ppspec.bench.gpu_bench import decode_and_verify
    from ppspec.router.llm import DEMO_MODEL

    # many short blocks: the pools must hold every step, warm-ups included
    dec, ver, ratios, r = decode_and_verify(torch, DEMO_MODEL, 2, 16, repeats=6, n=1, device="cpu",
                                            dtype=torch.float32, cuda_graph_max_bs=2)
    assert len(ratios) == 6 and ratios == sorted(ratios) and all(x > 0 for x in ratios)
    assert r.num_steps == 0 and dec > 0 and ver > 0


def test_edge_cost_divides_the_servers_cpu_by_the_tokens_it_streamed(capsys):
    """``bench/edge_cost.py`` end to end at toy size: the stand-in server streams every
    sample's tokens (the client's count equals the samples' lengths, nothing failed) and
    the figure is the server's CPU seconds over them, positive."""
    from ppspec.bench.dataset import TokenCounter, load_sharegpt, sample_sharegpt
    from ppspec.bench.edge_cost import main as edge_cost

    assert edge_cost(["--num-prompts", "6", "--concurrency", "3", "--max-tokens", "8", "--round-ms", "1",
                      "--tokens-per-round", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    want = sum(s.output_len for s in sample_sharegpt(load_sharegpt(), 6, 0, TokenCounter(None), max_output_len=8,
                                                      max_input_len=1024))
    first = out[0].split(", ")
    assert first[2] == f"{want} tokens" and first[3] == "0 failed", out
    assert float(first[0].split(": ")[1].split()[0]) > 0


def test_a_stream_without_text_fails_and_says_whether_tokens_came():
    """A stream that carries no text is a failed request (no TTFT), as vLLM's benchmark
    counts it. When its usage says the server generated tokens, the error says they decode
    to nothing (ids past the tokenizer's vocabulary, special tokens: a random checkpoint's
    output, not a server error), so that a report tells the two apart."""
    from ppspec.bench.client import NO_TEXT, NO_TEXT_TOKENS, session, stream_request

    def sse(*chunks):
        return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    empty = {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": None}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}
    text = {"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]}
    bodies = {"tokens": sse(empty, empty, usage), "nothing": sse(empty), "text": sse(text, usage)}

    async def run(kind):
        from aiohttp import web
        from aiohttp.test_utils import TestServer

        async def answer(request):
            return web.Response(body=bodies[kind].encode(), content_type="text/event-stream")

        app = web.Application()
        app.router.add_post("/v1/chat/completions", answer)
        async with TestServer(app, host="127.0.0.1") as server, session() as client:
            return await stream_request(client, str(server.make_url("/v1/chat/completions")), {}, True)

    r = asyncio.run(run("tokens"))
    assert not r.success and r.completion_tokens == 3 and r.error == NO_TEXT + NO_TEXT_TOKENS
    r = asyncio.run(run("nothing"))
    assert not r.success and r.error == NO_TEXT
    r = asyncio.run(run("text"))
    assert r.success and r.error is None and r.text == "hi" and r.completion_tokens == 3


def test_a_routers_first_token_stamps_are_summarized(dataset, tmp_path, capsys):
    stub = Stub(tokens_per_chunk=1, trace=True)
    n = 4
    with Serve(stub) as srv:
        r = run_bench(srv.url, dataset, tmp_path, "--num-prompts", str(n), "--max-concurrency", "2",
                      "--max-output-len", "5")
    rows = stub.traced[1:]  # the run's requests (the test request's row came before the mark)
    rt = r["router_ttft"]
    assert rt["n"] == n == len(rows)
    for key, (a, b) in (("queued_ms", (1, 2)), ("admitted_ms", (2, 4)), ("sent_ms", (4, 5)),
                        ("router_ttft_ms", (1, 5))):
        ms = sorted(1e3 * (x[b] - x[a]) for x in rows)
        assert math.isclose(rt[key]["mean"], statistics.fmean(ms), rel_tol=1e-9), key
        assert math.isclose(rt[key]["p50"], (ms[1] + ms[2]) / 2, rel_tol=1e-9), key
    # the router's share cannot exceed what the client measured: it stamps inside the request
    assert rt["router_ttft_ms"]["p99"] <= max(q["ttft_ms"] for q in r["requests"])
    out = capsys.readouterr().out
    assert f"Router's TTFT path, {n} requests, ms (mean/p50/p90/p99):" in out
    assert "  queued until admitted" in out and "  queued until first token back" in out

