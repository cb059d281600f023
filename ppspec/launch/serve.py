"""``ppspec serve``: start N stage processes and the router on loopback, and supervise them.

Waits until the router's ``/health`` answers 200 (every stage serving), prints the URL,
and on Ctrl-C or SIGTERM stops every child. When a child dies unexpectedly it stops the
others and exits non-zero, so that a supervisor restarts the whole set.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from ppspec.argtypes import (
    DEMO_MODEL, DTYPES, DefaultsHelpFormatter, add_control_channel_arg, add_cuda_graph_args, add_data_plane_arg,
    add_inline_steps_arg, cuda_graph_argv, device_list, free_ports, listen_error, nonneg_int, port, port_list,
    positive_finite_float, positive_float, positive_int, stage_devices,
)
from ppspec.auth import KeyFileError, read_key_file, write_temp_key
from ppspec.lifetime import die_with
from ppspec.stage_server.config import PAGE_SIZE, CheckpointError, load_config

from ppspec.router.scheduler import check_token_budget
from ppspec.router.server import add_auto_tool_choice_arg, add_router_args, check_auto_tool_choice, router_options
from ppspec.router.start import load_chat_template


def speculative_config(text: str) -> dict:
    """vLLM's ``--speculative-config`` JSON as ``{"speculative_algorithm", "speculative_num_steps"}``."""
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise argparse.ArgumentTypeError('expected a JSON object such as {"method": "mtp", "num_speculative_tokens": 3}')
    other = sorted(set(cfg) - {"method", "num_speculative_tokens"})
    if other:
        raise argparse.ArgumentTypeError(f"ppspec reads method and num_speculative_tokens only, got {', '.join(other)} "
                                         f"(a draft model is not supported: drafts come from the checkpoint's MTP "
                                         f"head or the prompt)")
    method, k = cfg.get("method"), cfg.get("num_speculative_tokens", 3)
    if not isinstance(method, str) or not (method == "ngram" or method == "mtp" or method.endswith("_mtp")):
        raise argparse.ArgumentTypeError(f'method must be "mtp" (or a *_mtp name) or "ngram", got {method!r}')
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise argparse.ArgumentTypeError(f"num_speculative_tokens must be an integer >= 1, got {k!r}")
    return {"speculative_algorithm": "ngram" if method == "ngram" else "mtp", "speculative_num_steps": k}


def build_parser() -> argparse.ArgumentParser:
    """Every option has help text; ``--help`` shows each default (vLLM's names are aliases)."""
    ap = argparse.ArgumentParser(prog="ppspec serve", description="start N pipeline stages and the router",
                                 formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--model", default=DEMO_MODEL, help="checkpoint folder (default: the bundled demo model)")
    ap.add_argument("--pp-size", "--pipeline-parallel-size", "-pp", type=positive_int, default=1,
                    help="pipeline stages (one process each)")
    ap.add_argument("--speculative-algorithm", default="none", choices=["none", "ngram", "mtp"],
                    help="drafts: none, ngram (prompt lookup) or mtp (the checkpoint's MTP head)")
    ap.add_argument("--speculative-num-steps", type=positive_int, default=3,
                    help="drafts per round (a verify checks K + 1 tokens)")
    ap.add_argument("--speculative-config", type=speculative_config, default=None,
                    help='vLLM\'s form of the two above, JSON: {"method": "mtp" (or a *_mtp name such as '
                         '"qwen3_next_mtp") or "ngram", "num_speculative_tokens": K} (default: the two above)')
    ap.add_argument("--host", default="127.0.0.1", help="address of the HTTP API (and of the stages)")
    ap.add_argument("--port", type=port, default=8000, help="port of the HTTP API")
    ap.add_argument("--stage-ports", type=port_list, default=None, help="comma-separated stage ports (default: free ports)")
    ap.add_argument("--max-rows", "--max-num-seqs", type=positive_int, default=64,
                    help="concurrent requests (rows of every pool)")
    ap.add_argument("--kv-tokens", type=positive_int, default=65536, help="KV cache of each stage, in tokens")
    ap.add_argument("--max-context", "--max-model-len", type=positive_int, default=None,
                    help="longest prompt + completion in tokens (default: the checkpoint's)")
    ap.add_argument("--prefix-cache-gb", type=positive_finite_float, default=4.0,
                    help="GiB per stage for prefix-cache snapshots of the recurrent state (unless "
                         "--no-enable-prefix-caching; their KV pages come from --kv-tokens)")
    ap.add_argument("--dtype", default="auto", choices=DTYPES,
                    help="weights and activations; auto: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--device", type=device_list, default="cpu",
                    help="cpu, cuda (stage k on cuda:k), or a comma-separated device per stage")
    ap.add_argument("--memory-budget-gb", type=positive_finite_float, default=None,
                    help="GiB per stage (weights, pools and CUDA graphs; default: no limit)")
    ap.add_argument("--commit-design", default=None, choices=["copy", "replay"],
                    help="GDN verify commit of every stage (default: replay on CUDA, copy on CPU)")
    add_data_plane_arg(ap)
    add_control_channel_arg(ap)
    add_inline_steps_arg(ap)
    add_cuda_graph_args(ap)
    add_router_args(ap)
    add_auto_tool_choice_arg(ap)
    ap.add_argument("--num-threads", type=nonneg_int, default=0, help="torch threads per stage (0: cores / stages)")
    ap.add_argument("--startup-timeout", type=positive_float, default=300.0,
                    help="seconds to wait for every stage and the router")
    ap.add_argument("--pipeline-key-file", default=None,
                    help="file holding the secret the router and stages share (default: a fresh key per run, in a "
                         "0600 temporary file removed at exit)")
    ap.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)
    return ap


