import pytest

from tpfuse.bench.server_metrics import parse_prometheus, spec_deltas

TEXT = """# HELP vllm:spec_decode_num_drafts_total drafts
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{model_name="m"} 10
vllm:spec_decode_num_drafts_total 10
vllm:spec_decode_num_draft_tokens_total 30
vllm:spec_decode_num_accepted_tokens_total 18 1700000000000
vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9
sglang:spec_accept_length 2.5
"""


def test_prometheus_text_is_parsed_with_labels_and_timestamps():
    series = parse_prometheus(TEXT)
    assert series['vllm:spec_decode_num_drafts_total{model_name="m"}'] == 10
    assert series["vllm:spec_decode_num_accepted_tokens_total"] == 18
    assert series["sglang:spec_accept_length"] == 2.5
    assert not any(k.startswith("#") for k in series)


def test_counters_become_deltas_gauges_end_values_and_acceptance_is_derived():
    before = parse_prometheus(TEXT)
    after = dict(before)
    after["vllm:spec_decode_num_drafts_total"] += 100
    after["vllm:spec_decode_num_draft_tokens_total"] += 300
    after["vllm:spec_decode_num_accepted_tokens_total"] += 150
    after["sglang:spec_accept_length"] = 3.1
    deltas = spec_deltas(before, after)
    assert deltas["vllm:spec_decode_num_drafts_total"] == 100
    assert deltas["sglang:spec_accept_length"] == 3.1
    assert deltas["acceptance_length"] == pytest.approx(1 + 150 / 100)
    assert deltas["acceptance_rate"] == pytest.approx(150 / 300)


def test_no_scrape_gives_no_spec_metrics():
    assert spec_deltas(None, {"x_spec_total": 1.0}) == {}
