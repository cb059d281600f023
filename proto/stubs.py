"""The generated stubs, rebuilt first when ``stage.proto`` changed since they were made."""
from __future__ import annotations

from . import build as _build

if _build.is_stale():
    _build.build()

from . import stage_pb2 as pb  # noqa: E402
from . import stage_pb2_grpc as pb_grpc  # noqa: E402

__all__ = ["pb", "pb_grpc"]
