"""Sampling and speculative acceptance on the last stage.

One function covers every mode: a prefill or plain decode is a verify of ``D = 1`` with no
draft. Drafts are deterministic (n-gram lookup, argmax MTP), so the draft distribution is
one-hot and speculative rejection sampling (Leviathan et al., "Fast Inference from
Transformers via Speculative Decoding", ICML 2023, Algorithm 1) reduces to: accept draft
``d`` with probability ``p(d)``; on rejection sample from ``p`` with ``d`` removed,
renormalised; after the last accepted draft sample a bonus token from ``p``. The output
distribution equals the target's (tested with a chi-square test).

Sampling is a pure function of ``(seed, output position)``: each draw uses a generator
seeded from the request's seed and the index of the token it produces, so results do not
depend on batch composition or on which process samples.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ppspec.proto.messages import SamplingSpec

_MASK64 = (1 << 64) - 1


def _generator(seed: int, position: int, kind: int) -> torch.Generator:
    g = torch.Generator()
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + kind) & _MASK64
    # the CPU generator (mt19937) keeps the low 32 bits of its seed: fold the high half in,
    # or seeds 2^32 apart would sample alike
    g.manual_seed(x ^ (x >> 32))
    return g


def filter_probs(logits: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p (vLLM / HF semantics).

    logits: ``[..., V]`` fp32. Returns ``[..., V]`` fp32 summing to 1 on the last dim.
    """
    probs = torch.softmax(logits / spec.temperature, dim=-1)
    if spec.top_k and spec.top_k > 0 and spec.top_k < probs.shape[-1]:
        kth = probs.topk(spec.top_k, dim=-1).values[..., -1:]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if spec.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        drop = before >= spec.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    if spec.min_p > 0.0:
        floor = spec.min_p * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < floor, torch.zeros_like(probs), probs)
    return probs / probs.sum(-1, keepdim=True)


def adjust_logits(logits: torch.Tensor, drafts: list[list[int]], specs: list[SamplingSpec],
                  output_lens: list[int]) -> torch.Tensor:
    """The logits a request samples from, at each of its D verified positions, in vLLM's
    order: EOS / stop ids masked before ``min_tokens``; ``logit_bias`` added (OpenAI);
    then the penalties over the tokens generated before the position (the step's drafts
    ahead of it included, as they are accepted when the position is reached): repetition
    (CTRL, Keskar et al. 2019, eq. 2, as transformers' ``RepetitionPenaltyLogitsProcessor``:
    a logit ``l`` of a token in the prompt or the output becomes ``l / r`` if positive, else
    ``l * r``), then frequency and presence (OpenAI: ``l -= c * frequency + (c > 0) *
    presence`` for a token generated ``c`` times).

    Args:
        logits: ``[B, D, V]``, any float dtype and device.
        drafts: per request, the step's draft tokens (position j counts drafts ``< j``).
        specs, output_lens: as :func:`verify_and_sample`.

    Returns:
        ``logits`` itself when no request asks for any of this, else an adjusted copy: fp32
        when any request has a penalty or a bias (one must not overflow an fp16 logit).
        Dense ``[D, V]`` counts per penalised request: the cost does not grow with its
        history.
    """
    B, D, V = logits.shape
    bans = [b for b, spec in enumerate(specs) if spec.banned_until_min and output_lens[b] < spec.min_tokens]
    other = [b for b, spec in enumerate(specs) if spec.logit_bias_ids or spec.penalized]
    if not bans and not other:
        return logits
    # a copy (the caller's logits stay as they were); fp32 only where a penalty or bias
    # applies, the min_tokens mask alone keeps the model's dtype
    logits = logits.to(torch.float32, copy=True) if other else logits.clone()
    dev = logits.device
    for b in bans:
        spec = specs[b]
        n_ban = min(D, spec.min_tokens - output_lens[b])
        logits[b, :n_ban, spec.banned_until_min] = float("-inf")
    for b in other:
        spec = specs[b]
        rows = logits[b]  # [D, V], a view
        if spec.logit_bias_ids:
            ids = torch.tensor(spec.logit_bias_ids, dtype=torch.long, device=dev)
            rows[:, ids] += torch.tensor(spec.logit_bias_values, dtype=torch.float32, device=dev)
        if not spec.penalized:
            continue
        counts = torch.zeros(D, V, dtype=torch.float32, device=dev)
        if spec.output_token_ids:
            counts[:, torch.tensor(spec.output_token_ids, dtype=torch.long, device=dev)] = torch.tensor(
                spec.output_token_counts, dtype=torch.float32, device=dev)
        for j, d in enumerate(drafts[b][: D - 1]):
            counts[j + 1:, d] += 1  # draft j is generated before positions j + 1 on
        seen = counts > 0
        if spec.repetition_penalty != 1.0:
            rep = seen.clone()
            if spec.prompt_token_ids:
                rep[:, torch.tensor(spec.prompt_token_ids, dtype=torch.long, device=dev)] = True
            r = spec.repetition_penalty
            rows.copy_(torch.where(rep, torch.where(rows > 0, rows / r, rows * r), rows))
        if spec.presence_penalty or spec.frequency_penalty:
            rows.sub_(counts * spec.frequency_penalty + seen * spec.presence_penalty)
    return logits


