"""Async scheduling of MTP verify rounds (docs/DESIGN.md, "Async scheduling"): the router
sends round r + 1 of a request before round r's result, and the first stage fills in
what only that result says (the bonus token and the MTP drafts as input ids, the position
round r's accept length leaves, and round r's commit, which every stage applies before
round r + 1). Greedy tokens must stay those of PP1 without speculation, with requests
joining and leaving, ending by EOS within a round and by max_tokens.

The stages' MTP head on a random checkpoint rarely drafts right, so that most rounds
accept one token; the in-process runs also replace the last stage's drafts with an oracle
(the reference continuation, corrupted at seeded places), so that every accept length from
1 to D occurs and round r's commit differs from row to row.
"""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from ppspec.proto.messages import RoundNote, note_round
from ppspec.router import pipeline as pipeline_mod
from ppspec.router.engine import Engine
from ppspec.router.llm import LLM
from ppspec.router.pipeline import InProcessPipeline
from ppspec.router.types import SamplingParams

CKPT = "qwen3_5_ratio2_7l"
STEPS = 3  # D = 4
TIMEOUT = 120  # seconds: a wedged pipeline fails the test instead of hanging it


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def workload():
    rnd = random.Random(5)
    return [dict(prompt=[rnd.randrange(3, 256) for _ in range(rnd.choice([4, 11, 23]))],
                 max_tokens=rnd.choice([8, 40, 56]), join=rnd.randint(0, 6)) for _ in range(6)]


@pytest.fixture(scope="module")
def reference(make_ckpt):
    """PP1 without speculation, greedy, ignore_eos: each request's tokens; and an EOS id
    that the reference emits in the middle of some requests (each then ends at it)."""
    path = make_ckpt(CKPT)
    reqs = workload()
    llm = LLM(path, max_rows=8)
    outs = llm.generate([r["prompt"] for r in reqs],
                        [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs])
    ref = [o.token_ids for o in outs]
    counts = {}
    for toks in ref:
        for t in set(toks[3:-3]):
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=counts.get)  # a token several requests emit mid-way
    return path, reqs, ref, eos


def expected(ref, eos):
    """Each request's tokens and finish reason once ``eos`` ends it."""
    out = []
    for toks in ref:
        if eos in toks:
            out.append((toks[: toks.index(eos) + 1], "stop"))
        else:
            out.append((toks, "length"))
    return out


class OracleDrafts:
    """Replaces the last stage's MTP drafts of each row by the request's reference
    continuation after the round, corrupted at seeded places (all right, first wrong, one
    wrong): every accept length occurs."""

    def __init__(self, engine, reqs, ref):
        self.engine, self.full = engine, {f"r{i}": r["prompt"] + ref[i] for i, r in enumerate(reqs)}

    def wrap(self, runner):
        step = runner.step

        def drafting(inp):
            out = step(inp)
            if out.drafts:
                by_row = {r.row: r.request_id for r in list(self.engine.scheduler.requests.values())}
                notes = note_round(inp, out.output_ids, out.drafts)
                for b, row in enumerate(inp.req_pool_indices):
                    if row not in notes or row not in by_row:
                        continue
                    at = notes[row].seq_len + 1  # the first token the next round's drafts guess
                    truth = self.full[by_row[row]][at: at + STEPS]
                    truth += [5] * (STEPS - len(truth))
                    kind = random.Random(hash((row, at))).choice(["all", "first_wrong", "mid_wrong", "all"])
                    if kind == "first_wrong":
                        truth[0] = (truth[0] + 1) % 256
                    elif kind == "mid_wrong":
                        j = random.Random(hash((row, at, 1))).randrange(STEPS)
                        truth[j] = (truth[j] + 7) % 256
                    out.drafts[b] = truth
            return out

        runner.step = drafting


async def _consume(engine, rid, prompt, max_tokens, delay_rounds, rounds):
    while rounds[0] < delay_rounds:
        await rounds[1].wait()
    out, reason = [], None
    try:
        async for o in engine.generate(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens)):
            out += o.new_token_ids
            reason = o.finish_reason or reason
    except Exception as e:  # noqa: BLE001  (a fault test counts a refused request as a difference)
        return out, f"error: {e}"
    return out, reason


