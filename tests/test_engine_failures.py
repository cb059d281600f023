"""The async engine and ``LLM`` when a stage refuses one micro-batch: only that micro-batch's requests
fail; the others finish with the tokens of PP1 without speculation, every row comes back on
every stage, and the engine keeps serving (no full recovery)."""
from __future__ import annotations

import asyncio

import pytest
import torch

from ppspec.router.engine import Engine
from ppspec.router.llm import DEMO_MODEL, LLM
from ppspec.router.pipeline import InProcessPipeline
from ppspec.router.types import EngineError, SamplingParams, StageDownError

PROMPTS = [[1 + (7 * i + j) % 200 for j in range(6 + i)] for i in range(6)]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def _pp2_mtp(pipeline=InProcessPipeline, **kw):
    """The pipeline these tests break: the demo checkpoint over two in-process stages with
    MTP drafts (3), 8 rows and 4096 KV tokens unless ``kw`` says otherwise; ``pipeline``: the
    class (a subclass that changes how commits travel)."""
    return pipeline.build(DEMO_MODEL, 2, **{**dict(max_rows=8, kv_tokens=4096, num_speculative_steps=3, use_mtp=True),
                                            **kw})


async def _mtp_engine(pipe, **kw) -> Engine:
    """An MTP engine over ``pipe``, started (``kw``: the engine's settings)."""
    engine = Engine(pipe, model_name="demo", tokenizer=None, speculative_algorithm="mtp", **kw)
    await engine.start()
    return engine


def _stop_tasks(engine: Engine) -> None:
    """Cancel the engine's lane, watch and output tasks, before the test's event loop ends."""
    for t in engine._tasks:
        t.cancel()


def _metrics():
    """A fresh Prometheus registry and the router's metrics on it (two stages, 3 drafts)."""
    from prometheus_client import CollectorRegistry

    from ppspec.router.metrics import RouterMetrics

    reg = CollectorRegistry()
    return reg, RouterMetrics(reg, num_stages=2, num_spec_tokens=3)


async def _until(ready, tries: int, period: float = 0.05) -> None:
    """Poll ``ready()`` up to ``tries`` times, ``period`` seconds apart, for work the engine
    does in the background; the test's asserts after it say whether it came."""
    for _ in range(tries):
        if ready():
            return
        await asyncio.sleep(period)


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    outs = LLM(DEMO_MODEL, max_rows=8).generate(PROMPTS + [PROMPTS[0]], PARAMS)
    return [o.token_ids for o in outs]


async def _collect(engine, rid, prompt, params=PARAMS):
    ids = []
    try:
        async for out in engine.generate(rid, prompt, params):
            ids += out.new_token_ids
    except EngineError as e:
        return e
    return ids


def test_a_refused_micro_batch_fails_only_its_requests(reference):
    torch.set_num_threads(1)
    pipe = _pp2_mtp()
    refused = []
    step = pipe.runners[1].step

    def refuse_first_verify(inp):
        # stage 1 refuses after stage 0 has run the step: stage 0 holds state (and, over
        # gRPC, a pending commit) for these rows that only a release can drop
        if inp.mode == "verify" and not refused:
            refused.append(list(inp.req_pool_indices))
            raise ValueError("stage 1: refused for the test")
        return step(inp)

    pipe.runners[1].step = refuse_first_verify

    async def run():
        engine = await _mtp_engine(pipe, num_micro_batches=2)
        results = await asyncio.gather(*(_collect(engine, f"r{i}", p) for i, p in enumerate(PROMPTS)))
        # the release of the failed rows runs in the background
        await _until(lambda: engine.scheduler.free_rows and len(engine.scheduler.free_rows) == 8, 50)
        health = engine.health()
        after = await _collect(engine, "late", PROMPTS[0])  # still serving
        await asyncio.sleep(0.2)
        infos = await pipe.info()
        _stop_tasks(engine)
        return results, health, after, infos

    results, health, after, infos = asyncio.run(run())
    failed = [r for r in results if isinstance(r, BaseException)]
    assert refused and len(failed) == len(refused[0]) >= 1
    assert all(not isinstance(e, StageDownError) and "refused for the test" in str(e) for e in failed)
    survivors = [(i, r) for i, r in enumerate(results) if not isinstance(r, BaseException)]
    assert survivors, "the other micro-batch's requests must finish"
    for i, ids in survivors:
        assert ids == reference[i], f"request {i}"
    assert health[0], health
    assert after == reference[-1]
    assert all(i["rows_in_use"] == 0 and i["kv_pages_used"] == 0 for i in infos), infos


