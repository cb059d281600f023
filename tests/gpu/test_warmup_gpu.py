"""The stage warm-up on CUDA (``stage_server.warmup``): with CUDA graphs, the replay commit
and MTP, it leaves nothing behind (no row, no KV page, no pending replay) and fp32 greedy
tokens after it are those of the same pipeline that never warmed up (the same kernels and
batches: identical, near-ties included)."""
import os

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(ROOT, "models", "qwen35-demo")
PROMPTS = [[5, 9, 14, 3, 8, 2, 7] * (1 + i % 3) for i in range(8)] + [list(range(40, 140))]


def test_warm_up_on_cuda_leaves_no_state_and_changes_no_token():
    from ppspec.router.llm import LLM
    from ppspec.router.pipeline import InProcessPipeline
    from ppspec.router.types import SamplingParams
    from ppspec.stage_server.runner import StageRunner
    from ppspec.stage_server.warmup import warm_up

    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    cold = LLM(DEMO, device="cuda", pp_size=2, speculative_algorithm="mtp", max_rows=16)
    ref = [c.token_ids for c in cold.generate(PROMPTS, params)]
    del cold
    runners = [StageRunner(DEMO, k, 2, device="cuda", max_rows=16, num_speculative_steps=3, use_mtp=True,
                           strict_lengths=True) for k in range(2)]
    for r in runners:
        assert r.commit_design == "replay" and r.graphs
        assert warm_up(r) > 0
        i = r.info()
        assert i["rows_in_use"] == 0 and i["kv_pages_used"] == 0 and not r._verify_open and not r.broken_rows
        assert r.mtp_kv is None or r.mtp_kv.used_pages == 0
    llm = LLM(DEMO, device="cuda", pp_size=2, speculative_algorithm="mtp", max_rows=16,
              pipeline=InProcessPipeline(runners))
    assert [c.token_ids for c in llm.generate(PROMPTS, params)] == ref
    assert llm.rows_in_use() == [0, 0]
    torch.cuda.synchronize()
