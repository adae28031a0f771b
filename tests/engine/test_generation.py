"""End-to-end engine behaviour on the embedded tiny model: sampling, stopping, batching, caching."""

import gc
import weakref

import pytest

from tpfuse.engine.llm import LLM
from tpfuse.engine.sampling_params import SamplingParams

PROMPTS = ["The quick brown fox", "hi", "a somewhat longer prompt that spans several KV blocks", "xyz"]


def greedy(max_tokens=24, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm():
    engine = LLM("tiny", device="cpu", num_kv_blocks=512)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference_outputs(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, greedy())]


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=123, max_tokens=16, ignore_eos=True)
    first = llm.generate("once upon a time", params)[0].token_ids
    second = llm.generate("once upon a time", params)[0].token_ids
    assert first == second


def test_seeded_sampling_does_not_depend_on_the_rest_of_the_batch(llm):
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate("once upon a time", params)[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True), greedy(), params]
    batch = llm.generate(["other prompt", "and another one", "once upon a time"], others)
    assert batch[2].token_ids == alone


def test_different_seeds_give_different_samples(llm):
    a, b = (
        llm.generate("same", SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True))[0]
        for s in (1, 2)
    )
    assert a.token_ids != b.token_ids


def test_outputs_come_back_in_input_order(llm, reference_outputs):
    reversed_outputs = llm.generate(PROMPTS[::-1], greedy())
    assert [o.token_ids for o in reversed_outputs] == reference_outputs[::-1]
    assert [o.prompt_token_ids for o in reversed_outputs] == [llm.tokenizer.encode(p) for p in PROMPTS[::-1]]


def test_chunked_prefill_gives_the_same_greedy_tokens(reference_outputs):
    chunked = LLM("tiny", device="cpu", num_kv_blocks=512, max_num_batched_tokens=7)
    assert [o.token_ids for o in chunked.generate(PROMPTS, greedy())] == reference_outputs


def test_preemption_under_a_tiny_kv_budget_gives_the_same_greedy_tokens(reference_outputs):
    tight = LLM("tiny", device="cpu", num_kv_blocks=18, block_size=4)
    tight.engine.scheduler.growth_reserve = None  # admit what fits, so that this budget preempts
    outputs = tight.generate(PROMPTS, greedy(max_tokens=10))
    full = [r[:10] for r in reference_outputs]
    assert [o.token_ids for o in outputs] == full
    assert tight.engine.stats().num_preemptions > 0
    assert tight.engine.block_manager.num_free_blocks == 18


def test_repeated_prompt_is_served_from_the_prefix_cache_with_the_same_tokens(llm):
    prompt = "a prompt long enough to fill a few blocks of sixteen tokens each, twice over"
    first = llm.generate(prompt, greedy())[0]
    second = llm.generate(prompt, greedy())[0]
    assert second.num_cached_tokens >= 16 * ((len(first.prompt_token_ids) - 1) // 16)
    assert second.num_cached_tokens > 0
    assert second.token_ids == first.token_ids
    assert llm.engine.stats().prefix_cache_hit_rate > 0


def test_stop_string_cuts_the_text_before_it_with_reason_stop(llm):
    full = llm.generate("stop strings", greedy(max_tokens=32))[0]
    visible = full.text.replace("\ufffd", "")
    stop = visible[len(visible) // 2 :][:2]
    assert stop, "the model produced no visible text to stop on"
    out = llm.generate("stop strings", greedy(max_tokens=32, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text
    assert full.text.startswith(out.text)
    assert full.text[len(out.text) :].startswith(stop)


def test_stop_token_id_finishes_with_reason_stop_including_the_token(llm, reference_outputs):
    stop_id = reference_outputs[0][3]
    out = llm.generate(PROMPTS[0], greedy(stop_token_ids=[stop_id]))[0]
    first = reference_outputs[0].index(stop_id)
    assert out.token_ids == reference_outputs[0][: first + 1]
    assert out.finish_reason == "stop"


def test_min_tokens_keeps_stop_tokens_from_being_sampled_early(llm, reference_outputs):
    banned = reference_outputs[0][0]
    out = llm.generate(PROMPTS[0], greedy(stop_token_ids=[banned], min_tokens=4))[0]
    assert banned not in out.token_ids[:4]
    assert len(out.token_ids) >= 4


def test_max_tokens_finishes_with_reason_length(llm):
    out = llm.generate("count", greedy(max_tokens=5))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_stats_count_prompt_and_generated_tokens(llm):
    before = llm.engine.stats()
    outs = llm.generate(["abc", "defgh"], greedy(max_tokens=3))
    after = llm.engine.stats()
    assert after.num_prompt_tokens - before.num_prompt_tokens == sum(len(o.prompt_token_ids) for o in outs)
    assert after.num_generated_tokens - before.num_generated_tokens == 6
    assert after.num_running == after.num_waiting == 0 and after.kv_usage == 0.0


def test_shutdown_drops_the_weights_kv_cache_and_graphs_and_is_safe_twice():
    engine = LLM("tiny", device="cpu", num_kv_blocks=64)
    engine.generate("hi", greedy(4))
    runner = engine.engine.executor.runner
    kv_block, weight = weakref.ref(runner.kv_caches[0][0]), weakref.ref(runner.model.embed_tokens.weight)
    engine.shutdown()
    engine.shutdown()
    gc.collect()
    assert kv_block() is None and weight() is None  # nothing else kept them alive
    assert runner.graphs is None
