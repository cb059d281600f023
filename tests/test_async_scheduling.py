"""The router overlaps scheduling with compute
(docs/DESIGN.md, "Scheduling" and "Async scheduling"): across lanes it forms and sends micro-batch i + 1 while micro-batch i is
still in the pipeline, and within a lane it sends round r + 1 before round r's result
came back, its continuing requests' input ids filled in by the first stage from round r's
tokens. Checked on an injected pipeline that holds every step's result until the test
lets it go and records the order of the calls (no timing), then on real in-process stages
against the synchronous loop."""
from __future__ import annotations

import asyncio

import pytest

from ppspec.proto.messages import FOLLOWS, RoundNote, StepInput, StepOutput, fill_following, note_round
from ppspec.router.engine import Engine
from ppspec.router.pipeline import InProcessPipeline, Pipeline
from ppspec.router.types import SamplingParams
from ppspec.stage_server.rounds import FollowError, SampledRounds

EOS, VOCAB = 0, 16


class HeldPipeline(Pipeline):
    """One stage that answers each step only when the test releases it; every call is
    logged as ``("step", micro_batch_id, round)`` / ``("result", ...)`` / ``("release",
    rows)``, in order. A request emits ``next_token(its last input id)`` per step; a step
    that follows a round takes its FOLLOWS ids from that round's result as a first stage
    does (``SampledRounds``, ``fill_following``)."""

    def __init__(self, rows: int = 8, next_token=lambda t: 7):
        self.rows, self.next_token = rows, next_token
        self.log: list[tuple] = []
        self.held: list[tuple[StepInput, asyncio.Event]] = []
        self.stepped = asyncio.Event()
        self.sampled = SampledRounds()

    async def info(self) -> list[dict]:
        return [dict(pp_rank=0, pp_size=1, layer_start=0, layer_end=1, num_layers=1, num_speculative_steps=0,
                     has_mtp=False, vocab_size=VOCAB, max_rows=self.rows, max_context=256, kv_tokens=4096,
                     kv_pages_total=0, kv_pages_used=0, eos_token_ids=[EOS], rows_in_use=0, pending_commits=0,
                     busy_seconds=0.0)]

    async def step(self, inp: StepInput) -> StepOutput:
        go = asyncio.Event()
        self.log.append(("step", inp.micro_batch_id, inp.round))
        self.held.append((inp, go))
        self.stepped.set()
        key, emitted = ("", inp.micro_batch_id), None
        self.sampled.begin(key, inp.round)
        try:
            if inp.follows_round:
                got = await self.sampled.wait(key, inp.follows_round, None)
                inp.input_ids = fill_following(inp, got, {})[0].input_ids
            await go.wait()
            self.log.append(("result", inp.micro_batch_id, inp.round))
            ends = [sum(inp.extend_lens[: b + 1]) - 1 for b in range(len(inp.req_pool_indices))]
            out = [[self.next_token(inp.input_ids[e])] for e in ends]
            emitted = note_round(inp, out, [])
            return StepOutput(inp.micro_batch_id, inp.round, output_ids=out, drafts=[[] for _ in out],
                              stage_seconds=[0.0])
        finally:
            await self.sampled.ended(key, inp.round, emitted)

    async def commit_accept(self, c) -> list[float]:
        return [0.0]

    async def release(self, r) -> None:
        if r.req_pool_indices:
            self.log.append(("release", tuple(r.req_pool_indices)))

    def health(self):
        return True, "held"

    async def close(self) -> None:
        pass

    async def wait_steps(self, n: int) -> None:
        """Until ``n`` steps have been sent, or fail (the engine never sends them)."""
        async def until():
            while len(self.held) < n:
                self.stepped.clear()
                await self.stepped.wait()
        await asyncio.wait_for(until(), 10.0)

    async def settle(self) -> None:
        """Let every task that can run do so (the held steps stay held)."""
        for _ in range(20):
            await asyncio.sleep(0)


async def _consume(engine, rid, n, prompt=(1, 2, 3), **kw):
    out, reason = [], None
    params = SamplingParams(temperature=0, max_tokens=n, **({"ignore_eos": True} | kw))
    async for o in engine.generate(rid, list(prompt), params):
        out += o.new_token_ids
        reason = o.finish_reason or reason
    return out, reason