def serve(path, reqs, eos, pp, oracle=None, lanes=None, fault=None, stages=None):
    """The requests through an ``Engine`` over in-process stages (or the gRPC stages at
    ``stages``) with MTP and async scheduling, each joining after its ``join`` rounds;
    returns (tokens, finish reason) per request, the steps sent, and the verify rounds'
    accept lengths."""
    steps, accepts = [], []

    async def run():
        if stages is None:
            pipe = InProcessPipeline.build(path, pp_size=pp, max_rows=8, kv_tokens=4096, num_speculative_steps=STEPS,
                                           use_mtp=True)
        else:
            from ppspec.router.grpc_pipeline import GrpcPipeline

            pipe = GrpcPipeline(stages)
            await pipe.wait_ready(240)
        engine = Engine(pipe, model_name="m", tokenizer=None, num_micro_batches=lanes)
        if oracle is not None:
            oracle(engine).wrap(pipe.runners[-1])
        rounds = [0, asyncio.Event()]
        step = pipe.step

        async def counted(inp, *commit):
            steps.append((inp.mode, inp.follows_round))
            try:
                return await step(inp, *commit)
            finally:
                rounds[0] += 1
                rounds[1].set()
                rounds[1] = asyncio.Event()

        pipe.step = counted
        process = None
        await engine.start()
        engine.scheduler.eos = engine.eos = [eos]
        process = engine.scheduler.process

        def recorded(batch, *a, **kw):
            up = process(batch, *a, **kw)
            accepts.extend(a for a in up.accept_lengths if a)
            return up

        engine.scheduler.process = recorded
        try:
            outs = await asyncio.wait_for(asyncio.gather(*(
                _consume(engine, f"r{i}", r["prompt"], r["max_tokens"], r["join"], rounds) for i, r in enumerate(reqs))),
                TIMEOUT)
            for _ in range(300):  # every row back on every stage
                infos = await pipe.info()
                if not any(i["rows_in_use"] for i in infos) and not engine.scheduler.releasing_rows():
                    break
                await asyncio.sleep(0.01)
            if fault is None:
                assert [i["rows_in_use"] for i in infos] == [0] * pp
                assert not getattr(pipe, "_pending", None) and not any(i.get("pending_commits") for i in infos)
                assert len(engine.scheduler.free_rows) == 8
            return outs
        finally:
            await engine.close()

    return asyncio.run(run()), steps, accepts


@pytest.mark.parametrize("pp,lanes,oracle", [(1, None, False), (1, 1, True), (2, None, True), (3, 2, True)])
def test_following_verifies_give_the_tokens_of_pp1_without_speculation(reference, pp, lanes, oracle):
    path, reqs, ref, eos = reference
    want = expected(ref, eos)
    assert {r for _, r in want} == {"stop", "length"}
    mk = (lambda e: OracleDrafts(e, reqs, ref)) if oracle else None
    got, steps, accepts = serve(path, reqs, eos, pp, mk, lanes)
    assert got == want
    following = [f for m, f in steps if m == "verify" and f]
    assert len(following) > len(steps) // 2, steps  # most rounds followed the verify before them
    if oracle:
        assert set(accepts) == set(range(1, STEPS + 2)), accepts  # every accept length, each committed in its row


def test_following_verifies_over_grpc_stages(reference):
    """PP2 stage processes: stage 0's server fills the following verifies in, leaves out the
    requests an EOS ended, and relays the step with round r's commit, which stage 1 applies
    before it: PP1's tokens, every row and commit settled."""
    from cluster import Cluster

    path, reqs, ref, eos = reference
    c = Cluster(path, 2, "mtp", steps=STEPS, max_rows=8, kv_tokens=4096)  # the stages alone: the test drives them
    try:
        for k in range(2):
            c.start_stage(k)
        got, steps, _ = serve(path, reqs, eos, 2, stages=c.stages.split(","))
    finally:
        c.stop()
    assert got == expected(ref, eos)
    assert len([f for m, f in steps if m == "verify" and f]) > len(steps) // 2, steps


def _wrong_round(fill):
    def faulty(inp, noted, pending):
        older = FAULTY_SAMPLED[0]._ended.get(("", inp.micro_batch_id), {}).get(inp.follows_round - 1)
        return fill(inp, older or noted, pending)
    return faulty


