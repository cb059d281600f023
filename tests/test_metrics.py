"""RouterMetrics: known events in, exact exposition values out.

Every assertion reads the text exposition (what Prometheus scrapes), parsed with
prometheus_client's own parser, not the Python objects.
"""
from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ppspec.router.metrics import RouterMetrics, metric_families, sample_names

P = "ppspec:"


def scrape(rm: RouterMetrics) -> dict[tuple[str, frozenset], float]:
    body, content_type = rm.exposition()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def val(samples, name, **labels) -> float:
    key = (P + name, frozenset((k, str(v)) for k, v in labels.items()))
    assert key in samples, f"{name}{labels} not exported"
    return samples[key]


@pytest.fixture
def rm():
    return RouterMetrics(CollectorRegistry(), num_stages=2, num_spec_tokens=3)


# ---------------------------------------------------------------- requests


def test_request_lifecycle_counters_and_histograms(rm):
    # A: arrives 0.0, scheduled 0.5 with 10 prompt tokens, tokens 1 @1.0, 3 @1.3, 2 @1.5, stop @1.6
    rm.on_request_arrived("A", now=0.0)
    rm.on_request_arrived("B", now=0.2)
    rm.on_request_scheduled("B", prompt_tokens=5, now=0.3)
    rm.on_request_scheduled("A", prompt_tokens=10, now=0.5)
    rm.on_tokens("B", 1, now=0.8)          # B: TTFT 0.6
    rm.on_request_finished("B", "length", now=0.9)
    rm.on_tokens("A", 1, now=1.0)          # A: TTFT 1.0
    rm.on_request_arrived("C", now=1.0)
    rm.on_tokens("A", 3, now=1.3)          # gap 0.3 over 3 tokens: 3 x 0.1
    rm.on_tokens("A", 2, now=1.5)          # gap 0.2 over 2 tokens: 2 x 0.1
    rm.on_tokens("A", 0, now=1.55)         # nothing new: no sample
    rm.on_request_finished("A", "stop", now=1.6)
    rm.on_request_finished("C", "abort", now=2.0)  # aborted while waiting
    assert rm.tracked_requests == 0

    s = scrape(rm)
    assert val(s, "prompt_tokens_total") == 15
    assert val(s, "generation_tokens_total") == 7
    assert val(s, "request_success_total", finished_reason="stop") == 1
    assert val(s, "request_success_total", finished_reason="length") == 1
    assert val(s, "request_success_total", finished_reason="abort") == 1

    assert val(s, "request_queue_time_seconds_count") == 2
    assert val(s, "request_queue_time_seconds_sum") == pytest.approx(0.5 + 0.1)

    assert val(s, "time_to_first_token_seconds_count") == 2
    assert val(s, "time_to_first_token_seconds_sum") == pytest.approx(1.0 + 0.6)
    assert val(s, "time_to_first_token_seconds_bucket", le="0.5") == 0
    assert val(s, "time_to_first_token_seconds_bucket", le="0.75") == 1
    assert val(s, "time_to_first_token_seconds_bucket", le="1.0") == 2

    # ITL: count = sum over requests of (output tokens - 1) = 5 + 0; sum = last - first token time
    assert val(s, "inter_token_latency_seconds_count") == 5
    assert val(s, "inter_token_latency_seconds_sum") == pytest.approx(0.5)
    assert val(s, "inter_token_latency_seconds_bucket", le="0.075") == 0
    assert val(s, "inter_token_latency_seconds_bucket", le="0.15") == 5

    # TPOT: only A (B had one token): (1.5 - 1.0) / (6 - 1)
    assert val(s, "request_time_per_output_token_seconds_count") == 1
    assert val(s, "request_time_per_output_token_seconds_sum") == pytest.approx(0.1)

    assert val(s, "e2e_request_latency_seconds_count") == 3
    assert val(s, "e2e_request_latency_seconds_sum") == pytest.approx(1.6 + 0.7 + 1.0)
    assert val(s, "e2e_request_latency_seconds_bucket", le="+Inf") == 3

    # PromQL-style: mean ITL = rate(sum) / rate(count) equals the TPOT of the one request
    mean_itl = val(s, "inter_token_latency_seconds_sum") / val(s, "inter_token_latency_seconds_count")
    assert mean_itl == pytest.approx(val(s, "request_time_per_output_token_seconds_sum"))


def test_first_step_with_several_tokens(rm):
    rm.on_request_arrived(7, now=10.0)
    rm.on_tokens(7, 3, now=10.25)  # TTFT 0.25; the two tokens that came with it: ITL 0
    rm.on_request_finished(7, "stop", now=10.25)
    s = scrape(rm)
    assert val(s, "time_to_first_token_seconds_sum") == pytest.approx(0.25)
    assert val(s, "inter_token_latency_seconds_count") == 2
    assert val(s, "inter_token_latency_seconds_sum") == 0
    assert val(s, "request_time_per_output_token_seconds_sum") == 0
    assert val(s, "generation_tokens_total") == 3