def test_next_micro_batch_is_sent_before_the_previous_result():
    """Across lanes (async scheduling off, one micro-batch per lane in flight): the second
    lane's micro-batch reaches the stage while the first is held, and every later step
    goes out before the result ahead of it is released (the last one excepted)."""

    async def run():
        pipe = HeldPipeline()
        engine = Engine(pipe, model_name="m", tokenizer=None, async_scheduling=False, num_micro_batches=2)
        await engine.start()
        try:
            tasks = [asyncio.ensure_future(_consume(engine, f"r{i}", 3)) for i in range(2)]
            await pipe.wait_steps(2)
            assert pipe.log == [("step", 0, 1), ("step", 1, 1)]  # both out, no result yet
            for k in range(6):  # 2 requests x (prefill + 2 decodes)
                if k < 5:  # the step behind it goes out while step k is still held
                    await pipe.wait_steps(k + 2)
                pipe.held[k][1].set()
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 10.0)
            assert [o for o, _ in outs] == [[7, 7, 7], [7, 7, 7]]
        finally:
            await engine.close()

    asyncio.run(run())


def test_round_r_plus_1_is_sent_before_round_r_returns():
    """One request in one lane: round r + 1 goes out while round r is held, following it
    (its input id FOLLOWS, its position the one round r leaves); the synchronous loop
    sends it only after round r's result. The first stage's filling makes the tokens those
    of the synchronous loop: each emits its input + 1."""

    async def run():
        pipe = HeldPipeline(next_token=lambda t: (t + 1) % VOCAB)
        engine = Engine(pipe, model_name="m", tokenizer=None, num_micro_batches=1)
        await engine.start()
        try:
            task = asyncio.ensure_future(_consume(engine, "r", 4))
            await pipe.wait_steps(2)  # the prefill and, before its result, the first decode
            assert pipe.log == [("step", 0, 1), ("step", 0, 2)]
            prefill, decode = pipe.held[0][0], pipe.held[1][0]
            assert prefill.mode == "prefill" and prefill.follows_round == 0
            assert (decode.mode, decode.follows_round, decode.seq_lens, decode.output_lens) == ("decode", 1, [3], [1])
            for k in range(3):  # round k + 3 goes out while round k + 2 is still held
                pipe.held[k][1].set()
                if k < 2:
                    await pipe.wait_steps(k + 3)
                    assert pipe.log[-2:] == [("result", 0, k + 1), ("step", 0, k + 3)]
                    assert pipe.held[k + 2][0].follows_round == k + 2
                    assert pipe.held[k + 2][0].seq_lens == [3 + k + 1]
            # the fourth token is the last (max_tokens): nothing follows its round
            pipe.held[3][1].set()
            out, reason = await asyncio.wait_for(task, 10.0)
            assert (out, reason) == ([4, 5, 6, 7], "length")
            assert len(pipe.held) == 4
            assert [inp.input_ids for inp, _ in pipe.held] == [[1, 2, 3], [4], [5], [6]]  # as filled in
        finally:
            await engine.close()

    asyncio.run(run())


@pytest.mark.parametrize("cap", [2, None])
def test_max_in_flight_bounds_the_rounds_a_lane_sends_beside_its_last(cap):
    """Two lanes over one stage, a request in each: with ``max_in_flight=2`` each lane
    keeps one micro-batch in flight, its next round sent once its last is back (a request
    admitted now waits behind one micro-batch, not three); by default (``default_in_flight``:
    two per lane) each sends its next round at once. A lane alone sends it beside the one
    in flight either way (concurrency 1). The tokens are the same."""

    async def run():
        pipe = HeldPipeline(next_token=lambda t: (t + 1) % VOCAB)
        engine = Engine(pipe, model_name="m", tokenizer=None, num_micro_batches=2, max_in_flight=cap)
        await engine.start()
        try:
            assert engine.max_in_flight == (cap or 4)
            alone = asyncio.ensure_future(_consume(engine, "alone", 3))
            await pipe.wait_steps(2)  # a lane alone: its next round beside the one in flight
            assert pipe.log == [("step", 0, 1), ("step", 0, 2)] and pipe.held[1][0].follows_round == 1
            for k in range(3):
                pipe.held[k][1].set()
                await pipe.settle()
            assert await asyncio.wait_for(alone, 10.0) == ([4, 5, 6], "length")
            del pipe.log[:], pipe.held[:]
            tasks = [asyncio.ensure_future(_consume(engine, "r0", 6))]
            await pipe.wait_steps(2)  # r0 alone again: a round beside the one in flight
            tasks.append(asyncio.ensure_future(_consume(engine, "r1", 6)))
            await pipe.wait_steps(3)  # r1's first micro-batch, in the other lane
            await pipe.settle()
            counts = []  # micro-batches in flight, after each result
            while not all(t.done() for t in tasks):
                outstanding = [go for _, go in pipe.held if not go.is_set()]
                counts.append(len(outstanding))
                outstanding[0].set()
                await pipe.settle()
            # r0's two and r1's first; then one per lane (by default: two per lane)
            assert counts == ([3] + [2] * 9 + [1, 1] if cap == 2 else [4] * 9 + [3, 2, 1])
            assert [o for o, _ in await asyncio.gather(*tasks)] == [[4, 5, 6, 7, 8, 9]] * 2
        finally:
            await engine.close()

    asyncio.run(run())


