"""Prefix caching where requests meet only under concurrency (issue 28's mt32 workload),
each interleaving driven deterministically through the in-process engine (``LLM``) with
MTP, at PP1 and PP2: greedy tokens are those without the cache, and once the cache is
flushed no stage holds a row, a KV page or a snapshot, nor the router a charge or a pin.

- a conversation's next turn that arrives while the release taking its previous turn's
  snapshot is under way waits for that snapshot; aborted while it waits, it leaves
  nothing behind, and the turn sent again hits the whole previous turn;
- the snapshot such a turn waits for is evicted as soon as it is filed, before the turn
  is admitted: the turn misses and prefills it all;
- a request admitted with a hit (its snapshot pinned, its pages shared) is preempted
  before its first chunk ran: the pin and the shared pages go back, and readmitted it
  hits again, counted once;
- and all of it at once: the engine as served (async scheduling), 32 conversations at a
  time on four snapshot slots and a KV pool that preempts, some turns aborted.
"""
from __future__ import annotations

import pytest
import torch

from ppspec.router.llm import LLM
from ppspec.router.scheduler import WAITING
from ppspec.router.types import SamplingParams
from test_prefix_cache import CHUNK, CKPT, assert_all_free, conversations

P1 = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
P2 = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt(CKPT)


@pytest.fixture(scope="module")
def turns(ckpt):
    """PP1 without speculation or cache: two conversations' first turn, their second turn's
    prompt (the first, its reply and a new message) and its reply."""
    ref = LLM(ckpt, chunk_size=CHUNK)
    convs = conversations(2)
    first = [o.token_ids for o in ref.generate(convs, P1)]
    second = [c + o + [11, 12, 13 + i] for i, (c, o) in enumerate(zip(convs, first))]
    return convs, first, second, [o.token_ids for o in ref.generate(second, P2)]


def run(llm):
    while llm.has_unfinished():
        llm.step()


def on_release_with_snapshot(llm, hook):
    """Call ``await hook()`` inside the first release that takes a finished row's
    snapshot, before any stage runs it (the release is under way)."""
    release, done = llm.pipeline.release, []

    async def hooked(r):
        if r.snapshot_slots and not done:
            done.append(r)
            await hook()
        return await release(r)

    llm.pipeline.release = hooked
    return done


@pytest.mark.parametrize("pp", [1, 2])
def test_next_turn_aborted_while_it_waits_for_the_release_snapshot(ckpt, turns, pp):
    convs, first, second, want = turns
    llm = LLM(ckpt, pp_size=pp, speculative_algorithm="mtp", chunk_size=CHUNK, enable_prefix_caching=True)
    sched, waited = llm.scheduler, []

    async def next_turn_then_abort():
        rid = llm.add_request(second[0], P2, request_id="early")
        req = sched.requests[rid]
        sched._admit()  # what the next lane to schedule does: the turn waits for the release
        waited.append((req.status, req.row, sched._snapshot_coming(req), list(sched.waiting)))
        await llm.engine.abort(rid)

    done = on_release_with_snapshot(llm, next_turn_then_abort)
    rid0 = llm.add_request(convs[0], P1)
    run(llm)
    assert done and llm.completions[rid0].token_ids == first[0]
    (status, row, coming, waiting), = waited
    assert status == WAITING and row < 0 and coming and [r.request_id for r in waiting] == ["early"]
    early = llm.completions["early"]
    assert early.token_ids == [] and early.finish_reason == "abort"
    assert not sched.waiting and "early" not in sched.requests
    # sent again, the turn hits the whole previous turn (all of it but its last token)
    rid = llm.add_request(second[0], P2)
    req = sched.requests[rid]
    run(llm)
    assert llm.completions[rid].token_ids == want[0]
    assert req.cached_tokens == len(convs[0]) + len(first[0]) - 1
    assert sched.cache.hit_tokens == req.cached_tokens and not sched.cache.pins
    assert_all_free(llm)


