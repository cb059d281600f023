"""The pipeline key (``ppspec.auth``): a stage started with ``--pipeline-key-file`` refuses
every call that would change it (Forward, Verify, a Steps stream, CommitAccept, Release, AttachDataPlane,
an Info that claims or leaves) without the key or with a wrong one (UNAUTHENTICATED), and with the key a
call that names no router (PERMISSION_DENIED); each refusal changes nothing (rows, KV
pages, pending commits, owner), and the request that held the rows finishes with the
tokens it gives untouched. Read-only Info and health stay open. A router with a wrong key
or none refuses to start, naming the stage; a missing key file stops a stage with exit 2."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster import Cluster, free_port
from ppspec.auth import METADATA_KEY, KeyFileError, read_key_file
from ppspec.proto import local
from ppspec.proto.codec import GRPC_OPTIONS, result_from_pb, step_to_pb
from ppspec.proto.messages import SamplingSpec, StepInput
from ppspec.proto.stubs import STAGE_SERVICE, pb, pb_grpc
from ppspec.router.grpc_pipeline import GrpcPipeline
from ppspec.router.types import StageDownError

STEPS, D, ROWS, TIMEOUT = 3, 4, 4, 30
PROMPT = list(range(10, 30))
KEY, WRONG = b"0123456789abcdef-the-pipeline-key", b"0123456789abcdef-not-the-key...."
UNAUTH, DENIED = grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED


def call(fn, req, key=KEY):
    md = [(METADATA_KEY, key)] if key else None
    try:
        return "OK", fn(req, timeout=TIMEOUT, metadata=md)
    except grpc.RpcError as e:
        return e.code(), e.details()


class StepRefused(grpc.RpcError):
    """A step the Steps stream answered with a refusal, read as the unary call's error."""

    def __init__(self, res):
        self._code = next(c for c in grpc.StatusCode if c.value[0] == res.error_code)
        self._details = res.error

    def code(self):
        return self._code

    def details(self):
        return self._details


def steps(stub):
    """One step on a Steps stream of ``stub``, called as a unary method."""
    def fn(req, timeout, metadata):
        (res,) = stub.Steps(iter([req]), timeout=timeout, metadata=metadata)
        if res.error_code:
            raise StepRefused(res)
        return res
    return fn


