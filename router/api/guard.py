"""ASGI guard in front of the app: the API key and the body size, checked before any body is read."""
from __future__ import annotations

import hmac
import json
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import error_body

DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
"""Largest accepted request body, in bytes (larger: 413)."""


class Guard:
    """Checks the Bearer key on ``/v1/*`` (401) and caps request bodies (413)."""

    DRAIN_LIMIT = 64 * 1024 * 1024  # bytes of an oversized body read before replying anyway

    def __init__(self, app: Any, api_key: str | None, max_request_bytes: int):
        self.app = app
        self.api_key = api_key.encode() if api_key is not None else None
        self.max_bytes = max_request_bytes

    async def _drain(self, receive: Any) -> None:
        """Read and drop the rest of an oversized body (up to DRAIN_LIMIT bytes), so that the
        client, which sends its whole body before reading, sees the 413 instead of a reset."""
        dropped = 0
        while dropped <= self.DRAIN_LIMIT:
            message = await receive()
            if message["type"] != "http.request":
                return
            dropped += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    def _too_large(self) -> dict:
        # built when refused only: a pydantic model's dump costs every request ~40 us otherwise
        return error_body(f"request body is larger than {self.max_bytes} bytes", "invalid_request_error",
                          code="request_too_large")

    async def _reply(self, send: Any, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and scope.get("path", "").startswith("/v1"):
            scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                await self._reply(send, 401, error_body("Incorrect API key provided.", "invalid_request_error",
                                                        code="invalid_api_key"))
                return
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._drain(receive)
            await self._reply(send, 413, self._too_large())
            return
        seen = 0

        async def limited_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # a chunked upload without Content-Length
                    if message.get("more_body", False):
                        await self._drain(receive)
                    raise StarletteHTTPException(413, self._too_large()["error"]["message"])
            return message

        await self.app(scope, limited_receive, send)

