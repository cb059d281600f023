"""Where the prefix cache takes snapshots and makes requests wait (``router.scheduler``),
the scheduler alone, driven with made-up step results (no model: tokens do not matter
here, the micro-batches and the counters do; greedy tokens with these rules are checked
against the uncached ones in tests/test_prefix_cache*.py):

- a conversation's next turn whose reply did not re-tokenize to the ids generated still
  hits the whole previous prompt (the snapshot at a prompt's end) and prefills in one
  micro-batch (no chunk split where it leaves the reply: a branch seen first);
- requests sharing a system prompt: the second to leave a cached sequence at the same
  point ends a chunk there, the ones after it wait for that snapshot instead of each
  prefilling the system prompt again;
- a request waiting for a snapshot under way does not hold back the requests behind it;
- the hit counter counts each request once, as its ``cached_tokens``, also when it was
  preempted before its first micro-batch.
"""
from __future__ import annotations

from ppspec.router.prefix_cache import PrefixCache
from ppspec.router.scheduler import Scheduler
from ppspec.router.types import SamplingParams


def make(kv_tokens=4096, chunk=64, page=4, lanes=1, slots=16):
    return Scheduler(max_rows=8, kv_tokens=kv_tokens, max_context=2048, page_size=page, num_lanes=lanes,
                     max_batch_size=4, max_num_batched_tokens=chunk, chunk_size=chunk,
                     prefix_cache=PrefixCache(slots, page))


class Driver:
    """Runs micro-batches of lane 0 one at a time, every request sampling token 7 after its
    prompt, releases (with their snapshots) and drops done at once. Records each batch."""

    def __init__(self, sched: Scheduler):
        self.s, self.batches, self.releasing = sched, [], []

    def round(self) -> bool:
        s = self.s
        batch = s.schedule(0)
        self.release(s.take_preempted())
        if batch is None:
            return False
        self.batches.append(batch)
        out = [[7] if sample else [] for sample in batch.sample]
        up = s.process(batch, out)
        self.releasing += up.release_rows
        return True

    def release(self, rows):
        s = self.s
        s.release_snapshots(rows)
        s.free(rows)
        s.slots_dropped(s.take_dropped_slots())

    def finish_releases(self):
        rows, self.releasing = self.releasing, []
        self.release(rows)

    def run(self):
        while self.s.has_work():
            if not self.round():
                self.finish_releases()
        self.finish_releases()

    def chunks(self, rid: str) -> list[tuple[int, int]]:
        """(seq_len, extend_len) of each prefill chunk of request ``rid``."""
        return [(b.seq_lens[i], b.extend_lens[i]) for b in self.batches for i in range(b.first_chunk, len(b.requests))
                if b.requests[i].request_id == rid]


P = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
P1 = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def test_next_turn_whose_reply_retokenized_differently_hits_the_prompt_in_one_chunk():
    s = make()
    d = Driver(s)
    prompt = list(range(100, 140))
    s.add("t1", prompt, P)
    d.run()
    reply = [7, 7, 7, 7]
    # the reply came back as other ids past its second token (the client's text re-tokenized)
    turn2 = prompt + reply[:2] + list(range(300, 330))
    r2 = s.add("t2", turn2, P)
    d.run()
    assert r2.cached_tokens == len(prompt)  # the prompt's end, filed with the token sampled there
    assert d.chunks("t2") == [(len(prompt), len(turn2) - len(prompt))]  # one micro-batch, no split
    assert s.cache.hit_tokens == len(prompt) and s.cache.queried_tokens == len(prompt) + len(turn2)


def test_shared_system_prompt_burst_prefills_it_once_more():
    s = make(chunk=512)
    d = Driver(s)
    system = list(range(1000, 1200))
    s.add("first", system + [1, 2, 3], P)  # the deployment's first request caches it
    d.run()
    burst = [s.add(f"b{i}", system + [10 + i] * 12, P) for i in range(4)]
    d.run()
    # b0 leaves first's sequence at the system prompt's end (199: the shared tokens but the
    # last) first: no split; b1 leaves it there again and ends a chunk there; b2, b3 wait
    # for that snapshot rather than prefill the system prompt themselves
    assert [r.cached_tokens for r in burst] == [0, 0, 199, 199]
    assert d.chunks("b0") == [(0, 212)] and d.chunks("b1") == [(0, 199), (199, 13)]
    assert d.chunks("b2") == [(199, 13)] and d.chunks("b3") == [(199, 13)]
    assert sum(e for r in burst for _, e in d.chunks(r.request_id)) == 212 + 212 + 2 * 13  # 4 x 212 before
    assert s.cache.hit_tokens == sum(r.cached_tokens for r in burst)


