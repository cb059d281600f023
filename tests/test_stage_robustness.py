"""Bad input to a stage's gRPC API gets a clear status naming the field and loses nothing.

Real stage processes (PP2 with an MTP head and the replay commit design, and a PP1 stage
without speculation) take
hand-built requests. After every refused request the stages hold no row, KV page or
pending commit, and a valid request gives the very tokens and log-probabilities it gave
on the fresh stages. The checkpoint (4 layers, attention only in the last) puts no KV
pool on stage 0 and one on stage 1, so stage 1 runs out of pages after stage 0 ran a step.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster import free_port
from ppspec.proto.codec import GRPC_OPTIONS, result_from_pb, step_to_pb
from ppspec.proto.messages import SamplingSpec, StepInput
from ppspec.proto.stubs import STAGE_SERVICE, pb, pb_grpc

MAX_ROWS, KV_TOKENS, MAX_CONTEXT, STEPS, VOCAB, HIDDEN = 4, 256, 200, 3, 320, 64
D = STEPS + 1
PROMPT = list(range(10, 30))
TIMEOUT = 30  # seconds per call: a request the stage wrongly holds back fails instead of hanging
INV, PRE, EXH = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION,
                 grpc.StatusCode.RESOURCE_EXHAUSTED)


class Stages:
    def __init__(self, path, tmp):
        self.procs, self.stubs, self.channels = [], {}, []
        self.ports = ports = {name: free_port() for name in ("s0", "s1", "nospec")}
        common = ["--model", path, "--max-rows", str(MAX_ROWS), "--kv-tokens", str(KV_TOKENS),
                  "--max-context", str(MAX_CONTEXT), "--num-threads", "1"]
        # the replay commit design (the CUDA default): a commit applied twice would corrupt it
        mtp = ["--pp-size", "2", "--speculative-algorithm", "mtp", "--speculative-num-steps", str(STEPS),
               "--commit-design", "replay"]
        argvs = {
            "s1": mtp + ["--pp-rank", "1"],
            "s0": mtp + ["--pp-rank", "0", "--next-stage", f"127.0.0.1:{ports['s1']}"],
            "nospec": ["--speculative-algorithm", "none"],
        }
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for name, argv in argvs.items():
            log = open(os.path.join(tmp, f"{name}.log"), "w")
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "ppspec.cli", "stage", "--port", str(ports[name])] + common + argv,
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            ch = grpc.insecure_channel(f"127.0.0.1:{ports[name]}", options=GRPC_OPTIONS)
            self.channels.append(ch)
            self.stubs[name] = pb_grpc.StageStub(ch)
        deadline = time.monotonic() + 120
        for name, ch in zip(self.stubs, self.channels):
            # SERVING on the stage service, as the router waits for: stage 0 serves once it
            # reached stage 1 (its channel to stage 1 may first be in a reconnect backoff,
            # in which a relayed step fails at once)
            health = health_pb2_grpc.HealthStub(ch)
            while True:
                assert all(p.poll() is None for p in self.procs), f"a stage exited; logs in {tmp}"
                try:
                    if health.Check(health_pb2.HealthCheckRequest(service=STAGE_SERVICE),
                                    timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                assert time.monotonic() < deadline, f"stage {name} did not start"
                time.sleep(0.2)
        self.s0, self.s1, self.nospec = self.stubs["s0"], self.stubs["s1"], self.stubs["nospec"]

    def stop(self):
        for ch in self.channels:
            ch.close()
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()

    # ---- helpers
    def both(self, method, req):
        return [call(getattr(s, method), req) for s in (self.s0, self.s1)]

    def commit(self, mb, rnd, rows, acc):
        return self.both("CommitAccept", pb.CommitRequest(micro_batch_id=mb, round=rnd, req_pool_indices=rows,
                                                         accept_lengths=acc))

    def release(self, rows, abandon=False):
        return self.both("Release", pb.ReleaseRequest(req_pool_indices=rows, abandon=abandon))

    def state(self):
        """(rows in use, KV pages used, pending commits) of stage 0 and stage 1."""
        out = []
        for s in (self.s0, self.s1):
            i = s.Info(pb.InfoRequest(), timeout=10)
            out.append((i.rows_in_use, i.kv_pages_used, i.pending_commits))
        return out

    def request(self, row=1, carried: int | None = None):
        """A full request on ``row``: prefill, verify + commit, decode, release. Returns
        every token, draft and log-probability. ``carried``: the decode carries the commit
        (``StepRequest.commit``, naming round ``carried``) instead of a CommitAccept; a
        round other than the verify's refuses the decode, then the right one is carried."""
        spec = [SamplingSpec(logprobs=3)]
        r = self.forward(prefill([row], sampling=spec))
        first = r.output_ids[0][0]
        v = result_from_pb(self.s0.Verify(step_to_pb(StepInput(
            3, 2, "verify", [row], [20], [D], [first] + r.drafts[0], num_drafts=[len(r.drafts[0])],
            sampling=spec, output_lens=[1])), timeout=TIMEOUT))
        acc = len(v.output_ids[0])
        dec = step_to_pb(StepInput(3, 3, "decode", [row], [20 + acc], [1], [v.output_ids[0][-1]],
                                   sampling=spec, output_lens=[1 + acc]))
        if carried is None:
            assert [c for c, _ in self.commit(3, 2, [row], [acc])] == ["OK", "OK"]
        else:
            dec.commit.CopyFrom(pb.CommitRequest(micro_batch_id=3, round=carried, req_pool_indices=[row],
                                                 accept_lengths=[acc]))
            if carried != 2:
                expect(call(self.s0.Forward, dec), PRE,
                       f"commit of micro-batch 3 round {carried} names rows not pending on it")
                assert self.state() == [(1, 0, 1), (1, 2, 1)]  # still pending on round 2 everywhere
                dec.commit.round = 2
        got = self.s0.Forward(dec, timeout=TIMEOUT)
        if carried is not None:
            assert len(got.commit_seconds) == 2 and min(got.commit_seconds) > 0  # each stage applied it
        d = result_from_pb(got)
        assert [c for c, _ in self.release([row])] == ["OK", "OK"]
        return [(o.output_ids, o.drafts, o.logprobs) for o in (r, v, d)]

    def forward(self, inp, stub=None):
        return result_from_pb((stub or self.s0).Forward(step_to_pb(inp), timeout=TIMEOUT))


