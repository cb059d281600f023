"""``ppspec bench --plot RESULT.json ... --plot-out DIR``: PNG figures of result files.

* ``throughput_vs_concurrency.png``: output tokens/s and requests/s against concurrency
  (``max_concurrency`` of the run, or the measured mean number of requests in flight
  when the run was rate-limited only). Results with the same label form one line.
* ``latency_percentiles.png``: p50 / p90 / p99 of TTFT, TPOT, ITL and end-to-end latency,
  one group of bars per result file.
* ``acceptance_per_position.png``: acceptance rate at each draft position, one line per
  result that has speculative-decoding metrics (skipped when none has).

A result's name is its ``label`` (``--label`` at run time), else the file name.
"""
from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path

from ppspec.bench import BenchError

REQUIRED_KEYS = ("schema_version", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "output_throughput")


def load_result(path: str | os.PathLike) -> dict:
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise BenchError(f"cannot read {p}: {e.strerror or e}") from None
    except ValueError as e:
        raise BenchError(f"{p} is not JSON ({e})") from None
    if not isinstance(data, dict) or any(k not in data for k in REQUIRED_KEYS):
        raise BenchError(f"{p} is not a ppspec bench result")
    return data


def _concurrency(r: dict) -> float | None:
    return r.get("max_concurrency") or r.get("mean_concurrency")


def _names(results: list[tuple[str, dict]]) -> list[str]:
    labels = [r.get("label") or Path(path).stem for path, r in results]
    names = []
    for label, (_, r) in zip(labels, results):
        if labels.count(label) > 1:
            if r.get("max_concurrency"):
                label = f"{label} c={r['max_concurrency']}"
            elif r.get("request_rate"):
                label = f"{label} r={r['request_rate']:g}/s"
        names.append(label)
    return names


def make_plots(paths: list[str], out_dir: str | os.PathLike) -> list[Path]:
    """Draw the figures; returns the files written."""
    if not paths:
        raise BenchError("--plot needs at least one result file")
    results = [(p, load_result(p)) for p in paths]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BenchError(f"cannot create {out}: {e.strerror or e}") from None
    written: list[Path] = []
    names = _names(results)
    series_names = [r.get("label") or Path(p).stem for p, r in results]

    # 1. throughput against concurrency, one line per label
    series: "OrderedDict[str, list[tuple[float, dict]]]" = OrderedDict()
    for label, (_, r) in zip(series_names, results):
        c = _concurrency(r)
        if c is not None:
            series.setdefault(label, []).append((c, r))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    xs_all = []
    for label, pts in series.items():
        pts.sort(key=lambda t: t[0])
        xs = [c for c, _ in pts]
        xs_all += xs
        axes[0].plot(xs, [r["output_throughput"] or 0 for _, r in pts], "o-", label=label)
        axes[1].plot(xs, [r.get("request_throughput") or 0 for _, r in pts], "o-", label=label)
    for ax, ylabel in zip(axes, ("output tokens / s", "requests / s")):
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if xs_all and min(xs_all) > 0 and max(xs_all) / min(xs_all) >= 4:
            ax.set_xscale("log", base=2)
            ax.minorticks_off()
        if xs_all:
            ticks = sorted(set(xs_all))
            ax.set_xticks(ticks)
            ax.set_xticklabels([f"{x:.3g}" for x in ticks])
        ax.set_ylim(bottom=0)
    axes[0].set_title("Output throughput")
    axes[1].set_title("Request throughput")
    if series:
        axes[0].legend(fontsize="small")
    fig.tight_layout()
    written.append(_save(fig, out / "throughput_vs_concurrency.png", plt))

    # 2. latency percentiles, grouped bars per result
    metrics = [("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "End-to-end latency")]
    pcts = ("p50", "p90", "p99")
    width = 0.8 / len(pcts)
    fig, axes = plt.subplots(2, 2, figsize=(max(8, 1.2 * len(results) + 6), 7.5))
    for ax, (key, title) in zip(axes.flat, metrics):
        for j, pc in enumerate(pcts):
            vals = [(r.get(key) or {}).get(pc) or 0 for _, r in results]
            ax.bar([i + (j - 1) * width for i in range(len(results))], vals, width, label=pc)
        ax.set_xticks(range(len(results)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize="small")
        ax.set_ylabel("ms")
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    written.append(_save(fig, out / "latency_percentiles.png", plt))

    # 3. acceptance per draft position
    spec = [(n, r["spec_decode"]) for n, (_, r) in zip(names, results)
            if (r.get("spec_decode") or {}).get("acceptance_per_position")]
    if spec:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for name, s in spec:
            acc = s["acceptance_per_position"]
            mal = s.get("mean_accept_length")
            tag = f" (accept length {mal:.2f})" if mal is not None else ""
            ax.plot(range(len(acc)), acc, "o-", label=name + tag)
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1.05)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        ax.set_title("Acceptance per draft position")
        fig.tight_layout()
        written.append(_save(fig, out / "acceptance_per_position.png", plt))
    return written


def _save(fig, path: Path, plt) -> Path:
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise BenchError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
    return path