@pytest.mark.parametrize("pp", [1, 2])
def test_the_snapshot_a_next_turn_waits_for_is_evicted_before_it_is_admitted(ckpt, turns, pp):
    convs, first, second, want = turns
    llm = LLM(ckpt, pp_size=pp, speculative_algorithm="mtp", chunk_size=CHUNK, enable_prefix_caching=True)
    sched, filed = llm.scheduler, []

    async def next_turn():
        llm.add_request(second[0], P2, request_id="next")
        sched._admit()
        assert sched.requests["next"].status == WAITING and sched._snapshot_coming(sched.requests["next"])

    free = sched.free

    def free_then_flush(rows):
        free(rows)  # files the release's snapshot
        if "next" in sched.requests and not filed:
            filed.append(sched.cache.num_cached)
            sched.flush_cache()  # every snapshot evicted (none pinned): the turn finds none

    sched.free = free_then_flush
    on_release_with_snapshot(llm, next_turn)
    rid0 = llm.add_request(convs[0], P1)
    run(llm)
    assert filed and filed[0] > 0
    assert llm.completions[rid0].token_ids == first[0] and llm.completions["next"].token_ids == want[0]
    assert llm.completions["next"].finish_reason == "length"
    assert sched.cache.hit_tokens == 0 and not sched.cache.pins
    assert_all_free(llm)


@pytest.mark.parametrize("pp", [1, 2])
def test_a_request_preempted_with_its_hit_before_its_first_chunk(ckpt, turns, pp):
    """Four long prompts, older, fill the token budget of the rounds after the second turn
    is admitted with its hit (two lanes at PP2: two of them in its lane); preempted then (as a short KV pool preempts the youngest
    request not in flight), it gives its pin and shared pages back, and readmitted it
    hits the same snapshot again and is counted once."""
    convs, first, second, want = turns
    others = [[(3 * i + 7 * k) % 250 + 1 for i in range(60)] for k in range(4)]
    ref = LLM(ckpt, chunk_size=CHUNK, max_batch_size=4, max_num_batched_tokens=32)
    want_others = [o.token_ids for o in ref.generate(others, P2)]
    llm = LLM(ckpt, pp_size=pp, speculative_algorithm="mtp", chunk_size=CHUNK, enable_prefix_caching=True,
              max_batch_size=4, max_num_batched_tokens=32)
    sched = llm.scheduler
    rid0 = llm.add_request(convs[0], P1)
    run(llm)
    rids = [llm.add_request(q, P2) for q in others]
    rid = llm.add_request(second[0], P2)
    req = sched.requests[rid]
    llm.step()
    # admitted with its hit, its first chunk not run: the others' chunks took the budget
    slot = req.restore_slot
    assert req.status == "running" and slot >= 0 and not req.in_flight and req.num_computed == len(second[0]) - 4
    assert sched.cache.pins == {slot: 1}
    hit = req.num_computed
    sched._preempt(req)
    assert req.restore_slot == -1 and not sched.cache.pins and req.status == WAITING
    run(llm)
    assert [llm.completions[r].token_ids for r in [rid0, *rids, rid]] == [first[0], *want_others, want[0]]
    assert sched.num_preemptions == 1 and req.cached_tokens == hit
    assert sched.cache.hit_tokens == hit and not sched.cache.pins
    assert_all_free(llm)


async def _conversations(engine, n, turns, seed, aborts=0.0):
    """``n`` multi-turn conversations at once through ``engine`` (half of them after a shared
    40-token system prompt), each turn the last one, its reply and a new message; a turn is
    aborted (and its conversation ends) with probability ``aborts``. Returns
    ``{(conversation, turn): tokens}``, ``"aborted"`` for the aborted turns."""
    import asyncio
    import random

    rnd = random.Random(seed)
    system = [rnd.randrange(3, 250) for _ in range(40)]
    out = {}

    async def conversation(k):
        r = random.Random(seed * 1000 + k)
        prompt = (system if k % 2 else []) + [r.randrange(3, 250) for _ in range(r.randrange(5, 80))]
        for t in range(turns):
            params = SamplingParams(temperature=0, max_tokens=r.randrange(1, 30), ignore_eos=True)
            abort_at = r.randrange(0, 6) if r.random() < aborts else None
            toks = []
            gen = engine.generate(f"c{k}t{t}", list(prompt), params)
            async for o in gen:
                toks += o.new_token_ids
                if abort_at is not None and len(toks) >= abort_at:
                    await engine.abort(f"c{k}t{t}")
                    await gen.aclose()
                    out[(k, t)] = "aborted"
                    return
            out[(k, t)] = toks
            prompt = prompt + toks + [r.randrange(3, 250) for _ in range(r.randrange(3, 30))]

    await asyncio.gather(*(conversation(k) for k in range(n)))
    return out


