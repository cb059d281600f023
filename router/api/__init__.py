"""The router's OpenAI-compatible HTTP API (FastAPI, served by uvicorn on uvloop).

``build_app(engine)`` serves any object with the ``AsyncEngine`` shape
(``router/protocol.py``): ``POST /v1/completions``, ``POST /v1/chat/completions``,
``GET /v1/models``, ``GET /health`` and Prometheus' ``/metrics``.

One file per concern:

* ``errors.py``: OpenAI error bodies ``{"error": {"message", "type", "param", "code"}}``
  (400 invalid request, pydantic errors included, or over-long prompt; 401 wrong API key;
  404 unknown model; 413 body too large; 429 ``QueueFullError``; 503 ``StageDownError``);
  any string a client sent renders.
* ``tokenize.py``: prompt encoding and chat rendering (``apply_chat_template``) on worker threads.
* ``fanout.py``: one engine request per (prompt, choice) (``n`` > 1: seeds ``seed + i``),
  run as tasks; incremental detokenization (whole UTF-8 characters) and stop strings (text
  that could still become one is held back; on a match the text is cut before it and the
  engine request aborted); a client that disconnects aborts every unfinished request.
* ``logprobs.py``: log-probabilities in OpenAI's two shapes.
* ``handlers.py``: the two generation endpoints and their one SSE writer (``data: [DONE]``
  last; mid-stream errors as an error event).
* ``sse.py``: server-sent events on raw ASGI (frames as bytes, plain text chunks spliced
  into a template pydantic rendered once, keep-alive comments, a client's leaving cancels
  the stream): the hot path of every streamed token.
* ``guard.py``: API key (401) and body size (413), before any body is read.
* ``edge.py``: uvicorn's HTTP protocol (httptools where installed, else h11) with a read
  deadline per request, strict framing and JSON refusals.
* ``app.py``: ``build_app`` (routes, error handlers) and ``serve_http`` (uvicorn).
"""
from .app import DEFAULT_MAX_TOKENS_CAP, build_app, serve_http
from .errors import APIError, error_body, error_response
from .guard import DEFAULT_MAX_REQUEST_BYTES

__all__ = ["APIError", "DEFAULT_MAX_REQUEST_BYTES", "DEFAULT_MAX_TOKENS_CAP", "build_app", "error_body",
           "error_response", "serve_http"]