def call(fn, req):
    try:
        fn(req, timeout=TIMEOUT)
        return "OK", ""
    except grpc.RpcError as e:
        return e.code(), e.details()


def prefill(rows, seq=None, ext=None, ids=None, **kw):
    B = len(rows)
    kw.setdefault("sampling", [SamplingSpec() for _ in rows])
    return StepInput(1, 1, "prefill", rows, seq or [0] * B, ext or [20] * B, PROMPT * B if ids is None else ids, **kw)


@pytest.fixture(scope="module")
def stages(make_ckpt, tmp_path_factory):
    s = Stages(make_ckpt("qwen3_5_ratio1"), str(tmp_path_factory.mktemp("stage_logs")))
    s.reference = s.request()
    yield s
    s.stop()


@pytest.fixture
def st(stages):
    """The stages, checked clean and serving exactly as fresh after the test."""
    yield stages
    state = stages.state()
    if state != [(0, 0, 0), (0, 0, 0)]:  # one failure must not spill into the next test
        stages.release(list(range(MAX_ROWS)), abandon=True)
    assert state == [(0, 0, 0), (0, 0, 0)]
    assert stages.request() == stages.reference


def expect(result, code, *fragments):
    got, msg = result
    assert got == code, (got, msg)
    for f in fragments:
        assert f in msg, msg


def torn_ids_req() -> pb.StepRequest:
    """A prefill whose spec's packed allowed ids end inside an id (7 bytes)."""
    m = step_to_pb(prefill([0]))
    m.sampling[0].allowed_token_ids_le32 = b"\x01\x00\x00\x00\x02\x00\x00"
    return m


def hidden_req(data, dtype, shape):
    m = step_to_pb(prefill([0]))
    m.hidden_states.CopyFrom(pb.Tensor(data=data, dtype=dtype, shape=shape))
    return m


def floats(n, value=0.0):
    import torch

    return torch.full((n,), value, dtype=torch.float32).numpy().tobytes()


STEP_CASES = {
    # name: (RPC of stage 0 or 1, request, code, fragments of the message)
    "seq_lens negative": ("s0", "Forward", prefill([0], seq=[-5]), INV, ["seq_lens must be >= 0"]),
    "input_ids above the vocabulary": ("s0", "Forward", prefill([0], ids=[VOCAB] * 20), INV, ["input_ids", "[0, 320)"]),
    "input_ids negative": ("s0", "Forward", prefill([0], ids=[-3] * 20), INV, ["input_ids"]),
    "empty micro-batch": ("s0", "Forward", StepInput(1, 1, "prefill", [], [], [], []), INV, ["empty micro-batch"]),
    "lengths differ": ("s0", "Forward", prefill([0], seq=[0, 0]), INV, ["seq_lens and extend_lens differ"]),
    "repeated rows": ("s0", "Forward", prefill([0, 0], ext=[10, 10]), INV, ["repeats rows"]),
    "row out of range": ("s0", "Forward", prefill([MAX_ROWS]), INV, ["req_pool_indices", "outside [0, 4)"]),
    "row negative": ("s0", "Forward", prefill([-1]), INV, ["req_pool_indices", "outside [0, 4)"]),
    "extend_lens 0": ("s0", "Forward", prefill([0], ext=[0], ids=[]), INV, ["extend_lens must be >= 1"]),
    "beyond the context": ("s0", "Forward", prefill([0], seq=[190]), INV, ["context limit of 200"]),
    "unknown mode": ("s0", "Forward", StepInput(1, 1, "bogus", [0], [0], [20], PROMPT), INV, ["unknown mode"]),
    "verify sent to Forward": ("s0", "Forward", StepInput(1, 1, "verify", [0], [20], [D], PROMPT[:D]), INV,
                               ["sent to Forward"]),
    "verify of 3 tokens": ("s0", "Verify", StepInput(1, 1, "verify", [0], [20], [3], PROMPT[:3]), INV,
                           ["verify expects 4 tokens"]),
    "num_drafts beyond D - 1": ("s0", "Verify", StepInput(1, 1, "verify", [0], [20], [D], PROMPT[:D], num_drafts=[4]),
                                INV, ["num_drafts must be in [0, 3]"]),
    "decode on a row never prefilled": ("s0", "Forward", StepInput(1, 1, "decode", [0], [5], [1], [7]), PRE,
                                        ["row 0", "holds no request"]),
    "verify on a row never prefilled": ("s0", "Verify", StepInput(1, 1, "verify", [0], [5], [D], PROMPT[:D],
                                                                  num_drafts=[3]), PRE, ["holds no request"]),
    "continuing prefill of a row never started": ("s0", "Forward", prefill([0], seq=[5]), PRE, ["holds no request"]),
    "top_p 0": ("s0", "Forward", prefill([0], sampling=[SamplingSpec(temperature=1.0, top_p=0.0)]), INV,
                ["sampling[0]: top_p"]),
    "temperature negative": ("s0", "Forward", prefill([0], sampling=[SamplingSpec(temperature=-1.0)]), INV,
                             ["sampling[0]: temperature"]),
    "temperature NaN": ("s0", "Forward", prefill([0], sampling=[SamplingSpec(temperature=float("nan"))]), INV,
                        ["sampling[0]: temperature"]),
    "top_k negative": ("s0", "Forward", prefill([0], sampling=[SamplingSpec(temperature=1.0, top_k=-5)]), INV,
                       ["sampling[0]: top_k"]),
    "min_p above 1": ("s0", "Forward", prefill([0], sampling=[SamplingSpec(temperature=1.0, min_p=2.0)]), INV,
                      ["sampling[0]: min_p"]),
    "huge logprobs": ("s0", "Forward", prefill([0], sampling=[SamplingSpec(logprobs=100000)]), INV,
                      ["sampling[0]: logprobs"]),
    "banned id outside the vocabulary": ("s0", "Forward", prefill([0], sampling=[SamplingSpec(
        min_tokens=2, banned_until_min=[99999])]), INV, ["banned_until_min"]),
    "allowed ids not whole 4-byte ids": ("s0", "Forward", torn_ids_req(), INV,
                                         ["sampling: allowed_token_ids holds 7 bytes"]),
    "two sampling specs for one request": ("s0", "Forward", prefill([0], sampling=[SamplingSpec()] * 2), INV,
                                           ["sampling: 2 entries for 1 requests"]),
    "chunk without its next token": ("s0", "Forward", prefill([0], sample=[False], next_token_ids=[-1]), INV,
                                     ["next_token_ids"]),
    "sample list too long": ("s0", "Forward", prefill([0], sample=[True, True]), INV, ["sample: 2 entries"]),
    "drafts in a prefill": ("s0", "Forward", prefill([0], num_drafts=[2]), INV, ["num_drafts"]),
    # stage 1 decodes the hidden states itself
    "no hidden_states": ("s1", "Forward", step_to_pb(prefill([0])), INV, ["hidden_states"]),
    "hidden_states byte count": ("s1", "Forward", hidden_req(b"\0" * 100, "float32", [20, HIDDEN]), INV,
                                 ["hidden_states", "needs 5120 bytes, got 100"]),
    "hidden_states unknown dtype": ("s1", "Forward", hidden_req(floats(20 * HIDDEN), "nonsense", [20, HIDDEN]), INV,
                                    ["hidden_states", "unknown tensor dtype"]),
    "hidden_states negative shape": ("s1", "Forward", hidden_req(floats(20 * HIDDEN), "float32", [-20, -HIDDEN]),
                                     INV, ["hidden_states", "negative dimension"]),
    "hidden_states too narrow": ("s1", "Forward", hidden_req(floats(20 * 32), "float32", [20, 32]), INV,
                                 ["hidden_states: shape [20, 32], expected [20, 64]"]),
    "hidden_states flat": ("s1", "Forward", hidden_req(floats(20 * HIDDEN), "float32", [20 * HIDDEN]), INV,
                           ["hidden_states: shape"]),
    "hidden_states int64": ("s1", "Forward", hidden_req(b"\0" * (20 * HIDDEN * 8), "int64", [20, HIDDEN]), INV,
                            ["hidden_states: dtype int64"]),
    "hidden_states NaN": ("s1", "Forward", hidden_req(floats(20 * HIDDEN, float("nan")), "float32", [20, HIDDEN]),
                          INV, ["hidden_states: contains NaN"]),
}