class Children:
    def __init__(self):
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str]) -> None:
        # own session: a Ctrl-C in the terminal reaches serve alone, which stops the
        # router before the stages (stop())
        self.procs.append((name, subprocess.Popen(argv, start_new_session=True, preexec_fn=die_with(os.getpid()))))

    def dead(self) -> tuple[str, int] | None:
        for name, p in self.procs:
            if p.poll() is not None:
                return name, p.returncode
        return None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM in reverse start order, the router before the stages, so that it ends
        in-flight requests itself while the stages still answer; SIGKILL after ``timeout``."""
        deadline = time.monotonic() + timeout
        for group in (self.procs[-1:], self.procs[:-1]):
            for _, p in group:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for _, p in group:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def stage_argv(a: argparse.Namespace, k: int, ports: list[int], device: str, threads: int) -> list[str]:
    """``ppspec stage`` arguments of stage ``k`` of ``ppspec serve``'s options ``a``."""
    n = a.pp_size
    argv = [
        "stage", "--model", a.model, "--pp-rank", str(k), "--pp-size", str(n), "--host", a.host,
        "--port", str(ports[k]), "--max-rows", str(a.max_rows), "--kv-tokens", str(a.kv_tokens),
        "--speculative-algorithm", a.speculative_algorithm,
        "--speculative-num-steps", str(a.speculative_num_steps), "--dtype", a.dtype,
        "--device", device, "--num-threads", str(threads), "--data-plane", a.data_plane,
        "--control-channel", a.control_channel, "--inline-steps", a.inline_steps,
        "--gc-freeze" if a.gc_freeze else "--no-gc-freeze",
    ]
    if k + 1 < n:
        argv += ["--next-stage", f"{a.host}:{ports[k + 1]}"]
    if a.max_context:
        argv += ["--max-context", str(a.max_context)]
    if a.memory_budget_gb:
        argv += ["--memory-budget-gb", str(a.memory_budget_gb)]
    if a.commit_design:
        argv += ["--commit-design", a.commit_design]
    if a.enable_prefix_caching is not False:  # on by default: the router turns it on when every stage has one
        argv += ["--prefix-cache-gb", str(a.prefix_cache_gb)]
    argv += cuda_graph_argv(a)
    if a.inject_fault:
        argv += ["--inject-fault", a.inject_fault]
    return argv


