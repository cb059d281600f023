"""Structured output: the grammar's token mask at every verified position of a speculative
round (``stage_server/grammar.py``), and the request forms that become a grammar
(``router/structured.py``).

The reference of a masked verify is plain torch: at each position the allowed tokens are
found by offering every token id to a fresh xgrammar matcher that has accepted the prefix
(not the bitmask the stage fills and rolls back), the logits of the others set to -inf,
then greedy acceptance as without a grammar.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx

import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from ppspec.proto.codec import step_from_pb, step_to_pb
from ppspec.proto.messages import SamplingSpec
from ppspec.router.llm import DEMO_MODEL, LLM
from ppspec.router.protocol import ChatCompletionRequest, CompletionRequest
from ppspec.router.scheduler import Scheduler
from ppspec.router.structured import request_grammar
from ppspec.router.tool_calls import parse_tool_calls
from ppspec.router.types import InvalidRequestError, SamplingParams
from ppspec.stage_server.grammar import GrammarRows
from ppspec.stage_server.sampler import verify_and_sample

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
V = 8192  # the demo checkpoint's vocabulary
EOS = 2


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DEMO_MODEL)


@pytest.fixture(scope="module")
def grammar():
    return request_grammar(CompletionRequest(prompt="x", response_format={"type": "json_schema",
                                                                           "json_schema": {"name": "p", "schema": SCHEMA}}))


@pytest.fixture(scope="module")
def compiled(grammar):
    return GrammarRows(DEMO_MODEL, V, [EOS]).compiler.compile_grammar(grammar)


def _allowed(compiled, prefix: list[int]) -> torch.Tensor:
    """``[V]`` bool: the tokens a fresh matcher that accepted ``prefix`` accepts next."""
    m = xgr.GrammarMatcher(compiled)
    for t in prefix:
        assert m.accept_token(t)
    ok = torch.zeros(V, dtype=torch.bool)
    for t in range(V):
        f = m.fork()
        ok[t] = f.accept_token(t)
    return ok


def _masked_greedy(logits, drafts, allowed_at):
    """Greedy verify of one request over masked logits: ``allowed_at(prefix)``."""
    out = []
    for j in range(len(drafts) + 1):
        row = logits[j].masked_fill(~allowed_at(out), float("-inf"))
        target = int(row.argmax())
        out.append(target)
        if j == len(drafts) or drafts[j] != target:
            return out
    return out


def test_the_verify_accepts_a_draft_only_where_the_mask_allows_it(tok, grammar, compiled):
    """Request 0's drafts are valid JSON and the raw argmax at their positions: all
    accepted, and its bonus token, whose raw argmax the grammar refuses, is the best
    allowed one. Request 1's second draft is the raw argmax but leaves the grammar: it is
    rejected there. Request 2 is unconstrained: the same logits accept every draft."""
    torch.manual_seed(0)
    text = tok.encode('{"name": "bob", "age": 3')
    D = 4
    prefix = text[:6]  # what each constrained request generated before this round: {"name": "bob
    logits = torch.randn(3, D, V)
    drafts = torch.tensor([text[6:9], [text[6], tok.encode("!")[0], text[8]], text[6:9]])  # ", "age
    for b in range(3):
        for j in range(D - 1):
            logits[b, j, drafts[b, j]] = 20.0  # each draft is the raw argmax at its position
    logits[:, D - 1, tok.encode("!")[0]] = 30.0  # the bonus position's raw argmax: outside JSON here
    rows = GrammarRows(DEMO_MODEL, V, [EOS])
    rows.install(rows.prepare([5, 9], [grammar, grammar], [prefix, prefix]))
    mask = rows.token_mask([5, 9, 11], drafts.tolist(), [True] * 3, D)
    assert mask.batch == [0, 1]
    got = verify_and_sample(logits, drafts, [3, 3, 3], [SamplingSpec()] * 3, [6] * 3, mask)
    ref = [_masked_greedy(logits[b], drafts[b].tolist(), lambda out: _allowed(compiled, prefix + out)) for b in range(2)]
    assert [r.tokens for r in got[:2]] == ref
    assert got[0].tokens[:3] == text[6:9] and got[0].tokens[3] != tok.encode("!")[0]  # bonus masked
    assert got[1].tokens == [text[6], ref[1][1]] and ref[1][1] != tok.encode("!")[0]  # draft 1 rejected
    assert got[2].tokens == drafts[2].tolist() + [tok.encode("!")[0]]  # unconstrained: the raw argmax
    # the matchers advanced by the emitted tokens alone: their next mask is a fresh matcher's
    rows.advance([5, 9, 11], mask, [r.tokens for r in got])
    for row, r in zip((5, 9), got):
        bm = xgr.allocate_token_bitmask(1, V)
        rows.matchers[row].fill_next_token_bitmask(bm)
        logits1 = torch.zeros(1, V)
        xgr.apply_token_bitmask_inplace(logits1, bm)
        assert torch.equal(logits1[0] == 0, _allowed(compiled, prefix + r.tokens))


def test_sampled_rounds_never_leave_the_grammar(tok, grammar, compiled):
    """Temperature 1 over random logits with random drafts: every emitted token is one the
    grammar accepts (a refused draft is never accepted: its probability is 0)."""
    torch.manual_seed(1)
    rows = GrammarRows(DEMO_MODEL, V, [EOS])
    rows.install(rows.prepare([0], [grammar], [[]]))
    ref = xgr.GrammarMatcher(compiled)
    valid = tok.encode('{"name": "al", "age": 7}')
    for rnd in range(12):
        D = 4
        drafts = [valid[(rnd + k) % len(valid)] if k % 2 else int(torch.randint(V, ())) for k in range(D - 1)]
        logits = torch.randn(1, D, V) * 4
        mask = rows.token_mask([0], [drafts], [True], D)
        out = verify_and_sample(logits, torch.tensor([drafts]), [D - 1], [SamplingSpec(temperature=1.0, seed=rnd)],
                                [rnd], mask)[0].tokens
        rows.advance([0], mask, [out])
        for t in out:
            assert ref.accept_token(t), (rnd, out)
        if ref.is_terminated():
            break


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_dead_end_ends_with_eos(tok, temperature):
    """A complete output allows EOS alone; under a min_tokens ban of EOS nothing is allowed
    there: the position gives EOS (the request stops) instead of sampling from nothing."""
    done = request_grammar(CompletionRequest(prompt="x", guided_choice=["yes"]))
    rows = GrammarRows(DEMO_MODEL, V, [EOS])
    rows.install(rows.prepare([2, 3], [done, done], [tok.encode("yes")] * 2))
    mask = rows.token_mask([2, 3], [[], []], [True, True], 1)
    specs = [SamplingSpec(temperature=temperature, seed=1, min_tokens=10, banned_until_min=[EOS]),
             SamplingSpec(temperature=temperature, seed=1)]
    logits = torch.randn(2, 1, V)
    logits[:, 0, EOS] = -50.0  # the model would rather go on
    got = verify_and_sample(logits, torch.zeros(2, 0, dtype=torch.long), [0, 0], specs, [1, 1], mask)
    assert [r.tokens for r in got] == [[EOS], [EOS]] and mask.dead.tolist() == [[True], [False]]
    rows.advance([2, 3], mask, [r.tokens for r in got])  # logs the dead end, raises nothing


def test_the_router_sends_the_grammar_once_per_row_with_a_preempted_requests_outputs(grammar):
    """With the prefill chunk that ends the prompt, not before or after; after a preemption
    the new row gets it again, with the chunk that ends the recompute, and every output so
    far (the grammar accepts them before the next sample)."""
    def wire(batch):
        return step_from_pb(step_to_pb(batch.step_input([EOS]))).sampling[0]

    s = Scheduler(max_rows=2, kv_tokens=1000, max_context=100, chunk_size=4)
    req = s.add("a", list(range(3, 9)), SamplingParams(temperature=0, max_tokens=8, grammar=grammar))
    b = s.schedule(0)
    assert wire(b).grammar == ""  # the prompt's first chunk
    s.process(b, [[]])
    b = s.schedule(0)
    assert (wire(b).grammar, wire(b).grammar_accepted_ids) == (grammar, [])  # its last: the first sample
    s.process(b, [[40]])
    for out in ([41], [42]):  # decodes
        b = s.schedule(0)
        assert wire(b).grammar == ""
        s.process(b, [out])
    s._preempt(req)
    s.free(s.take_preempted())
    got = []
    while True:  # the recompute: prompt and outputs but the last, in chunks
        b = s.schedule(0)
        got.append((b.mode, wire(b).grammar, wire(b).grammar_accepted_ids))
        if b.mode != "prefill":
            break
        s.process(b, [[]])
    assert got == [("prefill", "", [])] * 1 + [("prefill", grammar, [40, 41, 42]), ("decode", "", [])]


def test_request_forms_become_one_grammar():
    kinds = {
        "response_format": dict(response_format={"type": "json_object"}),
        "structured_outputs.json": dict(structured_outputs={"json": json.dumps(SCHEMA)}),
        "structured_outputs.regex": dict(structured_outputs={"regex": "[a-c]{2}"}),
        "structured_outputs.choice": dict(structured_outputs={"choice": ["a", "b"]}),
        "structured_outputs.grammar": dict(structured_outputs={"grammar": 'root ::= "x" | "y"'}),
        "guided_json": dict(guided_json=SCHEMA), "guided_regex": dict(guided_regex="[0-9]+"),
        "guided_choice": dict(guided_choice=["x"]), "guided_grammar": dict(guided_grammar='root ::= "z"'),
    }
    for name, kw in kinds.items():
        g = request_grammar(CompletionRequest(prompt="x", **kw))
        assert isinstance(g, str) and "root" in g, name
        xgr.Grammar.from_ebnf(g)  # what the stage compiles
    assert request_grammar(CompletionRequest(prompt="x")) is None
    assert request_grammar(CompletionRequest(prompt="x", response_format={"type": "text"})) is None


@pytest.mark.parametrize("kw,param,words", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
     "response_format", 'Unsupported type "foo"'),
    (dict(guided_json={"type": "string", "pattern": "[a-"}), "guided_json", "Unclosed '['"),
    (dict(guided_json="{not json"), "guided_json", "not valid JSON"),
    (dict(guided_regex="(?=a)b"), "guided_regex", "Lookahead"),
    (dict(structured_outputs={"grammar": 'root ::= "a" | b'}), "structured_outputs", 'Rule "b" is not defined'),
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "exactly one"),
    (dict(guided_regex="a", response_format={"type": "json_object"}), "guided_regex", "one structured output"),
    # keywords xgrammar would ignore: the output could break the schema
    (dict(guided_json={"type": "object", "properties": {"a b": {"type": "array", "items": {"not": {"type": "null"}}}}}),
     "guided_json", "'not' (at $.properties.a b.items)"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}), "response_format", "'uniqueItems' (at $)"),
    (dict(structured_outputs={"json": {"anyOf": [{"type": "object", "if": {}, "then": {}}]}}), "structured_outputs",
     "'if' (at $.anyOf[0])"),
])
def test_bad_constraints_are_named(kw, param, words):
    with pytest.raises(InvalidRequestError) as e:
        request_grammar(CompletionRequest(prompt="x", **kw))
    assert e.value.param == param and words in e.value.message, e.value.message
    assert "/project/" not in e.value.message  # xgrammar's source location is not the client's business


def _nested(depth: int) -> dict:
    """An object schema whose property ``a`` nests ``depth`` objects deep."""
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_a_schema_nested_past_the_limit_is_refused_before_its_build(monkeypatch):
    """450 levels took xgrammar 37 s to build on an HTTP worker thread; past the limit the
    request is a 400 naming the path, and xgrammar is never called; at the limit it builds."""
    from ppspec.router import structured

    deep = CompletionRequest(prompt="x", guided_json=_nested(structured.MAX_SCHEMA_DEPTH + 1))
    calls = []
    monkeypatch.setattr(structured, "_xgrammar", lambda: calls.append(1))
    with pytest.raises(InvalidRequestError) as e:
        request_grammar(deep)
    assert e.value.param == "guided_json" and f"more than {structured.MAX_SCHEMA_DEPTH} levels" in e.value.message
    assert "$.properties.a.properties.a" in e.value.message and not calls
    monkeypatch.undo()
    grammar = request_grammar(CompletionRequest(prompt="x", guided_json=_nested(structured.MAX_SCHEMA_DEPTH)))
    assert grammar.count("{") >= structured.MAX_SCHEMA_DEPTH


def test_response_format_refusals_say_what_is_wrong():
    with pytest.raises(ValueError, match="type json_schema needs its schema"):
        CompletionRequest(prompt="x", response_format={"type": "json_schema"})
    with pytest.raises(ValueError, match="json_schema goes with type json_schema, not json_object"):
        CompletionRequest(prompt="x", response_format={"type": "json_object", "json_schema": {"name": "x", "schema": {}}})


def test_tool_choice_needs_a_tool_call_parser_and_a_known_function():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice="required")
    with pytest.raises(InvalidRequestError, match="--tool-call-parser hermes"):
        request_grammar(body, None)
    assert request_grammar(body, "hermes")
    with pytest.raises(ValueError, match="not among the tools"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools,
                              tool_choice={"type": "function", "function": {"name": "g"}})


def test_ignore_eos_is_refused_with_a_grammar(grammar):
    with pytest.raises(InvalidRequestError, match="ignore_eos"):
        SamplingParams(grammar=grammar, ignore_eos=True).validate()


@pytest.fixture(scope="module")
def pp1():
    torch.set_num_threads(1)
    return LLM(DEMO_MODEL, max_rows=4)


def test_choices_come_out_verbatim(tok, pp1):
    """Choices with quotes, backslashes, newlines and non-ASCII text are escaped into the
    grammar and come out as given."""
    choices = ['say "hi"', "back\\slash", "two\nlines", "ünïcode"]
    g = request_grammar(CompletionRequest(prompt="x", guided_choice=choices))
    outs = pp1.generate([tok.encode(p) for p in ("Pick one:", "The answer is")],
                        SamplingParams(temperature=0, max_tokens=16, grammar=g))
    for o in outs:
        assert o.finish_reason == "stop" and tok.decode(o.token_ids, skip_special_tokens=True) in choices


def test_a_constrained_request_leaves_the_fused_greedy_round(tok):
    """The last stage's fused greedy MTP round (CUDA graphs; on the CPU its padded path runs
    eagerly) takes the raw logits' argmax: a micro-batch with a constrained request goes to
    the host sampler instead, its plain requests with it. Without that the JSON breaks at
    once (checked)."""
    torch.set_num_threads(1)
    g = request_grammar(CompletionRequest(prompt="x", guided_json=SCHEMA))
    ps = [tok.encode(t) for t in ("Explain how a hash map works.", "Write a poem")]
    params = [SamplingParams(temperature=0, max_tokens=40, grammar=g), SamplingParams(temperature=0, max_tokens=12)]
    ref = LLM(DEMO_MODEL, max_rows=2).generate(ps, params)
    llm = LLM(DEMO_MODEL, speculative_algorithm="mtp", max_rows=2, cuda_graph_max_bs=2)
    assert llm.pipeline.runners[-1].round_graphs
    outs = llm.generate(ps, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert outs[0].finish_reason == "stop" and set(json.loads(tok.decode(outs[0].token_ids[:-1]))) == {"name", "age"}


def test_mtp_drafts_of_a_constrained_request_follow_its_grammar(tok, compiled):
    """The last stage masks each step of a constrained request's MTP draft chain with the
    grammar after its outputs and the drafts before: every draft chain the stage returns
    is a continuation a fresh matcher accepts after the outputs so far (unmasked, the demo
    head's drafts leave the JSON at once: its mean accept length was 1.6 against 3.1 masked,
    bench/structured_accept.py), and the answers are those of PP1 without speculation."""
    torch.set_num_threads(1)
    g = request_grammar(CompletionRequest(prompt="x", guided_json=SCHEMA))
    ps = [tok.encode(t) for t in ("Describe a person as JSON:", "A sailor, as JSON:")]
    p = SamplingParams(temperature=0, max_tokens=40, grammar=g)
    ref = [o.token_ids for o in LLM(DEMO_MODEL, max_rows=2).generate(ps, p)]
    llm = LLM(DEMO_MODEL, speculative_algorithm="mtp", max_rows=2)
    steps = []
    step_sync = llm.pipeline.step_sync
    llm.pipeline.step_sync = lambda inp: steps.append((inp, step_sync(inp))) or steps[-1][1]
    outs = llm.generate(ps, p)
    assert [o.token_ids for o in outs] == ref
    emitted: dict[int, list[int]] = {}
    checked = 0
    for inp, res in steps:
        for b, row in enumerate(inp.req_pool_indices):
            if inp.is_prefill(b) and inp.seq_lens[b] == 0:  # its first chunk (maybe beside another's verify)
                emitted[row] = []
            emitted[row] += res.output_ids[b]
            if not res.drafts or not res.drafts[b]:
                continue
            if EOS in emitted[row]:  # it ended in this round (the router drops what follows)
                continue
            m = xgr.GrammarMatcher(compiled)
            assert all(m.accept_token(t) for t in emitted[row])
            for t in res.drafts[b]:
                if m.is_terminated():
                    break
                assert m.accept_token(t), (emitted[row], res.drafts[b])
                checked += 1
    assert checked > 20


def test_a_preempted_constrained_request_resumes_its_grammar(tok):
    """A short KV pool preempts requests mid-answer; readmitted, the new row's grammar
    accepts the outputs so far before its next sample: the answers are those of a pool
    that never runs short, and they parse."""
    torch.set_num_threads(1)
    g = request_grammar(CompletionRequest(prompt="x", guided_json=SCHEMA))
    ps = [tok.encode(f"Person number {i}:") for i in range(6)]
    p = SamplingParams(temperature=0, max_tokens=40, grammar=g)
    ref = [o.token_ids for o in LLM(DEMO_MODEL, max_rows=8).generate(ps, p)]
    llm = LLM(DEMO_MODEL, max_rows=8, kv_tokens=160, speculative_algorithm="mtp")
    outs = [o.token_ids for o in llm.generate(ps, p)]
    assert llm.scheduler.num_preemptions > 0
    assert outs == ref
    for ids in outs:
        assert set(json.loads(tok.decode(ids, skip_special_tokens=True))) == {"name", "age"}


def test_a_prefix_cache_hit_keeps_the_grammar(tok):
    """A request whose prompt is cached starts its row past the hit (its prefill skips the
    cached chunks): the grammar still reaches the stage with its last chunk, and the answer
    is the uncached one."""
    torch.set_num_threads(1)
    g = request_grammar(CompletionRequest(prompt="x", guided_json=SCHEMA))
    p = SamplingParams(temperature=0, max_tokens=40, grammar=g)
    prompt = tok.encode("A long shared system prompt about people and their ages. " * 6 + "Who?")
    llm = LLM(DEMO_MODEL, max_rows=2, enable_prefix_caching=True, chunk_size=32)
    first = llm.generate([prompt], p)[0]
    rid = llm.add_request(prompt, p)
    llm.step()
    assert llm.scheduler.requests[rid].cached_tokens > 0
    while llm.has_unfinished():
        llm.step()
    assert llm.completions[rid].token_ids == first.token_ids
    assert first.finish_reason == "stop" and set(json.loads(tok.decode(first.token_ids[:-1]))) == {"name", "age"}

# --------------------------------------------------------------------------------------
# Through the API, the openai client against real pipelines
# --------------------------------------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "member": {"type": "boolean"}},
          "required": ["name", "age", "member"], "additionalProperties": False}
WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                 "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string", "maxLength": 6}}, "required": ["tz"]}}}]
QUESTIONS = ["Who is Alice?", "Describe a person.", "What is the weather in Paris?"]


def test_qwen3_coder_calls_parse_and_follow_the_schema(tok, pp1):
    """``tool_choice`` with ``--tool-call-parser qwen3_coder``: XML calls (xgrammar's
    ``qwen_xml`` parameters) that the parser reads back into arguments valid for the tool."""
    import jsonschema

    msgs = [{"role": "user", "content": QUESTIONS[2]}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    choices = ("required", {"type": "function", "function": {"name": "get_weather"}})
    params = [SamplingParams(temperature=0, max_tokens=160, grammar=request_grammar(ChatCompletionRequest(
        messages=msgs, tools=TOOLS, tool_choice=c, parallel_tool_calls=False), "qwen3_coder")) for c in choices]
    for choice, out in zip(choices, pp1.generate([ids, ids], params)):
        assert out.finish_reason == "stop"
        content, calls = parse_tool_calls(tok.decode(out.token_ids, skip_special_tokens=True), "qwen3_coder", TOOLS)
        assert content is None and len(calls) == 1
        name = calls[0]["function"]["name"]
        assert name == "get_weather" or choice == "required"
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), schema)


@pytest.mark.parametrize("city,unit", [(" Strasbourg", "c"), ("Paris", " f"), ("Paris\t", "c\r"), ("\nParis", " c\n")])
def test_qwen3_coder_whitespace_the_grammar_allows_around_a_value_is_not_in_it(tok, city, unit):
    """The ``qwen_xml`` grammar of a forced call allows one whitespace character (any of
    space, tab, CR, newline: xgrammar's) on each side of a value; the parser takes it off
    as it takes off the format's newline, so the arguments still follow the schema (a
    sampled " c" was no enum value, a space made a 10-character city 11)."""
    import jsonschema

    grammar = request_grammar(ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], tools=TOOLS, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}), "qwen3_coder")
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=8192, stop_token_ids=[2]))
    text = (f"<tool_call>\n<function=get_weather>\n<parameter=city>{city}</parameter>\n"
            f"<parameter=unit>{unit}</parameter>\n</function>\n</tool_call>")
    m = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    assert m.accept_string(text) and m.accept_token(2)  # the grammar lets the model write it
    content, calls = parse_tool_calls(text, "qwen3_coder", TOOLS)
    args = json.loads(calls[0]["function"]["arguments"])
    jsonschema.validate(args, WEATHER_ARGS)
    assert content is None and args == {"city": city.strip(), "unit": unit.strip()}


@pytest.fixture(scope="module")
def pp1_none(pp1):
    """PP1 without speculation, in process: the reference of every greedy answer."""
    llm = pp1
    done = {}

    def run(prompt_ids, body):
        key = (tuple(prompt_ids), json.dumps(body, sort_keys=True))
        if key not in done:  # each answer once for both pipelines
            grammar = request_grammar(ChatCompletionRequest(**body), "hermes")
            params = SamplingParams(temperature=0, max_tokens=body["max_tokens"], grammar=grammar)
            done[key] = llm.generate([prompt_ids], params)[0].token_ids
        return done[key]

    return run


@pytest.fixture(scope="module", params=[(2, "mtp"), (3, "ngram")], ids=["pp2-mtp", "pp3-ngram"])
def cluster(request, tmp_path_factory):
    from cluster import Cluster

    pp, spec = request.param
    c = Cluster(DEMO_MODEL, pp, spec, router_args=["--tool-call-parser", "hermes"],
                log_dir=str(tmp_path_factory.mktemp("logs"))).start()
    yield c
    c.stop()


def _chat(client, body):
    return client.chat.completions.create(model=client.models.list().data[0].id, temperature=0,
                                          extra_body={"return_token_ids": True}, **body)


def test_openai_client_gets_schema_valid_json_and_tool_calls_with_speculation(cluster, pp1_none):
    """Every answer parses and validates against its schema, and its greedy tokens are PP1's
    without speculation (so speculation changed nothing, drafts leaving the grammar
    included)."""
    import jsonschema
    from openai import OpenAI

    client = OpenAI(base_url=cluster.url + "/v1", api_key="none", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    ask = [{"role": "user", "content": QUESTIONS[2]}]
    bodies = [dict(messages=[{"role": "user", "content": q}], max_tokens=60, response_format=fmt) for q in QUESTIONS[:2]]
    bodies += [dict(messages=ask, max_tokens=120, tools=TOOLS, tool_choice="required", parallel_tool_calls=False),
               dict(messages=ask, max_tokens=120, tools=TOOLS,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})]
    with ThreadPoolExecutor(len(bodies)) as pool:  # in flight together: batched rounds
        answers = list(pool.map(lambda body: _chat(client, body), bodies))
    for body, r in zip(bodies, answers):
        choice = r.choices[0]
        if "response_format" in body:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), PERSON)
        else:
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
            call = choice.message.tool_calls[0].function
            if isinstance(body["tool_choice"], dict):
                assert call.name == "get_weather"
            schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.name)
            jsonschema.validate(json.loads(call.arguments), schema)
        assert choice.model_extra["token_ids"] == pp1_none(r.model_extra["prompt_token_ids"], body)


def test_a_bad_schema_is_a_400_before_any_row_is_taken(cluster):
    # the earlier tests' releases reach the stages after their answers: wait for them
    before = [i.rows_in_use for i in cluster.wait_rows_free()]
    body = {"messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}}}}}
    r = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    assert "minimum greater than maximum" in r.json()["error"]["message"]
    assert [i.rows_in_use for i in cluster.stage_infos()] == before == [0] * len(before)


def test_prepare_grammar_over_grpc(cluster):
    """``PrepareGrammar`` on the real last stage (the router sends it before admitting a
    constrained request): a grammar that compiles is answered, one that does not is a
    ValueError with the stage's reason (the router's 400), nothing taken."""
    import asyncio

    from ppspec.router.grpc_pipeline import GrpcPipeline

    async def run():
        p = GrpcPipeline([f"127.0.0.1:{port}" for port in cluster.stage_ports])
        p.router_id = ""  # a tool's call: the serving router owns the stages
        try:
            await p.prepare_grammar('root ::= "yes" | "no"')
            with pytest.raises(ValueError, match="does not compile"):
                await p.prepare_grammar('root ::= ( "a"')
        finally:
            await p.close()

    asyncio.run(run())
    assert all(i.rows_in_use == 0 for i in cluster.wait_rows_free())