def test_stages_serve_warm_and_clean(st):
    """Every stage ran its warm-up before it served (``Info.warmup_seconds``), and the
    warm-up left no row, KV page or pending commit behind."""
    for s in (st.s0, st.s1, st.nospec):
        i = s.Info(pb.InfoRequest(), timeout=10)
        assert i.warmup_seconds > 0 and (i.rows_in_use, i.kv_pages_used, i.pending_commits) == (0, 0, 0), i


@pytest.mark.parametrize("name", list(STEP_CASES))
def test_bad_step_is_refused_and_changes_nothing(st, name):
    stage, rpc, req, code, fragments = STEP_CASES[name]
    if isinstance(req, StepInput):
        req = step_to_pb(req)
    expect(call(getattr(st.stubs[stage], rpc), req), code, *fragments)


def test_step_must_name_the_length_its_row_holds(st):
    st.forward(prefill([0]))
    expect(call(st.s0.Forward, step_to_pb(StepInput(1, 2, "decode", [0], [25], [1], [7]))), PRE,
           "seq_lens: row 0 holds 20 tokens, the decode says 25")
    expect(call(st.s0.Forward, step_to_pb(prefill([0], seq=[19]))), PRE, "row 0 holds 20 tokens")
    expect(call(st.s0.Forward, step_to_pb(prefill([0]))), PRE, "still in use")  # a new request on a used row
    st.forward(StepInput(1, 2, "decode", [0], [20], [1], [7]))  # the right length still works
    assert st.state() == [(1, 0, 0), (1, 2, 0)]
    st.release([0])


def setup_verify(st, rows=(0, 2), mb=5, rnd=9, drafts=3, prompt=PROMPT):
    """Prefill ``rows`` with ``prompt`` and verify them as micro-batch ``mb`` round ``rnd``:
    the rows are pending on both stages. Returns the accept lengths."""
    rows, B = list(rows), len(rows)
    r = st.forward(prefill(rows, ids=prompt * B))
    ids = sum(([o[0]] + d[:drafts] + [0] * (STEPS - drafts) for o, d in zip(r.output_ids, r.drafts)), [])
    v = result_from_pb(st.s0.Verify(step_to_pb(StepInput(mb, rnd, "verify", rows, [20] * B, [D] * B, ids,
                                                         num_drafts=[drafts] * B)), timeout=TIMEOUT))
    assert [p for *_, p in st.state()] == [B, B]
    return [len(o) for o in v.output_ids]


BAD_COMMITS = {
    # name: (rows, accept lengths, code, fragments); the stage keeps the rows pending
    "accept length 0": ([0, 2], [0, 1], INV, ["accept_lengths must be in [1, 4]"]),
    "accept length above D": ([0, 2], [5, 1], INV, ["accept_lengths must be in [1, 4]"]),
    "fewer accept lengths than rows": ([0, 2], [1], INV, ["2 req_pool_indices but 1 accept_lengths"]),
    "repeated rows": ([0, 0, 2], [1, 1, 1], INV, ["repeat rows"]),
    "a row of no verify": ([0, 3], [1, 1], PRE, ["not pending on it", "3: None"]),
    "a row outside the pool": ([0, MAX_ROWS], [1, 1], PRE, ["not pending on it"]),
}


@pytest.mark.parametrize("name", list(BAD_COMMITS))
def test_bad_commit_is_refused_and_the_valid_one_still_applies(st, name):
    rows, acc, code, fragments = BAD_COMMITS[name]
    good = setup_verify(st)
    for res in st.commit(5, 9, rows, acc):
        expect(res, code, *fragments)
    assert st.state() == [(2, 0, 2), (2, 4, 2)]  # nothing dropped, nothing committed
    assert [c for c, _ in st.commit(5, 9, [0, 2], good)] == ["OK", "OK"]
    assert st.state() == [(2, 0, 0), (2, 4, 0)]
    st.release([0, 2])


