"""Files a benchmark leaves in its output directory.

single:  summary.json, requests.jsonl, runs.csv, runs.png (+ power.png with GPU telemetry)
sweep:   summary.json, requests.jsonl, sweep.csv, throughput.png, latency.png (+ power.png)
compare: summary.json, requests.jsonl (live runs), compare.csv, throughput.png, ratio.png, latency.png
JSON is strict: NaN and infinities are written as null.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict
from pathlib import Path

from tpfuse.bench import plots


def clean_json(value):
    """`value` with NaN / inf floats replaced by None, recursively (strict JSON)."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {str(k): clean_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_json(v) for v in value]
    return value


def write_json(path: Path, data) -> Path:
    path.write_text(json.dumps(clean_json(data), indent=2, allow_nan=False) + "\n")
    return path


def write_jsonl(path: Path, rows) -> Path:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(clean_json(row), allow_nan=False) + "\n")
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: "" if v is None else v for k, v in clean_json(row).items()})
    return path


def _samples(result) -> list[dict]:
    return [asdict(s) for s in result.samples]


def write_single(result, out_dir: str | Path) -> list[Path]:
    """Write a SingleResult's files into `out_dir` (created); returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = result.summary_dict() | {"gpu_samples": _samples(result)}
    rows = [asdict(r) | {f"energy_{k}": v for k, v in r.energy.items()} for r in result.runs]
    for row in rows:
        row.pop("energy")
    paths = [
        write_json(out / "summary.json", summary),
        write_jsonl(out / "requests.jsonl", (r.to_dict() for r in result.records)),
        write_csv(out / "runs.csv", rows),
        plots.plot_runs(result, out / "runs.png"),
    ]
    if result.samples:
        paths.append(plots.plot_power(result.samples, out / "power.png"))
    return paths


def sweep_rows(result) -> list[dict]:
    """One flat CSV row per point."""
    rows = []
    for p in result.points:
        row = {
            "label": p.label,
            "concurrency": p.concurrency,
            "valid": p.valid,
            "achieved_concurrency": p.pooled.achieved_concurrency,
            "requests_per_s": p.pooled.requests_per_s,
            "output_tok_s_mean": p.tput.mean,
            "output_tok_s_stdev": p.tput.stdev,
            "output_tok_s_cv": p.tput.cv,
            "output_tok_s_ci_low": p.tput.ci_low,
            "output_tok_s_ci_high": p.tput.ci_high,
            "repeats": p.tput.n,
            "num_requests": p.pooled.num_requests,
            "num_failed": p.pooled.num_failed,
        }
        for metric in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
            for stat, value in getattr(p.pooled, metric).items():
                row[f"{metric.removesuffix('_s')}_{stat}_ms"] = value * 1e3
        row |= {f"energy_{k}": v for k, v in p.energy.items()}
        if "acceptance_length" in p.spec:
            row["acceptance_length"] = p.spec["acceptance_length"]
        rows.append(row)
    return rows


def write_sweep(result, out_dir: str | Path, with_plots: bool = True) -> list[Path]:
    """Write a SweepResult's files into `out_dir` (created); returns the paths written.

    Safe to call after every point: each call rewrites the files with the points so far
    (with_plots=False skips the slower PNGs for such partial saves).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = result.summary_dict() | {"gpu_samples": _samples(result)}
    paths = [
        write_json(out / "summary.json", summary),
        write_jsonl(out / "requests.jsonl", result.records),
        write_csv(out / "sweep.csv", sweep_rows(result)),
    ]
    if not with_plots:
        return paths
    paths.append(plots.plot_throughput({result.label: result.points}, out / "throughput.png"))
    paths.append(plots.plot_latency({result.label: result.points}, out / "latency.png"))
    if result.samples:
        paths.append(plots.plot_power(result.samples, out / "power.png"))
    return paths


def write_compare(
    summary: dict, crossover, points_by_label: dict, records: list[dict], out_dir
) -> list[Path]:
    """Write a comparison: `summary` (both sweeps' summaries), the crossover rows as CSV, plots.

    `points_by_label` maps a configuration name to its points (SweepPoint or saved point dicts).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [
        write_json(out / "summary.json", summary | {"mode": "compare", "crossover": crossover.to_dict()}),
        write_csv(out / "compare.csv", [asdict(r) for r in crossover.rows]),
        plots.plot_throughput(points_by_label, out / "throughput.png"),
        plots.plot_ratio(crossover, out / "ratio.png"),
        plots.plot_latency(points_by_label, out / "latency.png"),
    ]
    if records:
        paths.append(write_jsonl(out / "requests.jsonl", records))
    return paths
