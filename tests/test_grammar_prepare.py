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
from transformers import AutoTokenizer

from ppspec.router.llm import DEMO_MODEL, LLM
from ppspec.router.protocol import CompletionRequest
from ppspec.router.structured import request_grammar
from ppspec.router.types import InvalidRequestError, SamplingParams

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

    def held(text):
        events.append("compile starts")
        opened = gate.wait(120)  # bounded: a step that waited for the compile would end here
        events.append("compiled" if opened else "gate timed out")
        return compile_(text)

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