def test_queue_gauges(rm):
    rm.set_queue(running=12, waiting=3)
    s = scrape(rm)
    assert val(s, "num_requests_running") == 12
    assert val(s, "num_requests_waiting") == 3
    rm.set_queue(running=0, waiting=0)
    assert val(scrape(rm), "num_requests_running") == 0


def test_request_events_are_checked(rm):
    with pytest.raises(ValueError, match="unknown request"):
        rm.on_tokens("nope", 1, now=0.0)
    rm.on_request_arrived("x", now=0.0)
    with pytest.raises(ValueError, match="twice"):
        rm.on_request_arrived("x", now=0.0)
    with pytest.raises(ValueError, match="finish_reason"):
        rm.on_request_finished("x", "eos", now=1.0)
    with pytest.raises(ValueError):
        rm.on_tokens("x", -1, now=1.0)
    rm.on_request_finished("x", "abort", now=1.0)
    with pytest.raises(ValueError, match="unknown request"):
        rm.on_request_finished("x", "abort", now=1.0)


# ------------------------------------------------------------- speculation


def spec_values(s) -> dict[str, float]:
    return {
        "drafts": val(s, "spec_decode_num_drafts_total"),
        "draft_tokens": val(s, "spec_decode_num_draft_tokens_total"),
        "accepted": val(s, "spec_decode_num_accepted_tokens_total"),
        "len_sum": val(s, "spec_decode_accept_length_sum"),
        "len_count": val(s, "spec_decode_accept_length_count"),
    }


def test_verify_rounds_counters_positions_and_dashboard_formulas(rm):
    s0 = scrape(rm)
    # pre-created at zero so rate() has a start point
    for pos in range(3):
        assert val(s0, "spec_decode_num_accepted_tokens_per_pos_total", position=pos) == 0

    # round 1 (chain drafts of 3): accept lengths 4, 2, 1; a request without draft is skipped
    rm.on_verify_requests(draft_lengths=[3, 3, 3, 0], accept_lengths=[4, 2, 1, 1])
    s1 = scrape(rm)
    assert spec_values(s1) == {"drafts": 3, "draft_tokens": 9, "accepted": 4, "len_sum": 7, "len_count": 3}
    assert [val(s1, "spec_decode_num_accepted_tokens_per_pos_total", position=p) for p in range(3)] == [2, 1, 1]

    # round 2 given directly: two drafts of 3, each accepted its first token only
    rm.on_verify_round(num_drafts=2, num_draft_tokens=6, accepted_per_position=[2, 0, 0], accept_lengths=[2, 2])
    s2 = scrape(rm)
    v = spec_values(s2)
    assert v == {"drafts": 5, "draft_tokens": 15, "accepted": 6, "len_sum": 11, "len_count": 5}
    assert [val(s2, "spec_decode_num_accepted_tokens_per_pos_total", position=p) for p in range(3)] == [4, 1, 1]
    # accept-length histogram buckets are the integers 1..num_spec_tokens+1
    assert [val(s2, "spec_decode_accept_length_bucket", le=le) for le in ("1.0", "2.0", "3.0", "4.0", "+Inf")] \
        == [1, 4, 4, 5, 5]

    # The dashboard's formulas on these values:
    #   acceptance rate    = accepted / draft tokens
    #   mean accept length = 1 + accepted / drafts = accept_length_sum / accept_length_count
    #   acceptance at position p = accepted_per_pos{p} / drafts
    assert v["accepted"] / v["draft_tokens"] == pytest.approx(0.4)
    assert 1 + v["accepted"] / v["drafts"] == pytest.approx(2.2)
    assert v["len_sum"] / v["len_count"] == pytest.approx(1 + v["accepted"] / v["drafts"])
    per_pos_rate = [val(s2, "spec_decode_num_accepted_tokens_per_pos_total", position=p) / v["drafts"]
                    for p in range(3)]
    assert per_pos_rate == pytest.approx([0.8, 0.2, 0.2])
    assert sum(per_pos_rate) == pytest.approx(v["accepted"] / v["drafts"])

    # ... and over a window (rate() divides both sides by the same duration): round 2 alone
    w1, w2 = spec_values(s1), v
    d = {k: w2[k] - w1[k] for k in w2}
    assert 1 + d["accepted"] / d["drafts"] == pytest.approx(2.0)
    assert d["accepted"] / d["draft_tokens"] == pytest.approx(2 / 6)
    assert d["len_sum"] / d["len_count"] == pytest.approx(2.0)