def test_llm_stays_usable_after_a_refused_step_and_bad_requests(reference):
    """``LLM.generate``: a stage refusing a step, or a request refused before it is queued,
    raises to the caller and leaves nothing behind (no queued request, no held row): the
    next call generates as a fresh engine would."""
    torch.set_num_threads(1)
    llm = LLM(DEMO_MODEL, pp_size=2, speculative_algorithm="mtp", max_rows=8)
    step = llm.pipeline.runners[1].step
    calls = []

    def refuse_second_verify(inp):
        if inp.mode == "verify":
            calls.append(1)
            if len(calls) == 2:
                raise ValueError("stage 1: refused for the test")
        return step(inp)

    llm.pipeline.runners[1].step = refuse_second_verify
    with pytest.raises(ValueError, match="refused for the test"):
        llm.generate(PROMPTS[:3], PARAMS)
    assert not llm.has_unfinished() and llm.rows_in_use() == [0, 0] and not llm.completions
    for bad, err in (([[10**7]], "token ids must be ints"), ([[1.5, 2]], "token ids must be ints"),
                     ([[1, 2], [3]], "1 SamplingParams for 2 prompts")):
        with pytest.raises(ValueError, match=err):
            llm.generate(bad, [PARAMS] if len(bad) == 2 else PARAMS)
        assert not llm.has_unfinished() and llm.rows_in_use() == [0, 0]
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[1, 2]], SamplingParams(stop_token_ids=[-1]))
    # wrong types: one clear error each, nothing queued
    for prompts, params, err in (([[1, 2]], {"max_tokens": 3}, "params must be SamplingParams"),
                                 ([[1, 2]], [None], "params must be SamplingParams"),
                                 ([1, 2, 3], PARAMS, "prompts must be a list of prompts"),
                                 ([b"hi"], PARAMS, "a prompt is a string or a list of token ids"),
                                 ([torch.tensor(5)], PARAMS, "got a scalar"),
                                 ([[1, 2]], SamplingParams(stop_token_ids=None), "stop_token_ids must be a list"),
                                 ([[1, 2]], SamplingParams(temperature=10**400), "temperature must be a finite number")):
        with pytest.raises((TypeError, ValueError), match=err):
            llm.generate(prompts, params)
        assert not llm.has_unfinished() and llm.rows_in_use() == [0, 0] and not llm.completions
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference[:-1]
    assert llm.rows_in_use() == [0, 0]


@pytest.mark.parametrize("where", ["step", "commit_accept", "release"])
def test_llm_interrupted_generate_releases_every_row(reference, where):
    """Ctrl-C inside ``LLM.generate`` (a KeyboardInterrupt out of a stage's step, commit or
    release, with two micro-batches in flight): the call raises it, its requests end, every
    stage gets every row and KV page back, and the next call generates as a fresh engine."""
    torch.set_num_threads(1)
    llm = LLM(DEMO_MODEL, pp_size=2, speculative_algorithm="mtp", max_rows=8, num_micro_batches=2)
    runner = llm.pipeline.runners[1 if where == "step" else 0]
    real = getattr(runner, where)
    calls = []

    def interrupt_once(*args):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args)

    setattr(runner, where, interrupt_once)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True) if where == "release" else PARAMS
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, params)
    assert len(calls) >= 3
    assert not llm.has_unfinished() and not llm.completions
    assert llm.rows_in_use() == [0, 0]
    assert all(i["kv_pages_used"] == 0 for i in llm.pipeline.info_sync())
    assert len(llm.scheduler.free_rows) == 8 and llm.scheduler.kv_reserved == 0
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference[:-1]
    assert llm.rows_in_use() == [0, 0]


def test_llm_step_interrupted_in_a_commit_ends_the_uncommitted_micro_batches(reference):
    """Step-level API: a ``step()`` cut off inside a stage's commit ends the requests whose
    accepted state not every stage committed (their tokens would go wrong), gives back
    their rows, and the rest finish with PP1's tokens; a second interrupt inside the
    clean-up's release leaves rows that the next step releases."""
    torch.set_num_threads(1)
    llm = LLM(DEMO_MODEL, pp_size=2, speculative_algorithm="mtp", max_rows=8)
    rids = [llm.add_request(p, PARAMS) for p in PROMPTS[:4]]
    runner = llm.pipeline.runners[0]
    commit, release, calls = runner.commit_accept, runner.release, []

    def commit_once(*args):
        calls.append("commit")
        if calls.count("commit") == 2:
            raise KeyboardInterrupt
        return commit(*args)

    def release_fails_in_cleanup(rows):
        if "commit" in calls and calls.count("commit") == 2 and "release" not in calls:
            calls.append("release")
            raise KeyboardInterrupt  # the clean-up's release, cut off too
        return release(rows)

    runner.commit_accept, runner.release = commit_once, release_fails_in_cleanup
    interrupted = 0
    while llm.has_unfinished():
        try:
            llm.step()
        except KeyboardInterrupt:
            interrupted += 1
    assert interrupted == 1 and "release" in calls  # the second came out of the first one's clean-up
    done = [llm.completions[r] for r in rids]
    aborted = [c for c in done if c.finish_reason == "abort"]
    assert aborted
    for i, c in enumerate(done):
        if c.finish_reason == "abort":
            assert c.token_ids == reference[i][:len(c.token_ids)]
        else:
            assert c.finish_reason == "length" and c.token_ids == reference[i], i
    assert llm.rows_in_use() == [0, 0]
    assert len(llm.scheduler.free_rows) == 8 and llm.scheduler.kv_reserved == 0
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == reference[:-1]