@dataclass
class AcceptResult:
    """Per request: ``tokens`` emitted (accepted drafts then the bonus / resampled token),
    ``len(tokens)`` is the accept length; ``logprobs`` per token when asked for
    (``(token_id, logprob, [(id, logprob) top-n])``)."""

    tokens: list[int]
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None


def verify_and_sample(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: list[int],
    specs: list[SamplingSpec],
    output_lens: list[int],
) -> list[AcceptResult]:
    """Accept drafts and sample the next token for every request of a batch.

    Args:
        logits: ``[B, D, V]`` target logits at the D verified positions, fp32 or the
            model's dtype (the rows that sample are upcast to fp32 here; the argmax is the
            same either way, upcasting being exact).
        drafts: ``[B, D - 1]`` int64 draft tokens (position j's logits judge draft j).
        num_drafts: valid drafts per request (``<= D - 1``; the rest is padding never accepted).
        specs: sampling spec per request. output_lens: tokens generated before this step
            (the output index of the first token produced here).

    Returns:
        One :class:`AcceptResult` per request, ``1 <= len(tokens) <= num_drafts + 1``.

    ``logits`` may live on the GPU: greedy acceptance needs only the argmax, so only
    ``[B, D]`` token ids cross to the host, plus the logit rows of the requests that sample
    or ask for logprobs (sampling draws from CPU generators, so results do not depend on
    the device). At a 248K vocabulary, batch 32 and D = 4 that is 512 bytes against 127 MB.
    """
    B, D, V = logits.shape
    drafts_l = drafts.tolist() if drafts.numel() else [[] for _ in range(B)]
    drafts_l = [row[: num_drafts[b]] for b, row in enumerate(drafts_l)]
    logits = adjust_logits(logits, drafts_l, specs, output_lens)
    greedy_targets = logits.argmax(-1).tolist()  # [B][D], one transfer for the batch
    host = [b for b, spec in enumerate(specs) if spec.temperature != 0.0 or spec.logprobs is not None]
    moved = logits[torch.tensor(host, dtype=torch.long, device=logits.device)].float().cpu() if host else None
    host_row = {b: moved[i] for i, b in enumerate(host)}  # [D, V] fp32 on the host
    results = []
    for b, spec in enumerate(specs):
        m, out0 = num_drafts[b], output_lens[b]
        tokens: list[int] = []
        if spec.temperature == 0.0:
            tg = greedy_targets[b]
            j = 0
            while j < m and drafts_l[b][j] == tg[j]:
                j += 1
            tokens = tg[: j + 1]
        else:
            probs = filter_probs(host_row[b][: m + 1], spec)
            for j in range(m + 1):
                if j < m:
                    d = drafts_l[b][j]
                    u = torch.rand((), generator=_generator(spec.seed, out0 + j, 1)).item()
                    if u < probs[j, d].item():
                        tokens.append(d)
                        continue
                    residual = probs[j].clone()
                    residual[d] = 0.0
                    if residual.sum() <= 0:  # p was one-hot on the draft: cannot reject it
                        tokens.append(d)
                        continue
                    tok = torch.multinomial(residual / residual.sum(), 1, generator=_generator(spec.seed, out0 + j, 2))
                else:
                    tok = torch.multinomial(probs[j], 1, generator=_generator(spec.seed, out0 + j, 0))
                tokens.append(int(tok))
                break
        res = AcceptResult(tokens)
        if spec.logprobs is not None:
            lp = torch.log_softmax(host_row[b][: len(tokens)], dim=-1)
            res.logprobs = []
            for j, t in enumerate(tokens):
                top = []
                if spec.logprobs > 0:
                    v, i = lp[j].topk(spec.logprobs)
                    top = list(zip(i.tolist(), v.tolist()))
                res.logprobs.append((t, float(lp[j, t]), top))
        results.append(res)
    return results
