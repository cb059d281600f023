"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

Every error the HTTP layer answers goes through :func:`error_body`, which makes its strings
encodable: a message may quote what the client sent (a model name, a stop string), and a
JSON string can hold lone surrogates (``"\\ud800"``) that UTF-8 cannot, so rendering such a
message must not fail (it would turn a 404 into a 500).
"""
from __future__ import annotations

import re
from array import array

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from ..protocol import ErrorInfo, ErrorResponse
from ..types import EngineError, InvalidRequestError


class APIError(EngineError):
    """An HTTP-layer error with its own status (401, 404, 413, 500...)."""

    def __init__(self, status: int, message: str, error_type: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message, param=param, code=code)
        self.http_status = status
        self.error_type = error_type


STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                429: "rate_limit_error", 503: "service_unavailable"}
"""The OpenAI error ``type`` of an HTTP status."""


def renderable(text: str | None) -> str | None:
    """``text`` with every code point UTF-8 cannot encode (lone surrogates) written as a
    ``\\udXXX`` escape, so that the JSON answer can always be encoded."""
    if text is None:
        return None
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error JSON object (its strings made encodable)."""
    info = ErrorInfo(message=renderable(message), type=error_type, param=renderable(param), code=renderable(code))
    return ErrorResponse(error=info).model_dump()


def error_response(status: int, message: str, error_type: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, param, code), status_code=status)


def engine_error_response(exc: EngineError) -> JSONResponse:
    return error_response(exc.http_status, exc.message, exc.error_type, exc.param, exc.code)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) of the first pydantic error, e.g. ``("temperature: Input should be ...", "temperature")``."""
    errors = list(exc.errors())
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"request body is not valid JSON: {ctx.get('error', 'decode error')}", None
    if first.get("type") == "string_unicode":  # a lone surrogate in a field name or value
        where = ".".join(loc) or "a field name"
        return f"{where}: not valid UTF-8 text (a lone surrogate)", (loc[0] if loc else None)
    if not loc and first.get("type") == "missing":
        return "request body is missing: expected a JSON object (Content-Type: application/json)", None
    if not loc and isinstance(first.get("input"), (bytes, str)):
        return "request body must be a JSON object (Content-Type: application/json)", None
    param = loc[0] if loc else None  # the top-level field (union branch names dropped)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    body = first.get("input")
    if param is None and isinstance(body, dict):
        # a whole-request check (a model validator) has no location; its message starts
        # with the field it is about ("tools are not supported")
        word = re.match(r"[a-z_]+", msg)
        param = word.group(0) if word and word.group(0) in body else None
    text = f"{'.'.join(loc)}: {msg}" if loc else msg
    locs = [[str(x) for x in e.get("loc", ()) if x != "body"] for e in errors]
    if param and len(errors) > 1 and all(len(l) >= 2 and l[0] == param for l in locs):
        # a value matching no form of a union field: name the forms, not each branch's complaint
        forms = list(dict.fromkeys(l[1] for l in locs))
        if len(forms) > 1:
            return f"{param}: expected {' or '.join(forms)}", param
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return text, param


def check_utf8(text: str, param: str) -> None:
    """Raise ``InvalidRequestError`` when ``text`` holds lone surrogates (not encodable as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(f"{param} is not valid UTF-8 text", param=param) from None


def _holds_lone_surrogate(value: object) -> bool:
    stack = [value]  # no recursion: a JSON schema may nest deeper than Python's stack
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if not v.isascii():  # isascii: a flag of the string, no scan
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(v, BaseModel):
            stack.extend(v.__dict__.values())
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            try:
                array("q", v)  # token ids (a prompt's thousands): ints only, checked in C
            except (TypeError, OverflowError):
                stack.extend(v)
    return False


def check_utf8_fields(body: BaseModel, skip: tuple[str, ...] = ("model", "user")) -> None:
    """``check_utf8`` over every field of a request (nested lists, dicts and models, keys
    too) but ``skip``: ``model`` gets its 404 quoting the name, ``user`` is only a label.
    The fields left are text the server reads (a prompt, messages, stop strings, bad words,
    a grammar's choices, template arguments), which the tokenizer cannot encode with a lone
    surrogate in it. Raises ``InvalidRequestError`` naming the first such field."""
    for name, value in body.__dict__.items():
        if value is None or value.__class__ in (bool, int, float):  # most fields: no walk
            continue
        if name not in skip and _holds_lone_surrogate(value):
            raise InvalidRequestError(f"{name} is not valid UTF-8 text", param=name)
