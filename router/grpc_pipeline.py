"""The pipeline over gRPC: stage 0 takes each step (it relays to the others), every stage
takes commits and releases, and a monitor watches each stage's gRPC health service."""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ppspec.auth import client_interceptors, key_metadata
from ppspec.proto.codec import (
    GRPC_OPTIONS, RECONNECT_OPTIONS, SpecMemo, commit_to_pb, info_from_pb, release_to_pb, result_from_pb, step_to_pb,
)
from ppspec.proto.local import StepChannel, host_id, same_host
from ppspec.proto.messages import Commit, Release, StageInfo, StepInput, StepOutput
from ppspec.proto.stream import StepStream
from ppspec.proto.stubs import STAGE_SERVICE, pb, pb_grpc

from .pipeline import Pipeline
from .types import StageDownError

log = logging.getLogger("ppspec.router")

# A router reads every stage's Info each monitor period (1 s); one silent this long is gone.
ROUTER_LEASE_S = 3.0
# A stage re-reads its next stage every 2 s: a chain disagreement shorter than this is a
# restart not yet seen, not a wiring error.
CHAIN_GRACE_S = 5.0
# keys of GrpcPipeline.down beside the stage indices
_CHAIN, _DISPLACED = -1, -2


class GrpcPipeline(Pipeline):
    """Stages at ``addresses`` (``host:port``, in PP-rank order).

    Args:
        step_timeout: seconds a micro-batch may take through the whole pipeline; past it
            the step fails with StageDownError (a wedged pipeline).
        rpc_timeout: seconds for commits, releases and info.
        key: the pipeline key (``ppspec.auth``), sent with every call; None: none sent.
    """

    def __init__(self, addresses: list[str], step_timeout: float = 120.0, rpc_timeout: float = 30.0,
                 key: bytes | None = None):
        if not addresses:
            raise ValueError("no stage addresses")
        self.addresses = list(addresses)
        self.step_timeout, self.rpc_timeout = step_timeout, rpc_timeout
        self.channels = [grpc.aio.insecure_channel(a, options=GRPC_OPTIONS + RECONNECT_OPTIONS,
                                                   interceptors=client_interceptors(key)) for a in self.addresses]
        self.stubs = [pb_grpc.StageStub(c) for c in self.channels]
        self.health_stubs = [health_pb2_grpc.HealthStub(c) for c in self.channels]
        # each stage's step channel: its socket when on this host (proto/local.py), else its
        # gRPC Steps stream. Every step goes to stage 0 on its channel; commits and releases
        # go to every stage on its own (StepRequest.commit_call / release_call), not as
        # unary calls, which cost both ends several times a frame on the socket
        self.controls = [StepChannel(StepStream(stub, key_metadata(key)), key, who=f"router -> stage {k}")
                         for k, stub in enumerate(self.stubs)]
        self.steps = self.controls[0]
        self.specs = SpecMemo()  # each row's last sampling spec, encoded once (codec.SpecMemo)
        self.down: dict[int, str] = {}
        self._monitor: asyncio.Task | None = None
        # this router, as the stages' Info sees it (they tell a new router whether another
        # one still asks them: one router per pipeline)
        self.router_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self.instances: list[str] | None = None  # each stage's instance_id at the first Info
        self.claimed = False  # this router claimed the stages (check_start): it owns them
        self.on_restart = None  # f(stage, detail): a stage answers as another process
        self.on_displaced = None  # f(detail): another router claimed the stages
        self._chain_bad_since: float | None = None
        self.data_plane = ""  # the hops' transports as the stages last said (/health)

    def _error(self, stage: int | None, e: grpc.aio.AioRpcError, what: str) -> StageDownError:
        """The error a failed call raises. A stage that denied this router (another router
        claimed it since) also puts this router down for good, as the monitor does once it
        sees the claim: the rows are the new owner's."""
        if e.code() == grpc.StatusCode.PERMISSION_DENIED:
            self._displace(e.details())
        where = f"stage {stage} ({self.addresses[stage]})" if stage is not None else "the pipeline"
        return StageDownError(f"{what} failed at {where}: {e.code().name}: {e.details()}")

    def _displace(self, why: str) -> None:
        """Another router took the stages over (``why``: how this router learnt it): down
        for good, the engine told once."""
        if _DISPLACED in self.down:
            return
        detail = (f"another router took over these stages ({why}); this router ({self.router_id}) no longer "
                  f"serves them: stop it")
        self.down[_DISPLACED] = detail
        if self.on_displaced is not None:
            self.on_displaced(detail)

    async def wait_ready(self, timeout: float) -> None:
        """Wait until every stage's health service answers SERVING for the stage service
        (a stage is SERVING once its next stage answered as pp_rank + 1).

        Raises:
            StageDownError: naming the first stage not serving after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        next_note = time.monotonic() + 10.0
        for k, stub in enumerate(self.health_stubs):
            why = f"stage {k} at {self.addresses[k]} is unreachable"
            while True:
                try:
                    r = await stub.Check(health_pb2.HealthCheckRequest(service=STAGE_SERVICE), timeout=2.0)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                    why = await self._not_serving(k, 2.0)
                except grpc.aio.AioRpcError:
                    pass
                now = time.monotonic()
                if now > deadline:
                    raise StageDownError(why)
                if now > next_note:  # say what it waits for, not just hang
                    log.warning("waiting for stage %d at %s to serve (%.0f s left)", k, self.addresses[k], deadline - now)
                    next_note = now + 10.0
                await asyncio.sleep(0.2)

    async def check_key(self) -> None:
        """Before serving: every stage takes this router's pipeline key (or needs none). The
        probe is a Release of no row, which changes nothing.

        Raises:
            StageDownError: naming the first stage that refused the key.
        """
        for k, stub in enumerate(self.stubs):
            try:
                await stub.Release(pb.ReleaseRequest(router_id=self.router_id), timeout=self.rpc_timeout)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise StageDownError(f"stage {k} ({self.addresses[k]}) refused this router: "
                                         f"{e.code().name}: {e.details()}") from None

    async def _infos(self, timeout: float, claim: bool = False) -> list[StageInfo | grpc.aio.AioRpcError]:
        """Every stage's Info as this router (``claim``: taking the stages over), or the
        error of each stage that did not answer."""
        req = pb.InfoRequest(router_id=self.router_id, claim=claim)
        out = []
        for s in self.stubs:
            try:
                out.append(info_from_pb(await s.Info(req, timeout=timeout)))
            except grpc.aio.AioRpcError as e:
                out.append(e)
        return out

    async def info(self, claim: bool = False) -> list[StageInfo]:
        """Every stage's Info, as this router (``claim``: taking the stages over).

        Raises:
            StageDownError: naming the first stage that did not answer.
        """
        out = await self._infos(self.rpc_timeout, claim)
        for k, i in enumerate(out):
            if isinstance(i, grpc.aio.AioRpcError):
                raise self._error(k, i, "Info")
        self.claimed = self.claimed or claim
        if self.instances is None:
            self.instances = [i["instance_id"] for i in out]
        for k, i in enumerate(out):
            self._use_socket(k, i)
        return out

    def _use_socket(self, k: int, i: StageInfo) -> None:
        """Stage ``k``'s channel on its socket when it has one on this host, else on gRPC (at
        start, and each time the engine reads Info again: a restarted stage has a new
        socket, and one that could not be opened is tried again)."""
        name, why = i.get("control_socket", ""), ""
        if not name:
            why = f"stage {k} offers no step socket (its --control-channel grpc)"
        elif not same_host(i.get("host_id", ""), host_id()):
            name, why = "", f"stage {k} is on another host ({i.get('host_id')})"
        self.controls[k].use(name, why)

    commits_ride_steps = True

    async def step(self, inp: StepInput, commit: Commit | None = None) -> StepOutput:
        """``commit``: the commit of this micro-batch's last verify, which every stage
        applies before the step (``StepRequest.commit``) instead of a CommitAccept of its own;
        its seconds per stage come back in the output's ``commit_seconds``."""
        try:
            req = step_to_pb(inp, self.specs)
            req.router_id = self.router_id  # stages refuse the steps of a router that lost them
            if commit is not None:
                req.commit.CopyFrom(commit_to_pb(commit, self.router_id))
            res = await self.steps.step(req, self.step_timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise ValueError(e.details()) from None
            details = e.details() or ""
            stage = 0
            if details.startswith("stage ") and details.split()[1].isdigit():
                stage = int(details.split()[1])
            raise self._error(stage, e, f"{inp.mode} of micro-batch {inp.micro_batch_id}") from None
        return result_from_pb(res)

    async def prepare_grammar(self, grammar: str) -> None:
        """``PrepareGrammar`` on the last stage; ValueError (its reason) when it does not compile."""
        stage = len(self.stubs) - 1
        try:
            await self.stubs[stage].PrepareGrammar(pb.GrammarRequest(grammar=grammar, router_id=self.router_id),
                                                   timeout=self.step_timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(e.details()) from None
            raise self._error(stage, e, "prepare grammar") from None

    async def commit_accept(self, c: Commit) -> list[float]:
        """CommitAccept to every stage, the last included; returns each stage's seconds."""
        return await self._call_every_stage("commit_call", commit_to_pb(c, self.router_id),
                                            f"commit of micro-batch {c.micro_batch_id} round {c.round}")

    async def _call_every_stage(self, field: str, call, what: str) -> list[float]:
        """The call ``call`` (a ``pb.CommitRequest`` as ``field`` ``commit_call``, or a
        ``pb.ReleaseRequest`` as ``release_call``) on every stage's step channel, at once;
        each stage's ``commit_seconds`` (0.0 where none came). Raises StageDownError for the
        first stage that failed it."""
        # a message per channel: each sets its own call_id, and the gRPC stream serializes later
        replies = await asyncio.gather(
            *(ch.step(pb.StepRequest(router_id=self.router_id, **{field: call}), self.rpc_timeout)
              for ch in self.controls), return_exceptions=True)
        for k, r in enumerate(replies):
            if isinstance(r, grpc.aio.AioRpcError):
                raise self._error(k, r, what)
            if isinstance(r, BaseException):
                raise r
        return [r.commit_seconds[0] if r.commit_seconds else 0.0 for r in replies]

    async def release(self, r: Release) -> list[float] | None:
        """Release rows on every stage. Each stage first applies ``r.commit`` if any, waits
        for pending commits of those rows, or with ``abandon`` (after a failure: no commit
        will come) drops them; then snapshots the rows with a slot in ``snapshot_slots``
        (the prefix cache), releases them and drops the prefix-cache ``drop_slots``.
        Returns each stage's seconds for ``r.commit`` (None without one)."""
        if not r.req_pool_indices and not r.drop_slots and r.commit is None:
            return None
        secs = await self._call_every_stage("release_call", release_to_pb(r, self.router_id), "release")
        return secs if r.commit is not None else None

    # ---- health
    async def _watch(self, period: float) -> None:
        """Each period: every stage's health (for the stage service: a stage whose next stage
        is wrong does not serve), then the Info of every stage that answers, which keeps this
        router known to them (also while another stage is down), tells a restarted stage (new
        instance_id) or another router's claim, and checks the relay chain."""
        while True:
            serving = []
            for k, stub in enumerate(self.health_stubs):
                try:
                    r = await stub.Check(health_pb2.HealthCheckRequest(service=STAGE_SERVICE), timeout=max(1.0, period))
                    ok = r.status == health_pb2.HealthCheckResponse.SERVING
                    detail = "" if ok else await self._not_serving(k, period)
                except grpc.aio.AioRpcError as e:
                    ok, detail = False, f"stage {k} ({self.addresses[k]}) is down: {e.code().name}"
                if ok:
                    serving.append(k)
                else:
                    self.down[k] = detail
            if _DISPLACED not in self.down:  # a displaced router stays silent
                # a stage that did not answer: the health check says which
                infos = await self._infos(max(1.0, period))
                for k in self._check_infos([i if isinstance(i, dict) else None for i in infos]):
                    # a restarted stage owns no router: claim it again, so that it fences too
                    try:
                        await self.stubs[k].Info(pb.InfoRequest(router_id=self.router_id, claim=True),
                                                 timeout=max(1.0, period))
                    except grpc.aio.AioRpcError:
                        pass  # the next period tries again
                # a stage that was down counts as up once its Info has answered: had it
                # restarted, the engine has been told above (on_restart) before the
                # pipeline's health turns 200, so no request is admitted into the window
                # between the two and then failed as "restarted"
                serving = [k for k in serving if k not in self.down or isinstance(infos[k], dict)]
            for k in serving:
                self.down.pop(k, None)
            await asyncio.sleep(period)

    async def _not_serving(self, k: int, period: float) -> str:
        """Why stage k answers NOT_SERVING, as its Info says (a tool's Info: this router's
        lease is the monitor's own Info)."""
        why = ""
        try:
            why = (await self.stubs[k].Info(pb.InfoRequest(), timeout=max(1.0, period))).not_serving
        except grpc.aio.AioRpcError:
            pass
        return f"stage {k} ({self.addresses[k]}) is not serving: {why or 'see its log'}"

    async def check_start(self, infos: list[StageInfo]) -> list[StageInfo]:
        """Before serving: no other router uses these stages, and each stage relays to the
        stage this router knows as the next. Another router that asked a stage within
        ``ROUTER_LEASE_S`` may be alive: it is, if it asks again while this router watches
        (up to that long); a killed one stops asking. Then claims the stages (a router that
        was only paused sees the claim and stops serving). Returns fresh infos.

        Raises:
            ValueError: another router serves these stages, or the relay chain is not the
            router's ``--stages``.
        """
        def recent(infos):
            return {(r, k): idle for k, i in enumerate(infos) for r, idle in i["routers"].items()
                    if idle < ROUTER_LEASE_S}

        seen = recent(infos)
        deadline = time.monotonic() + ROUTER_LEASE_S + 0.5
        while seen and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            infos = await self.info()
            now = recent(infos)
            again = [(r, k, idle) for (r, k), idle in now.items() if idle < seen.get((r, k), float("inf"))]
            if again:
                r, k, idle = again[0]
                raise ValueError(f"another router ({r}) serves these stages: it asked stage {k} "
                                 f"({self.addresses[k]}) {idle:.1f}s ago; one router per pipeline, stop it first")
            seen = now
        err = chain_error(infos, self.addresses)
        if err:
            raise ValueError(err)
        return await self.info(claim=True)

    async def leave(self) -> None:
        """On a clean exit: tell every stage this router is gone (best effort), so that the
        next router need not wait out the lease. The monitor stops first (its Info would
        announce this router again)."""
        if self._monitor is not None:
            self._monitor.cancel()
        req = pb.InfoRequest(router_id=self.router_id, leaving=True)
        await asyncio.gather(*(s.Info(req, timeout=2.0) for s in self.stubs), return_exceptions=True)

    async def owns_stages(self) -> bool:
        """Whether no other router has claimed any stage that answers (and none took one
        from this router, even if it has left since)."""
        try:
            infos = await self.info()
            others = {i["owner_router_id"] for i in infos} - {"", self.router_id}
            return not (others or any(i["replaced"] for i in infos))
        except StageDownError:
            return True  # the stages that answer decide the next time; release what it can

    def _check_infos(self, infos: list[StageInfo | None]) -> list[int]:
        """The monitor's reading of every stage's Info (None: no answer): restarts,
        another router's claim (this one is then down for good), the relay chain. Returns
        the stages this router claimed that own no router now (restarted): to claim again."""
        for k, i in enumerate(infos):
            if i is not None and self.instances and i["instance_id"] != self.instances[k]:
                detail = f"stage {k} ({self.addresses[k]}) restarted (instance {i['instance_id']})"
                self.instances[k] = i["instance_id"]
                if self.on_restart is not None:
                    self.on_restart(k, detail)
        owners = {i["owner_router_id"] for i in infos if i is not None} - {"", self.router_id}
        if owners:
            # this router was silent past the lease (paused, or cut off) and another one took
            # the stages over: its rows are no longer its own, so it must not touch them
            self._displace(f"router {owners.pop()} claimed them")
            return []
        taken = [k for k, i in enumerate(infos) if i is not None and i["replaced"]]
        if taken:
            # as above, and the router that took over has left since: the stages remember
            self._displace(f"stage {taken[0]} says so; that router has left since")
            return []
        reclaim = [k for k, i in enumerate(infos) if i is not None and not i["owner_router_id"]] if self.claimed else []
        if any(i is None for i in infos):
            return reclaim
        plane = "; ".join(p for p in (data_plane(infos), control_plane(infos, self.steps)) if p)
        if plane != self.data_plane:
            (log.warning if "fell back" in plane else log.info)("%s", plane)
            self.data_plane = plane
        err = chain_error(infos, self.addresses)
        now = time.monotonic()
        if not err:
            self._chain_bad_since = None
            self.down.pop(_CHAIN, None)
        elif self._chain_bad_since is None:
            self._chain_bad_since = now
        elif now - self._chain_bad_since > CHAIN_GRACE_S:
            self.down[_CHAIN] = err
        return reclaim

    def recovered(self, infos: list[StageInfo]) -> None:
        """The stages as the engine recovered them: a restart seen there is handled, and the
        monitor must not take it for a new one after serving resumed."""
        self.instances = [i["instance_id"] for i in infos]

    def start_monitor(self, period: float = 1.0) -> None:
        if self._monitor is None:
            self._monitor = asyncio.ensure_future(self._watch(period))

    def health(self) -> tuple[bool, str]:
        if self.down:
            return False, "; ".join(self.down[k] for k in sorted(self.down))
        n = len(self.addresses)
        return True, f"{n} stage{'s' if n != 1 else ''} serving" + (f"; {self.data_plane}" if self.data_plane else "")

    async def close(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        for ch in self.controls:
            ch.close()
        for c in self.channels:
            await c.close()


def data_plane(infos: list[StageInfo]) -> str:
    """How hidden states go from stage to stage, as the stages say (their Info): one
    transport for every hop, or each hop's, with why a hop fell back to bytes."""
    hops = [(k, i["transport"], i["transport_detail"]) for k, i in enumerate(infos[:-1])]
    if not hops:
        return ""
    if len({t for _, t, _ in hops}) == 1 and not any(d for *_, d in hops):
        return f"data plane: {hops[0][1]}"
    return "data plane: " + "; ".join(
        f"stage {k} -> {k + 1} {t or 'not attached'}" + (f" (fell back: {d})" if d else "") for k, t, d in hops)


def control_plane(infos: list[StageInfo], first: StepChannel) -> str:
    """What the steps' control messages go on, hop by hop (``first``: the router's hop to
    stage 0): "control: socket" when every hop is on a socket, else each hop's, with why
    gRPC where it says."""
    hops = [("router -> stage 0", first.transport, first.detail)]
    hops += [(f"stage {k} -> {k + 1}", i.get("control", ""), i.get("control_detail", ""))
             for k, i in enumerate(infos[:-1])]
    if all(t == "socket" for _, t, _ in hops):
        return "control: socket"
    return "control: " + "; ".join(f"{h} {t or 'not attached'}" + (f" ({d})" if d else "") for h, t, d in hops)


def chain_error(infos: list[StageInfo], addresses: list[str]) -> str:
    """'' when stage k relays to the stage the router knows as stage k + 1 (by instance_id),
    else what is wrong: a stage whose ``--next-stage`` is another process than the router's
    ``--stages`` names would get steps the router never sees commit or release."""
    for k in range(len(infos) - 1):
        nxt, want = infos[k].get("next_instance_id", ""), infos[k + 1].get("instance_id", "")
        if nxt and want and nxt != want:
            return (f"stage {k} ({addresses[k]}) relays to another process than stage {k + 1} "
                    f"({addresses[k + 1]}): its --next-stage and the router's --stages disagree")
    return ""
