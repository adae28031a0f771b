import math

import pytest

from tpfuse.bench.client import RequestRecord
from tpfuse.bench.metrics import itl_per_token, request_metrics, summarize_window, token_count_warning
from tpfuse.bench.stats import percentile


def record(request_id=0, scheduled=0.0, chunks=((0.1, 1),), end=None, usage=None, error=None, client=None):
    times = [t for t, _ in chunks]
    tokens = [float(n) for _, n in chunks]
    return RequestRecord(
        request_id=request_id,
        max_tokens=16,
        scheduled_s=scheduled,
        start_s=scheduled,
        first_token_s=times[0] if times and error is None else None,
        end_s=end if end is not None else (times[-1] if times else scheduled),
        chunk_times_s=times,
        chunk_tokens=tokens,
        completion_tokens=usage if usage is not None else int(sum(tokens)),
        client_completion_tokens=client,
        error=error,
    )


def test_itl_divides_each_chunk_gap_by_its_tokens_once_per_token():
    values, weights = itl_per_token([0.10, 0.13, 0.14], [1, 3, 1])
    assert values == pytest.approx([0.01, 0.01])
    assert weights == [3, 1]


def test_itl_percentiles_are_not_inflated_by_speculative_chunks():
    # Every token 10 ms apart on the server; speculation delivers them 4 at a time every 40 ms.
    times = [0.05 + 0.04 * i for i in range(10)]
    values, weights = itl_per_token(times, [4] * 10)
    assert percentile(values, 50, weights) == pytest.approx(0.01)
    assert percentile(values, 99, weights) == pytest.approx(0.01)


def test_itl_skips_chunks_without_tokens_and_charges_their_gap_to_the_next():
    values, weights = itl_per_token([0.1, 0.2, 0.3], [1, 0, 2])
    assert values == pytest.approx([0.1]) and weights == [2]


def test_ttft_and_e2e_count_client_queueing_from_the_due_time():
    r = record(scheduled=1.0, chunks=((1.5, 1), (1.6, 1)), end=1.7)
    r.start_s = 1.4  # sent 0.4 s after it was due
    m = request_metrics(r)
    assert m.ttft_s == pytest.approx(0.5)
    assert m.e2e_s == pytest.approx(0.7)


def test_tpot_is_time_after_first_token_over_remaining_tokens_from_usage():
    r = record(scheduled=0.0, chunks=((0.2, 1), (0.5, 4), (0.8, 5)), end=0.8, usage=10)
    assert request_metrics(r).tpot_s == pytest.approx((0.8 - 0.2) / 9)


def test_tpot_of_a_single_token_output_is_nan():
    assert math.isnan(request_metrics(record(chunks=((0.1, 1),), usage=1)).tpot_s)


def test_failed_request_has_no_metrics():
    assert request_metrics(record(error="HTTP 500: boom")) is None


def test_window_throughput_and_achieved_concurrency_from_latencies_over_wall_time():
    # Two overlapping requests on [0, 1] and [0, 0.5], then one on [0.5, 1.0]: wall 1 s.
    records = [
        record(0, 0.0, ((0.1, 1), (1.0, 9)), 1.0),
        record(1, 0.0, ((0.1, 1), (0.5, 4)), 0.5),
        record(2, 0.5, ((0.6, 1), (1.0, 4)), 1.0),
    ]
    w = summarize_window(records)
    assert w.wall_s == pytest.approx(1.0)
    assert w.output_tokens == 20
    assert w.output_tok_s == pytest.approx(20.0)
    assert w.requests_per_s == pytest.approx(3.0)
    assert w.achieved_concurrency == pytest.approx((1.0 + 0.5 + 0.5) / 1.0)
    assert w.valid


def test_window_with_a_failed_request_is_invalid_and_names_the_error():
    records = [record(0, 0.0, ((0.1, 1),), 0.2), record(1, 0.0, (), 0.3, error="HTTP 500: boom")]
    w = summarize_window(records)
    assert not w.valid
    assert (w.num_requests, w.num_failed) == (2, 1)
    assert w.errors == ["HTTP 500: boom"]


def test_window_percentiles_match_the_per_request_values():
    records = [record(i, 0.0, ((0.01 * (i + 1), 1), (0.5, 1)), 0.5) for i in range(11)]
    w = summarize_window(records)
    ttfts = [0.01 * (i + 1) for i in range(11)]
    assert w.ttft_s["p50"] == pytest.approx(percentile(ttfts, 50))
    assert w.ttft_s["p90"] == pytest.approx(percentile(ttfts, 90))
    assert w.ttft_s["mean"] == pytest.approx(sum(ttfts) / 11)


def test_token_count_warning_only_when_client_and_usage_differ():
    same = [record(usage=5, chunks=((0.1, 5),), client=5)]
    assert token_count_warning(same) is None
    differ = same + [record(1, usage=5, chunks=((0.1, 5),), client=7)]
    warning = token_count_warning(differ)
    assert "1/2 requests" in warning and "usage 5" in warning and "tokenizer 7" in warning
