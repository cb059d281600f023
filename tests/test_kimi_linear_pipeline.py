"""Kimi Linear through the pipeline: greedy tokens with speculation and PP equal PP1 without
speculation, in process (oracle drafts forcing every accept length, requests joining and
leaving, both commit designs) and over real stage processes (n-gram drafts, concurrent
requests); the commit faults are caught as on the GDN family; prefix-cache hits change no
token."""
import pytest
import torch

from cluster import Cluster, sharegpt_prompts
from ppspec.router.llm import LLM
from ppspec.router.types import SamplingParams
from ppspec.stage_server.runner import FAULTS
from test_pipeline import complete, divergences
from test_prefix_cache import CHUNK, assert_all_free, conversations, multi_turn
from test_spec_invariance import Oracle, drive, workload

CKPT = "kimi_moe_5l"  # 5 layers: PP 2, 3, 4 split them unevenly
N_REQ = 10


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup(make_ckpt):
    path = make_ckpt(CKPT)
    reqs = workload(seed=5)[:N_REQ]
    return path, reqs, drive(LLM(path, max_rows=N_REQ), reqs)


@pytest.mark.parametrize("pp,design", [(1, "replay"), (2, "copy"), (3, "copy"), (4, "replay")])
def test_oracle_drafts_match_no_speculation(setup, pp, design):
    path, reqs, ref = setup
    oracle = Oracle(ref, seed=2)
    llm = LLM(path, pp_size=pp, num_micro_batches=2, max_rows=N_REQ, speculative_algorithm="ngram",
              num_speculative_steps=3, drafter=oracle, commit_design=design)
    assert drive(llm, reqs) == ref
    assert {k for _, _, k in oracle.log} >= {"none", "all", "first_wrong", "mid_wrong"}
    assert all(u == 0 for u in llm.rows_in_use())


@pytest.mark.parametrize("design", ["copy", "replay"])
@pytest.mark.parametrize("fault", FAULTS)
def test_invariance_catches_the_commit_bugs(setup, fault, design):
    path, reqs, ref = setup
    llm = LLM(path, pp_size=2, num_micro_batches=2, max_rows=N_REQ, speculative_algorithm="ngram",
              num_speculative_steps=3, drafter=Oracle(ref, seed=3), fault=fault, commit_design=design)
    assert sum(o != r for o, r in zip(drive(llm, reqs), ref)) > 0, f"fault {fault} went unnoticed"


@pytest.mark.parametrize("design", ["copy", "replay"])
def test_prefix_cache_hits_change_no_token(setup, design):
    """Multi-turn conversations sharing a system prompt: with the prefix cache (snapshots of
    the KDA state and conv windows, the MLA latent pages shared) the replies are those
    without it, at PP2 with n-gram drafts; nothing is held once the cache is flushed."""
    path = setup[0]
    ref = multi_turn(LLM(path, chunk_size=CHUNK), conversations())[0]
    llm = LLM(path, chunk_size=CHUNK, enable_prefix_caching=True, pp_size=2, speculative_algorithm="ngram",
              commit_design=design)
    replies, cached = multi_turn(llm, conversations())
    assert replies == ref and sum(cached[-1]) > 0
    assert_all_free(llm)


@pytest.fixture(scope="module")
def processes_ref(make_ckpt):
    from transformers import AutoTokenizer

    path = make_ckpt(CKPT)
    prompts = sharegpt_prompts(AutoTokenizer.from_pretrained(path), 8, seed=2, max_len=64)
    outs = LLM(path, max_rows=16).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2))
    gaps = [[lp.top[0][1] - lp.top[1][1] for lp in o.logprobs] for o in outs]
    return path, prompts, [o.token_ids for o in outs], gaps


@pytest.mark.slow
@pytest.mark.parametrize("pp", [2, 3, 4])
def test_stage_processes_with_ngram_match_pp1(processes_ref, pp, tmp_path):
    path, prompts, ref, gaps = processes_ref
    with Cluster(path, pp, "ngram", max_rows=16, log_dir=str(tmp_path)) as c:
        outs = complete(c.url, prompts, max_tokens=24)
        infos = c.wait_rows_free()
    real, _ = divergences(outs, ref, gaps)
    assert not real, f"divergences beyond near-ties at (request, position) {real}"
    assert all(i.rows_in_use == 0 and i.kv_pages_used == 0 for i in infos)


@pytest.mark.slow
@pytest.mark.parametrize("fault,design", [("positional_scratch", "replay"), ("skip_commit", "copy"),
                                          ("stale_rows", "replay")])
def test_stage_processes_catch_the_commit_bugs(processes_ref, fault, design, tmp_path):
    """Over real processes the same comparison fails when the non-last stages skip their
    commit, commit the verify's batch positions instead of its rows (replay design: the
    positions' pending counters), or commit another micro-batch's rows."""
    path, prompts, ref, gaps = processes_ref
    with Cluster(path, 3, "ngram", max_rows=16, fault=fault, commit_design=design, log_dir=str(tmp_path)) as c:
        outs = complete(c.url, prompts, max_tokens=24)
    real, _ = divergences(outs, ref, gaps)
    assert real, f"fault {fault} went unnoticed"