def test_commit_of_another_micro_batch_or_round_is_refused(st):
    good = setup_verify(st)
    for mb, rnd in ((6, 9), (5, 8)):
        for res in st.commit(mb, rnd, [0, 2], good):
            expect(res, PRE, f"commit of micro-batch {mb} round {rnd} names rows not pending on it")
    assert [c for c, _ in st.commit(5, 9, [0, 2], good)] == ["OK", "OK"]
    for res in st.commit(5, 9, [0, 2], good):  # twice: nothing pending any more
        expect(res, PRE, "not pending")
    st.release([0, 2])


def test_a_commit_the_next_step_carries_applies_on_every_stage_before_it(st):
    """The router's commit of a verify may ride on the micro-batch's next step
    (``StepRequest.commit``): each stage applies it before the step, as a CommitAccept, so
    the request's tokens, drafts and log-probabilities are the reference's (a commit
    applied late or twice would change the decode after it). One naming a round the rows
    are not pending on refuses the step (FAILED_PRECONDITION), nothing changed."""
    assert st.request(carried=2) == st.reference
    assert st.request(carried=1) == st.reference


def test_a_commit_sent_twice_at_once_applies_once(st):
    """Two copies of one commit reach each stage while it computes something else: one
    applies, the other is refused. (The replay design flips a slot per commit: applied
    twice, the row replays stale steps and decodes wrongly, silently.) The row then
    decodes exactly as after a single commit."""
    prompt = list(range(40, 60))  # no other test verifies it: stale replay steps would differ

    def verify_commit_decode(row, copies):
        acc = setup_verify(st, rows=[row], prompt=prompt)
        busy = st.s0.Forward.future(step_to_pb(prefill([3], ext=[150], ids=list(range(1, 151)))), timeout=TIMEOUT)
        req = pb.CommitRequest(micro_batch_id=5, round=9, req_pool_indices=[row], accept_lengths=acc)
        futs = [s.CommitAccept.future(req, timeout=TIMEOUT) for s in (st.s0, st.s1) for _ in range(copies)]
        codes = []
        for f in futs:
            try:
                f.result()
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(e.code())
        busy.result()
        out = st.forward(StepInput(5, 10, "decode", [row], [20 + acc[0]], [1], [7],
                                   sampling=[SamplingSpec(logprobs=3)]))
        st.release([row, 3])
        return codes, (out.output_ids, out.drafts, out.logprobs)

    once = verify_commit_decode(0, 1)
    assert once[0] == ["OK", "OK"]
    twice = verify_commit_decode(2, 2)
    assert sorted(map(str, twice[0])) == sorted(map(str, ["OK", PRE, "OK", PRE])), twice[0]
    assert twice[1] == once[1]


def test_a_commit_a_release_carries_applies_on_every_stage_before_the_release(st):
    """When rows of a verify end, the router sends the verify's commit with their release
    (``ReleaseRequest.commit``): each stage applies it first, as a CommitAccept, then
    releases them. The verify's other row then decodes exactly as after a CommitAccept (a
    commit applied late, twice or not at all changes that decode under the replay design).
    A release whose commit names a round the rows are not pending on, or that abandons them,
    is refused with nothing released or committed."""
    prompt = list(range(60, 80))  # no other test verifies it

    def verify_then_decode(carried: bool):
        acc = setup_verify(st, rows=[0, 2], prompt=prompt)
        commit = pb.CommitRequest(micro_batch_id=5, round=9, req_pool_indices=[0, 2], accept_lengths=acc)
        if carried:
            wrong = pb.CommitRequest(micro_batch_id=5, round=8, req_pool_indices=[0, 2], accept_lengths=acc)
            for res in st.both("Release", pb.ReleaseRequest(req_pool_indices=[0], commit=wrong)):
                expect(res, PRE, "commit of micro-batch 5 round 8 names rows not pending on it")
            for res in st.both("Release", pb.ReleaseRequest(req_pool_indices=[0], abandon=True, commit=commit)):
                expect(res, INV, "release: abandon with a commit to apply")
            assert st.state() == [(2, 0, 2), (2, 4, 2)]  # nothing released, nothing committed
            replies = [s.Release(pb.ReleaseRequest(req_pool_indices=[0], commit=commit), timeout=TIMEOUT)
                       for s in (st.s0, st.s1)]
            assert min(r.commit_seconds for r in replies) > 0  # each stage applied it
        else:
            assert [c for c, _ in st.commit(5, 9, [0, 2], acc)] == ["OK", "OK"]
            assert [c for c, _ in st.release([0])] == ["OK", "OK"]
        assert st.state() == [(1, 0, 0), (1, 2, 0)]  # row 0 released, row 2 committed
        out = st.forward(StepInput(5, 10, "decode", [2], [20 + acc[1]], [1], [7],
                                   sampling=[SamplingSpec(logprobs=3)]))
        st.release([2])
        return out.output_ids, out.drafts, out.logprobs

    assert verify_then_decode(carried=True) == verify_then_decode(carried=False)


def test_commits_and_releases_on_the_step_channel_answer_as_the_unary_calls(st):
    """The router sends CommitAccept and Release as messages of each stage's step channel
    (``StepRequest.commit_call`` / ``release_call``; here on the gRPC Steps stream, which
    the socket serves through the same ``run_step``): a commit naming another round is
    refused with the unary call's code and details, nothing changed; the right one applies
    on each stage (its seconds in ``commit_seconds``); the release frees the rows (the
    fixture then checks every stage clean and the reference request's tokens)."""
    acc = setup_verify(st)

    def on_channel(stub, **call):
        (res,) = list(stub.Steps(iter([pb.StepRequest(call_id=1, **call)]), timeout=TIMEOUT))
        assert res.call_id == 1
        return res

    wrong = pb.CommitRequest(micro_batch_id=5, round=8, req_pool_indices=[0, 2], accept_lengths=acc)
    for s in (st.s0, st.s1):
        res = on_channel(s, commit_call=wrong)
        assert res.error_code == PRE.value[0], res
        assert "commit of micro-batch 5 round 8 names rows not pending on it" in res.error
    assert st.state() == [(2, 0, 2), (2, 4, 2)]  # nothing committed
    right = pb.CommitRequest(micro_batch_id=5, round=9, req_pool_indices=[0, 2], accept_lengths=acc)
    for s in (st.s0, st.s1):
        res = on_channel(s, commit_call=right)
        assert res.error_code == 0 and len(res.commit_seconds) == 1 and res.commit_seconds[0] > 0, res
    assert st.state() == [(2, 0, 0), (2, 4, 0)]
    for s in (st.s0, st.s1):
        res = on_channel(s, release_call=pb.ReleaseRequest(req_pool_indices=[9]))
        assert res.error_code == INV.value[0] and "outside [0, 4)" in res.error, res
        res = on_channel(s, release_call=pb.ReleaseRequest(req_pool_indices=[0, 2]))
        assert res.error_code == 0 and not res.commit_seconds, res


