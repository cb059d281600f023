"""vLLM's ``allowed_token_ids``, ``bad_words`` and ``--max-logprobs``
(``stage_server/sampler.py`` adjust_logits; ``router/types.py``).

The reference is an independent greedy loop: one token at a time through the plain path (no
speculation, a fresh request per token, prompt plus the outputs so far), the rule applied
in Python as a ``logit_bias`` of -100 on the tokens it bans. Speculation (n-gram, MTP at PP2)
must give the same tokens as without.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from ppspec.router.llm import DEMO_MODEL, LLM
from ppspec.router.types import InvalidRequestError, SamplingParams, bad_words_token_ids

PROMPTS = [[5, 6, 7, 8, 9], [40, 41, 42, 43, 44, 45]]
with open(f"{DEMO_MODEL}/config.json") as _f:
    EOS = json.load(_f)["eos_token_id"]  # the demo's one EOS id, which ends a request unless ignore_eos
N = 14


@pytest.fixture(scope="module")
def plain():
    torch.set_num_threads(1)
    return LLM(DEMO_MODEL, max_rows=4)


def _reference(llm: LLM, prompt: list[int], banned_after) -> list[int]:
    """Greedy tokens, each the argmax with ``banned_after(outputs)`` biased by -100."""
    out: list[int] = []
    for _ in range(N):
        bias = {t: -100.0 for t in banned_after(out)}
        p = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logit_bias=bias or None)
        out += llm.generate([prompt + out], p)[0].token_ids
    return out


def _bad_word_bans(words: list[list[int]]):
    def banned(out: list[int]) -> set[int]:
        return {w[-1] for w in words if len(w) - 1 <= len(out) and out[len(out) - len(w) + 1:] == w[:-1]}
    return banned


@pytest.fixture(scope="module")
def cases(plain):
    """Per prompt: the allowed set (a slice of the vocabulary around the unconstrained
    answer's tokens) and bad words cut out of the unconstrained answer (one of one token,
    one of two, one of three), with the reference tokens under each rule."""
    free = [o.token_ids for o in plain.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))]
    out = []
    for prompt, ans in zip(PROMPTS, free):
        allowed = sorted(set(range(100, 400)) - set(ans[:3]))
        words = [[ans[2]], [ans[4], ans[5]], [ans[7], ans[8], ans[9]]]
        out.append(dict(prompt=prompt, allowed=allowed, words=words,
                        ref_allowed=_reference(plain, prompt, lambda o: set(range(8192)) - set(allowed)),
                        ref_bad=_reference(plain, prompt, _bad_word_bans(words))))
        assert out[-1]["ref_allowed"] != ans and out[-1]["ref_bad"] != ans  # the rules bite
    return out


@pytest.mark.parametrize("spec", ["none", "ngram", "mtp-pp2"])
def test_allowed_token_ids_and_bad_words_against_a_reference_loop(cases, spec):
    """Greedy tokens under ``allowed_token_ids`` and under ``bad_words`` (token sequences
    as the engine tokenizes them) equal the reference loop's, with speculation as without;
    no token outside the allowed set, no bad word completed."""
    torch.set_num_threads(1)
    kw = {"none": {}, "ngram": dict(speculative_algorithm="ngram"),
          "mtp-pp2": dict(speculative_algorithm="mtp", pp_size=2)}[spec]
    llm = LLM(DEMO_MODEL, max_rows=4, **kw)
    ps = [c["prompt"] for c in cases]
    got = llm.generate(ps, [SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, allowed_token_ids=c["allowed"])
                            for c in cases])
    got_bad = llm.generate(ps, [SamplingParams(temperature=0, max_tokens=N, ignore_eos=True,
                                               bad_words_token_ids=c["words"]) for c in cases])
    for c, a, b in zip(cases, got, got_bad):
        assert a.token_ids == c["ref_allowed"] and set(a.token_ids) <= set(c["allowed"])
        assert b.token_ids == c["ref_bad"]
        for w in c["words"]:
            assert not any(b.token_ids[i:i + len(w)] == w for i in range(N)), (w, b.token_ids)


def test_bad_words_tokenize_as_vllm():
    """A word as written and, when it gives another first token of the same length, after a
    space; a word of no token is a 400."""
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    for word in ("the", "hello world", " sea"):
        bare = tok.encode(word.lstrip(), add_special_tokens=False)
        spaced = tok.encode(" " + word.lstrip(), add_special_tokens=False)
        want = [bare] + ([spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else [])
        assert bad_words_token_ids(tok, [word]) == want
    for bad in (" ", "a\udc80b"):  # no token; a lone surrogate, which no tokenizer can encode
        with pytest.raises(InvalidRequestError) as e:
            bad_words_token_ids(tok, [bad])
        assert e.value.param == "bad_words"


def test_bad_words_strings_through_the_llm(plain):
    """``bad_words`` strings: the engine tokenizes them, and the greedy answer never holds one."""
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    free = plain.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))[0].token_ids
    word = tok.decode(free[3:5])
    out = plain.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, bad_words=[word]))
    for w in bad_words_token_ids(tok, [word]):
        assert not any(out[0].token_ids[i:i + len(w)] == w for i in range(N))


def test_allowed_eos_alone_with_min_tokens_is_refused_unless_ignore_eos(plain):
    """With only EOS allowed, min_tokens would mask every logit (it bans EOS), so the
    request is refused; with ignore_eos EOS is no stop token and it is what comes out."""
    with pytest.raises(InvalidRequestError) as e:
        plain.generate([PROMPTS[0]], SamplingParams(max_tokens=3, min_tokens=1, allowed_token_ids=[EOS]))
    assert e.value.param == "allowed_token_ids"
    out = plain.generate([PROMPTS[0]], SamplingParams(max_tokens=3, min_tokens=1, allowed_token_ids=[EOS],
                                                      ignore_eos=True, temperature=0))[0]
    assert out.token_ids == [EOS] * 3 and out.finish_reason == "length"


@pytest.mark.parametrize("body, param", [
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[99999]), "allowed_token_ids"),
    (dict(allowed_token_ids=[2], min_tokens=2, stop_token_ids=[2]), "allowed_token_ids"),
    # EOS is a stop token too: min_tokens bans it, and nothing would be left to sample
    (dict(allowed_token_ids=[EOS], min_tokens=1), "allowed_token_ids"),
    (dict(allowed_token_ids=[EOS, 7], min_tokens=1, stop_token_ids=[7]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(bad_words=["  "]), "bad_words"),
    (dict(bad_words=["ok", "\ud800"]), "bad_words"),  # a lone surrogate: the tokenizer cannot take it
    (dict(logprobs=21), "logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
])
def test_bad_values_are_a_400_naming_the_field_before_any_row(body, param):
    """Over HTTP (an engine over in-process stages, --max-logprobs 20): each bad value is a
    400 naming its field, and no stage holds a row."""
    r, rows = _post(dict(prompt=[5, 6, 7], max_tokens=3, temperature=0, **body))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert rows == [set()]


def test_top_logprobs_over_the_cap_is_a_400_naming_it():
    r, rows = _post(dict(messages=[{"role": "user", "content": "hi"}], max_tokens=2, logprobs=True, top_logprobs=21),
                    path="/v1/chat/completions")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "top_logprobs", r.json()
    assert r.json()["error"]["message"].startswith("top_logprobs"), r.json()  # the field the client sent
    assert rows == [set()]


def test_max_logprobs_minus_one_lets_prompt_logprobs_take_the_vocabulary():
    """--max-logprobs -1: ``prompt_logprobs: -1`` is every token's log-probability at each
    prompt position (vLLM's), ranks 1..V."""
    r, rows = _post(dict(prompt=[5, 6, 7], max_tokens=1, temperature=0, prompt_logprobs=-1), max_logprobs=-1)
    assert r.status_code == 200, r.text
    entries = r.json()["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and all(len(e) >= 8000 for e in entries[1:])
    assert rows == [set()]


def _post(body: dict, max_logprobs: int = 20, path: str = "/v1/completions"):
    from ppspec.router.api import build_app
    from ppspec.router.engine import Engine
    from ppspec.router.pipeline import InProcessPipeline

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    pipe = InProcessPipeline.build(DEMO_MODEL, 1, max_rows=4, kv_tokens=4096)

    async def run():
        engine = Engine(pipe, model_name="t", tokenizer=tok, max_logprobs=max_logprobs)
        await engine.start()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(engine, "t")), base_url="http://t",
                                     timeout=120) as c:
            # json.dumps writes ASCII escapes, so a lone surrogate reaches the server as JSON allows
            r = await c.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        await engine.settle()
        for t in engine._tasks:
            t.cancel()
        return r

    r = asyncio.run(run())
    return r, [set(x.rows_in_use) for x in pipe.runners]