@pytest.mark.parametrize("pp,slots,kv_tokens,aborts", [(1, 4, 1024, 0.0), (2, 4, 640, 0.25), (1, 2, 1024, 0.0)])
def test_served_engine_at_concurrency_32_with_few_slots_and_a_short_pool(ckpt, pp, slots, kv_tokens, aborts):
    """The engine as ``ppspec serve`` runs it (async scheduling: a lane's next round sent
    before its last one's result; the stages' compute on the loop's thread, so that the
    interleaving is the same in every run) with 32 conversations at once, MTP, four (or
    two) snapshot slots and a KV pool that preempts: every turn gets the tokens of the same
    engine without the cache (no request fails), snapshots are hit, and a flush leaves
    nothing held. Whether a turn finds its conversation's snapshot while 32 others finish
    beside it depends on the interleaving at two slots (the 32 conversations' rows evict
    each other's: the lane a request joins, when a lane sends its next round, decide it);
    so after them a flush frees every slot (one pinned or leaked by the stress would stay)
    and a conversation run alone has its second turn hit the first's finished row, prompt
    and reply."""
    import asyncio

    from ppspec.router.engine import Engine
    from ppspec.router.pipeline import InProcessPipeline
    from ppspec.stage_server.snapshots import snapshot_nbytes

    per_slot = max(snapshot_nbytes(r.state) for r in InProcessPipeline.build(ckpt, pp, max_rows=2,
                                                                             kv_tokens=64).runners)

    async def serve(cache):
        pipe = InProcessPipeline.build(ckpt, pp, max_rows=64, kv_tokens=kv_tokens, num_speculative_steps=3,
                                       use_mtp=True, prefix_cache_gb=(slots + 0.5) * per_slot / 2**30 if cache else 0)
        pipe.inline = True
        engine = Engine(pipe, model_name="m", tokenizer=None, speculative_algorithm="mtp",
                        enable_prefix_caching=cache, max_num_batched_tokens=256, chunk_size=64)
        await engine.start()
        try:
            got = await asyncio.wait_for(_conversations(engine, 32, 3, seed=pp, aborts=aborts), 600)
            s = engine.scheduler
            while not engine.settled() or s.releasing_rows():
                await asyncio.sleep(0.01)
            hit_together = s.cache.hit_tokens if cache else 0
            if cache:  # every slot back (none pinned nor leaked by the stress): a flush frees them all
                await engine.flush_cache()
                assert s.cache.num_used == 0 and not s.cache.pins
            # one conversation alone, after the others: its second turn (the first's prompt,
            # reply and a new message) hits the first turn's finished row
            prompt, cached = [(13 * i + 5) % 240 + 3 for i in range(50)], []
            for t in range(2):
                toks = []
                async for o in engine.generate(f"alone{t}", list(prompt), SamplingParams(temperature=0, max_tokens=12,
                                                                                           ignore_eos=True)):
                    toks += o.new_token_ids
                    cached.append(o.num_cached_tokens)
                got[("alone", t)] = toks
                while not engine.settled() or s.releasing_rows():
                    await asyncio.sleep(0.01)
                prompt = prompt + toks + [7, 8, 9]
            held = None
            if cache:
                assert s.cache.num_slots == slots
                figures = (s.num_preemptions, hit_together, cached[-1])
                await engine.flush_cache()
                held = (s.kv_reserved, len(s.free_rows), s.cache.num_used, dict(s.cache.pins), figures,
                        [(len(r.rows_in_use), r.kv.used_pages if r.kv else 0, r.mtp_kv.used_pages if r.mtp_kv else 0,
                          r.snapshots.used) for r in pipe.runners])
            return got, held
        finally:
            await engine.close()

    want, _ = asyncio.run(serve(False))
    got, (kv, free, used, pins, (preempted, hit, alone), stages) = asyncio.run(serve(True))
    assert got == want
    assert preempted > 0 and (hit > 0 or slots < 4)
    assert alone == 50 + 12 - 1  # the first turn's prompt and reply but its last token
    assert (kv, free, used, pins) == (0, 64, 0, {}) and stages == [(0, 0, 0, 0)] * pp
