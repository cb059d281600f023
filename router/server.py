"""``ppspec router``: the HTTP API and the scheduler in front of running stages."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys

from ppspec.argtypes import DEMO_MODEL, DefaultsHelpFormatter, add_gc_freeze_arg, address_list, json_str_list, listen_error, port, positive_float, positive_int
from ppspec.heap import freeze_startup_heap

from .reasoning import REASONING_PARSERS
from .start import EngineStartError, generation_defaults, load_tokenizer, served_name, start_engine
from .tool_calls import TOOL_CALL_PARSERS


def _max_logprobs(value: str) -> int:
    # ArgumentTypeError: argparse prints its message (a ValueError's it replaces with the
    # function's name: "invalid _max_logprobs value")
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if n < -1:
        raise argparse.ArgumentTypeError(f"give a count >= 0, or -1 for no cap, got {n}")
    return n


def add_router_args(ap: argparse.ArgumentParser) -> list[argparse.Action]:
    """The router's options that ``ppspec serve`` takes as well and hands on to the router
    it starts (scheduling, timeouts, the HTTP API): their help texts and defaults, once.
    Returns their actions, for :func:`router_options`."""
    add = ap.add_argument
    return [
        add("--num-micro-batches", type=positive_int, default=None,
            help="micro-batches in flight (default: the number of stages, stages sharing one GPU counted once)"),
        add("--max-in-flight", type=positive_int, default=None,
            help="micro-batches of every lane in flight at most: a lane sends its next round beside the one in "
                 "flight only below it (default: two per lane)"),
        add("--max-batch-size", type=positive_int, default=64, help="requests per micro-batch"),
        add("--max-num-batched-tokens", type=positive_int, default=None,
            help="tokens per micro-batch: decodes and verifies first, prefill chunks in the rest of one "
                 "forward (default: 8192 on CUDA stages, 512 on CPU ones); at least --max-batch-size x D"),
        add("--mixed-prefill-tokens", type=positive_int, default=None,
            help="prompt-chunk tokens of a micro-batch that also decodes; a whole prompt of at most this "
                 "many tokens joins in the rest of the budget (default: 512 on CUDA, 128 on CPU)"),
        add("--chunk-size", type=positive_int, default=None,
            help="prompt tokens of one request per micro-batch at most (default: the token budget)"),
        add("--max-waiting", type=positive_int, default=4096, help="requests waiting for a row (beyond those the free rows take next) before 429"),
        add("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
            help="send a micro-batch's next round before its last one's result, decoding requests' input "
                 "ids filled in by the first stage; off: each round after the last one's result"),
        add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
            help="reuse the state of cached prompt prefixes (snapshots of the recurrent state, shared KV pages); "
                 "default: on when every stage has a prefix cache (--prefix-cache-gb; ppspec serve gives each one), "
                 "as it costs first turns no throughput (docs/PERFORMANCE.md); on requires it of every stage"),
        add("--max-logprobs", type=_max_logprobs, default=20,
            help="log-probabilities a request may ask for per token (logprobs, top_logprobs, prompt_logprobs; "
                 "vLLM's option): more is a 400; -1: no cap (prompt_logprobs -1, the whole vocabulary, needs it)"),
        add("--api-key", default=None, help="bearer key required on /v1/* (default: none)"),
        # CORS, vLLM's options and defaults (a string default goes through its type)
        add("--allowed-origins", type=json_str_list, default='["*"]',
            help='origins a browser page may call the API from, a JSON list (e.g. \'["https://app.example"]\'; '
                 '"*": any)'),
        add("--allowed-methods", type=json_str_list, default='["*"]',
            help="HTTP methods a cross-origin request may use, a JSON list"),
        add("--allowed-headers", type=json_str_list, default='["*"]',
            help="request headers a cross-origin request may send, a JSON list"),
        add("--allow-credentials", action=argparse.BooleanOptionalAction, default=False,
            help="let cross-origin requests carry credentials (cookies, HTTP auth)"),
        add("--served-model-name", default=None, help="the model id clients send (default: the folder's name)"),
        add("--chat-template", default=None,
            help="a Jinja chat template, or a file holding one (default: the tokenizer's)"),
        add("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
            help="read tool calls from chat output (the chat API's tools); default: tools are refused"),
        add("--reasoning-parser", default=None, choices=REASONING_PARSERS,
            help="split chat output's thinking into reasoning_content (qwen3: <think>...</think>); "
                 "default: it stays content"),
        add("--generation-config", default="auto", choices=["auto", "vllm"],
            help="sampling defaults of a request that leaves them out (vLLM's option): auto, the checkpoint's "
                 "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty; max_new_tokens "
                 "as the default max_tokens); vllm, vLLM's own (temperature 1, no top-p / top-k)"),
        add("--engine-process", action=argparse.BooleanOptionalAction, default=True,
            help="run the scheduler and the pipeline in a process of their own, the HTTP server and its "
                 "per-token work (detokenization, stop strings, SSE) in the router's; off: one event loop "
                 "does both"),
        add_gc_freeze_arg(ap),
        add("--api-server-count", type=positive_int, default=1,
            help="HTTP server processes in front of the engine process, accepting on one port (vLLM's option): "
                 "the per-token HTTP work of many streams on several cores"),
        add("--step-timeout", type=positive_float, default=120.0, help="seconds one micro-batch may take"),
        add("--wedge-timeout", type=positive_float, default=60.0,
            help="seconds a micro-batch may stay outstanding before /health says 503"),
        add("--stall-timeout", type=positive_float, default=10.0,
            help="seconds a stage may fail its health checks with micro-batches in flight before those "
                 "requests fail (503) instead of waiting for --step-timeout"),
    ]


def add_auto_tool_choice_arg(ap: argparse.ArgumentParser) -> None:
    """vLLM's ``--enable-auto-tool-choice`` (``ppspec router`` and ``ppspec serve``; serve
    does not pass it on): accepted, checked by :func:`check_auto_tool_choice`."""
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help="accepted, as vLLM's: with --tool-call-parser the model may always call tools "
                         "(tool_choice auto); it needs --tool-call-parser")


def check_auto_tool_choice(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--enable-auto-tool-choice`` without ``--tool-call-parser``: a usage error (exit 2)."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        ap.error("--enable-auto-tool-choice needs --tool-call-parser (hermes or qwen3_coder)")


def router_options(args: argparse.Namespace) -> list[str]:
    """The command-line of :func:`add_router_args`' options as ``args`` holds them (options
    left at None are left out), for a launcher that starts the router."""
    argv = []
    for action in add_router_args(argparse.ArgumentParser(add_help=False)):
        value = getattr(args, action.dest)
        if isinstance(action, argparse.BooleanOptionalAction):
            if value is not None:
                argv.append(action.option_strings[0 if value else 1])
        elif isinstance(value, list):  # a JSON list option, as it was given
            argv += [action.option_strings[0], json.dumps(value)]
        elif value is not None:
            argv += [action.option_strings[0], str(value)]
    return argv


def cors_options(args: argparse.Namespace) -> dict:
    """``build_app``'s CORS arguments from the router's options."""
    return {"allowed_origins": args.allowed_origins, "allowed_methods": args.allowed_methods,
            "allowed_headers": args.allowed_headers, "allow_credentials": args.allow_credentials}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ppspec router", description="OpenAI-compatible router in front of ppspec stages",
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--model", default=DEMO_MODEL, help="checkpoint folder (its tokenizer and chat template)")
    ap.add_argument("--stages", type=address_list, required=True, help="comma-separated host:port of the stages, in PP-rank order")
    ap.add_argument("--host", default="127.0.0.1", help="address of the HTTP API")
    ap.add_argument("--port", type=port, default=8000, help="port of the HTTP API")
    ap.add_argument("--speculative-algorithm", default=None, choices=["none", "ngram", "mtp"],
                    help="checked against the stages (default: what the stages run)")
    add_router_args(ap)
    add_auto_tool_choice_arg(ap)
    ap.add_argument("--connect-timeout", type=positive_float, default=300.0,
                    help="seconds to wait for the stages at start (a CUDA stage's first start on a machine "
                         "builds FlashInfer's prefill kernel: minutes)")
    ap.add_argument("--pipeline-key-file", default=None,
                    help="file holding the secret shared with the stages, their --pipeline-key-file (default: none, "
                         "for stages started without one)")
    ap.add_argument("--log-level", default="info", help="uvicorn's log level")
    # the router's own processes (router/engine_proc.py): its engine process, its extra HTTP servers
    ap.add_argument("--engine-fd", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--engine-listen-fd", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--engine-address", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--http-fd", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    return ap


async def run_router(args, argv: list[str]) -> int:
    """Serve HTTP in front of the engine: in a child process (``--engine-process``, the
    default: router/engine_proc.py says why) or on this event loop."""
    from .api import build_app, serve_http
    from .engine_proc import EngineClient, HttpServers, connect_engine

    extra = http = None
    if args.engine_address is not None:  # one of the extra HTTP servers (--api-server-count)
        http = socket.socket(fileno=args.http_fd)
    else:
        err = listen_error(args.host, args.port)  # before anything starts or prints
        if err:
            print(f"ppspec router: {err}", file=sys.stderr)
            return 2
        if args.api_server_count > 1 and not args.engine_process:
            print("ppspec router: --api-server-count above 1 needs --engine-process", file=sys.stderr)
            return 2
    name = served_name(args)
    try:
        tokenizer = load_tokenizer(args)
        if args.engine_address is not None:
            engine = await connect_engine(args.engine_address, tokenizer, name)
            registry, before_metrics = engine.registry, engine.refresh_metrics
        elif args.engine_process:
            extra = HttpServers(argv, args.api_server_count) if args.api_server_count > 1 else None
            engine = EngineClient(argv, tokenizer, name)
            await engine.start(listen=extra.listen if extra else None)
            registry, before_metrics = engine.registry, engine.refresh_metrics
        else:
            engine, metrics = await start_engine(args, tokenizer)
            registry, before_metrics = metrics.registry, None
    except EngineStartError as e:
        print(f"ppspec router: {e}", file=sys.stderr)
        return 2
    defaults, max_tokens_cap = generation_defaults(args.model) if args.generation_config == "auto" else ({}, None)
    if defaults or max_tokens_cap:
        logging.getLogger("ppspec.router").info("default sampling from %s/generation_config.json: %s%s", args.model,
                                                defaults, f", max_tokens {max_tokens_cap}" if max_tokens_cap else "")
    app = build_app(engine, name, api_key=args.api_key, registry=registry, before_metrics=before_metrics,
                    tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                    sampling_defaults=defaults, max_tokens_cap=max_tokens_cap, **cors_options(args))
    if extra is not None:
        http = bind_http(args.host, args.port)
        try:
            await extra.spawn(http)
        except EngineStartError as e:
            print(f"ppspec router: {e}", file=sys.stderr)
            await extra.stop()
            await engine.close()
            return 2
    frozen = freeze_startup_heap("HTTP server", args.gc_freeze)  # built, its engine started: what lives on
    if args.ready_fd is not None:  # an extra HTTP server: built, its engine reached
        os.write(args.ready_fd, b"1")
        os.close(args.ready_fd)
    if args.engine_address is None:
        heap = f"{frozen} objects here" + (f", {engine.frozen} in the engine process"
                                           if isinstance(engine, EngineClient) else "")
        print(f"ppspec router: {len(args.stages)} stage{'s' if len(args.stages) > 1 else ''}, speculative {engine.spec}, "
              f"{args.api_server_count} HTTP server{'s' if args.api_server_count > 1 else ''}, "
              f"startup heap frozen ({heap}), serving {name} on http://{args.host}:{args.port}", flush=True)
    stop = asyncio.Event()  # set when the engine process ends unasked: this process ends too, status 1
    if isinstance(engine, EngineClient):
        engine.on_lost = stop.set
    try:
        await serve_http(app, args.host, args.port, log_level=args.log_level, on_exit=engine.shutdown, sock=http,
                         shutdown=stop)
    finally:
        if extra is not None:
            await extra.stop()
        await engine.close()
    lost = engine.lost if isinstance(engine, EngineClient) else None
    if lost:
        print(f"ppspec router: {lost}", file=sys.stderr)
        return 1
    return 0


def bind_http(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` that several HTTP server processes accept on."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``ppspec router``'s options; a conflict exits 2 (argparse's usage error)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    check_auto_tool_choice(ap, args)
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from .engine_proc import run_engine_process

    if args.engine_fd is not None:
        return run_engine_process(args, args.engine_fd)
    try:
        import uvloop

        return uvloop.run(run_router(args, argv))
    except ImportError:
        return asyncio.run(run_router(args, argv))