def _wrong_rows(fill):
    def faulty(inp, noted, pending):
        rows = sorted(noted)
        return fill(inp, {r: noted[rows[(k + 1) % len(rows)]] for k, r in enumerate(rows)}, pending)
    return faulty


def _commit_rows(fill):
    def faulty(inp, noted, pending):
        filled, left_out, commit = fill(inp, noted, pending)
        if commit is not None and len(commit.req_pool_indices) > 1:
            commit.accept_lengths = commit.accept_lengths[1:] + commit.accept_lengths[:1]
        return filled, left_out, commit
    return faulty


FAULTY_SAMPLED: list = [None]


@pytest.mark.parametrize("fault", [None, _wrong_round, _wrong_rows, _commit_rows])
def test_invariance_catches_a_first_stage_that_fills_from_the_wrong_result(reference, monkeypatch, fault):
    """Stage 0 filling a following verify from the round before the one it follows, from
    another row's result, or applying round r's accept lengths to other rows: the tokens
    differ from PP1's (or a stage refuses the step). Without a fault (None) the same run
    gives PP1's tokens."""
    path, reqs, ref, eos = reference
    if fault is not None:
        monkeypatch.setattr(pipeline_mod, "fill_following", fault(pipeline_mod.fill_following))
    build = InProcessPipeline.build.__func__

    def built(cls, *a, **kw):
        p = build(cls, *a, **kw)
        FAULTY_SAMPLED[0] = p.sampled
        return p
    monkeypatch.setattr(InProcessPipeline, "build", classmethod(built))
    together = [dict(r, join=0) for r in reqs]  # one lane: rows share each micro-batch
    got, steps, _ = serve(path, together, eos, 2, lambda e: OracleDrafts(e, together, ref), 1, fault=fault)
    assert any(m == "verify" and f for m, f in steps)
    if fault is None:
        assert got == expected(ref, eos)
    else:
        assert got != expected(ref, eos)


def test_a_round_note_is_what_the_step_after_takes():
    """What the first stage notes of a verify row: its position once committed, its
    outputs, its drafts; of a prefill chunk: the chunk's end."""
    from ppspec.proto.messages import StepInput, note_round

    inp = StepInput(0, 3, "verify", [4, 6, 2], [10, 20, 0], [4, 4, 5], [0] * 13, num_drafts=[3, 3, 0],
                    output_lens=[5, 7, 0], num_prefill=1)
    notes = note_round(inp, [[1, 2], [3], [9]], [[7, 7, 7], [8, 8, 8], [6, 6, 6]])
    assert notes == {4: RoundNote([1, 2], [7, 7, 7], 12, 7, True), 6: RoundNote([3], [8, 8, 8], 21, 8, True),
                     2: RoundNote([9], [6, 6, 6], 5, 1, False)}


def test_a_lane_keeps_following_while_requests_near_their_end_skip_a_round(make_ckpt):
    """Twelve requests in one lane with MTP, their ends staggered: near its end (within
    three verify rounds of max_tokens) a request may not follow, and the lane sends the
    next round with the others anyway (at least half of the round's requests continue);
    the one near its end joins the round after, formed once the round in flight is back.
    So rounds shrink and grow back, most rounds follow, no running request misses more
    than one round in a row, and the greedy tokens are PP1's without speculation."""
    path = make_ckpt(CKPT)
    prompts = [[(5 * i + j) % 89 + 3 for j in range(40)] for i in range(12)]
    lengths = [24 + 3 * i for i in range(12)]
    want = [c.token_ids for c in LLM(path, max_rows=16).generate(
        prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths])]
    rounds = []

    async def run():
        pipe = InProcessPipeline.build(path, pp_size=1, max_rows=16, kv_tokens=8192, num_speculative_steps=STEPS,
                                       use_mtp=True)
        engine = Engine(pipe, model_name="m", tokenizer=None, num_micro_batches=1, max_num_batched_tokens=256)
        step = pipe.step

        async def spied(inp, *commit):
            if inp.mode == "verify" and not inp.num_prefill:
                rounds.append((list(inp.req_pool_indices), inp.follows_round))
            return await step(inp, *commit)

        pipe.step = spied
        await engine.start()
        try:
            return await asyncio.gather(*(engine_consume(engine, f"r{i}", p, n)
                                          for i, (p, n) in enumerate(zip(prompts, lengths))))
        finally:
            await engine.close()

    assert asyncio.run(run()) == want
    sizes = [len(rows) for rows, _ in rounds]
    first_full = sizes.index(12)
    after = sizes[first_full:]
    assert any(a > b < c for a, b, c in zip(after, after[1:], after[2:])), sizes  # shrank, then grew back
    assert sum(f > 0 for _, f in rounds[first_full:]) > len(after) // 2, rounds
    for row in {r for rows, _ in rounds for r in rows}:
        seen = [i for i, (rows, _) in enumerate(rounds) if row in rows]
        assert all(b - a <= 2 for a, b in zip(seen, seen[1:])), (row, seen)


