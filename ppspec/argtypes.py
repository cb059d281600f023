"""argparse value types shared by the ``ppspec`` subcommands: a bad value is one clear
usage error (exit code 2), never a traceback from deep inside a server. Also the defaults
and checks every server's command line shares (the demo checkpoint, a free port)."""
from __future__ import annotations

import argparse
import errno
import json
import os
import re
import socket

# the bundled demo checkpoint: the default of every --model
DEMO_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "qwen35-demo")


def _int_at_least(lo: int, what: str):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    parse.__name__ = what.replace(" ", "_")  # argparse names the type in its messages
    return parse


positive_int = _int_at_least(1, "a positive integer")
nonneg_int = _int_at_least(0, "an integer >= 0")


def positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {s!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
    return v


def positive_finite_float(s: str) -> float:
    """A number > 0 and finite (inf or 1e400 would overflow where it becomes bytes or ints)."""
    v = positive_float(s)
    if v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s}")
    return v


def json_str_list(s: str) -> list[str]:
    """vLLM's form of a list option (``--allowed-origins '["https://a.example"]'``): a JSON
    list of strings."""
    try:
        v = json.loads(s)
    except ValueError:
        v = None
    if not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings (e.g. '[\"https://a.example\"]'), got {s!r}")
    return v


def port(s: str) -> int:
    s = s.strip()
    if not (s.isascii() and s.isdigit()):  # int() would take "5_000", "+80", " 80", "٨٠"
        raise argparse.ArgumentTypeError(f"expected a TCP port, got {s!r}")
    v = int(s)
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is in [1, 65535], got {v}")
    return v


def port_list(s: str) -> list[int]:
    """``"9000,9001"`` -> ``[9000, 9001]``."""
    parts = [p.strip() for p in s.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError("expected comma-separated ports")
    return [port(p) for p in parts]


_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)$")  # a name, an IPv4 or a bracketed IPv6


def address(s: str) -> str:
    """``"host:port"`` as gRPC dials it: a host name or IPv4 address, or an IPv6 address in
    brackets (``[::1]:50051``), and a port in range; no scheme, path or list."""
    a = s.strip()
    host, sep, p = a.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"expected host:port, got {s!r}")
    if not _HOST.match(host):
        why = ""
        if "," in a:
            why = " (one address here, not a list)"
        elif ":" in host and "/" not in host:
            why = " (an IPv6 address goes in brackets: [::1]:50051)"
        raise argparse.ArgumentTypeError(f"expected host:port, got {s!r}{why}")
    port(p)
    return a


def address_list(s: str) -> list[str]:
    """``"host:port,host:port"``, each port in range."""
    out = [address(a) for a in s.split(",") if a.strip()]
    if not out:
        raise argparse.ArgumentTypeError("expected comma-separated host:port addresses")
    return out


