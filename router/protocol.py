"""The router's OpenAI-compatible HTTP schemas, and the engine interface the HTTP layer uses.

Requests are pydantic v2 models in strict mode (``"5"`` is not an int, ``1.5`` is not an
int, ``NaN`` is not a float) that accept and ignore unknown fields (named in one warning
line per request), as vLLM does: a malformed body is a 400 with an
OpenAI-style error body (``router/api/errors.py`` converts pydantic's errors). Semantic checks that
need the tokenizer or the context limit (prompt length, token id range) happen in
``router/api/handlers.py`` and ``router/api/fanout.py``; range checks of the sampling knobs are repeated by
``SamplingParams.validate``.

Responses are plain pydantic models in OpenAI's shapes. ppspec extensions
(``token_ids``, ``prompt_token_ids``, ``stop_reason``) are left out of the JSON when unset.

Units: every ``*_tokens`` field counts tokens; ``created`` is Unix time in seconds; log
probabilities are natural logarithms.
"""
from __future__ import annotations

import functools
import json
import math

import time
from typing import (TYPE_CHECKING, Any, AsyncIterator, ClassVar, ForwardRef, Literal, Optional, Protocol, Union,
                    get_args, get_origin, runtime_checkable)

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from .types import RequestOutput, SamplingParams

if TYPE_CHECKING:  # pragma: no cover - typing only; transformers is heavy to import
    from transformers import PreTrainedTokenizerBase

