"""Sampling and speculative acceptance on the last stage.

One function covers every mode: a prefill or plain decode is a verify of ``D = 1`` with no
draft. Every output position ``t`` of a request has one target token, fixed before any
draft is judged: greedy, the argmax of the processed logits; sampled, the Gumbel-max pick
``argmax_v p_t(v) / E[v]`` where ``p_t`` are the processed probabilities (penalties, bias,
temperature, top-k, top-p, min-p) and ``E[v]`` are i.i.d. Exp(1) noise drawn from a
counter-based hash of ``(seed, t, v)`` (:func:`exponential_noise`; ``p / E`` is the
exponential-race form of Gumbel-max: ``log p - log E`` with ``-log E`` Gumbel). A draft is
accepted exactly when it equals its position's target token; the first mismatch (or the
bonus position past the last draft) emits its target token.

Why the output is the target's distribution: the pick at a position is an exact sample of
``p_t`` (Gumbel-max), and it is the token plain sampling would emit there, since the noise
depends on ``(seed, t, v)`` only. Drafts are deterministic (n-gram lookup, argmax MTP), so a
draft ``d`` is accepted with probability ``p_t(d)``, and on rejection the emitted token is
``p_t`` conditioned on ``!= d``, i.e. ``p_t`` with ``d`` removed, renormalised: the
acceptance probability and residual of speculative rejection sampling (Leviathan et al.,
"Fast Inference from Transformers via Speculative Decoding", ICML 2023, Algorithm 1, with a
one-hot draft distribution). So the tokens are the same with speculation none, ngram or
mtp, at any batch and PP size (tested token for token and with a chi-square test), as long
as the verify's logits equal the decode's (the greedy path's condition too).

The noise is integer arithmetic on the logits' device, so it is the same on the CPU and on
CUDA and costs no host transfer: only ``[B, D]`` token ids cross to the host.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ppspec.proto.messages import SamplingSpec

from .grammar import TokenMask
from .pools import device_int64, to_device

_MASK64 = (1 << 64) - 1


def _s64(c: int) -> int:
    """A uint64 constant as the int64 of the same bits (torch has no uint64 arithmetic)."""
    c &= _MASK64
    return c - (1 << 64) if c >= 1 << 63 else c


_NOISE_ROWS = 64  # rows of noise drawn at once (float64: 2 MB a row at a 248K vocabulary)
_GAMMA, _M1, _M2 = _s64(0x9E3779B97F4A7C15), _s64(0xBF58476D1CE4E5B9), _s64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    return (x >> k) & ((1 << (64 - k)) - 1)  # logical shift of int64 bits (>> is arithmetic)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser (Steele et al., "Fast splittable pseudorandom number
    generators", OOPSLA 2014) on int64 tensors; multiplication wraps mod 2^64 on CPU and CUDA."""
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def _mix_int(z: int) -> int:
    """:func:`_mix` on a Python int (the row keys)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def exponential_noise(seed: int, positions: list[int], vocab: int, device) -> torch.Tensor:
    """I.i.d. Exp(1) noise, a pure function of ``(seed, output position, token id)``.

    Row ``i`` is the SplitMix64 stream keyed by ``(seed, positions[i])``: element ``v`` is
    ``mix(key + (v + 1) * gamma)``, its top 53 bits ``u`` in (0, 1), ``-log(u)``.

    Returns ``[len(positions), vocab]`` float64 on ``device``.
    """
    return _noise([(seed, p) for p in positions], vocab, device)


def _noise(keys: list[tuple[int, int]], vocab: int, device) -> torch.Tensor:
    """:func:`exponential_noise` of ``(seed, position)`` pairs, one row each."""
    rows = device_int64([_s64(_mix_int((seed & _MASK64) ^ _mix_int(p + 0x632BE59BD9B4E019))) for seed, p in keys],
                        device)
    z = _mix(rows[:, None] + torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * _GAMMA)
    u = (_shr(z, 11).double() + 0.5) * (2.0 ** -53)
    return -torch.log(u)


def _device_float32(values: list[float], device) -> torch.Tensor:
    """``values`` as fp32 on ``device`` without a blocking copy (``pools.device_int64``'s way:
    a copy from pageable memory would synchronise the stream)."""
    return to_device(torch.tensor(values, dtype=torch.float32), device)


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


_ALLOWED_MASKS: dict[int, tuple[list[int], torch.Tensor]] = {}
_ALLOWED_MASKS_KEPT = 256


def _allowed_mask(ids: list[int], V: int, dev: torch.device) -> torch.Tensor:
    """``[V]`` fp32 on ``dev``: 0 at ``ids``, -inf elsewhere. Kept by the identity of the
    ``ids`` list (a row's spec is the same read-only object from one step to the next:
    ``proto.codec.SpecMemo``), the list itself held so that its id is not reused, at most
    ``_ALLOWED_MASKS_KEPT`` of them: built once per request, not per step (a fill, a
    host-to-device copy of the ids and a scatter per request and step)."""
    hit = _ALLOWED_MASKS.get(id(ids))
    if hit is not None and hit[1].device == dev and hit[1].shape[0] == V:  # (hit[0] is ids: held, so never reused)
        return hit[1]
    keep = torch.full((V,), float("-inf"), dtype=torch.float32, device=dev)
    keep[device_int64(ids, dev)] = 0.0
    if len(_ALLOWED_MASKS) >= _ALLOWED_MASKS_KEPT:
        _ALLOWED_MASKS.clear()
    _ALLOWED_MASKS[id(ids)] = (ids, keep)
    return keep


def adjust_logits(logits: torch.Tensor, drafts: list[list[int]], specs: list[SamplingSpec],
                  output_lens: list[int]) -> torch.Tensor:
    """The logits a request samples from, at each of its D verified positions, in vLLM's
    order: EOS / stop ids masked before ``min_tokens``; every token but ``allowed_token_ids``
    masked, and the last token of each bad word whose other tokens end the output before
    the position (vLLM's ``allowed_token_ids`` and ``bad_words``; :func:`_ban_bad_words`);
    ``logit_bias`` added (OpenAI);
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
    other = [b for b, spec in enumerate(specs)
             if spec.logit_bias_ids or spec.penalized or spec.allowed_token_ids or spec.bad_word_lens]
    if not bans and not other:
        return logits
    # a copy (the caller's logits stay as they were); fp32 only where a penalty or bias
    # applies, the min_tokens mask alone keeps the model's dtype
    logits = logits.to(torch.float32, copy=True) if other else logits.clone()
    dev = logits.device
    for b in bans:
        spec = specs[b]
        n_ban = min(D, spec.min_tokens - output_lens[b])
        logits[b, :n_ban, device_int64(spec.banned_until_min, dev)] = float("-inf")
    for b in other:
        spec = specs[b]
        rows = logits[b]  # [D, V], a view
        if spec.allowed_token_ids:
            rows += _allowed_mask(spec.allowed_token_ids, V, dev)
        if spec.bad_word_lens:
            _ban_bad_words(rows, spec, drafts[b][: D - 1])
        if spec.logit_bias_ids:
            rows[:, device_int64(spec.logit_bias_ids, dev)] += _device_float32(spec.logit_bias_values, dev)
        if not spec.penalized:
            continue
        counts = torch.zeros(D, V, dtype=torch.float32, device=dev)
        if spec.output_token_ids:
            counts[:, device_int64(spec.output_token_ids, dev)] = _device_float32(spec.output_token_counts, dev)
        for j, d in enumerate(drafts[b][: D - 1]):
            counts[j + 1:, d] += 1  # draft j is generated before positions j + 1 on
        seen = counts > 0
        if spec.repetition_penalty != 1.0:
            rep = seen.clone()
            if spec.prompt_token_ids:
                rep[:, device_int64(spec.prompt_token_ids, dev)] = True
            r = spec.repetition_penalty
            torch.where(rep, torch.where(rows > 0, rows / r, rows * r), rows, out=rows)  # in place, no copy
        if spec.presence_penalty or spec.frequency_penalty:
            rows.sub_(counts * spec.frequency_penalty + seen * spec.presence_penalty)
    return logits


def _ban_bad_words(rows: torch.Tensor, spec: SamplingSpec, drafts: list[int]) -> None:
    """vLLM's ``bad_words`` on one request's ``[D, V]`` fp32 logits, in place: at position
    ``j`` the outputs before it are ``spec.recent_output_ids`` then ``drafts[:j]``; a bad
    word's last token is masked where its other tokens end them (a one-token word always).
    Where that would leave no token (every allowed one a bad word's end) the position keeps
    its logits: a soft rule never leaves the sampler nothing."""
    words = spec.bad_words
    for j in range(rows.shape[0]):
        past = spec.recent_output_ids + drafts[:j]
        ends = [w[-1] for w in words if len(w) - 1 <= len(past) and past[len(past) - len(w) + 1:] == w[:-1]]
        if not ends:
            continue
        row, ids = rows[j], device_int64(ends, rows.device)
        kept = row[ids]
        row[ids] = float("-inf")
        if bool(torch.isneginf(row).all()):
            row[ids] = kept


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
    token_mask: TokenMask | None = None,
) -> list[AcceptResult]:
    """Accept drafts and sample the next token for every request of a batch:
    :func:`sample_targets` on the device, one read of the targets, :func:`accept` on the host.

    Args:
        logits: ``[B, D, V]`` target logits at the D verified positions, fp32 or the
            model's dtype (the rows that sample are upcast to fp32 here; the argmax is the
            same either way, upcasting being exact).
        drafts: ``[B, D - 1]`` int64 draft tokens (position j's logits judge draft j), on
            the host.
        num_drafts: valid drafts per request (``<= D - 1``; the rest is padding never accepted).
        specs: sampling spec per request. output_lens: tokens generated before this step
            (the output index of the first token produced here).
        token_mask: the grammar's allowed tokens at every position of the constrained
            requests (structured output, ``grammar.GrammarRows.token_mask``), applied after
            :func:`adjust_logits`: a draft it refuses is rejected, the bonus token obeys it.

    Returns:
        One :class:`AcceptResult` per request, ``1 <= len(tokens) <= num_drafts + 1``.

    Only ``[B, D]`` token ids cross to the host, plus the logit rows of the requests that
    ask for logprobs. At a 248K vocabulary, batch 32 and D = 4 that is 512 bytes against 127 MB.
    """
    B = logits.shape[0]
    drafts_l = drafts.tolist() if drafts.numel() else [[] for _ in range(B)]
    drafts_l = [row[: num_drafts[b]] for b, row in enumerate(drafts_l)]
    targets, logits = sample_targets(logits, drafts_l, num_drafts, specs, output_lens, token_mask)
    return accept(targets.tolist(), drafts_l, num_drafts, specs, logits)


