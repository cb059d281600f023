#!/usr/bin/env python3
"""Container health probe for ppspec processes (installed in the image as ppspec-healthcheck).

    ppspec-healthcheck grpc HOST:PORT [--service NAME]   # a stage: standard gRPC health service
    ppspec-healthcheck http URL                          # the router: GET URL (e.g. /health)

Exit status 0 when healthy (gRPC SERVING, or HTTP 2xx), 1 otherwise, with one line saying
why on stderr. Kubernetes probes the same endpoints natively (grpc / httpGet probes); this
script is for docker-compose healthchecks, which can only run a command.
"""
from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request


def check_grpc(target: str, service: str, timeout: float) -> str | None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return f"{target}: {e.code().name} {e.details() or ''}".strip()
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{target}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return None


def check_http(url: str, timeout: float) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return None if 200 <= resp.status < 300 else f"{url}: HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        return f"{url}: HTTP {e.code}"
    except OSError as e:
        return f"{url}: {e}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ppspec-healthcheck", description="health probe for ppspec containers")
    sub = ap.add_subparsers(dest="kind", required=True)
    g = sub.add_parser("grpc", help="standard gRPC health check of a stage")
    g.add_argument("target", help="HOST:PORT")
    g.add_argument("--service", default="", help="service name ('' = the whole server)")
    h = sub.add_parser("http", help="HTTP GET, healthy on 2xx")
    h.add_argument("url")
    ap.add_argument("--timeout", type=float, default=3.0, help="seconds")
    args = ap.parse_args(argv)
    if args.kind == "grpc":
        problem = check_grpc(args.target, args.service, args.timeout)
    else:
        problem = check_http(args.url, args.timeout)
    if problem:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
