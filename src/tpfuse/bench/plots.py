"""PNG plots with matplotlib's Agg backend (no display needed).

Sweep plots accept points as SweepPoint objects or as the dicts saved in summary.json, so saved
sweeps can be compared without re-running them.
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend first)


def _as_dict(point) -> dict:
    return point if isinstance(point, dict) else point.to_dict()


def _num(value) -> float:
    return math.nan if value is None else float(value)


def _concurrency_axis(ax, levels) -> None:
    """Log-2 x axis labelled with the measured levels as plain numbers."""
    ax.set_xscale("log", base=2)
    levels = sorted(set(levels))
    if levels:
        ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_throughput(points_by_label: dict, path: Path) -> Path:
    """Output tok/s (mean with CI bars) against concurrency, one line per configuration."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    levels = []
    for label, points in points_by_label.items():
        rows = sorted((_as_dict(p) for p in points), key=lambda p: p["concurrency"])
        c = [p["concurrency"] for p in rows]
        levels += c
        mean = [_num(p["output_tok_s"]["mean"]) for p in rows]
        low = [m - _num(p["output_tok_s"]["ci_low"]) for m, p in zip(mean, rows, strict=True)]
        high = [_num(p["output_tok_s"]["ci_high"]) - m for m, p in zip(mean, rows, strict=True)]
        yerr = [[0 if math.isnan(x) else x for x in low], [0 if math.isnan(x) else x for x in high]]
        ax.errorbar(c, mean, yerr=yerr, marker="o", capsize=3, label=label)
        for ci, m, p in zip(c, mean, rows, strict=True):
            if not p["valid"]:
                ax.plot(ci, m, "rx", markersize=10)
    _concurrency_axis(ax, levels)
    ax.set_ylabel("output tok/s")
    ax.set_title("throughput vs concurrency (x: invalid point)")
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def plot_latency(points_by_label: dict, path: Path) -> Path:
    """TTFT and TPOT p50 / p90 / p99 against concurrency."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, metric, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        levels = []
        for label, points in points_by_label.items():
            rows = sorted((_as_dict(p) for p in points), key=lambda p: p["concurrency"])
            c = [p["concurrency"] for p in rows]
            levels += c
            for q, style in (("p50", "-o"), ("p90", "--s"), ("p99", ":^")):
                values = [_num(p["pooled"][metric].get(q)) * 1e3 for p in rows]
                ax.plot(c, values, style, label=f"{label} {q}")
        _concurrency_axis(ax, levels)
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} percentiles")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_ratio(crossover, path: Path) -> Path:
    """Throughput ratio B/A with its CI against concurrency; the crossover marked."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = crossover.rows
    c = [r.concurrency for r in rows]
    ratio = [r.ratio for r in rows]
    low = [r.ratio - r.ci_low if math.isfinite(r.ci_low) else 0 for r in rows]
    high = [r.ci_high - r.ratio if math.isfinite(r.ci_high) else 0 for r in rows]
    ax.errorbar(c, ratio, yerr=[low, high], marker="o", capsize=3)
    ax.axhline(1.0, color="gray", linestyle="--")
    if crossover.concurrency is not None:
        ax.axvline(
            crossover.concurrency, color="red", linestyle=":", label=f"crossover C={crossover.concurrency}"
        )
        ax.legend()
    _concurrency_axis(ax, c)
    ax.set_ylabel("throughput ratio B / A")
    ax.set_title(f"B / A with {crossover.confidence:.0%} CI")
    ax.grid(True, alpha=0.3)
    return _save(fig, path)


def plot_runs(result, path: Path) -> Path:
    """Single-stream tok/s per run, with the mean."""
    fig, ax = plt.subplots(figsize=(7, 4))
    ok = [r for r in result.runs if r.ok]
    ax.bar([str(r.index) for r in ok], [r.tok_s for r in ok], color="tab:blue")
    if result.tok_s is not None:
        ax.axhline(result.tok_s.mean, color="black", linestyle="--", label=f"mean {result.tok_s.mean:.1f}")
        ax.legend()
    ax.set_xlabel("run")
    ax.set_ylabel("tok/s")
    ax.set_title(f"single stream: {result.label}")
    return _save(fig, path)


def plot_power(samples, path: Path) -> Path:
    """Power, SM clock and utilization over time, one line per GPU."""
    fig, axes = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    fields = (("power_w", "power (W)"), ("sm_clock_mhz", "SM clock (MHz)"), ("utilization_pct", "util (%)"))
    for gpu in sorted({s.gpu for s in samples}):
        mine = [s for s in samples if s.gpu == gpu]
        t = [s.t_s for s in mine]
        for ax, (name, _) in zip(axes, fields, strict=True):
            ax.plot(t, [_num(getattr(s, name)) for s in mine], label=f"GPU {gpu}")
    for ax, (_, ylabel) in zip(axes, fields, strict=True):
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=7)
    axes[-1].set_xlabel("seconds")
    return _save(fig, path)
