"""A request's path to its first token (router/first_tokens.py): the scheduler's and the
engine's stamps under an injected clock, and the summary the prefix bench prints."""
import asyncio
import itertools
import statistics

import pytest
import torch

from ppspec.router import engine as engine_mod
from ppspec.router import scheduler as sched_mod
from ppspec.router.first_tokens import FIELDS, FirstTokens, format_summary, summarize
from ppspec.router.scheduler import Scheduler
from ppspec.router.types import SamplingParams


class _Clock:
    """``time.monotonic`` stand-in: each call one second later."""

    def __init__(self):
        self.t = itertools.count(1)

    def monotonic(self):
        return float(next(self.t))


def test_the_stamps_of_admission_formation_and_chunks(monkeypatch):
    """Queued at 1, admitted at 2 (the schedule that forms its first chunk), formed at 3;
    a 10-token prompt in chunks of 4 is in 3 micro-batches until its first token."""
    clock = _Clock()
    monkeypatch.setattr(sched_mod, "time", clock)
    s = Scheduler(max_rows=4, kv_tokens=1024, max_context=256, max_num_batched_tokens=4, max_batch_size=4)
    r = s.add("a", list(range(1, 11)), SamplingParams(temperature=0.0, max_tokens=3))
    assert r.arrival_time == 1.0
    b = s.schedule(0)
    assert (r.admitted_at, r.formed_at) == (2.0, 3.0)
    seen = []
    while not r.output_ids:
        seen.append(b.extend_lens[0])
        s.process(b, [[7] if b.sample[0] else []])
        b = s.schedule(0)
    assert seen == [4, 4, 2] and r.prefill_batches == 3
    assert r.formed_at == 3.0  # the first micro-batch's, not a later chunk's


def test_first_tokens_rows_and_summary():
    """Rows as recorded, the rows since a mark, and each segment's mean and median."""
    ft = FirstTokens(maxlen=3)

    class R:
        prompt_ids = [1] * 20
        lane, sent_behind = 1, 2

    stamps = [(0.0, 0.010, 0.030, 0.031, 0.131, 1, 16), (1.0, 1.002, 1.004, 1.005, 1.045, 2, 0),
              (2.0, 2.030, 2.050, 2.050, 2.100, 1, 16), (3.0, 3.001, 3.002, 3.003, 3.023, 1, 16)]
    for arr, adm, frm, snt, back, n, cached in stamps:
        r = R()
        r.arrival_time, r.admitted_at, r.formed_at, r.sent_at = arr, adm, frm, snt
        r.prefill_batches, r.cached_tokens = n, cached
        ft.record(r, back)
    got = ft.rows()
    assert got["total"] == 4 and [x[0] for x in got["rows"]] == [1, 2, 3]  # the first dropped: maxlen 3
    assert [x[0] for x in ft.rows(since=3)["rows"]] == [3]
    rows = got["rows"]
    assert rows[0] == [1, 1.0, 1.002, 1.004, 1.005, 1.045, 2, 0, 20, 1, 2] and got["fields"] == list(FIELDS)
    s = summarize(rows)
    ms = lambda a, b: [1e3 * (x[b] - x[a]) for x in rows]  # noqa: E731
    for seg, (a, b) in zip(("queued", "admitted", "formed", "sent", "ttft"), ((1, 2), (2, 3), (3, 4), (4, 5), (1, 5))):
        assert s[seg] == pytest.approx((statistics.fmean(ms(a, b)), statistics.median(ms(a, b))))
    assert s["queued"] == pytest.approx((11.0, 2.0)) and s["ttft"] == pytest.approx((56.0, 45.0))
    assert s["n"] == 3 and s["batches"] == pytest.approx((4 / 3, 1)) and s["ahead"] == (2, 2)
    assert "3 requests" in format_summary(s, "x") and summarize([]) == {"n": 0}


def test_the_engine_records_each_request_once(make_ckpt, monkeypatch):
    """The served engine (PP1, MTP off, chunks of 8): one row per request, in the order of
    its stamps, with the micro-batches its prompt took; the row a prompt of 20 tokens leaves
    says 3, one of 5 tokens 1; nothing recorded twice over the rounds that follow."""
    from ppspec.router.pipeline import InProcessPipeline

    torch.set_num_threads(1)
    path = make_ckpt("qwen3_5_ratio2_7l")
    pipe = InProcessPipeline.build(path, 1, max_rows=8, kv_tokens=4096)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    prompts = {"long": list(range(3, 23)), "short": [5, 9, 2, 7, 4]}

    async def run():
        engine = engine_mod.Engine(pipe, model_name="t", tokenizer=None, max_num_batched_tokens=16, chunk_size=8,
                                   max_batch_size=4)
        await engine.start()
        try:
            async def one(rid, p):
                async for _ in engine.generate(rid, p, params):
                    pass
            await asyncio.gather(*(one(k, p) for k, p in prompts.items()))
            return await engine.first_token_rows()
        finally:
            await engine.close()

    got = asyncio.run(run())
    assert got["total"] == 2
    ix = {f: i for i, f in enumerate(got["fields"])}
    by_len = {x[ix["prompt_tokens"]]: x for x in got["rows"]}
    assert sorted(by_len) == [5, 20]
    assert by_len[20][ix["batches"]] == 3 and by_len[5][ix["batches"]] == 1
    for x in got["rows"]:
        t = [x[ix[k]] for k in ("arrival", "admitted", "formed", "sent", "back")]
        assert t == sorted(t) and t[0] > 0 and x[ix["cached_tokens"]] == 0
        assert x[ix["ahead"]] in (0, 1)  # one lane (PP1 without speculation), at most its one other micro-batch