# Limits of the request schema. Each is a DoS guard, not a model property.
MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts in one completions request
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512  # length of one stop string, in characters
MAX_BAD_WORDS_CHARS = 16384
"""Characters of a request's ``bad_words`` in all. Every step of the request carries the
words' token sequences to every stage (decoded there each time) and the last stage matches
each against the outputs at every verified position: 1024 words of ~460 characters (a
0.5 MB body, 600k token ids) cost ~40 ms a step, and four such requests made every other
request's 32 tokens take 15-24 s instead of 1.4 s. At this bound a request's words cost
about what a plain request does (the synchronous rounds a multi-token word needs aside)."""
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs (the server's cap: SamplingParams.validate)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


# --------------------------------------------------------------------------------------
# The engine interface
# --------------------------------------------------------------------------------------


@runtime_checkable
class AsyncEngine(Protocol):
    """What the HTTP layer needs from an engine (``router/engine.py`` implements it).

    Token-level stopping (EOS unless ``ignore_eos``, ``stop_token_ids``, ``max_tokens``,
    ``min_tokens``) is the engine's; stop *strings* are the HTTP layer's (it detokenizes,
    truncates and calls ``abort``).
    """

    model_name: str
    """Served model id (the default ``model`` of requests and of ``/v1/models``)."""
    tokenizer: "PreTrainedTokenizerBase"
    """Hugging Face tokenizer of the checkpoint (its chat template renders chat requests)."""
    max_model_len: int
    """Context limit in tokens: prompt tokens + completion tokens of one request."""

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Run one request; an async generator function (calling it returns the iterator).

        Yields ``RequestOutput`` updates, each with the tokens new since the previous one;
        the last has ``finish_reason`` set ("stop", "length" or "abort"). ``request_id`` is
        unique per call. The HTTP layer also accepts an ``async def`` that returns the
        iterator.

        Raises (from the first ``__anext__``, before anything is yielded, nothing allocated):
        ``InvalidRequestError``, ``ContextLengthError`` (prompt + max_tokens over
        ``max_model_len``), ``QueueFullError``. Raises ``StageDownError`` before or after
        yielding (a stage failed; the request is over).
        """
        ...

    async def abort(self, request_id: str, finish_reason: str = "abort") -> None:
        """Stop a request and free its rows; a no-op for unknown or finished ids.

        ``finish_reason`` is what the request is recorded as (metrics): ``"stop"`` when the
        HTTP layer matched a stop string, ``"abort"`` otherwise.

        The running ``generate`` then yields a final output with ``finish_reason="abort"``
        (the HTTP layer may instead close the iterator with ``aclose()``; both must free
        the rows).
        """
        ...

    def health(self) -> tuple[bool, str]:
        """``(ok, detail)``; when not ok, ``detail`` names the stage that is down. Cheap, non-blocking."""
        ...


# --------------------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------------------


REFUSED_FIELDS = frozenset({
    "use_beam_search",
    "structural_tag",  # of structured_outputs (router/structured.py builds the other kinds)
})
"""Fields of vLLM's API that change what the output must be and that ppspec does not
implement: refused (400) rather than ignored, so a client never gets output that silently
disregards them. (A field implemented later is declared on its model and leaves this set's reach.)"""


class _Request(BaseModel):
    """Strict request model: wrong JSON types and non-finite floats are rejected (400).
    Unknown fields are accepted and ignored, as vLLM does (clients such as guidellm or the
    OpenAI SDK send fields of their own): :func:`ignored_fields` names them, for the one
    warning line the HTTP layer logs per request; those in ``REFUSED_FIELDS`` are a 400."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    @model_validator(mode="after")
    def _refuse_unimplemented(self):
        for name in self.model_extra or {}:
            if name in REFUSED_FIELDS:
                raise ValueError(f"{name} is not supported")
        return self


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the unknown (ignored) fields of a request and of the models it
    holds, e.g. ``["metadata", "messages.0.foo"]``."""
    names = [prefix + str(k) for k in (model.model_extra or {})]
    for key in _nesting_fields(type(model)):
        value = getattr(model, key)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, _Request):
                names += ignored_fields(item, f"{prefix}{key}." + ("" if i is None else f"{i}."))
    return names


def _may_hold_model(tp: Any) -> bool:
    """Whether a value of the annotation ``tp`` may hold a pydantic model (``Any`` and an
    unresolved name may)."""
    if tp is Any or isinstance(tp, (str, ForwardRef)):
        return True
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return True
    if get_origin(tp) is Literal:
        return False
    return any(_may_hold_model(a) for a in get_args(tp))


@functools.cache
def _nesting_fields(cls: type[BaseModel]) -> tuple[str, ...]:
    """The fields of ``cls`` whose values may hold request models: the ones
    :func:`ignored_fields` looks into (not a prompt's thousands of token ids, which it
    looked at one by one: ~0.6 ms for 8000 ids)."""
    return tuple(k for k, f in cls.model_fields.items() if _may_hold_model(f.annotation))


def _null_means_default(*fields: str):
    """A before-validator reading ``null`` as the default of ``fields``: OpenAI's API takes
    ``null`` for these (its spec marks them nullable), and clients that write every field,
    such as those generated from that spec, send it. (Each model names its
    validator apart: a subclass attribute of the same name would replace its parent's.)"""

    def null_is_default(cls, v: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].default if v is None else v

    return field_validator(*fields, mode="before")(classmethod(null_is_default))


class StreamOptions(_Request):
    include_usage: bool = False
    """Send one last chunk (``choices: []``) with the request's ``usage`` before ``[DONE]``."""
    continuous_usage_stats: bool = False
    """vLLM's, with ``include_usage`` (alone it does nothing, as in vLLM): every chunk also
    carries the ``usage`` of its choice so far (that choice's prompt tokens and the completion
    tokens it generated up to and with this chunk's; 0 on chat's role chunk); the last chunk
    has the totals over all choices."""


class JsonSchemaSpec(_Request):
    """``response_format.json_schema`` (OpenAI)."""

    name: Optional[str] = None
    description: Optional[str] = None
    schema_: dict[str, Any] = Field(alias="schema")
    """The JSON schema the output must validate against."""
    strict: Optional[bool] = None
    """Accepted; the output always follows the schema (no properties beyond it)."""


class StructuralTagItem(_Request):
    """One tag of vLLM's legacy ``structural_tag`` response format."""

    begin: str
    schema_: dict[str, Any] = Field(alias="schema")
    end: str


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    """``json_object``: any JSON object; ``json_schema``: one that validates against
    ``json_schema.schema`` (``router/structured.py`` builds the grammar); ``structural_tag``
    (vLLM's): xgrammar's structural tag ``format``, or the legacy ``structures`` (begin,
    schema, end) and ``triggers``."""
    json_schema: Optional[JsonSchemaSpec] = None
    format: Optional[dict[str, Any]] = None
    structures: Optional[list[StructuralTagItem]] = None
    triggers: Optional[list[str]] = None

    @model_validator(mode="after")
    def _check_format(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type json_schema needs its schema: "json_schema": {"name": ..., "schema": {...}}')
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema goes with type json_schema, not {self.type}")
        if self.type == "structural_tag" and (self.format is None) == (self.structures is None):
            raise ValueError("structural_tag takes format, or structures and triggers (vLLM's legacy form)")
        return self


class StructuredOutputs(_Request):
    """vLLM's ``structured_outputs``: exactly one of ``json`` (a JSON schema, as an object or
    its text), ``regex``, ``choice``, ``grammar`` (xgrammar EBNF, or Lark), ``json_object``."""

    json_: Union[dict[str, Any], str, None] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = Field(None, min_length=1)
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Union[dict[str, Any], str, None] = None
    """xgrammar's structural tag (``{"type": "structural_tag", "format": ...}``), as an object or its JSON text."""
    disable_any_whitespace: bool = False
    """Accepted: JSON output is always compact here (``", "`` and ``": "``, no newlines)."""


class _GenerationRequest(_Request):
    """Fields shared by ``/v1/completions`` and ``/v1/chat/completions``."""

    model: Optional[str] = None
    """Must name the served model when given (else 404); omitted means the served model."""
    max_tokens: Optional[int] = Field(None, ge=0)
    """Completion tokens at most, per choice (at least 1; 0 only with completions' ``echo``:
    the prompt alone, as vLLM). Default: the context limit minus the prompt (vLLM's),
    unless ``build_app(max_tokens_cap=...)`` caps it."""
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    """Same as ``max_tokens`` (OpenAI's newer name); give at most one of them."""
    temperature: Optional[float] = Field(None, ge=0.0)
    """Softmax temperature; 0 (or below 1e-5, as vLLM) is greedy. Default 1.0 (as OpenAI)."""
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)
    """Keep the k most likely tokens; 0 or -1 keeps all."""
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=INT64_MIN, le=INT64_MAX)
    """Per-request seed; with n > 1, choice i uses seed + i."""
    stop: Optional[Union[str, list[str]]] = None
    """Stop strings: the text ends before the first occurrence of any (not included)."""
    stop_token_ids: Optional[list[int]] = Field(None, max_length=64)
    """Extra token ids that end a choice (vLLM extension); as EOS, the one that ends it is
    left out of the text unless ``include_stop_str_in_output``."""
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=MAX_N)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    """EOS and stop token ids are ignored until a choice has this many tokens."""
    return_token_ids: bool = False
    """Add ``token_ids`` (generated ids) to each choice and ``prompt_token_ids``."""
    return_tokens_as_token_ids: bool = False
    """vLLM's: logprob entries name tokens as ``token_id:{id}`` instead of their text."""
    skip_special_tokens: bool = True
    """Leave special tokens (EOS, chat markers) out of the returned text."""
    user: Optional[str] = None
    """Accepted and ignored (OpenAI's end-user id)."""
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    """Subtracted once from the logit of every token generated so far."""
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    """Subtracted from a generated token's logit per time it was generated."""
    repetition_penalty: Optional[float] = Field(None, ge=1 / 128, le=128.0)
    """vLLM's extension: > 1 discourages tokens of the prompt and the output (1 = off)."""
    logit_bias: Optional[dict[str, float]] = None
    """Token id (as a string, as OpenAI) -> bias in [-100, 100], added to its logit."""
    allowed_token_ids: Optional[list[int]] = Field(None, max_length=1 << 20)
    """vLLM's: every other token is masked."""
    bad_words: Optional[list[str]] = Field(None, max_length=1024)
    """vLLM's: words that may not be generated (a word's last token is masked where its
    other tokens end the output)."""
    include_stop_str_in_output: bool = False
    """vLLM's: keep the stop string that ended a choice at the end of its text."""
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1)
    """vLLM's: run only the last k tokens of each prompt (the rendered chat's included);
    -1: the last ``max_model_len``; at most ``max_model_len``."""
    prompt_logprobs: Optional[int] = Field(None, ge=-1)
    """vLLM's: the log-probability, rank and this many top alternatives of every prompt
    token (the first's null), in ``choices[i].prompt_logprobs`` (completions) or the
    response's ``prompt_logprobs`` (chat); not with ``stream``."""
    # structured output (router/structured.py): at most one of these, or tool_choice
    # "required" / a named function
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    guided_json: Union[dict[str, Any], str, None] = None
    """vLLM's older names of ``structured_outputs.json``, ``.regex``, ``.choice``, ``.grammar``."""
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = Field(None, min_length=1)
    guided_grammar: Optional[str] = None

    _nullable_common = _null_means_default("stream", "n")

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: Union[str, list[str], None]) -> Union[str, list[str], None]:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        for s in stops:
            if not s:
                raise ValueError("stop strings must not be empty")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("bad_words")
    @classmethod
    def _check_bad_words(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        if v is not None and sum(map(len, v)) > MAX_BAD_WORDS_CHARS:
            raise ValueError(f"the words may have at most {MAX_BAD_WORDS_CHARS} characters in all, got "
                             f"{sum(map(len, v))}")
        return v

    @model_validator(mode="after")
    def _check_common(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("max_completion_tokens: give it or max_tokens, not both")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (the context) or at least 1")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available when stream is true")
        if self.requested_max_tokens == 0 and not getattr(self, "echo_only", False):
            raise ValueError(f"{self.max_tokens_field} must be at least 1 (0 only with echo on /v1/completions: "
                             f"the prompt alone)")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):  # not "-1", " 3", "²" or 10**5000
                raise ValueError(f"logit_bias keys must be token ids, got {key[:24]!r}{'...' if len(key) > 24 else ''}")
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return v

    @property
    def logit_bias_ids(self) -> Optional[dict[int, float]]:
        return {int(k): float(b) for k, b in self.logit_bias.items()} if self.logit_bias else None

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_field(self) -> str:
        """The field :attr:`requested_max_tokens` came from (an error's ``param``)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        # vLLM's: only with include_usage (include_continuous_usage = include_usage and ...)
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


_TOKEN_IDS = TypeAdapter(list[int], config=ConfigDict(strict=True))


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    """A string, a list of strings, a list of token ids, or a list of token id lists."""
    echo: bool = False
    """Prepend the prompt text to each choice's text; with ``logprobs``, the prompt tokens'
    log-probabilities come first too (the first token's null: nothing predicts it)."""
    logprobs: Optional[int] = Field(None, ge=0)
    """Return the log-probability of each generated token and this many top alternatives."""
    suffix: Optional[str] = None
    """Not supported: only null or an empty string."""
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    """Only best_of == n is supported."""

    _nullable_completion = _null_means_default("echo")

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _token_ids_first(cls, v: Any, handler: Any) -> Any:
        """A flat list of token ids is validated as ``list[int]`` alone, which the union
        gives it too (strict: no other member takes ints): the union tries ``list[str]``
        first, which collects an error for every id (0.65 ms for 8000 ids against 0.06).
        Anything else, or a list that ``list[int]`` refuses, goes through the union, whose
        errors are the request's."""
        if type(v) is list and v and type(v[0]) is int:
            try:
                return _TOKEN_IDS.validate_python(v)
            except ValidationError:
                pass
        return handler(v)

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0 (vLLM's): each choice is the prompt alone (its text,
        its log-probabilities), ``finish_reason`` ``length``; one token is generated and dropped."""
        return self.echo and self.requested_max_tokens == 0

    @model_validator(mode="after")
    def _check_completion(self):
        p = self.prompt
        if isinstance(p, str):
            pass
        elif len(p) == 0:
            raise ValueError("prompt must not be empty")
        elif isinstance(p[0], list) and any(len(x) == 0 for x in p):
            raise ValueError("prompt: token id prompts must not be empty")
        if isinstance(p, list) and p and not isinstance(p[0], int) and len(p) > MAX_PROMPTS:
            raise ValueError(f"prompt: at most {MAX_PROMPTS} prompts per request")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must equal n)")
        return self


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    """One chat message; ``content`` is a string, a list of text parts, or null (assistant only)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextContentPart], None] = None
    name: Optional[str] = None
    tool_call_id: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None
    # fields of a returned assistant message (``choices[0].message.model_dump()`` of the
    # OpenAI SDK) that a client sends back in the history; accepted, not rendered
    refusal: Optional[str] = None
    annotations: Optional[list[Any]] = None
    audio: Optional[dict[str, Any]] = None
    function_call: Optional[dict[str, Any]] = None
    reasoning_content: Optional[str] = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        content = data.get("content") if isinstance(data, dict) else None
        for part in content if isinstance(content, list) else []:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"content parts of type {renderable_type(kind)!r} are not supported: the served "
                                 f"models read text (parts of type 'text')")
        return data

    @model_validator(mode="after")
    def _check_content(self):
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        for i, call in enumerate(self.tool_calls or []):
            _check_tool_call(call, i)
        return self

    def text(self) -> Optional[str]:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: text parts joined by newlines, a null
        content as "" (templates print ``None`` or fail on it), and each tool call's
        ``function.arguments`` JSON string as the object it encodes (templates iterate it,
        as vLLM passes it); arguments that are not a JSON object stay the string sent."""
        out: dict[str, Any] = {"role": self.role, "content": self.text() or ""}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls is not None:
            out["tool_calls"] = [_parsed_arguments(c) for c in self.tool_calls]
        return out


def _check_tool_call(call: dict[str, Any], i: int) -> None:
    """A tool call in the history as OpenAI's API (and vLLM's request model) types it:
    ``{"id": str, "type": "function", "function": {"name": str, "arguments": str}}``; the
    arguments may also be the object itself (the template gets an object either way). ValueError
    naming what is wrong: the template would render anything, or fail with a 500."""
    where = f"tool_calls[{i}]"
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise ValueError(f"{where}: needs a function object ({{\"name\": ..., \"arguments\": ...}})")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"{where}: function.name must be a non-empty string")
    if not isinstance(fn.get("arguments"), (str, dict)):
        raise ValueError(f"{where}: function.arguments must be a JSON string (or an object), "
                         f"got {type(fn.get('arguments')).__name__}")
    if call.get("type", "function") != "function":
        raise ValueError(f"{where}: type must be 'function'")
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise ValueError(f"{where}: id must be a string")


def renderable_type(kind: str) -> str:
    """A client's part type, cut short for an error message."""
    return kind if len(kind) <= 32 else kind[:32] + "..."


