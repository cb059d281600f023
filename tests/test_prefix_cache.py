"""Prefix caching (``router.prefix_cache``, ``stage_server.snapshots``): greedy tokens with
the cache are those without it, and those of PP1 without speculation, in multi-turn and
shared-prefix workloads of concurrent requests: hits in the middle of a prompt (a
prefill chunk's snapshot), hits on a finished conversation (its release's snapshot, taken
after the last verify's commit), eviction under a small snapshot budget, preemption under
a short KV pool. Restoring the wrong slot, or snapshotting before the commit, is caught.
After the requests end and the cache is flushed, every stage holds no row, page or
snapshot.
"""
from __future__ import annotations

import random

import pytest
import torch

from ppspec.router.llm import DEMO_MODEL, LLM
from ppspec.router.prefix_cache import PrefixCache
from ppspec.router.types import SamplingParams
from ppspec.stage_server.runner import StageRunner
from ppspec.stage_server.snapshots import FAULT_SNAPSHOT_BEFORE_COMMIT, FAULT_SNAPSHOT_WRONG_SLOT

CKPT = "qwen3_5_ratio2_7l"
CHUNK = 16  # prefill chunk: snapshots every 16 tokens of a prompt
TURNS = 3


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def conversations(n=4, seed=0):
    """``n`` conversations sharing a 45-token system prompt, each with its own first message."""
    rnd = random.Random(seed)
    system = [rnd.randrange(256) for _ in range(45)]
    return [system + [rnd.randrange(256) for _ in range(3 + 2 * i)] for i in range(n)]


def step(llm):
    """One round; the router's KV charge is never below what a stage's pool holds (each
    page charged once, whoever holds it: router/kv_ledger.py)."""
    llm.step()
    sched = llm.scheduler
    for r in llm.pipeline.runners:
        for pool in (r.kv, r.mtp_kv):
            if pool is not None:
                assert pool.used_pages * pool.page_size <= sched.kv_reserved <= sched.kv_tokens


def multi_turn(llm, convs, turns=TURNS, max_tokens=6):
    """Every conversation's turns, all conversations concurrently; the next turn's prompt is
    the last one, its reply and a new message. Returns per turn the replies and the
    requests' cached prompt tokens."""
    replies, cached = [], []
    for t in range(turns):
        p = SamplingParams(temperature=0, max_tokens=max_tokens + 3 * t, ignore_eos=True)
        rids, reqs = [], []
        for i, c in enumerate(convs):
            rids.append(llm.add_request(c, p, request_id=f"t{t}c{i}"))
            reqs.append(llm.scheduler.requests[rids[-1]])
            if t == 0 and i == 0:  # the others join once its prompt's chunks are cached
                for _ in range(4):
                    step(llm)
        while llm.has_unfinished():
            step(llm)
        outs = [llm.completions.pop(r).token_ids for r in rids]
        replies.append(outs)
        cached.append([r.cached_tokens for r in reqs])
        convs = [c + o + [11 + t, 12, 13 + i] for i, (c, o) in enumerate(zip(convs, outs))]
    return replies, cached


def assert_all_free(llm):
    """Flush the cache: no stage holds a row, a KV page or a snapshot, nor the router a charge."""
    llm.flush_cache()
    sched = llm.scheduler
    assert sched.kv_reserved == 0 and len(sched.free_rows) == sched.max_rows
    assert sched.cache.num_used == 0
    for r in llm.pipeline.runners:
        assert not r.rows_in_use
        for pool in (r.kv, r.mtp_kv):
            if pool is not None:
                assert pool.used_pages == 0 and not any(pool.refs)
        assert r.snapshots.used == 0


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt(CKPT)


@pytest.fixture(scope="module")
def reference(ckpt):
    """PP1, no speculation, no cache."""
    torch.set_num_threads(1)
    return multi_turn(LLM(ckpt, chunk_size=CHUNK), conversations())[0]


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
@pytest.mark.parametrize("spec", ["none", "ngram", "mtp"])
def test_multi_turn_with_cache_matches_pp1_without(ckpt, reference, spec, pp):
    llm = LLM(ckpt, pp_size=pp, speculative_algorithm=spec, chunk_size=CHUNK, enable_prefix_caching=True)
    replies, cached = multi_turn(llm, conversations())
    assert replies == reference
    # turn 1: the shared system prompt's chunk snapshots (16, 32 tokens) of whichever request
    # prefilled it first serve the others, mid-prompt; the second request to leave the first
    # one's sequence at the system prompt's end (44) ends a chunk there, the third waits for
    # its snapshot and hits it; later turns hit the whole previous turn (prompt and reply),
    # the finished request's snapshot: all but its last token
    assert cached[0] == [0, 32, 32, 44]
    convs = conversations()
    for t in range(1, TURNS):
        prev = [c + r for c, r in zip(convs, replies[t - 1])]
        assert cached[t] == [len(p) - 1 for p in prev]
        convs = [p + [11 + t - 1, 12, 13 + i] for i, p in enumerate(prev)]
    assert_all_free(llm)


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_replay_design_and_lanes_match(ckpt, reference, spec):
    """The replay commit design (pending steps applied before a finished row's snapshot),
    two micro-batches in flight."""
    llm = LLM(ckpt, pp_size=2, num_micro_batches=2, speculative_algorithm=spec, chunk_size=CHUNK,
              commit_design="replay", enable_prefix_caching=True)
    assert multi_turn(llm, conversations())[0] == reference
    assert llm.scheduler.cache.hit_tokens > 0
    assert_all_free(llm)


