"""``served_vs_engine.closed_loop``: the engine driven by clients in a closed loop, as
``ppspec bench`` drives a server, generates what ``LLM.generate`` does for the same prompts,
and its micro-batches hold no more requests than there are clients."""
import torch

from ppspec.bench.served_vs_engine import closed_loop, make_tiny
from ppspec.router.llm import LLM
from ppspec.router.types import SamplingParams


def test_closed_loop_generates_every_prompt_with_at_most_its_clients_per_micro_batch(tmp_path):
    torch.set_num_threads(1)
    llm = LLM(make_tiny(str(tmp_path / "tiny")), max_rows=8, kv_tokens=4096)
    prompts = [[5 + i, 9, 11 + 2 * i, 7] * (1 + i % 3) for i in range(7)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens, seconds, rounds = closed_loop(llm, prompts, params, concurrency=3)
    ref = llm.generate(prompts, params)
    assert tokens == sum(len(c.token_ids) for c in ref) == 7 * 6 and seconds > 0
    # 3 clients: at most 3 tokens a micro-batch (no speculation); each finish lets the next
    # prompt in, so most micro-batches hold 3
    assert 42 / 3 <= rounds <= 42 / 2
    assert llm.scheduler.num_running == 0 and llm.scheduler.num_waiting == 0