def test_a_request_waiting_for_a_release_does_not_hold_back_the_others():
    s = make()
    d = Driver(s)
    prompt = list(range(100, 140))
    s.add("t1", prompt, P)
    while not d.releasing:  # t1 ends; its release (which snapshots prompt and reply) under way
        assert d.round()
    turn2 = s.add("t2", prompt + [7] * 4 + [50, 51, 52], P)  # waits for that snapshot
    other = s.add("other", list(range(500, 520)), P)
    assert d.round()
    assert other.row >= 0 and turn2.row < 0
    d.finish_releases()  # the release took the snapshot on every stage
    d.run()
    assert turn2.cached_tokens == len(prompt) + 3


def test_hits_counted_once_when_preempted_before_the_first_micro_batch():
    # pages of 4 tokens, chunks of 16, a pool of 52 tokens: b is admitted from a's chunk
    # snapshot (16 tokens), then a's next chunk needs four pages more than the headroom kept,
    # so the scheduler preempts b (the youngest, not in flight) before b ever ran
    s = make(kv_tokens=52, chunk=16)
    d = Driver(s)
    a_prompt = list(range(100, 148))
    s.add("a", a_prompt, P1)
    assert d.round()
    b = s.add("b", a_prompt[:17] + list(range(300, 315)), P1)
    d.run()
    assert b.num_preemptions == 1 and b.cached_tokens == 16
    assert s.cache.hit_tokens == b.cached_tokens  # 32 before: counted at each admission
    assert s.cache.queried_tokens == len(a_prompt) + len(b.prompt_ids)


