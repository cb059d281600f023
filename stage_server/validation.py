"""Validation of a stage's inputs: a micro-batch against the stage's limits, before any
pool is touched (:class:`StepChecker`), and the errors that name what is wrong."""
from __future__ import annotations

import math
import operator

import torch

from ppspec.proto.messages import DECODE, PREFILL, REPETITION_PENALTY_RANGE, VERIFY, SamplingSpec, StepInput


class RowStateError(ValueError):
    """A step or commit that does not fit the state of its rows on this stage (a row never
    started or already released, a new request on a row still in use, a sequence length
    other than the row holds, a row whose state a failed step left undefined), or a verify
    or commit on a stage started without speculation. Nothing was changed. The gRPC
    server answers FAILED_PRECONDITION; other ValueErrors are INVALID_ARGUMENT."""


def brief(xs, n: int = 16) -> str:
    """A list or dict for an error message, cut after ``n`` items (a status message must
    stay small)."""
    if isinstance(xs, dict):
        return str(xs) if len(xs) <= n else f"{str(dict(list(xs.items())[:n]))[:-1]}, ... ({len(xs)} in all)}}"
    xs = list(xs)
    return str(xs) if len(xs) <= n else f"{str(xs[:n])[:-1]}, ... ({len(xs)} in all)]"


