"""Random serving traffic (seeded, so every run is the same): arrivals at random steps with prompts
of 1-60 tokens, greedy and seeded sampling, max_tokens, min_tokens, stop ids, EOS, aborts, a KV cache
small enough to preempt, chunked prefill and prefix caching on or off. The overlap schedule (steps
planned while the step before runs, their ids from the token table) must give every request that
was not aborted exactly the synchronous engine's tokens and finish reason."""

import random

import pytest

from tpfuse.config import EngineConfig
from tpfuse.engine.engine import LLMEngine
from tpfuse.engine.sampling_params import SamplingParams


def _traffic(seed: int):
    rng = random.Random(seed)
    arrivals, aborts = {}, {}
    for i in range(rng.randint(6, 14)):
        step = rng.randint(0, 25)
        prompt = [rng.randint(3, 250) for _ in range(rng.choice([1, 2, 3, rng.randint(4, 60)]))]
        kw = dict(max_tokens=rng.randint(1, 30), ignore_eos=rng.random() < 0.5)
        if rng.random() < 0.3:
            kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
        if rng.random() < 0.4:
            kw["stop_token_ids"] = [rng.randint(3, 250) for _ in range(rng.randint(1, 20))]
        if rng.random() < 0.5:
            params = SamplingParams(temperature=0.0, **kw)
        else:
            sampling = dict(temperature=rng.choice([0.7, 1.0]), top_k=rng.choice([-1, 5, 40]), top_p=0.9)
            params = SamplingParams(**sampling, seed=rng.randint(0, 99), **kw)
        arrivals.setdefault(step, []).append((f"r{i}", prompt, params))
        if rng.random() < 0.15:
            aborts.setdefault(step + rng.randint(1, 10), []).append(f"r{i}")
    config = dict(
        num_kv_blocks=rng.choice([12, 24, 256]),
        block_size=rng.choice([4, 16]),
        max_num_batched_tokens=rng.choice([16, 32, 256]),
        max_prefill_tokens_per_step=rng.choice([8, 16, 256]),
        enable_prefix_caching=rng.random() < 0.6,
        max_running_requests=rng.choice([4, 8, 64]),
    )
    return arrivals, aborts, config


def _serve(overlap: bool, arrivals, aborts, config) -> tuple[dict, dict, int]:
    engine = LLMEngine(
        EngineConfig(model="tiny", device="cpu", disable_overlap_schedule=not overlap, **config)
    )
    tokens, reasons, step = {}, {}, 0
    while engine.has_unfinished() or any(s >= step for s in arrivals):
        for request_id, prompt, params in arrivals.get(step, []):
            try:
                engine.add_request(request_id, prompt, params)
            except ValueError as refused:  # e.g. a prompt longer than this small cache holds
                reasons[request_id] = f"refused: {refused}"
            tokens[request_id] = []
        for request_id in aborts.get(step, []):
            if request_id not in reasons:
                engine.abort_request(request_id)
                reasons[request_id] = "abort"
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        step += 1
        assert step < 2000, "the engine did not finish"
    preemptions = engine.scheduler.num_preemptions
    engine.shutdown()
    return tokens, reasons, preemptions


SEEDS = range(24)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_traffic_gets_the_synchronous_tokens_with_steps_planned_ahead(seed):
    arrivals, aborts, config = _traffic(seed)
    sync_tokens, sync_reasons, _ = _serve(False, arrivals, aborts, config)
    tokens, reasons, _ = _serve(True, arrivals, aborts, config)
    served = [r for r in sync_tokens if "abort" not in (sync_reasons.get(r), reasons.get(r))]
    assert served
    for request_id in served:
        assert tokens[request_id] == sync_tokens[request_id], request_id
        assert reasons[request_id] == sync_reasons[request_id], request_id


def test_the_random_traffic_covers_preemption_aborts_refusals_stops_and_lengths():
    preempted, reasons = 0, []
    for seed in SEEDS:
        arrivals, aborts, config = _traffic(seed)
        _, seed_reasons, seed_preempted = _serve(True, arrivals, aborts, config)
        preempted += seed_preempted > 0
        reasons += [r.split(":")[0] for r in seed_reasons.values()]
    assert preempted >= 1
    assert {"abort", "refused", "stop", "length"} <= set(reasons)
