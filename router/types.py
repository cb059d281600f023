"""Typed messages between the HTTP layer, the scheduler and the engine drivers.

These are plain dataclasses with no torch dependency: the HTTP layer, the scheduler and
the benchmark client all import them.
"""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

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
    the request once they appear in its text; the text is cut before the first one, or
    after it with ``include_stop_str_in_output`` (vLLM's) (``LLM.generate``; the HTTP layer
    takes ``stop`` and ``include_stop_str_in_output`` from the request body). The stages
    never see them.
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
    excepted: nothing predicts it); they come with the request's first output. -1 (and
    ``logprobs`` -1): the whole vocabulary, as vLLM, where ``max_logprobs`` allows it."""
    allowed_token_ids: list[int] | None = None
    """vLLM's: every other token is masked (applied with the penalties, at every verified position)."""
    bad_words: list[str] = field(default_factory=list)
    """vLLM's: each word's token sequences (:func:`bad_words_token_ids`: as written and after
    a space) may not be generated: a sequence's last token is masked where its other tokens
    end the output so far."""
    bad_words_token_ids: list[list[int]] | None = None
    """``bad_words`` tokenized (the engine fills it from ``bad_words`` at submission)."""
    include_stop_str_in_output: bool = False
    """vLLM's: ``LLM.generate``'s text keeps the stop string that ended it (cut after it, not before)."""

    def validate(self, max_logprobs: int = 20, vocab_size: int | None = None,
                 eos_token_ids: list[int] | None = None) -> None:
        """Raise ``InvalidRequestError`` naming the bad field (a wrong type included: a
        float ``max_tokens`` or a bool ``logprobs`` is refused, not truncated).
        ``max_logprobs``: the server's cap on ``logprobs`` and ``prompt_logprobs`` (vLLM's
        ``--max-logprobs``; -1: none); with ``vocab_size`` known, -1 asks for every token
        and is replaced by it. ``eos_token_ids``: the model's, where known (the scheduler),
        stop tokens too unless ``ignore_eos``."""
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
                               ("seed", True), ("logprobs", True), ("prompt_logprobs", True)):
            v = getattr(self, name)
            if (v is None and optional) or (isinstance(v, numbers.Integral) and not isinstance(v, bool)):
                continue
            raise InvalidRequestError(f"{name} must be an integer{' or None' if optional else ''}, got {v!r}", param=name)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            v = getattr(self, name)
            if not isinstance(v, bool) and not (str(getattr(v, "dtype", "")) == "bool" and getattr(v, "ndim", 1) == 0):
                raise InvalidRequestError(f"{name} must be a bool, got {v!r}", param=name)
            setattr(self, name, bool(v))  # numpy's bool_ too
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
        self._check_logprobs(max_logprobs, vocab_size)
        self._check_token_rules(vocab_size, eos_token_ids)
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

    def _check_logprobs(self, max_logprobs: int, vocab_size: int | None) -> None:
        """vLLM's rule: -1 counts as the vocabulary, and neither may exceed ``max_logprobs``
        (-1: the vocabulary)."""
        cap = max_logprobs if max_logprobs >= 0 else vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is None:
                continue
            if n < -1:
                raise InvalidRequestError(f"{name} must be >= 0, or -1 for the whole vocabulary, got {n}", param=name)
            if n == -1 and vocab_size is None:
                raise InvalidRequestError(f"{name} -1 (the whole vocabulary) needs the vocabulary's size here",
                                          param=name)
            want = vocab_size if n == -1 else n
            if cap is not None and want > cap:
                raise InvalidRequestError(f"{name}: {want} log-probabilities asked for, more than the server's "
                                          f"--max-logprobs {cap}", param=name)
            setattr(self, name, want)

    def _check_token_rules(self, vocab_size: int | None, eos_token_ids: list[int] | None = None) -> None:
        """``allowed_token_ids``, ``bad_words`` and their token sequences."""
        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not ids or not token_ids_ok(ids):
                raise InvalidRequestError(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}",
                                          param="allowed_token_ids")
            self.allowed_token_ids = sorted(set(map(int, ids)))
            if vocab_size is not None and self.allowed_token_ids[-1] >= vocab_size:
                raise InvalidRequestError(f"allowed_token_ids: token id {self.allowed_token_ids[-1]} is outside the "
                                          f"vocabulary [0, {vocab_size})", param="allowed_token_ids")
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) and w for w in self.bad_words):
            raise InvalidRequestError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}",
                                      param="bad_words")
        seqs = self.bad_words_token_ids
        if seqs is not None and not all(isinstance(s, (list, tuple)) and s and token_ids_ok(s) for s in seqs):
            raise InvalidRequestError("bad_words_token_ids must be non-empty lists of token ids", param="bad_words")
        # min_tokens bans every stop token (EOS too unless ignore_eos): with nothing else
        # allowed, every logit would be masked and the sampled token one outside the set
        stops = set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids or ()))
        if ids is not None and self.min_tokens > 0 and set(self.allowed_token_ids) <= stops:
            raise InvalidRequestError("allowed_token_ids: every allowed token is a stop token, so min_tokens "
                                      "cannot be met", param="allowed_token_ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def token_ids_ok(ids) -> bool:
    """Whether every one of ``ids`` is an integer >= 0 (a bool is not). Exact ``int`` ids are
    checked in C: ``allowed_token_ids`` may list thousands, and the ABC check
    (``numbers.Integral``) per id cost ~1 ms a request on the HTTP event loop for 4256 ids,
    in front of every other request (docs/PERFORMANCE.md, "A burst behind request checks")."""
    if set(map(type, ids)) <= {int}:
        return not ids or min(ids) >= 0
    return all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in ids)


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of ``bad_words``: each word as written (leading spaces stripped)
    and, when that gives another first token and the same length, after one space (a word
    inside text). Raises InvalidRequestError for a word that tokenizes to nothing or is not
    UTF-8 text (a JSON string may hold a lone surrogate, which the tokenizer cannot take)."""
    out: list[list[int]] = []
    for w in words:
        try:
            w.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError("bad_words is not valid UTF-8 text", param="bad_words") from None
        bare = tokenizer.encode(w.lstrip(), add_special_tokens=False)
        if not bare:
            raise InvalidRequestError(f"bad_words: {w!r} tokenizes to no token", param="bad_words")
        out.append(list(bare))
        spaced = tokenizer.encode(" " + w.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(list(spaced))
    return out


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


async def request_outputs(stream, abandon: Callable[[], Awaitable[None]],
                          done: Callable[[], object]) -> AsyncIterator["RequestOutput"]:
    """A request's outputs from ``stream`` (an ``asyncio.Queue``) up to its final one; an
    exception in it is raised (the request ended with it). ``done()`` at the end whatever
    the end, after ``await abandon()`` when the consumer left before the final output (the
    HTTP client went away): close it with ``aclose`` (``contextlib.aclosing``), so that
    this runs at once."""
    finished = False
    try:
        while True:
            item = await stream.get()
            if isinstance(item, BaseException):
                finished = True
                raise item
            finished = item.finished
            yield item
            if finished:
                return
    finally:
        done()
        if not finished:
            await abandon()


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
