"""Speculative-decoding counters from the server's Prometheus /metrics, as before/after deltas.

Counters are cumulative over the server's life, so only the delta over a measured window means
anything. Any series whose name mentions "spec" is kept: counters (…_total, …_count, …_sum) as
deltas, gauges as their value at the end of the window.
"""

from __future__ import annotations

import math

import httpx

_COUNTER_SUFFIXES = ("_total", "_count", "_sum", "_bucket")


def parse_prometheus(text: str) -> dict[str, float]:
    """{"name{labels}": value} from Prometheus text exposition (comments and bad lines skipped)."""
    series = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        # The value follows the last space outside the labels; an optional timestamp may follow it.
        head, _, rest = line.rpartition("}") if "}" in line else ("", "", line)
        key = head + "}" if head else rest.split()[0]
        fields = rest.split() if head else rest.split()[1:]
        if not fields:
            continue
        try:
            series[key] = float(fields[0])
        except ValueError:
            continue
    return series


async def scrape_spec_metrics(http: httpx.AsyncClient, base_url: str) -> dict[str, float] | None:
    """The speculative-decoding series at `base_url`/metrics; None when there is no /metrics."""
    try:
        response = await http.get(base_url + "/metrics", timeout=10.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return {k: v for k, v in parse_prometheus(response.text).items() if "spec" in k.split("{")[0].lower()}


def spec_deltas(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """Deltas of counters and end values of gauges between two scrapes, plus, when the server
    exposes drafts and accepted tokens, acceptance_length = 1 + accepted / drafts (the bonus token
    counted) and acceptance_rate = accepted / draft tokens. Empty when either scrape is missing."""
    if not before or after is None:
        return {}
    out: dict[str, float] = {}
    for key, value in after.items():
        name = key.split("{")[0]
        if name.endswith(_COUNTER_SUFFIXES) or "num_" in name:
            out[key] = value - before.get(key, 0.0)
        else:
            out[key] = value
    drafts = _find(out, "num_drafts")
    accepted = _find(out, "num_accepted_tokens")
    draft_tokens = _find(out, "num_draft_tokens")
    if drafts and accepted is not None:
        out["acceptance_length"] = 1.0 + accepted / drafts
    if draft_tokens and accepted is not None:
        out["acceptance_rate"] = accepted / draft_tokens
    return out


def _find(series: dict[str, float], fragment: str) -> float | None:
    """The unlabelled series whose name contains `fragment` (e.g. vllm:spec_decode_num_drafts_total)."""
    for key, value in series.items():
        if "{" not in key and fragment in key and not math.isnan(value):
            return value
    return None
