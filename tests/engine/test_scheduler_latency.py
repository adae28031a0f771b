"""The scheduler's part in serving latency: a prefill budget per step that decodes never wait behind,
and min_tokens without anything to ban keeping the overlap schedule on (the body benchmark clients
send: ignore_eos with min_tokens = max_tokens)."""

import argparse

import pytest

from tests.engine.launch_counting import count_launches
from tpfuse.config import EngineConfig, add_engine_args, engine_config_from_args
from tpfuse.engine.block_manager import BlockManager
from tpfuse.engine.engine import LLMEngine
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.engine.scheduler import Scheduler
from tpfuse.engine.sequence import Sequence

BLOCK = 4
EOS = 999


def fake_next_token(tokens):
    return (sum((i + 1) * t for i, t in enumerate(tokens)) * 31 + 7) % 500


def make(budget=64, prefill=None, max_running=64, num_blocks=512):
    bm = BlockManager(num_blocks, BLOCK, enable_prefix_caching=True)
    return Scheduler(bm, max_running, budget, 4096, {EOS}, max_prefill_tokens_per_step=prefill)


def add(sched, request_id, prompt, **params):
    seq = Sequence(request_id, list(prompt), SamplingParams(**{"max_tokens": 6, **params}), BLOCK)
    sched.add(seq)
    return seq


def step(sched):
    """One step with the fake model; returns (the ids of the requests that were decoding before it,
    the batch)."""
    decoding = {s.request_id for s in sched.running if s.num_uncomputed_tokens == 1}
    batch = sched.schedule()
    sampled = [fake_next_token(s.token_ids) if batch.samples(i) else None for i, s in enumerate(batch.seqs)]
    sched.postprocess(batch, sampled)
    return decoding, batch


def run_with_arrivals(sched, arrivals: dict, checks=None) -> dict:
    """arrivals: step -> [(request id, prompt length)]; returns request id -> its output tokens."""
    seqs, n = {}, 0
    while sched.has_unfinished() or any(k >= n for k in arrivals):
        for request_id, length in arrivals.get(n, []):
            prompt = [(53 * ord(request_id) + 7 * j) % 400 + 1 for j in range(length)]
            seqs[request_id] = add(sched, request_id, prompt)
        if sched.has_unfinished():
            decoding, batch = step(sched)
            if checks is not None:
                checks(decoding, batch)
        n += 1
        assert n < 2000, "the scheduler did not finish"
    return {r: s.token_ids[s.num_prompt_tokens :] for r, s in seqs.items()}


ARRIVALS = {0: [("a", 3), ("b", 40)], 2: [("c", 3), ("d", 77), ("e", 19)], 3: [("f", 130)], 9: [("g", 5)]}


@pytest.mark.parametrize("prefill_budget", [1, 5, 16, 48])
def test_no_step_carries_more_prompt_tokens_than_the_prefill_budget_and_every_decode_runs(prefill_budget):
    most = [0]

    def checks(decoding, batch):
        rows = {s.request_id: n for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)}
        assert all(rows.get(r) == 1 for r in decoding), "a decoding request missed a step"
        prompt_tokens = sum(n for r, n in rows.items() if r not in decoding)
        assert prompt_tokens <= prefill_budget
        most[0] = max(most[0], prompt_tokens)

    outputs = run_with_arrivals(make(budget=64, prefill=prefill_budget), ARRIVALS, checks)
    assert outputs == run_with_arrivals(make(budget=4096), ARRIVALS)  # same tokens as one big budget
    assert most[0] == prefill_budget  # while prompts wait, the budget is used in full


def test_decodes_take_their_tokens_of_a_tight_batch_budget_before_prompt_chunks():
    sched = make(budget=8, prefill=8)
    for i in range(3):
        add(sched, f"s{i}", range(10 * i + 1, 10 * i + 3), max_tokens=20)
    step(sched)  # the three 2-token prompts
    add(sched, "long", range(100, 200))
    for _ in range(4):
        decoding, batch = step(sched)
        assert decoding == {"s0", "s1", "s2"}
        rows = dict(zip([s.request_id for s in batch.seqs], batch.num_new_tokens, strict=True))
        assert rows == {"s0": 1, "s1": 1, "s2": 1, "long": 5}