def test_demo_checkpoint_matches():
    convs = conversations(3, seed=1)
    ref = multi_turn(LLM(DEMO_MODEL, chunk_size=CHUNK), convs, turns=2)[0]
    for spec, pp in (("mtp", 2), ("none", 3)):
        llm = LLM(DEMO_MODEL, pp_size=pp, speculative_algorithm=spec, chunk_size=CHUNK, enable_prefix_caching=True)
        replies, cached = multi_turn(llm, convs, turns=2)
        assert replies == ref
        assert min(cached[1]) > 0
        assert_all_free(llm)


def _slot_gb(ckpt) -> float:
    r = StageRunner(ckpt, max_rows=2, kv_tokens=64)
    from ppspec.stage_server.snapshots import snapshot_nbytes

    return snapshot_nbytes(r.state) / 2**30


def test_eviction_under_a_small_snapshot_budget(ckpt):
    """Three snapshot slots for three conversations, each leaving chunk snapshots and a
    finished one per turn: snapshots are evicted (superseded ones first, then least
    recently used, never one a micro-batch restores from), later turns still hit, and the
    tokens stay the same."""
    convs = conversations(3)
    reference = multi_turn(LLM(ckpt, chunk_size=CHUNK), convs)[0]
    llm = LLM(ckpt, speculative_algorithm="mtp", chunk_size=CHUNK, enable_prefix_caching=True,
              prefix_cache_gb=3.5 * _slot_gb(ckpt))
    assert llm.scheduler.cache.num_slots == 3
    dropped = []
    orig = llm.scheduler.slots_dropped
    llm.scheduler.slots_dropped = lambda slots: (dropped.extend(slots), orig(slots))
    replies, cached = multi_turn(llm, convs)
    assert replies == reference
    assert dropped and any(c > 0 for turn in cached[1:] for c in turn)
    assert_all_free(llm)


def test_budget_too_small_for_one_snapshot_is_refused(ckpt):
    gb = _slot_gb(ckpt)
    with pytest.raises(ValueError, match=r"holds no snapshot: one takes \d+ bytes") as e:
        StageRunner(ckpt, max_rows=2, kv_tokens=64, prefix_cache_gb=gb / 2)
    assert str(int(gb / 2 * 2**30)) in str(e.value)


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_short_kv_pool_preempts_and_evicts(ckpt, spec):
    """Six conversations on a KV pool of 12 pages: requests are preempted (and readmitted
    from the cache), snapshots evicted for KV room before any request is preempted."""
    convs = conversations(6)
    ref = multi_turn(LLM(ckpt, chunk_size=CHUNK), convs, turns=2, max_tokens=24)[0]
    llm = LLM(ckpt, speculative_algorithm=spec, chunk_size=CHUNK, enable_prefix_caching=True, kv_tokens=192)
    replies, _ = multi_turn(llm, convs, turns=2, max_tokens=24)
    assert replies == ref
    assert llm.scheduler.num_preemptions > 0 and llm.scheduler.cache.hit_tokens > 0
    assert_all_free(llm)


@pytest.mark.parametrize("fault", [FAULT_SNAPSHOT_WRONG_SLOT, FAULT_SNAPSHOT_BEFORE_COMMIT])
@pytest.mark.parametrize("design", ["copy", "replay"])
def test_cache_tests_catch_snapshot_bugs(ckpt, reference, fault, design):
    """The same workload with a stage restoring another slot's state, or snapshotting a
    finished row without its last verify's commit, gives other tokens."""
    llm = LLM(ckpt, speculative_algorithm="mtp", chunk_size=CHUNK, enable_prefix_caching=True, fault=fault,
              commit_design=design)
    replies, _ = multi_turn(llm, conversations())
    assert replies[0] == reference[0] or fault == FAULT_SNAPSHOT_WRONG_SLOT
    assert replies != reference


