"""The app factory (``build_app``: routes, error handlers, the guard) and the uvicorn runner (``serve_http``)."""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import re
import time
from typing import Any, Awaitable, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import make_asgi_app
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ..protocol import (
    AsyncEngine,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from ..reasoning import check_reasoning_parser
from ..tool_calls import check_parser
from ..types import EngineError, InvalidRequestError
from .errors import STATUS_TYPES, engine_error_response, error_body, error_response, renderable, validation_message
from .edge import READ_TIMEOUT_S, edge_protocol
from .guard import DEFAULT_MAX_REQUEST_BYTES, Guard
from .handlers import ACCESS_KEY, OpenAIHandlers

log = logging.getLogger("ppspec.router.api")

DEFAULT_MAX_TOKENS_CAP: int | None = None
"""Cap on the default ``max_tokens`` of a request that gives none: None means the context
left after the prompt (vLLM's default; KV pages are taken as the sequence grows, so a
large default reserves nothing)."""


# FastAPI 0.165+ bridges each request to OpenTelemetry when a provider is configured, and
# checks whether one is on every request (its NativeTelemetry): ~7% of the HTTP process's
# CPU at 64 streams on the H200 host (py-spy, 2026-12-03). The router exports Prometheus
# metrics of its own, so the bridge is off where FastAPI has it.
_NO_OTEL = ({"telemetry": {"tracing": False, "metrics": False, "logs": False}}
            if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})