def test_commit_cannot_accept_more_than_the_verified_drafts(st):
    setup_verify(st, rows=[2], drafts=1)  # one real draft: at most 2 tokens
    for res in st.commit(5, 9, [2], [3]):
        expect(res, INV, "row 2 was verified with 1 drafts", "at most 2")
    assert st.state() == [(1, 0, 1), (1, 2, 1)]
    assert [c for c, _ in st.commit(5, 9, [2], [2])] == ["OK", "OK"]
    # the row now holds 22 tokens
    st.forward(StepInput(1, 2, "decode", [2], [22], [1], [7]))
    st.release([2])


def test_bad_release_is_refused_before_abandoning_anything(st):
    setup_verify(st)
    for rows in ([0, 2, 9], [-1]):
        for res in st.release(rows, abandon=True):
            expect(res, INV, "release: req_pool_indices", "outside [0, 4)")
    assert st.state() == [(2, 0, 2), (2, 4, 2)]
    assert [c for c, _ in st.release([0, 2], abandon=True)] == ["OK", "OK"]
    for res in st.commit(5, 9, [0, 2], [1, 1]):  # abandoned: its commit is refused
        expect(res, PRE, "not pending")
    for rows in ([3], [3], [0, 1, 2, 3]):  # never used, twice, all: releasing is idempotent
        assert [c for c, _ in st.release(rows)] == ["OK", "OK"]


def test_prefills_beyond_the_kv_pool_are_refused_with_every_pool_unchanged(st):
    big = list(range(1, 101))
    # stage 0 (no attention layer) runs it, stage 1 runs out of pages: stage 0 undoes it
    expect(call(st.s0.Forward, step_to_pb(prefill([0, 1, 2, 3], ext=[100] * 4, ids=big * 4))), EXH,
           "stage 1: KV pool: need 28 pages, 16 free")
    assert st.state() == [(0, 0, 0), (0, 0, 0)]
    st.forward(prefill([0, 2], ext=[100] * 2, ids=big * 2))
    assert st.state() == [(2, 0, 0), (2, 14, 0)]
    expect(call(st.s0.Forward, step_to_pb(prefill([3], ext=[100], ids=big))), EXH, "need 7 pages, 2 free")
    assert st.state() == [(2, 0, 0), (2, 14, 0)]
    st.forward(prefill([3]))  # the same row takes a request that fits
    assert st.state() == [(3, 0, 0), (3, 16, 0)]
    st.release([0, 2, 3])


def test_steps_a_later_stage_refuses_are_undone_or_fenced(st):
    """Stage 1 runs out of KV pages for a verify, then for a decode, that stage 0 already
    ran: stage 0 drops the verify's pending marks (its committed state is unchanged), and
    refuses further steps on the decoded row (its state went one token ahead) until the
    row is released."""
    big = list(range(1, 101))
    st.forward(prefill([0, 2], ext=[100] * 2, ids=big * 2))
    r = st.forward(prefill([3], ext=[30], ids=big[:30]))  # the pools are full: 32 tokens of row 3 fit
    assert st.state() == [(3, 0, 0), (3, 16, 0)]
    ids = [r.output_ids[0][0]] + r.drafts[0]
    expect(call(st.s0.Verify, step_to_pb(StepInput(4, 1, "verify", [3], [30], [D], ids, num_drafts=[3]))), EXH,
           "stage 1", "need 1 pages, 0 free")
    assert st.state() == [(3, 0, 0), (3, 16, 0)]  # no commit pending anywhere
    expect(call(st.s0.Forward, step_to_pb(StepInput(4, 2, "decode", [3], [30], [1], ids[:1]))), EXH, "stage 1")
    expect(call(st.s0.Forward, step_to_pb(StepInput(4, 3, "decode", [3], [30], [1], ids[:1]))), PRE,
           "row 3: a failed step left its state undefined; release the row")
    st.release([0, 2, 3])


def test_a_step_a_later_stage_refuses_keeps_the_commit_it_carried_applied_once(st):
    """A verify carries the commit of the row's previous verify and stage 1 refuses it (no
    KV page) after both stages applied that commit: nothing is left pending anywhere, the
    commit cannot apply a second time, both stages hold the row at its accepted length,
    and the router's release with abandon (its answer to a refused micro-batch) gives
    every row back (the fixture then checks the reference)."""
    big = list(range(1, 101))
    st.forward(prefill([0, 2], ext=[100] * 2, ids=big * 2))
    r = st.forward(prefill([3], ext=[26], ids=big[:26]))  # the pools are full: 32 tokens of row 3 fit
    ids = [r.output_ids[0][0]] + r.drafts[0]
    st.s0.Verify(step_to_pb(StepInput(4, 1, "verify", [3], [26], [D], ids, num_drafts=[3])), timeout=TIMEOUT)
    assert st.state() == [(3, 0, 1), (3, 16, 1)]
    nxt = step_to_pb(StepInput(4, 2, "verify", [3], [26 + D], [D], ids, num_drafts=[3]))  # 34 tokens: a page more
    nxt.commit.CopyFrom(pb.CommitRequest(micro_batch_id=4, round=1, req_pool_indices=[3], accept_lengths=[D]))
    expect(call(st.s0.Verify, nxt), EXH, "stage 1", "need 1 pages, 0 free")
    assert st.state() == [(3, 0, 0), (3, 16, 0)]  # applied on both, the refused verify's marks dropped
    for res in st.commit(4, 1, [3], [D]):
        expect(res, PRE, "not pending")
    short = step_to_pb(StepInput(4, 3, "decode", [3], [26 + D - 1], [1], ids[:1]))
    expect(call(st.s0.Forward, short), PRE, f"row 3 holds {26 + D} tokens")
    short.hidden_states.CopyFrom(pb.Tensor(data=floats(HIDDEN), dtype="float32", shape=[1, HIDDEN]))
    expect(call(st.s1.Forward, short), PRE, f"row 3 holds {26 + D} tokens")
    assert [c for c, _ in st.release([0, 2, 3], abandon=True)] == ["OK", "OK"]