@pytest.mark.parametrize("end", ["eos", "abort"])
def test_a_request_ending_with_a_round_in_flight_emits_nothing_more(end):
    """A request that ends (EOS in its result, or an abort such as a stop string the HTTP
    layer matched) while its next round is in flight: that round's token is dropped, and
    its row is released once, only after that round came back (the stage may still run it
    before then)."""

    async def run():
        # 1 2 3 -> 4 5 EOS (the third decode's input 5 emits EOS)
        pipe = HeldPipeline(next_token=lambda t: EOS if t == 5 else t + 1)
        engine = Engine(pipe, model_name="m", tokenizer=None, num_micro_batches=1)
        await engine.start()
        try:
            kw = {} if end == "abort" else {"ignore_eos": False}
            task = asyncio.ensure_future(_consume(engine, "r", 10, **kw))
            await pipe.wait_steps(2)
            pipe.held[0][1].set()  # the prefill emits 4
            await pipe.wait_steps(3)
            if end == "abort":
                await pipe.settle()
                await engine.abort("r", "stop")  # as the HTTP layer on a stop string after "4"
                pipe.held[1][1].set()  # round 2 emits 5: dropped
                await pipe.settle()
                pipe.held[2][1].set()
                want = ([4], "stop")
            else:
                pipe.held[1][1].set()  # emits 5; round 4 goes out following round 3
                await pipe.wait_steps(4)
                pipe.held[2][1].set()  # round 3 emits EOS: the request ends, round 4 in flight
                await pipe.settle()
                assert not any(e[0] == "release" for e in pipe.log)  # round 4 still holds the row
                pipe.held[3][1].set()
                want = ([4, 5, EOS], "stop")
            out, reason = await asyncio.wait_for(task, 10.0)
            assert (out, reason) == want
            for _ in range(100):
                if any(e[0] == "release" for e in pipe.log):
                    break
                await asyncio.sleep(0.01)
            releases = [i for i, e in enumerate(pipe.log) if e[0] == "release"]
            last_result = max(i for i, e in enumerate(pipe.log) if e[0] == "result")
            assert len(releases) == 1 and releases[0] > last_result, pipe.log
            assert engine.scheduler.releasing_rows() == [] and len(engine.scheduler.free_rows) == pipe.rows
            assert len(pipe.held) == (3 if end == "abort" else 4)
        finally:
            await engine.close()

    asyncio.run(run())


def test_a_round_that_follows_a_failed_round_is_refused():
    """The first stage never guesses a token: a step that follows a failed round, or a
    round the micro-batch is already past, is refused (nothing ran)."""

    async def run():
        s = SampledRounds()
        await s.ended(("", 0), 1, None)
        with pytest.raises(FollowError, match="failed"):
            await s.wait(("", 0), 1, 1.0)
        await s.ended(("", 0), 3, {5: 9})
        with pytest.raises(FollowError, match="last round is 3"):
            await s.wait(("", 0), 2, 1.0)
        assert await s.wait(("", 0), 3, 1.0) == {5: 9}
        with pytest.raises(asyncio.TimeoutError):
            await s.wait(("other router", 0), 3, 0.01)

    asyncio.run(run())

    def note(tok):
        return RoundNote([tok], [], 0, 0, False)

    def ids(input_ids, exts, rows, noted):
        inp = StepInput(0, 2, "decode", rows, [0] * len(rows), exts, input_ids, follows_round=1)
        return fill_following(inp, noted, {})[0].input_ids
    assert ids([FOLLOWS, 3, 4], [1, 2], [5, 6], {5: note(9)}) == [9, 3, 4]
    with pytest.raises(ValueError, match="row 6"):
        ids([3, FOLLOWS], [1, 1], [5, 6], {5: note(9)})
    with pytest.raises(ValueError, match="past its first token"):
        ids([3, FOLLOWS], [2], [5], {5: note(9)})