def test_prompts_wait_in_the_queue_rather_than_exceed_the_prefill_budget():
    sched = make(budget=64, prefill=4)
    for i in range(3):
        add(sched, f"r{i}", range(10 * i + 1, 10 * i + 4))  # 3-token prompts
    _, batch = step(sched)
    rows = dict(zip([s.request_id for s in batch.seqs], batch.num_new_tokens, strict=True))
    assert rows == {"r0": 3, "r1": 1}  # r1's one-token chunk is a decode row, ahead of r0's chunk
    assert [s.request_id for s in sched.waiting] == ["r2"]


def test_min_tokens_with_ignore_eos_and_no_stop_ids_plans_the_next_decode_without_bans():
    sched = make()
    add(sched, "bench", range(1, 4), max_tokens=6, min_tokens=6, ignore_eos=True)
    step(sched)  # the prompt
    decode = sched.schedule()
    assert decode.is_decode and not decode.bans
    following = sched.schedule_following(decode)
    assert following is not None and not following.bans


@pytest.mark.parametrize(
    "params", [dict(min_tokens=6), dict(min_tokens=6, ignore_eos=True, stop_token_ids=[5])]
)
def test_min_tokens_bans_travel_on_the_batch_planned_ahead_counted_from_the_token_in_flight(params):
    sched = make()
    add(sched, "r", range(1, 4), max_tokens=6, **params)
    step(sched)  # the prompt: one output token
    decode = sched.schedule()
    assert decode.is_decode and decode.bans[0].count == 5
    following = sched.schedule_following(decode)  # after decode's token: two outputs
    assert following.begins == [4] and following.bans[0].count == 4
    assert following.bans[0].token_ids == decode.bans[0].token_ids


def test_the_engine_overlaps_decodes_of_a_min_tokens_ignore_eos_request_with_the_same_tokens():
    results = []
    for overlap in (False, True):
        engine = LLMEngine(EngineConfig(model="tiny", device="cpu", disable_overlap_schedule=not overlap))
        counts = count_launches(engine.executor)
        params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, ignore_eos=True)
        engine.add_request("r", [5, 6, 7, 8], params)
        tokens = []
        while engine.has_unfinished():
            tokens += [t for o in engine.step() for t in o.new_token_ids]
        engine.shutdown()
        results.append((tokens, counts["ahead"]))
    (sync_tokens, sync_chained), (tokens, chained) = results
    assert tokens == sync_tokens and len(tokens) == 12
    assert sync_chained == 0 and chained >= 9  # every decode but the first and the last ones


def test_prefill_budget_flag_reaches_the_scheduler_and_is_checked():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    config = engine_config_from_args(parser.parse_args(["--max-prefill-tokens-per-step", "96"]))
    assert config.max_prefill_tokens_per_step == 96
    assert EngineConfig().max_prefill_tokens_per_step == 2048
    with pytest.raises(ValueError, match="--max-prefill-tokens-per-step must be >= 1"):
        EngineConfig(max_prefill_tokens_per_step=0)
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", max_prefill_tokens_per_step=96))
    assert engine.scheduler.max_prefill_tokens_per_step == 96
    engine.shutdown()


def test_the_engine_keeps_every_stream_decoding_while_a_long_prompt_is_prefilled_under_the_budget():
    engine = LLMEngine(EngineConfig(model="tiny", device="cpu", max_prefill_tokens_per_step=16))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"s{i}", [10 + i, 20, 30], params)
    engine.step()  # the three prompts (and their first decode launched ahead)
    engine.add_request("long", [(7 * j) % 200 + 40 for j in range(200)], params)
    steps = 0
    while True:
        got = {o.request_id for o in engine.step()}
        if "long" in got:
            break
        assert got == {"s0", "s1", "s2"}  # every stream, every step
        steps += 1
    engine.shutdown()
    # The decode in flight, 12 steps of 16 prompt tokens, then the last 8 with its first token.
    assert steps == 1 + 200 // 16