def router_argv(a: argparse.Namespace, ports: list[int]) -> list[str]:
    """``ppspec router`` arguments of ``ppspec serve``'s options ``a`` (stages at ``ports``)."""
    return [
        "router", "--model", a.model, "--stages", ",".join(f"{a.host}:{p}" for p in ports),
        "--host", a.host, "--port", str(a.port), "--speculative-algorithm", a.speculative_algorithm,
        "--connect-timeout", str(a.startup_timeout), "--log-level", "warning", *router_options(a),
    ]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def stage_warmup_seconds(addresses: list[str]) -> list[float]:
    """Each stage's warm-up time (seconds, from its Info; ``stage_server.warmup``); NaN for
    a stage that does not answer."""
    import grpc

    from ppspec.proto.stubs import pb, pb_grpc

    out = []
    for addr in addresses:
        with grpc.insecure_channel(addr) as ch:
            try:
                out.append(pb_grpc.StageStub(ch).Info(pb.InfoRequest(), timeout=5.0).warmup_seconds)
            except grpc.RpcError:
                out.append(float("nan"))
    return out


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    """Poll ``url``/health until 200. False when ``proc`` exits or ``timeout`` (s) passes."""
    deadline = time.monotonic() + timeout
    while not healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``ppspec serve``'s options, vLLM's spellings resolved; a conflict exits 2 (argparse's usage error)."""
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.speculative_config:
        if a.speculative_algorithm not in ("none", a.speculative_config["speculative_algorithm"]):
            ap.error(f"--speculative-config says {a.speculative_config['speculative_algorithm']}, "
                     f"--speculative-algorithm {a.speculative_algorithm}: give one of them")
        vars(a).update(a.speculative_config)
    check_auto_tool_choice(ap, a)
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    n = a.pp_size
    if a.stage_ports and len(a.stage_ports) != n:
        print(f"ppspec serve: --stage-ports lists {len(a.stage_ports)} ports for {n} stages", file=sys.stderr)
        return 2
    for p in [a.port] + (a.stage_ports or []):
        err = listen_error(a.host, p)
        if err:
            print(f"ppspec serve: {err}", file=sys.stderr)
            return 2
    try:
        devices = stage_devices(a.device, n)
    except ValueError as e:
        print(f"ppspec serve: {e}", file=sys.stderr)
        return 2
    if a.chat_template:
        try:
            load_chat_template(a.chat_template)
        except ValueError as e:
            print(f"ppspec serve: {e}", file=sys.stderr)
            return 2
    if not os.path.isfile(os.path.join(a.model, "config.json")):
        print(f"ppspec serve: {a.model}: no config.json (is this a checkpoint folder?)", file=sys.stderr)
        return 2
    try:
        cfg = load_config(a.model)
    except CheckpointError as e:
        print(f"ppspec serve: {e}", file=sys.stderr)
        return 2
    # checked before any stage starts (each would refuse at start, one by one)
    if a.max_num_batched_tokens:
        try:
            check_token_budget(a.max_num_batched_tokens, a.max_batch_size,
                               a.speculative_num_steps + 1 if a.speculative_algorithm != "none" else 1, PAGE_SIZE)
        except ValueError as e:
            print(f"ppspec serve: {e}", file=sys.stderr)
            return 2
    if n > cfg.num_hidden_layers:
        print(f"ppspec serve: --pp-size {n} is more than the checkpoint's {cfg.num_hidden_layers} layers", file=sys.stderr)
        return 2
    if a.max_context and a.max_context > cfg.max_context:
        print(f"ppspec serve: --max-context {a.max_context} is more than the checkpoint's {cfg.max_context} tokens "
              f"(max_position_embeddings {cfg.max_position_embeddings}, with its RoPE scaling)", file=sys.stderr)
        return 2
    if a.pipeline_key_file:  # checked here once, not by each child
        try:
            read_key_file(a.pipeline_key_file)
        except KeyFileError as e:
            print(f"ppspec serve: {e}", file=sys.stderr)
            return 2
    key_file = a.pipeline_key_file or write_temp_key()
    ports = a.stage_ports or free_ports(a.host, n)
    threads = a.num_threads or max(1, (os.cpu_count() or 1) // n)
    py = [sys.executable, "-m", "ppspec.cli"]
    kids = Children()
    stop = {"sig": None}

    def on_signal(sig, _frame):
        stop["sig"] = sig

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    hup = getattr(signal, "SIGHUP", None)  # its terminal closed; not under nohup, which ignores it
    if hup is not None and signal.getsignal(hup) is not signal.SIG_IGN:
        signal.signal(hup, on_signal)
    try:
        for k in range(n):
            key = ["--pipeline-key-file", key_file]
            kids.start(f"stage {k}", py + stage_argv(a, k, ports, devices[k], threads) + key)
        router = py + router_argv(a, ports) + ["--pipeline-key-file", key_file]
        kids.start("router", router)
        url = f"http://{a.host}:{a.port}"
        deadline = time.monotonic() + a.startup_timeout
        while not healthy(url):
            dead = kids.dead()
            if dead or stop["sig"] or time.monotonic() > deadline:
                why = f"{dead[0]} exited with code {dead[1]}" if dead else (
                    "interrupted" if stop["sig"] else f"not healthy after {a.startup_timeout:.0f}s")
                print(f"ppspec serve: startup failed: {why}", file=sys.stderr)
                if dead and dead[1] == 2:
                    return 2  # a child refused its settings (a usage error, its line above): so does serve
                return 0 if stop["sig"] and not dead else 1
            time.sleep(0.25)
        warm = stage_warmup_seconds([f"{a.host}:{p}" for p in ports])
        print(f"ppspec serve: PP{n}, speculative {a.speculative_algorithm}, warm-up {max(warm):.1f} s (per stage: "
              f"{', '.join(f'{s:.1f}' for s in warm)}), ready at {url}/v1", flush=True)
        while stop["sig"] is None:
            dead = kids.dead()
            if dead:
                print(f"ppspec serve: {dead[0]} exited unexpectedly with code {dead[1]}; stopping", file=sys.stderr)
                time.sleep(3.0)  # let the router answer in-flight requests with 503
                return 1
            time.sleep(0.25)
        print("ppspec serve: stopping", flush=True)
        return 0
    finally:
        kids.stop()
        if key_file != a.pipeline_key_file:
            os.unlink(key_file)