def test_a_step_follows_its_round_when_a_later_round_of_the_micro_batch_ended_first():
    """Round 335 (rows 3, 7 decoding) and round 336 (rows 0, 10: a prefill) of one
    micro-batch in flight; 336 ends first, then 335; round 337 follows 336. Before, the
    first stage kept only the last round to end (335), so 337 waited for ever (served:
    the step's DEADLINE_EXCEEDED after --step-timeout, every request of the pipeline 503)."""

    async def run():
        s, key = SampledRounds(), ("router", 0)
        s.begin(key, 335)
        s.begin(key, 336)
        await s.ended(key, 336, {0: 201, 10: 582})
        await s.ended(key, 335, {3: 573, 7: 416})
        assert await s.wait(key, 336, 1.0) == {0: 201, 10: 582}
        assert await s.wait(key, 335, 1.0) == {3: 573, 7: 416}
        # a round still running is waited for, though a later one ended
        s.begin(key, 337)
        s.begin(key, 338)
        await s.ended(key, 338, {0: 1})
        waiter = asyncio.ensure_future(s.wait(key, 337, 1.0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await s.ended(key, 337, {3: 2})
        assert await waiter == {3: 2}

    asyncio.run(run())


def test_async_rounds_on_real_stages_give_the_synchronous_tokens(make_ckpt):
    """In-process stages (PP 2), greedy, some requests ending by EOS (an EOS id the random
    model emits) and some by length, more requests than lanes: the same tokens and finish
    reasons with async scheduling as without; every row comes back."""
    path = make_ckpt("qwen3_5_ratio2_7l")

    follows = []

    async def serve(async_scheduling, eos=None, pipe=None):
        follows.clear()
        pipe = pipe or InProcessPipeline.build(path, pp_size=2, max_rows=8, kv_tokens=4096)
        engine = Engine(pipe, model_name="m", tokenizer=None, async_scheduling=async_scheduling,
                        num_micro_batches=2)
        step = pipe.step

        async def counted(inp):
            follows.append(inp.follows_round)
            return await step(inp)

        pipe.step = counted
        await engine.start()
        if eos is not None:
            engine.scheduler.eos = engine.eos = [eos]
        try:
            prompts = [[(7 * i + j) % 97 + 3 for j in range(5 + 3 * i)] for i in range(6)]
            outs = await asyncio.gather(*(_consume(engine, f"r{i}", 6 + 2 * i, prompt=p, ignore_eos=False)
                                          for i, p in enumerate(prompts)))
            for _ in range(200):
                if not engine.scheduler.releasing_rows():
                    break
                await asyncio.sleep(0.01)
            assert len(engine.scheduler.free_rows) == 8 and not engine.scheduler.releasing_rows()
            for _ in range(200):  # the stages' releases may still be on their way
                infos = await pipe.info()
                if not any(i["rows_in_use"] for i in infos):
                    break
                await asyncio.sleep(0.01)
            assert [i["rows_in_use"] for i in infos] == [0, 0]
            return outs
        finally:
            await engine.close()

    ref = asyncio.run(serve(False))
    # an EOS that ends some requests early: a token the reference emits mid-way
    eos = ref[2][0][3]
    ref = asyncio.run(serve(False, eos))
    assert {r for _, r in ref} == {"stop", "length"}
    assert asyncio.run(serve(True, eos)) == ref
    assert sum(f > 0 for f in follows) > len(follows) // 2  # most rounds followed the one before

    # the same over stage processes: stage 0's gRPC server fills the ids in and leaves out
    # the requests that stopped
    from cluster import Cluster
    from ppspec.router.grpc_pipeline import GrpcPipeline

    c = Cluster(path, 2, max_rows=8, kv_tokens=4096)  # the stages alone: this test drives them
    try:
        for k in range(2):
            c.start_stage(k)

        async def over_grpc():
            pipe = GrpcPipeline(c.stages.split(","))
            await pipe.wait_ready(240)
            return await serve(True, eos, pipe)

        assert asyncio.run(over_grpc()) == ref
    finally:
        c.stop()
    assert sum(f > 0 for f in follows) > len(follows) // 2


def test_with_the_prefix_cache_a_stopped_row_keeps_its_snapshot():
    """With the prefix cache: a request that a stop id ends while its next round is in
    flight keeps its row's snapshot for the next turn (the first stage leaves it out of that
    round, so the state stays that of prompt and reply); one that an abort (a stop string)
    ends then leaves none (that round moves its state past them). Both rows are released
    only after that round."""
    from ppspec.router.prefix_cache import PrefixCache
    from ppspec.router.scheduler import Scheduler

    sched = Scheduler(max_rows=4, kv_tokens=4096, max_context=256, page_size=16, eos_token_ids=[EOS],
                      prefix_cache=PrefixCache(8, 16), async_scheduling=True)
    sched.add("stops", [1, 2, 3], SamplingParams(temperature=0, max_tokens=8))
    sched.add("aborted", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8))
    first = sched.schedule(0)
    ahead = sched.schedule(0)  # both continue before the prefill's result
    assert first.mode == "prefill" and ahead.follows_round == first.round and ahead.input_ids == [FOLLOWS] * 2
    assert sched.abort("aborted", "stop") == []  # in flight: released after its rounds
    up = sched.process(first, [[4], [8]])  # "stops" emitted 4, then EOS below
    assert up.release_rows == [] and sched._row_snapshots == {}  # "aborted" ended, held, no snapshot
    nxt = sched.schedule(0)
    up = sched.process(ahead, [[EOS], []])  # the stage left "aborted" out
    assert len(up.release_rows) == 1 and up.outputs[0].finish_reason == "stop"
    assert list(sched._row_snapshots) == [ahead.rows[0]] and list(sched._held) == [ahead.rows[0]]  # held by `nxt`
    up2 = sched.process(nxt, [[]])  # left out by the first stage (its EOS)
    assert len(up2.release_rows) == 1 and not up2.outputs
    # the snapshot of "stops": prompt and reply, taken at its end although `nxt` held the row
    assert [key for _, key in sched._row_snapshots.values()] == [[1, 2, 3, 4, EOS]]


def test_the_first_stage_leaves_out_requests_that_stopped():
    """A follower's requests whose token in the followed round is one of their stop ids are
    taken out of the step, and the result has empty entries for them."""
    from ppspec.proto.messages import SamplingSpec, StepInput, with_left_out

    stop = SamplingSpec(banned_until_min=[EOS, 9])
    inp = StepInput(0, 2, "decode", [3, 4, 5], [6, 7, 8], [1, 1, 1], [FOLLOWS, FOLLOWS, FOLLOWS],
                    sampling=[stop, stop, SamplingSpec()], output_lens=[1, 1, 1], follows_round=1)
    # row 5 may emit EOS (ignore_eos)
    rest, left, commit = fill_following(inp, {r: RoundNote([t], [], 0, 0, False) for r, t in ((3, 9), (4, 2), (5, EOS))}, {})
    assert left == [0] and commit is None
    assert (rest.req_pool_indices, rest.seq_lens, rest.input_ids, rest.output_lens) == ([4, 5], [7, 8], [2, EOS], [1, 1])
    out = with_left_out(StepOutput(0, 2, output_ids=[[11], [12]], drafts=[[], []]), 3, left, 0, 2)
    assert out.output_ids == [[], [11], [12]] and out.drafts == [[], [], []]
    assert with_left_out(None, 2, [0, 1], 0, 2).output_ids == [[], []]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_a_lane_keeps_its_requests_in_one_micro_batch(make_ckpt, async_scheduling):
    """Twelve requests whose prompts take two prefill micro-batches under the token budget,
    one lane: once prefilled they decode together, twelve rows per forward. A second
    micro-batch beside the one in flight only continues that one's requests; formed from
    the others, the lane would run two groups of six taking turns for good (a decode
    forward costs about as much at 6 rows as at 12: two of them cost twice one)."""
    path = make_ckpt("qwen3_5_ratio2_7l")
    decode_rows = []

    async def serve():
        pipe = InProcessPipeline.build(path, pp_size=1, max_rows=16, kv_tokens=4096)
        engine = Engine(pipe, model_name="m", tokenizer=None, async_scheduling=async_scheduling,
                        num_micro_batches=1, max_num_batched_tokens=256)
        step = pipe.step

        async def spied(inp):
            if inp.mode == "decode" and not inp.num_prefill:
                decode_rows.append(len(inp.req_pool_indices))
            return await step(inp)

        pipe.step = spied
        await engine.start()
        try:
            prompts = [[(5 * i + j) % 89 + 3 for j in range(40)] for i in range(12)]
            return await asyncio.gather(*(_consume(engine, f"r{i}", 40, prompt=p) for i, p in enumerate(prompts)))
        finally:
            await engine.close()

    outs = asyncio.run(serve())
    assert all(len(o) == 40 and r == "length" for o, r in outs)
    assert max(decode_rows) == 12 and sum(n == 12 for n in decode_rows) >= 30, decode_rows


def test_a_step_whose_decode_rows_all_stopped_runs_its_prefill_chunks(make_ckpt):
    """A decode micro-batch formed ahead (it follows the round in flight) whose decode
    request a stop id ends in that round, with a new prompt's chunk in its tail: the first
    stage leaves the stopped request out, and what is left is a prefill of that chunk (not
    a mixed decode with no decode request of its own, which the stage refused, failing the
    new request). The new request's tokens are those it has alone."""
    from ppspec.router.llm import LLM
    from ppspec.router.scheduler import Scheduler

    path = make_ckpt("qwen3_5_ratio2_7l")
    a, b = [5, 6, 7], list(range(10, 40))
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ref = LLM(path).generate([a, b], greedy)
    ref_a, ref_b = ref[0].token_ids, ref[1].token_ids

    async def run():
        pipe = InProcessPipeline.build(path, pp_size=1, max_rows=4, kv_tokens=4096)
        sched = Scheduler(max_rows=4, kv_tokens=4096, max_context=1024, page_size=16, async_scheduling=True)
        sched.add("a", a, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, stop_token_ids=[ref_a[1]]))
        first = sched.schedule(0)
        out = await pipe.step(first.step_input([]))
        got = {}

        def take(batch, out):
            for o in sched.process(batch, out.output_ids, out.drafts).outputs:
                got.setdefault(o.request_id, []).extend(o.new_token_ids)

        take(first, out)
        decode = sched.schedule(0)  # "a" emits its stop id here
        sched.add("b", b, greedy)
        ahead = sched.schedule(0)  # formed before that result: "a" follows it, "b"'s prompt in the tail
        inp = ahead.step_input([])
        assert inp.mode == "decode" and inp.follows_round == decode.round and inp.num_prefill == 1
        first_out, ahead_out = await asyncio.gather(pipe.step(decode.step_input([])), pipe.step(inp))
        take(decode, first_out)
        take(ahead, ahead_out)
        while (batch := sched.schedule(0)) is not None:
            take(batch, await pipe.step(batch.step_input([])))
        return got

    got = asyncio.run(run())
    assert got == {"a": ref_a[:2], "b": ref_b}