def build_app(engine: AsyncEngine, served_model_name: str | None = None, api_key: str | None = None, *,
              max_tokens_cap: int | None = DEFAULT_MAX_TOKENS_CAP, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              registry: Any = None, before_metrics: Callable[[], Awaitable[None]] | None = None,
              tool_call_parser: str | None = None, reasoning_parser: str | None = None,
              sampling_defaults: dict[str, float] | None = None, allowed_origins: Sequence[str] = ("*",),
              allowed_methods: Sequence[str] = ("*",), allowed_headers: Sequence[str] = ("*",),
              allow_credentials: bool = False) -> FastAPI:
    """The OpenAI-compatible ASGI app in front of ``engine``.

    served_model_name: the model id clients use (default ``engine.model_name``); another
    ``model`` gets 404. api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <key>``
    (401 otherwise); ``/health`` and ``/metrics`` stay open for probes and scrapers.
    max_tokens_cap: default ``max_tokens`` is min(context limit - prompt tokens, this);
    None: the context limit - prompt tokens.
    max_request_bytes: larger request bodies get 413. registry: the prometheus_client
    registry ``/metrics`` exports (default: the global one); before_metrics: awaited before
    each scrape (an engine in another process fetches its figures). tool_call_parser: how tool
    calls are read from generated text (``router.tool_calls``, e.g. ``hermes``); None: a
    chat request with ``tools`` gets 400. reasoning_parser: how chat output's thinking is
    split into ``reasoning_content`` (``router.reasoning``, e.g. ``qwen3``); None: it stays
    content. sampling_defaults: ``temperature``, ``top_p``, ``top_k``, ``min_p`` and
    ``repetition_penalty`` of requests that leave them out (``router.start.generation_defaults``).
    allowed_origins, allowed_methods, allowed_headers, allow_credentials: CORS, as vLLM's
    options of those names (starlette's ``CORSMiddleware``; the defaults are vLLM's: any origin,
    method and header, no credentials).
    Raises ValueError for an unknown parser.
    """
    from prometheus_client import REGISTRY

    check_parser(tool_call_parser)
    check_reasoning_parser(reasoning_parser)
    server = OpenAIHandlers(engine, served_model_name or engine.model_name, max_tokens_cap, tool_call_parser,
                            reasoning_parser, sampling_defaults)
    app = FastAPI(title="ppspec", summary="OpenAI-compatible API of the ppspec router",
                  docs_url=None, redoc_url=None, **_NO_OTEL)
    app.state.server = server

    @app.exception_handler(EngineError)
    async def _on_engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return engine_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if status == 400 and message == "There was an error parsing the body":
            message = "request body could not be parsed (is it UTF-8 JSON?)"
        return error_response(status, message, STATUS_TYPES.get(status, "invalid_request_error"))

    @app.exception_handler(Exception)
    async def _on_crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat(body, request)

    def _card() -> ModelCard:
        return ModelCard(id=server.model_name, max_model_len=int(engine.max_model_len))

    @app.get("/v1/models")
    async def list_models() -> Response:
        return Response(ModelList(data=[_card()]).model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        server.check_model(model_id)
        return Response(_card().model_dump_json(), media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return Response((await server.tokenize(body)).model_dump_json(), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return Response((await server.detokenize(body)).model_dump_json(), media_type="application/json")

    @app.post("/v1/cache/flush")
    async def flush_cache() -> JSONResponse:
        """Evict every cached prefix no running request uses, on every stage (behind the API
        key, as all of ``/v1``; safe while requests run)."""
        if not getattr(engine, "prefix_caching", False):
            raise InvalidRequestError("prefix caching is off: it needs every stage started with --prefix-cache-gb "
                                      "(ppspec serve does that unless --no-enable-prefix-caching)")
        return JSONResponse({"flushed_snapshots": await engine.flush_cache()})

    @app.get("/v1/trace/first_tokens")
    async def first_tokens(since: int = 0) -> JSONResponse:
        """Where each recent request's time to its first token went, from the router's
        timestamps (router/first_tokens.py): the rows recorded from number ``since`` on."""
        rows = getattr(engine, "first_token_rows", None)
        if rows is None:
            raise InvalidRequestError("this engine records no first-token paths")
        got = await rows()
        got["rows"] = [x for x in got["rows"] if x[0] >= since]
        return JSONResponse(got)

    @app.get("/version")
    async def version() -> JSONResponse:
        from ppspec import __version__

        return JSONResponse({"version": __version__})

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: probes that read the status alone
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's probe): the same answer
    async def health() -> JSONResponse:
        try:
            ok, detail = engine.health()
        except Exception as exc:  # noqa: BLE001 - a failing health check is "down"
            ok, detail = False, f"health check failed: {type(exc).__name__}: {exc}"
        if ok:
            return JSONResponse({"status": "ok", "detail": detail})
        body = {"status": "unavailable", "detail": detail, **error_body(detail, "service_unavailable")}
        return JSONResponse(body, status_code=503)

    app.mount("/metrics", _read_only(make_asgi_app(registry=REGISTRY if registry is None else registry),
                                     before=before_metrics))
    # Serve "/metrics" itself, not only "/metrics/" (a Mount matches "/metrics/..." only).
    app.routes[-1].path_regex = re.compile(r"^/metrics(?P<path>.*)$")  # type: ignore[attr-defined]

    app.add_middleware(Guard, api_key=api_key, max_request_bytes=max_request_bytes)
    # CORS outside the guard: a browser's preflight (OPTIONS, without the key) is answered
    # here, not refused with 401, and the guard's 401 / 413 carry the header that lets the
    # page read them (vLLM's auth lets OPTIONS through for the same reason). A request without
    # an Origin header (no browser) passes straight through.
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=list(allowed_methods),
                       allow_headers=list(allowed_headers), allow_credentials=allow_credentials)
    app.add_middleware(AccessLog)  # outermost: the guard's 401 / 413 and CORS's answers get their line too
    return app


access_log = logging.getLogger("ppspec.router.access")


class AccessLog:
    """One log line per HTTP request, when its response has been sent (a stream: at its
    end): client, method, path, status, prompt / completion tokens (generation endpoints;
    ``-`` elsewhere) and the latency from the request's arrival, e.g.
    ``127.0.0.1:50312 "POST /v1/chat/completions" 200 prompt_tokens=12 completion_tokens=40 0.532s``.
    Handlers leave the token counts in ``scope[ACCESS_KEY]``."""

    def __init__(self, app: Any, clock: Callable[[], float] = time.perf_counter):
        self.app, self.clock = app, clock

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = self.clock()
        record: dict[str, Any] = {"status": None}
        scope[ACCESS_KEY] = record

        async def send_and_note(message: Any) -> None:
            if message["type"] == "http.response.start":
                record["status"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            client = scope.get("client")
            tokens = " ".join(f"{k}={record[k]}" for k in ("prompt_tokens", "completion_tokens") if k in record)
            access_log.info('%s "%s %s" %s %s %.3fs', f"{client[0]}:{client[1]}" if client else "-", scope["method"],
                            renderable(scope.get("path", "")), record["status"] or 500, tokens or "-",
                            self.clock() - start)


def _read_only(inner: Callable, before: Callable[[], Awaitable[None]] | None = None) -> Callable:
    """An ASGI app that passes GET and HEAD to ``inner`` (after awaiting ``before``) and
    answers 405 (with ``Allow``) to any other method: prometheus_client's exporter answers
    every method alike."""

    async def app(scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD"):
            resp = error_response(405, f"method {scope['method']} is not allowed on {scope['path']} (GET or HEAD)",
                                  "invalid_request_error")
            resp.headers["allow"] = "GET, HEAD"
            await resp(scope, receive, send)
            return
        if before is not None and scope["type"] == "http":
            await before()
        await inner(scope, receive, send)

    return app


async def serve_http(app: Any, host: str, port: int, *, log_level: str = "info",
                     shutdown: asyncio.Event | None = None, on_exit: Callable[[], None] | None = None,
                     drain_seconds: float = 1.0, read_timeout: float = READ_TIMEOUT_S,
                     max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, sock: Any = None,
                     **uvicorn_kwargs: Any) -> None:
    """Serve ``app`` with uvicorn until SIGINT / SIGTERM (main thread) or ``shutdown`` is set.

    Uses ``loop="uvloop"``: run this coroutine on a uvloop event loop, e.g.
    ``uvloop.run(serve_http(app, host, port))``, so that the engine and the server share it.
    On exit, in-flight responses get uvicorn's graceful-shutdown time
    (``timeout_graceful_shutdown``, seconds, in ``uvicorn_kwargs``). Extra keyword arguments
    go to ``uvicorn.Config``. When the port cannot be bound, uvicorn logs the error and
    raises ``SystemExit(3)``. ``sock``: a listening socket to accept on instead of binding
    ``host``:``port`` (several processes serving one port share it).

    ``on_exit`` runs on the event loop at the first SIGINT / SIGTERM, ``drain_seconds``
    before the server starts closing: the engine ends its requests there, so that open
    streams still carry the error event and ``[DONE]`` instead of being cut off.
    """
    import uvicorn

    loop = asyncio.get_running_loop()
    if "uvloop" not in type(loop).__module__:
        log.warning("serve_http is running on %s, not uvloop", type(loop).__name__)
    uvicorn_kwargs.setdefault("access_log", False)  # the app's AccessLog writes one line per request
    # read deadline (seconds per request), strict framing, JSON refusals: router/api/edge.py
    uvicorn_kwargs.setdefault("http", edge_protocol(read_timeout, max_request_bytes))
    http = uvicorn_kwargs["http"]
    log.info("HTTP edge on %s", getattr(http, "func", http).__name__ if not isinstance(http, str) else http)
    config = uvicorn.Config(app, host=host, port=port, loop="uvloop", log_level=log_level, **uvicorn_kwargs)

    class _Uvicorn(uvicorn.Server):
        draining = False

        def handle_exit(self, sig, frame):  # a signal handler: hand the work to the loop
            if on_exit is None or self.draining:
                return super().handle_exit(sig, frame)
            self.draining = True
            loop.call_soon_threadsafe(on_exit)
            loop.call_soon_threadsafe(loop.call_later, drain_seconds, super().handle_exit, sig, frame)

    server = _Uvicorn(config)
    watcher = None
    if shutdown is not None:
        async def _stop_when_asked() -> None:
            await shutdown.wait()
            server.should_exit = True

        watcher = asyncio.ensure_future(_stop_when_asked())
    try:
        await server.serve(sockets=[sock] if sock is not None else None)
    finally:
        if watcher is not None:
            watcher.cancel()
