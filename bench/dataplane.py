"""Per-hop time of hidden states between two stage processes: ``python -m ppspec.bench.dataplane``.

A receiver process serves ``Forward`` the way a stage takes its hidden states (inline
bytes decoded by ``proto.codec`` and moved to its device, or a ``TensorRef`` read by
``stage_server.dataplane.Receiver``) and answers once the tensor is on its device; this
process sends each tensor the way a stage relays one (``BytesLink``, ``SlotLink.put`` or
``DistLink.put``, the gRPC call, the slot given back). Prints the median milliseconds per hop
and the effective GB/s of each size and transport; no model runs, so what is left is the
data plane's own cost. On the CPU: bytes, ``shm`` and ``dist`` (gloo over loopback, as
between hosts). ``--device cuda:0``: both processes on that GPU, ``cuda_ipc`` against bytes
(``dist`` would be NCCL, which refuses two ranks on one GPU).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

SIZES = {  # name: (tokens, hidden, dtype)
    "1.46B decode, 1 request bf16": (1, 2048, "bfloat16"),  # a PP hop at concurrency 1: 4 KiB
    "demo decode, 64 requests": (64, 256, "float32"),
    "demo prefill, 2048 tokens": (2048, 256, "float32"),
    "1.46B prefill chunk, 512 tokens bf16": (512, 2048, "bfloat16"),
    "8000 tokens x 2048 fp32": (8000, 2048, "float32"),
}


async def _serve(port: int, device: str) -> None:
    import grpc
    import torch

    from ppspec.proto.codec import GRPC_OPTIONS, tensor_from_pb
    from ppspec.proto.stubs import pb, pb_grpc
    from ppspec.stage_server.dataplane import Receiver
    from ppspec.stage_server.dataplane_dist import DistInbox

    rx = Receiver(device, dist_inbox=DistInbox)

    class Sink(pb_grpc.StageServicer):
        async def Forward(self, request, context):
            if request.HasField("hidden_ref"):
                h = rx.read(request.hidden_ref, request.micro_batch_id, request.round)
            else:
                h = tensor_from_pb(request.hidden_states).to(device)
            if h.is_cuda:
                torch.cuda.synchronize(h.device)  # the hop ends with the tensor on the device
            return pb.StepResult(micro_batch_id=request.micro_batch_id, stage_seconds=[float(h.shape[0])])

        async def AttachDataPlane(self, request, context):
            return rx.attach(request, "127.0.0.1")

    server = grpc.aio.server(options=GRPC_OPTIONS)
    pb_grpc.add_StageServicer_to_server(Sink(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


async def _measure(port: int, iters: int, device: str) -> list[tuple[str, str, float, float]]:
    import grpc
    import torch

    from ppspec.proto.codec import GRPC_OPTIONS
    from ppspec.proto.stubs import pb, pb_grpc
    from ppspec.stage_server import dataplane as dp

    rows = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS) as ch:
        stub = pb_grpc.StageStub(ch)
        shm = dp.SlotLink(dp.choose("auto", device), "bench", device)
        probe, nonce = dp.make_probe(shm)
        reply = await stub.AttachDataPlane(pb.AttachRequest(sender_id="bench", host_id=dp.host_id(),
                                                            transport=shm.transport, probe=probe.ref, nonce=nonce))
        assert reply.transport == shm.transport, reply.detail
        shm.done(probe, answered=True)
        links = [dp.BytesLink(), shm]
        if device == "cpu":
            from ppspec.stage_server.dataplane_dist import DistLink

            reply = await stub.AttachDataPlane(pb.AttachRequest(sender_id="bench-dist", host_id="elsewhere/1",
                                                                transport="dist", dist_backend="gloo"))
            assert reply.transport == "dist", reply.detail
            links.append(await asyncio.to_thread(DistLink, "bench-dist", device, "127.0.0.1", reply.store_port))
        try:
            for name, (tokens, hidden, dtype) in SIZES.items():
                h = torch.randn(tokens, hidden).to(device=device, dtype=getattr(torch, dtype))
                for link in links:
                    times = []
                    for i in range(iters + 2):  # the first two warm the slot and the channel
                        req = pb.StepRequest(micro_batch_id=i, round=i, mode="decode")
                        if h.is_cuda:
                            torch.cuda.synchronize(h.device)  # the hop starts with the tensor made
                        t0 = time.perf_counter()
                        sent = link.put(h, i, i)
                        sent.fill(req)
                        res = await stub.Forward(req)
                        link.done(sent, answered=True)
                        times.append(time.perf_counter() - t0)
                        assert res.stage_seconds[0] == tokens
                    ms = statistics.median(times[2:]) * 1e3
                    rows.append((name, link.transport, ms, h.numel() * h.element_size() / ms / 1e6))
        finally:
            for link in links:
                link.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.dataplane", description=__doc__)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cpu", help="cpu (shm against bytes) or cuda:N (cuda_ipc against bytes)")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)  # the receiver process
    a = ap.parse_args(argv)
    if a.serve is not None:
        asyncio.run(_serve(a.serve, a.device))
        return 0
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rx = subprocess.Popen([sys.executable, "-m", "ppspec.bench.dataplane", "--serve", str(port), "--device", a.device],
                          stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout.readline().strip() == "ready"
        rows = asyncio.run(_measure(port, a.iters, a.device))
    finally:
        rx.terminate()
        rx.wait()
    print(f"{'tensor':40s} {'transport':>9s} {'ms/hop':>9s} {'GB/s':>7s}")
    for name, transport, ms, gbs in rows:
        print(f"{name:40s} {transport:>9s} {ms:9.3f} {gbs:7.2f}")
    by = {(n, t): ms for n, t, ms, _ in rows}
    for name in SIZES:
        print(f"{name}: " + ", ".join(f"{t} {by[(name, 'bytes')] / by[(name, t)]:.1f}x" for n, t, _, _ in rows
                                      if n == name and t != "bytes") + " faster than bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
