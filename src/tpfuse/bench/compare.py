"""Paired comparison of two configurations and the crossover concurrency.

The crossover is the first concurrency (ascending) at which the upper confidence bound of
throughput_b / throughput_a falls below 1: from there on, B is slower than A with that confidence
(e.g. A = speculation off, B = speculation on). Invalid points (failed requests) never decide it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tpfuse.bench.stats import ratio_ci


@dataclass(slots=True)
class RatioRow:
    concurrency: int
    ratio: float  # throughput_b / throughput_a
    ci_low: float
    ci_high: float
    paired: bool
    valid: bool  # both points valid


@dataclass(slots=True)
class Crossover:
    rows: list[RatioRow]
    concurrency: int | None  # None: B never fell below A with confidence
    confidence: float

    def to_dict(self) -> dict:
        return {
            "concurrency": self.concurrency,
            "confidence": self.confidence,
            "rows": [asdict(r) for r in self.rows],
        }


@dataclass(slots=True)
class PointThroughput:
    """What the crossover needs from a sweep point: per-repeat output tok/s and validity."""

    concurrency: int
    repeats: list[float]
    valid: bool


def find_crossover(a: list[PointThroughput], b: list[PointThroughput], confidence: float = 0.95) -> Crossover:
    """Ratio rows at the concurrencies both sweeps measured, and the crossover concurrency.

    Repeats of equal count are treated as paired (repeat i of A ran beside repeat i of B).
    """
    by_c_a = {p.concurrency: p for p in a}
    by_c_b = {p.concurrency: p for p in b}
    rows = []
    for c in sorted(by_c_a.keys() & by_c_b.keys()):
        pa, pb = by_c_a[c], by_c_b[c]
        if not pa.repeats or not pb.repeats or sum(pa.repeats) <= 0:
            continue
        estimate = ratio_ci(pa.repeats, pb.repeats, confidence)
        rows.append(
            RatioRow(
                c, estimate.ratio, estimate.ci_low, estimate.ci_high, estimate.paired, pa.valid and pb.valid
            )
        )
    crossover = next((r.concurrency for r in rows if r.valid and r.ci_high < 1.0), None)
    return Crossover(rows, crossover, confidence)


def throughputs_from_points(points) -> list[PointThroughput]:
    """PointThroughput from SweepPoint objects."""
    return [PointThroughput(p.concurrency, [r.output_tok_s for r in p.repeats], p.valid) for p in points]


def load_saved_sweep(path: str | Path) -> tuple[str, list[PointThroughput], dict]:
    """(label, points, summary) from a sweep's summary.json or the directory holding it.

    Raises ValueError naming the file when it is missing or is not a sweep summary.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{path} does not exist: pass a sweep output directory or its summary.json"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if summary.get("mode") != "sweep":
        raise ValueError(
            f"{path} is not a sweep summary (mode {summary.get('mode')!r}); run `tpfuse bench sweep`"
        )
    points = [
        PointThroughput(p["concurrency"], [float(x) for x in p["output_tok_s_repeats"]], bool(p["valid"]))
        for p in summary.get("points", [])
    ]
    return summary.get("label") or str(path.parent), points, summary
