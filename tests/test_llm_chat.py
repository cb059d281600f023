"""``LLM.chat`` renders conversations with the checkpoint's chat template, and ``n``
samples per prompt are the requests one would send one by one (seed + i for sample i)."""
import pytest
import torch

from ppspec.router.llm import DEMO_MODEL, LLM
from ppspec.router.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    torch.set_num_threads(1)
    return LLM(DEMO_MODEL, max_rows=8, kv_tokens=4096)


def test_chat_renders_the_template_and_answers_as_generate(llm):
    convs = [[{"role": "user", "content": "Hello there"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]]
    # the demo checkpoint's template (Qwen's ChatML), written out
    texts = ["<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n",
             "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"]
    out = llm.chat(convs, GREEDY)
    ref = llm.generate([llm.tokenizer.encode(t) for t in texts], GREEDY)
    assert [c.prompt_ids for c in out] == [c.prompt_ids for c in ref]
    assert [c.token_ids for c in out] == [c.token_ids for c in ref]
    assert [c.text for c in out] == [llm.tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in ref]
    assert all(c.text for c in out)  # ignore_eos, 8 tokens: some text
    one = llm.chat(convs[0], GREEDY)  # a single conversation
    assert len(one) == 1 and one[0].token_ids == out[0].token_ids
    with pytest.raises(TypeError, match="messages must be"):
        llm.chat("Hello", GREEDY)


def test_n_samples_are_the_seeded_requests(llm):
    prompts = [[5, 9, 14, 3], [40, 41, 42]]
    seeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=11)
    out = llm.generate(prompts, seeded, n=3)
    assert len(out) == 6
    for p in range(2):
        for i in range(3):
            alone = llm.generate([prompts[p]], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True,
                                                              seed=11 + i))[0]
            assert out[3 * p + i].token_ids == alone.token_ids, (p, i)
    assert len({tuple(c.token_ids) for c in out[:3]}) > 1  # three samples, not one three times
    greedy = llm.generate(prompts, GREEDY, n=2)
    assert greedy[0].token_ids == greedy[1].token_ids
    with pytest.raises(ValueError, match="n must be"):
        llm.generate(prompts, GREEDY, n=0)