def test_llm_generate_from_two_threads_and_numpy_prompts(reference):
    """Two threads calling ``generate`` at once both get PP1's tokens (the calls run one
    after another); numpy arrays of ids are prompts like lists."""
    import threading

    import numpy as np

    torch.set_num_threads(1)
    llm = LLM(DEMO_MODEL, speculative_algorithm="ngram", max_rows=8)
    got, errors = {}, []

    def run(k):
        try:
            got[k] = [o.token_ids for o in llm.generate(PROMPTS[3 * k:3 * k + 3], PARAMS)]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert got[0] + got[1] == reference[:6]
    arr = [np.array(p, dtype=np.int64) for p in PROMPTS[:2]]
    assert [o.token_ids for o in llm.generate(arr, PARAMS)] == reference[:2]
    assert [o.token_ids for o in llm.generate(np.array([PROMPTS[0]]), PARAMS)] == reference[:1]
    assert llm.rows_in_use() == [0]


@pytest.mark.parametrize("kw,err", [
    (dict(max_rows=0), "max_rows must be >= 1"), (dict(chunk_size=0), "chunk_size must be >= 1"),
    (dict(max_batch_size=0), "max_batch_size must be >= 1"), (dict(dtype="int8"), "dtype must be"),
    (dict(num_micro_batches=0), "num_micro_batches must be >= 1"), (dict(pp_size=0), "pp_size must be >= 1"),
    (dict(device="tpu"), "expected cpu, cuda or cuda:N"),
    (dict(speculative_algorithm="mtp", num_speculative_steps=0), "num_speculative_steps >= 1"),
])
def test_llm_refuses_bad_settings_at_construction(kw, err):
    with pytest.raises(ValueError, match=err):
        LLM(DEMO_MODEL, **kw)


def _recover_with_stage_1_changed(pipe, changed: dict):
    """Fail the engine over ``pipe``, recover while stage 1's Info reports ``changed`` (a
    stage restarted with other settings), then recover with it as it was. Returns stage 1's
    Info before, /health after each recovery, and PROMPTS[0]'s greedy tokens at the end."""
    info = pipe.info

    async def run():
        engine = await _mtp_engine(pipe)
        before = (await info())[1]
        engine._fail("stage 1 died (test)")

        async def restarted_otherwise():
            infos = await info()
            infos[1] = dict(infos[1], **changed)
            return infos

        pipe.info = restarted_otherwise
        await engine._recover()
        refused = engine.health()
        pipe.info = info  # the stage is restarted as it was
        await engine._recover()
        ok = engine.health()
        out = await _collect(engine, "after", PROMPTS[0])
        _stop_tasks(engine)
        return before, refused, ok, out

    return asyncio.run(run())


def test_recovery_refuses_a_stage_back_with_other_settings(reference):
    """After a failure the engine resumes only when every stage reports the settings it
    started with: a stage restarted without MTP would otherwise turn speculation off
    unnoticed (the router schedules drafts it no longer verifies)."""
    torch.set_num_threads(1)
    _, refused, ok, out = _recover_with_stage_1_changed(_pp2_mtp(), dict(has_mtp=False, num_speculative_steps=0))
    assert not refused[0] and "stage 1 has_mtp is False, was True" in refused[1], refused
    assert "num_speculative_steps is 0, was 3" in refused[1]
    assert ok[0], ok
    assert out == reference[0]


@pytest.mark.parametrize("slots", [0, 5])
def test_recovery_refuses_a_stage_back_with_fewer_prefix_cache_slots(reference, slots):
    """A stage restarted without ``--prefix-cache-gb`` (a hand-started stage has no prefix
    cache without it) or with less of it: the recovery went on to release every slot of
    the others on it, which such a stage refuses (INVALID_ARGUMENT, "snapshot slots on a
    stage without a prefix cache" / "outside [0, n)"), so the router stayed down for good
    with /health naming the failure from before the restart ("the stage closed the step
    socket"), not the setting. It is a setting the router schedules by (the cache's slots):
    /health names it, and the stage back with it the pipeline serves again."""
    torch.set_num_threads(1)
    info, refused, ok, out = _recover_with_stage_1_changed(_pp2_mtp(prefix_cache_gb=0.05), dict(snapshot_slots=slots))
    before = info["snapshot_slots"]
    assert before > slots
    assert not refused[0] and f"stage 1 snapshot_slots is {slots}, was {before}" in refused[1], refused
    assert ok[0], ok
    assert out == reference[0]


