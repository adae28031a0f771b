"""Speculative decoding at TP=2 and 4 (one process per rank, gloo on CPU): every drafter emits the TP=1
plain greedy tokens in a mixed batch with a late arrival; drafts and accepted tokens reach the workers
in the next packed step, so the ranks never diverge."""

import pytest

from tpfuse.config import EngineConfig
from tpfuse.engine.engine import LLMEngine

from .spec_helpers import ENGINE, greedy, run_with_late_arrival, spec_config, write_eagle3_head


@pytest.fixture(scope="module")
def plain_tokens():
    return run_with_late_arrival(LLMEngine(EngineConfig(**ENGINE)), greedy(14))


@pytest.mark.parametrize("drafter", ["ngram", "draft", "eagle3"])
def test_speculative_greedy_at_tp2_equals_plain_greedy_at_tp1(plain_tokens, tmp_path, drafter):
    path = {"eagle3": write_eagle3_head(str(tmp_path)), "draft": "tiny", "ngram": None}[drafter]
    engine = LLMEngine(EngineConfig(**ENGINE, tp_size=2, speculative=spec_config(drafter, path)))
    try:
        assert run_with_late_arrival(engine, greedy(14)) == plain_tokens
        assert engine.stats().spec_num_drafts_total > 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("drafter", ["ngram", "eagle3"])
def test_speculative_greedy_at_tp4_with_chained_steps_equals_plain_greedy_at_tp1(
    plain_tokens, tmp_path, drafter
):
    path = write_eagle3_head(str(tmp_path)) if drafter == "eagle3" else None
    engine = LLMEngine(EngineConfig(**ENGINE, tp_size=4, speculative=spec_config(drafter, path)))
    decoder, chained = engine.spec_decoder, [0]
    launch = decoder.launch

    def counting(batch, *args, previous=None, **kwargs):
        chained[0] += previous is not None
        return launch(batch, *args, previous=previous, **kwargs)

    decoder.launch = counting
    try:
        assert run_with_late_arrival(engine, greedy(14)) == plain_tokens
        assert engine.stats().spec_num_drafts_total > 0
        if drafter == "eagle3":  # EAGLE-3 chain drafting launches steps ahead of the one in flight
            assert chained[0] > 0
    finally:
        engine.shutdown()
