#!/usr/bin/env python3
"""Write deploy/grafana/dashboards/ppspec.json, the ppspec Grafana dashboard.

Built with grafana-foundation-sdk (pip install grafana-foundation-sdk). Run it after
changing a panel and commit the JSON with it; tests/test_deploy.py checks that the
committed JSON is what this script writes and that every PromQL expression in it
parses and names only metrics that ppspec.router.metrics.RouterMetrics exports.

    python deploy/grafana/build_dashboard.py            # write the JSON
    python deploy/grafana/build_dashboard.py --check    # exit 1 if the JSON is stale
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import DashboardCursorSync, DataSourceRef

OUT = Path(__file__).resolve().parent / "dashboards" / "ppspec.json"
UID = "ppspec-overview"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")
RI = "$__rate_interval"


def rate(metric: str, by: str | None = None, window: str = RI) -> str:
    agg = f"sum by ({by}) " if by else "sum"
    return f"{agg}(rate({metric}[{window}]))"


def quantile(q: float, histogram: str, by: str = "") -> str:
    labels = "le" + (f", {by}" if by else "")
    return f"histogram_quantile({q}, sum by ({labels}) (rate({histogram}_bucket[{RI}])))"


ACCEPTED = "ppspec:spec_decode_num_accepted_tokens_total"
DRAFTS = "ppspec:spec_decode_num_drafts_total"
DRAFT_TOKENS = "ppspec:spec_decode_num_draft_tokens_total"
PER_POS = "ppspec:spec_decode_num_accepted_tokens_per_pos_total"


def target(expr: str, legend: str, ref: str) -> prometheus.Dataquery:
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref).range()


def series(title: str, description: str, targets: list[tuple[str, str]], unit: str, *,
           width: int = 12, height: int = 8, minimum: float | None = None,
           maximum: float | None = None) -> timeseries.Panel:
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .span(width)
        .height(height)
        .line_width(1)
        .fill_opacity(10)
        .show_points(common.VisibilityMode.NEVER)
        .legend(cb.VizLegendOptions()
                .display_mode(common.LegendDisplayMode.LIST)
                .placement(common.LegendPlacement.BOTTOM)
                .show_legend(True))
        .tooltip(cb.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.NONE))
    )
    if minimum is not None:
        panel = panel.min(minimum)
    if maximum is not None:
        panel = panel.max(maximum)
    for i, (expr, legend) in enumerate(targets):
        panel = panel.with_target(target(expr, legend, chr(ord("A") + i)))
    return panel


def single(title: str, description: str, expr: str, unit: str, decimals: int) -> stat.Panel:
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DS)
        .unit(unit)
        .decimals(decimals)
        .span(6)
        .height(4)
        .graph_mode(common.BigValueGraphMode.NONE)
        .reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]))
        .with_target(prometheus.Dataquery().expr(expr).legend_format(title).ref_id("A").instant())
    )


def build() -> dict:
    mean_accept = f"1 + {rate(ACCEPTED)} / {rate(DRAFTS)}"
    d = (
        db.Dashboard("ppspec: speculative decoding and pipeline")
        .uid(UID)
        .description("Router-exported metrics of a ppspec deployment (one router, N pipeline stages).")
        .tags(["ppspec", "llm", "speculative-decoding"])
        .refresh("10s")
        .time("now-30m", "now")
        .timezone("browser")
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .editable()
        .with_variable(db.DatasourceVariable("datasource").label("Data source").type("prometheus"))
        # ---------------------------------------------------------------- speculation
        .with_row(db.Row("Speculative decoding"))
        .with_panel(single(
            "Mean accept length", "1 + accepted / drafts over the selected range: tokens emitted per "
            "request per verify round.",
            f"1 + sum(increase({ACCEPTED}[$__range])) / sum(increase({DRAFTS}[$__range]))", "none", 2))
        .with_panel(single(
            "Acceptance rate", "Accepted draft tokens / draft tokens over the selected range.",
            f"sum(increase({ACCEPTED}[$__range])) / sum(increase({DRAFT_TOKENS}[$__range]))", "percentunit", 1))
        .with_panel(single(
            "Output tokens/s", "Generated tokens per second, last rate window.",
            rate("ppspec:generation_tokens_total"), "short", 1))
        .with_panel(single(
            "Requests running", "Requests holding a request-pool row.",
            "sum(ppspec:num_requests_running)", "short", 0))
        .with_panel(series(
            "Mean accept length over time",
            "1 + rate(accepted) / rate(drafts); the accept-length histogram's median and p90 beside it.",
            [(mean_accept, "mean"),
             (quantile(0.5, "ppspec:spec_decode_accept_length"), "p50"),
             (quantile(0.9, "ppspec:spec_decode_accept_length"), "p90")],
            "none", minimum=1))
        .with_panel(series(
            "Acceptance by draft position",
            "Fraction of drafts whose token at position p (0 = first draft token) was accepted. "
            "The positions sum to mean accept length - 1.",
            [(f"{rate(PER_POS, by='position')} / scalar({rate(DRAFTS)})", "position {{position}}")],
            "percentunit", minimum=0, maximum=1))
        .with_panel(series(
            "Acceptance rate over time", "rate(accepted draft tokens) / rate(draft tokens).",
            [(f"{rate(ACCEPTED)} / {rate(DRAFT_TOKENS)}", "acceptance rate")],
            "percentunit", minimum=0, maximum=1))
        .with_panel(series(
            "Drafts and tokens/s", "Verified drafts, draft tokens and accepted tokens per second.",
            [(rate(DRAFTS), "drafts/s"), (rate(DRAFT_TOKENS), "draft tokens/s"),
             (rate(ACCEPTED), "accepted tokens/s")],
            "short", minimum=0))
        # ---------------------------------------------------------------- requests
        .with_row(db.Row("Requests and latency"))
        .with_panel(series(
            "Throughput", "Prompt and generated tokens per second.",
            [(rate("ppspec:generation_tokens_total"), "output tokens/s"),
             (rate("ppspec:prompt_tokens_total"), "prompt tokens/s")],
            "short", minimum=0))
        .with_panel(series(
            "Requests", "Running and waiting requests; finished requests per second by reason; preemptions per second.",
            [("sum(ppspec:num_requests_running)", "running"),
             ("sum(ppspec:num_requests_waiting)", "waiting"),
             (rate("ppspec:request_success_total", by="finished_reason"), "finished {{finished_reason}}/s"),
             (rate("ppspec:num_preemptions_total"), "preempted/s")],
            "short", minimum=0))
        .with_panel(series(
            "Time to first token", "Arrival to first output token.",
            [(quantile(q, "ppspec:time_to_first_token_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)]
            + [("sum(rate(ppspec:request_queue_time_seconds_sum[$__rate_interval])) / "
                "sum(rate(ppspec:request_queue_time_seconds_count[$__rate_interval]))", "mean queue time")],
            "s", minimum=0))
        .with_panel(series(
            "Inter-token latency", "Seconds between output tokens (a verify round's tokens share its gap); "
            "mean time per output token of finished requests.",
            [(quantile(q, "ppspec:inter_token_latency_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)]
            + [("sum(rate(ppspec:request_time_per_output_token_seconds_sum[$__rate_interval])) / "
                "sum(rate(ppspec:request_time_per_output_token_seconds_count[$__rate_interval]))", "mean TPOT")],
            "s", minimum=0))
        .with_panel(series(
            "End-to-end request latency", "Arrival to finish.",
            [(quantile(q, "ppspec:e2e_request_latency_seconds"), f"p{int(q * 100)}") for q in (0.5, 0.9, 0.99)],
            "s", width=24, height=7, minimum=0))
        # ---------------------------------------------------------------- pipeline
        .with_row(db.Row("Pipeline stages"))
        .with_panel(series(
            "Stage Forward / Verify latency", "Stage compute time per micro-batch, as the stage reports it.",
            [(quantile(0.5, "ppspec:stage_forward_latency_seconds", "stage, mode"), "stage {{stage}} {{mode}} p50"),
             (quantile(0.99, "ppspec:stage_forward_latency_seconds", "stage, mode"), "stage {{stage}} {{mode}} p99")],
            "s", minimum=0))
        .with_panel(series(
            "Stage CommitAccept latency", "Stage compute time per CommitAccept.",
            [(quantile(0.5, "ppspec:stage_commit_latency_seconds", "stage"), "stage {{stage}} p50"),
             (quantile(0.99, "ppspec:stage_commit_latency_seconds", "stage"), "stage {{stage}} p99")],
            "s", minimum=0))
        .with_panel(series(
            "Stage busy fraction", "Fraction of wall time each stage spent computing.",
            [("max by (stage) (ppspec:stage_busy_fraction)", "stage {{stage}}")],
            "percentunit", minimum=0, maximum=1))
        .with_panel(series(
            "Micro-batches in flight", "Micro-batches launched into the pipeline and not finished.",
            [("sum(ppspec:micro_batches_in_flight)", "in flight")],
            "short", minimum=0))
        .with_panel(series(
            "Tokens per micro-batch", "Decode, verify and prefill chunk tokens of one micro-batch.",
            [(quantile(0.5, "ppspec:iteration_tokens"), "p50"), (quantile(0.99, "ppspec:iteration_tokens"), "p99")],
            "short", minimum=0))
        .with_panel(series(
            "Stage forwards by how they ran", "Layer forwards per second: CUDA graph replays, and eager ones, "
            "which cost the host far more (a mixed micro-batch or prefill no graph holds).",
            [("sum by (stage, how) (rate(ppspec:stage_forwards[$__rate_interval]))", "stage {{stage}} {{how}}")],
            "ops", minimum=0))
        .with_panel(series(
            "Stage pool usage", "Used fraction of each stage's request rows, KV cache and recurrent-state pool.",
            [("max by (stage, pool) (ppspec:stage_pool_usage)", "stage {{stage}} {{pool}}")],
            "percentunit", width=24, minimum=0, maximum=1))
        .with_panel(series(
            "Prefix cache", "Share of looked-up prompt tokens found in the prefix cache (--enable-prefix-caching), "
            "and the used fraction of its snapshot slots.",
            [(f"{rate('ppspec:prefix_cache_hits_total')} / {rate('ppspec:prefix_cache_queries_total')}", "hit rate"),
             ("max(ppspec:prefix_cache_usage)", "snapshot slots used")],
            "percentunit", width=24, minimum=0, maximum=1))
    )
    return json.loads(json.dumps(d.build(), cls=JSONEncoder))


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed JSON differs")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} is stale: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
