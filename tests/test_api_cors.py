"""CORS, as vLLM's ``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers`` and
``--allow-credentials`` (starlette's ``CORSMiddleware``, vLLM's defaults: any origin, method
and header, no credentials).

The middleware sits outside the API-key check: a browser's preflight (``OPTIONS`` without
``Authorization``) is answered, not refused with 401, and a 401 carries the header that lets
the page read it. A served app over test_api's ``FakeEngine``; raw HTTP through httpx.
"""
from __future__ import annotations

import json

import httpx
import pytest

from ppspec.router.api import build_app
from ppspec.router.server import cors_options
from test_api import MODEL, FakeEngine, make_tokenizer, run_server

KEY = "cors-test-key"
GOOD = "https://app.example.com"
BAD = "https://evil.example.net"
BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "seed": 1}


@pytest.fixture(scope="module")
def engine():
    return FakeEngine(make_tokenizer())


@pytest.fixture(scope="module")
def server(engine):
    """Origins, methods and headers restricted as a deployment would; the API key on."""
    from ppspec.router.server import parse_args

    args = parse_args(["--stages", "127.0.0.1:1", "--allowed-origins", json.dumps([GOOD]),
                       "--allowed-methods", '["GET", "POST"]', "--allowed-headers", '["authorization", "content-type"]'])
    with run_server(build_app(engine, MODEL, api_key=KEY, **cors_options(args))) as url:
        yield url


def _preflight(url: str, origin: str, path: str = "/v1/completions", headers: str = "authorization, content-type"):
    return httpx.options(url + path, headers={"origin": origin, "access-control-request-method": "POST",
                                              "access-control-request-headers": headers}, timeout=30)


def test_a_preflight_from_an_allowed_origin_is_answered_without_the_api_key(server):
    r = _preflight(server, GOOD)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == GOOD
    assert {m.strip() for m in r.headers["access-control-allow-methods"].split(",")} == {"GET", "POST"}
    assert {h.strip() for h in r.headers["access-control-allow-headers"].split(",")} >= {"authorization",
                                                                                       "content-type"}
    assert "access-control-allow-credentials" not in r.headers  # vLLM's default: off


def test_a_preflight_from_another_origin_or_for_another_header_is_refused(server):
    r = _preflight(server, BAD)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    assert r.text == "Disallowed CORS origin"
    r = _preflight(server, GOOD, headers="authorization, x-other")
    assert r.status_code == 400 and r.text == "Disallowed CORS headers"


def test_simple_requests_carry_the_header_for_an_allowed_origin_only(server, engine):
    auth = {"authorization": f"Bearer {KEY}"}
    r = httpx.post(server + "/v1/completions", json=BODY, headers={**auth, "origin": GOOD}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"]
    assert r.headers["access-control-allow-origin"] == GOOD
    assert r.headers["vary"] == "Origin"
    # another origin is served (CORS is the browser's check) without the header the browser needs
    r = httpx.post(server + "/v1/completions", json=BODY, headers={**auth, "origin": BAD}, timeout=30)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    # a client that is no browser (no Origin) sees no CORS header at all
    r = httpx.post(server + "/v1/completions", json=BODY, headers=auth, timeout=30)
    assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)


def test_the_api_keys_401_carries_the_header_so_the_page_can_read_it(server):
    r = httpx.post(server + "/v1/completions", json=BODY, headers={"origin": GOOD}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert r.headers["access-control-allow-origin"] == GOOD


def test_a_stream_through_cors_keeps_its_frames(server):
    headers = {"authorization": f"Bearer {KEY}", "origin": GOOD}
    r = httpx.post(server + "/v1/completions", json={**BODY, "stream": True}, headers=headers, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == GOOD
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    frames = r.content.split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""] and all(f.startswith(b"data: {") for f in frames[:-2])


def test_vllms_defaults_allow_any_origin_and_credentials_on_echo_the_origin(engine):
    from ppspec.router.server import parse_args

    args = parse_args(["--stages", "127.0.0.1:1"])
    assert (args.allowed_origins, args.allowed_methods, args.allowed_headers, args.allow_credentials) == \
        (["*"], ["*"], ["*"], False)
    with run_server(build_app(engine, MODEL, **cors_options(args))) as url:
        r = _preflight(url, BAD, headers="x-anything")
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert r.headers["access-control-allow-headers"] == "x-anything"
        r = httpx.get(url + "/v1/models", headers={"origin": BAD}, timeout=30)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    args = parse_args(["--stages", "127.0.0.1:1", "--allow-credentials"])
    with run_server(build_app(engine, MODEL, **cors_options(args))) as url:
        r = httpx.get(url + "/v1/models", headers={"origin": BAD}, timeout=30)
        # with credentials a wildcard may not be sent: the origin itself is (starlette's, vLLM's)
        assert r.headers["access-control-allow-origin"] == BAD
        assert r.headers["access-control-allow-credentials"] == "true"


def test_serve_takes_the_options_and_hands_them_to_its_router():
    from ppspec.launch.serve import build_parser as serve_parser
    from ppspec.launch.serve import router_argv
    from ppspec.router.server import build_parser as router_parser

    a = serve_parser().parse_args(["--allowed-origins", '["https://a.example", "http://b.example:8080"]',
                                   "--allowed-headers", '["authorization"]', "--allow-credentials"])
    r = router_parser().parse_args(router_argv(a, [5001])[1:])
    assert r.allowed_origins == ["https://a.example", "http://b.example:8080"]
    assert (r.allowed_methods, r.allowed_headers, r.allow_credentials) == (["*"], ["authorization"], True)
    r = router_parser().parse_args(router_argv(serve_parser().parse_args([]), [5001])[1:])
    assert (r.allowed_origins, r.allowed_methods, r.allowed_headers, r.allow_credentials) == (["*"], ["*"], ["*"],
                                                                                            False)