async def engine_consume(engine, rid, prompt, n):
    out = []
    async for o in engine.generate(rid, prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)):
        out += o.new_token_ids
    return out


@pytest.mark.parametrize("stages", ["in-process", "grpc"])
def test_a_following_verify_whose_verify_rows_all_stopped_runs_its_chunk_as_a_prefill(make_ckpt, stages):
    """A verify micro-batch formed ahead (it follows the verify in flight) with a new
    prompt's chunk in its tail, whose one verify request a stop id ends in the round it
    follows: the first stage leaves that request out and runs the chunk as a prefill (a
    stage server as a Forward: it came as a Verify, which takes verify steps only). Refused
    before, failing the new request. Its tokens are those it has alone."""
    from ppspec.router.scheduler import Scheduler

    path = make_ckpt(CKPT)
    a, b = [5, 6, 7], list(range(10, 40))
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = LLM(path).generate([a, b], greedy)
    ref_a, ref_b = ref[0].token_ids, ref[1].token_ids

    async def run(pipe):
        sched = Scheduler(max_rows=4, kv_tokens=4096, max_context=1024, page_size=16, async_scheduling=True,
                          speculative_algorithm="mtp", num_steps=STEPS)
        # stops at its second token, which the first verify emits (the random head's drafts
        # are rejected: it emits one token there)
        sched.add("a", a, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[ref_a[1]]))
        got, commit = {}, None

        def take(batch, out):
            up = sched.process(batch, out.output_ids, out.drafts)
            for o in up.outputs:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)
            return up.commit

        first = sched.schedule(0)
        take(first, await pipe.step(first.step_input([])))
        verify = sched.schedule(0)
        sched.add("b", b, greedy)
        ahead = sched.schedule(0)
        inp = ahead.step_input([])
        assert (inp.mode, inp.follows_round, inp.num_prefill) == ("verify", verify.round, 1)
        outs = await asyncio.wait_for(asyncio.gather(pipe.step(verify.step_input([])), pipe.step(inp)), TIMEOUT)
        assert outs[0].output_ids == [ref_a[1:2]] and outs[1].output_ids[0] == []
        commit = take(verify, outs[0]) or commit
        commit = take(ahead, outs[1]) or commit
        while (batch := sched.schedule(0)) is not None:
            if commit is not None:
                await pipe.commit_accept(commit)
            commit = take(batch, await asyncio.wait_for(pipe.step(batch.step_input([])), TIMEOUT))
        return got

    if stages == "in-process":
        pipe = InProcessPipeline.build(path, max_rows=4, kv_tokens=4096, num_speculative_steps=STEPS, use_mtp=True)
        got = asyncio.run(run(pipe))
    else:
        from cluster import Cluster
        from ppspec.router.grpc_pipeline import GrpcPipeline

        c = Cluster(path, 1, "mtp", steps=STEPS, max_rows=4, kv_tokens=4096)  # the stage alone: the test drives it
        try:
            c.start_stage(0)

            async def over_grpc():
                pipe = GrpcPipeline(c.stages.split(","))
                await pipe.wait_ready(240)
                return await run(pipe)

            got = asyncio.run(over_grpc())
        finally:
            c.stop()
    assert got == {"a": ref_a[:2], "b": ref_b}