def _parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except (ValueError, RecursionError):
        return call
    if not isinstance(args, dict):
        return call
    return {**call, "function": {**fn, "arguments": args}}


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens",
})
"""``apply_chat_template``'s own arguments: not template variables a request may set."""


# A tool's function fields besides its name, as OpenAI (and vLLM's request model) type them:
# (field, the types it may have when not null, what the error says it must be). The tool
# call parsers and the forced-call grammars read ``parameters`` as a JSON schema object.
_FUNCTION_FIELDS = (("parameters", dict, "a JSON schema object"), ("description", str, "a string"),
                    ("strict", bool, "a boolean"))


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    """Return per-token log-probabilities in ``choices[i].logprobs.content``."""
    top_logprobs: Optional[int] = Field(None, ge=0)
    """Top alternatives per token; more than 0 needs ``logprobs: true``."""
    _nullable_chat = _null_means_default("logprobs")
    tools: Optional[list[dict[str, Any]]] = None
    """Functions the model may call (``{"type": "function", "function": {"name", ...}}``),
    rendered by the chat template; needs a server started with ``--tool-call-parser``."""
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    """``"auto"`` (the default with tools), ``"none"`` (the tools are not rendered),
    ``"required"`` (one or more calls) or ``{"type": "function", "function": {"name": ...}}``
    (one call of that function): those two constrain the output to calls in the parser's
    format (``router/structured.py``)."""
    parallel_tool_calls: Optional[bool] = None
    """Accepted; the model may call several tools in one message either way."""
    chat_template_kwargs: Optional[dict[str, Any]] = None
    """Extra variables for the chat template, e.g. ``{"enable_thinking": false}`` (Qwen3 /
    Qwen3.5 templates); names of ``apply_chat_template``'s own arguments are refused."""
    add_generation_prompt: bool = True
    """Open an assistant turn after the messages (the template's generation prompt)."""
    continue_final_message: bool = False
    """Render the last message (an assistant turn) open-ended, so that the completion
    continues it; needs ``add_generation_prompt: false``."""
    echo: bool = False
    """vLLM's: when the last message is the assistant's, its content starts each choice's
    content (with ``continue_final_message``: the whole reply)."""

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _check_tool_choice_form(cls, v: Any) -> Any:
        """Name the accepted forms (pydantic's union error names its own branch types)."""
        if v is None or (isinstance(v, str) and v in ("none", "auto", "required")):
            return v
        fn = v.get("function") if isinstance(v, dict) else None
        if isinstance(fn, dict) and v.get("type") == "function" and isinstance(fn.get("name"), str):
            return v
        raise ValueError('expected "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')

    @model_validator(mode="after")
    def _check_chat(self):
        if "chat_template" in (self.model_extra or {}):  # it would change the prompt: refused, not ignored
            raise ValueError("chat_template in a request is not supported (vLLM refuses it too, without "
                             "--trust-request-chat-template): start the server with --chat-template")
        if self.top_logprobs and not self.logprobs:  # 0 asks for nothing: accepted alone, as vLLM
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt set to false")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be an assistant message")
        reserved = sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_ARGUMENTS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)} (a request field or "
                             "the server's own argument of apply_chat_template)")
        for t in self.tools or []:
            fn = t.get("function")
            if t.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                    or not fn["name"]:
                raise ValueError('tools: each must be {"type": "function", "function": {"name": ..., ...}}')
            for key, kinds, what in _FUNCTION_FIELDS:
                if fn.get(key) is not None and not isinstance(fn[key], kinds):
                    raise ValueError(f"tools: function {fn['name']!r}: {key} must be {what}, "
                                     f"got {type(fn[key]).__name__}")
        if self.tool_choice not in (None, "none", "auto"):
            names = [t["function"]["name"] for t in self.tools or []]
            if not names:
                raise ValueError("tool_choice \"required\" or naming a function needs tools")
            if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names function {self.tool_choice.function.name!r}, which is not "
                                 f"among the tools ({', '.join(names)})")
        return self

    @property
    def tools_in_use(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def echoed(self) -> str:
        """The text ``echo`` puts before each choice's content ("" when none)."""
        last = self.messages[-1]
        return (last.text() or "") if self.echo and last.role == "assistant" else ""


class TokenizeRequest(_Request):
    """``POST /tokenize`` (vLLM's): a ``prompt`` encoded as ``/v1/completions`` does, or
    ``messages`` rendered as ``/v1/chat/completions`` does; exactly one of them."""

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    add_special_tokens: Optional[bool] = None
    """Default: true for a prompt, false for messages (the template writes them)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _check_tokenize(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt or messages: give exactly one of them")
        reserved = sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_ARGUMENTS)
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        return self


class DetokenizeRequest(_Request):
    """``POST /detokenize`` (vLLM's): token ids to text (special tokens kept)."""

    model: Optional[str] = None
    tokens: list[int] = Field(max_length=1 << 20)


# --------------------------------------------------------------------------------------
# Responses
# --------------------------------------------------------------------------------------


class _Response(BaseModel):
    """Response model; the fields named in ``_omit_if_none`` are left out of the JSON when None
    (ppspec extensions and stream-only fields), the others are always written."""

    model_config = ConfigDict(extra="forbid")
    _omit_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_unset_optional(self, handler: SerializerFunctionWrapHandler) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for key in self._omit_if_none:
                if key in data and data[key] is None:
                    del data[key]
        return data


class ErrorInfo(_Response):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(_Response):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class PromptTokensDetails(_Response):
    cached_tokens: int = 0
    """Prompt tokens whose state the prefix cache held (not computed again)."""


class UsageInfo(_Response):
    prompt_tokens: int = 0
    """Prompt tokens, each prompt counted once (not once per choice)."""
    completion_tokens: int = 0
    """Generated tokens over all choices (after stop-string truncation)."""
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None
    """With --enable-prefix-caching: the cached part of the prompts."""

    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"prompt_tokens_details"})


