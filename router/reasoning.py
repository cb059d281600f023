"""Reasoning in generated text (the chat API's ``reasoning_content``), as vLLM's ``--reasoning-parser``.

``qwen3``: Qwen3 / Qwen3-Next / Qwen3.5 models think between ``<think>`` and ``</think>``
before they answer. The thinking goes to ``reasoning_content``, the rest to ``content``.
The opening tag may be in the prompt instead of the output (templates that open the
thinking block for the model, e.g. Qwen3-Thinking's): the parser is told so
(``in_reasoning``), read from the rendered prompt's tail. With ``enable_thinking: false``
(``chat_template_kwargs``) the template closes an empty block in the prompt and the parser
is not used: everything is content.

Newlines around the thinking and before the answer (``<think>\\n...\\n</think>\\n\\n``) are
the format's, not text: reasoning is stripped of them, content of its leading ones.
:class:`ReasoningStream` splits a streamed text the same way, holding back only a tail that
could still be ``</think>`` or such newlines.
"""
from __future__ import annotations

REASONING_PARSERS = ("qwen3",)

START, END = "<think>", "</think>"


def check_reasoning_parser(name: str | None) -> None:
    """Raises ValueError for a parser this module does not have (None: no reasoning split)."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; available: {', '.join(REASONING_PARSERS)}")


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether a prompt ending in ``prompt_tail`` leaves a ``<think>`` block open."""
    return prompt_tail.rfind(START) > prompt_tail.rfind(END)


def split_reasoning(text: str, in_reasoning: bool = False) -> tuple[str | None, str | None]:
    """``(reasoning, content)`` of a whole generated text; either is None when empty.

    Reasoning is the text before ``</think>`` when the output starts inside a thinking
    block: one the prompt opened (``in_reasoning``) or its own first ``<think>``; without
    ``</think>`` such an output is all reasoning (cut off while thinking). Any other text is
    all content."""
    stripped = text.lstrip()
    if stripped.startswith(START):
        in_reasoning, text = True, stripped[len(START):]
    if not in_reasoning:
        return None, text or None
    end = text.find(END)
    if end < 0:
        return text.strip("\n") or None, None
    reasoning, content = text[:end].strip("\n"), text[end + len(END):].lstrip("\n")
    return reasoning or None, content or None


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


class ReasoningStream:
    """One streamed choice: :meth:`feed` each text delta, send the ``(reasoning, content)``
    it returns; :meth:`finish` returns what was held back. The concatenations equal
    :func:`split_reasoning` of the whole text."""

    def __init__(self, in_reasoning: bool = False):
        self.state = "start"  # start: could still open a block; reasoning; content
        self.in_reasoning = in_reasoning
        self.held = ""
        self.sent_reasoning = False  # a reasoning delta went out (later newlines are text)
        self.sent_content = False
        self.after_think = False  # content follows </think>: its leading newlines are the format's

    def feed(self, delta: str) -> tuple[str, str]:
        self.held += delta
        reasoning, content = "", ""
        if self.state == "start":
            stripped = self.held.lstrip()
            if stripped.startswith(START):
                self.held, self.state = stripped[len(START):], "reasoning"
            elif START.startswith(stripped):
                return "", ""  # whitespace, or a prefix of <think>: could still open a block
            else:
                self.state = "reasoning" if self.in_reasoning else "content"
        if self.state == "reasoning":
            end = self.held.find(END)
            if end < 0:
                keep = _partial_suffix(self.held, END)
                body = self.held[:len(self.held) - keep]
                out = body.rstrip("\n")  # trailing newlines may be the format's, before </think>
                self.held = body[len(out):] + self.held[len(body):]
                reasoning = self._reasoning(out)
                return reasoning, ""
            reasoning = self._reasoning(self.held[:end].rstrip("\n"))
            self.held, self.state, self.after_think = self.held[end + len(END):], "content", True
        if self.state == "content":
            content = self._content(self.held)
            self.held = ""
        return reasoning, content

    def _reasoning(self, text: str) -> str:
        if not self.sent_reasoning:
            text = text.lstrip("\n")
        self.sent_reasoning = self.sent_reasoning or bool(text)
        return text

    def _content(self, text: str) -> str:
        if self.after_think and not self.sent_content:
            text = text.lstrip("\n")
        self.sent_content = self.sent_content or bool(text)
        return text

    def finish(self) -> tuple[str, str]:
        """What is still held: reasoning cut off before ``</think>``, or text that could have
        opened a block."""
        held, self.held = self.held, ""
        if self.state == "start":
            reasoning, content = split_reasoning(held, self.in_reasoning)  # nothing was sent yet
            return reasoning or "", content or ""
        if self.state == "reasoning":
            return self._reasoning(held.rstrip("\n")), ""
        return "", self._content(held)