def sample_targets(
    logits: torch.Tensor,
    drafts: list[list[int]],
    num_drafts: list[int],
    specs: list[SamplingSpec],
    output_lens: list[int],
    token_mask: TokenMask | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position's target token (argmax, or the seeded Gumbel-max pick; module
    docstring), on the logits' device without reading it: ``(targets [B, D] int64, the
    processed logits)``. ``drafts``: per request its real drafts (host lists); the other
    arguments as :func:`verify_and_sample`. A step reads the targets of all its parts at
    once (``StageRunner._last_stage``), then :func:`accept` judges the drafts."""
    V = logits.shape[-1]
    logits = adjust_logits(logits, drafts, specs, output_lens)
    if token_mask is not None:
        logits = token_mask.apply(logits)
    targets = logits.argmax(-1)  # [B, D]
    sampled = [b for b, spec in enumerate(specs) if spec.temperature != 0.0]
    if sampled:
        # the positions a request may emit (its drafts' and the bonus), every sampled
        # request's in one list; the noise in chunks of rows (memory: 2 x 8 bytes x V a row)
        rows = [(b, j) for b in sampled for j in range(num_drafts[b] + 1)]
        probs = torch.cat([filter_probs(logits[b, : num_drafts[b] + 1].float(), specs[b]) for b in sampled])
        picks = []
        for i in range(0, len(rows), _NOISE_ROWS):
            part = rows[i: i + _NOISE_ROWS]
            noise = _noise([(specs[b].seed, output_lens[b] + j) for b, j in part], V, logits.device)
            picks.append((probs[i: i + len(part)].double() / noise).argmax(-1))
        at = device_int64([x for pair in rows for x in pair], logits.device).view(-1, 2)
        targets = targets.clone()
        targets[at[:, 0], at[:, 1]] = torch.cat(picks)
    return targets, logits


def accept(targets: list[list[int]], drafts: list[list[int]], num_drafts: list[int], specs: list[SamplingSpec],
           logits: torch.Tensor) -> list[AcceptResult]:
    """The host's part of :func:`verify_and_sample`: per request, its drafts while each
    equals its position's target (``targets``: :func:`sample_targets`' read on the host),
    then the target of the first position that differs (or of the bonus position); the
    log-probabilities of the emitted tokens from ``logits`` (the processed ones) for the
    requests that ask (one more read of their rows)."""
    lp_rows = [b for b, spec in enumerate(specs) if spec.logprobs is not None]
    moved = logits[device_int64(lp_rows, logits.device)].float().cpu() if lp_rows else None
    host_row = {b: moved[i] for i, b in enumerate(lp_rows)}  # [D, V] fp32 on the host
    results = []
    for b, spec in enumerate(specs):
        # the one acceptance rule: drafts while each equals its position's target, then
        # the target of the first position that differs (or of the bonus position)
        tg, m = targets[b], num_drafts[b]
        j = 0
        while j < m and drafts[b][j] == tg[j]:
            j += 1
        res = AcceptResult(tg[: j + 1])
        if spec.logprobs is not None:
            lp = torch.log_softmax(host_row[b][: len(res.tokens)], dim=-1)
            res.logprobs = []
            for j, t in enumerate(res.tokens):
                top = []
                if spec.logprobs > 0:
                    v, i = lp[j].topk(spec.logprobs)
                    top = list(zip(i.tolist(), v.tolist()))
                res.logprobs.append((t, float(lp[j, t]), top))
        results.append(res)
    return results
