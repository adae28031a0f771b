"""Bad requests and settings fail early with a ValueError that names the value and the limit."""

import pytest

from tpfuse.config import EngineConfig
from tpfuse.engine.engine import LLMEngine
from tpfuse.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine():
    e = LLMEngine(EngineConfig(model="tiny", device="cpu", num_kv_blocks=64, max_model_len=64))
    yield e
    e.shutdown()


def test_empty_prompt_is_rejected(engine):
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("empty", [], SamplingParams())


def test_prompt_longer_than_max_model_len_is_rejected_naming_both(engine):
    with pytest.raises(ValueError, match=r"prompt has 80 tokens but max_model_len is 64"):
        engine.add_request("long", [1] * 80, SamplingParams())


def test_max_tokens_beyond_the_context_is_rejected_naming_the_room_left(engine):
    with pytest.raises(ValueError, match=r"max_tokens 60 .* 10 tokens exceeds max_model_len 64.*at most 54"):
        engine.add_request("greedy", [1] * 10, SamplingParams(max_tokens=60))


def test_token_id_outside_the_vocabulary_is_rejected(engine):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("oov", [1, 10**6], SamplingParams())


def test_duplicate_request_id_is_rejected(engine):
    engine.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=2))
    try:
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("dup", [1, 2, 3], SamplingParams())
    finally:
        engine.abort_request("dup")


def test_rejected_requests_leave_nothing_queued(engine):
    with pytest.raises(ValueError):
        engine.add_request("bad", [], SamplingParams())
    assert not engine.has_unfinished()


def test_abort_removes_a_running_request_and_frees_its_blocks(engine):
    engine.add_request("a", list(range(1, 40)), SamplingParams(max_tokens=8))
    engine.step()
    assert engine.block_manager.num_free_blocks < 64
    engine.abort_request("a")
    assert not engine.has_unfinished()
    assert engine.block_manager.num_free_blocks == 64
    assert engine.step() == []


def test_max_model_len_beyond_the_model_is_rejected():
    with pytest.raises(ValueError, match=r"--max-model-len 100000 must lie in \[2, 2048\]"):
        LLMEngine(EngineConfig(model="tiny", device="cpu", max_model_len=100000))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.5), "temperature must lie in"),
        (dict(top_p=0.0), "top_p must lie in"),
        (dict(top_k=0), "top_k must be -1"),
        (dict(max_tokens=0), "max_tokens must be >= 1"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens .* must not exceed max_tokens"),
        (dict(stop=[""]), "stop strings must be non-empty"),
        (dict(stop_token_ids=[-1]), "stop_token_ids must be non-negative"),
    ],
)
def test_invalid_sampling_params_are_rejected_with_the_field_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_single_stop_string_is_accepted_as_a_list():
    assert SamplingParams(stop="END").stop == ["END"]


@pytest.mark.parametrize(
    ("prompt", "message"),
    [([1.5, 2.0], r"prompt token ids must be integers, got 1\.5"),
     ([1, "2"], r"prompt token ids must be integers, got '2'"),
     ("hello", r"token ids, got a string; tokenize it first")],
)  # fmt: skip
def test_a_prompt_that_is_not_integer_token_ids_is_refused_and_the_engine_serves_on(engine, prompt, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("not-ints", prompt, SamplingParams(max_tokens=2))
    assert not engine.has_unfinished()
    engine.add_request("after", [1, 2, 3], SamplingParams(max_tokens=2))
    tokens = []
    while engine.has_unfinished():
        for output in engine.step():
            tokens += output.new_token_ids
    assert len(tokens) == 2


def test_integer_like_token_ids_are_taken_as_ints(engine):
    import numpy as np

    engine.add_request("np", np.array([1, 2, 3]), SamplingParams(max_tokens=1))
    assert engine.requests["np"].token_ids == [1, 2, 3]
    assert all(type(t) is int for t in engine.requests["np"].token_ids)
    engine.abort_request("np")


def test_sampling_params_of_another_type_are_refused(engine):
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        engine.add_request("dict", [1, 2], {"max_tokens": 2})
    assert not engine.has_unfinished()
