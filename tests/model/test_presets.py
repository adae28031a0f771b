"""Presets carry the real models' shapes: parameter counts equal the published ones, without allocating."""

from __future__ import annotations

import pytest
import torch

from tpfuse.comm.communicator import SingleRankCommunicator
from tpfuse.model.layers import ParallelContext
from tpfuse.model.presets import PRESETS, TINY_VOCAB_SIZE, preset_config
from tpfuse.model.registry import model_class
from tpfuse.model.tokenizer import ByteTokenizer

# Parameter counts as published on each model's card / safetensors metadata.
PUBLISHED_PARAMETER_COUNTS = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.1-70b": 70_553_706_496,
    "qwen2.5-7b": 7_615_616_512,
    "qwen3-8b": 8_190_735_360,
    "qwen3-32b": 32_762_123_264,
    "mistral-7b": 7_248_023_552,
    "qwen3-30b-a3b": 30_532_122_624,
    "qwen3-235b-a22b": 235_093_634_560,
    "mixtral-8x7b": 46_702_792_704,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETER_COUNTS))
def test_preset_parameter_count_equals_the_published_count(name):
    assert preset_config(name).num_parameters() == PUBLISHED_PARAMETER_COUNTS[name]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_model_built_on_meta_device_has_the_configured_parameter_count(name):
    config = preset_config(name)
    with torch.device("meta"):
        model = model_class(config.architecture)(config, ParallelContext(0, 1, SingleRankCommunicator()))
    assert sum(p.numel() for p in model.parameters()) == config.num_parameters()


def test_real_model_presets_run_in_bfloat16_and_tiny_in_float32():
    assert all(preset_config(n).dtype == torch.bfloat16 for n in PUBLISHED_PARAMETER_COUNTS)
    assert preset_config("tiny").dtype == torch.float32


def test_dtype_flag_overrides_the_preset_dtype():
    assert preset_config("llama-3.1-8b", dtype="float16").dtype == torch.float16


def test_llama_3_2_1b_ties_embeddings_and_scales_rope_by_32():
    config = preset_config("llama-3.2-1b")
    assert config.tie_word_embeddings
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 32.0


def test_tiny_preset_vocabulary_and_specials_match_the_byte_tokenizer():
    config, tokenizer = preset_config("tiny"), ByteTokenizer()
    assert config.vocab_size == TINY_VOCAB_SIZE == tokenizer.vocab_size
    assert set(config.eos_token_ids) == tokenizer.eos_token_ids
    assert config.bos_token_id == tokenizer.bos_token_id


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ValueError, match=r"unknown model preset 'llama-9'.*tiny, llama-3\.2-1b"):
        preset_config("llama-9")
