"""The benchmark run: check the server, replay the prompts, read /metrics, aggregate.

Arrivals: with ``--request-rate R`` request i is sent at the i-th point of a seeded
Poisson process of rate R (exponential gaps, the first at t = 0); with no rate (or
``inf``) every request is due at once. ``--max-concurrency C`` caps the requests in
flight (a request that is due waits for a free slot). The two combine.
Duration runs from the first send to the last completion.
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import math
import random
import sys
import urllib.parse
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from ppspec.bench import BenchError
from ppspec.bench import client as client_mod
from ppspec.bench.client import RequestResult, _snippet, describe_http_error, error_message, session, stream_request
from ppspec.bench.dataset import SampleRequest
from ppspec.bench.metrics import DEFAULT_PREFIX, compute_results, parse_spec_counters, router_ttft_summary, spec_decode_summary

SCHEMA_VERSION = 1
MAX_ERRORS_KEPT = 10


@dataclass
class RunConfig:
    base_url: str
    model: str | None = None
    endpoint: str = "completions"  # or "chat"
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True
    api_key: str | None = None
    timeout: float = 600.0  # seconds without a byte from the server before a request fails
    connect_timeout: float = 10.0
    metrics_prefix: str = DEFAULT_PREFIX
    progress: bool = True
    test_request: bool = True
    extra_body: dict | None = None  # more request fields, sent with every request (e.g. allowed_token_ids)


def normalize_base_url(url: str) -> str:
    """``http(s)://host[:port][/path]`` without a trailing ``/`` or ``/v1``."""
    raw = url
    url = url.strip()
    try:
        u = urllib.parse.urlsplit(url)
        u.port  # raises ValueError on a bad port
    except ValueError:
        u = None
    if u is None or u.scheme not in ("http", "https") or not u.hostname:
        raise BenchError(f"invalid --base-url {raw!r}: expected http://HOST:PORT (or https://...)")
    path = u.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urllib.parse.urlunsplit((u.scheme, u.netloc, path, "", ""))


async def _get(client: aiohttp.ClientSession, url: str, headers: dict, params: dict | None = None):
    """GET ``url``: (status, content type, body text)."""
    async with client.get(url, headers=headers, params=params) as resp:
        body = (await resp.read()).decode("utf-8", "replace")
        return resp.status, resp.headers.get("content-type", ""), body


async def check_server(client: aiohttp.ClientSession, root: str, model: str | None, headers: dict) -> str:
    """GET /v1/models: the server must answer like an OpenAI API. Returns the model name."""
    url = root + "/v1/models"
    try:
        status, ctype, body = await _get(client, url, headers)
    except (aiohttp.ClientError, TimeoutError) as e:
        raise BenchError(f"cannot reach {root}: {describe_http_error(e)}") from None
    not_openai = (
        f"{root} does not look like an OpenAI-compatible server: GET /v1/models answered "
        f"HTTP {status} ({ctype or 'no content-type'}) {_snippet(body)}"
    )
    if status == 200:
        try:
            data = json.loads(body)
        except ValueError:
            raise BenchError(not_openai) from None
        if not (isinstance(data, dict) and isinstance(data.get("data"), list)):
            raise BenchError(not_openai)
        ids = [m["id"] for m in data["data"] if isinstance(m, dict) and isinstance(m.get("id"), str)]
        if model is None:
            if not ids:
                raise BenchError(f"{url} lists no models; pass --model")
            model = ids[0]
        return model
    if status in (401, 403):
        raise BenchError(f"{url}: {error_message(status, body)} (pass --api-key)")
    if "html" in ctype:
        raise BenchError(not_openai)
    if model is None:
        raise BenchError(f"{url}: {error_message(status, body)}; pass --model NAME")
    return model  # some servers lack /v1/models; the test request will tell


async def scrape_spec_counters(client, root: str, headers: dict, prefix: str):
    """(counters, None) or (None, why /metrics could not be used)."""
    try:
        status, _, text = await _get(client, root + "/metrics", headers)
    except (aiohttp.ClientError, TimeoutError) as e:
        return None, f"GET /metrics: {describe_http_error(e)}"
    if status != 200:
        return None, f"GET /metrics: HTTP {status}"
    try:
        return parse_spec_counters(text, prefix), None
    except Exception as e:  # the parser raises assorted errors on non-Prometheus text
        return None, f"GET /metrics: not Prometheus text format ({type(e).__name__}: {e})"