def test_verify_and_commit_on_a_stage_without_speculation(st):
    stub = st.nospec
    out = st.forward(prefill([0]), stub)
    expect(call(stub.Verify, step_to_pb(StepInput(1, 2, "verify", [0], [20], [1], out.output_ids[0]))), PRE,
           "started without speculative decoding")
    expect(call(stub.CommitAccept, pb.CommitRequest(micro_batch_id=1, round=2, req_pool_indices=[0],
                                                    accept_lengths=[1])), PRE, "not pending")
    i = stub.Info(pb.InfoRequest(), timeout=10)
    assert (i.rows_in_use, i.pending_commits) == (1, 0)
    again = st.forward(StepInput(1, 3, "decode", [0], [20], [1], out.output_ids[0]), stub)
    assert call(stub.Release, pb.ReleaseRequest(req_pool_indices=[0]))[0] == "OK"
    # the decode saw the state of the prefill alone: a fresh request gives the same token
    out2 = st.forward(prefill([1]), stub)
    again2 = st.forward(StepInput(1, 3, "decode", [1], [20], [1], out2.output_ids[0]), stub)
    assert again.output_ids == again2.output_ids
    assert call(stub.Release, pb.ReleaseRequest(req_pool_indices=[1]))[0] == "OK"


def test_a_hand_built_sampling_spec_means_the_defaults_not_proto_zeros():
    """proto3 reads an unset float as 0: top_p 0 would be refused and logprobs 0 would ask
    for logprobs. The fields carry presence, so an unset one decodes to the default."""
    from ppspec.proto.codec import step_from_pb

    s = step_from_pb(pb.StepRequest(mode="prefill", sampling=[pb.SamplingSpec(temperature=0.7)])).sampling[0]
    assert (s.temperature, s.top_p, s.logprobs) == (pytest.approx(0.7), 1.0, None)
    # set explicitly, the values travel as they are (the stage refuses top_p 0 itself)
    s = step_from_pb(pb.StepRequest(sampling=[pb.SamplingSpec(top_p=0.0, logprobs=0)])).sampling[0]
    assert (s.top_p, s.logprobs) == (0.0, 0)
    for spec in (SamplingSpec(0.5, top_p=0.25, logprobs=None), SamplingSpec(1.0, top_p=1.0, logprobs=3)):
        assert step_from_pb(step_to_pb(prefill([0], sampling=[spec]))).sampling[0] == spec


