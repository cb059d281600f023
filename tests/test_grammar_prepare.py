"""A structured output's grammar is compiled off the step (``stage_server/grammar.py``): the
router asks the last stage to compile it when the request arrives and admits the request
once it is compiled, so a step never compiles one and the other requests never wait for it.

The compile is held on an injected gate, so the order of events is what the test reads,
never a clock.
"""
from __future__ import annotations

import json
import threading

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from ppspec.router.llm import DEMO_MODEL, LLM
from ppspec.router.protocol import CompletionRequest
from ppspec.router.structured import request_grammar
from ppspec.router.types import InvalidRequestError, SamplingParams
from ppspec.stage_server.grammar import GrammarRows

# a fresh 50-property schema: a compile that costs something at any vocabulary
SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": ["string", "integer", "boolean"][i % 3]} for i in range(50)},
          "required": ["p0", "p1"]}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DEMO_MODEL)


def test_a_compiling_grammar_holds_back_its_request_alone(tok):
    """While a constrained request's grammar compiles (held on a gate), a plain request
    submitted after it runs to its end; the constrained one starts once the compile is
    done, its step looks the compiled grammar up (no step compiles), and its answer is the
    one an unhindered run gives, valid JSON."""
    torch.set_num_threads(1)
    grammar = request_grammar(CompletionRequest(prompt="x", guided_json=SCHEMA))
    constrained = SamplingParams(temperature=0, max_tokens=120, grammar=grammar)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [tok.encode("A record as JSON:"), tok.encode("Once upon a time")]
    ref = LLM(DEMO_MODEL, max_rows=2).generate([prompts[0]], constrained)[0]

    llm = LLM(DEMO_MODEL, max_rows=2)
    grammars = llm.pipeline.runners[-1].grammars
    gate, events = threading.Event(), []
    compile_ = grammars._compile

    def held(text, *job):
        events.append("compile starts")
        opened = gate.wait(120)  # bounded: a step that waited for the compile would end here
        events.append("compiled" if opened else "gate timed out")
        return compile_(text, *job)

    grammars._compile = held
    a = llm.add_request(prompts[0], constrained)
    b = llm.add_request(prompts[1], plain)
    while llm.completions[b].finish_reason is None:
        for o in llm.step():
            events.append(f"{'a' if o.request_id == a else 'b'} tokens")
    events.append("b finished")
    gate.set()
    while llm.has_unfinished():
        for o in llm.step():
            events.append(f"{'a' if o.request_id == a else 'b'} tokens")
    assert events[0] == "compile starts"
    first_a = events.index("a tokens")
    assert events.index("b finished") < events.index("compiled") < first_a, events
    assert "b tokens" in events[:events.index("b finished")]
    assert grammars.step_compiles == 0
    out = llm.completions[a]
    assert (out.token_ids, out.finish_reason) == (ref.token_ids, ref.finish_reason) and out.finish_reason == "stop"
    assert set(json.loads(tok.decode(out.token_ids[:-1]))) <= set(SCHEMA["properties"])


def test_a_grammar_the_stage_cannot_compile_is_refused_before_any_row():
    """The engine's compile on the last stage fails: the request ends with an
    InvalidRequestError (HTTP 400) naming it, no row was taken, the engine serves on."""
    llm = LLM(DEMO_MODEL, max_rows=2)
    with pytest.raises(InvalidRequestError, match="does not compile") as e:
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, grammar="root ::= ( \"a\""))
    assert e.value.param == "grammar"
    assert all(not r.rows_in_use for r in llm.pipeline.runners) and not llm.scheduler.requests
    assert len(llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids) == 4



def _props(n: int) -> str:
    """The grammar of an object of ``n`` optional integer properties: its compile grows
    about as n^2.5 (300: under a second on the demo's vocabulary, 1000: 20 s, 5000: minutes)."""
    return request_grammar(CompletionRequest(prompt="x", guided_json={
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)}}))


def test_a_long_compile_holds_back_neither_the_others_nor_the_stages_exit(monkeypatch):
    """A grammar whose compile would take minutes, then a small one: the small one compiles
    while the long one still runs (compiles run side by side in child processes), and
    closing the stage's grammars stops the long compile at once (its child is killed: a
    compile in a thread could not be stopped, and held the stage's exit)."""
    monkeypatch.setenv("PPSPEC_GRAMMAR_COMPILE_TIMEOUT", "600")
    rows = GrammarRows(DEMO_MODEL, 8192, [2])
    slow = rows.prefetch(_props(5000))
    small = rows.prefetch(request_grammar(CompletionRequest(prompt="x", guided_json=SCHEMA)))
    matcher = xgr.GrammarMatcher(small.result(timeout=300))
    assert not slow.done()  # minutes of compile left
    assert matcher.accept_token(rows.tokenizer_info.decoded_vocab.index(b"{"))
    children = rows.compile_processes()
    assert len(children) == 2 and all(p.poll() is None for p in children)
    rows.close()
    with pytest.raises(ValueError, match="stopped"):
        slow.result(timeout=60)
    assert all(p.wait(timeout=10) is not None for p in children)


