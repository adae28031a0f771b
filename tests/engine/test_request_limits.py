"""What a client can put in SamplingParams never raises inside a step: out-of-range values fail in
SamplingParams or add_request, representable extremes run; a step that raises anyway is cleaned up
by abort_failed_step and the engine serves the next request."""

import math

import pytest

from tpfuse.config import EngineConfig
from tpfuse.engine.engine import LLMEngine
from tpfuse.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine():
    e = LLMEngine(EngineConfig(model="tiny", device="cpu", num_kv_blocks=64, max_model_len=64))
    yield e
    e.shutdown()


def _run(engine, request_id: str, params: SamplingParams) -> list[int]:
    engine.add_request(request_id, [5, 6, 7], params)
    tokens = []
    while engine.has_unfinished():
        for output in engine.step():
            tokens += output.new_token_ids
    return tokens


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=math.nan), dict(temperature=math.inf), dict(top_p=math.nan), dict(top_k=2**63),
     dict(stop_token_ids=[2**63]), dict(max_tokens=2**63), dict(min_tokens=-1), dict(temperature=101.0)],
)  # fmt: skip
def test_values_no_int64_or_float_can_hold_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_stop_token_id_outside_the_vocabulary_is_refused_at_admission(engine):
    vocab = engine.vocab_size
    with pytest.raises(ValueError, match=rf"stop_token_ids holds {vocab}, outside the vocabulary"):
        engine.add_request("oov", [1, 2], SamplingParams(stop_token_ids=[vocab], min_tokens=1))
    assert not engine.has_unfinished()


def test_representable_extremes_run(engine):
    vocab = engine.vocab_size
    huge_top_k = SamplingParams(temperature=1.0, top_k=2**63 - 1, seed=-(2**63), max_tokens=3)
    assert len(_run(engine, "top_k", huge_top_k)) == 3
    banned = SamplingParams(stop_token_ids=[vocab - 1], min_tokens=2, max_tokens=3, temperature=1e-30)
    assert len(_run(engine, "banned", banned)) == 3


def test_a_failed_step_is_aborted_and_the_engine_serves_on(engine, monkeypatch):
    engine.add_request("doomed", [1, 2, 3], SamplingParams(max_tokens=4))

    def broken(*args, **kwargs):
        raise RuntimeError("broken step")

    with monkeypatch.context() as patch:
        patch.setattr(engine.executor, "launch", broken)
        with pytest.raises(RuntimeError):
            engine.step()
    assert engine.abort_failed_step() == ["doomed"]
    assert not engine.has_unfinished()
    assert len(_run(engine, "after", SamplingParams(max_tokens=4, ignore_eos=True))) == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [(dict(stop_token_ids=[2.7]), r"stop_token_ids must be integer token ids, got 2\.7"),
     (dict(stop_token_ids=["a"]), r"stop_token_ids must be integer token ids, got 'a'"),
     (dict(logit_bias={2.5: 1.0}), r"logit_bias keys must be integer token ids, got 2\.5")],
)  # fmt: skip
def test_token_ids_that_are_not_integers_are_refused_not_truncated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_none_stop_lists_mean_none():
    params = SamplingParams(stop=None, stop_token_ids=None)
    assert params.stop == [] and params.stop_token_ids == []
    assert SamplingParams(logit_bias={"5": 1}).logit_bias == {5: 1.0}  # JSON keys stay accepted


def test_min_tokens_with_every_token_banned_is_refused_and_the_engine_serves_on(engine):
    """Stop ids plus the end-of-sequence ids covering the vocabulary leave nothing to emit before
    min_tokens: the engine used to emit token 0, a banned token."""
    vocab = engine.vocab_size
    every = SamplingParams(stop_token_ids=list(range(vocab)), min_tokens=2, max_tokens=3)
    with pytest.raises(ValueError, match=rf"cover all {vocab} tokens, so min_tokens 2 leaves no token"):
        engine.add_request("all-banned", [1, 2], every)
    assert not engine.has_unfinished()
    all_but_one = SamplingParams(
        stop_token_ids=list(range(1, vocab)), min_tokens=2, max_tokens=3, ignore_eos=True
    )
    assert _run(engine, "one-left", all_but_one)[:2] == [0, 0]


@pytest.mark.parametrize(
    "kwargs",
    [dict(top_k=True), dict(seed=True), dict(max_tokens=True), dict(temperature=True), dict(logprobs=True),
     dict(presence_penalty="1"), dict(frequency_penalty=None), dict(repetition_penalty="1.1"),
     dict(ignore_eos="false")],
)  # fmt: skip
def test_values_of_the_wrong_type_are_refused_naming_the_field(kwargs):
    """Booleans were taken as 1 and strings failed in a bare comparison; "false" read as true."""
    (name,) = kwargs
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)