def test_a_mixed_verify_left_without_its_verify_request_is_a_prefill():
    """fill_following on a mixed verify whose one verify request stopped in the round it
    follows: the chunk alone, as a prefill step (mode prefill, no num_prefill)."""
    from ppspec.proto.messages import SamplingSpec

    stop = SamplingSpec(temperature=0.0, banned_until_min=[9])
    inp = StepInput(0, 3, "verify", [0, 1], [6, 0], [3, 4], [FOLLOWS] * 3 + [1, 2, 3, 4], num_drafts=[2, 0],
                    sample=[True, False], next_token_ids=[-1, 5], sampling=[stop, SamplingSpec(temperature=0.0)],
                    output_lens=[2, 0], restore_slots=[-1, -1], snapshot_slots=[-1, 4], num_prefill=1,
                    follows_round=2)
    noted = {0: RoundNote(ids=[9], drafts=[7, 8], seq_len=7, output_len=3, verified=True)}
    filled, left_out, commit = fill_following(inp, noted, {})
    assert left_out == [0] and commit is None
    assert (filled.mode, filled.num_prefill, filled.req_pool_indices) == ("prefill", 0, [1])
    assert (filled.input_ids, filled.snapshot_slots, filled.sample) == ([1, 2, 3, 4], [4], [False])
    assert filled.parts() == [filled]