def test_a_kv_pool_smaller_than_the_context_limits_requests_instead_of_refusing_them(make_ckpt):
    """Stages whose KV pool holds less than their context (``--kv-tokens`` at or below
    ``--max-context``): the router's context limit becomes what the pool holds, so a
    request without ``max_tokens`` (default: the rest of the context) runs to that limit
    and one asking for more gets the context-length error, not a KV refusal of every
    request. A pool too small for any request refuses to start."""
    import httpx
    from transformers import AutoTokenizer

    from ppspec.router.api import build_app

    torch.set_num_threads(1)
    path = make_ckpt("qwen3_5_ratio1")
    pipe = InProcessPipeline.build(path, 2, max_rows=4, kv_tokens=48, max_context=64, num_speculative_steps=3, use_mtp=True)
    prompt = [3, 1, 4, 1, 5, 9, 2]

    async def run():
        engine = Engine(pipe, model_name="t", tokenizer=AutoTokenizer.from_pretrained(path))
        await engine.start()
        app = build_app(engine, "t")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            models = (await c.get("/v1/models")).json()
            ok = await c.post("/v1/completions", json=dict(prompt=prompt, temperature=0, ignore_eos=True))
            over = await c.post("/v1/completions", json=dict(prompt=prompt, temperature=0, ignore_eos=True,
                                                             max_tokens=engine.max_model_len - len(prompt) + 1))
        await engine.close()
        return engine.max_model_len, models, ok, over

    limit, models, ok, over = asyncio.run(run())
    kv = next(r.kv for r in pipe.runners if r.kv is not None)
    page = 48 // kv.num_pages
    assert limit == 48 // page * page - 4 - 3 < 64  # pool - (D + num_steps): verify and draft overhang
    assert models["data"][0]["max_model_len"] == limit
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == limit - len(prompt)
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded", over.text
    assert [i["rows_in_use"] for i in pipe.info_sync()] == [0, 0]
    with pytest.raises(ValueError, match="cannot hold a single request"):
        LLM(path, kv_tokens=4, max_context=64, speculative_algorithm="mtp", num_speculative_steps=8)
    for kw, err in ((dict(kv_tokens=0), "kv_tokens must be an integer >= 1"),
                    (dict(kv_tokens=-5), "kv_tokens must be an integer >= 1"),
                    (dict(max_context=0), "max_context must be an integer >= 1"),
                    (dict(kv_tokens=2.5), "kv_tokens must be an integer")):
        with pytest.raises(ValueError, match=err):
            LLM(path, **kw)


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_llm_stop_strings_cut_the_text_and_end_the_request(spec):
    """``SamplingParams(stop=[...])`` in ``LLM.generate``, as vLLM's: the text ends before
    the first stop string, the token ids end with the token that completed it (with MTP a
    round may have emitted more: they are dropped), finish_reason is ``stop`` with the
    string as stop_reason, and the rows come back. Checked against the same greedy run
    without stop strings."""
    torch.set_num_threads(1)
    llm = LLM(DEMO_MODEL, speculative_algorithm=spec, max_rows=4)
    prompts = ["The pipeline", "Once upon a time"]
    full = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    tok = llm.tokenizer
    stops, expect = [], []
    for c in full:
        text = c.text
        s = text[len(text) // 2: len(text) // 2 + 3]
        assert len(s) == 3 and s.strip(), text
        cut = text.find(s)
        k = next(k for k in range(1, len(c.token_ids) + 1) if s in tok.decode(c.token_ids[:k], skip_special_tokens=True))
        stops.append(s)
        expect.append((text[:cut], c.token_ids[:k]))
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[s, "\x00never"])
                                  for s in stops])
    for o, s, (text, ids) in zip(outs, stops, expect):
        assert o.text == text and o.token_ids == ids
        assert o.finish_reason == "stop" and o.stop_reason == s
    assert llm.rows_in_use() == [0] and not llm.has_unfinished()
    # within min_tokens a stop string does not count (vLLM): with min_tokens = max_tokens none does
    held = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=40, min_tokens=40, ignore_eos=True, stop=[s])
                                  for s in stops])
    assert [(o.text, o.token_ids, o.finish_reason) for o in held] == [(c.text, c.token_ids, "length") for c in full]
    # a stop string that never appears changes nothing; one string is a list of one
    (same,) = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop="\x00never"))
    assert same.token_ids == full[0].token_ids and same.finish_reason == "length" and same.stop_reason is None
    for bad in ([""], [3], 7):
        with pytest.raises(ValueError, match="stop must be a list of non-empty strings"):
            llm.generate(prompts[:1], SamplingParams(max_tokens=4, stop=bad))
    assert llm.rows_in_use() == [0]


@pytest.mark.parametrize("where", ["release", "commit", "commit refused"])
def test_rows_whose_release_a_failing_stage_lost_come_back_at_recovery(reference, where):
    """A stage dies while the router commits or releases the rows of requests that just
    finished: those rows are neither free nor a request's. Recovery releases every row on
    every stage, so it must also give these back (and their KV reservations), or each stage
    crash shrinks the router's capacity for good while the stages report nothing held."""
    torch.set_num_threads(1)
    pipe = _pp2_mtp()
    release, commit, failed, with_release = pipe.release, pipe.commit_accept, [], set()

    async def dying_release(r):
        if where == "release" and r.req_pool_indices and not r.abandon and not failed:
            failed.append(list(r.req_pool_indices))
            raise StageDownError("stage 1 died (test)")
        return await release(r)

    async def dying_commit(c):
        # fail the commit of a round in which a request finished (its row is released after it)
        if where.startswith("commit") and not failed and id(c) in with_release:
            failed.append(list(c.req_pool_indices))
            if where == "commit refused":
                raise ValueError("stage 1: commit refused (test)")
            raise StageDownError("stage 1 died (test)")
        return await commit(c)

    pipe.release, pipe.commit_accept = dying_release, dying_commit
    # different lengths: requests finish in different rounds, the others still run
    params = [SamplingParams(temperature=0, max_tokens=4 + 6 * i, ignore_eos=True) for i in range(len(PROMPTS))]

    async def run():
        nonlocal engine
        engine = await _mtp_engine(pipe, num_micro_batches=2)
        process = engine.scheduler.process

        def marking_process(*a, **k):
            up = process(*a, **k)
            if up.commit is not None and up.release_rows:
                with_release.add(id(up.commit))
            return up

        engine.scheduler.process = marking_process
        first = await asyncio.wait_for(  # without the recovery the requests never end: fail, not hang
            asyncio.gather(*(_collect(engine, f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, params)))), 60)
        # the lanes recover in the background
        await _until(lambda: engine.health()[0] and len(engine.scheduler.free_rows) == 8, 100)
        state = (sorted(engine.scheduler.free_rows), engine.scheduler.kv_reserved, engine.scheduler.releasing_rows())
        again = await asyncio.gather(*(_collect(engine, f"s{i}", p, PARAMS) for i, p in enumerate(PROMPTS)))
        for _ in range(100):  # the finished requests' rows are released in the background
            infos = await pipe.info()
            if all(i["rows_in_use"] == 0 for i in infos):
                break
            await asyncio.sleep(0.05)
        _stop_tasks(engine)
        return first, state, again, infos

    engine = None
    first, (free, reserved, releasing), again, infos = asyncio.run(run())
    assert failed, "the stage failure was not injected"
    assert any(isinstance(r, StageDownError) for r in first)  # the others' requests end with the pipeline
    assert free == list(range(8)) and reserved == 0 and releasing == [], (free, reserved, releasing)
    assert again == reference[:-1]
    assert all(i["rows_in_use"] == 0 for i in infos), infos