class StepChecker:
    """The checks of one micro-batch against a stage's limits; touches nothing.

    Args:
        cfg: the model config (``vocab_size``, ``hidden_size``).
        max_rows, max_context, num_steps: the stage's rows, context (tokens) and drafts per
            round (verify ``D = num_steps + 1``).
        is_first: the first stage takes token ids, the others ``hidden_states`` too.
        snapshots: the stage's prefix-cache snapshots, or None.
    """

    def __init__(self, cfg, max_rows: int, max_context: int, num_steps: int, is_first: bool, snapshots):
        self.cfg, self.max_rows, self.max_context, self.num_steps = cfg, max_rows, max_context, num_steps
        self.is_first, self.snapshots = is_first, snapshots
        # specs that passed the full check, by identity (the object kept, so its id is not
        # reused): a spec is read-only once built, and a row's spec is the same object from one
        # step to the next (``proto.codec.SpecMemo``, or the router's own in process), so a
        # request with thousands of ``allowed_token_ids`` pays the scan over them once, not per
        # step and check (~230 us each for 4256 ids: 64 such requests were ~15 ms a round)
        self._checked: dict[int, SamplingSpec] = {}

    def check(self, inp: StepInput, hidden: bool = True) -> None:
        """Validate one micro-batch against this stage's limits; touches nothing.

        Every check but the hidden states' depends only on what every stage of a pipeline
        shares (rows, context, vocabulary, D), so a step one stage refuses the first stage
        refuses too, before any stage changed anything. The rows' state is checked when
        the step runs (it changes as steps and commits apply). ``hidden=False`` skips the
        ``hidden_states`` checks (the gRPC server's early check, on its event loop).

        Raises:
            IndexError: a row outside ``[0, max_rows)``.
            RowStateError: a verify on a stage started without speculation.
            ValueError: any other malformed field; the message names it.
        """
        rows, seq, ext, ids = inp.req_pool_indices, inp.seq_lens, inp.extend_lens, inp.input_ids
        mode, B, V = inp.mode, len(inp.req_pool_indices), self.cfg.vocab_size
        if mode not in (PREFILL, DECODE, VERIFY):
            raise ValueError(f"mode: unknown mode {mode!r} (prefill, decode or verify)")
        if B == 0:
            raise ValueError("req_pool_indices: empty micro-batch")
        if not (len(seq) == len(ext) == B):
            raise ValueError(
                f"req_pool_indices, seq_lens and extend_lens differ in length ({B}, {len(seq)}, {len(ext)})"
            )
        for name in ("num_drafts", "sample", "next_token_ids", "sampling", "output_lens"):
            n = len(getattr(inp, name))
            if n not in (0, B):
                raise ValueError(f"{name}: {n} entries for {B} requests (one per request, or none)")
        # every step of every stage runs these checks before the device can start: builtins
        # over whole lists first (min, max, sum in C), the offender is looked for on failure
        if len(set(rows)) != B:
            raise ValueError(f"req_pool_indices: micro-batch {inp.micro_batch_id} repeats rows {brief(rows)}")
        if inp.num_prefill:
            # a mixed micro-batch: each part obeys its kind's rules
            if mode == PREFILL or not 0 < inp.num_prefill < B:
                raise ValueError(f"num_prefill: {inp.num_prefill} prefill chunks in a {mode} micro-batch of {B} "
                                 f"requests (a decode or verify with at least one request of its own)")
            if sum(ext) != len(ids):
                raise ValueError(f"extend_lens must sum to the number of input_ids ({sum(ext)} vs {len(ids)})")
            k = B - inp.num_prefill
            for name in ("restore_slots", "snapshot_slots"):  # the chunks' (parts() gives them the chunks only)
                slots = getattr(inp, name)
                if slots and (len(slots) != B or max(slots[:k]) >= 0):
                    raise ValueError(f"{name}: {len(slots)} entries in a mixed {mode} of {B} requests (one per "
                                     f"request, -1 for each of its first {k}: slots go with prefill chunks only)")
            for part in inp.parts():
                self.check(part, hidden=False)
            if hidden and not self.is_first:
                self._check_hidden(inp.hidden_states, len(ids))
            return
        if min(rows) < 0 or max(rows) >= self.max_rows:
            r = next(r for r in rows if not 0 <= r < self.max_rows)
            raise IndexError(f"req_pool_indices: row {r} outside [0, {self.max_rows})")
        if min(seq) < 0:
            raise ValueError(f"seq_lens must be >= 0, got {brief(seq)}")
        if min(ext) < 1 or sum(ext) != len(ids):
            raise ValueError(
                f"extend_lens must be >= 1 and sum to the number of input_ids ({sum(ext)} vs {len(ids)})"
            )
        if min(ids) < 0 or max(ids) >= V:
            raise ValueError(f"input_ids must be token ids in [0, {V}), got min {min(ids)} max {max(ids)}")
        limit = self.max_context + self.num_steps + 1
        if max(map(operator.add, seq, ext)) > limit:
            b = next(b for b, (s, e) in enumerate(zip(seq, ext)) if s + e > limit)
            raise ValueError(
                f"seq_lens + extend_lens: request {b} (row {rows[b]}) reaches {seq[b] + ext[b]} tokens, beyond "
                f"the context limit of {self.max_context} tokens"
            )
        if mode == VERIFY and self.num_steps == 0:
            raise RowStateError("verify: this stage was started without speculative decoding (D = 1)")
        d = 1 if mode == DECODE else self.num_steps + 1
        if mode != PREFILL and ext.count(d) != B:
            raise ValueError(f"extend_lens: {mode} expects {d} tokens per request, got {brief(ext)}")
        most = d - 1 if mode == VERIFY else 0
        if inp.num_drafts and (min(inp.num_drafts) < 0 or max(inp.num_drafts) > most):
            raise ValueError(f"num_drafts must be in [0, {most}] for {mode}, got {brief(inp.num_drafts)}")
        if mode != PREFILL and not all(inp.sample):
            raise ValueError(f"sample: every request of a {mode} samples, got {brief(inp.sample)}")
        if any(t != -1 and not 0 <= t < V for t in inp.next_token_ids):
            raise ValueError(f"next_token_ids must be -1 or token ids in [0, {V}), got {brief(inp.next_token_ids)}")
        for b, smp in enumerate(inp.sample):
            if not smp and not (inp.next_token_ids and 0 <= inp.next_token_ids[b] < V):
                raise ValueError(
                    f"next_token_ids: request {b} (row {rows[b]}) ends a prefill chunk without sampling, "
                    f"so it needs the prompt token after the chunk"
                )
        checked = self._checked
        for b, spec in enumerate(inp.sampling):
            if not self._sampling_ok(spec) and id(spec) not in checked:  # (held there: its id not reused)
                self._check_sampling(b, spec)  # raises, naming the field
                if len(checked) >= 4 * self.max_rows:
                    checked.clear()
                checked[id(spec)] = spec
            if (spec.grammar or spec.grammar_accepted_ids) and not (inp.is_prefill(b) and spec.grammar):
                raise ValueError(f"sampling[{b}]: grammar comes with a prefill chunk, grammar_accepted_ids only "
                                 f"with it")
        if inp.output_lens and min(inp.output_lens) < 0:
            raise ValueError(f"output_lens must be >= 0, got {brief(inp.output_lens)}")
        for name in ("restore_slots", "snapshot_slots"):
            slots = getattr(inp, name)
            if slots and (len(slots) != B or mode != PREFILL or self.snapshots is None):
                raise ValueError(f"{name}: {len(slots)} entries in a {mode} of {B} requests on a stage "
                                 f"{'with' if self.snapshots else 'without'} a prefix cache (prefill only, one per request)")
        if hidden and not self.is_first:
            self._check_hidden(inp.hidden_states, len(ids))

    def _sampling_ok(self, s: SamplingSpec) -> bool:
        """:meth:`_check_sampling`'s rules in one expression (per request and step: the
        common case must cost little); False means that it raises."""
        V, t = self.cfg.vocab_size, s.temperature
        return (0 <= t < math.inf and (t == 0 or (0 < s.top_p <= 1 and s.top_k >= -1 and 0 <= s.min_p <= 1))
                and (s.logprobs is None or 0 <= s.logprobs <= V) and s.min_tokens >= 0
                and (s.prompt_logprobs is None or 0 <= s.prompt_logprobs <= V)
                and (not s.banned_until_min or (min(s.banned_until_min) >= 0 and max(s.banned_until_min) < V))
                and not (s.penalized or s.logit_bias_ids or s.output_token_ids or s.prompt_token_ids
                         or s.logit_bias_values or s.output_token_counts or s.grammar_accepted_ids
                         or s.allowed_token_ids or s.bad_word_ids or s.bad_word_lens or s.recent_output_ids))  # those: the full check

    def _check_sampling(self, b: int, spec: SamplingSpec) -> None:
        V = self.cfg.vocab_size
        bad = None
        if not (math.isfinite(spec.temperature) and spec.temperature >= 0):
            bad = f"temperature must be a finite number >= 0, got {spec.temperature}"
        elif spec.temperature > 0 and not 0 < spec.top_p <= 1:  # the filters apply only when sampling
            bad = f"top_p must be in (0, 1], got {spec.top_p}"
        elif spec.temperature > 0 and spec.top_k < -1:
            bad = f"top_k must be -1, 0 (all tokens) or positive, got {spec.top_k}"
        elif spec.temperature > 0 and not 0 <= spec.min_p <= 1:
            bad = f"min_p must be in [0, 1], got {spec.min_p}"
        elif spec.logprobs is not None and not 0 <= spec.logprobs <= V:
            bad = f"logprobs must be in [0, {V}] (or none), got {spec.logprobs}"
        elif spec.prompt_logprobs is not None and not 0 <= spec.prompt_logprobs <= V:
            bad = f"prompt_logprobs must be in [0, {V}] (or none), got {spec.prompt_logprobs}"
        elif spec.min_tokens < 0:
            bad = f"min_tokens must be >= 0, got {spec.min_tokens}"
        elif any(not 0 <= t < V for t in spec.banned_until_min):
            bad = f"banned_until_min must be token ids in [0, {V}), got {brief(spec.banned_until_min)}"
        elif not all(math.isfinite(x) and -2 <= x <= 2 for x in (spec.presence_penalty, spec.frequency_penalty)):
            bad = (f"presence_penalty and frequency_penalty must be in [-2, 2], got {spec.presence_penalty} and "
                   f"{spec.frequency_penalty}")
        elif not REPETITION_PENALTY_RANGE[0] <= spec.repetition_penalty <= REPETITION_PENALTY_RANGE[1]:
            bad = (f"repetition_penalty must be in [{REPETITION_PENALTY_RANGE[0]:g}, {REPETITION_PENALTY_RANGE[1]:g}], "
                   f"got {spec.repetition_penalty}")
        elif (any(n < 1 for n in spec.bad_word_lens) or sum(spec.bad_word_lens) != len(spec.bad_word_ids)
              or any(not 0 <= t < V for t in spec.bad_word_ids + spec.recent_output_ids)):
            bad = (f"bad_word_ids must be token ids in [0, {V}) of bad_word_lens (each >= 1) tokens, and "
                   f"recent_output_ids token ids, got {brief(spec.bad_word_ids)}, {brief(spec.bad_word_lens)}")
        else:
            for name, ids, vals in (("allowed_token_ids", spec.allowed_token_ids, None),
                                    ("output_token_ids", spec.output_token_ids, spec.output_token_counts),
                                    ("grammar_accepted_ids", list(set(spec.grammar_accepted_ids)), None),
                                    ("prompt_token_ids", spec.prompt_token_ids, None),
                                    ("logit_bias_ids", spec.logit_bias_ids, spec.logit_bias_values)):
                if any(not 0 <= t < V for t in ids) or len(set(ids)) != len(ids):
                    bad = f"{name} must be distinct token ids in [0, {V}), got {brief(ids)}"
                elif vals is not None and len(vals) != len(ids):
                    bad = f"{name}: {len(ids)} ids but {len(vals)} values"
                elif name == "output_token_ids" and any(c < 1 for c in vals):
                    bad = f"output_token_counts must be >= 1, got {brief(vals)}"
                elif name == "logit_bias_ids" and not all(math.isfinite(x) and -100 <= x <= 100 for x in vals):
                    bad = f"logit_bias_values must be in [-100, 100], got {brief(vals)}"
                if bad:
                    break
        if bad:
            raise ValueError(f"sampling[{b}]: {bad}")

    def _check_hidden(self, h, tokens: int) -> None:
        want = (tokens, self.cfg.hidden_size)
        if h is None:
            raise ValueError(f"hidden_states: stages after the first need hidden_states of shape {list(want)}")
        if tuple(h.shape) != want:
            raise ValueError(f"hidden_states: shape {list(h.shape)}, expected {list(want)} (tokens, hidden size)")
        if not h.dtype.is_floating_point:
            raise ValueError(f"hidden_states: dtype {str(h.dtype).removeprefix('torch.')} is not a floating-point type")
        # a device tensor comes from a stage in this process; one received over the wire is
        # checked here (a read of the device would wait for it)
        if h.device.type == "cpu" and not bool(torch.isfinite(h).all()):
            raise ValueError("hidden_states: contains NaN or infinite values")