_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def device(s: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``."""
    if not _DEVICE.match(s):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {s!r}")
    return s


def device_list(s: str) -> str:
    """One device, or a comma-separated device per stage (returned as given)."""
    for d in s.split(","):
        device(d.strip())
    return s


def stage_devices(device: str, n: int, spread_cuda: bool = True) -> list[str]:
    """The device of each of ``n`` stages: a comma-separated list gives one per stage; a
    bare ``cuda`` puts stage k on ``cuda:k`` with ``spread_cuda`` (``ppspec serve``), else
    every stage on the current CUDA device; any other single device is shared.

    Raises:
        ValueError: a list of another length than ``n``.
    """
    if "," in device:
        devs = [d.strip() for d in device.split(",")]
        if len(devs) != n:
            raise ValueError(f"--device lists {len(devs)} devices for {n} stages")
        return devs
    if device == "cuda" and spread_cuda:
        return [f"cuda:{k}" for k in range(n)]
    return [device] * n


DATA_PLANES = ("auto", "shm", "cuda_ipc", "dist", "bytes")


def add_data_plane_arg(ap) -> None:
    """``--data-plane`` of ``ppspec stage`` and ``ppspec serve`` (stage_server/dataplane.py)."""
    ap.add_argument("--data-plane", default="auto", choices=DATA_PLANES,
                    help="how hidden states go to the next stage: auto (shm between CPU stages, cuda_ipc between "
                         "CUDA stages, of one host; dist to a stage on another host), shm, cuda_ipc, dist "
                         "(torch.distributed point-to-point: gloo on CPU, NCCL on CUDA), or bytes (inline in the "
                         "gRPC message); a hop "
                         "the next stage cannot take that way falls back to bytes (Info, the log and the router's "
                         "/health say so)")


CONTROL_CHANNELS = ("auto", "grpc")


def add_control_channel_arg(ap) -> None:
    """``--control-channel`` of ``ppspec stage`` and ``ppspec serve`` (proto/local.py)."""
    ap.add_argument("--control-channel", default="auto", choices=CONTROL_CHANNELS,
                    help="how steps' control messages reach this stage from a caller on its host (the router, the "
                         "previous stage): auto (a Unix-domain socket, gRPC where it cannot be opened) or grpc "
                         "(the gRPC Steps stream only); other calls always go on gRPC")


INLINE_STEPS = ("auto", "on", "off")


def add_inline_steps_arg(ap) -> None:
    """``--inline-steps`` of ``ppspec stage`` and ``ppspec serve`` (stage_server/compute.py)."""
    ap.add_argument("--inline-steps", default="auto", choices=INLINE_STEPS,
                    help="run a decode or verify step on the stage's event loop, without the two thread "
                         "hand-offs of its compute thread, when no other job is queued: auto (on CUDA stages), "
                         "on, off")


def add_gc_freeze_arg(ap) -> argparse.Action:
    """``--gc-freeze`` of ``ppspec stage``, ``ppspec router`` and ``ppspec serve`` (ppspec/heap.py)."""
    return ap.add_argument(
        "--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
        help="freeze the process's startup heap out of the garbage collector's passes before serving (as vLLM "
             "and SGLang): no full-collection stalls over it (docs/PERFORMANCE.md, \"The collector's passes\")")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """``--help`` shows every option's default: ``(default: X)`` is appended to a help text
    that does not already say its default (an option whose default is None says it in
    words: "default: the checkpoint's"); a flag's default is "off"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings or action.required:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


DTYPES = ("auto", "float32", "bfloat16", "float16")
"""``--dtype`` choices; ``auto`` is :func:`resolve_dtype`'s pick for the device."""


def resolve_dtype(dtype: str, device: str) -> str:
    """The dtype a stage on ``device`` runs in: ``auto`` is bfloat16 on CUDA (as vLLM's
    ``auto`` for bf16 checkpoints) and float32 on the CPU (bf16 matmuls are slow there)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.startswith("cuda") else "float32"


def add_cuda_graph_args(ap: argparse.ArgumentParser) -> None:
    """``--cuda-graph-max-bs N`` and ``--disable-cuda-graph`` (SGLang's names), read back
    by :func:`cuda_graph_max_bs`."""
    ap.add_argument("--cuda-graph-max-bs", type=nonneg_int, default=None,
                    help="decode/verify batches and commits of up to N requests replay CUDA graphs, "
                         "as do short prefill chunks (default: min(max rows, 256) on CUDA; 0: all off)")
    ap.add_argument("--disable-cuda-graph", action="store_true", help="run every step eagerly")


def cuda_graph_max_bs(args: argparse.Namespace) -> int | None:
    """The ``StageRunner(cuda_graph_max_bs=)`` the options of :func:`add_cuda_graph_args` ask for."""
    return 0 if args.disable_cuda_graph else args.cuda_graph_max_bs


def cuda_graph_argv(args: argparse.Namespace) -> list[str]:
    """The same options, for a child process's command line."""
    n = cuda_graph_max_bs(args)
    return [] if n is None else ["--cuda-graph-max-bs", str(n)]


def free_ports(host: str, n: int) -> list[int]:
    """``n`` distinct ports free on ``host`` now: all bound at once, so that the kernel cannot
    hand one out twice (ports asked for one after another, each closed before the next,
    may repeat, and two stages would then share one)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now. SO_REUSEADDR as the servers set it:
    sockets of a stopped server left in TIME_WAIT do not count as in use.

    Raises:
        ValueError: ``host`` does not resolve, or is no address of this machine.
    """
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except socket.gaierror as e:
            raise ValueError(f"--host {host}: cannot resolve it ({e.strerror})") from None
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                raise ValueError(f"--host {host} is not an address of this machine") from None
            return False
    return True


def listen_error(host: str, port: int) -> str | None:
    """Why a server could not listen on ``host:port`` now (one line), or None."""
    try:
        if port_free(host, port):
            return None
    except ValueError as e:
        return str(e)
    return f"{host}:{port} is already in use (another server?); pick another --port"
