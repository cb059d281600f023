"""Seeded sampling does not depend on speculation: with a seed, each output position's token
is the Gumbel-max pick under noise keyed by (seed, position), and a draft is accepted only
when it equals that pick (``stage_server/sampler.py``). So PP1 without speculation, PP3 with
MTP, PP2 with n-gram drafts and PP2 with drafts that are mostly right (an oracle, so that
long accepts really happen) give the same tokens, request for request, at temperature 0.8
with top-p / top-k / min-p variants. The distribution itself is checked by the chi-square
tests of ``tests/test_commit_and_sampling.py``."""
import random

import torch

from ppspec.router.llm import LLM
from ppspec.router.types import SamplingParams
from ppspec.stage_server.sampler import exponential_noise

CKPT = "qwen3_5_ratio2_7l"
N_REQ = 32
VARIANTS = [dict(), dict(top_p=0.9), dict(top_k=20), dict(top_k=50, top_p=0.95), dict(min_p=0.05)]


def workload():
    rnd = random.Random(7)
    reqs = []
    for i in range(N_REQ):
        n = rnd.choice([3, 9, 17, 40])
        prompt = [rnd.randrange(256) for _ in range(n)]
        if i % 4 == 0:  # repetitive prompts give the n-gram drafter something to find
            prompt = (prompt[:5] * 10)[:n]
        params = SamplingParams(temperature=0.8, max_tokens=rnd.randint(8, 24), ignore_eos=True,
                                seed=1000 + 17 * i, **VARIANTS[i % len(VARIANTS)])
        reqs.append((prompt, params, rnd.randint(0, 6)))
    return reqs


def drive(llm, reqs):
    """Add requests at their join step, step until all finish; returns token lists."""
    ids, step = {}, 0
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i][2])
    while pending or llm.has_unfinished():
        while pending and reqs[pending[0]][2] <= step:
            i = pending.pop(0)
            ids[i] = llm.add_request(reqs[i][0], reqs[i][1], request_id=f"r{i}")
        llm.step()
        step += 1
    return [llm.completions[ids[i]].token_ids for i in range(len(reqs))]


class Oracle:
    """Drafts of the reference continuation, one of every four rounds with a wrong token."""

    def __init__(self, reference):
        self.ref, self.rounds = reference, 0

    def __call__(self, req, k):
        i, n = int(req.request_id[1:]), len(req.output_ids)
        drafts = list(self.ref[i][n: n + k])
        self.rounds += 1
        if drafts and self.rounds % 4 == 0:
            drafts[-1] = (drafts[-1] + 1) % 256
        return drafts


def accepted_drafts(llm):
    """Drafts accepted so far, counted from the scheduler's verify rounds."""
    seen = []
    orig = llm.scheduler.process

    def process(batch, *a, **kw):
        up = orig(batch, *a, **kw)
        if batch.mode == "verify":
            seen.extend(a - 1 for a in up.accept_lengths)
        return up

    llm.scheduler.process = process
    return seen


def test_seeded_tokens_are_the_same_with_any_speculation_and_pp(make_ckpt):
    torch.set_num_threads(1)
    path = make_ckpt(CKPT)
    reqs = workload()
    ref = drive(LLM(path, max_rows=N_REQ), reqs)
    assert len({tuple(t) for t in ref}) == N_REQ
    runs = {
        "pp3-mtp": dict(pp_size=3, speculative_algorithm="mtp", num_speculative_steps=3),
        "pp2-ngram": dict(pp_size=2, speculative_algorithm="ngram", num_speculative_steps=3),
        "pp2-oracle": dict(pp_size=2, num_micro_batches=2, speculative_algorithm="ngram", num_speculative_steps=3,
                           drafter=Oracle(ref)),
    }
    for name, kw in runs.items():
        llm = LLM(path, max_rows=N_REQ, **kw)
        acc = accepted_drafts(llm)
        got = drive(llm, reqs)
        diff = [i for i in range(N_REQ) if got[i] != ref[i]]
        assert not diff, (name, diff[:4], [(ref[i], got[i]) for i in diff[:2]])
        assert acc, f"{name}: nothing was verified"
        if name == "pp2-oracle":
            assert max(acc) == 3 and sum(acc) > N_REQ, acc  # long accepts of sampled tokens happened
        assert all(u == 0 for u in llm.rows_in_use())


def test_noise_is_a_function_of_seed_position_and_token():
    """The noise of a (seed, position) row is the same whichever rows are drawn with it and
    whatever the vocabulary cut; rows of other positions or seeds differ; values are Exp(1)."""
    a = exponential_noise(5, [3, 4, 9], 1000, "cpu")
    assert torch.equal(a[1], exponential_noise(5, [4], 1000, "cpu")[0])
    assert torch.equal(a[2, :100], exponential_noise(5, [9], 100, "cpu")[0])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], exponential_noise(6, [3], 1000, "cpu")[0])
    assert not torch.equal(a[0], exponential_noise(5 + (1 << 32), [3], 1000, "cpu")[0])
    big = exponential_noise(1, [0, 1, 2, 3], 50000, "cpu")
    assert (big > 0).all() and abs(big.mean().item() - 1) < 0.01 and abs(big.var().item() - 1) < 0.02