class KeyedStages:
    """A PP2 pipeline with MTP (replay commits), both stages keyed; the test is its router."""

    def __init__(self, path, tmp):
        self.key_file = os.path.join(tmp, "key")
        with open(self.key_file, "wb") as f:
            f.write(KEY + b"\n")
        ports = [free_port(), free_port()]
        self.procs = []
        for k in (1, 0):
            argv = [sys.executable, "-m", "ppspec.cli", "stage", "--model", path, "--pp-rank", str(k), "--pp-size", "2",
                    "--port", str(ports[k]), "--max-rows", str(ROWS), "--kv-tokens", "512", "--num-threads", "1",
                    "--speculative-algorithm", "mtp", "--speculative-num-steps", str(STEPS),
                    "--commit-design", "replay", "--pipeline-key-file", self.key_file]
            if k == 0:
                argv += ["--next-stage", f"127.0.0.1:{ports[1]}"]
            self.procs.append(subprocess.Popen(argv, stdout=open(os.path.join(tmp, f"s{k}.log"), "w"),
                                               stderr=subprocess.STDOUT, start_new_session=True,
                                               env=dict(os.environ, OMP_NUM_THREADS="1")))
        self.ports = ports
        self.channels = [grpc.insecure_channel(f"127.0.0.1:{p}", options=GRPC_OPTIONS) for p in ports]
        self.s0, self.s1 = (pb_grpc.StageStub(c) for c in self.channels)
        deadline = time.monotonic() + 120
        for ch in self.channels:
            health = health_pb2_grpc.HealthStub(ch)  # open: no key
            while True:
                assert all(p.poll() is None for p in self.procs), f"a stage exited; logs in {tmp}"
                try:
                    if health.Check(health_pb2.HealthCheckRequest(service=STAGE_SERVICE),
                                    timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, "a stage did not start"
                time.sleep(0.2)
        for s in (self.s0, self.s1):
            assert call(s.Info, pb.InfoRequest(router_id="owner", claim=True))[0] == "OK"

    def stop(self):
        for ch in self.channels:
            ch.close()
        for p in self.procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    def state(self):
        """Per stage (rows in use, KV pages used, pending commits, owner), read without a key."""
        out = []
        for s in (self.s0, self.s1):
            i = s.Info(pb.InfoRequest(), timeout=TIMEOUT)
            out.append((i.rows_in_use, i.kv_pages_used, i.pending_commits, i.owner_router_id))
        return out

    def step(self, inp, verify=False):
        m = step_to_pb(inp)
        m.router_id = "owner"
        code, r = call(self.s0.Verify if verify else self.s0.Forward, m)
        assert code == "OK", r
        return result_from_pb(r)

    def commit(self, mb, rnd, rows, acc):
        req = pb.CommitRequest(micro_batch_id=mb, round=rnd, req_pool_indices=rows, accept_lengths=acc,
                               router_id="owner")
        assert [call(s.CommitAccept, req)[0] for s in (self.s0, self.s1)] == ["OK", "OK"]

    def release(self, rows):
        req = pb.ReleaseRequest(req_pool_indices=rows, router_id="owner")
        assert [call(s.Release, req)[0] for s in (self.s0, self.s1)] == ["OK", "OK"]


def spec():
    return [SamplingSpec(logprobs=2)]


def test_calls_without_the_key_change_nothing(make_ckpt, tmp_path):
    st = KeyedStages(make_ckpt("qwen3_5_ratio1"), str(tmp_path))
    try:
        def prefill(row):
            return st.step(StepInput(1, 1, "prefill", [row], [0], [20], PROMPT, sampling=spec()))

        def finish(row, first, drafts):
            # verify round 2 of micro-batch 3 pending, then what is left of the request
            v = st.step(StepInput(3, 2, "verify", [row], [20], [D], [first] + drafts, num_drafts=[len(drafts)],
                                  sampling=spec(), output_lens=[1]), verify=True)
            return v

        def rest(row, v):
            acc = len(v.output_ids[0])
            st.commit(3, 2, [row], [acc])
            d = st.step(StepInput(3, 3, "decode", [row], [20 + acc], [1], [v.output_ids[0][-1]], sampling=spec(),
                                  output_lens=[1 + acc]))
            st.release([row])
            return v.output_ids, v.logprobs, d.output_ids, d.logprobs, d.drafts

        r = prefill(1)
        ref = (r.output_ids, r.drafts, rest(1, finish(1, r.output_ids[0][0], r.drafts[0])))
        assert [s[:3] for s in st.state()] == [(0, 0, 0), (0, 0, 0)]

        # row 1 prefilled and verified (a commit pending on both stages), row 2 prefilled
        r = prefill(1)
        v = finish(1, r.output_ids[0][0], r.drafts[0])
        r2 = prefill(2)
        held = st.state()
        assert [h[2] for h in held] == [1, 1] and all(h[0] == 2 and h[3] == "owner" for h in held), held
        acc = len(v.output_ids[0])
        decode2 = step_to_pb(StepInput(4, 1, "decode", [2], [20], [1], [r2.output_ids[0][0]], sampling=spec(),
                                       output_lens=[1]))
        verify1 = step_to_pb(StepInput(3, 3, "verify", [1], [20 + acc], [D], [v.output_ids[0][-1]] * D,
                                       num_drafts=[STEPS], sampling=spec(), output_lens=[1 + acc]))
        everything = list(range(ROWS))
        cases = []  # (stub, method, request, the key's router ids this refusal holds for)
        for s in (st.s0, st.s1):
            for rid in ("owner", ""):
                for name, m in (("Forward", decode2), ("Verify", verify1), ("Steps", decode2), ("Steps", verify1)):
                    req = type(m)()
                    req.CopyFrom(m)
                    req.router_id = rid
                    cases.append((s, name, req, rid))
                cases.append((s, "CommitAccept", pb.CommitRequest(micro_batch_id=3, round=2, req_pool_indices=[1],
                                                                  accept_lengths=[acc], router_id=rid), rid))
                cases.append((s, "Release", pb.ReleaseRequest(req_pool_indices=everything, router_id=rid), rid))
                cases.append((s, "Release", pb.ReleaseRequest(req_pool_indices=everything, router_id=rid,
                                                              abandon=True), rid))
            cases.append((s, "AttachDataPlane", pb.AttachRequest(sender_id="intruder", transport="bytes"), "intruder"))
            cases.append((s, "Info", pb.InfoRequest(router_id="intruder", claim=True), "intruder"))
            cases.append((s, "Info", pb.InfoRequest(router_id="owner", leaving=True), "owner"))
        for s, name, req, rid in cases:
            fn = steps(s) if name == "Steps" else getattr(s, name)
            for key in (None, WRONG):
                code, msg = call(fn, req, key)
                assert code == UNAUTH, (name, rid, key, code, msg)
                assert "pipeline key" in msg and "refused" in msg, msg
                assert st.state() == held, (name, rid, key)
            if rid == "" and name not in ("Info", "AttachDataPlane"):  # with the key, a call must name its router
                code, msg = call(fn, req)
                assert code == DENIED and "names no router" in msg, (name, code, msg)
                assert st.state() == held, (name, "empty router id")
        # read-only Info stays open, the wrong key aside
        assert st.s0.Info(pb.InfoRequest(router_id="reader"), timeout=TIMEOUT).owner_router_id == "owner"
        assert call(st.s0.Info, pb.InfoRequest(), WRONG)[0] == UNAUTH
        # the held request goes on as if nothing happened
        assert (r.output_ids, r.drafts, rest(1, v)) == ref
        st.release([2])
        assert [s[:3] for s in st.state()] == [(0, 0, 0), (0, 0, 0)]
    finally:
        st.stop()


def test_a_missing_or_empty_key_file_stops_a_stage_naming_it(tmp_path, capsys):
    from ppspec.stage_server.server import main as stage_main

    missing, empty = str(tmp_path / "nope"), tmp_path / "empty"
    assert stage_main(["--pipeline-key-file", missing, "--port", str(free_port())]) == 2  # before any model loads
    err = capsys.readouterr().err
    assert err == f"ppspec stage 0: --pipeline-key-file {missing}: No such file or directory\n", err
    empty.write_text("\n")
    with pytest.raises(KeyFileError, match=f"--pipeline-key-file {empty}: the file is empty"):
        read_key_file(str(empty))


@pytest.fixture(scope="module")
def keyed_cluster(make_ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keyed")
    key_file = tmp / "key"
    key_file.write_bytes(KEY)
    path = make_ckpt("qwen3_5_ratio2_7l")
    c = Cluster(path, 3, "mtp", log_dir=str(tmp), stage_args=["--pipeline-key-file", str(key_file)],
                router_args=["--pipeline-key-file", str(key_file)])
    with c:
        yield c, tmp


def test_a_router_with_a_wrong_key_or_none_refuses_to_start_naming_the_stage(keyed_cluster):
    c, tmp = keyed_cluster
    (tmp / "wrong").write_bytes(WRONG)
    p = subprocess.run([sys.executable, "-m", "ppspec.cli", "router", "--model", c.model, "--stages", c.stages,
                        "--port", str(free_port()), "--connect-timeout", "30", "--pipeline-key-file", str(tmp / "wrong")],
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 2, p.stderr
    first = c.stages.split(",")[0]
    assert f"stage 0 ({first}) refused this router: UNAUTHENTICATED: stage 0: Release with a wrong pipeline key" \
        in p.stderr and "Traceback" not in p.stderr, p.stderr

    async def keyless():
        pipe = GrpcPipeline(c.stages.split(","))
        try:
            await pipe.check_key()
        finally:
            await pipe.close()

    with pytest.raises(StageDownError, match=f"stage 0 \\({first}\\) refused this router: UNAUTHENTICATED: "
                                             "stage 0: Release without the pipeline key"):
        asyncio.run(keyless())
    # the serving router still owns the stages
    assert httpx.get(c.url + "/health", timeout=10).status_code == 200


def test_release_of_every_row_during_traffic_is_refused(keyed_cluster):
    """The break-it trial's attack: ``Release(0..rows, router_id="")`` from any process, while
    requests run. Without the key (or with the key and no router id) it is refused, the
    requests finish with the tokens they give undisturbed, and every row is free after."""
    c, _ = keyed_cluster
    prompts = [[5 + i, 6, 7, 8 + i] * 3 for i in range(6)]
    body = dict(max_tokens=60, temperature=0.0, ignore_eos=True)

    async def run(attack):
        async with httpx.AsyncClient(timeout=300) as client:
            tasks = [asyncio.ensure_future(client.post(c.url + "/v1/completions", json=dict(body, prompt=p)))
                     for p in prompts]
            refusals = []
            if attack:
                while not any(i.rows_in_use for i in c.stage_infos()):
                    await asyncio.sleep(0.05)
                for port in c.stage_ports:
                    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                        stub = pb_grpc.StageStub(ch)
                        for rid, key in (("", None), ("", WRONG), ("", KEY), (c.stage_infos()[0].owner_router_id, None)):
                            req = pb.ReleaseRequest(req_pool_indices=list(range(c.max_rows)), router_id=rid)
                            refusals.append(await asyncio.to_thread(call, stub.Release, req, key))
            out = await asyncio.gather(*tasks)
            return [r.json()["choices"][0]["text"] if r.status_code == 200 else r.text for r in out], refusals

    ref, _ = asyncio.run(run(False))
    got, refusals = asyncio.run(run(True))
    assert [code for code, _ in refusals] == [UNAUTH, UNAUTH, DENIED, UNAUTH] * c.pp, refusals
    assert got == ref
    infos = c.wait_rows_free()
    assert all(i.rows_in_use == 0 and i.pending_commits == 0 for i in infos)
    # the keyed steps went on the stages' sockets (proto/local.py), which refuse a caller without the key
    assert [i.control for i in infos] == ["socket", "socket", ""]
    assert "control: socket" in httpx.get(c.url + "/health", timeout=10).text
    for i in infos:
        for key in (None, WRONG):
            with pytest.raises(ConnectionRefusedError, match="a wrong or no pipeline key"):
                asyncio.run(local._open(i.control_socket, key))


def test_prepare_grammar_needs_the_key(keyed_cluster):
    """``PrepareGrammar`` compiles whatever grammar it is given on the last stage's one
    compile worker and keeps it in the stage's bounded cache of compiled grammars (pushing
    out the router's): a call that changes the stage. The owner's router id is no secret
    (read-only ``Info`` gives it), so without the key, or with a wrong one, the call is
    refused before anything compiles; the router's own calls carry the key, so its
    constrained requests are served."""
    c, _ = keyed_cluster
    owner = c.stage_infos()[0].owner_router_id
    assert owner
    with grpc.insecure_channel(f"127.0.0.1:{c.stage_ports[-1]}") as ch:
        stub = pb_grpc.StageStub(ch)
        req = pb.GrammarRequest(grammar='root ::= "intruder" [a-z]*', router_id=owner)
        for key in (None, WRONG):
            code, msg = call(stub.PrepareGrammar, req, key)
            assert code == UNAUTH, (key, code, msg)
            assert "PrepareGrammar" in msg and "pipeline key" in msg and "refused" in msg, msg
        assert call(stub.PrepareGrammar, pb.GrammarRequest(grammar='root ::= "yes"', router_id=""))[0] == DENIED
    r = httpx.post(c.url + "/v1/completions", timeout=120,
                   json=dict(prompt=[5, 6, 7], max_tokens=8, temperature=0.0, guided_choice=["yes", "no"]))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in ("yes", "no")
    assert all(i.rows_in_use == 0 for i in c.wait_rows_free())
