"""The documentation says what the code does: every command README.md, deploy/README.md and
docs/PERFORMANCE.md show parses with the real argument parser of its subcommand or script, every ``make``
target they name exists, every relative link in the repository's Markdown resolves
(anchors included), the README's ``ppspec serve`` options table names real options with
their real defaults, every option of every ``ppspec`` subcommand has a help text, and every
code comment citing a section of docs/DESIGN.md or
docs/PERFORMANCE.md names a section that exists.

Parsers are read in-process: the subcommand's ``main`` is called with
``argparse.ArgumentParser.parse_args`` patched to hand back the parser before anything
runs, so the check follows the parsers wherever their modules build them.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from pathlib import Path
from unittest import mock

import pytest

from ppspec.cli import SUBCOMMANDS

ROOT = Path(__file__).resolve().parent.parent
COMMAND_DOCS = ["README.md", "deploy/README.md", "docs/PERFORMANCE.md"]
SHELL_LANGS = {"", "sh", "bash", "shell", "console"}
# tools whose arguments these docs need not check beyond the paths they name
ORDINAL_SESSION = (r"\.\./shared/|(?<!docs/)DESIGN\.md (?:section|§)|\b(?:first|second|third|fourth|fifth|sixth|seventh|"
                   r"eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth) session\b")
EXTERNAL = {"curl", "git", "pip", "export", "nvidia-smi", "kubernetes-validate"}


# ---------------------------------------------------------------------------- Markdown
def markdown_files() -> list[Path]:
    skip = {".venv", ".git", "node_modules", "build"}
    return sorted(p for p in ROOT.rglob("*.md")
                  if not any(part in skip or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts))


def fenced_blocks(text: str) -> list[tuple[str, str, int]]:
    """``(language, body, first line number)`` of every fenced code block."""
    blocks, lang, body, start = [], None, [], 0
    for n, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^\s*```+\s*([\w+-]*)", line)
        if m and lang is None:
            lang, body, start = m.group(1).lower(), [], n + 1
        elif m and lang is not None:
            blocks.append((lang, "\n".join(body), start))
            lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def unfenced(text: str) -> str:
    """The text outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if re.match(r"^\s*```", line):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return "\n".join(out)


def prose(text: str) -> str:
    """The text outside fenced blocks and inline code."""
    return re.sub(r"`[^`]*`", "", unfenced(text))


def inline_code(text: str) -> list[str]:
    """Inline code spans, a span broken over lines joined with a space."""
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", unfenced(text))]


def headings(path: Path) -> list[str]:
    titles, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if re.match(r"^\s*```", line):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)):
            titles.append(m.group(1))
    return titles


def plain_title(title: str) -> str:
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link's text
    return title.replace("`", "").replace("*", "").strip()


def anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", plain_title(title).lower()).replace(" ", "-")


# ---------------------------------------------------------------------------- parsers
class _Parser(BaseException):
    """Raised from a patched ``parse_args``: carries the parser, before any parsing."""

    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def parser_of(main) -> argparse.ArgumentParser:
    """The parser ``main`` builds (its first ``parse_args`` call), without running it."""
    def grab(self, args=None, namespace=None):
        raise _Parser(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", grab):
        try:
            main([])
        except _Parser as p:
            return p.parser
    raise AssertionError(f"{main.__module__}.main returned without calling parse_args")


_PARSERS: dict[str, argparse.ArgumentParser] = {}


def module_parser(module: str) -> argparse.ArgumentParser:
    if module not in _PARSERS:
        _PARSERS[module] = parser_of(importlib.import_module(module).main)
    return _PARSERS[module]


def subcommand_parser(name: str, where: str) -> argparse.ArgumentParser:
    assert name in SUBCOMMANDS, f"{where}: `ppspec {name}` is not a ppspec subcommand ({', '.join(SUBCOMMANDS)})"
    return module_parser(SUBCOMMANDS[name][0])


def parse(parser: argparse.ArgumentParser, argv: list[str], where: str) -> None:
    parser.allow_abbrev = False  # a shown flag is spelled out in full
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            assert e.code == 0, f"{where}: `{parser.prog} {shlex.join(argv)}` does not parse: {err.getvalue().strip()}"


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return set(parser._option_string_actions)


def make_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-/$() ]+?)\s*:(?!=)", line)
        if m and not line.startswith(("\t", "#")):
            targets.update(m.group(1).split())
    return targets


