"""The stage warm-up (``stage_server.warmup``) leaves nothing behind: no row in use, no KV
page or prefix-cache snapshot taken, no verify awaiting its commit, busy time unchanged; and greedy generation after
it gives the tokens of a PP1 run without speculation on stages that never warmed up."""
import pytest
import torch

from ppspec.router.llm import LLM
from ppspec.router.pipeline import InProcessPipeline
from ppspec.router.types import SamplingParams
from ppspec.stage_server.runner import StageRunner
from ppspec.stage_server.warmup import warm_up

from cluster import DEMO

PROMPTS = [[5, 9, 14, 3, 8, 2, 7], list(range(40, 75)), [11, 12, 13, 11, 12, 13, 11, 12]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.mark.parametrize("design", ["copy", "replay"])
def test_warm_up_leaves_no_state_and_changes_no_token(design):
    reference = [c.token_ids for c in LLM(DEMO, max_rows=8, kv_tokens=4096).generate(PROMPTS, GREEDY)]
    runners = [StageRunner(DEMO, k, 2, max_rows=8, kv_tokens=4096, num_speculative_steps=3, use_mtp=True,
                           commit_design=design, strict_lengths=True, prefix_cache_gb=0.05) for k in range(2)]
    for r in runners:
        busy = r.busy_seconds
        assert warm_up(r) > 0
        info = r.info()
        assert info["rows_in_use"] == 0 and info["kv_pages_used"] == 0 and info["snapshots_in_use"] == 0, info
        assert not r._verify_open and not r.broken_rows and not r.row_lens
        assert r.mtp_kv is None or r.mtp_kv.used_pages == 0
        assert r.busy_seconds == busy
    llm = LLM(DEMO, pp_size=2, speculative_algorithm="mtp", max_rows=8, kv_tokens=4096,
              pipeline=InProcessPipeline(runners))
    out = llm.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in out] == reference
    assert llm.rows_in_use() == [0, 0]
