"""Presence, frequency and repetition penalties and logit_bias (``sampler.adjust_logits``).

References: a plain per-token loop of the formulas over random logits; transformers'
``generate(repetition_penalty=...)`` on the same checkpoint; a greedy loop over
transformers' logits with OpenAI's presence / frequency formula. With speculation the
penalties must count the drafts ahead of each verified position, so PP2 with MTP and
n-gram drafts must give the tokens of PP1 without speculation.
"""
from __future__ import annotations

import pytest
import torch

from ppspec.proto.codec import step_from_pb, step_to_pb
from ppspec.proto.messages import SamplingSpec
from ppspec.router.llm import DEMO_MODEL, LLM
from ppspec.router.scheduler import Scheduler
from ppspec.router.types import InvalidRequestError, SamplingParams
from ppspec.stage_server.sampler import adjust_logits, verify_and_sample
from test_model_reference import hf_model

N_NEW = 24


def _reference_row(row, prompt, history, spec):
    """One position's logits by the formulas, token by token."""
    out = row.clone()
    for t, b in zip(spec.logit_bias_ids, spec.logit_bias_values):
        out[t] += b
    counts = {}
    for t in history:
        counts[t] = counts.get(t, 0) + 1
    for t in range(out.numel()):
        seen = t in counts or (spec.repetition_penalty != 1.0 and t in prompt)
        if seen and spec.repetition_penalty != 1.0:
            out[t] = out[t] / spec.repetition_penalty if out[t] > 0 else out[t] * spec.repetition_penalty
        if t in counts:
            out[t] -= counts[t] * spec.frequency_penalty + spec.presence_penalty
    return out


def test_adjust_logits_matches_the_formulas_at_every_draft_position():
    torch.manual_seed(0)
    B, D, V = 3, 4, 50
    logits = torch.randn(B, D, V) * 3
    prompt = [1, 2, 3, 7]
    history = [[5, 5, 9], [], [7, 7, 7, 1]]
    drafts = [[5, 11, 5], [2, 2], [7, 40, 41]]
    specs = []
    for b, (pp, fp, rp) in enumerate([(0.5, 0.3, 1.0), (1.0, -0.5, 1.3), (0.0, 0.0, 0.7)]):
        counts = {}
        for t in history[b]:
            counts[t] = counts.get(t, 0) + 1
        specs.append(SamplingSpec(presence_penalty=pp, frequency_penalty=fp, repetition_penalty=rp,
                                  output_token_ids=list(counts), output_token_counts=list(counts.values()),
                                  prompt_token_ids=sorted(set(prompt)) if rp != 1.0 else [],
                                  logit_bias_ids=[3, 40] if b == 2 else [], logit_bias_values=[2.5, -7.0] if b == 2 else []))
    got = adjust_logits(logits, drafts, specs, [len(h) for h in history])
    assert not torch.equal(got, logits)
    for b in range(B):
        for j in range(min(D, len(drafts[b]) + 1)):
            ref = _reference_row(logits[b, j], set(prompt), history[b] + drafts[b][:j], specs[b])
            torch.testing.assert_close(got[b, j], ref, rtol=1e-6, atol=1e-6)
    # nothing asked: the very same tensor, not a copy
    assert adjust_logits(logits, drafts, [SamplingSpec()] * B, [0] * B) is logits


def test_fp16_logits_are_adjusted_in_fp32():
    """A strong repetition penalty on fp16 logits of 10 and 20 gives 1280 and 2560: beyond
    nothing in fp32, but a 128x of 600 would be inf in fp16 and tie with every other."""
    logits = torch.zeros(1, 1, 12, dtype=torch.float16)
    logits[0, 0, 5], logits[0, 0, 9], logits[0, 0, 3] = 600.0, 610.0, 1.0
    spec = SamplingSpec(repetition_penalty=1 / 128, prompt_token_ids=[5, 9], output_token_ids=[3],
                        output_token_counts=[1])
    got = adjust_logits(logits, [[]], [spec], [1])
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert got[0, 0, 9] == 610.0 * 128 and got[0, 0, 5] == 600.0 * 128 and got[0, 0, 3] == 128.0
    assert verify_and_sample(logits, torch.empty(1, 0, dtype=torch.long), [0], [spec], [1])[0].tokens == [9]


def test_a_penalty_turns_a_greedy_acceptance():
    """Draft 5 is the argmax at position 1 without penalties; having just been drafted at
    position 0 it is penalised there, so the verify must reject it."""
    V = 10
    logits = torch.zeros(1, 3, V)
    logits[0, :, 5] = 2.0
    logits[0, :, 6] = 1.5
    drafts = torch.tensor([[5, 5]])
    plain = verify_and_sample(logits, drafts, [2], [SamplingSpec()], [0])[0].tokens
    assert plain == [5, 5, 5]
    spec = SamplingSpec(frequency_penalty=1.0)
    assert verify_and_sample(logits, drafts, [2], [spec], [0])[0].tokens == [5, 6]


