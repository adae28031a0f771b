"""The overlap schedule (the next decode step launched before this one's ids are read) gives exactly
the synchronous engine's tokens and finish reasons: greedy and seeded sampling, stop ids, EOS,
max_tokens and min_tokens in the middle of a batch, requests arriving and aborted mid-run, and
preemption under a tiny KV budget. A launched step is never thrown away: a row that finished
meanwhile has its token discarded, and an arriving request joins the step after it."""

import pytest

from tests.engine.launch_counting import count_launches
from tpfuse.config import EngineConfig
from tpfuse.engine.engine import LLMEngine
from tpfuse.engine.sampling_params import SamplingParams

PROMPT_LENGTHS = [5, 19, 37, 3, 11]


def _prompt(i: int) -> list[int]:
    return [(17 * i + 5 * j + 1) % 200 + 50 for j in range(PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)])]


def _engine(overlap: bool, **kw) -> LLMEngine:
    config = EngineConfig(model="tiny", device="cpu", disable_overlap_schedule=not overlap, **kw)
    engine = LLMEngine(config)
    engine.launch_counts = count_launches(engine.executor)
    return engine


def _run(engine: LLMEngine, arrivals: dict, aborts: dict) -> dict:
    """arrivals: step -> [(request id, params)]; aborts: step -> [request id]. Returns
    request id -> (token ids, finish reason)."""
    tokens, reasons, step = {}, {}, 0
    while engine.has_unfinished() or any(s >= step for s in arrivals):
        for request_id, params in arrivals.get(step, []):
            engine.add_request(request_id, _prompt(int(request_id[1:])), params)
            tokens[request_id] = []
        for request_id in aborts.get(step, []):
            engine.abort_request(request_id)
            reasons[request_id] = "abort"
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        step += 1
    return {r: (tokens[r], reasons.get(r)) for r in tokens}


def _both(arrivals, aborts=None, launches=None, **kw) -> tuple[dict, dict, int]:
    """Runs the synchronous and the overlapped engine; launches: a list that receives both engines'
    step launch counts (sync, overlapped)."""
    results = []
    for overlap in (False, True):
        engine = _engine(overlap, **kw)
        results.append((_run(engine, arrivals, aborts or {}), engine.launch_counts["ahead"]))
        if launches is not None:
            launches.append(engine.launch_counts["total"])
        engine.shutdown()
    (sync, sync_chained), (overlapped, chained) = results
    assert sync_chained == 0
    return sync, overlapped, chained


def greedy(n, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def seeded(n, seed, **kw):
    return SamplingParams(
        temperature=0.9, top_k=40, top_p=0.9, seed=seed, max_tokens=n, ignore_eos=True, **kw
    )


def test_greedy_and_seeded_batch_with_max_tokens_and_min_tokens_mid_batch_matches_sync():
    params = [greedy(20), seeded(9, 1), greedy(14, min_tokens=6), seeded(25, 2), greedy(3)]
    sync, overlapped, chained = _both({0: [(f"r{i}", p) for i, p in enumerate(params)]}, num_kv_blocks=256)
    assert overlapped == sync
    assert [len(sync[f"r{i}"][0]) for i in range(5)] == [20, 9, 14, 25, 3]
    assert chained > 10


def test_stop_token_and_eos_finishing_mid_batch_match_sync():
    base = _both({0: [(f"r{i}", greedy(30)) for i in range(3)]}, num_kv_blocks=256)[0]
    stop_at = base["r1"][0][7]  # r1 stops on its eighth token
    eos_like = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[base["r2"][0][4]])
    arrivals = {0: [("r0", greedy(30)), ("r1", greedy(30, stop_token_ids=[stop_at])), ("r2", eos_like)]}
    launches = []
    sync, overlapped, chained = _both(arrivals, launches=launches, num_kv_blocks=256)
    assert overlapped == sync
    assert sync["r1"][1] == "stop" and len(sync["r1"][0]) <= 8 and sync["r2"][1] == "stop"
    assert chained > 10
    assert launches[1] == launches[0], "the step in flight when a row stopped still served the others"


