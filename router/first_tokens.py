"""Where a request's time to its first token goes, from the router's own timestamps.

The scheduler stamps each request (``time.monotonic()``) where it is queued
(``Request.arrival_time``), admitted into a lane (``admitted_at``), put in its first
micro-batch (``formed_at``); the engine where that micro-batch is sent (``sent_at``) and
where the result carrying its first token is back (:meth:`FirstTokens.record`), with the
micro-batches it was in until then (``Request.prefill_batches``: its prefill chunks) and the
micro-batches of every lane in flight ahead of its first (``Request.sent_behind``). One
row per request, kept for the last ``maxlen`` requests; ``GET /v1/trace/first_tokens``
serves them and ``bench.prefix_served`` prints :func:`summarize` of a workload's hitting
requests. A few stamps per request, none per token: off the per-round path.
"""
from __future__ import annotations

import collections
import statistics

# the stages of the path, each the time from the stamp before it
SEGMENTS = (
    ("queued", "queued until admitted into a lane"),
    ("admitted", "admitted until its first micro-batch formed"),
    ("formed", "formed until sent"),
    ("sent", "sent until the result with its first token back"),
)
FIELDS = ("seq", "arrival", "admitted", "formed", "sent", "back", "batches", "cached_tokens", "prompt_tokens", "lane",
          "ahead")


class FirstTokens:
    """The last ``maxlen`` requests' first-token paths (rows of :data:`FIELDS`);
    ``total``: rows ever recorded, so that a reader takes those since a mark
    (:meth:`rows`)."""

    def __init__(self, maxlen: int = 4096):
        self._rows: collections.deque = collections.deque(maxlen=maxlen)
        self.total = 0

    def record(self, r, back: float) -> None:
        """``r`` (a scheduler ``Request``) got its first token in a result back at ``back``."""
        self._rows.append((self.total, r.arrival_time, r.admitted_at, r.formed_at, r.sent_at or r.formed_at, back,
                           r.prefill_batches, r.cached_tokens, len(r.prompt_ids), r.lane, r.sent_behind))
        self.total += 1

    def rows(self, since: int = 0) -> dict:
        """``{"total", "fields", "rows"}``: the rows kept whose ``seq`` is at least ``since``."""
        return {"total": self.total, "fields": list(FIELDS), "rows": [list(x) for x in self._rows if x[0] >= since]}


def summarize(rows: list[list], fields: list[str] = FIELDS) -> dict:
    """Per segment of :data:`SEGMENTS` and in all (``ttft``, queued until the first token
    back), the mean and median in ms, over ``rows``; ``batches``: the mean and median of
    micro-batches until the first token, ``ahead`` of micro-batches in flight ahead of its
    first when sent; ``n`` the rows."""
    if not rows:
        return {"n": 0}
    ix = {f: i for i, f in enumerate(fields)}
    stamps = ("arrival", "admitted", "formed", "sent", "back")
    out: dict = {"n": len(rows)}
    for (name, _), a, b in zip(SEGMENTS, stamps, stamps[1:]):
        ms = [1e3 * (x[ix[b]] - x[ix[a]]) for x in rows]
        out[name] = (statistics.fmean(ms), statistics.median(ms))
    ms = [1e3 * (x[ix["back"]] - x[ix["arrival"]]) for x in rows]
    out["ttft"] = (statistics.fmean(ms), statistics.median(ms))
    n = [x[ix["batches"]] for x in rows]
    out["batches"] = (statistics.fmean(n), statistics.median(n))
    n = [x[ix["ahead"]] for x in rows]
    out["ahead"] = (statistics.fmean(n), statistics.median(n))
    return out


def format_summary(s: dict, label: str) -> str:
    """One line per figure of :func:`summarize`'s ``s``."""
    if not s.get("n"):
        return f"    {label}: no request"
    lines = [f"    {label}, {s['n']} requests (mean / median):"]
    for name, text in SEGMENTS:
        lines.append(f"      {text:52s} {s[name][0]:8.1f} / {s[name][1]:8.1f} ms")
    lines.append(f"      {'queued until its first token back (router)':52s} {s['ttft'][0]:8.1f} / {s['ttft'][1]:8.1f} ms")
    lines.append(f"      {'micro-batches until its first token':52s} {s['batches'][0]:8.2f} / {s['batches'][1]:8.1f}")
    lines.append(f"      {'micro-batches in flight ahead of its first, sent':52s} {s['ahead'][0]:8.2f} / {s['ahead'][1]:8.1f}")
    return "\n".join(lines)
