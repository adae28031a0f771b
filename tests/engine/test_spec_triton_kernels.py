"""Speculative decoding on the Triton kernels (interpreted on CPU): the verify pass runs the packed,
key-split prefill attention and the drafter its own kernels, and greedy output still equals plain
greedy decoding on the torch references token for token."""

from tpfuse import knobs
from tpfuse.config import EngineConfig
from tpfuse.engine.llm import LLM

from .spec_helpers import ENGINE, PROMPTS, greedy, spec_config, write_eagle3_head


def test_eagle3_greedy_on_triton_kernels_equals_plain_greedy_on_references(tmp_path, monkeypatch):
    monkeypatch.setenv("TPFUSE_KERNELS", "torch")
    knobs.reload()
    expected = [o.token_ids for o in LLM(**ENGINE).generate(PROMPTS, greedy(12))]
    monkeypatch.setenv("TPFUSE_KERNELS", "triton")
    knobs.reload()
    path = write_eagle3_head(str(tmp_path))
    llm = LLM(config=EngineConfig(**ENGINE, speculative=spec_config("eagle3", path, adaptive=False)))
    assert [o.token_ids for o in llm.generate(PROMPTS, greedy(12))] == expected
    assert llm.engine.spec_decoder.stats.num_drafts > 0  # the verify path really ran
