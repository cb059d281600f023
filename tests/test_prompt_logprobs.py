"""vLLM's ``prompt_logprobs`` request field through the HTTP API, on a real engine (the
demo checkpoint, PP2 in process, prefill in 5-token chunks): every prompt token's
log-probability, rank and top alternatives are transformers' on the same checkpoint, in
vLLM's shape (``choices[i].prompt_logprobs`` for completions, the response's
``prompt_logprobs`` for chat: None for the first token, then dicts keyed by token id).
"""
from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ppspec.router.api import build_app
from ppspec.router.engine import Engine
from ppspec.router.llm import DEMO_MODEL
from ppspec.router.pipeline import InProcessPipeline

K = 3


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(DEMO_MODEL)


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()


def _post_all(bodies: list[tuple[str, dict]], tok) -> list[httpx.Response]:
    torch.set_num_threads(1)
    pipe = InProcessPipeline.build(DEMO_MODEL, 2, max_rows=4, kv_tokens=512)

    async def run():
        engine = Engine(pipe, model_name="t", tokenizer=tok, chunk_size=5)
        await engine.start()
        app = build_app(engine, "t")
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         timeout=120) as c:
                return [await c.post(path, json=body) for path, body in bodies]
        finally:
            for t in engine._tasks:
                t.cancel()

    return asyncio.run(run())


def _check(got, prompt, hf, tok, k):
    """``got`` (vLLM's prompt_logprobs of ``prompt``) against transformers."""
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert len(got) == len(prompt) and got[0] is None
    for j in range(1, len(prompt)):
        row, t = ref[j - 1], prompt[j]
        top = row.topk(k)
        want = {t: (row[t].item(), int((row > row[t]).sum()) + 1)}
        for r, (i, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), 1):
            want.setdefault(i, (v, r))
        entry = {int(key): v for key, v in got[j].items()}  # JSON keys are strings
        assert list(entry) == list(want)
        for i, (lp, rank) in want.items():
            assert entry[i]["logprob"] == pytest.approx(lp, abs=2e-4)
            assert entry[i]["rank"] == rank
            assert entry[i]["decoded_token"] == tok.decode([i])


def test_prompt_logprobs_of_completions_and_chat_against_transformers(tok, hf):
    prompt = tok.encode("The quick brown fox jumps over the lazy dog")
    messages = [{"role": "user", "content": "Name a colour."}]
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    bodies = [
        ("/v1/completions", dict(prompt=prompt, max_tokens=2, temperature=0, prompt_logprobs=K, n=2)),
        # echo's entries keep their own count of alternatives
        ("/v1/completions", dict(prompt=prompt, max_tokens=2, temperature=0, prompt_logprobs=K, echo=True, logprobs=1)),
        ("/v1/completions", dict(prompt=prompt, max_tokens=1, temperature=0, prompt_logprobs=0)),
        ("/v1/chat/completions", dict(messages=messages, max_tokens=2, temperature=0, prompt_logprobs=K)),
        ("/v1/completions", dict(prompt=prompt, max_tokens=2, prompt_logprobs=K, stream=True)),
        ("/v1/completions", dict(prompt=prompt, max_tokens=2, prompt_logprobs=21)),
        ("/v1/chat/completions", dict(messages=messages, max_tokens=2, prompt_logprobs=-1)),
    ]
    r = _post_all(bodies, tok)
    assert [x.status_code for x in r] == [200] * 4 + [400] * 3, [x.text for x in r]
    for choice in r[0].json()["choices"]:
        _check(choice["prompt_logprobs"], prompt, hf, tok, K)
    echo = r[1].json()["choices"][0]
    _check(echo["prompt_logprobs"], prompt, hf, tok, K)
    n = len(prompt)
    assert all(len(t) <= 2 for t in echo["logprobs"]["top_logprobs"][1:n])  # logprobs 1: the token + one
    _check(r[2].json()["choices"][0]["prompt_logprobs"], prompt, hf, tok, 0)
    assert r[2].json()["choices"][0]["logprobs"] is None  # prompt_logprobs alone: no echo entries
    chat = r[3].json()
    _check(chat["prompt_logprobs"], chat_ids, hf, tok, K)
    assert "prompt_logprobs" not in chat["choices"][0]
    assert r[4].json()["error"]["param"] == "prompt_logprobs" and "stream" in r[4].json()["error"]["message"]
    assert r[5].json()["error"]["param"] == r[6].json()["error"]["param"] == "prompt_logprobs"