# ---------------------------------------------------------------------------- commands
def commands(body: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped, split
    at ``&&``, ``;``, ``|`` and ``&``."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        cmd: list[str] = []
        for w in words + [";"]:
            if w in ("&&", ";", "|", "||", "&"):
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


def check_script(path: Path, args: list[str], where: str) -> None:
    """A Python script run by path: it exists, and its parser (read from its source when
    the script needs packages the CPU environment lacks, such as triton) has each flag."""
    assert path.is_file(), f"{where}: {path.relative_to(ROOT)} does not exist"
    source = path.read_text()
    for a in args:
        flag = a.split("=", 1)[0]
        if flag.startswith("--"):
            assert f'"{flag}"' in source, f"{where}: {path.relative_to(ROOT)} takes no {flag}"


def check_command(words: list[str], cwd: Path, where: str) -> Path:
    """Check one command; returns the directory the next command runs in."""
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value before the command
        words = words[1:]
    if not words:
        return cwd
    exe, args = words[0].removeprefix(".venv/bin/"), words[1:]
    if exe == "cd":
        target = (cwd / args[0]).resolve()
        assert target.is_dir(), f"{where}: `cd {args[0]}`: no such folder"
        return target
    if exe == "ppspec":
        assert args, f"{where}: `ppspec` without a subcommand"
        parse(subcommand_parser(args[0], where), args[1:], where)
    elif exe in ("python", "python3"):
        if args[:1] == ["-m"]:
            module, rest = args[1], args[2:]
            if module == "cProfile":  # a profiled run: check what it profiles
                rest = rest[rest.index("-o") + 2:] if "-o" in rest else rest
                return check_command(["python", *rest], cwd, where)
            if module == "pytest":
                for a in rest:
                    if a.startswith("tests/"):
                        assert (ROOT / a.split("::")[0]).exists(), f"{where}: {a} does not exist"
            elif module == "ppspec.cli":
                check_command(["ppspec", *rest], cwd, where)
            else:
                assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
                parse(module_parser(module), rest, where)
        elif args and args[0].endswith(".py"):
            check_script(cwd / args[0], args[1:], where)
        else:
            raise AssertionError(f"{where}: cannot check `{shlex.join(words)}`")
    elif exe == "make":
        targets = make_targets()
        for a in args:
            if "=" not in a and not a.startswith("-"):
                assert a in targets, f"{where}: `make {a}`: no such target in the Makefile"
    elif exe == "docker":
        if args[:1] == ["build"] and "-f" in args:
            f = args[args.index("-f") + 1]
            assert (cwd / f).is_file(), f"{where}: {f} does not exist"
        elif args[:1] == ["run"]:
            image = next((i for i, a in enumerate(args) if a.startswith("ppspec:")), None)
            assert image is not None, f"{where}: `docker run` of an image other than ppspec"
            check_command(["ppspec", *args[image + 1:]], cwd, where)
    elif exe == "docker-compose":
        files = [args[i + 1] for i, a in enumerate(args) if a == "-f"]
        for f in files or ["docker-compose.yml"]:
            assert (cwd / f).is_file(), f"{where}: {f} does not exist in {cwd.relative_to(ROOT)}"
    elif exe == "kubectl":
        if "-k" in args:
            d = args[args.index("-k") + 1]
            assert (cwd / d).is_dir(), f"{where}: {d} does not exist"
    elif exe not in EXTERNAL:
        raise AssertionError(f"{where}: no rule checks `{exe}` commands; add one to tests/test_docs.py")
    return cwd


@pytest.mark.parametrize("doc", COMMAND_DOCS)
def test_every_shown_command_parses(doc):
    path = ROOT / doc
    text = path.read_text(encoding="utf-8")
    checked = 0
    for lang, body, line in fenced_blocks(text):
        where = f"{doc}:{line}"
        if lang == "python":
            compile(body, where, "exec")
            continue
        if lang not in SHELL_LANGS:
            continue
        cwd = ROOT
        for words in commands(body):
            cwd = check_command(words, cwd, where)
            checked += 1
    # inline commands: `ppspec SUB --flag ...` names a subcommand and options it has;
    # `make TARGET` a target; `python -m ppspec.MODULE ...` parses
    for span in inline_code(text):
        words = span.split()
        where = f"{doc}: `{span}`"
        if words[0] == "ppspec" and len(words) > 1 and re.fullmatch(r"[a-z]+", words[1]):
            opts = option_strings(subcommand_parser(words[1], where))
            for w in words[2:]:
                flag = w.split("=", 1)[0]
                if flag.startswith("-"):
                    assert flag in opts, f"{where}: `ppspec {words[1]}` has no option {flag}"
            checked += 1
        elif words[0] == "make" and len(words) > 1 or words[:2] == ["docker", "run"]:
            check_command(words, ROOT, where)
            checked += 1
        elif words[0] in ("python", "python3") and words[1:2] == ["-m"] and len(words) > 2 \
                and words[2].startswith("ppspec"):
            check_command(words, ROOT, where)  # the module exists and the flags shown parse
            checked += 1
    assert checked, f"{doc} shows no command"


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_every_subcommand_option_has_help(name):
    """``ppspec NAME --help`` says what each option and argument it lists is for."""
    parser = subcommand_parser(name, f"ppspec {name}")
    bare = [a.option_strings or [a.dest] for a in parser._actions if not a.help]
    assert not bare, f"`ppspec {name} --help` explains nothing for {bare}"


def _number(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def test_serve_options_table_names_real_options_and_defaults():
    """Each row of README's `ppspec serve` options table names options `ppspec serve`
    has, and a default written as one code literal per option is the parser's."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("### `ppspec serve` options", 1)[1].split("\n#", 1)[0]
    parser = subcommand_parser("serve", "README")
    actions = parser._option_string_actions
    rows = [r for r in section.splitlines() if r.startswith("| `-")]
    assert len(rows) >= 10
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        flags = re.findall(r"`(--[\w-]+)", cells[0])
        for f in flags:
            assert f in actions, f"README serve table: `ppspec serve` has no option {f}"
        literals = re.findall(r"`([^`]*)`", cells[1])
        if len(literals) == len(flags) and not re.search(r"[()]", cells[1]):
            for f, lit in zip(flags, literals):
                default = actions[f].default
                if default is not None:
                    assert lit == str(default) or _number(lit) == default, \
                        f"README serve table: {f} defaults to {default!r}, not {lit!r}"



def test_deploy_readme_metrics_list_names_every_metric():
    """deploy/README.md's "Metrics" list names every metric RouterMetrics exports (counters
    with their `_total`), so that a reader of the list knows all /metrics can give."""
    from ppspec.router.metrics import PREFIX, metric_families

    text = (ROOT / "deploy/README.md").read_text(encoding="utf-8")
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"`([a-z0-9_]+)[`{]", section))
    families = metric_families()
    assert len(families) >= 20
    missing = sorted(name[len(PREFIX):] + ("_total" if kind == "counter" else "") for name, kind in families.items()
                     if name[len(PREFIX):] + ("_total" if kind == "counter" else "") not in listed)
    assert not missing, f"deploy/README.md, Metrics: not listed: {missing}"


def test_every_relative_link_resolves():
    bad = []
    for md in markdown_files():
        text = prose(md.read_text(encoding="utf-8"))
        for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file, _, frag = target.partition("#")
            dest = (md.parent / file).resolve() if file else md
            if not dest.exists():
                bad.append(f"{md.relative_to(ROOT)}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in {anchor(h) for h in headings(dest)}:
                bad.append(f"{md.relative_to(ROOT)}: {target} (no heading with that anchor)")
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_code_cites_sections_that_exist():
    """Comments cite documents by section title: (docs/DESIGN.md, "Commit rule"); nothing cites
    the design reference that lived outside the repository or a diary entry."""
    titles = {doc: {plain_title(h) for h in headings(ROOT / "docs" / doc)} for doc in ("DESIGN.md", "PERFORMANCE.md")}
    bad = []
    skip = {".venv", ".git", "build"}
    files = [p for pattern in ("*.py", "*.md", "*.proto", "*.yml", "*.yaml", "Makefile", "Dockerfile")
             for p in ROOT.rglob(pattern)]
    for py in files:
        rel = py.relative_to(ROOT)
        if any(part in skip or part.endswith(".egg-info") for part in rel.parts):
            continue
        text = py.read_text(encoding="utf-8")
        for doc, cited in re.findall(r"docs/(DESIGN\.md|PERFORMANCE\.md),\s*((?:\"[^\"]+\"(?:\s*(?:,|and)\s*)?)+)", text):
            for title in re.findall(r"\"([^\"]+)\"", cited):
                title = re.sub(r"\s*\n\s*(?:#\s*)?", " ", title)  # a title wrapped onto a comment's next line
                if title not in titles[doc]:
                    bad.append(f"{rel}: docs/{doc}, \"{title}\"")
        # the design reference that lived outside the repository, and diary entries
        for m in re.finditer(ORDINAL_SESSION, text):
            bad.append(f"{rel}: cites {m.group(0)!r}")
    assert not bad, "citations of missing sections:\n" + "\n".join(sorted(bad))
