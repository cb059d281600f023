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
  hits again, counted once.
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