def test_a_second_stage_on_a_served_port_exits(st):
    """gRPC sets SO_REUSEPORT by default: a second stage would share the port and silently
    take over part of the first one's traffic. It must refuse to start instead."""
    p = subprocess.run([sys.executable, "-m", "ppspec.cli", "stage", "--port", str(st.ports["nospec"]),
                        "--max-rows", "2", "--kv-tokens", "256", "--num-threads", "1"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 2 and f"cannot listen on 127.0.0.1:{st.ports['nospec']}" in p.stderr, p.stderr
    assert st.nospec.Info(pb.InfoRequest(), timeout=10).pp_size == 1  # the first one still serves


def test_only_the_router_that_owns_the_stages_steps_commits_and_releases(st):
    """Stages fence routers: once a router claimed them (its Info with claim, at its start),
    a step, commit or release from any other router is refused with PERMISSION_DENIED
    naming the owner, and changes nothing; a later claim moves the ownership, and the
    router it was taken from stays refused, also once the new owner has left (its claim is
    ignored; its Info says replaced). A request that names no router (a tool, as the other
    tests here) is not fenced. With stage 1 claimed by another router than stage 0 (a
    takeover half done), the step stage 0 ran and relayed is undone there."""
    denied = grpc.StatusCode.PERMISSION_DENIED

    def claim(router, stubs=(st.s0, st.s1)):
        for s in stubs:
            s.Info(pb.InfoRequest(router_id=router, claim=True), timeout=10)

    def owners():
        return [s.Info(pb.InfoRequest(), timeout=10).owner_router_id for s in (st.s0, st.s1)]

    def step(router, inp):
        m = step_to_pb(inp)
        m.router_id = router
        return call(st.s0.Verify if inp.mode == "verify" else st.s0.Forward, m)

    def commit(router, acc):
        return st.both("CommitAccept", pb.CommitRequest(micro_batch_id=5, round=9, req_pool_indices=[0, 2],
                                                       accept_lengths=acc, router_id=router))

    def release(router, rows):
        return st.both("Release", pb.ReleaseRequest(req_pool_indices=rows, abandon=True, router_id=router))

    routers = ("router-a", "router-b", "router-c", "router-d")
    try:
        claim("router-a")
        expect(step("router-b", prefill([1])), denied, "stage 0: prefill of micro-batch 1 from router router-b",
               "router router-a owns this stage")
        assert st.state() == [(0, 0, 0), (0, 0, 0)]
        acc = setup_verify(st)  # rows 0 and 2 pending on both stages (a tool's requests)
        for res in commit("router-b", acc):
            expect(res, denied, "commit of micro-batch 5 round 9 from router router-b", "router-a owns")
        for res in release("router-b", [0, 2]):
            expect(res, denied, "release from router router-b")
        assert st.state() == [(2, 0, 2), (2, 4, 2)]  # nothing committed, abandoned or released
        claim("router-b")  # router-a paused past its lease: router-b took over
        for res in commit("router-a", acc):
            expect(res, denied, "router router-b took this stage over from it")
        expect(step("router-a", prefill([1])), denied, "router-b took this stage over")
        assert st.state() == [(2, 0, 2), (2, 4, 2)]
        assert [c for c, _ in commit("router-b", acc)] == ["OK", "OK"]
        assert [c for c, _ in release("router-b", [0, 2])] == ["OK", "OK"]
        assert st.state() == [(0, 0, 0), (0, 0, 0)]
        for s in (st.s0, st.s1):  # router-b exits cleanly: nobody owns the stages
            s.Info(pb.InfoRequest(router_id="router-b", leaving=True), timeout=10)
        assert owners() == ["", ""]
        claim("router-a")  # router-a resumes: not given the stages back
        assert owners() == ["", ""]
        assert all(s.Info(pb.InfoRequest(router_id="router-a"), timeout=10).replaced for s in (st.s0, st.s1))
        expect(step("router-a", prefill([1])), denied, "router-b took this stage over from it")
        for res in release("router-a", [1]):
            expect(res, denied, "release from router router-a")
        claim("router-c", [st.s0])  # a takeover half done: stage 0 is router-c's, stage 1 router-d's
        claim("router-d", [st.s1])
        expect(step("router-c", prefill([1])), denied, "stage 1: prefill of micro-batch 1 from router router-c")
        assert st.state() == [(0, 0, 0), (0, 0, 0)]  # stage 0 released the row it had started
    finally:
        for router in routers:
            for s in (st.s0, st.s1):
                s.Info(pb.InfoRequest(router_id=router, leaving=True), timeout=10)
    assert owners() == ["", ""]


def test_a_step_that_waited_for_a_commit_checks_the_owner_again(st):
    """A verify waits on stage 0 for the pending commit of its rows' last round; another
    router claims the stages meanwhile. When the commit lands, the verify is refused
    (PERMISSION_DENIED) instead of running for the router that lost the stages: stage 0
    runs nothing, and no verify stays pending."""
    import concurrent.futures

    acc = setup_verify(st)  # rows 0 and 2 pending (micro-batch 5, round 9)
    for s in (st.s0, st.s1):
        s.Info(pb.InfoRequest(router_id="router-e", claim=True), timeout=10)
    m = step_to_pb(StepInput(6, 1, "verify", [0, 2], [20 + a for a in acc], [D, D], [7] * (2 * D), num_drafts=[3, 3]))
    m.router_id = "router-e"
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(call, st.s0.Verify, m)
            time.sleep(1.0)
            assert not waiting.done()  # it waits for the commit of round 9
            for s in (st.s0, st.s1):  # router-e paused past its lease: router-f takes over
                s.Info(pb.InfoRequest(router_id="router-f", claim=True), timeout=10)
            assert [c for c, _ in st.commit(5, 9, [0, 2], acc)] == ["OK", "OK"]  # a tool's commit
            expect(waiting.result(timeout=TIMEOUT), grpc.StatusCode.PERMISSION_DENIED,
                   "stage 0: verify of micro-batch 6 from router router-e", "router-f took this stage over")
        assert st.state() == [(2, 0, 0), (2, 4, 0)]
        assert [c for c, _ in st.release([0, 2])] == ["OK", "OK"]
    finally:
        for router in ("router-e", "router-f"):
            for s in (st.s0, st.s1):
                s.Info(pb.InfoRequest(router_id=router, leaving=True), timeout=10)


def test_a_router_the_stages_deny_goes_down_for_good(st):
    """The router's side of the fence: a step refused because another router claimed the
    stages (before this router's monitor saw the claim) puts it down for good, as the
    monitor would: /health says another router took over, and the engine is told once."""
    import asyncio

    from ppspec.proto.messages import Release
    from ppspec.router.grpc_pipeline import GrpcPipeline
    from ppspec.router.types import StageDownError

    async def scenario():
        p = GrpcPipeline([f"127.0.0.1:{st.ports['s0']}", f"127.0.0.1:{st.ports['s1']}"])
        told = []
        p.on_displaced = told.append
        try:
            await p.info(claim=True)
            assert p.health()[0]
            for s in (st.s0, st.s1):
                s.Info(pb.InfoRequest(router_id="router-new", claim=True), timeout=10)
            with pytest.raises(StageDownError, match="PERMISSION_DENIED"):
                await p.step(prefill([1]))
            with pytest.raises(StageDownError, match="PERMISSION_DENIED"):
                await p.release(Release([1]))
            return told, p.health()
        finally:
            await p.close()

    try:
        told, (ok, why) = asyncio.run(scenario())
    finally:
        for s in (st.s0, st.s1):  # no owner left for the next test
            s.Info(pb.InfoRequest(router_id="router-new", leaving=True), timeout=10)
    assert not ok and "another router took over these stages" in why, why
    assert "router router-new took this stage over" in why, why
    assert len(told) == 1 and told[0] == why
    assert st.state() == [(0, 0, 0), (0, 0, 0)]


@pytest.mark.parametrize("change,fragment", [
    (dict(shape=[10, 2 * HIDDEN]), "shape [20, 64] in the slot, [10, 128] in the step"),
    (dict(dtype="float16"), "dtype float32 in the slot, 'float16' in the step"),
    (dict(micro_batch_id=2), "micro-batch 1 round 1 in the slot, micro-batch 2 round 1 in the step"),
    (dict(round=5), "micro-batch 1 round 1 in the slot, micro-batch 1 round 5 in the step"),
    (dict(seq=1000), "sequence number"),
    (dict(sender_id="nobody"), "no data-plane link from stage instance 'nobody'"),
])
def test_a_data_plane_tensor_that_does_not_match_its_step_is_refused(st, change, fragment):
    """Stage 0 sends to stage 1 through shared memory. A tensor on that data plane whose slot
    header disagrees with the step naming it (shape, dtype, micro-batch, round, sequence
    number), or from a sender that never attached, is refused by stage 1 before anything
    changes; the same slot under its true step then runs."""
    import torch

    from ppspec.stage_server import dataplane as dp
    from test_dataplane import tampered

    assert st.s0.Info(pb.InfoRequest(), timeout=TIMEOUT).transport == "shm"
    link = dp.SlotLink("shm", "robust" + os.urandom(3).hex(), "cpu")
    try:
        probe, nonce = dp.make_probe(link)
        reply = st.s1.AttachDataPlane(pb.AttachRequest(sender_id=link.sender_id, host_id=dp.host_id(),
                                                       transport="shm", probe=probe.ref, nonce=nonce), timeout=TIMEOUT)
        assert (reply.transport, reply.detail) == ("shm", "")
        link.done(probe, answered=True)
        sent = link.put(torch.randn(20, HIDDEN), 1, 1)  # for prefill([0]): micro-batch 1, round 1

        def step(**change):
            m = step_to_pb(prefill([0]))
            for k in ("micro_batch_id", "round"):
                if k in change:
                    setattr(m, k, change.pop(k))
            m.hidden_ref.CopyFrom(tampered(sent.ref, **change))
            return m

        code = PRE if "sender_id" in change else INV
        expect(call(st.s1.Forward, step(**change)), code, "stage 1: hidden_ref", fragment)
        assert st.state() == [(0, 0, 0), (0, 0, 0)]
        expect(call(st.s1.Forward, step()), "OK")
        assert st.state()[1][0] == 1  # stage 1 holds the row
        expect(call(st.s1.Release, pb.ReleaseRequest(req_pool_indices=[0])), "OK")
    finally:
        link.close()


@pytest.mark.parametrize("change,fragment", [
    (dict(shape=[10, 2 * HIDDEN]), "shape [20, 64] in the header, [10, 128] in the step"),
    (dict(dtype="float16"), "dtype float32 in the header, 'float16' in the step"),
    (dict(micro_batch_id=2), "micro-batch 1 round 1 in the header, micro-batch 2 round 1 in the step"),
])
def test_a_dist_data_plane_tensor_that_does_not_match_its_step_is_refused(st, change, fragment):
    """The same over ``dist`` (a gloo group with stage 1, as a stage on another host would
    build): a tensor whose header disagrees with its step is refused by stage 1
    (INVALID_ARGUMENT) before anything changes, and the true step then reads it."""
    import torch

    from ppspec.stage_server import dataplane_dist as dd
    from test_dataplane import tampered

    sender = "dist" + os.urandom(3).hex()
    reply = st.s1.AttachDataPlane(pb.AttachRequest(sender_id=sender, host_id="elsewhere/1", transport="dist",
                                                   dist_backend="gloo"), timeout=TIMEOUT)
    assert (reply.transport, reply.detail) == ("dist", "")
    link = dd.DistLink(sender, "cpu", "127.0.0.1", reply.store_port)
    try:
        sent = link.put(torch.randn(20, HIDDEN), 1, 1)  # for prefill([0]): micro-batch 1, round 1

        def step(**change):
            m = step_to_pb(prefill([0]))
            for k in ("micro_batch_id", "round"):
                if k in change:
                    setattr(m, k, change.pop(k))
            m.hidden_ref.CopyFrom(tampered(sent.ref, **change))
            return m

        expect(call(st.s1.Forward, step(**change)), INV, "stage 1: hidden_ref", fragment)
        assert st.state() == [(0, 0, 0), (0, 0, 0)]
        expect(call(st.s1.Forward, step()), "OK")
        assert st.state()[1][0] == 1  # stage 1 holds the row
        expect(call(st.s1.Release, pb.ReleaseRequest(req_pool_indices=[0])), "OK")
    finally:
        link.close()


def test_a_stage_whose_data_plane_link_was_pushed_out_attaches_again(st):
    """Stage 1 keeps the links of its last MAX_SENDERS senders: four others attaching push
    stage 0's out. Stage 0's next step is refused (FAILED_PRECONDITION, stage 0 undoes its
    part: nothing held anywhere) and has stage 0 attach again at its next wiring check; the
    steps after run."""
    from ppspec.stage_server import dataplane as dp

    links = [dp.SlotLink("shm", f"other{i}" + os.urandom(3).hex(), "cpu") for i in range(dp.MAX_SENDERS)]
    try:
        for link in links:
            probe, nonce = dp.make_probe(link)
            reply = st.s1.AttachDataPlane(pb.AttachRequest(sender_id=link.sender_id, host_id=dp.host_id(),
                                                           transport="shm", probe=probe.ref, nonce=nonce),
                                          timeout=TIMEOUT)
            assert reply.transport == "shm"
    finally:
        for link in links:
            link.close()
    expect(call(st.s0.Forward, step_to_pb(prefill([0]))), PRE, "stage 1: hidden_ref", "must attach first")
    assert st.state() == [(0, 0, 0), (0, 0, 0)]
    deadline = time.monotonic() + 30
    while call(st.s0.Forward, step_to_pb(prefill([0])))[0] != "OK":
        assert time.monotonic() < deadline, "stage 0 did not attach again"
        assert st.state() == [(0, 0, 0), (0, 0, 0)]
        time.sleep(0.5)
    assert st.s0.Info(pb.InfoRequest(), timeout=TIMEOUT).transport == "shm"
    st.release([0])


def test_a_restarted_stage_is_reported_before_the_pipeline_turns_healthy_again():
    """The router's monitor: a stage that was down answers SERVING again as a new process.
    The engine must hear of the restart (``on_restart``, which fails and recovers it) while
    the pipeline still reports that stage down; were the stage counted up first, /health
    would answer 200 for a moment and a request admitted then would be failed as
    "restarted" (seen in test_pipeline's rejoin test on a loaded machine)."""
    import asyncio

    from ppspec.router.grpc_pipeline import GrpcPipeline

    class Health:
        async def Check(self, req, timeout=None):
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    class Stage:
        def __init__(self, rank, instance):
            self.rank, self.instance = rank, instance

        async def Info(self, req, timeout=None):
            return pb.InfoReply(pp_rank=self.rank, pp_size=2, instance_id=self.instance)

    async def scenario():
        p = GrpcPipeline(["127.0.0.1:1", "127.0.0.1:2"])
        try:
            p.health_stubs = [Health(), Health()]
            p.stubs = [Stage(0, "s0"), Stage(1, "s1-new")]
            p.instances = ["s0", "s1-old"]
            p.down = {1: "stage 1 (127.0.0.1:2) is down: UNAVAILABLE"}
            told = []
            p.on_restart = lambda k, detail: told.append((k, detail, p.health()[0]))
            watch = asyncio.ensure_future(p._watch(0.01))
            for _ in range(500):
                if told and p.health()[0]:
                    break
                await asyncio.sleep(0.01)
            watch.cancel()
            return told, p.health()
        finally:
            await p.close()

    told, health = asyncio.run(scenario())
    assert len(told) == 1, told
    stage, detail, healthy_then = told[0]
    assert stage == 1 and "restarted (instance s1-new)" in detail
    assert healthy_then is False  # still down when the engine is told
    assert health[0] is True and health[1].startswith("2 stages serving")  # and up after it