def test_the_router_sends_the_history_and_the_codec_keeps_it():
    s = Scheduler(max_rows=2, kv_tokens=1000, max_context=100)
    p = SamplingParams(temperature=0, max_tokens=8, presence_penalty=0.5, frequency_penalty=0.25,
                       repetition_penalty=1.2, logit_bias={4: 3.0})
    s.add("a", [9, 8, 9], p)
    b = s.schedule(0)
    s.process(b, [[4]])
    b = s.schedule(0)
    s.process(b, [[4]])
    b = s.schedule(0)
    spec = step_from_pb(step_to_pb(b.step_input([2]))).sampling[0]
    assert (spec.output_token_ids, spec.output_token_counts, spec.prompt_token_ids) == ([4], [2], [8, 9])
    assert (spec.presence_penalty, spec.frequency_penalty) == (0.5, 0.25)
    assert abs(spec.repetition_penalty - 1.2) < 1e-6 and spec.logit_bias_ids == [4] and spec.logit_bias_values == [3.0]
    s.process(b, [[5]])  # back before "b" is scheduled: a lane's next micro-batch holds both
    s.add("b", [1], SamplingParams(temperature=0, max_tokens=8))
    plain = step_from_pb(step_to_pb(s.schedule(0).step_input([2]))).sampling
    assert plain[-1] == SamplingSpec(seed=plain[-1].seed, banned_until_min=[2])  # nothing sent without a penalty


@pytest.mark.parametrize("bad,param", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=True), "repetition_penalty"),
    (dict(repetition_penalty=1e-40), "repetition_penalty"), (dict(repetition_penalty=1e300), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={3: 101.0}), "logit_bias"),
    (dict(logit_bias=[3]), "logit_bias"),
])
def test_bad_penalties_are_refused_by_name(bad, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**bad).validate()
    assert e.value.param == param


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return make_ckpt("qwen3_5_ratio1")


# no token 0: transformers' generate would take it for padding
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [11, 12, 11, 12, 11, 12], [7] * 5 + [8] * 3]


def test_repetition_penalty_equals_transformers_generate(ckpt):
    torch.set_num_threads(1)
    model = hf_model(ckpt)
    p = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, repetition_penalty=1.8)
    outs = LLM(ckpt, max_rows=4).generate(PROMPTS, p)
    plain = LLM(ckpt, max_rows=4).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True))
    with torch.no_grad():
        for prompt, out, base in zip(PROMPTS, outs, plain):
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=N_NEW, min_new_tokens=N_NEW, do_sample=False,
                                 repetition_penalty=1.8, pad_token_id=0)[0, len(prompt):].tolist()
            assert out.token_ids == ref
    assert any(o.token_ids != b.token_ids for o, b in zip(outs, plain)), "the penalty changed nothing"


def _openai_greedy(model, prompt, n, presence, frequency):
    ids, counts = list(prompt), {}
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].clone()
            for t, c in counts.items():
                logits[t] -= c * frequency + presence
            t = int(logits.argmax())
            counts[t] = counts.get(t, 0) + 1
            ids.append(t)
    return ids[len(prompt):]


@pytest.mark.parametrize("model,pp,spec", [("random", 1, "none"), ("random", 2, "ngram"), ("demo", 2, "mtp")])
def test_presence_and_frequency_penalties_match_a_transformers_loop(ckpt, model, pp, spec):
    """On the demo checkpoint its MTP head's drafts are accepted often under the penalties,
    so a verify that did not count the drafts ahead of a position would part from the
    loop (checked: it does); on the random one n-gram drafts (repeats) must be rejected."""
    torch.set_num_threads(1)
    path = DEMO_MODEL if model == "demo" else ckpt
    bias = {13: -2.0}
    p = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.3,
                       logit_bias=bias)
    outs = LLM(path, max_rows=4, pp_size=pp, speculative_algorithm=spec).generate(PROMPTS, p)
    ref_model = _biased(hf_model(path), bias)
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == _openai_greedy(ref_model, prompt, N_NEW, 0.5, 0.3)
    if spec == "mtp":
        assert sum(sum(o.accept_lengths) - len(o.accept_lengths) for o in outs) >= 20


def _biased(model, bias):
    class Biased(torch.nn.Module):
        def forward(self, ids):
            out = model(ids)
            for t, b in bias.items():
                out.logits[..., t] += b
            return out
    return Biased()


def test_logit_bias_forces_and_bans_tokens(ckpt):
    torch.set_num_threads(1)
    llm = LLM(ckpt, max_rows=4, speculative_algorithm="mtp")
    forced = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.7, seed=3, max_tokens=10, ignore_eos=True,
                                                      logit_bias={42: 100.0}))[0]
    assert forced.token_ids == [42] * 10
    plain = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].token_ids
    banned = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                      logit_bias={plain[0]: -100.0}))[0].token_ids
    assert plain[0] not in banned


def test_a_logit_bias_outside_the_vocabulary_is_refused_before_queueing(ckpt):
    llm = LLM(ckpt, max_rows=2)
    with pytest.raises(ValueError, match="logit_bias: token ids must be ints in"):
        llm.add_request([1, 2], SamplingParams(logit_bias={llm.vocab_size: 1.0}))
    assert not llm.scheduler.requests
