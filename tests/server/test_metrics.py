"""Engine stats become Prometheus gauges without the metrics module knowing their names."""

from tpfuse.server.metrics import ServerMetrics, flatten_stats


def test_nested_stats_flatten_to_underscored_names_and_lists_stay_lists():
    stats = {
        "num_running": 2,
        "spec": {"acceptance_length": 2.5, "rate": [0.9, 0.5]},
        "note": "x",
        "on": True,
    }
    assert dict(flatten_stats(stats)) == {
        "num_running": 2, "spec_acceptance_length": 2.5, "spec_rate": [0.9, 0.5], "on": 1,
    }  # fmt: skip


def test_engine_stats_appear_under_stable_aliases_and_generic_names():
    stats = {"num_waiting": 3, "kv_usage": 0.25, "spec": {"acceptance_rate_per_position": [0.75, 0.5]}}
    text = ServerMetrics(lambda: stats).render().decode()
    assert "tpfuse_num_requests_waiting 3.0" in text
    assert "tpfuse_kv_cache_usage_ratio 0.25" in text
    assert 'tpfuse_engine_spec_acceptance_rate_per_position{position="1"} 0.5' in text


def test_latency_histograms_are_exported():
    metrics = ServerMetrics(dict)
    metrics.ttft.observe(0.02)
    text = metrics.render().decode()
    assert "tpfuse_time_to_first_token_seconds_count 1.0" in text
    assert "tpfuse_inter_token_latency_seconds_count 0.0" in text
    assert "tpfuse_e2e_request_latency_seconds_count 0.0" in text