def test_positions_beyond_the_precreated_ones(rm):
    rm.on_verify_requests([5], [6])
    s = scrape(rm)
    assert [val(s, "spec_decode_num_accepted_tokens_per_pos_total", position=p) for p in range(5)] == [1] * 5


@pytest.mark.parametrize("args", [
    (2, 6, [1, 0, 0], [2]),        # one accept length for two drafts
    (1, 3, [1, 1, 0], [2]),        # positions say 2 accepted, lengths say 1
    (1, 1, [1, 1], [3]),           # more accepted than drafted tokens
    (1, 3, [0, 0, 0], [0]),        # accept length below 1
    (1, 3, [2, 0, 0], [3]),        # a position accepted more than there were drafts
])
def test_inconsistent_verify_round_rejected(rm, args):
    before = scrape(rm)
    with pytest.raises(ValueError):
        rm.on_verify_round(*args)
    assert scrape(rm) == {k: v for k, v in before.items()}  # nothing half-recorded


def test_impossible_chain_accept_length_rejected(rm):
    with pytest.raises(ValueError, match="impossible"):
        rm.on_verify_requests([2], [4])


# ---------------------------------------------------------------- pipeline


def test_stage_metrics(rm):
    s0 = scrape(rm)
    for stage in (0, 1):  # num_stages=2 pre-creates every stage series
        assert val(s0, "stage_forward_latency_seconds_count", stage=stage, mode="verify") == 0
        assert val(s0, "stage_commit_latency_seconds_count", stage=stage) == 0
        for pool in ("rows", "kv", "state"):
            assert val(s0, "stage_pool_usage", stage=stage, pool=pool) == 0

    rm.on_stage_rpc(0, "forward", 0.002)
    rm.on_stage_rpc(0, "verify", 0.004)
    rm.on_stage_rpc(0, "verify", 0.006)
    rm.on_stage_rpc(1, "commit", 0.0005)
    rm.set_in_flight(2)
    rm.set_stage_busy(0, 0.75)
    rm.set_stage_busy(1, 0.5)
    rm.set_pool_usage(1, "state", 0.25)
    rm.set_pool_usage(1, "kv", 1.0)
    s = scrape(rm)
    assert val(s, "stage_forward_latency_seconds_count", stage=0, mode="forward") == 1
    assert val(s, "stage_forward_latency_seconds_sum", stage=0, mode="forward") == pytest.approx(0.002)
    assert val(s, "stage_forward_latency_seconds_count", stage=0, mode="verify") == 2
    assert val(s, "stage_forward_latency_seconds_sum", stage=0, mode="verify") == pytest.approx(0.010)
    assert val(s, "stage_forward_latency_seconds_bucket", stage=0, mode="verify", le="0.004") == 1
    assert val(s, "stage_forward_latency_seconds_bucket", stage=0, mode="verify", le="0.006") == 2
    assert val(s, "stage_forward_latency_seconds_count", stage=1, mode="verify") == 0
    assert val(s, "stage_commit_latency_seconds_count", stage=1) == 1
    assert val(s, "stage_commit_latency_seconds_sum", stage=1) == pytest.approx(0.0005)
    assert val(s, "micro_batches_in_flight") == 2
    assert val(s, "stage_busy_fraction", stage=0) == 0.75
    assert val(s, "stage_busy_fraction", stage=1) == 0.5
    assert val(s, "stage_pool_usage", stage=1, pool="state") == 0.25
    assert val(s, "stage_pool_usage", stage=1, pool="kv") == 1.0
    assert val(s, "stage_pool_usage", stage=1, pool="rows") == 0

    rm.on_pipeline_step("forward", 0.003, tokens=64)
    rm.on_pipeline_step("verify", 0.004, tokens=300)
    rm.on_pipeline_step("forward", 0.001)  # tokens not counted
    rm.set_stage_forwards(1, {"graph": 40, "eager": 3})
    s = scrape(rm)
    assert val(s, "iteration_tokens_count") == 2 and val(s, "iteration_tokens_sum") == 364
    assert val(s, "iteration_tokens_bucket", le="64.0") == 1 and val(s, "iteration_tokens_bucket", le="512.0") == 2
    assert val(s, "pipeline_step_latency_seconds_count", mode="forward") == 2
    assert val(s, "stage_forwards", stage=1, how="graph") == 40 and val(s, "stage_forwards", stage=1, how="eager") == 3


@pytest.mark.parametrize("call", [
    lambda rm: rm.on_stage_rpc(0, "prefill", 0.1),
    lambda rm: rm.on_stage_rpc(0, "verify", -0.1),
    lambda rm: rm.on_stage_rpc(0, "verify", float("nan")),
    lambda rm: rm.set_stage_busy(0, 1.5),
    lambda rm: rm.set_stage_busy(0, float("nan")),
    lambda rm: rm.set_pool_usage(0, "scratch", 0.1),
    lambda rm: rm.set_pool_usage(0, "kv", -0.1),
    lambda rm: rm.set_in_flight(-1),
    lambda rm: rm.set_queue(-1, 0),
])
def test_bad_stage_values_rejected(rm, call):
    with pytest.raises(ValueError):
        call(rm)


