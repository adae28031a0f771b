"""Latency and throughput metrics from request records.

Definitions (all latencies from the time a request was due, so client-side queueing counts):
TTFT = first token - due; E2E = end - due; TPOT = (E2E - TTFT) / (output tokens - 1);
ITL per token: each chunk after the first contributes gap / tokens-in-chunk, once per token it
carries, so a speculative chunk of 3 tokens after 30 ms gives three 10 ms values, not one 30 ms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from tpfuse.bench.client import RequestRecord
from tpfuse.bench.stats import percentile

PERCENTILES = (50, 90, 99)


def itl_per_token(chunk_times_s: Sequence[float], chunk_tokens: Sequence[float]) -> tuple[list, list]:
    """(values, weights): for each chunk after the first, its gap divided by its tokens, weighted by
    its tokens. Chunks with no tokens are skipped (their gap joins the next chunk's)."""
    values, weights = [], []
    previous = None
    for t, n in zip(chunk_times_s, chunk_tokens, strict=True):
        if n <= 0:
            continue
        if previous is not None:
            values.append((t - previous) / n)
            weights.append(n)
        previous = t
    return values, weights


@dataclass(slots=True)
class RequestMetrics:
    ttft_s: float
    e2e_s: float
    tpot_s: float  # NaN for a single-token output
    output_tokens: float
    itl_values: list[float]
    itl_weights: list[float]


def request_metrics(record: RequestRecord) -> RequestMetrics | None:
    """Metrics of one successful request; None for a failed one or one that produced no token."""
    if not record.ok or record.first_token_s is None or record.end_s is None:
        return None
    ttft = record.first_token_s - record.scheduled_s
    e2e = record.end_s - record.scheduled_s
    tokens = record.output_tokens
    tpot = (e2e - ttft) / (tokens - 1) if tokens > 1 else math.nan
    values, weights = itl_per_token(record.chunk_times_s, record.chunk_tokens)
    return RequestMetrics(ttft, e2e, tpot, tokens, values, weights)


def distribution(values: Sequence[float], weights: Sequence[float] | None = None) -> dict[str, float]:
    """mean and p50/p90/p99 (NaN entries dropped; NaN when nothing is left)."""
    pairs = [(v, 1.0 if weights is None else w) for v, w in zip(values, weights or values, strict=True)]
    pairs = [(v, w) for v, w in pairs if not math.isnan(v)]
    out = {"mean": math.nan}
    if pairs:
        out["mean"] = sum(v * w for v, w in pairs) / sum(w for _, w in pairs)
    for q in PERCENTILES:
        out[f"p{q}"] = percentile([v for v, _ in pairs], q, [w for _, w in pairs]) if pairs else math.nan
    return out


@dataclass(slots=True)
class WindowSummary:
    """One measured window (a single-stream run, or one repeat of one concurrency level).

    wall_s runs from the first request due to the last one finished. achieved_concurrency is the sum
    of E2E latencies over wall_s (the concurrency the server actually saw, on average).
    token_mismatches counts requests whose client re-tokenized count differs from usage.
    """

    num_requests: int
    num_failed: int
    wall_s: float
    output_tokens: float
    output_tok_s: float
    requests_per_s: float
    achieved_concurrency: float
    ttft_s: dict = field(default_factory=dict)
    tpot_s: dict = field(default_factory=dict)
    itl_s: dict = field(default_factory=dict)
    e2e_s: dict = field(default_factory=dict)
    token_mismatches: int = 0
    errors: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return self.num_failed == 0 and self.num_requests > 0

    def to_dict(self) -> dict:
        return asdict(self) | {"valid": self.valid}


def summarize_window(records: Sequence[RequestRecord]) -> WindowSummary:
    """Throughput, achieved concurrency and latency distributions over `records` (failed included
    in the counts, excluded from the latencies)."""
    done = [r for r in records if r.end_s is not None]
    wall = max(r.end_s for r in done) - min(r.scheduled_s for r in done) if done else 0.0
    measured = [m for m in (request_metrics(r) for r in records) if m is not None]
    failed = [r for r in records if not r.ok]
    tokens = sum(m.output_tokens for m in measured)
    itl_values = [v for m in measured for v in m.itl_values]
    itl_weights = [w for m in measured for w in m.itl_weights]
    mismatches = sum(
        1
        for r in records
        if r.ok and r.completion_tokens is not None and r.client_completion_tokens is not None
        if r.completion_tokens != r.client_completion_tokens
    )
    return WindowSummary(
        num_requests=len(records),
        num_failed=len(failed),
        wall_s=wall,
        output_tokens=tokens,
        output_tok_s=tokens / wall if wall > 0 else 0.0,
        requests_per_s=len(measured) / wall if wall > 0 else 0.0,
        achieved_concurrency=sum(m.e2e_s for m in measured) / wall if wall > 0 else 0.0,
        ttft_s=distribution([m.ttft_s for m in measured]),
        tpot_s=distribution([m.tpot_s for m in measured]),
        itl_s=distribution(itl_values, itl_weights),
        e2e_s=distribution([m.e2e_s for m in measured]),
        token_mismatches=mismatches,
        errors=sorted({r.error for r in failed if r.error})[:5],
    )


def token_count_warning(records: Sequence[RequestRecord]) -> str | None:
    """A warning when client re-tokenized counts differ from the server's usage, else None."""
    pairs = [
        (r.completion_tokens, r.client_completion_tokens)
        for r in records
        if r.ok and r.completion_tokens is not None and r.client_completion_tokens is not None
    ]
    bad = [(s, c) for s, c in pairs if s != c]
    if not bad:
        return None
    server, client = sum(s for s, _ in bad), sum(c for _, c in bad)
    return (
        f"token count mismatch in {len(bad)}/{len(pairs)} requests: server usage {server} vs client "
        f"tokenizer {client}; throughput uses the server's usage"
    )
