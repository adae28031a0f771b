"""Speculative decoding through the engine (LLM.generate / LLMEngine.step) on the tiny model: lossless
greedy for every drafter, batch 1 and mixed batches with a late arrival, adaptive on and off;
stopping rules inside accepted runs; seeded sampling; acceptance statistics; the simulate mode."""

import dataclasses

import pytest

from tpfuse.config import EngineConfig, SpeculativeConfig
from tpfuse.engine.engine import LLMEngine
from tpfuse.engine.llm import LLM
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.server.metrics import ServerMetrics

from .spec_helpers import (
    ENGINE,
    PROMPTS,
    greedy,
    run_with_late_arrival,
    spec_config,
    write_eagle3_head,
)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return write_eagle3_head(str(tmp_path_factory.mktemp("eagle3")))


@pytest.fixture(scope="module")
def plain():
    return LLMEngine(EngineConfig(**ENGINE))


@pytest.fixture(scope="module")
def plain_tokens(plain):
    return run_with_late_arrival(plain, greedy())


def drafter_config(name: str, head_dir: str, adaptive: bool):
    path = {"eagle3": head_dir, "draft": "tiny", "ngram": None}[name]
    return spec_config(name, path, adaptive=adaptive)


def spec_engine(name, head_dir, adaptive=True, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(**{**ENGINE, **kw}, speculative=drafter_config(name, head_dir, adaptive)))


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "fixed-k"])
@pytest.mark.parametrize("drafter", ["ngram", "draft", "eagle3"])
def test_speculative_greedy_equals_plain_greedy_in_mixed_batches_with_a_late_arrival(
    plain_tokens, head_dir, drafter, adaptive
):
    from tpfuse.spec.drafter import Drafter

    engine = spec_engine(drafter, head_dir, adaptive)
    device_drafter = engine.executor.hook.drafter  # n-gram drafts on rank 0's host instead
    assert device_drafter is None if drafter == "ngram" else isinstance(device_drafter, Drafter)
    assert run_with_late_arrival(engine, greedy()) == plain_tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("drafter", ["ngram", "draft", "eagle3"])
def test_speculative_greedy_equals_plain_greedy_at_batch_one(plain, head_dir, drafter):
    prompt = plain.tokenizer.encode(PROMPTS[2])
    expected = LLM(config=plain.config).generate(prompt, greedy(max_tokens=17))[0].token_ids
    llm = LLM(config=spec_engine(drafter, head_dir, adaptive=False).config)
    assert llm.generate(prompt, greedy(max_tokens=17))[0].token_ids == expected


def test_a_different_draft_model_is_lossless(tmp_path):
    from tests.engine.checkpoints import build_checkpoint

    target, draft = str(tmp_path / "target"), str(tmp_path / "draft")
    build_checkpoint(target, "llama", seed=0)
    build_checkpoint(draft, "qwen2", seed=1)
    kw = dict(device="cpu", num_kv_blocks=128, max_num_batched_tokens=16)
    prompts = [[5, 17, 33, 100, 2, 9, 81], [200], list(range(40, 70))]
    expected = [o.token_ids for o in LLM(target, **kw).generate(prompts, greedy(12))]
    llm = LLM(target, **kw, speculative=spec_config("draft", draft, adaptive=False))
    assert [o.token_ids for o in llm.generate(prompts, greedy(12))] == expected


def test_identical_draft_model_accepts_every_draft_and_stats_count_them(plain, head_dir):
    engine = spec_engine("draft", head_dir, adaptive=False)
    LLM(config=engine.config)  # a config with speculation builds
    llm = LLM(config=engine.config)
    llm.generate(PROMPTS, greedy(max_tokens=21))
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens == 3
    assert stats.spec_num_drafts_total > 0
    assert stats.spec_num_accepted_tokens_total == stats.spec_num_draft_tokens_total
    assert stats.spec_acceptance_rate_per_position == [1.0, 1.0, 1.0]
    expected_length = 1 + stats.spec_num_accepted_tokens_total / stats.spec_num_drafts_total
    assert stats.spec_acceptance_length == pytest.approx(expected_length)
    assert stats.spec_acceptance_length > 3.0
    assert stats.simulated_acceptance == 0
    assert stats.num_generated_tokens == 21 * len(PROMPTS)


def test_stop_token_inside_an_accepted_run_truncates_it(plain, head_dir):
    reference = LLM(config=plain.config).generate(PROMPTS[0], greedy(24))[0].token_ids
    stop = reference[6]
    out = LLM(config=spec_engine("draft", head_dir, adaptive=False).config).generate(
        PROMPTS[0], greedy(24, stop_token_ids=[stop])
    )[0]
    assert out.token_ids == reference[: reference.index(stop) + 1]
    assert out.finish_reason == "stop"


def test_max_tokens_between_verify_steps_is_met_exactly(head_dir):
    llm = LLM(config=spec_engine("draft", head_dir, adaptive=False).config)
    outs = llm.generate(PROMPTS, greedy(max_tokens=10))  # 1 + 4 + 4 + (1 of 4): the last run is cut
    assert [len(o.token_ids) for o in outs] == [10] * len(PROMPTS)
    assert all(o.finish_reason == "length" for o in outs)