# ---------------------------------------------------------------- registries and names


def test_names_are_prefixed_and_complete(rm):
    families = metric_families()
    assert all(name.startswith(P) for name in families)
    expected = {
        "num_requests_running", "num_requests_waiting", "num_preemptions", "request_success", "prompt_tokens",
        "generation_tokens", "request_queue_time_seconds", "time_to_first_token_seconds",
        "inter_token_latency_seconds", "request_time_per_output_token_seconds",
        "e2e_request_latency_seconds", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
        "spec_decode_accept_length", "stage_forward_latency_seconds", "stage_commit_latency_seconds",
        "micro_batches_in_flight", "stage_busy_fraction", "stage_pool_usage", "pipeline_step_latency_seconds",
        "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_usage", "iteration_tokens", "stage_forwards",
    }
    assert set(families) == {P + n for n in expected}
    # every sample a busy router exports is a name sample_names() announces
    rm.on_request_arrived("r", now=0)
    rm.on_request_scheduled("r", 4, now=0)
    rm.on_tokens("r", 2, now=1)
    rm.on_request_finished("r", "stop", now=2)
    rm.on_verify_requests([2], [2])
    exported = {name for name, _ in scrape(rm)}
    assert exported <= sample_names()
    assert {P + "spec_decode_num_accepted_tokens_per_pos_total", P + "time_to_first_token_seconds_bucket"} <= exported


def test_private_registries_are_independent():
    a, b = RouterMetrics(CollectorRegistry()), RouterMetrics(CollectorRegistry())
    a.on_verify_requests([1], [2])
    assert val(scrape(a), "spec_decode_num_drafts_total") == 1
    assert val(scrape(b), "spec_decode_num_drafts_total") == 0


def test_default_registry_and_unregister():
    if b"ppspec:" in generate_latest(REGISTRY):
        # another part of this process already holds the default registry: one per registry
        with pytest.raises(ValueError):
            RouterMetrics()
        return
    rm = RouterMetrics()  # prometheus_client's default registry
    try:
        rm.set_in_flight(3)
        assert b"ppspec:micro_batches_in_flight 3.0" in generate_latest(REGISTRY)
        with pytest.raises(ValueError):
            RouterMetrics()  # one per registry
    finally:
        rm.unregister()
    assert b"ppspec:" not in generate_latest(REGISTRY)
    RouterMetrics().unregister()  # the registry is free again


def test_failed_construction_leaves_the_registry_as_it_was():
    from prometheus_client import Gauge

    reg = CollectorRegistry()
    Gauge("ppspec:stage_pool_usage", "taken", registry=reg)  # the last metric RouterMetrics creates
    with pytest.raises(ValueError):
        RouterMetrics(reg)
    assert [m.name for m in reg.collect()] == ["ppspec:stage_pool_usage"]


def test_a_counted_histogram_exports_what_prometheus_clients_histogram_does():
    """``CountedHistogram.observe(v, n)`` against prometheus_client's ``Histogram`` observing
    ``v`` n times (the reference): the same ``_bucket``, ``_count`` and ``_sum`` samples in
    the text exposition, values on bucket bounds, between them, past the last and 0 included;
    and a second histogram of the same name on the registry is refused, as for a Histogram."""
    from prometheus_client import Histogram

    from ppspec.router.metrics import CountedHistogram

    buckets = (0.001, 0.01, 0.1, 1.0)
    samples = [(0.0, 3), (0.001, 2), (0.005, 4), (0.01, 1), (0.5, 7), (1.0, 1), (3.0, 2), (0.02, 0)]
    mine, ref = CollectorRegistry(), CollectorRegistry()
    h = CountedHistogram("x_seconds", "doc", buckets, mine)
    r = Histogram("x_seconds", "doc", buckets=buckets, registry=ref)
    for v, n in samples:
        h.observe(v, n)
        for _ in range(n):
            r.observe(v)

    def exported(reg):
        return {(s.name, frozenset(s.labels.items())): s.value
                for fam in text_string_to_metric_families(generate_latest(reg).decode()) for s in fam.samples
                if not s.name.endswith("_created")}

    got, want = exported(mine), exported(ref)
    assert got == pytest.approx(want) and len(want) == len(buckets) + 3
    assert got[("x_seconds_count", frozenset())] == sum(n for _, n in samples)
    with pytest.raises(ValueError, match="Duplicated"):
        CountedHistogram("x_seconds", "doc", buckets, mine)
