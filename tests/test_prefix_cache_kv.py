"""The KV budget with the prefix cache charges a page once, whoever holds it
(``router.kv_ledger``): the pages of a shared system prompt that a snapshot and every
request restored from it hold are one set of pages on every stage, so requests that fit
run together; and the router's figure is never below what any stage's pool holds."""
from __future__ import annotations

import torch

from ppspec.router.kv_ledger import PageLedger
from ppspec.router.llm import LLM
from ppspec.router.types import SamplingParams
from test_prefix_cache import CKPT, assert_all_free


def test_shared_prompt_pages_are_charged_once(make_ckpt):
    """Six requests share a 64-token system prompt on a pool of 20 pages of 16 tokens: each
    needs 5 pages alone (4 of them the prompt's), so charged per request they would run one
    or two at a time; charged once, the five that arrive together all run at once."""
    torch.set_num_threads(1)
    ckpt = make_ckpt(CKPT)
    system = [(5 * i + 1) % 250 for i in range(64)]
    prompts = [system + [200 + i, 201, 202, 203 + i, 204] for i in range(6)]
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = [o.token_ids for o in LLM(ckpt, chunk_size=16).generate(prompts, p)]
    llm = LLM(ckpt, chunk_size=16, enable_prefix_caching=True, kv_tokens=320)
    sched = llm.scheduler
    first = llm.add_request(prompts[0], p)
    while llm.has_unfinished():
        llm.step()
    rids = [llm.add_request(q, p) for q in prompts[1:]]
    most = 0
    while llm.has_unfinished():
        llm.step()
        most = max(most, sched.num_running)
        for r in llm.pipeline.runners:  # never less than a stage's pool really holds
            assert r.kv.used_pages * r.kv.page_size <= sched.kv_reserved <= sched.kv_tokens
    assert [llm.completions[r].token_ids for r in [first] + rids] == ref
    assert most == 5 and sched.num_preemptions == 0
    assert sched.cache.hit_tokens >= 5 * 48
    assert_all_free(llm)


def test_ledger_counts_a_shared_page_once():
    k = PageLedger(page_size=4)
    assert k.grow(("row", 0), 10) == 12                # 3 pages
    k.take(("slot", 0), ("row", 0), 9)                 # the row's 3 pages, the partial one too
    assert k.used == 12 and k.freed_by([("row", 0)]) == 0
    k.share(("row", 1), ("slot", 0), 9)                # its 2 whole pages shared
    assert k.grow(("row", 1), 16) == 8 and k.used == 20  # a copy of the partial page, one more
    assert k.release(("row", 0)) == 0                  # the snapshot keeps all three
    assert k.freed_by([("slot", 0)]) == 4              # only the partial page is the snapshot's alone
    assert k.release(("slot", 0)) == 4 and k.release(("row", 1)) == 16 and k.used == 0


def test_a_new_request_evicts_cached_prefixes_while_others_run(make_ckpt):
    """Four finished requests' snapshots fill most of a 16-page pool; a request arriving
    while another decodes is admitted at once, evicting least recently used snapshots (as
    vLLM counts cached blocks no request uses as free), instead of waiting until nothing
    runs."""
    torch.set_num_threads(1)
    ckpt = make_ckpt(CKPT)
    old = [[(7 * i + 13 * k) % 250 for i in range(30)] for k in range(4)]
    a, b = [(3 * i + 1) % 250 for i in range(20)], [(11 * i + 5) % 250 for i in range(30)]
    pa, pb = (SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 10))
    ref = LLM(ckpt, chunk_size=16)
    want = [ref.generate([a], pa)[0].token_ids, ref.generate([b], pb)[0].token_ids]
    llm = LLM(ckpt, chunk_size=16, enable_prefix_caching=True, kv_tokens=256)
    sched = llm.scheduler
    for q in old:
        llm.generate([q], pb)
    assert sched.kv_reserved >= 160  # the snapshots' pages
    ra = llm.add_request(a, pa)
    for _ in range(3):
        llm.step()
    rb = llm.add_request(b, pb)
    for _ in range(2):  # the evicted slots' pages come back once every stage dropped them
        llm.step()
    assert sched.num_running == 2 and sched.requests[rb].status == "running"  # a still decodes
    while llm.has_unfinished():
        llm.step()
    assert [llm.completions[r].token_ids for r in (ra, rb)] == want
    assert_all_free(llm)