def test_requests_arriving_and_aborted_mid_run_match_sync():
    arrivals = {
        0: [("r0", greedy(24)), ("r1", seeded(24, 5))],
        4: [("r2", greedy(10))],
        9: [("r3", seeded(12, 8)), ("r4", greedy(6))],
    }
    aborts = {6: ["r1"], 11: ["r3"]}
    sync, overlapped, chained = _both(arrivals, aborts, num_kv_blocks=256)
    aborted = {"r1", "r3"}
    assert {r: v for r, v in overlapped.items() if r not in aborted} == {
        r: v for r, v in sync.items() if r not in aborted
    }
    # An arrival joins the step after the one in flight, so an abort given at a fixed engine step may
    # cut a request a token earlier or later; either way its tokens are those of one stream.
    full = _both({0: [("r1", seeded(24, 5)), ("r3", seeded(12, 8))]}, num_kv_blocks=256)[0]
    for request_id in aborted:
        tokens = overlapped[request_id][0]
        assert overlapped[request_id][1] == sync[request_id][1] == "abort"
        assert tokens == full[request_id][0][: len(tokens)]
    assert sync["r1"][1] == "abort" and len(sync["r1"][0]) < 24
    assert chained > 10


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_under_a_tiny_kv_budget_matches_sync(prefix_caching):
    arrivals = {0: [(f"r{i}", greedy(40) if i % 2 else seeded(40, i)) for i in range(4)]}
    kw = dict(num_kv_blocks=10, block_size=16, enable_prefix_caching=prefix_caching)
    results = []
    for overlap in (False, True):
        engine = _engine(overlap, **kw)
        engine.scheduler.growth_reserve = None  # admit what fits, so that this budget preempts
        results.append(
            (_run(engine, arrivals, {}), engine.scheduler.num_preemptions, engine.launch_counts["ahead"])
        )
        engine.shutdown()
    (sync, sync_preempted, _), (overlapped, preempted, chained) = results
    assert overlapped == sync
    assert sync_preempted > 0 and preempted > 0
    assert chained > 10


def test_overlap_schedule_is_on_by_default_and_off_with_the_flag():
    assert _engine(True, num_kv_blocks=64).overlap
    assert not _engine(False, num_kv_blocks=64).overlap


def test_disable_overlap_schedule_flag_reaches_the_engine_config():
    import argparse

    from tpfuse.config import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--disable-overlap-schedule"])).disable_overlap_schedule
    assert not engine_config_from_args(parser.parse_args([])).disable_overlap_schedule


def test_a_step_in_flight_whose_rows_all_stopped_is_set_aside_and_never_completed():
    """When every row of the step launched ahead stops (here on a stop id), that step serves nobody:
    the engine sets it aside without waiting for it (the last outputs do not wait for it) and reads
    it at the start of the next step, never completing it as a step (which would time the idle gap
    before the next request as one); the next request gets its tokens as if it had not existed."""
    engine = _engine(True, num_kv_blocks=64)
    first = _run(engine, {0: [("r0", greedy(12))]}, {})["r0"][0]
    stop = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[first[6]], ignore_eos=True)
    tokens = _run(engine, {0: [("r0", stop)]}, {})["r0"]  # the same prompt again
    assert tokens[1] == "stop" and engine.launch_counts["ahead"] > 2
    assert engine._in_flight is None and engine._serving_nobody is not None
    generated = engine.num_generated_tokens
    assert engine.step() == [] and engine._serving_nobody is None
    assert engine.num_generated_tokens == generated
    assert _run(engine, {0: [("r0", greedy(12))]}, {})["r0"][0] == first


