"""The pipeline key: a secret shared by a router and its stages.

Every call that changes a stage (``Forward``, ``Verify``, ``CommitAccept``, ``Release``,
``AttachDataPlane``, ``PrepareGrammar`` (a compile on the last stage's worker, kept in its
cache of compiled grammars), and ``Info`` when it claims the stage or leaves it) carries the key in
the gRPC metadata entry :data:`METADATA_KEY`; a stage started with ``--pipeline-key-file``
refuses a call without it (``UNAUTHENTICATED``) in a server interceptor, before the request
is even parsed, so no row is read. Read-only ``Info`` and the health service stay open. The
key is compared in constant time (``hmac.compare_digest``). It travels in the clear on an
insecure channel: it keeps out any process that can reach a stage's port, not one that can
read the traffic (docs/DESIGN.md, "Router ownership"; README, "Security").
"""
from __future__ import annotations

import hmac
import os
import secrets
import tempfile

import grpc

from ppspec.proto.stubs import STAGE_SERVICE

METADATA_KEY = "ppspec-pipeline-key-bin"  # "-bin": the value is bytes, any key file works
# the stage methods that change something whatever their request says ("Info" only when it
# claims or leaves: checked on the parsed request)
MUTATING = frozenset(f"/{STAGE_SERVICE}/{m}" for m in ("Forward", "Verify", "Steps", "CommitAccept", "Release",
                                                       "AttachDataPlane", "PrepareGrammar"))
STEPS = f"/{STAGE_SERVICE}/Steps"  # the one streaming method (proto/stream.py)
INFO = f"/{STAGE_SERVICE}/Info"


class KeyFileError(Exception):
    """A key file that cannot serve: missing, unreadable or empty."""


def read_key_file(path: str) -> bytes:
    """The key in ``path``: its bytes, surrounding whitespace dropped.

    Raises:
        KeyFileError: naming the file and why.
    """
    try:
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as e:
        raise KeyFileError(f"--pipeline-key-file {path}: {e.strerror or e}") from None
    if not key:
        raise KeyFileError(f"--pipeline-key-file {path}: the file is empty")
    return key


def write_temp_key() -> str:
    """A fresh random key in a new 0600 file (``ppspec serve``'s per-run key); returns its
    path. The caller removes it."""
    fd, path = tempfile.mkstemp(prefix="ppspec-pipeline-key-")  # created 0600
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def has_key(metadata, key: bytes) -> bool:
    """Whether gRPC ``metadata`` (``(name, value)`` pairs) carries ``key``."""
    for name, value in metadata or ():
        if name == METADATA_KEY:
            return hmac.compare_digest(value if isinstance(value, bytes) else value.encode(), key)
    return False


class KeyCheck(grpc.aio.ServerInterceptor):
    """Refuse a mutating stage call without the pipeline key (UNAUTHENTICATED), before its
    request is parsed; an ``Info`` that claims or leaves is checked once parsed."""

    def __init__(self, key: bytes, pp_rank: int):
        self.key, self.rank = key, pp_rank

    def _refusal(self, method: str, wrong: bool = False) -> str:
        return (f"stage {self.rank}: {method.rsplit('/', 1)[-1]} {'with a wrong' if wrong else 'without the'} "
                f"pipeline key (--pipeline-key-file): refused, nothing read or changed")

    async def intercept_service(self, continuation, details):
        method, md = details.method, details.invocation_metadata
        sent = any(name == METADATA_KEY for name, _ in md or ())
        wrong = sent and not has_key(md, self.key)  # a wrong key is refused on every stage method
        if (method in MUTATING and not sent) or (wrong and method.startswith(f"/{STAGE_SERVICE}/")):
            why = self._refusal(method, wrong)

            async def refuse(request, context):
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

            # no request deserializer: the bytes are never parsed
            if method == STEPS:
                return grpc.stream_stream_rpc_method_handler(refuse)
            return grpc.unary_unary_rpc_method_handler(refuse)
        handler = await continuation(details)
        if method != INFO or handler is None or sent:
            return handler
        inner, why = handler.unary_unary, self._refusal(method) + " (a claim or a leave needs it)"

        async def info(request, context):
            if request.claim or request.leaving:
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(info, handler.request_deserializer, handler.response_serializer)


class SendKey(grpc.aio.UnaryUnaryClientInterceptor):
    """Add the pipeline key to every call of a channel (the router's, a stage's relay)."""

    def __init__(self, key: bytes):
        self.entry = (METADATA_KEY, key)

    async def intercept_unary_unary(self, continuation, details, request):
        details = details._replace(metadata=[*(details.metadata or ()), self.entry])
        return await continuation(details, request)


def client_interceptors(key: bytes | None) -> list:
    """The interceptors of a channel to the stages: the key's, when there is one (unary
    calls; a Steps stream sends :func:`key_metadata` when it opens)."""
    return [SendKey(key)] if key else []


def key_metadata(key: bytes | None) -> tuple:
    """The metadata that carries ``key`` (none without one)."""
    return ((METADATA_KEY, key),) if key else ()
