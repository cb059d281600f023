"""Where one round's time goes on its way through the served pipeline: ``python -m ppspec.bench.hop_trace``.

Starts ``--pp`` stages (``ppspec stage``, one process each, on loopback; by default the tiny
random checkpoint of ``served_vs_engine --tiny``: hidden size 64, so compute is negligible),
drives them as the router does (``GrpcPipeline.step``: one prefill, then ``--rounds``
decode rounds of ``--batch`` requests, one round at a time) and records
``time.perf_counter_ns`` (CLOCK_MONOTONIC, one clock for every process of the host) at each
point of a step: in the router (encode, send, answer, decode) and in every stage (handler
entered, request decoded, handed to the compute thread, hidden states read, the runner's
step, hidden states onto the data plane, back on the event loop, relayed, answered, result
encoded). Prints the median and 90th percentile microseconds of each segment over the
rounds after the first 10: the hops are the segments from one process's send to the next
one's handler, and back; a hop to a stage is split where that stage has read and parsed the
step (``StepServer.submit``, on its socket or its gRPC stream, docs/DESIGN.md, "Control
channel"). ``--stage-args "--control-channel grpc"`` times the same code on gRPC.

The stages record through wrappers around ``StageServicer``'s methods (this file run with
``--stage-trace``), so the served code runs unchanged. To trace another checkout, run this
file from the folder that holds its ``ppspec`` package, with that folder on ``PYTHONPATH``
(as ``served_vs_engine --baseline-pythonpath`` takes it)::

    cd DIR && PYTHONPATH=DIR python /path/to/bench/hop_trace.py --pp 2
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ns = time.perf_counter_ns


def _wrap_calls(events: list) -> None:
    """Stamp ``call0`` / ``call1`` around every step this process sends to a stage: on its
    step channel (the stage's socket or the Steps stream), or (checkouts before them) a Steps
    stream or a unary Forward."""
    try:
        from ppspec.proto import local as sender
        sends = sender.StepChannel
    except ImportError:
        try:
            from ppspec.proto import stream as sender
            sends = sender.StepStream
        except ImportError:
            sends = None
    if sends is not None:
        send = sends.step

        async def step(self, req, timeout):
            events.append((req.round, "call0", ns()))
            res = await send(self, req, timeout)
            events.append((req.round, "call1", ns()))
            return res
        sends.step = step
    from ppspec.proto.stubs import pb_grpc
    init = pb_grpc.StageStub.__init__

    def stub_init(self, channel):
        init(self, channel)
        forward = self.Forward

        async def call(req, **kw):
            events.append((req.round, "call0", ns()))
            res = await forward(req, **kw)
            events.append((req.round, "call1", ns()))
            return res
        self.Forward = lambda req, **kw: call(req, **kw)
    pb_grpc.StageStub.__init__ = stub_init


def stage_main(out: str, argv: list[str]) -> int:
    """``ppspec stage`` with stamps; writes ``[(round, point, ns)]`` to ``out`` at exit."""
    import atexit

    from ppspec.stage_server import runner, server

    events: list = []
    atexit.register(lambda: json.dump(events, open(out, "w")))
    _wrap_calls(events)

    def stamped(fn, before, after, key):
        @functools.wraps(fn)
        def f(*a, **kw):
            r = key(*a)
            events.append((r, before, ns()))
            res = fn(*a, **kw)
            events.append((r, after, ns()))
            return res
        return f

    server.step_from_pb = stamped(server.step_from_pb, "decode0", "decode1", lambda m, *a: m.round)
    server.result_to_pb = stamped(server.result_to_pb, "encode0", "encode1", lambda o: o.round)
    runner.StageRunner.step = stamped(runner.StageRunner.step, "step0", "step1", lambda self, inp: inp.round)
    server.StageServicer._run = stamped(server.StageServicer._run, "thread0", "thread1",
                                        lambda self, inp, *a: inp.round)
    try:  # the step read off the socket or the stream, parsed (checkouts before StepServer: none)
        from ppspec.proto import stream

        submit = stream.StepServer.submit

        def read(self, request):
            events.append((request.round, "read", ns()))
            return submit(self, request)
        stream.StepServer.submit = read
    except (ImportError, AttributeError):
        pass
    compute, step_once = server.StageServicer._compute, server.StageServicer._step_once

    async def _compute(self, fn, *args, **kw):
        if getattr(fn, "__name__", "") != "_run":
            return await compute(self, fn, *args, **kw)
        events.append((args[0].round, "submit", ns()))
        res = await compute(self, fn, *args, **kw)
        events.append((args[0].round, "back", ns()))
        return res

    async def _step_once(self, request, context, verify, *rest):
        r = request.round
        events.append((r, "enter", ns()))
        res = await step_once(self, request, context, verify, *rest)
        events.append((r, "exit", ns()))
        return res
    server.StageServicer._compute, server.StageServicer._step_once = _compute, _step_once
    return server.main(argv)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports, all bound at once (as ``ppspec.argtypes.free_ports``,
    which a traced older checkout may lack: this file runs against its ``ppspec``)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


async def drive(addresses: list[str], rounds: int, batch: int, events: list) -> None:
    from ppspec.proto.messages import SamplingSpec, StepInput
    from ppspec.router.grpc_pipeline import GrpcPipeline

    _wrap_calls(events)
    pipe = GrpcPipeline(addresses)
    await pipe.wait_ready(600)
    await pipe.info(claim=True)
    rows, prompt = list(range(batch)), list(range(100, 116))

    # each request's spec built once, as the router's scheduler does (Request.spec)
    request_specs = [SamplingSpec() for _ in rows]

    def specs():
        return list(request_specs)
    out = await pipe.step(StepInput(0, 1, "prefill", rows, [0] * batch, [len(prompt)] * batch, prompt * batch,
                                    sample=[True] * batch, next_token_ids=[-1] * batch, sampling=specs(),
                                    output_lens=[0] * batch))
    seq = len(prompt)
    for r in range(2, rounds + 2):
        inp = StepInput(0, r, "decode", rows, [seq] * batch, [1] * batch, [o[-1] for o in out.output_ids],
                        sample=[True] * batch, next_token_ids=[-1] * batch, sampling=specs(),
                        output_lens=[r - 2] * batch)
        events.append((r, "step0", ns()))
        out = await pipe.step(inp)
        events.append((r, "step1", ns()))
        seq += 1
    await pipe.close()


def segments(pp: int, by_round: dict[int, dict[str, int]]) -> dict[str, list[float]]:
    """Microseconds of each segment of a round, per round: ``R.`` points are the router's,
    ``k.`` stage k's."""
    spans = [("router: a round (GrpcPipeline.step)", "R.step0", "R.step1"),
             ("router: encode (step_to_pb)", "R.step0", "R.call0"),
             ("hop router -> stage 0 (send to handler)", "R.call0", "0.enter"),
             ("  router -> stage 0: send to the stage's read, message parsed", "R.call0", "0.read"),
             ("  router -> stage 0: read to handler (the step's task started)", "0.read", "0.enter")]
    for k in range(pp):
        s, last = f"{k}.", k == pp - 1
        spans += [(f"stage {k}: decode (step_from_pb)", s + "decode0", s + "decode1"),
                  (f"stage {k}: checks, commit order", s + "decode1", s + "submit"),
                  (f"stage {k}: hand-off to the compute thread", s + "submit", s + "thread0"),
                  (f"stage {k}: hidden states read", s + "thread0", s + "step0"),
                  (f"stage {k}: runner.step (batch build, forward, sample)", s + "step0", s + "step1"),
                  (f"stage {k}: hidden states onto the data plane", s + "step1", s + "thread1"),
                  (f"stage {k}: hand-off back to the event loop", s + "thread1", s + "back")]
        if last:
            spans += [(f"stage {k}: encode (result_to_pb)", s + "encode0", s + "encode1"),
                      (f"hop stage {k} -> {'router' if k == 0 else f'stage {k - 1}'} (handler exit to answer)",
                       s + "exit", "R.call1" if k == 0 else f"{k - 1}.call1")]
        else:
            spans += [(f"stage {k}: to the relay", s + "back", s + "call0"),
                      (f"hop stage {k} -> stage {k + 1} (send to handler)", s + "call0", f"{k + 1}.enter"),
                      (f"  stage {k} -> stage {k + 1}: send to the stage's read, message parsed", s + "call0",
                       f"{k + 1}.read"),
                      (f"  stage {k} -> stage {k + 1}: read to handler (the step's task started)", f"{k + 1}.read",
                       f"{k + 1}.enter"),
                      (f"stage {k}: answer to handler exit", s + "call1", s + "exit")]
            if k == 0:
                spans.append(("hop stage 0 -> router (handler exit to answer)", "0.exit", "R.call1"))
            else:
                spans.append((f"hop stage {k} -> stage {k - 1} (handler exit to answer)", s + "exit", f"{k - 1}.call1"))
    out: dict[str, list[float]] = {}
    for r, d in sorted(by_round.items()):
        if r < 12 or "R.step0" not in d:  # the prefill, the first rounds, the warm-up are not timed
            continue
        for name, a, b in spans:
            if a in d and b in d:
                out.setdefault(name, []).append((d[b] - d[a]) / 1e3)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--stage-trace"]:
        if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
            sys.path.pop(0)  # run as a file: bench/'s modules must not shadow top-level names
        return stage_main(argv[1], argv[2:])
    ap = argparse.ArgumentParser(prog="python -m ppspec.bench.hop_trace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--model", default=None, help="checkpoint (default: a tiny random one, made)")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--stage-args", default="", help="more arguments for each ppspec stage")
    a = ap.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="hop-trace-")
    if a.model is None:
        from ppspec.bench.served_vs_engine import make_tiny

        a.model = make_tiny(os.path.join(tmp, "tiny"))
    ports = _free_ports(a.pp)
    # every row's KV: its 16-token prompt and a token a round, a page of slack each
    kv_tokens = max(8192, a.batch * (16 + a.rounds + 64))
    procs = []
    for k in range(a.pp):
        cmd = [sys.executable, os.path.abspath(__file__), "--stage-trace", os.path.join(tmp, f"stage{k}.json"),
               "--model", a.model, "--pp-rank", str(k), "--pp-size", str(a.pp), "--port", str(ports[k]),
               "--num-threads", "1", "--max-rows", str(max(8, a.batch)), "--kv-tokens", str(kv_tokens), *a.stage_args.split()]
        if k < a.pp - 1:
            cmd += ["--next-stage", f"127.0.0.1:{ports[k + 1]}"]
        procs.append(subprocess.Popen(cmd, stdout=open(os.path.join(tmp, f"stage{k}.log"), "w"),
                                      stderr=subprocess.STDOUT))
    events: list = []
    try:
        asyncio.run(drive([f"127.0.0.1:{p}" for p in ports], a.rounds, a.batch, events))
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait(60)
    by_round: dict[int, dict[str, int]] = {}
    for r, point, t in events:
        by_round.setdefault(r, {})[f"R.{point}"] = t
    for k in range(a.pp):
        for r, point, t in json.load(open(os.path.join(tmp, f"stage{k}.json"))):
            by_round.setdefault(r, {})[f"{k}.{point}"] = t
    segs = segments(a.pp, by_round)
    rounds = segs["router: a round (GrpcPipeline.step)"]
    print(f"PP{a.pp}, batch {a.batch}, {len(rounds)} decode rounds timed ({a.model}); microseconds")
    print(f"| segment | median | p90 |\n|---|---|---|")
    for name, v in segs.items():
        print(f"| {name} | {statistics.median(v):.0f} | {sorted(v)[int(0.9 * len(v))]:.0f} |")
    compute = sum(statistics.median(segs[f"stage {k}: runner.step (batch build, forward, sample)"]) for k in range(a.pp))
    print(f"\nround {statistics.median(rounds):.0f} us, of which runner.step {compute:.0f} us (every stage): "
          f"{statistics.median(rounds) - compute:.0f} us outside the runner")
    return 0


if __name__ == "__main__":
    sys.exit(main())
