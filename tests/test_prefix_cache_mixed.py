"""Prefill chunks in mixed micro-batches (a decode or verify micro-batch with prefill chunks
in its tail, ``StepInput.num_prefill``) keep what goes with a chunk: a prefix-cache restore
(the snapshot copied into the row before the chunk) and a snapshot after it, and the prompt
log-probabilities of an ``echo`` request. Greedy tokens are those of PP1 without
speculation or cache; the prompt log-probabilities those of the prompt prefilled alone."""
from __future__ import annotations

import pytest
import torch

from ppspec.router.llm import LLM
from ppspec.router.types import SamplingParams
from test_prefix_cache import CHUNK, CKPT, assert_all_free, conversations, multi_turn


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt(CKPT)


def record_steps(llm) -> list:
    """Every StepInput the pipeline runs, in order."""
    seen, step = [], llm.pipeline.step_sync

    def rec(inp):
        seen.append(inp)
        return step(inp)

    llm.pipeline.step_sync = rec
    return seen


@pytest.mark.parametrize("spec", ["none", "ngram", "mtp"])
def test_hits_and_snapshots_ride_in_mixed_micro_batches(ckpt, spec):
    """The first conversation decodes while the others' prompts prefill beside it: their
    restores from its chunk snapshots, and their own chunk snapshots, go in decode / verify
    micro-batches; the next turns restore the finished turns' snapshots there too. One lane
    over the two stages, so that every request shares the decoding conversation's lane
    (with two, a request that hits joins the lane forming its micro-batch, which may hold
    only other prompts' chunks: ``Scheduler._admit``; that case rides in a decode
    micro-batch in tests/test_lanes.py)."""
    ref = multi_turn(LLM(ckpt, chunk_size=CHUNK), conversations())[0]
    llm = LLM(ckpt, pp_size=2, speculative_algorithm=spec, chunk_size=CHUNK, enable_prefix_caching=True,
              num_micro_batches=1)
    steps = record_steps(llm)
    replies, cached = multi_turn(llm, conversations())
    assert replies == ref
    assert cached[0] == [0, 32, 32, 44] and all(c > 0 for turn in cached[1:] for c in turn)
    mixed = [s for s in steps if s.num_prefill]
    restores = [s for s in mixed if max(s.restore_slots, default=-1) >= 0]
    snapshots = [s for s in mixed if max(s.snapshot_slots, default=-1) >= 0]
    assert restores and snapshots
    for s in restores + snapshots:  # the slots name prefill chunks only
        k = len(s.req_pool_indices) - s.num_prefill
        assert max((s.restore_slots or [-1])[:k] + (s.snapshot_slots or [-1])[:k]) == -1
    assert_all_free(llm)


def test_prompt_logprobs_of_chunks_in_mixed_micro_batches(ckpt):
    """An ``echo`` request's prompt prefills in 8-token chunks beside another request's
    decodes: it gets every prompt token's log-probability, as when it prefills alone."""
    llm = LLM(ckpt, chunk_size=8, mixed_prefill_tokens=8)
    steps = record_steps(llm)
    prompt = [(7 * i + 3) % 200 for i in range(29)]
    echo = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)

    def run(with_decoder: bool):
        if with_decoder:
            llm.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
            llm.step()
        rid = llm.add_request(prompt, echo)
        got = None
        while llm.has_unfinished():
            for o in llm.step():
                if o.request_id == rid and o.prompt_logprobs is not None:
                    got = o.prompt_logprobs
        return got, llm.completions[rid].token_ids

    mixed_lps, mixed_ids = run(True)
    row_chunks = [s for s in steps if s.num_prefill and s.sampling[-1].prompt_logprobs == 2]
    assert len(row_chunks) >= 2  # the prompt's chunks rode beside the decodes
    del steps[:]
    alone_lps, alone_ids = run(False)
    assert not any(s.num_prefill for s in steps)
    assert mixed_ids == alone_ids
    assert [x.token_id for x in mixed_lps] == [x.token_id for x in alone_lps] == prompt[1:]
    torch.testing.assert_close(torch.tensor([x.logprob for x in mixed_lps]),
                               torch.tensor([x.logprob for x in alone_lps]), atol=1e-4, rtol=0)
    assert [[t for t, _ in x.top] for x in mixed_lps] == [[t for t, _ in x.top] for x in alone_lps]


def test_a_slot_for_a_decode_row_of_a_mixed_step_is_refused(ckpt):
    """Prefix-cache slots name prefill chunks: one for a decode row of a mixed micro-batch
    (or a list of another length) is refused before anything changes."""
    from ppspec.proto.messages import StepInput
    from ppspec.stage_server.runner import StageRunner

    s = StageRunner(ckpt, max_rows=4, kv_tokens=256, prefix_cache_gb=0.001)
    s.step(StepInput(0, 0, "prefill", [0], [0], [3], [1, 2, 3]))
    for name, slots in (("restore_slots", [0, -1]), ("snapshot_slots", [1, -1]), ("snapshot_slots", [-1])):
        with pytest.raises(ValueError, match=f"{name}: .* slots go with prefill chunks only"):
            s.step(StepInput(0, 1, "decode", [0, 1], [3, 0], [1, 2], [4, 5, 6], num_prefill=1, **{name: slots}))
    assert s.rows_in_use == {0} and s.row_lens[0] == 3 and s.snapshots.used == 0
