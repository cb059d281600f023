"""Prometheus metrics of a ppspec deployment, exported by the router's ``/metrics``.

Every metric lives in the router process. Stages measure their own compute time and pool
usage and send those numbers back in their RPC responses; the router records them here with
a ``stage`` label. So Prometheus scrapes one target (the router), and the stages only serve
the standard gRPC health service.

Names follow vLLM's and SGLang's conventions with the ``ppspec:`` prefix, so that existing
dashboards and habits carry over:

requests (as vLLM)
    ``ppspec:num_requests_running`` / ``ppspec:num_requests_waiting`` (gauges),
    ``ppspec:request_success_total{finished_reason}``, ``ppspec:prompt_tokens_total``,
    ``ppspec:generation_tokens_total`` (counters), and the histograms
    ``ppspec:request_queue_time_seconds``, ``ppspec:time_to_first_token_seconds``,
    ``ppspec:inter_token_latency_seconds``,
    ``ppspec:request_time_per_output_token_seconds`` (vLLM's current name for the
    per-request TPOT; its older ``time_per_output_token_seconds`` is deprecated there) and
    ``ppspec:e2e_request_latency_seconds``.
speculation (counters as vLLM, so rates give the ratios; histogram in SGLang's spirit)
    ``ppspec:spec_decode_num_drafts_total``, ``ppspec:spec_decode_num_draft_tokens_total``,
    ``ppspec:spec_decode_num_accepted_tokens_total``,
    ``ppspec:spec_decode_num_accepted_tokens_per_pos_total{position}`` and the histogram
    ``ppspec:spec_decode_accept_length``.
    acceptance rate   = rate(accepted_tokens) / rate(draft_tokens)
    mean accept length = 1 + rate(accepted_tokens) / rate(drafts)
                       = rate(accept_length_sum) / rate(accept_length_count)
pipeline (ours)
    ``ppspec:stage_forward_latency_seconds{stage,mode}`` (mode ``forward`` or ``verify``),
    ``ppspec:stage_commit_latency_seconds{stage}``, ``ppspec:micro_batches_in_flight``,
    ``ppspec:stage_busy_fraction{stage}``, ``ppspec:stage_pool_usage{stage,pool}`` (pool
    ``rows``, ``kv`` or ``state``; a fraction in [0, 1], like vLLM's kv_cache_usage_perc),
    ``ppspec:iteration_tokens`` (a histogram of tokens per micro-batch, vLLM's
    iteration_tokens_total) and ``ppspec:stage_forwards{stage,how}`` (layer forwards since
    the stage started, ``how`` ``graph`` or ``eager``: eager ones cost the host far more).
prefix cache (counters as vLLM's, in tokens)
    ``ppspec:prefix_cache_queries_total`` (prompt tokens looked up at admission),
    ``ppspec:prefix_cache_hits_total`` (of them, found cached: hit rate = the ratio of their
    rates) and ``ppspec:prefix_cache_usage`` (fraction of snapshot slots in use).

Units: every time is in seconds; ``now`` arguments are readings of one monotonic clock
(``time.monotonic()`` when omitted); fractions are in [0, 1].
"""
from __future__ import annotations

import bisect
import collections
import itertools
import math
import threading
import time
from dataclasses import dataclass
from typing import Hashable, Sequence

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

PREFIX = "ppspec:"

FINISH_REASONS = ("stop", "length", "abort")
STAGE_MODES = ("forward", "verify")  # label values of stage_forward_latency_seconds
RPC_KINDS = STAGE_MODES + ("commit",)  # what on_stage_rpc accepts
POOLS = ("rows", "kv", "state")

# Bucket bounds, in seconds unless named otherwise.
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0,
                1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
               0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 3600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015,
                 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
DEFAULT_MAX_ACCEPT_LENGTH = 16  # accept-length buckets are the integers 1..this


@dataclass
class _RequestClock:
    arrived: float
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    output_tokens: int = 0


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else float(now)


def _fraction(value: float, what: str) -> float:
    value = float(value)
    if not (0.0 <= value <= 1.0):  # also rejects NaN
        raise ValueError(f"{what} must be a fraction in [0, 1], got {value!r}")
    return value


