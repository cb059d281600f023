"""The generated stubs, rebuilt first when ``stage.proto`` changed since they were made."""
from __future__ import annotations

from . import build as _build

if _build.is_stale():
    _build.build()

from . import stage_pb2 as pb  # noqa: E402
from . import stage_pb2_grpc as pb_grpc  # noqa: E402

__all__ = ["STAGE_SERVICE", "pb", "pb_grpc"]

# The gRPC health service name a stage reports SERVING once it can take steps: its next
# stage (if any) answered as pp_rank + 1. The server-wide name "" is SERVING while the
# process is up (liveness); routers and readiness probes wait for this one.
STAGE_SERVICE = pb.DESCRIPTOR.services_by_name["Stage"].full_name