def test_a_hung_stage_ends_in_flight_requests_after_the_stall_timeout(reference):
    """A stage that stops answering without dying (SIGSTOP, a wedged device): its health
    checks fail at once, but an in-flight step RPC would wait for its own timeout
    (minutes). After ``stall_timeout`` seconds the in-flight requests end with
    StageDownError and the lanes stop waiting; once the stage answers again the router
    recovers and serves the same tokens as before."""
    torch.set_num_threads(1)
    # room for every request's whole reservation at once
    pipe = _pp2_mtp(kv_tokens=32768)
    step, hung = pipe.step, asyncio.Event()

    async def hanging_step(inp):
        if hung.is_set():
            await asyncio.Event().wait()  # never answers
        return await step(inp)

    pipe.step = hanging_step
    pipe.health = lambda: (False, "stage 1 (test) is not answering") if hung.is_set() else (True, "in-process stages")
    long = SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True)

    async def run():
        nonlocal engine
        engine = await _mtp_engine(pipe, num_micro_batches=2, stall_timeout=1.0)
        tasks = [asyncio.ensure_future(_collect(engine, f"r{i}", p, long)) for i, p in enumerate(PROMPTS)]
        await _until(lambda: engine.scheduler.num_running == len(PROMPTS), 600)
        assert engine.scheduler.num_running == len(PROMPTS)
        await asyncio.sleep(0.3)
        hung.set()
        # the hung step never answers (an in-process pipeline has no RPC timeout): only the
        # stall detection can end these requests
        results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        hung.clear()  # the stage answers again
        await _until(lambda: engine.health()[0] and len(engine.scheduler.free_rows) == 8, 100)
        again = await asyncio.gather(*(_collect(engine, f"s{i}", p, PARAMS) for i, p in enumerate(PROMPTS)))
        _stop_tasks(engine)
        return results, again

    engine = None
    results, again = asyncio.run(run())
    assert all(isinstance(r, StageDownError) and "not answering" in str(r) for r in results), results
    assert again == reference[:-1]


def test_close_ends_a_lane_whose_cancel_lands_with_a_wake(make_ckpt):
    """A lane idles in ``wait_for(_wake.wait(), 0.5)``; a background release wakes it in the
    same loop iteration as close() cancels it. Python 3.11's wait_for then returns and
    swallows the cancel: the lane must still end, or close() waits for ever."""
    torch.set_num_threads(1)
    pipe = InProcessPipeline.build(make_ckpt("qwen3_5_ratio1"), 1, max_rows=4, kv_tokens=256)

    async def run():
        for _ in range(5):
            engine = Engine(pipe, model_name="t", tokenizer=None, num_micro_batches=1)
            await engine.start()
            await asyncio.sleep(0.05)  # the lane idles
            engine._wake.set()  # as a finished release does
            await asyncio.sleep(0)  # the Event's waiter completes in this iteration...
            await asyncio.wait_for(engine._stop_lanes(), 10)  # ...and the lane is cancelled in it

    asyncio.run(run())


def test_the_running_gauge_drops_when_failed_requests_end_without_a_later_step():
    """Every request ends by failure (stage 1 refuses every verify): no successful step
    follows, so the gauges must be set where the requests are dropped, not at the next
    step's record (before, /metrics kept num_requests_running at the last step's count)."""
    torch.set_num_threads(1)
    pipe = _pp2_mtp()
    step = pipe.runners[1].step

    def refuse_verifies(inp):
        if inp.mode == "verify":
            raise ValueError("stage 1: refused for the test")
        return step(inp)

    pipe.runners[1].step = refuse_verifies
    reg, metrics = _metrics()

    async def run():
        engine = await _mtp_engine(pipe, num_micro_batches=2, metrics=metrics)
        results = await asyncio.gather(*(_collect(engine, f"r{i}", p) for i, p in enumerate(PROMPTS)))
        running = engine.scheduler.num_running
        _stop_tasks(engine)
        return results, running

    results, running = asyncio.run(run())
    assert all(isinstance(r, EngineError) for r in results), results
    assert running == 0
    assert reg.get_sample_value("ppspec:num_requests_running") == 0
    assert reg.get_sample_value("ppspec:num_requests_waiting") == 0