def test_a_grammar_past_the_compile_cap_is_refused_before_any_row(monkeypatch):
    """A compile that runs past PPSPEC_GRAMMAR_COMPILE_TIMEOUT is stopped (its child
    killed): the request ends with InvalidRequestError (HTTP 400) naming the cap, no row
    was taken, and the next constrained request compiles and runs."""
    monkeypatch.setenv("PPSPEC_GRAMMAR_COMPILE_TIMEOUT", "1")
    llm = LLM(DEMO_MODEL, max_rows=2)
    with pytest.raises(InvalidRequestError, match="did not compile within 1 s") as e:
        llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, grammar=_props(5000)))
    assert e.value.param == "grammar"
    assert all(not r.rows_in_use for r in llm.pipeline.runners) and not llm.scheduler.requests
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=40, grammar=request_grammar(
        CompletionRequest(prompt="x", guided_choice=["yes", "no"]))))[0]
    assert out.finish_reason == "stop" and llm.tokenizer.decode(out.token_ids[:-1]) in ("yes", "no")


def _engine_over_demo():
    """An engine over the demo checkpoint in one in-process stage, and that stage's grammars."""
    from ppspec.router.engine import Engine
    from ppspec.router.pipeline import InProcessPipeline

    pipe = InProcessPipeline.build(DEMO_MODEL, 1, max_rows=4, kv_tokens=4096)
    return Engine(pipe, model_name="demo", tokenizer=None), pipe.runners[-1].grammars


async def _outcome(engine, rid, prompt, params):
    """The request's token ids and finish reason, or the error that ended it."""
    ids = []
    try:
        async for out in engine.generate(rid, prompt, params):
            ids += out.new_token_ids
            if out.finished:
                return ids, out.finish_reason
    except Exception as e:  # noqa: BLE001 - the test reads it
        return e
    return ids, None


def test_an_aborted_requests_queued_compile_is_dropped_and_a_shared_one_kept(tok):
    """Three grammars for two compile workers, both held on a gate: the third one's compile
    queues. Its request aborts, and so does one of the two requests sharing the first
    grammar: the queued compile never starts (nobody waits for it), the shared one goes on
    for the request still waiting, and both requests left answer in their grammar."""
    import asyncio

    torch.set_num_threads(1)
    # small (the gate holds the compiles), one per name, each answer short
    choices = {t: [f"{t} yes", f"{t} no"] for t in ("shared", "other", "queued")}
    shared, other, queued = (request_grammar(CompletionRequest(prompt="x", guided_choice=choices[t])) for t in choices)
    engine, grammars = _engine_over_demo()
    gate, started = threading.Event(), []
    compile_ = grammars._compile

    def held(text, *job):
        started.append(text)
        gate.wait(120)  # bounded: a test that never opens it fails below instead of hanging
        return compile_(text, *job)

    grammars._compile = held
    prompt = tok.encode("Answer yes or no:")

    def params(g):
        return SamplingParams(temperature=0, max_tokens=40, grammar=g)

    async def run():
        await engine.start()
        try:
            runs = {rid: asyncio.ensure_future(_outcome(engine, rid, prompt, params(g)))
                    for rid, g in (("kept", shared), ("gone", shared), ("other", other), ("queued", queued))}
            for _ in range(1200):
                if len(started) == 2:
                    break
                await asyncio.sleep(0.05)
            await engine.abort("queued")
            await engine.abort("gone")
            await asyncio.sleep(0.2)  # what the workers would take next, they take now
            gate.set()
            return {rid: await asyncio.wait_for(t, 300) for rid, t in runs.items()}
        finally:
            await engine.close()

    outs = asyncio.run(run())
    assert sorted(started) == sorted([shared, other]), [len(t) for t in started]
    assert outs["queued"] == ([], "abort") and outs["gone"] == ([], "abort"), outs
    for rid, t in (("kept", "shared"), ("other", "other")):
        ids, reason = outs[rid]
        assert reason == "stop", (rid, outs[rid])
        assert tok.decode(ids[:-1]) in choices[t]


