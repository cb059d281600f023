"""Typed messages between the HTTP layer, the scheduler and the engine drivers.

These are plain dataclasses with no torch dependency: the HTTP layer, the scheduler and
the benchmark client all import them.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field

from ppspec.proto.messages import GREEDY_BELOW, REPETITION_PENALTY_RANGE


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters (OpenAI / vLLM semantics).

    temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature);
    below ``proto.messages.GREEDY_BELOW`` (1e-5, as vLLM) it is greedy too.
    top_p: nucleus mass in (0, 1]; top_k: keep the k most likely tokens (0 or -1 = all);
    min_p: drop tokens whose probability is below ``min_p * max_prob`` (0 = off).
    seed: per-request seed (the router draws one when None). Each output position's token
    is the Gumbel-max pick of the processed distribution under noise keyed by (seed,
    position), and a draft is accepted only when it equals that pick
    (``stage_server.sampler``), so the same seed gives the same tokens whatever the batch,
    PP split, preemption or speculation (none, ngram, mtp), as far as the logits are the
    same (one device and dtype: another GPU or bf16 may round a near-tie the other way).
    max_tokens: completion tokens at most; min_tokens: EOS / stop ids are masked until
    this many tokens exist. stop_token_ids: extra ids that end the request (EOS is added by
    the engine unless ignore_eos). logprobs: None, or the number of top log-probabilities
    to return per generated token (0 = only the sampled token's). stop: strings that end
    the request once they appear in its text; the text is cut before the first one
    (``LLM.generate``; the HTTP layer takes ``stop`` from the request body). The stages never
    see them.
    presence_penalty, frequency_penalty: in [-2, 2], subtracted from a generated token's
    logit once / per occurrence (OpenAI). repetition_penalty: 1 = off; divides a
    positive logit of a prompt or generated token by it, multiplies a negative one (vLLM,
    transformers); in [1/128, 128], where fp32 logits cannot overflow. logit_bias: ``{token_id: bias}``, bias in [-100, 100], added to the
    logits (OpenAI). All apply before temperature and the filters
    (``stage_server.sampler.adjust_logits``), with speculation as without.
    grammar: structured output, xgrammar EBNF text (``router.structured`` builds it from
    ``response_format`` and the like); the last stage masks every verified position with
    it (``stage_server/grammar.py``). It ends the output with EOS, so not with ``ignore_eos``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    grammar: str | None = None
    prompt_logprobs: int | None = None
    """None, or the number of top log-probabilities to return per prompt token (its first
    excepted: nothing predicts it); they come with the request's first output."""

    def validate(self) -> None:
        """Raise ``InvalidRequestError`` naming the bad field (a wrong type included: a
        float ``max_tokens`` or a bool ``logprobs`` is refused, not truncated)."""
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise InvalidRequestError(f"{name} must be a number, got {v!r}", param=name)
            try:
                float(v)
            except OverflowError:  # an int beyond a float (10**400)
                raise InvalidRequestError(f"{name} must be a finite number, got an integer of "
                                          f"{len(str(abs(int(v))))} digits", param=name) from None
        for name, optional in (("top_k", False), ("max_tokens", False), ("min_tokens", False),
                               ("seed", True), ("logprobs", True)):
            v = getattr(self, name)
            if (v is None and optional) or (isinstance(v, numbers.Integral) and not isinstance(v, bool)):
                continue
            raise InvalidRequestError(f"{name} must be an integer{' or None' if optional else ''}, got {v!r}", param=name)
        v = self.ignore_eos
        if not isinstance(v, bool) and not (str(getattr(v, "dtype", "")) == "bool" and getattr(v, "ndim", 1) == 0):
            raise InvalidRequestError(f"ignore_eos must be a bool, got {v!r}", param="ignore_eos")
        self.ignore_eos = bool(v)  # numpy's bool_ too
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in ids):
            raise InvalidRequestError(f"stop_token_ids must be a list of integers, got {ids!r}", param="stop_token_ids")
        if isinstance(self.stop, str):  # one string, as OpenAI and vLLM take it
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(x, str) and x for x in self.stop):
            raise InvalidRequestError(f"stop must be a list of non-empty strings, got {self.stop!r}", param="stop")
        self.stop = list(self.stop)
        # numpy / torch scalars become Python numbers (a numpy seed would overflow below)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            setattr(self, name, float(getattr(self, name)))
        for name in ("top_k", "max_tokens", "min_tokens", "seed", "logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, int(getattr(self, name)))
        self.stop_token_ids = [int(t) for t in ids]
        if not (0.0 <= self.temperature < float("inf")):
            raise InvalidRequestError("temperature must be a finite number >= 0", param="temperature")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p must be in (0, 1]", param="top_p")
        if self.top_k < -1:
            raise InvalidRequestError("top_k must be -1, 0 or positive", param="top_k")
        if not (0.0 <= self.min_p <= 1.0):
            raise InvalidRequestError("min_p must be in [0, 1]", param="min_p")
        if self.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens must be in [0, max_tokens]", param="min_tokens")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise InvalidRequestError("logprobs must be in [0, 20]", param="logprobs")
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= 20):
            raise InvalidRequestError("prompt_logprobs must be in [0, 20]", param="prompt_logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2]", param=name)
        if not REPETITION_PENALTY_RANGE[0] <= self.repetition_penalty <= REPETITION_PENALTY_RANGE[1]:
            raise InvalidRequestError("repetition_penalty must be in [%g, %g]" % REPETITION_PENALTY_RANGE,
                                      param="repetition_penalty")
        bias = self.logit_bias or {}
        if not isinstance(bias, dict) or not all(
                isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0
                and isinstance(b, numbers.Real) and not isinstance(b, bool) and -100 <= b <= 100
                for t, b in bias.items()):
            raise InvalidRequestError("logit_bias must map token ids (integers >= 0) to biases in [-100, 100]",
                                      param="logit_bias")
        self.logit_bias = {int(t): float(b) for t, b in bias.items()} or None
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar):
            raise InvalidRequestError(f"grammar must be a non-empty string (xgrammar EBNF) or None, got {self.grammar!r}",
                                      param="grammar")
        if self.grammar is not None and self.ignore_eos:
            raise InvalidRequestError("ignore_eos cannot be combined with structured output: the grammar ends the "
                                      "output with EOS", param="ignore_eos")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class TokenLogprob:
    """Log-probability of one generated token and, optionally, the top alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None
    """Prompt tokens: 1 + the number of tokens more likely than this one (None for outputs)."""


@dataclass
class RequestOutput:
    """One incremental update of a request, yielded by ``AsyncEngine.generate``.

    new_token_ids: tokens produced since the previous update (speculation can add several
    at once). finish_reason: None while running, then "stop" (EOS or a stop id), "length"
    (max_tokens or the context limit) or "abort". accept_lengths: accept length of each
    verify round included in this update (empty without speculation).
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    accept_lengths: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held at admission
    prompt_logprobs: list[TokenLogprob] | None = None
    """With ``SamplingParams.prompt_logprobs``, on the first update: one per prompt token
    after the first."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineError(Exception):
    """Base class of errors the HTTP layer maps to OpenAI-style error bodies."""

    http_status = 500
    error_type = "internal_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidRequestError(EngineError, ValueError):
    """A request the engine refuses before allocating anything (HTTP 400). Also a
    ValueError, so ``LLM`` callers catch it as vLLM's ``LLM`` raises bad parameters."""

    http_status = 400
    error_type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    """Prompt plus completion exceed the model's context; nothing was allocated."""

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int):
        super().__init__(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
            param="messages",
            code="context_length_exceeded",
        )
        self.prompt_tokens, self.max_tokens, self.limit = prompt_tokens, max_tokens, limit


class StepRefusedError(EngineError, ValueError):
    """A stage refused the micro-batch the request rode in (HTTP 500); a ValueError as the
    stage's refusal is, for ``LLM`` callers."""


class QueueFullError(EngineError):
    http_status = 429
    error_type = "rate_limit_error"


class StageDownError(EngineError):
    """A pipeline stage is unreachable or failed; in-flight requests end with this."""

    http_status = 503
    error_type = "service_unavailable"