class _RidingPipeline(InProcessPipeline):
    """In-process stages that take a verify's commit on the micro-batch's next step, as
    ``GrpcPipeline`` does (``StepRequest.commit``), and refuse a commit whose rows are not
    pending on its verify, as a stage server does (FAILED_PRECONDITION: StageDownError)."""

    commits_ride_steps = True

    async def step(self, inp, commit=None):
        if commit is not None:
            await self.commit_accept(commit)
        return await super().step(inp)

    async def commit_accept(self, c):
        key = (c.micro_batch_id, c.round)
        wrong = {r: self._pending.get(r) for r in c.req_pool_indices if self._pending.get(r) != key}
        if wrong:
            raise StageDownError(f"commit of micro-batch {key[0]} round {key[1]} names rows not pending on it: {wrong}")
        return await super().commit_accept(c)


def test_a_verify_back_after_a_failure_sends_no_commit_after_the_recovery(reference):
    """A failure (as the health monitor reports a stage restart) while a verify is in
    flight: its result still comes back, but its requests are dropped and the recovery
    releases every row, abandoning that verify's commit. The commit must never reach the
    stages afterwards: held for the lane's next step, it went out after the recovery, the
    stages refused it (rows not pending) and the router failed a second time."""
    torch.set_num_threads(1)
    pipe = _pp2_mtp(_RidingPipeline)
    step, verifies, reasons = pipe.step, [], []

    async def failing_during_a_verify(inp, commit=None):
        if inp.mode == "verify":
            verifies.append(inp.round)
            if len(verifies) == 2:
                engine._fail("stage 1 restarted (test)")  # the step itself still answers
        return await step(inp, commit)

    pipe.step = failing_during_a_verify

    async def run():
        nonlocal engine
        engine = await _mtp_engine(pipe, num_micro_batches=1)
        fail = engine._fail
        engine._fail = lambda reason: (reasons.append(reason), fail(reason))
        first = await asyncio.wait_for(_collect(engine, "r0", PROMPTS[0]), 60)
        # the lane recovers in the background
        await _until(lambda: engine.failure is None, 200)
        await asyncio.sleep(0.3)  # what the lane does right after the recovery
        await engine.settle()
        after = await asyncio.wait_for(_collect(engine, "r1", PROMPTS[1]), 60)
        _stop_tasks(engine)
        return first, after

    engine = None
    first, after = asyncio.run(run())
    assert len(verifies) >= 2 and isinstance(first, StageDownError), first
    assert reasons == ["stage 1 restarted (test)"], reasons
    assert after == reference[1]


def test_a_lane_whose_loop_raises_fails_its_requests_and_serves_again(reference):
    """An exception out of a lane's own work (here the scheduler's processing of a result,
    once), not a step a stage refused: the lane's requests end with StageDownError instead
    of waiting for ever, every row comes back, and the restarted lane serves the next
    requests with the tokens of PP1 without speculation."""
    torch.set_num_threads(1)
    pipe = _pp2_mtp()

    async def run():
        engine = await _mtp_engine(pipe, num_micro_batches=1)
        process, raised = engine.scheduler.process, []

        def process_once_broken(*a, **kw):
            if not raised and a[0].mode == "verify":
                raised.append(1)
                raise RuntimeError("scheduler bug for the test")
            return process(*a, **kw)

        engine.scheduler.process = process_once_broken
        # a hang here would be the bug: the guard is generous, the requests take seconds
        first = await asyncio.wait_for(asyncio.gather(*(_collect(engine, f"a{i}", p) for i, p in
                                                        enumerate(PROMPTS[:3]))), 300)
        # the full recovery (every stage reset) runs before new requests
        await _until(lambda: engine.failure is None, 600)
        again = await asyncio.wait_for(asyncio.gather(*(_collect(engine, f"b{i}", p) for i, p in
                                                        enumerate(PROMPTS))), 300)
        # the recovery's releases run in the background
        await _until(lambda: len(engine.scheduler.free_rows) == 8, 100)
        free = len(engine.scheduler.free_rows)
        await engine.close()
        return raised, first, again, free

    raised, first, again, free = asyncio.run(run())
    assert raised == [1]
    assert all(isinstance(r, StageDownError) and "scheduler bug for the test" in str(r) for r in first), first
    assert again == reference[:-1]
    assert free == 8


