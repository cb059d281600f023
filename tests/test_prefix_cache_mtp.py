"""The MTP head after a prefix-cache hit: a snapshot keeps the head's KV of the prefix (its
pages in the head's pool, position ``n - 1`` computed with token ``n``, which is why a slot
is filed under ``n + 1`` tokens), and the head's first draft after the hit comes from the
prompt's last position, which the prefill after the hit computes. So a hit changes no
draft: on the demo checkpoint (a trained MTP head) every request's accept length of every
round is the same with the cache as without, mid-prompt hits and hits on a finished turn
included."""
from __future__ import annotations

import pytest
import torch

from ppspec.router.llm import DEMO_MODEL, LLM
from ppspec.router.types import SamplingParams
from test_prefix_cache import assert_all_free

SYSTEM = "<|im_start|>system\nYou are a helpful assistant who answers briefly.<|im_end|>\n"
QUESTIONS = [["How do I bake bread?", "And without yeast?"],
             ["What is the capital of France?", "Tell me about its museums."],
             ["Write a poem about the sea.", "Make it shorter."]]


def chat_turns(llm, tok):
    """Two turns of three conversations (sharing a system prompt), greedy, MTP. Returns per
    request (turn, conversation) its tokens, accept lengths and cached prompt tokens."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    user = lambda m: enc(f"<|im_start|>user\n{m}<|im_end|>\n<|im_start|>assistant\n")  # noqa: E731
    prompts = [enc(SYSTEM) + user(q[0]) for q in QUESTIONS]
    out = []
    for t in range(2):
        rids = []
        for i, p in enumerate(prompts):
            rids.append(llm.add_request(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)))
            if t == 0 and i == 0:
                for _ in range(3):  # the first prompt's chunk snapshots serve the others
                    llm.step()
        reqs = [llm.scheduler.requests[r] for r in rids]
        while llm.has_unfinished():
            llm.step()
        for i, (rid, req) in enumerate(zip(rids, reqs)):
            c = llm.completions.pop(rid)
            out.append((c.token_ids, c.accept_lengths, req.cached_tokens))
            prompts[i] = prompts[i] + c.token_ids + enc("<|im_end|>\n") + user(QUESTIONS[i][1])
    return out


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL)


def test_a_hit_keeps_every_accept_length(tok):
    torch.set_num_threads(1)
    off = chat_turns(LLM(DEMO_MODEL, speculative_algorithm="mtp", chunk_size=16), tok)
    llm = LLM(DEMO_MODEL, pp_size=2, speculative_algorithm="mtp", chunk_size=16, enable_prefix_caching=True)
    on = chat_turns(llm, tok)
    assert [o[0] for o in on] == [o[0] for o in off]
    cached = [o[2] for o in on]
    assert cached[0] == 0 and min(cached[1:3]) > 0 and min(cached[3:]) > 0  # mid-prompt, then finished turns
    rounds = [a for o in off for a in o[1]]
    assert sum(rounds) / len(rounds) > 1.5  # a head that drafts: a wrong KV would show
    assert [o[1] for o in on] == [o[1] for o in off]
    assert_all_free(llm)
