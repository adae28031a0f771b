"""Prometheus metrics for /metrics: latencies measured in the HTTP process, engine state from stats.

Every numeric entry of the engine's `stats()` appears as a gauge `tpfuse_engine_<name>`: a list of
numbers becomes one gauge with a `position` label (e.g. per-position draft acceptance rates), a nested
dict is flattened with `_` ({"spec": {"acceptance_length": 2.1}} -> tpfuse_engine_spec_acceptance_length).
So the engine (and speculative decoding) adds a metric by adding a stats entry; nothing here changes.
The headline engine gauges also get stable names (ENGINE_ALIASES) whichever stats key carries them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

# stable metric name -> stats keys that may carry it (first found wins)
ENGINE_ALIASES = {
    "tpfuse_num_requests_running": ("num_running", "running", "num_running_requests"),
    "tpfuse_num_requests_waiting": ("num_waiting", "waiting", "num_waiting_requests"),
    "tpfuse_kv_cache_usage_ratio": ("kv_usage", "kv_cache_usage", "kv_usage_fraction"),
    "tpfuse_prefix_cache_hit_rate": ("prefix_cache_hit_rate", "prefix_hit_rate"),
}

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)


def _metric_name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def _is_number(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def flatten_stats(stats: dict, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(name, number | list of numbers) pairs of a nested stats dict, names joined with '_'."""
    for key, value in stats.items():
        name = f"{prefix}{_metric_name(str(key))}"
        if isinstance(value, dict):
            yield from flatten_stats(value, name + "_")
        elif isinstance(value, bool):
            yield name, int(value)
        elif _is_number(value) or (isinstance(value, list | tuple) and all(_is_number(x) for x in value)):
            yield name, value


class _EngineStatsCollector:
    def __init__(self, get_stats: Callable[[], dict]):
        self.get_stats = get_stats

    def collect(self):
        stats = self.get_stats() or {}
        for alias, keys in ENGINE_ALIASES.items():
            for key in keys:
                if _is_number(stats.get(key)):
                    yield GaugeMetricFamily(alias, f"engine stats '{key}'", value=float(stats[key]))
                    break
        for name, value in flatten_stats(stats):
            metric = f"tpfuse_engine_{name}"
            if isinstance(value, list | tuple):
                family = GaugeMetricFamily(metric, f"engine stats '{name}' by position", labels=["position"])
                for position, v in enumerate(value):
                    family.add_metric([str(position)], float(v))
                yield family
            else:
                yield GaugeMetricFamily(metric, f"engine stats '{name}'", value=float(value))


class ServerMetrics:
    """The HTTP process's metrics on its own registry (so several apps can live in one test process)."""

    def __init__(self, get_engine_stats: Callable[[], dict]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tpfuse_requests", "finished requests", ["endpoint", "finish_reason"], registry=r
        )
        self.request_errors = Counter(
            "tpfuse_request_errors", "requests refused or failed", ["status_code"], registry=r
        )
        self.prompt_tokens = Counter("tpfuse_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generated_tokens = Counter("tpfuse_generation_tokens", "generated tokens", registry=r)
        self.cached_prompt_tokens = Counter(
            "tpfuse_cached_prompt_tokens", "prompt tokens found in the prefix cache", registry=r
        )
        self.ttft = Histogram(
            "tpfuse_time_to_first_token_seconds",
            "arrival to first token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "tpfuse_inter_token_latency_seconds",
            "time between consecutive tokens (a step's tokens share its gap)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tpfuse_e2e_request_latency_seconds", "arrival to last token", buckets=E2E_BUCKETS, registry=r
        )
        r.register(_EngineStatsCollector(get_engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