def test_min_tokens_bans_stop_tokens_at_every_verified_position(plain, head_dir):
    reference = LLM(config=plain.config).generate(PROMPTS[0], greedy(24))[0].token_ids
    banned = reference[1]
    params = greedy(24, stop_token_ids=[banned], min_tokens=12)
    expected = LLM(config=plain.config).generate(PROMPTS[0], params)[0].token_ids
    out = LLM(config=spec_engine("draft", head_dir, adaptive=False).config).generate(PROMPTS[0], params)[0]
    assert banned not in out.token_ids[:12]
    assert out.token_ids == expected


def test_seeded_sampling_is_reproducible_and_batch_independent_with_adaptive_k(head_dir):
    llm = LLM(config=spec_engine("eagle3", head_dir, adaptive=True).config)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=42, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], seeded)[0].token_ids
    again = llm.generate(PROMPTS[0], seeded)[0].token_ids
    others = [greedy(), SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True), seeded]
    in_batch = llm.generate([PROMPTS[1], PROMPTS[3], PROMPTS[0]], others)[2].token_ids
    assert alone == again == in_batch


def test_rejection_sampling_with_the_target_as_draft_model_accepts_almost_every_draft(head_dir):
    llm = LLM(config=spec_engine("draft", head_dir, adaptive=False).config)
    unseeded = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)  # q == p: accept all
    llm.generate(PROMPTS, unseeded)
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens_total >= 0.95 * stats.spec_num_draft_tokens_total


def test_tree_drafting_with_a_non_eagle3_drafter_is_rejected_with_a_clear_error():
    config = spec_config("draft", "tiny", eagle_topk=2, num_draft_tokens=6)
    with pytest.raises(ValueError, match="tree drafting needs --speculative-algorithm eagle3"):
        LLMEngine(EngineConfig(**ENGINE, speculative=config))


def test_repeated_prompt_from_the_prefix_cache_and_preemption_keep_greedy_tokens(plain, head_dir):
    expected = [o.token_ids for o in LLM(config=plain.config).generate(PROMPTS, greedy(12))]
    llm = LLM(config=spec_engine("eagle3", head_dir, num_kv_blocks=24, block_size=4).config)
    llm.engine.scheduler.growth_reserve = None  # admit what fits, so that this budget preempts
    first = [o.token_ids for o in llm.generate(PROMPTS, greedy(12))]
    second = llm.generate(PROMPTS, greedy(12))
    assert first == [o.token_ids for o in second] == expected
    assert llm.engine.stats().num_preemptions > 0
    assert any(o.num_cached_tokens > 0 for o in second)


def test_simulated_acceptance_warns_and_reports_itself_in_stats(head_dir, capfd):
    config = spec_config("eagle3", head_dir, adaptive=False, simulate_acceptance_length=3.0)
    llm = LLM(config=EngineConfig(**ENGINE, speculative=config))
    assert "SIMULATED" in capfd.readouterr().err
    llm.generate(PROMPTS, greedy(max_tokens=64))
    stats = llm.engine.stats()
    assert stats.simulated_acceptance == 1
    assert 2.3 < stats.spec_acceptance_length < 3.7  # random head: without simulation it would be 1
    metrics = ServerMetrics(lambda: dataclasses.asdict(stats)).render().decode()
    assert "tpfuse_engine_simulated_acceptance 1.0" in metrics
    assert 'tpfuse_engine_spec_acceptance_rate_per_position{position="2"}' in metrics


def test_a_seeded_request_gets_the_same_tokens_when_its_last_prompt_chunk_is_one_token():
    """Under a small token budget, two decoding requests (1 + k tokens each) leave a 5-token prompt
    room for 4 tokens, so its last chunk is one token: a verify row, not a prefill. Its seeded
    tokens must still equal those it gets alone (prefilled at once)."""

    prompt = [128, 90, 49, 77, 30]
    seeded = SamplingParams(temperature=0.5, max_tokens=7, seed=65, ignore_eos=True)
    engine = LLMEngine(
        EngineConfig(
            model="tiny", device="cpu", num_kv_blocks=16, max_model_len=96, max_num_batched_tokens=8,
            speculative=SpeculativeConfig(algorithm="ngram", num_steps=1),
        )
    )  # fmt: skip

    def run(request_id):
        tokens = []
        while engine.has_unfinished():
            for output in engine.step():
                if output.request_id == request_id:
                    tokens += output.new_token_ids
        return tokens

    engine.add_request("alone", prompt, seeded)
    alone = run("alone")
    engine.add_request("g1", [3, 4, 5, 6] * 3, SamplingParams(temperature=0.0, max_tokens=20))
    engine.add_request("g2", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20))
    for _ in range(3):
        engine.step()
    engine.add_request("joined", prompt, seeded)
    assert run("joined") == alone
    engine.shutdown()