async def first_tokens(client, root: str, headers: dict, since: int = 1 << 62) -> dict | None:
    """A ppspec router's first-token paths recorded from number ``since`` on (``GET
    /v1/trace/first_tokens``: ``total``, ``fields``, ``rows``); the default ``since`` reads
    just the count. None from a server without them (another engine, an older router)."""
    try:
        status, _, body = await _get(client, root + "/v1/trace/first_tokens", headers, {"since": str(since)})
        got = json.loads(body) if status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    return got if isinstance(got, dict) and isinstance(got.get("total"), int) else None


def build_payload(endpoint: str, model: str, sample: SampleRequest, max_tokens: int, cfg: RunConfig) -> dict:
    payload = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.ignore_eos:
        payload["ignore_eos"] = True
    if cfg.extra_body:
        payload.update(cfg.extra_body)
    if endpoint == "chat":
        system = [{"role": "system", "content": sample.system}] if sample.system else []
        payload["messages"] = system + [{"role": "user", "content": sample.prompt}]
    else:
        payload["prompt"] = f"{sample.system}\n\n{sample.prompt}" if sample.system else sample.prompt
    return payload


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of n requests: a Poisson process of ``rate``."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"arrivals-{seed}")
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def run_benchmark(cfg: RunConfig, samples: list[SampleRequest], count_tokens, counter_source: str) -> dict:
    """Run the benchmark; returns the result dict (without the run's own settings)."""
    root = normalize_base_url(cfg.base_url)
    if cfg.request_rate <= 0:
        raise BenchError("--request-rate must be positive")
    if cfg.max_concurrency is not None and cfg.max_concurrency < 1:
        raise BenchError("--max-concurrency must be at least 1")
    chat = cfg.endpoint == "chat"
    url = root + ("/v1/chat/completions" if chat else "/v1/completions")
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with session(cfg.timeout, cfg.connect_timeout) as client:
        model = await check_server(client, root, cfg.model, headers)

        if cfg.test_request:
            first = samples[0]
            res = await stream_request(
                client, url, build_payload(cfg.endpoint, model, first, min(first.output_len, 8), cfg), chat, headers
            )
            if not res.success:
                if res.non_openai:
                    raise BenchError(f"{url} did not answer like an OpenAI API: {res.error}")
                raise BenchError(f"the test request to {url} failed: {res.error}")

        before, metrics_error = await scrape_spec_counters(client, root, headers, cfg.metrics_prefix)
        mark = await first_tokens(client, root, headers)

        slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else contextlib.nullcontext()
        offsets = arrival_offsets(len(samples), cfg.request_rate, cfg.seed)
        pbar = tqdm(total=len(samples), disable=not cfg.progress, unit="req", desc="ppspec bench", file=sys.stderr)

        async def one(sample: SampleRequest, due: float) -> RequestResult:
            # until due by the clock: uvloop's timers count whole milliseconds of a cached loop
            # time, and wake up to ~1.3 ms early
            while (delay := start + due - client_mod.clock()) > 0:
                await asyncio.sleep(delay)
            payload = build_payload(cfg.endpoint, model, sample, sample.output_len, cfg)
            async with slots:
                res = await stream_request(client, url, payload, chat, headers)
            pbar.update(1)
            return res

        start = client_mod.clock()
        try:
            results = await asyncio.gather(*(one(s, t) for s, t in zip(samples, offsets)))
            duration = client_mod.clock() - start
        finally:
            pbar.close()

        after, err_after = (None, None)
        if before is not None:
            after, err_after = await scrape_spec_counters(client, root, headers, cfg.metrics_prefix)
        traced = await first_tokens(client, root, headers, mark["total"]) if mark is not None else None

    figures = compute_results(results, samples, duration, counter_source, count_tokens, start)
    errors: list[str] = []
    for r in results:
        if r.error and r.error not in errors:
            errors.append(r.error)
    if figures["completed"] == 0:
        raise BenchError(f"all {len(results)} requests failed; first error: {errors[0] if errors else '?'}")
    per_request = figures.pop("_per_request")
    result = {
        "schema_version": SCHEMA_VERSION,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "base_url": root,
        "model": model,
        "endpoint": cfg.endpoint,
        "num_prompts": len(samples),
        "request_rate": None if math.isinf(cfg.request_rate) else cfg.request_rate,
        "max_concurrency": cfg.max_concurrency,
        "seed": cfg.seed,
        "temperature": cfg.temperature,
        "ignore_eos": cfg.ignore_eos,
        **figures,
        "spec_decode": spec_decode_summary(before, after, metrics_error or err_after),
        # where the requests' TTFT went by a ppspec router's own stamps (None elsewhere)
        "router_ttft": router_ttft_summary(traced) if traced is not None else None,
        "errors": errors[:MAX_ERRORS_KEPT],
        "_per_request": per_request,
    }
    return result