def test_a_commit_that_never_comes_fails_the_rounds_waiting_for_it_instead_of_hanging(reference):
    """The in-process pipeline orders a step or release of a row after the row's pending
    commit, as a stage server does. A commit lost on the way (dropped here, once): the next
    round of those rows waited for it for ever. With ``order_timeout`` it fails after that
    many seconds with StageDownError naming the rows and the round whose commit it waited
    for; the engine recovers (its release of every row abandons the lost commit) and
    serves the next requests with the tokens of PP1 without speculation."""
    torch.set_num_threads(1)
    pipe = _pp2_mtp(order_timeout=1.0)
    commit, lost = pipe.commit_accept, []

    async def losing_the_first_commit(c):
        if not lost:
            lost.append((c.micro_batch_id, c.round, list(c.req_pool_indices)))
            return None  # never applied, never settled: its rows stay pending
        return await commit(c)

    pipe.commit_accept = losing_the_first_commit

    async def run():
        # each round after the last one's result: every commit goes out on its own
        engine = await _mtp_engine(pipe, num_micro_batches=1, async_scheduling=False)
        try:
            # without the timeout this waits for ever: the guard makes that a failure
            first = await asyncio.wait_for(asyncio.gather(*(_collect(engine, f"a{i}", p) for i, p in
                                                            enumerate(PROMPTS[:2]))), 120)
            # the recovery runs in the background
            await _until(lambda: engine.failure is None, 600)
            again = await asyncio.wait_for(asyncio.gather(*(_collect(engine, f"b{i}", p) for i, p in
                                                            enumerate(PROMPTS[:3]))), 120)
            await engine.settle()
            return first, again, len(engine.scheduler.free_rows), [i["rows_in_use"] for i in await pipe.info()]
        finally:
            await engine.close()

    first, again, free, in_use = asyncio.run(run())
    (mb, rnd, rows), = lost
    assert all(isinstance(r, StageDownError) for r in first), first
    msg = str(first[0])
    assert "waited 1s for the commits of" in msg and f"row {rows[0]} (micro-batch {mb} round {rnd})" in msg, msg
    assert again == reference[:3]
    assert free == 8 and in_use == [0, 0]


def test_the_prefix_cache_gauge_drops_when_a_recovery_drops_every_snapshot():
    """A recovery drops every prefix-cache snapshot on every stage and empties the router's
    cache, but ``ppspec:prefix_cache_usage`` was set only after a step or a flush: with no
    request after the recovery, /metrics kept the usage of before the failure for good (a
    failed flush, its drop cut by a stage that hung, left 0.0028 on an idle server). The
    gauge follows the cache where the recovery clears it."""
    torch.set_num_threads(1)
    pipe = _pp2_mtp(prefix_cache_gb=0.05)
    reg, metrics = _metrics()

    async def run():
        engine = await _mtp_engine(pipe, num_micro_batches=2, metrics=metrics)
        got = await asyncio.gather(*(_collect(engine, f"r{i}", p * 4) for i, p in enumerate(PROMPTS)))
        while not engine.settled() or engine.scheduler.releasing_rows():
            await asyncio.sleep(0.01)
        before = (engine.scheduler.cache.num_used, reg.get_sample_value("ppspec:prefix_cache_usage"))
        engine._fail("stage 1 died (test)")  # as a stage's failure does; the stage is back at once
        await _until(lambda: engine.health()[0], 200)
        after = (engine.health()[0], engine.scheduler.cache.num_used, reg.get_sample_value("ppspec:prefix_cache_usage"),
                 [r.snapshots.used for r in pipe.runners])
        _stop_tasks(engine)
        return got, before, after

    got, (used, gauge), after = asyncio.run(run())
    assert all(isinstance(g, list) and len(g) == 16 for g in got), got
    assert used > 0 and gauge == used / pipe.runners[0].snapshots.num_slots > 0, (used, gauge)
    assert after == (True, 0, 0.0, [0, 0]), after


def test_a_flush_while_a_stage_hangs_answers_503_and_loses_no_snapshot(reference):
    """``POST /v1/cache/flush`` (``Engine.flush_cache``) while a stage hangs: it waited for
    the drop's RPC timeout (30 s over gRPC; for ever in process), then answered 200 with
    nothing flushed. With the pipeline already down it is refused at once, evicting nothing;
    when the stage stops answering during the drop, it answers StageDownError (HTTP 503)
    naming the stage after ``stall_timeout`` (cut to 0.5 s here), the evicted snapshots
    stay out of use until the stage answers, then come free on the router and every stage,
    and the engine serves on."""
    torch.set_num_threads(1)
    pipe = _pp2_mtp(prefix_cache_gb=0.05)
    release, hung, drops = pipe.release, [], []

    async def hanging_drop(r):
        if r.drop_slots and not r.req_pool_indices:
            drops.append(r.drop_slots)
            if len(drops) == 1:  # the first flush's drop: the stage stops answering, its health checks too
                hung.append(asyncio.Event())
                await hung[-1].wait()
                hung.clear()
        return await release(r)

    pipe.release = hanging_drop
    pipe.health = lambda: (False, "stage 1 (test) is not answering") if hung else (True, "in-process stages")

    async def run():
        engine = await _mtp_engine(pipe, num_micro_batches=2, stall_timeout=0.5)
        cache = engine.scheduler.cache
        await asyncio.gather(*(_collect(engine, f"r{i}", p * 4) for i, p in enumerate(PROMPTS)))
        while not engine.settled() or engine.scheduler.releasing_rows():
            await asyncio.sleep(0.01)
        before = (cache.num_cached, cache.num_used, [r.snapshots.used for r in pipe.runners])
        hung.append(asyncio.Event())  # down before the flush
        with pytest.raises(StageDownError) as refused:
            await asyncio.wait_for(engine.flush_cache(), 60)
        untouched = (cache.num_cached, cache.num_used, [r.snapshots.used for r in pipe.runners])
        hung.clear()
        with pytest.raises(StageDownError) as unconfirmed:
            await asyncio.wait_for(engine.flush_cache(), 60)
        waiting = (cache.num_cached, cache.num_used, [r.snapshots.used for r in pipe.runners])
        hung[-1].set()  # the stage answers again
        await _until(lambda: not cache.num_used, 200)
        dropped = (cache.num_used, [r.snapshots.used for r in pipe.runners], engine.health()[0])
        again = await _collect(engine, "again", PROMPTS[0])
        while not engine.settled() or engine.scheduler.releasing_rows():
            await asyncio.sleep(0.01)
        cached = cache.num_cached
        flushed = await engine.flush_cache()
        _stop_tasks(engine)
        return before, refused.value, untouched, unconfirmed.value, waiting, dropped, again, cached, flushed

    before, refused, untouched, unconfirmed, waiting, dropped, again, cached, flushed = asyncio.run(run())
    cached_before, used_before, on_stages = before
    assert cached_before > 0 and used_before == cached_before and on_stages == [used_before] * 2, before
    assert "flush refused: stage 1 (test) is not answering" in str(refused) and refused.http_status == 503
    assert untouched == before
    assert "not confirmed" in str(unconfirmed) and "stage 1 (test) is not answering" in str(unconfirmed)
    assert waiting == (0, used_before, on_stages)  # evicted, not free until every stage dropped them
    assert dropped == (0, [0, 0], True)
    assert again == reference[0]
    assert cached > 0 and flushed == cached and len(drops) == 2