def test_eviction_drops_snapshots_that_free_pages_only_together():
    # a prompt's end (10 tokens) and its short reply's end (11 tokens) in the same three pages
    # of 4: neither drop alone gives a page back, both together give three
    s = make(page=4)
    d = Driver(s)
    s.add("a", list(range(100, 110)), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    d.run()
    c = s.cache
    assert c.num_cached == 2 and s.kv_reserved == 12
    assert c.evict(4, plan=s._drop_plan()) == 12 and sorted(c.take_drops()) == sorted(c.lens)


def test_a_result_back_after_a_failure_files_no_snapshot_of_the_failed_request():
    """A stage failure ends every request (``fail_all``): a snapshot a micro-batch in flight
    was taking is abandoned (dropped on every stage). That micro-batch's result may still
    come back afterwards (the failure was another call's): it must not file the slot, which
    would then be both cached and dropped (freed while the tree still names it); nor, once
    the recovery forgot every slot (``clear_cache``) and the slot went to a new request's
    micro-batch, file that request's slot under the failed one's tokens."""
    prompt = list(range(100, 200))
    for recovered in (False, True):
        s = make()
        s.add("a", prompt, P)
        batch = s.schedule(0)
        slot = batch.snapshot_slots[0]
        assert slot >= 0 and batch.extend_lens == [64]  # a chunk inside the prompt: snapshotted after it
        _, rows = s.fail_all()
        assert s.cache.to_drop == [slot] and s.cache.taking == {} and rows == batch.rows
        if recovered:  # the recovery ran before the result came back; a new request took the slot
            s.take_dropped_slots()
            s.clear_cache()
            s.free(rows)
            s.add("b", list(range(300, 400)), P)
            again = s.schedule(0)
            assert again.snapshot_slots == [slot] and s.cache.taking == {slot: "b"}
        s.process(batch, [[]])  # the failed request's chunk, back
        assert slot not in s.cache.nodes and s.cache.lookup(prompt) == (-1, 0)
        if recovered:
            assert s.cache.taking == {slot: "b"} and s.cache.to_drop == []
            s.process(again, [[]])  # "b"'s own result files it, under b's tokens
            assert s.cache.lookup(list(range(300, 400))) == (slot, 64)
        else:
            assert s.cache.to_drop == [slot]
            s.slots_dropped(s.take_dropped_slots())
            s.free(rows)  # the recovery's release of every row
            assert s.cache.free.count(slot) == 1 and s.cache.num_used == 0 and s.kv_reserved == 0


def test_a_tight_slot_budget_keeps_the_release_snapshot_over_chunk_snapshots():
    """Two snapshot slots. A conversation's first turn leaves its prompt's end and its
    finished row's snapshot (which supersedes the prompt's end); then a long prompt runs in
    chunks of 16, each chunk inside it wanting a snapshot. Its chunks may take only the
    superseded prompt's end, never the conversation's last snapshot: the next turn, arriving
    while the long one still decodes, hits the whole first turn. (Plain LRU: the chunks'
    snapshots push out both, and the next turn hits nothing.)"""
    s = make(chunk=16, slots=2)
    d = Driver(s)
    prompt = list(range(100, 112))
    s.add("a1", prompt, P)
    d.run()
    c = s.cache
    assert c.num_cached == 2  # the prompt's end (12 tokens) and the finished row (15)
    long = s.add("b", list(range(500, 600)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    while long.num_computed < len(long.prompt_ids):
        assert d.round()
    a2 = s.add("a2", prompt + [7] * 4 + list(range(300, 320)), P)
    d.run()
    assert a2.cached_tokens == len(prompt) + 3  # the first turn's prompt and reply, but its last token
    # the long prompt's six chunks inside it got one slot: the one the prompt's end gave up
    assert sum(1 for b in d.batches for i, sl in enumerate(b.snapshot_slots)
               if b.requests[i] is long and sl >= 0) == 1
    assert c.hit_tokens == a2.cached_tokens
    s.flush_cache()
    s.slots_dropped(s.take_dropped_slots())
    assert c.num_used == 0 and not c.pins and not c.taking and s.kv_reserved == 0
    assert sorted(c.free) == [0, 1] and len(s.free_rows) == s.max_rows


def test_eviction_order_superseded_snapshots_first_then_least_recently_used():
    """PrefixCache alone: a snapshot with a deeper one below it on its path that no request
    restored from goes first; a leaf, or one restored from, only after those, least recently
    used first; a new snapshot that is superseded itself evicts only the former, and takes
    no slot evicted for one that is not."""
    c = PrefixCache(5)

    def take(key):
        slot = c.reserve(len(key) - 1, "r")
        c.commit(slot, key)
        return slot

    leaf_old = take([9, 9, 9])
    mid, deep = take([1, 2, 3]), take([1, 2, 3, 4, 5])  # deep supersedes mid
    hit = take([5, 6, 7])
    c.use(hit)
    c.done(hit)
    below = take([5, 6, 7, 8, 9])  # supersedes hit, which a request restored from
    assert not c.free
    assert sorted(c.nodes, key=c._order) == [mid, leaf_old, deep, hit, below]
    assert c.evict_one(superseded=True) and c.take_drops() == [mid]
    assert not c.evict_one(superseded=True) and c.take_drops() == []
    assert c.evict_one() and c.take_drops() == [leaf_old] and c.owed == 1
    assert c.lookup([1, 2, 3, 4, 5, 6]) == (deep, 4) and c.lookup([1, 2, 3, 7]) == (-1, 0)
    c.dropped([mid, leaf_old])
    assert c.reserve(4, "x", superseded=True) >= 0  # two free, one owed to a snapshot not superseded
    assert c.reserve(4, "y", superseded=True) == -1
    assert c.reserve(4, "z") >= 0 and c.owed == 0


def test_a_burst_behind_a_full_cache_is_admitted_after_one_round_of_drops():
    # finished requests' snapshots fill the pool but for one prompt's pages; then four prompts
    # arrive at once. Evicting only what the head of the queue lacked when it lacked it, each
    # waited for drops of its own (a Release on every stage, then a round) one after the
    # other; the scheduler evicts for every prompt it has rows for at once
    s = make(kv_tokens=320, page=4)
    d = Driver(s)
    for i in range(6):
        s.add(f"old{i}", list(range(100 * (i + 1), 100 * (i + 1) + 40)), P)
    d.run()
    burst = [s.add(f"b{i}", list(range(5000 + 100 * i, 5040 + 100 * i)), P) for i in range(4)]
    need = s._kv_need(burst[0], 40)
    assert need <= s.kv_tokens - s.kv_reserved < 2 * need  # room for one of them, no more
    assert d.round()  # the first prefills; the drops of what was evicted finish with the round
    assert d.round()
    assert all(r.row >= 0 for r in burst)
    d.run()
    assert [r.output_ids for r in burst] == [[7] * 4] * 4


def test_no_snapshot_is_evicted_for_a_prompt_that_must_wait_for_running_requests_anyway():
    # a: 200 tokens decoding in a pool of 320; b, as long, fits only once a ends, with the
    # cache or without it: evicting for b would lose the cached prefix and admit nothing
    s = make(kv_tokens=320, page=4, chunk=512)
    d = Driver(s)
    s.add("old", list(range(100, 120)), P)
    d.run()
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a = s.add("a", list(range(1000, 1200)), long)
    assert d.round()
    cached = s.cache.num_cached  # old's prompt and reply, a's prompt
    assert cached == 3
    b = s.add("b", list(range(3000, 3200)), long)
    for _ in range(3):
        assert d.round()
    assert a.row >= 0 and b.row < 0
    assert s.cache.num_cached == cached and not s.cache.to_drop
    d.run()
    assert len(b.output_ids) == 40


def test_a_snapshot_passed_over_as_covered_is_one_whose_drop_gives_nothing():
    """:meth:`PrefixCache.evict` passes over a superseded snapshot without counting its pages
    when a deeper snapshot below it holds every one of them (``_covered``): over finished
    conversations of several turns, some sharing a prefix and some restored from, every
    snapshot so passed over gives nothing back alone, and the superseded snapshots of a
    finished row's prompt are passed over (the case it exists for). Eviction then frees as
    much as it asked for and empties the pool."""
    import random

    rng = random.Random(0)
    s = make(kv_tokens=8192, page=4, slots=64)
    d = Driver(s)
    system = list(range(900, 930))
    for i in range(24):
        # prompts that extend an earlier one by its sampled 7 and more, some arriving beside it
        # (computed from their own pages: a snapshot with another row's below it) and some
        # after it (restored from it)
        base = system + [7] * (i % 4) if i % 3 else []
        prompt = base + [rng.randrange(1000, 2000) for _ in range(rng.randrange(0 if base else 5, 12))]
        s.add(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=rng.randrange(1, 4), ignore_eos=True))
        if i % 5 == 4:
            d.run()
    d.run()
    c, plan = s.cache, s._drop_plan()
    covered = [x for x in c.nodes if c._covered(x, plan, [])]
    assert covered  # prompt ends superseded by their rows' finished snapshots
    for x in c.nodes:
        if x in covered:
            assert plan.gain(x) == 0, x
    want = s.kv_reserved
    assert c.evict(want, plan=plan) == want and not c.nodes



def test_a_snapshot_below_from_another_row_does_not_cover_one():
    """``_covered`` on pages made by hand: a prompt's end with a deeper snapshot of the same row
    below it is covered (its pages are the deeper one's first), unless that one is evicted in
    the same pass; one whose snapshot below is another row's (a request that computed the same
    prefix beside it, not restored from it) holds pages of its own, is not covered, and its
    drop gives them back."""
    from ppspec.router.kv_ledger import Letting, PageLedger
    from ppspec.router.scheduler import _SlotDrops

    prefix = list(range(100, 110))

    def pool():
        c, kv = PrefixCache(8, 4), PageLedger(4)
        kv.grow(("row", 0), 16)
        kv.grow(("row", 1), 16)

        def take(row, key):
            slot = c.reserve(len(key) - 1, f"r{row}")
            kv.take(("slot", slot), ("row", row), len(key) - 1)
            c.commit(slot, key)
            return slot

        return c, kv, take

    c, kv, take = pool()
    end, deeper = take(0, prefix + [7]), take(0, prefix + [7, 8, 9, 10])  # one row's prompt end, then more
    kv.release(("row", 0))
    plan = _SlotDrops(Letting(kv))
    assert c._covered(end, plan, []) and plan.gain(end) == 0
    assert not c._covered(end, plan, [deeper])  # the one below goes in this pass
    assert not c._covered(deeper, plan, [])  # a leaf

    c, kv, take = pool()
    end, theirs = take(0, prefix + [7]), take(1, prefix + [7, 8, 9, 10])  # row 1 computed it itself
    kv.release(("row", 0))
    kv.release(("row", 1))
    plan = _SlotDrops(Letting(kv))
    assert not c._covered(end, plan, []) and plan.gain(end) == 12  # its three pages, its own
    assert c.evict(4, plan=plan) == 12 and c.take_drops() == [end]
