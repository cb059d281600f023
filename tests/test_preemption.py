"""KV pages on demand and recompute preemption (``router.scheduler``).

A request holds pages for what its next micro-batch writes; when the pool runs short the
youngest requests not in flight give their rows back and are prefilled again (prompt and
outputs) when readmitted. The reference for every output is a run whose pool never runs
short: PP1 without speculation.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from ppspec.router.engine import Engine
from ppspec.router.llm import LLM
from ppspec.router.metrics import RouterMetrics
from ppspec.router.pipeline import InProcessPipeline
from ppspec.router.scheduler import RUNNING, WAITING, Scheduler
from ppspec.router.types import SamplingParams

PROMPTS = [[3 + i, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3 + i] for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
# 16 + 40 tokens and the verify / draft overhang: 4 pages of 16 each; 6 requests need 24
# pages for their whole lives, the pool has 10: an up-front reservation runs 2 at a time
KV_TOKENS = 160


def _peak_running(llm: LLM) -> int:
    peak = 0
    while llm.has_unfinished():
        llm.step()
        peak = max(peak, llm.scheduler.num_running)
    return peak


def _assert_nothing_held(sched: Scheduler, runners) -> None:
    assert sched.kv_reserved == 0 and not sched.releasing_rows() and len(sched.free_rows) == sched.max_rows
    for r in runners:
        for pool in (r.kv, getattr(r, "mtp_kv", None)):
            if pool is not None:
                assert pool.used_pages == 0


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt("qwen3_5_ratio1")


@pytest.fixture(scope="module")
def reference(ckpt):
    torch.set_num_threads(1)
    return [o.token_ids for o in LLM(ckpt, max_rows=8).generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("spec", ["none", "ngram", "mtp"])
def test_short_pool_preempts_and_outputs_match_an_unbounded_pool(ckpt, reference, spec):
    torch.set_num_threads(1)
    llm = LLM(ckpt, max_rows=8, kv_tokens=KV_TOKENS, speculative_algorithm=spec)
    page = llm.scheduler.page_size
    assert page == 16, "the sizes above assume 16-token pages"
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    peak = _peak_running(llm)
    assert [llm.completions[i].token_ids for i in ids] == reference
    assert llm.scheduler.num_preemptions > 0
    assert peak > 2  # more at once than whole-life reservations (2) allow
    _assert_nothing_held(llm.scheduler, llm.pipeline.runners)


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_seeded_sampling_is_the_same_after_a_preemption(ckpt, spec):
    """A seeded token depends on (seed, output position) alone: a recomputed request
    samples the tokens of an unpreempted run."""
    torch.set_num_threads(1)
    p = SamplingParams(temperature=0.8, top_k=20, max_tokens=40, ignore_eos=True, seed=11)
    ref = [o.token_ids for o in LLM(ckpt, max_rows=8, speculative_algorithm=spec).generate(PROMPTS, p)]
    llm = LLM(ckpt, max_rows=8, kv_tokens=KV_TOKENS, speculative_algorithm=spec)
    ids = [llm.add_request(q, p) for q in PROMPTS]
    _peak_running(llm)
    assert llm.scheduler.num_preemptions > 0
    assert [llm.completions[i].token_ids for i in ids] == ref


def test_pipeline_engine_preempts_across_lanes(ckpt, reference):
    """PP2 with two micro-batches in flight and MTP: a lane may preempt a request of the
    other lane only while that one is not in flight; the rows go back through a release on
    every stage; the metric counts them."""
    from prometheus_client import CollectorRegistry

    torch.set_num_threads(1)
    pipe = InProcessPipeline.build(ckpt, 2, max_rows=8, kv_tokens=KV_TOKENS, num_speculative_steps=3, use_mtp=True)
    metrics = RouterMetrics(registry=CollectorRegistry(), num_stages=2)
    in_flight: dict[int, set[int]] = {}
    for runner in pipe.runners:
        step, release = runner.step, runner.release

        def checked_step(inp, step=step, k=runner.pp_rank):
            in_flight.setdefault(k, set()).update(inp.req_pool_indices)
            try:
                return step(inp)
            finally:
                in_flight[k].difference_update(inp.req_pool_indices)

        def checked_release(rows, release=release, k=runner.pp_rank):
            assert not set(rows) & in_flight.get(k, set()), "a row released while its micro-batch runs"
            return release(rows)

        runner.step, runner.release = checked_step, checked_release

    async def run():
        engine = Engine(pipe, model_name="t", tokenizer=None, speculative_algorithm="mtp", num_micro_batches=2,
                        metrics=metrics)
        await engine.start()

        async def one(i):
            ids = []
            async for out in engine.generate(f"r{i}", PROMPTS[i], GREEDY):
                ids += out.new_token_ids
            return ids

        outs = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
        for _ in range(100):  # releases run in the background
            if not engine.scheduler.releasing_rows():
                break
            await asyncio.sleep(0.05)
        n = engine.scheduler.num_preemptions
        await engine.close()
        return outs, n, engine.scheduler

    outs, n, sched = asyncio.run(run())
    assert outs == reference
    assert n > 0 and metrics.num_preemptions._value.get() == n
    _assert_nothing_held(sched, pipe.runners)


# ---------------------------------------------------------------- the scheduler alone


def _sched(**kw):
    # 4-token pages, no speculation (D = 1): a request needs ceil4(num_computed + extend + 1)
    args = dict(max_rows=8, kv_tokens=24, max_context=96, page_size=4, chunk_size=64)
    args.update(kw)
    return Scheduler(**args)


def _run_round(s: Scheduler, lane: int, tok: int = 7):
    b = s.schedule(lane)
    if b is None:
        return None
    up = s.process(b, [[tok] if b.sample[i] else [] for i in range(len(b.requests))])
    s.free(up.release_rows)
    return b


def test_the_youngest_idle_request_is_preempted_and_recomputed_from_its_outputs():
    s = _sched()
    p = SamplingParams(max_tokens=20, ignore_eos=True)
    for i in range(3):
        s.add(f"r{i}", [1, 2, 3], p)
    b = _run_round(s, 0)  # admits and prefills all three: a page each (3 + 1 tokens)
    assert len(b.requests) == 3 and [r.reserved_tokens for r in b.requests] == [4, 4, 4]
    for _ in range(40):  # decode rounds until the pool (6 pages) is short
        if s.num_preemptions:
            break
        _run_round(s, 0)
    rows = s.take_preempted()
    assert s.num_preemptions == 1 and len(rows) == 1 and s.take_preempted() == []
    victim = s.requests["r2"]  # the youngest
    assert victim.status == WAITING and victim.row == -1 and victim.reserved_tokens == 0 and s.waiting[0] is victim
    assert rows == s.releasing_rows()  # freed only once the stages released it
    assert s.requests["r0"].status == s.requests["r1"].status == RUNNING
    n_out = len(victim.output_ids)
    assert n_out > 1
    # readmitted (after the release) it prefills its prompt and every output but the last,
    # and samples nothing: the last output is the next decode's input
    s.free(rows)
    s.requests["r0"].params.max_tokens = len(s.requests["r0"].output_ids) + 1  # r0 ends next round
    for _ in range(40):
        b = _run_round(s, 0)
        if b is not None and victim in b.requests:
            break
    i = b.requests.index(victim)
    assert b.mode == "prefill" and b.seq_lens[i] == 0 and b.extend_lens[i] == 3 + n_out - 1
    assert not b.sample[i] and b.next_token_ids[i] == victim.output_ids[-1]
    start = sum(b.extend_lens[:i])
    assert b.input_ids[start:start + b.extend_lens[i]] == [1, 2, 3] + victim.output_ids[:-1]
    assert len(victim.output_ids) == n_out and victim.num_computed == 3 + n_out - 1
    b = _run_round(s, 0)  # then it decodes its last output at that position
    i = b.requests.index(victim)
    assert b.mode == "decode" and b.seq_lens[i] == 3 + n_out - 1 and len(victim.output_ids) == n_out + 1


def test_a_request_in_flight_is_never_preempted_and_the_oldest_waits_for_it():
    s = _sched(kv_tokens=16, num_lanes=2)
    p = SamplingParams(max_tokens=12, ignore_eos=True)
    s.add("old", [1, 2, 3], p)
    s.add("young", [1, 2, 3], p)
    old, young = s.requests["old"], s.requests["young"]
    b0, b1 = s.schedule(0), s.schedule(1)
    assert b0.requests == [old] and b1.requests == [young]
    s.process(b0, [[7]])
    for _ in range(20):  # old decodes while young's micro-batch stays in flight
        b = s.schedule(0)
        if b is None:
            break
        s.process(b, [[7]])
    assert old.num_computed == 11 and s.kv_reserved == s.kv_tokens  # old needs a page young holds
    assert s.num_preemptions == 0 and young.status == RUNNING
    s.process(b1, [[7]])
    assert s.schedule(0) is None  # young is preempted now, but its page comes back with the release
    assert s.num_preemptions == 1 and young.status == WAITING and s.schedule(1) is None
    s.free(s.take_preempted())
    b = s.schedule(0)
    assert b is not None and b.requests == [old] and old.reserved_tokens == 16


def test_a_whole_life_too_big_for_the_pool_is_refused_at_add():
    from ppspec.router.types import ContextLengthError

    s = _sched(kv_tokens=16)
    assert s.max_context == 15  # the pool less the verify overhang
    with pytest.raises(ContextLengthError):
        s.add("big", [1] * 8, SamplingParams(max_tokens=8))
    assert not s.requests and not s.waiting
    s.add("ok", [1] * 8, SamplingParams(max_tokens=7))


def test_a_prefill_short_of_kv_does_not_stall_the_decodes_of_its_lane():
    """The lane's only prefill (young, in its chunked prefill) cannot grow and may not
    preempt the older decoding request: the lane decodes that one instead of forming no
    micro-batch at all, and the young one finishes once the old one gives its pages back."""
    s = _sched(kv_tokens=20, chunk_size=4)
    s.add("old", [1, 2, 3], SamplingParams(max_tokens=14, ignore_eos=True))
    for _ in range(12):  # old prefills and decodes up to 4 pages' worth
        _run_round(s, 0)
    old = s.requests["old"]
    assert old.num_computed == 14 and old.reserved_tokens == 16
    s.add("young", [5] * 12, SamplingParams(max_tokens=1, ignore_eos=True))
    rounds = []
    for _ in range(20):
        b = _run_round(s, 0)
        if b is None and not s.requests:
            break
        assert b is not None, "the lane formed no micro-batch while a request could run"
        rounds.append((b.mode, [r.request_id for r in b.requests]))
    assert ("decode", ["old"]) in rounds and rounds[-1][1] == ["young"]
    assert s.kv_reserved == 0 and len(s.free_rows) == s.max_rows


def test_a_request_preempted_before_its_first_micro_batch_is_announced_once():
    s = _sched(kv_tokens=24, chunk_size=8)
    s.add("old", [1] * 20, SamplingParams(max_tokens=1, ignore_eos=True))
    b = s.schedule(0)
    assert b.first == [s.requests["old"]]
    s.add("young", [2] * 6, SamplingParams(max_tokens=2, ignore_eos=True))
    s.process(b, [[]])
    # admits young (2 pages), then old's next chunk (2 more pages, 1 free) preempts it
    # before it ran; old waits for the release
    assert s.schedule(0) is None
    young = s.requests["young"]
    assert young.num_preemptions == 1 and not young.scheduled
    s.free(s.take_preempted())
    seen = []
    while s.requests:
        b = s.schedule(0)
        if b is None:
            s.free(s.take_preempted())
            continue
        seen += [r.request_id for r in b.first]
        up = s.process(b, [[7] if b.sample[i] else [] for i in range(len(b.requests))])
        s.free(up.release_rows)
    assert seen == ["young"]


def test_an_aborted_waiting_request_no_longer_counts_as_waiting():
    s = _sched(max_rows=1, max_waiting=2)
    s.add("run", [1, 2], SamplingParams(max_tokens=4))
    s.schedule(0)
    s.add("a", [1], SamplingParams(max_tokens=4))
    s.add("b", [1], SamplingParams(max_tokens=4))
    assert s.abort("a") == [] and s.abort("b") == []
    assert s.num_waiting == 0 and not s.waiting
    s.add("c", [1], SamplingParams(max_tokens=4))  # the queue bound counts only the live ones
    assert s.num_waiting == 1


def test_the_queue_bound_counts_the_requests_no_free_row_will_take():
    """--max-waiting bounds the requests that wait for a row: a burst into an idle server
    with 2 free rows and a bound of 3 takes 5 requests (2 for the rows, 3 queued), refuses
    the 6th; once the rows are taken, the bound is the queue's own."""
    from ppspec.router.types import QueueFullError

    s = _sched(max_rows=2, kv_tokens=64, max_waiting=3)
    for i in range(5):
        s.add(f"r{i}", [1], SamplingParams(max_tokens=4))
    with pytest.raises(QueueFullError, match="3 requests waiting for a row"):
        s.add("r5", [1], SamplingParams(max_tokens=4))
    b = s.schedule(0)
    assert sorted(r.request_id for r in b.first) == ["r0", "r1"] and not s.free_rows
    assert s.num_waiting == 3
    with pytest.raises(QueueFullError):
        s.add("r5", [1], SamplingParams(max_tokens=4))
    assert s.abort("r4") == []
    s.add("r5", [1], SamplingParams(max_tokens=4))
    assert [r.request_id for r in s.waiting] == ["r2", "r3", "r5"]


def test_the_queue_bound_counts_a_row_being_released_as_free():
    """A row whose request ended is back once every stage acknowledged its release, a
    round trip after the client had its answer: a client that sends its next request at
    once (--max-rows 1 --max-waiting 0) must not get 429 from a server it keeps busy alone
    (it got one about a third of the time)."""
    from ppspec.router.types import QueueFullError

    s = _sched(max_rows=1, kv_tokens=64, max_waiting=0)
    s.add("first", [1], SamplingParams(max_tokens=1))
    b = s.schedule(0)
    up = s.process(b, [[7]])
    assert up.release_rows and not s.free_rows and "first" not in s.requests  # ended, row releasing
    s.add("next", [1], SamplingParams(max_tokens=1))  # the releasing row takes it next
    with pytest.raises(QueueFullError):
        s.add("more", [1], SamplingParams(max_tokens=1))
    s.free(up.release_rows)
    assert [r.request_id for r in s.schedule(0).first] == ["next"]