def test_radix_tree_lookup_split_and_lru():
    c = PrefixCache(3, page_size=4)
    a = c.reserve(5, "a")
    c.commit(a, [1, 2, 3, 4, 5, 6])
    b = c.reserve(3, "b")
    c.commit(b, [1, 2, 3, 9])  # splits the edge after [1, 2, 3]
    assert c.lookup([1, 2, 3, 4, 5, 6, 7]) == (a, 5)
    assert c.lookup([1, 2, 3, 4, 5, 6]) == (a, 5)
    assert c.lookup([1, 2, 3, 4, 5]) == (-1, 0)  # token 5 must match too (the MTP head's KV)
    assert c.lookup([1, 2, 3, 9, 9]) == (b, 3)
    assert c.lookup([2]) == (-1, 0)
    c.use(a)  # pinned: never evicted
    assert c.evict(100) == 4 and c.take_drops() == [b]
    assert c.lookup([1, 2, 3, 9]) == (-1, 0) and c.lookup([1, 2, 3, 4, 5, 6]) == (a, 5)
    assert c.evict(100) == 0
    c.done(a)
    assert c.evict(1) == 8 and c.take_drops() == [a]
    assert c.dropped([a, b]) == 12 and c.num_used == 0 and not c.root.children


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_shared_prefix_hits_where_requests_branch(ckpt, spec):
    """Requests one after another sharing a 45-token system prompt (not a multiple of the
    chunk): the second hits the first one's chunk snapshot (32 tokens) and leaves the first
    one's sequence at 44 (the shared tokens but the last), a branch seen first: no split; the
    third branches there again and ends a chunk there, so the fourth hits 44."""
    convs = conversations(4, seed=2)
    p = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    ref = [o.token_ids for o in LLM(ckpt, chunk_size=CHUNK).generate(convs, p)]
    llm = LLM(ckpt, speculative_algorithm=spec, chunk_size=CHUNK, enable_prefix_caching=True)
    got, cached = [], []
    for c in convs:
        rid = llm.add_request(c, p)
        req = llm.scheduler.requests[rid]
        while llm.has_unfinished():
            llm.step()
        got.append(llm.completions.pop(rid).token_ids)
        cached.append(req.cached_tokens)
    assert got == ref
    assert cached == [0, 32, 32, 44]
    assert_all_free(llm)


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_next_turn_hits_the_prompt_end_where_the_reply_changed(ckpt, spec):
    """A next turn whose copy of the reply differs from the ids generated after its second
    token (a reply that re-tokenizes differently) hits the previous prompt's end, snapshotted
    after the chunk that ended it (filed with the token sampled there; with MTP the head's KV
    at the prompt's last position was computed with it), and gets the uncached tokens."""
    convs = conversations(2, seed=3)
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(ckpt, pp_size=2, speculative_algorithm=spec, chunk_size=CHUNK, enable_prefix_caching=True)
    first = [o.token_ids for o in llm.generate(convs, p)]
    turn2 = [c + o[:2] + [250, 251, 252 + i] for i, (c, o) in enumerate(zip(convs, first))]
    rids = [llm.add_request(t, p) for t in turn2]
    reqs = [llm.scheduler.requests[r] for r in rids]
    while llm.has_unfinished():
        llm.step()
    got = [llm.completions.pop(r).token_ids for r in rids]
    ref = LLM(ckpt, chunk_size=CHUNK)
    assert got == [o.token_ids for o in ref.generate(turn2, p)]
    assert [r.cached_tokens for r in reqs] == [len(c) for c in convs]
    assert_all_free(llm)



def test_two_snapshot_slots_for_four_conversations(ckpt, reference):
    """Four conversations at once on two snapshot slots, MTP: the chunk snapshots inside
    prompts (the prompt's end supersedes them) and the prompts' ends (the finished row's
    supersedes them) give way to the finished rows' snapshots (PrefixCache._order), so
    that each later turn has a conversation hitting its whole previous turn; the tokens
    are those of PP1 without the cache."""
    llm = LLM(ckpt, speculative_algorithm="mtp", chunk_size=CHUNK, enable_prefix_caching=True,
              prefix_cache_gb=2.5 * _slot_gb(ckpt))
    assert llm.scheduler.cache.num_slots == 2
    replies, cached = multi_turn(llm, conversations())
    assert replies == reference
    convs = conversations()
    for t in range(1, TURNS):
        prev = [c + r for c, r in zip(convs, replies[t - 1])]
        assert any(got == len(p) - 1 for got, p in zip(cached[t], prev))
        convs = [p + [11 + t - 1, 12, 13 + i] for i, p in enumerate(prev)]
    assert_all_free(llm)
