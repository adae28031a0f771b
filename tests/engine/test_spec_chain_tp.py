"""Chained speculative steps at TP=2 (gloo on CPU): rank 0 launches the next EAGLE-3 window step as a
template before it reads the step in flight, every rank verifies that step itself and shifts the
template by its own result, and the tokens equal TP=1's (greedy: plain decoding's; simulated
acceptance, with rows finishing mid-chain: the synchronous engine's)."""

import pytest

from tpfuse.config import EngineConfig
from tpfuse.engine.llm import LLM

from .spec_helpers import ENGINE, PROMPTS, greedy, spec_config, write_eagle3_head
from .test_spec_chain import _count_chained

KW = {**ENGINE, "enable_prefix_caching": False}


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return write_eagle3_head(str(tmp_path_factory.mktemp("eagle3-tp")))


def _generate(tp_size: int, head: str, params, chain: bool = True, **spec) -> tuple[list, dict]:
    config = EngineConfig(
        **KW, tp_size=tp_size, disable_overlap_schedule=not chain,
        speculative=spec_config("eagle3", head, adaptive=False, **spec),
    )  # fmt: skip
    llm = LLM(config=config)
    try:
        counts = _count_chained(llm)
        return [o.token_ids for o in llm.generate(PROMPTS, params)], counts
    finally:
        llm.shutdown()


def test_chained_eagle3_steps_at_tp2_give_the_tp1_plain_greedy_tokens(head):
    expected = [o.token_ids for o in LLM(**KW).generate(PROMPTS, greedy(30))]
    tokens, counts = _generate(2, head, greedy(30))
    assert tokens == expected
    assert counts["chained"] >= counts["launched"] // 3, counts


def test_chained_steps_at_tp2_accept_and_leave_out_rows_as_tp1_synchronous_steps_do(head):
    """Simulated acceptance shifts rows by 0..k each step, and rows finish at different steps, so the
    workers' shifts (their own verify results, gathered by the rows rank 0 sends) are exercised."""
    params = [greedy(n, seed=11) for n in (19, 26, 33, 40)]
    expected, _ = _generate(1, head, params, chain=False, simulate_acceptance_length=3.0)
    tokens, counts = _generate(2, head, params, simulate_acceptance_length=3.0)
    assert tokens == expected
    assert counts["chained"] > 4 and counts["left_out_rows"] >= 1, counts
