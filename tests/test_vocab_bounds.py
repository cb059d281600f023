"""Prompt token ids are bounded by the model's vocabulary (its embedding's rows,
config.json's ``vocab_size``), not by the tokenizer's length, which differs from it in
both directions in real checkpoints: Qwen3.5's embedding has rows no tokenizer id names
(the random checkpoints of tests/checkpoints.py too: 320 rows, 314 tokenizer ids), and a
tokenizer with added tokens can name ids past the embedding.

- An id the model has but the tokenizer lacks (one the model itself generates) is served,
  as vLLM does (it refuses only ids over both bounds).
- An id the tokenizer has but the model lacks is a 400 naming the prompt; it reached the
  first stage, which refused the step and so failed every request of its micro-batch with
  a 500."""
import asyncio
import json
import shutil

import httpx
import pytest
from transformers import AutoTokenizer

from cluster import Cluster
from ppspec.router.llm import LLM
from ppspec.router.scheduler import Scheduler
from ppspec.router.types import InvalidRequestError, SamplingParams

KIND = "granite_a"
MAX_TOKENS = 12


def _reference(path, prompts):
    """PP1 without speculation, greedy, in one process."""
    llm = LLM(path, max_rows=4)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.token_ids for o in outs]


async def _complete_all(url, prompts):
    async with httpx.AsyncClient(timeout=120) as c:
        rs = await asyncio.gather(*(c.post(url + "/v1/completions", json=dict(
            prompt=p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, return_token_ids=True))
            for p in prompts))
    return [(r.status_code, r.json()) for r in rs]


def test_the_scheduler_refuses_a_prompt_id_outside_the_model_vocabulary():
    s = Scheduler(max_rows=4, kv_tokens=1024, max_context=512, page_size=16, vocab_size=320)
    p = SamplingParams(temperature=0.0, max_tokens=4)
    for bad in ([5, 320], [-1, 5]):
        with pytest.raises(InvalidRequestError, match=f"token id {bad[0] if bad[0] < 0 else bad[1]}") as e:
            s.add("bad", bad, p)
        assert e.value.param == "prompt"
    s.add("ok", [5, 319], p)
    assert [r.request_id for r in s.waiting] == ["ok"]


@pytest.mark.slow
def test_an_id_the_model_has_but_the_tokenizer_lacks_is_served(make_ckpt, tmp_path):
    path = make_ckpt(KIND)
    vocab = json.load(open(f"{path}/config.json"))["vocab_size"]
    n_tok = len(AutoTokenizer.from_pretrained(path))
    assert n_tok < vocab
    prompts = [[5, 6, vocab - 1], [7, n_tok, 8, 9]]
    ref = _reference(path, prompts)
    with Cluster(path, 2, "ngram", max_rows=4, kv_tokens=4096, log_dir=str(tmp_path)) as c:
        got = asyncio.run(_complete_all(c.url, prompts))
        infos = c.wait_rows_free()
    assert [s for s, _ in got] == [200, 200], got
    assert [b["choices"][0]["token_ids"] for _, b in got] == ref
    assert all(i.rows_in_use == 0 for i in infos)


@pytest.mark.slow
def test_an_id_the_tokenizer_has_past_the_model_vocabulary_is_a_400_alone(make_ckpt, tmp_path):
    src = make_ckpt(KIND)
    path = tmp_path / "bigtok"
    shutil.copytree(src, path)
    tok = AutoTokenizer.from_pretrained(src)
    tok.add_special_tokens({"additional_special_tokens": [f"<|extra{i}|>" for i in range(12)]})
    tok.save_pretrained(path)
    vocab = json.load(open(path / "config.json"))["vocab_size"]
    assert len(tok) > vocab + 1
    good = [[5, 6, 7, 8], [9, 10, 11], [40, 41, 42, 43, 44]]
    ref = _reference(str(path), good)
    with Cluster(str(path), 1, "none", max_rows=4, kv_tokens=4096, log_dir=str(tmp_path)) as c:
        got = asyncio.run(_complete_all(c.url, [good[0], [5, vocab + 1], good[1], [vocab], good[2]]))
        infos = c.wait_rows_free()
    status = [s for s, _ in got]
    assert status == [200, 400, 200, 400, 200], got
    for _, body in (got[1], got[3]):
        assert body["error"]["param"] == "prompt" and "outside the vocabulary" in body["error"]["message"]
    assert [got[i][1]["choices"][0]["token_ids"] for i in (0, 2, 4)] == ref
    assert all(i.rows_in_use == 0 for i in infos)