def test_an_aborted_requests_running_compile_is_stopped(monkeypatch):
    """A grammar whose compile would take minutes: its request aborts while it compiles.
    The compile's child is killed at once (it held a compile process, and the stage's CPU,
    for nobody), and the next constrained request compiles and runs."""
    import asyncio

    monkeypatch.setenv("PPSPEC_GRAMMAR_COMPILE_TIMEOUT", "600")
    torch.set_num_threads(1)
    engine, grammars = _engine_over_demo()
    grammars.tokenizer_info  # the compile processes, shared by the module's tests: none left running
    grammars.close()
    slow = _props(5000)
    choice = request_grammar(CompletionRequest(prompt="x", guided_choice=["yes", "no"]))

    async def run():
        await engine.start()
        try:
            gone = asyncio.ensure_future(_outcome(engine, "slow", [5, 6, 7],
                                                  SamplingParams(temperature=0, max_tokens=4, grammar=slow)))
            for _ in range(2400):  # until a child process compiles it (it starts for this compile)
                if grammars.compile_processes():
                    break
                await asyncio.sleep(0.05)
            child, = grammars.compile_processes()
            await engine.abort("slow")
            status = await asyncio.get_running_loop().run_in_executor(None, child.wait, 60)
            after = await asyncio.wait_for(_outcome(engine, "next", [5, 6, 7], SamplingParams(
                temperature=0, max_tokens=40, grammar=choice)), 300)
            return await gone, status, after
        finally:
            await engine.close()

    gone, status, (ids, reason) = asyncio.run(run())
    assert gone == ([], "abort") and status == -9, (gone, status)
    assert reason == "stop" and AutoTokenizer.from_pretrained(DEMO_MODEL).decode(ids[:-1]) in ("yes", "no")
    assert slow not in grammars._compiles


def test_an_unexpected_compile_fault_ends_the_request_with_an_error():
    """A grammar compile that fails with something other than a refusal (here an OSError
    from the stage's compile): the request ends with an EngineError (HTTP 500) naming it
    instead of waiting for ever, it took no row, and the next request with the same grammar
    compiles and runs."""
    import asyncio

    from ppspec.router.types import EngineError

    torch.set_num_threads(1)
    engine, grammars = _engine_over_demo()
    compile_, calls = grammars._compile, []

    def faulty(text, *job):
        calls.append(text)
        if len(calls) == 1:
            raise OSError("no space left on device")
        return compile_(text, *job)

    grammars._compile = faulty
    choice = request_grammar(CompletionRequest(prompt="x", guided_choice=["yes", "no"]))

    def params():
        return SamplingParams(temperature=0, max_tokens=40, grammar=choice)

    async def run():
        await engine.start()
        try:
            first = await asyncio.wait_for(_outcome(engine, "first", [5, 6, 7], params()), 300)
            rows = [r.rows_in_use for r in engine.pipeline.runners]
            second = await asyncio.wait_for(_outcome(engine, "second", [5, 6, 7], params()), 300)
            return first, rows, second
        finally:
            await engine.close()

    first, rows, (ids, reason) = asyncio.run(run())
    assert isinstance(first, EngineError) and first.http_status == 500, first
    assert "OSError: no space left on device" in first.message
    assert rows == [set()] and len(calls) == 2
    assert reason == "stop" and AutoTokenizer.from_pretrained(DEMO_MODEL).decode(ids[:-1]) in ("yes", "no")


def test_a_compile_abandoned_while_no_child_runs_starts_none_for_it(monkeypatch):
    """The last request of a compile gives it up after a compile process took it but before
    a child ran (the process's child stopped by then, as an earlier abandon or the cap
    leaves it): the fresh child the compile then starts is not given the grammar, the
    compile ends as dropped, and the process compiles the next grammar."""
    from ppspec.stage_server.grammar import _Compile

    monkeypatch.setenv("PPSPEC_GRAMMAR_COMPILE_TIMEOUT", "600")
    rows = GrammarRows(DEMO_MODEL, 8192, [2])
    rows.tokenizer_info  # the pool's processes exist
    sent = []
    job = _Compile()
    job.future = None  # the worker's future: abandon() below only marks and stops
    pool = rows._pool
    process = pool.processes[0]
    process.stop()  # no child now: the compile below starts one
    real_start = process._start

    def start_then_abandon():  # the request gives up just as the fresh child comes up
        real_start()
        job.abandoned = True
        real_send = process._send.send_bytes
        process._send.send_bytes = lambda b: sent.append(b) or real_send(b)

    process._start = start_then_abandon
    with pytest.raises(ValueError, match="dropped"):
        pool.idle.queue.clear()
        pool.idle.put(process)
        pool.compile(_props(5000), 5, job)
    assert sent == []  # the grammar never went to the child
    process._start = real_start
    small = request_grammar(CompletionRequest(prompt="x", guided_choice=["yes", "no"]))
    assert xgr.GrammarMatcher(rows._compile(small))  # the next compile runs
    rows.close()
