"""Bad command-line values are one usage error (exit 2, no traceback) for every subcommand."""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import pytest

CASES = [
    (["serve", "--max-rows", "0"], "--max-rows/--max-num-seqs: must be >= 1"),
    (["serve", "--max-batch-size", "0"], "--max-batch-size: must be >= 1"),
    (["serve", "--port", "99999"], "--port: a TCP port is in [1, 65535]"),
    (["serve", "--stage-ports", "abc"], "--stage-ports: expected a TCP port"),
    (["serve", "--pp-size", "2", "--stage-ports", "9504,9505,9506"], "lists 3 ports for 2 stages"),
    (["serve", "--device", "gpu"], "--device: expected cpu, cuda or cuda:N"),
    (["serve", "--num-threads", "-3"], "--num-threads: must be >= 0"),
    (["serve", "--speculative-num-steps", "0"], "--speculative-num-steps: must be >= 1"),
    (["serve", "--max-context", "0"], "--max-context/--max-model-len: must be >= 1"),
    (["serve", "--num-micro-batches", "0"], "--num-micro-batches: must be >= 1"),
    (["serve", "--startup-timeout", "-1"], "--startup-timeout: must be > 0"),
    (["serve", "--memory-budget-gb", "inf"], "--memory-budget-gb: must be a finite number > 0"),
    (["stage", "--memory-budget-gb", "1e400"], "--memory-budget-gb: must be a finite number > 0"),
    (["serve", "--pp-size", "9"], "--pp-size 9 is more than the checkpoint's 8 layers"),  # the demo: 8
    (["stage", "--max-context", "100000"], "max_context 100000 is more than the checkpoint's 4096 tokens"),
    (["serve", "--max-context", "100000"], "--max-context 100000 is more than the checkpoint's 4096 tokens"),
    (["serve", "--host", "999.1.1.1"], "--host 999.1.1.1: cannot resolve it"),
    (["serve", "--host", "192.0.2.1"], "--host 192.0.2.1 is not an address of this machine"),  # TEST-NET-1
    (["bench", "--base-url", "http://127.0.0.1:1", "--request-rate", "nan"], "--request-rate: must be > 0"),
    (["bench", "--base-url", "http://127.0.0.1:1", "--max-concurrency", "0"], "--max-concurrency: must be >= 1"),
    (["bench", "--base-url", "http://127.0.0.1:1", "--num-prompts", "-3"], "--num-prompts: must be >= 1"),
    (["bench", "--base-url", "http://127.0.0.1:1", "--max-output-len", "0"], "--max-output-len: must be >= 1"),
    (["bench", "--base-url", "http://127.0.0.1:1", "--timeout", "-1"], "--timeout: must be > 0"),
    (["bench", "--base-url", "http://127.0.0.1:1", "--temperature", "nan"], "--temperature: must be a finite"),
    (["router", "--stages", "garbage"], "--stages: expected host:port"),
    (["router", "--stages", "127.0.0.1:70000"], "a TCP port is in [1, 65535]"),
    (["router", "--stages", "127.0.0.1:5_000"], "expected a TCP port, got '5_000'"),
    (["router", "--stages", "http://127.0.0.1:5000"], "expected host:port, got 'http://127.0.0.1:5000'"),
    (["stage", "--pp-size", "2", "--next-stage", "127.0.0.1:1,127.0.0.1:2"], "one address here, not a list"),
    (["stage", "--pp-size", "2", "--next-stage", "::1:5000"], "an IPv6 address goes in brackets"),
    (["stage", "--pp-size", "2", "--next-stage", "a b:5000"], "expected host:port, got 'a b:5000'"),
    (["stage", "--pp-rank", "5", "--pp-size", "2"], "--pp-rank 5 is not below --pp-size 2"),
    (["stage", "--device", "cuda:x"], "--device: expected cpu, cuda or cuda:N"),
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens: must be >= 1"),
    (["serve", "--speculative-config", "{nope"], "--speculative-config: not JSON"),
    (["serve", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'],
     'method must be "mtp" (or a *_mtp name) or "ngram", got \'eagle\''),
    (["serve", "--speculative-config", '{"method": "mtp", "model": "x"}'], "method and num_speculative_tokens only"),
    (["serve", "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 0}'],
     "num_speculative_tokens must be an integer >= 1"),
    (["serve", "--speculative-config", '{"method": "mtp"}', "--speculative-algorithm", "ngram"], "give one of them"),
    (["serve", "--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["serve", "--max-logprobs", "-5"], "--max-logprobs: give a count >= 0, or -1 for no cap, got -5"),
    (["router", "--stages", "127.0.0.1:1", "--max-logprobs", "many"], "--max-logprobs: expected an integer, got 'many'"),
    (["router", "--stages", "127.0.0.1:1", "--enable-auto-tool-choice"],
     "--enable-auto-tool-choice needs --tool-call-parser"),
    (["router", "--stages", "127.0.0.1:1", "--allowed-origins", "https://a.example"],
     '--allowed-origins: expected a JSON list of strings (e.g. \'["https://a.example"]\'), got \'https://a.example\''),
    (["serve", "--allowed-methods", '["GET", 3]'], "--allowed-methods: expected a JSON list of strings"),
]


@pytest.mark.parametrize("argv,msg", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_values_are_usage_errors(argv, msg):
    if argv[0] == "serve" and "--port" not in argv:
        # serve checks its port before the rest: take a free one, so that a server on the
        # default port 8000 does not decide the message
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            argv = [*argv, "--port", str(s.getsockname()[1])]
    p = subprocess.run([sys.executable, "-m", "ppspec.cli", *argv], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert msg in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_serve_exits_2_when_a_stage_refuses_its_budget():
    """A stage over its --memory-budget-gb exits 2 with one line; serve says which stage
    and exits 2 as well (a usage error, not a crash), leaving no process behind."""
    from cluster import free_port

    p = subprocess.run([sys.executable, "-m", "ppspec.cli", "serve", "--pp-size", "2", "--memory-budget-gb", "0.000001",
                        "--port", str(free_port()), "--stage-ports", f"{free_port()},{free_port()}"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "memory budget" in p.stderr and "startup failed: stage" in p.stderr and "Traceback" not in p.stderr, p.stderr


def _listener():
    """A listening loopback socket (as a server would hold it) and its port."""
    import socket

    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    return srv, srv.getsockname()[1]


def test_port_free_ignores_time_wait_sockets():
    """A server that stopped leaves TIME_WAIT sockets; serve must still see the port free."""
    import socket

    from ppspec.argtypes import port_free

    srv, port = _listener()
    assert not port_free("127.0.0.1", port)  # a listener: in use
    cli = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    conn.close()  # the server side closes first: its end goes to TIME_WAIT
    cli.close()
    srv.close()
    assert port_free("127.0.0.1", port)


def test_router_on_a_busy_port_says_so_before_anything_else():
    srv, port = _listener()
    p = subprocess.run([sys.executable, "-m", "ppspec.cli", "router", "--stages", "127.0.0.1:1", "--port", str(port)],
                       capture_output=True, text=True, timeout=120)
    srv.close()
    assert p.returncode == 2 and not p.stdout, (p.stdout, p.stderr)
    assert f"127.0.0.1:{port} is already in use" in p.stderr


def test_demo_on_a_busy_port_says_so_and_sends_nothing_there():
    """``make run`` with another server on its port: the demo exits 2 naming the port, and
    sends none of its prompts there (it took the other server's /health for its own, sent
    it its prompts, printed the answers and "serving on ..." and only then exited 2)."""
    import http.server
    import threading

    seen: list[str] = []

    class Other(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            seen.append(f"{self.command} {self.path}")
            body = b'{"status": "ok"}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        p = subprocess.run([sys.executable, "-m", "ppspec.cli", "demo", "--port", str(other.server_address[1]),
                            "--no-keep-serving"], capture_output=True, text=True, timeout=300)
    finally:
        other.shutdown()
        other.server_close()
    assert p.returncode == 2 and "Traceback" not in p.stderr, (p.stdout, p.stderr)
    assert f"127.0.0.1:{other.server_address[1]} is already in use" in p.stderr, p.stderr
    assert seen == [] and "serving on" not in p.stdout, (seen, p.stdout)


def test_stage_devices():
    from ppspec.argtypes import stage_devices

    assert stage_devices("cuda", 3) == ["cuda:0", "cuda:1", "cuda:2"]  # ppspec serve: one GPU each
    assert stage_devices("cuda", 2, spread_cuda=False) == ["cuda", "cuda"]  # LLM: the current GPU
    assert stage_devices("cuda:1", 2) == ["cuda:1", "cuda:1"]
    assert stage_devices("cuda:0, cuda:1", 2, spread_cuda=False) == ["cuda:0", "cuda:1"]
    with pytest.raises(ValueError, match="lists 3 devices for 2 stages"):
        stage_devices("cpu,cpu,cpu", 2)


def test_llm_takes_a_device_per_stage():
    import torch

    from ppspec.router.llm import LLM
    from ppspec.router.types import SamplingParams

    torch.set_num_threads(1)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    ref = [o.token_ids for o in LLM(max_rows=4).generate(prompts, p)]
    llm = LLM(pp_size=2, device="cpu,cpu", speculative_algorithm="mtp", max_rows=4)
    assert [str(r.device) for r in llm.pipeline.runners] == ["cpu", "cpu"]
    assert [o.token_ids for o in llm.generate(prompts, p)] == ref
    with pytest.raises(ValueError, match="lists 3 devices for 2 stages"):
        LLM(pp_size=2, device="cpu,cpu,cpu")


def _help_of(parser, action) -> str:
    return parser._get_formatter()._get_help_string(action) % vars(action) if action.help else ""


def test_every_serve_and_router_option_has_help_and_shows_its_default():
    from ppspec.launch.serve import build_parser as serve_parser
    from ppspec.router.server import build_parser as router_parser

    for parser in (serve_parser(), router_parser()):
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or action.dest == "help" or action.required:
                continue
            text = _help_of(parser, action)
            assert text and "default" in text, (parser.prog, action.option_strings, text)
        assert "(default: None)" not in parser.format_help(), parser.prog  # a None default says it in words


def test_vllm_option_names_are_aliases():
    from ppspec.launch.serve import build_parser as serve_parser
    from ppspec.stage_server.server import build_parser as stage_parser

    for parser in (serve_parser(), stage_parser()):
        a = parser.parse_args(["--max-model-len", "1000", "--max-num-seqs", "8"])
        assert (a.max_context, a.max_rows) == (1000, 8)
        assert parser.parse_args([]).dtype == "auto"


def test_vllm_speculation_and_tool_options():
    """vLLM's ``--speculative-config`` (an ``*_mtp`` method is the MTP head), ``-pp`` and
    ``--enable-auto-tool-choice`` (accepted beside a parser) on ``ppspec serve``."""
    from ppspec.launch.serve import parse_args

    a = parse_args(["-pp", "2", "--speculative-config", '{"method": "qwen3_next_mtp", "num_speculative_tokens": 2}',
                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    assert (a.pp_size, a.speculative_algorithm, a.speculative_num_steps, a.tool_call_parser) == (2, "mtp", 2, "hermes")
    a = parse_args(["--pipeline-parallel-size", "3", "--speculative-config", '{"method": "ngram"}'])
    assert (a.pp_size, a.speculative_algorithm, a.speculative_num_steps) == (3, "ngram", 3)


def test_router_accepts_vllms_enable_auto_tool_choice():
    """The README's table says ``--enable-auto-tool-choice --tool-call-parser`` is accepted,
    and ``ppspec router`` takes the table's API options: so the router takes it too."""
    from ppspec.router.server import parse_args

    a = parse_args(["--stages", "127.0.0.1:53001", "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder"])
    assert (a.enable_auto_tool_choice, a.tool_call_parser) == (True, "qwen3_coder")
    assert parse_args(["--stages", "127.0.0.1:53001"]).enable_auto_tool_choice is False


def test_dtype_auto_is_bf16_on_cuda_and_fp32_on_cpu():
    from ppspec.argtypes import resolve_dtype

    assert [resolve_dtype("auto", d) for d in ("cpu", "cuda", "cuda:3")] == ["float32", "bfloat16", "bfloat16"]
    assert resolve_dtype("float16", "cpu") == "float16" and resolve_dtype("float32", "cuda:0") == "float32"


def test_serve_passes_the_router_and_stage_options_through(tmp_path):
    """The command lines serve gives its children parse with the children's own parsers
    and carry serve's values."""
    from ppspec.launch.serve import build_parser as serve_parser
    from ppspec.launch.serve import router_argv, stage_argv
    from ppspec.router.server import build_parser as router_parser
    from ppspec.stage_server.server import build_parser as stage_parser

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    a = serve_parser().parse_args(["--pp-size", "2", "--chunk-size", "64", "--max-waiting", "9", "--step-timeout",
                                   "7.5", "--stall-timeout", "3", "--chat-template", str(template), "--max-model-len",
                                   "512", "--max-num-seqs", "4", "--device", "cuda"])
    r = router_parser().parse_args(router_argv(a, [5001, 5002])[1:])
    assert (r.chunk_size, r.max_waiting, r.step_timeout, r.stall_timeout) == (64, 9, 7.5, 3.0)
    assert r.chat_template == str(template) and r.stages == ["127.0.0.1:5001", "127.0.0.1:5002"]
    for k, dev in enumerate(["cuda:0", "cuda:1"]):
        s = stage_parser().parse_args(stage_argv(a, k, [5001, 5002], dev, 1)[1:])
        assert (s.pp_rank, s.device, s.dtype, s.max_context, s.max_rows) == (k, dev, "auto", 512, 4)


def test_chat_template_option(tmp_path):
    from ppspec.router.start import load_chat_template

    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(f)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}x{% endfor %}").startswith("{% for")
    with pytest.raises(ValueError, match="no such file, and not a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    from cluster import free_port

    p = subprocess.run([sys.executable, "-m", "ppspec.cli", "router", "--stages", "127.0.0.1:1", "--port",
                        str(free_port()), "--chat-template", str(tmp_path / "missing.jinja")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--chat-template" in p.stderr and "no such file" in p.stderr, p.stderr


def test_prefix_caching_is_on_by_default_where_every_stage_has_a_cache():
    """serve gives every stage a prefix cache unless --no-enable-prefix-caching; the router,
    left at its default, turns caching on when every stage has one, off otherwise, and
    refuses --enable-prefix-caching over a stage without one."""
    from types import SimpleNamespace

    from ppspec.launch.serve import build_parser as serve_parser
    from ppspec.launch.serve import router_argv, stage_argv
    from ppspec.router.engine import Engine
    from ppspec.router.server import build_parser as router_parser

    for flags, on in (([], None), (["--no-enable-prefix-caching"], False), (["--enable-prefix-caching"], True)):
        a = serve_parser().parse_args(flags)
        assert ("--prefix-cache-gb" in stage_argv(a, 0, [5001], "cpu", 1)) == (on is not False)
        assert router_parser().parse_args(router_argv(a, [5001])[1:]).enable_prefix_caching is on
    infos = [{"pp_rank": 0, "snapshot_slots": 8}, {"pp_rank": 1, "snapshot_slots": 5}]
    bare = [{"pp_rank": 0, "snapshot_slots": 8}, {"pp_rank": 1, "snapshot_slots": 0}]
    cache = Engine._prefix_cache(SimpleNamespace(enable_prefix_caching=None), infos, 16)
    assert cache.num_slots == 5
    assert Engine._prefix_cache(SimpleNamespace(enable_prefix_caching=None), bare, 16) is None
    assert Engine._prefix_cache(SimpleNamespace(enable_prefix_caching=False), infos, 16) is None
    with pytest.raises(ValueError, match="stage 1 has no prefix cache"):
        Engine._prefix_cache(SimpleNamespace(enable_prefix_caching=True), bare, 16)


def test_python_m_ppspec_is_the_ppspec_command():
    """``python -m ppspec serve ...`` (as ``python -m vllm ...`` is tried) runs the same
    command as ``ppspec serve ...``: here its usage error, exit 2, not "cannot be directly
    executed"."""
    want = subprocess.run([sys.executable, "-m", "ppspec.cli", "router", "--stages", "garbage"],
                          capture_output=True, text=True, timeout=120)
    p = subprocess.run([sys.executable, "-m", "ppspec", "router", "--stages", "garbage"],
                       capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stderr) == (want.returncode, want.stderr) and p.returncode == 2, p.stderr
    v = subprocess.run([sys.executable, "-m", "ppspec", "--version"], capture_output=True, text=True, timeout=120)
    from ppspec import __version__
    assert v.returncode == 0 and v.stdout == f"ppspec {__version__}\n", v.stderr


@pytest.mark.parametrize("flag, want", [([], True), (["--no-gc-freeze"], False)])
def test_serve_passes_gc_freeze_to_the_router_and_every_stage(flag, want):
    """``--no-gc-freeze`` (ppspec/heap.py) reaches every process serve starts: the router
    (whose engine process parses the same command line) and each stage."""
    from ppspec.launch.serve import build_parser as serve_parser
    from ppspec.launch.serve import router_argv, stage_argv
    from ppspec.router.server import build_parser as router_parser
    from ppspec.stage_server.server import build_parser as stage_parser

    a = serve_parser().parse_args(["--pp-size", "2", *flag])
    assert router_parser().parse_args(router_argv(a, [5001, 5002])[1:]).gc_freeze is want
    for k in range(2):
        assert stage_parser().parse_args(stage_argv(a, k, [5001, 5002], "cpu", 1)[1:]).gc_freeze is want


@pytest.mark.parametrize("cmd", ["stage", "serve"])
def test_a_kv_pool_too_small_to_warm_up_is_a_usage_error(cmd):
    """--kv-tokens below what the stage's warm-up takes (a micro-batch of a few short
    sequences) is one usage error naming the option, not a traceback of the pool (exit 1)."""
    from cluster import free_port

    p = subprocess.run([sys.executable, "-m", "ppspec.cli", cmd, "--kv-tokens", "10", "--port", str(free_port()),
                        *(["--stage-ports", str(free_port())] if cmd == "serve" else [])],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr
    assert "--kv-tokens 10 is too small" in p.stderr and "Traceback" not in p.stderr, p.stderr
