"""Prefix caching on CUDA (replay commit design, CUDA graphs, the demo checkpoint in fp32):
multi-turn conversations sharing a system prompt give the same greedy tokens with the
cache as without it, PP1 and PP2 x none / mtp, and every stage ends with no row, page or
snapshot after a flush. A restore lands where a chunk boundary of the reference does not,
so fp32 keeps the comparison exact but for near-ties (docs/DESIGN.md, "Correctness")."""
import os

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "models", "qwen35-demo")


def _turns(llm, convs, turns=3, max_tokens=24):
    from ppspec.router.types import SamplingParams

    replies = []
    for t in range(turns):
        outs = llm.generate(convs, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        replies.append([o.token_ids for o in outs])
        convs = [c + o.token_ids + [11 + t, 12, 13 + i] for i, (c, o) in enumerate(zip(convs, outs))]
    return replies


@pytest.fixture(scope="module")
def convs():
    import random

    rnd = random.Random(0)
    system = [rnd.randrange(1000) for _ in range(300)]
    return [system + [rnd.randrange(1000) for _ in range(5 + 3 * i)] for i in range(8)]


@pytest.fixture(scope="module")
def reference(convs):
    from ppspec.router.llm import LLM

    return _turns(LLM(DEMO, device="cuda", max_rows=16, chunk_size=128), convs)


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_cached_turns_match_uncached(convs, reference, pp, spec):
    from ppspec.router.llm import LLM

    llm = LLM(DEMO, device="cuda", pp_size=pp, speculative_algorithm=spec, max_rows=16, chunk_size=128,
              enable_prefix_caching=True, prefix_cache_gb=1.0)
    assert all(i["commit_design"] == "replay" for i in llm.pipeline.info_sync())
    assert _turns(llm, convs) == reference
    assert llm.scheduler.cache.hit_tokens > 0
    llm.flush_cache()
    for r in llm.pipeline.runners:
        assert not r.rows_in_use and r.snapshots.used == 0
        for pool in (r.kv, r.mtp_kv):
            if pool is not None:
                assert pool.used_pages == 0


def _staggered(llm, convs, max_tokens=24):
    """The first conversation decodes while the others arrive: their restores from its chunk
    snapshots ride in its decode / verify micro-batches (CUDA graphs for small mixed ones).
    Returns tokens, accept lengths and the steps run."""
    from ppspec.router.types import SamplingParams

    steps, step = [], llm.pipeline.step_sync
    llm.pipeline.step_sync = lambda inp: (steps.append(inp), step(inp))[1]
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    rids = [llm.add_request(convs[0], p)]
    for _ in range(4):
        llm.step()
    rids += [llm.add_request(c, p) for c in convs[1:]]
    while llm.has_unfinished():
        llm.step()
    done = [llm.completions.pop(r) for r in rids]
    return [c.token_ids for c in done], [c.accept_lengths for c in done], steps


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_hits_in_mixed_micro_batches_match_uncached(convs, spec):
    from ppspec.router.llm import LLM

    kw = dict(device="cuda", pp_size=2, speculative_algorithm=spec, max_rows=16, chunk_size=128)
    ref_ids, ref_acc, _ = _staggered(LLM(DEMO, **kw), convs)
    llm = LLM(DEMO, **kw, enable_prefix_caching=True, prefix_cache_gb=1.0)
    ids, acc, steps = _staggered(llm, convs)
    assert any(s.num_prefill and max(s.restore_slots, default=-1) >= 0 for s in steps)
    assert ids == ref_ids and acc == ref_acc  # MTP: every accept length as without hits
    llm.flush_cache()
    assert all(r.snapshots.used == 0 and not r.rows_in_use for r in llm.pipeline.runners)
