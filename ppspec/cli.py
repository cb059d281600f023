"""The ``ppspec`` command: one subcommand per process kind.

Each subcommand lives in the module that owns it and exposes ``main(argv) -> int``;
imports are lazy so that ``ppspec bench`` never loads torch.
"""
from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "serve": ("ppspec.launch.serve", "start N stages and the router on loopback"),
    "router": ("ppspec.router.server", "run the router (HTTP API + scheduler) in front of running stages"),
    "stage": ("ppspec.stage_server.server", "run one pipeline stage (gRPC)"),
    "demo": ("ppspec.launch.demo", "serve the demo model, send a few ShareGPT prompts, keep serving"),
    "bench": ("ppspec.bench.cli", "serving benchmark against any OpenAI-compatible server"),
    "generate": ("ppspec.router.llm", "generate in one process (no gRPC), for quick checks"),
}


def usage() -> str:
    lines = ["usage: ppspec <command> [options]   (ppspec --version: the version)", "", "commands:"]
    lines += [f"  {name:<10} {desc}" for name, (_, desc) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from ppspec import __version__

        print(f"ppspec {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"ppspec: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
