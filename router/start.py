"""The router's engine built from its arguments: the tokenizer (with ``--chat-template``)
and the :class:`~router.engine.Engine` over the stages, started. Both the HTTP server's
process (``router/server.py``, with ``--no-engine-process``) and the engine process
(``router/engine_proc.py``) start it from here."""
from __future__ import annotations

import os

from ppspec.auth import KeyFileError, read_key_file


def load_chat_template(value: str) -> str:
    """``--chat-template``: the text of the file ``value`` names, or ``value`` itself when it
    is a Jinja template (holds ``{{`` or ``{%``), as vLLM reads it. Raises ValueError."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template {value}: cannot read it ({e})") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value}: no such file, and not a Jinja template")


GENERATION_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}
"""The sampling fields of generation_config.json a request's defaults come from, with
transformers' ``GenerationConfig`` defaults: a field at its default is not the model's."""


def generation_defaults(model_dir: str) -> tuple[dict[str, float], int | None]:
    """The checkpoint's recommended sampling, as vLLM's ``--generation-config auto`` reads it:
    the fields of ``GENERATION_DEFAULTS`` that generation_config.json sets to another value
    than transformers' default, and its ``max_new_tokens`` (the default ``max_tokens``; None
    when absent). Nothing when the file is absent or unreadable."""
    import json

    try:
        with open(os.path.join(model_dir, "generation_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return {}, None
    if not isinstance(config, dict):
        return {}, None
    defaults = {k: config[k] for k, base in GENERATION_DEFAULTS.items()
                if isinstance(config.get(k), (int, float)) and not isinstance(config[k], bool) and config[k] != base}
    cap = config.get("max_new_tokens")
    return defaults, cap if isinstance(cap, int) and not isinstance(cap, bool) and cap > 0 else None


class EngineStartError(Exception):
    """The router cannot serve (a stage unreachable, a bad key or tokenizer, stages that
    disagree); the message says why, the process exits with status 2."""


def load_tokenizer(args):
    """The checkpoint's tokenizer, with ``--chat-template`` applied. Raises EngineStartError."""
    from transformers import AutoTokenizer

    try:
        chat_template = load_chat_template(args.chat_template) if args.chat_template else None
    except ValueError as e:
        raise EngineStartError(str(e)) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as e:
        raise EngineStartError(f"cannot load the tokenizer of {args.model}: {e}") from None
    # The context limit is the stages' (checked per request); silence the tokenizer's own.
    tokenizer.model_max_length = 1 << 62
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def served_name(args) -> str:
    return args.served_model_name or args.model.rstrip("/").split("/")[-1]


async def start_engine(args, tokenizer=None):
    """The engine of ``args`` over the stages, started (every stage's ``Info`` read), and its
    metrics: ``(Engine, RouterMetrics)``. Raises EngineStartError."""
    from .engine import Engine
    from .grpc_pipeline import GrpcPipeline
    from .metrics import RouterMetrics
    from .types import StageDownError

    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(args)
    key = None
    if args.pipeline_key_file:
        try:
            key = read_key_file(args.pipeline_key_file)
        except KeyFileError as e:
            raise EngineStartError(str(e)) from None
    pipeline = GrpcPipeline(args.stages, step_timeout=args.step_timeout, key=key)
    try:
        await pipeline.wait_ready(args.connect_timeout)
        await pipeline.check_key()
        infos = await pipeline.info()
    except StageDownError as e:
        raise EngineStartError(str(e)) from None
    metrics = RouterMetrics(num_stages=len(args.stages), num_spec_tokens=infos[-1]["num_speculative_steps"])
    engine = Engine(pipeline, model_name=served_name(args), tokenizer=tokenizer,
                    speculative_algorithm=args.speculative_algorithm,
                    num_micro_batches=args.num_micro_batches, max_batch_size=args.max_batch_size,
                    max_num_batched_tokens=args.max_num_batched_tokens,
                    mixed_prefill_tokens=args.mixed_prefill_tokens, chunk_size=args.chunk_size,
                    max_waiting=args.max_waiting, wedge_timeout=args.wedge_timeout,
                    stall_timeout=args.stall_timeout, enable_prefix_caching=args.enable_prefix_caching,
                    async_scheduling=args.async_scheduling, metrics=metrics, max_logprobs=args.max_logprobs,
                    max_in_flight=args.max_in_flight)
    try:
        await engine.start()
    except (ValueError, StageDownError) as e:
        await pipeline.leave()  # it asked the stages' Info: they need not count it
        raise EngineStartError(str(e)) from None
    return engine, metrics
