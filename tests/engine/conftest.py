"""Tiny checkpoints several engine test modules share (built once per module that asks)."""

from __future__ import annotations

import pytest

from tests.engine.checkpoints import BOS, EOS, VOCAB, build_checkpoint, save_byte_tokenizer


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE checkpoint (tests/model/harness.py's qwen3_moe) with the byte tokenizer."""
    directory = tmp_path_factory.mktemp("qwen3_moe")
    build_checkpoint(directory, "qwen3_moe")
    return str(directory)


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> str:
    """A tiny DeepseekV3ForCausalLM checkpoint (q LoRA, YaRN, tied groups) with the byte tokenizer."""
    from tests.model.test_deepseek_v3 import build_deepseek_checkpoint

    directory = tmp_path_factory.mktemp("deepseek_v3")
    build_deepseek_checkpoint(
        directory, "q_lora_yarn_tied_groups", vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS,
        pad_token_id=EOS,
    )  # fmt: skip
    save_byte_tokenizer(directory)
    return str(directory)