def test_arrivals_finishes_and_prompt_chunks_every_few_steps_keep_steps_launched_ahead():
    """Serving traffic: a request arrives every other step while others finish by length or a stop id
    and long prompts are prefilled in chunks beside the decodes. The step after each one is still
    planned and launched before that one is read (the composition changes travel on the planned
    batch; the ids come from the token table), and every request gets the synchronous tokens."""
    kw = dict(num_kv_blocks=256, max_num_batched_tokens=24, max_prefill_tokens_per_step=16)

    def arrivals(stop_id=None):
        plan = {}
        for i in range(12):
            params = greedy(6 + 5 * (i % 4)) if i % 3 else seeded(9 + i, i)
            if i == 5 and stop_id is not None:
                params = greedy(20, stop_token_ids=[stop_id])
            plan.setdefault(2 * i, []).append((f"r{i}", params))
        return plan

    base = _run(_engine(False, **kw), arrivals(), {})
    launches = []
    sync, overlapped, ahead = _both(arrivals(stop_id=base["r5"][0][6]), launches=launches, **kw)
    assert overlapped == sync
    assert sync["r5"][1] == "stop" and len(sync["r5"][0]) <= 7
    total = launches[1]
    assert ahead >= total - 2, (ahead, total)  # all but the first step


def test_requests_with_logits_processing_are_launched_ahead_and_match_sync():
    """Penalties, logit_bias, logprobs and a grammar (whose masks read the previous step's token) at
    once, beside plain rows: the overlapped engine launches those steps ahead too, choosing their
    tokens once the step before is read, and gives the synchronous tokens and logprobs."""
    import json

    from tpfuse.engine.sampling_params import Grammar

    schema = Grammar("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    params = [
        greedy(20, repetition_penalty=1.4, presence_penalty=0.5),
        seeded(18, 3, frequency_penalty=0.8, logprobs=3),
        greedy(16, logit_bias={60: 4.0, 61: -50.0}, min_tokens=5),
        SamplingParams(temperature=0.0, max_tokens=24, grammar=schema),
        greedy(22),
    ]
    results = []
    for overlap in (False, True):
        engine = _engine(overlap, num_kv_blocks=256)
        for i, p in enumerate(params):
            engine.add_request(f"r{i}", _prompt(i), p)
        tokens = {f"r{i}": [] for i in range(len(params))}
        logprobs = {f"r{i}": [] for i in range(len(params))}
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                logprobs[out.request_id] += [(e.token_id, e.logprob, e.top) for e in out.logprobs or []]
        results.append((tokens, logprobs, engine.launch_counts["ahead"]))
        engine.shutdown()
    (sync, sync_logprobs, _), (overlapped, overlapped_logprobs, chained) = results
    assert overlapped == sync
    assert overlapped_logprobs == sync_logprobs
    assert [t for t, _, _ in sync_logprobs["r1"]] == sync["r1"] and len(sync["r1"]) == 18
    json.loads(engine.tokenizer.decode(sync["r3"][:-1]))  # the grammar row wrote its object, then EOS
    assert chained > 10


def test_processed_requests_preempted_or_aborted_mid_run_match_sync():
    """Processed rows (penalties, logprobs) under a KV budget that preempts, with an abort while a
    processed step is in flight: the overlapped engine gives the synchronous tokens of every
    request that was not aborted."""
    params = {
        "r0": greedy(30, repetition_penalty=2.0, logprobs=1),
        "r1": seeded(30, 4, presence_penalty=1.0),
        "r2": greedy(30, frequency_penalty=0.7),
        "r3": seeded(30, 6, logit_bias={70: 3.0}),
    }
    results = []
    for overlap in (False, True):
        engine = _engine(overlap, num_kv_blocks=10, block_size=16)
        engine.scheduler.growth_reserve = None  # admit what fits, so that this budget preempts
        tokens = _run(engine, {0: list(params.items())}, {7: ["r3"]})
        results.append((tokens, engine.scheduler.num_preemptions, engine.launch_counts["ahead"]))
        engine.shutdown()
    (sync, sync_preempted, _), (overlapped, preempted, chained) = results
    assert {r: v for r, v in overlapped.items() if r != "r3"} == {r: v for r, v in sync.items() if r != "r3"}
    assert overlapped["r3"][1] == sync["r3"][1] == "abort"
    assert sync_preempted > 0 and preempted > 0
    assert chained > 10