class PromptLogprob(_Response):
    """vLLM's entry of one token in ``prompt_logprobs`` (keyed by its token id)."""

    logprob: float
    rank: Optional[int] = None
    """1 + the number of tokens more likely at that position."""
    decoded_token: Optional[str] = None


PromptLogprobs = list[Optional[dict[int, PromptLogprob]]]
"""One entry per prompt token: None for the first (nothing predicts it), then the prompt
token's and the top alternatives' entries by token id."""


class CompletionLogprobs(_Response):
    """OpenAI's legacy completions log-probability shape, one list entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    """Character offset of each token's text in the choice's ``text``."""
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(_Response):
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"prompt_token_ids", "stop_reason", "token_ids",
                                                         "prompt_logprobs"})
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None
    """The stop string or stop token id that ended the choice (vLLM extension)."""
    token_ids: Optional[list[int]] = None
    prompt_token_ids: Optional[list[int]] = None
    prompt_logprobs: Optional[PromptLogprobs] = None


class CompletionResponse(_Response):
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"usage"})
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: Optional[list[ChatTokenLogprob]] = None
    refusal: Optional[list[ChatTokenLogprob]] = None


class ChatResponseMessage(_Response):
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"tool_calls", "reasoning_content"})
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    """The thinking, with ``--reasoning-parser`` (vLLM's field)."""
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChatChoice(_Response):
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"stop_reason", "token_ids"})
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionResponse(_Response):
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"prompt_token_ids", "usage", "prompt_logprobs"})
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Optional[UsageInfo] = None
    prompt_token_ids: Optional[list[int]] = None
    prompt_logprobs: Optional[PromptLogprobs] = None


class ChatDelta(_Response):
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"content", "role", "tool_calls", "reasoning_content"})
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None  # each with its "index"


class ChatStreamChoice(_Response):
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"stop_reason", "token_ids"})
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[str, int, None] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionChunk(_Response):
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"prompt_token_ids", "usage"})
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None
    prompt_token_ids: Optional[list[int]] = None


class CompletionChunk(_Response):
    """A streamed completions event (OpenAI uses ``object: "text_completion"`` here too)."""
    _omit_if_none: ClassVar[frozenset[str]] = frozenset({"usage"})

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ppspec"
    max_model_len: Optional[int] = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str