async def _cached_engine(pipe):
    """An engine over ``pipe`` whose prefix cache holds the snapshots of PROMPTS' requests, settled."""
    engine = await _mtp_engine(pipe, num_micro_batches=2)
    await asyncio.gather(*(_collect(engine, f"r{i}", p * 4) for i, p in enumerate(PROMPTS)))
    while not engine.settled() or engine.scheduler.releasing_rows():
        await asyncio.sleep(0.01)
    return engine


def test_a_flush_drops_and_counts_its_own_snapshots_when_another_drop_runs_beside_it():
    """``Engine.flush_cache`` evicts every snapshot, then waits for their drop on every stage.
    A release that ends in the same turn of the event loop drops what is evicted next
    (``_release_or_fail``: ``_drop_evicted``); the flush's own drop ran a turn later, found
    nothing left to drop and answered 0 snapshots at once, before any stage had dropped
    them. The flush takes its slots when it evicts them: it counts them all and answers once
    every stage dropped them."""
    torch.set_num_threads(1)
    pipe = _pp2_mtp(prefix_cache_gb=0.05)

    async def run():
        engine = await _cached_engine(pipe)
        cache = engine.scheduler.cache
        cached = cache.num_cached
        flush = asyncio.ensure_future(engine.flush_cache())
        await asyncio.sleep(0)  # the flush's first step: every snapshot evicted, the drop under way
        beside = await engine._drop_evicted()  # a release's drop in the same turn
        flushed = await asyncio.wait_for(flush, 60)
        left = (cache.num_used, [r.snapshots.used for r in pipe.runners])
        _stop_tasks(engine)
        return cached, beside, flushed, left

    cached, beside, flushed, left = asyncio.run(run())
    assert cached > 0 and (flushed, beside) == (cached, 0), (cached, flushed, beside)
    assert left == (0, [0, 0])


def test_a_flush_confirmed_by_every_stage_answers_its_count_whatever_fails_after():
    """The flush's answer is its own drop's outcome: every stage confirmed the drop, so it
    answers the count, though a failure came between the confirmation and the answer."""
    torch.set_num_threads(1)
    pipe = _pp2_mtp(prefix_cache_gb=0.05)
    release = pipe.release

    async def run():
        engine = await _cached_engine(pipe)
        cached = engine.scheduler.cache.num_cached

        async def confirmed_then_a_failure(rel):
            await release(rel)
            engine.failure = "another stage failed (test)"  # as _fail leaves it, after the drop came back

        pipe.release = confirmed_then_a_failure
        flushed = await engine.flush_cache()
        engine.failure = None
        pipe.release = release
        _stop_tasks(engine)
        return cached, flushed

    cached, flushed = asyncio.run(run())
    assert cached > 0 and flushed == cached, (cached, flushed)


def test_a_flush_whose_drop_failed_answers_503_naming_why():
    """A drop a stage refused fails the pipeline (the recovery drops every slot) and the
    flush answers 503 naming the refusal, however far the recovery got by then."""
    torch.set_num_threads(1)
    pipe = _pp2_mtp(prefix_cache_gb=0.05)
    release = pipe.release

    async def run():
        engine = await _cached_engine(pipe)

        async def refused(rel):
            if rel.drop_slots:
                raise StageDownError("stage 1 refused the drop (test)")
            await release(rel)

        pipe.release = refused
        try:
            await engine.flush_cache()
            failed = None
        except StageDownError as e:
            failed = str(e)
        pipe.release = release
        _stop_tasks(engine)
        return failed

    failed = asyncio.run(run())
    assert failed is not None and "stage 1 refused the drop (test)" in failed, failed