class CountedHistogram(Collector):
    """A Prometheus histogram whose ``observe(value, count)`` records ``count`` samples of
    ``value`` at once: one bucket search and one lock, where prometheus_client's
    ``Histogram`` takes a call, a lock and a bucket scan per sample. The engine records
    inter-token latency ``n`` samples at a time, and every accept length of a verify round
    (~90 samples a micro-batch at 64 requests with MTP: ~90 us of the engine process's
    CPU a round, against ~5 here). Exposed exactly as a ``Histogram`` of the same name and
    buckets (``_bucket{le}``, ``_count``, ``_sum``; no ``_created``)."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry):
        self.name, self.documentation = name, documentation
        self.bounds = sorted(float(b) for b in buckets)
        if self.bounds[-1] != math.inf:
            self.bounds.append(math.inf)
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self.sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        """``count`` (>= 0) samples of ``value``."""
        i = bisect.bisect_left(self.bounds, value)  # the first bound >= value, as Histogram's le
        with self._lock:
            self.counts[i] += count
            self.sum += value * count

    def describe(self):  # the names, so a registry refuses a second of them as for a Histogram
        yield HistogramMetricFamily(self.name, self.documentation)

    def collect(self):
        with self._lock:
            counts, total = list(self.counts), self.sum
        fam = HistogramMetricFamily(self.name, self.documentation, sum_value=total, buckets=[
            (floatToGoString(b), c) for b, c in zip(self.bounds, itertools.accumulate(counts))])
        yield fam


class RouterMetrics:
    """The router's Prometheus metrics, fed by events from the scheduler and the stage client.

    ``registry``: where the metrics are registered; ``None`` means prometheus_client's
    default registry (what a bare ``generate_latest()`` exports). Tests pass a private
    ``CollectorRegistry()``. One ``RouterMetrics`` per registry: a second on the same
    registry raises prometheus_client's duplicate-name ``ValueError``.

    ``num_stages`` and ``num_spec_tokens`` (draft tokens per verify round) only pre-create
    the labelled children (``stage="0".."N-1"``, ``position="0".."K-1"``) at zero, so that
    ``rate()`` has a starting point before the first event; metrics for other stages or
    positions are still created on first use. ``max_accept_length`` sets the accept-length
    histogram's buckets to the integers 1..max (default ``num_spec_tokens + 1``, or 16).

    Request events take a ``request_id`` (any hashable; the router's request id string)
    and an optional ``now``. The router must end every request it announced with
    ``on_request_finished`` (aborts included), which drops its per-request clock.

    Invalid arguments (negative counts, fractions outside [0, 1], an unknown mode or pool,
    verify-round numbers that contradict each other) raise ``ValueError``: a metric
    silently recorded wrong is the failure these metrics exist to catch.

    Wiring (where each call belongs):

    - HTTP layer: ``on_request_arrived`` when a request is accepted; ``/metrics`` serves
      ``exposition()`` (or prometheus_client's ASGI app on ``registry``).
    - scheduler: ``on_request_scheduled`` when a row is allocated; ``on_tokens`` per
      delivered ``RequestOutput`` with new tokens; ``on_request_finished`` when it has a
      finish reason; ``set_queue`` after each scheduling pass; for a verify step,
      ``on_verify_requests(update.num_drafts, update.accept_lengths)``.
    - pipeline driver: ``set_in_flight`` when a micro-batch is launched or completes;
      ``on_stage_rpc``, ``set_stage_busy`` and ``set_pool_usage`` with the numbers each
      stage returns in its responses.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        num_stages: int = 0,
        num_spec_tokens: int = 0,
        max_accept_length: int | None = None,
    ):
        self.registry = REGISTRY if registry is None else registry
        reg = self.registry
        if max_accept_length is None:
            max_accept_length = num_spec_tokens + 1 if num_spec_tokens > 0 else DEFAULT_MAX_ACCEPT_LENGTH
        if max_accept_length < 1:
            raise ValueError("max_accept_length must be at least 1")

        try:
            self._create(reg, max_accept_length)
        except ValueError:
            # a name already taken in this registry: leave it as it was
            self.unregister()
            raise

        for reason in FINISH_REASONS:
            self.request_success.labels(finished_reason=reason)
        for pos in range(num_spec_tokens):
            self.spec_num_accepted_tokens_per_pos.labels(position=str(pos))
        for stage in range(num_stages):
            self._touch_stage(stage)

        self._lock = threading.Lock()
        self._requests: dict[Hashable, _RequestClock] = {}

    def _create(self, reg: CollectorRegistry, max_accept_length: int) -> None:
        # --- requests
        self.num_requests_running = Gauge(
            PREFIX + "num_requests_running", "Requests holding a request-pool row (prefilling or decoding).", registry=reg)
        self.num_requests_waiting = Gauge(
            PREFIX + "num_requests_waiting", "Requests admitted by the HTTP layer and waiting for a row.", registry=reg)
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests, by finish reason (stop, length, abort).",
            ["finished_reason"], registry=reg)
        self.num_preemptions = Counter(
            PREFIX + "num_preemptions", "Requests preempted for want of KV pages (recomputed when readmitted).",
            registry=reg)
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of scheduled requests (counted when prefill is scheduled).",
            registry=reg)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated (output) tokens, counted as they are produced.", registry=reg)
        self.request_queue_time = Histogram(
            PREFIX + "request_queue_time_seconds", "Seconds from arrival to scheduling (row allocated).",
            buckets=QUEUE_BUCKETS, registry=reg)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Seconds from arrival to the first output token.",
            buckets=TTFT_BUCKETS, registry=reg)
        self.inter_token_latency = CountedHistogram(
            PREFIX + "inter_token_latency_seconds",
            "Seconds between output tokens; a step that yields n tokens after a gap of t counts n samples of t/n.",
            buckets=ITL_BUCKETS, registry=reg)
        self.request_time_per_output_token = Histogram(
            PREFIX + "request_time_per_output_token_seconds",
            "Per request: (last token time - first token time) / (output tokens - 1).",
            buckets=ITL_BUCKETS, registry=reg)
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Seconds from arrival to finish.",
            buckets=E2E_BUCKETS, registry=reg)

        # --- speculative decoding
        self.spec_num_drafts = Counter(
            PREFIX + "spec_decode_num_drafts", "Drafts verified (one per request per verify round with drafts).",
            registry=reg)
        self.spec_num_draft_tokens = Counter(
            PREFIX + "spec_decode_num_draft_tokens", "Draft tokens verified.", registry=reg)
        self.spec_num_accepted_tokens = Counter(
            PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", registry=reg)
        self.spec_num_accepted_tokens_per_pos = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = first draft token).", ["position"], registry=reg)
        self.spec_accept_length = CountedHistogram(
            PREFIX + "spec_decode_accept_length",
            "Tokens emitted per request per verify round: 1 + accepted draft tokens.",
            buckets=tuple(float(i) for i in range(1, max_accept_length + 1)), registry=reg)

        # --- pipeline
        self.stage_forward_latency = Histogram(
            PREFIX + "stage_forward_latency_seconds",
            "Stage compute seconds of one Forward (mode=forward) or Verify (mode=verify) micro-batch, "
            "as reported by the stage.", ["stage", "mode"], buckets=STAGE_BUCKETS, registry=reg)
        self.stage_commit_latency = Histogram(
            PREFIX + "stage_commit_latency_seconds",
            "Stage compute seconds of one CommitAccept, as reported by the stage.", ["stage"],
            buckets=STAGE_BUCKETS, registry=reg)
        self.pipeline_step_latency = Histogram(
            PREFIX + "pipeline_step_latency_seconds",
            "Wall seconds of one micro-batch through the whole pipeline as the router sees it (all "
            "stages' compute plus one gRPC round trip per stage): minus the stages' compute, the hop cost.",
            ["mode"], buckets=STAGE_BUCKETS, registry=reg)
        self.iteration_tokens = Histogram(
            PREFIX + "iteration_tokens", "Tokens of one micro-batch (decode, verify and prefill chunk tokens; "
            "vLLM's iteration_tokens_total).", buckets=TOKEN_BUCKETS, registry=reg)
        self.stage_forwards = Gauge(
            PREFIX + "stage_forwards", "Layer forwards a stage has run since it started, by how: graph (a CUDA "
            "graph replay) or eager (every kernel launched from the host).", ["stage", "how"], registry=reg)
        self.micro_batches_in_flight = Gauge(
            PREFIX + "micro_batches_in_flight", "Micro-batches launched into the pipeline and not yet finished.",
            registry=reg)
        self.stage_busy_fraction = Gauge(
            PREFIX + "stage_busy_fraction", "Fraction of recent wall time the stage spent computing.", ["stage"],
            registry=reg)
        self.stage_pool_usage = Gauge(
            PREFIX + "stage_pool_usage", "Used fraction of a stage pool (rows, kv, state).", ["stage", "pool"],
            registry=reg)
        self.prefix_cache_queries = Counter(
            PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache at admission.", registry=reg)
        self.prefix_cache_hits = Counter(
            PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed again).", registry=reg)
        self.prefix_cache_usage = Gauge(
            PREFIX + "prefix_cache_usage", "Used fraction of the prefix cache's snapshot slots.", registry=reg)

    # ------------------------------------------------------------------ requests

    def on_request_arrived(self, request_id: Hashable, now: float | None = None) -> None:
        """A request was accepted by the HTTP layer (the start of TTFT and e2e latency)."""
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request {request_id!r} arrived twice")
            self._requests[request_id] = _RequestClock(arrived=_now(now))

    def on_request_scheduled(self, request_id: Hashable, prompt_tokens: int, now: float | None = None) -> None:
        """The scheduler gave the request a row and schedules its prefill.

        Observes the queue time (seconds since arrival) and counts ``prompt_tokens``.
        """
        if prompt_tokens < 0:
            raise ValueError("prompt_tokens must be >= 0")
        t = _now(now)
        with self._lock:
            clock = self._clock(request_id)
            if clock.scheduled is not None:
                raise ValueError(f"request {request_id!r} scheduled twice")
            clock.scheduled = t
        self.request_queue_time.observe(max(0.0, t - clock.arrived))
        self.prompt_tokens.inc(prompt_tokens)

    def on_tokens(self, request_id: Hashable, n: int, now: float | None = None) -> None:
        """``n`` new output tokens of the request became available at ``now``.

        Call once per step result (prefill, decode, or a verify round, which can give
        several tokens at once). The first call observes time-to-first-token for its first
        token. Inter-token latency is amortized as SGLang does: after a gap of ``t`` seconds
        since the previous tokens, ``n`` tokens count ``n`` samples of ``t / n``; the
        tokens after the first in the first call count samples of 0. So per request the
        ITL count is ``output_tokens - 1`` and its sum is ``last - first`` token time.
        """
        if n < 0:
            raise ValueError("n must be >= 0")
        if n == 0:
            return
        t = _now(now)
        with self._lock:
            clock = self._clock(request_id)
            first = clock.first_token is None
            previous = clock.last_token
            if first:
                clock.first_token = t
            clock.last_token = t
            clock.output_tokens += n
        self.generation_tokens.inc(n)
        if first:
            self.time_to_first_token.observe(max(0.0, t - clock.arrived))
            gap, samples = 0.0, n - 1
        else:
            gap, samples = max(0.0, t - previous) / n, n
        if samples:
            self.inter_token_latency.observe(gap, samples)

    def on_request_finished(self, request_id: Hashable, finish_reason: str, now: float | None = None) -> None:
        """The request ended: ``finish_reason`` is ``stop``, ``length`` or ``abort``.

        Counts it by reason, observes end-to-end latency (seconds since arrival) and, when
        it produced at least two tokens, its time per output token. Forgets the request.
        """
        if finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {finish_reason!r}")
        t = _now(now)
        with self._lock:
            clock = self._clock(request_id)
            del self._requests[request_id]
        self.request_success.labels(finished_reason=finish_reason).inc()
        self.e2e_request_latency.observe(max(0.0, t - clock.arrived))
        if clock.output_tokens >= 2:
            self.request_time_per_output_token.observe(
                max(0.0, clock.last_token - clock.first_token) / (clock.output_tokens - 1))

    def set_queue(self, running: int, waiting: int) -> None:
        """Current number of requests holding a row (``running``) and waiting for one."""
        if running < 0 or waiting < 0:
            raise ValueError("running and waiting must be >= 0")
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)

    def on_preemptions(self, n: int) -> None:
        """``n`` running requests gave their rows and KV back to let older ones grow."""
        if n < 0:
            raise ValueError("n must be >= 0")
        self.num_preemptions.inc(n)

    @property
    def tracked_requests(self) -> int:
        """Requests announced and not yet finished (a leak check for tests)."""
        with self._lock:
            return len(self._requests)

    # ------------------------------------------------------------- speculation

    def on_verify_round(
        self,
        num_drafts: int,
        num_draft_tokens: int,
        accepted_per_position: Sequence[int],
        accept_lengths: Sequence[int],
    ) -> None:
        """Record one verify round of a micro-batch.

        ``num_drafts``: requests in the round that carried a draft; ``num_draft_tokens``:
        draft tokens verified in all; ``accepted_per_position[j]``: how many of those drafts
        had their token at position ``j`` (0-based) accepted; ``accept_lengths``: one per
        drafted request, tokens it emitted this round (1 + accepted drafts, so 1 when all
        drafts were rejected). Requests without a draft are left out of all four.

        Consistency is checked: ``len(accept_lengths) == num_drafts`` and the accepted
        total ``sum(accepted_per_position) == sum(a - 1 for a in accept_lengths)``, which
        is also what ``spec_decode_num_accepted_tokens_total`` grows by.
        """
        if num_drafts < 0 or num_draft_tokens < 0 or any(a < 0 for a in accepted_per_position):
            raise ValueError("draft and acceptance counts must be >= 0")
        if len(accept_lengths) != num_drafts:
            raise ValueError(f"{len(accept_lengths)} accept lengths for {num_drafts} drafts")
        if any(a < 1 for a in accept_lengths):
            raise ValueError("every accept length is at least 1 (the target's own token)")
        accepted = sum(accepted_per_position)
        if accepted != sum(a - 1 for a in accept_lengths):
            raise ValueError(
                f"per-position acceptances sum to {accepted}, accept lengths imply "
                f"{sum(a - 1 for a in accept_lengths)}")
        if accepted > num_draft_tokens:
            raise ValueError(f"{accepted} accepted of {num_draft_tokens} draft tokens")
        if any(a > num_drafts for a in accepted_per_position):
            raise ValueError("a position accepted more tokens than there were drafts")
        self.spec_num_drafts.inc(num_drafts)
        self.spec_num_draft_tokens.inc(num_draft_tokens)
        self.spec_num_accepted_tokens.inc(accepted)
        for pos, count in enumerate(accepted_per_position):
            self.spec_num_accepted_tokens_per_pos.labels(position=str(pos)).inc(count)
        for a, count in collections.Counter(accept_lengths).items():
            self.spec_accept_length.observe(a, count)

    def on_verify_requests(self, draft_lengths: Sequence[int], accept_lengths: Sequence[int]) -> None:
        """Convenience for chain drafts: per request of the round, its draft length and its
        accept length (1 + accepted drafts). Requests with a draft length of 0 are skipped.
        Derives the arguments of ``on_verify_round`` and calls it.
        """
        if len(draft_lengths) != len(accept_lengths):
            raise ValueError("one draft length per accept length")
        pairs = [(d, a) for d, a in zip(draft_lengths, accept_lengths) if d > 0]
        for d, a in pairs:
            if not (1 <= a <= d + 1):
                raise ValueError(f"accept length {a} impossible with {d} draft tokens")
        per_pos = [0] * max((d for d, _ in pairs), default=0)
        for _, a in pairs:
            for j in range(a - 1):
                per_pos[j] += 1
        self.on_verify_round(len(pairs), sum(d for d, _ in pairs), per_pos, [a for _, a in pairs])

    # ---------------------------------------------------------------- pipeline

    def on_stage_rpc(self, stage: int, mode: str, seconds: float) -> None:
        """Compute time a stage reported for one RPC: ``mode`` is ``forward``
        (prefill or plain decode), ``verify`` or ``commit`` (CommitAccept); seconds >= 0."""
        if mode not in RPC_KINDS:
            raise ValueError(f"mode must be one of {RPC_KINDS}, got {mode!r}")
        seconds = float(seconds)
        if not (seconds >= 0.0) or math.isinf(seconds):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds!r}")
        if mode == "commit":
            self.stage_commit_latency.labels(stage=str(stage)).observe(seconds)
        else:
            self.stage_forward_latency.labels(stage=str(stage), mode=mode).observe(seconds)

    def on_pipeline_step(self, mode: str, seconds: float, tokens: int | None = None) -> None:
        """Wall time of one micro-batch through every stage (``forward`` or ``verify``) and
        its tokens (None: not counted)."""
        if mode not in ("forward", "verify"):
            raise ValueError(f"mode must be forward or verify, got {mode!r}")
        self.pipeline_step_latency.labels(mode=mode).observe(max(0.0, float(seconds)))
        if tokens is not None:
            self.iteration_tokens.observe(max(0, int(tokens)))

    def set_stage_forwards(self, stage: int, forwards: dict[str, int]) -> None:
        """A stage's layer forwards since its start, by how they ran (its Info's ``forwards``)."""
        for how, n in forwards.items():
            self.stage_forwards.labels(stage=str(stage), how=how).set(n)

    def set_in_flight(self, n: int) -> None:
        """Micro-batches currently in the pipeline."""
        if n < 0:
            raise ValueError("n must be >= 0")
        self.micro_batches_in_flight.set(n)

    def set_stage_busy(self, stage: int, fraction: float) -> None:
        """Fraction of recent wall time (the stage's own window) the stage spent computing."""
        self.stage_busy_fraction.labels(stage=str(stage)).set(_fraction(fraction, "busy fraction"))

    def set_pool_usage(self, stage: int, pool: str, used_fraction: float) -> None:
        """Used fraction of one of a stage's pools: ``rows`` (request-pool rows), ``kv``
        (KV-cache slots of its attention layers) or ``state`` (recurrent-state rows)."""
        if pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
        self.stage_pool_usage.labels(stage=str(stage), pool=pool).set(_fraction(used_fraction, "pool usage"))

    def on_prefix_cache(self, queried: int, hit: int, used_fraction: float) -> None:
        """Prompt tokens looked up and found in the prefix cache since the last call; the
        fraction of its snapshot slots in use."""
        if queried < 0 or hit < 0:
            raise ValueError("queried and hit must be >= 0")
        self.prefix_cache_queries.inc(queried)
        self.prefix_cache_hits.inc(hit)
        self.prefix_cache_usage.set(_fraction(used_fraction, "prefix cache usage"))

    def _touch_stage(self, stage: int) -> None:
        s = str(stage)
        for mode in STAGE_MODES:
            self.stage_forward_latency.labels(stage=s, mode=mode)
        self.stage_commit_latency.labels(stage=s)
        self.stage_busy_fraction.labels(stage=s)
        for pool in POOLS:
            self.stage_pool_usage.labels(stage=s, pool=pool)

    # ---------------------------------------------------------------- export

    def unregister(self) -> None:
        """Remove these metrics from their registry (so a new RouterMetrics can take it)."""
        for metric in self._metrics():
            self.registry.unregister(metric)

    def _metrics(self) -> list:
        return [v for v in vars(self).values() if isinstance(v, (Counter, Gauge, Histogram, CountedHistogram))]

    def exposition(self) -> tuple[bytes, str]:
        """The body and content type of a ``/metrics`` response (text format 0.0.4)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _clock(self, request_id: Hashable) -> _RequestClock:
        try:
            return self._requests[request_id]
        except KeyError:
            raise ValueError(f"unknown request {request_id!r} (on_request_arrived not called, or already finished)")


def metric_families() -> dict[str, str]:
    """Family name -> type (counter, gauge, histogram) of every metric RouterMetrics defines.

    Counter families are named without ``_total``, as prometheus_client names them.
    """
    reg = CollectorRegistry()
    RouterMetrics(reg)
    return {m.name: m.type for m in reg.collect()}


_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created")}


def sample_names() -> set[str]:
    """Every series name a RouterMetrics exposition can contain (what PromQL may select)."""
    return {name + suffix for name, kind in metric_families().items() for suffix in _SUFFIXES[kind]}

