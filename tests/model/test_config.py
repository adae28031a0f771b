"""ModelConfig from Hugging Face config.json dicts (transformers 4.x and 5.x layouts)."""

from __future__ import annotations

import re

import pytest
import torch

from tpfuse.model.config import ModelConfig

BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
)
LLAMA3_SCALING = dict(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)


def test_llama3_rope_scaling_reads_the_same_from_4x_and_5x_layouts():
    old = dict(
        BASE,
        architectures=["LlamaForCausalLM"],
        rope_theta=500000.0,
        rope_scaling=dict(LLAMA3_SCALING, rope_type="llama3"),
    )
    new = dict(
        BASE,
        architectures=["LlamaForCausalLM"],
        rope_parameters=dict(LLAMA3_SCALING, rope_type="llama3", rope_theta=500000.0),
    )
    a, b = ModelConfig.from_hf_dict(old), ModelConfig.from_hf_dict(new)
    assert a.rope_theta == b.rope_theta == 500000.0
    assert a.rope_scaling == b.rope_scaling == dict(LLAMA3_SCALING, rope_type="llama3")


def test_default_rope_type_means_no_scaling():
    hf = dict(BASE, model_type="qwen3", rope_parameters=dict(rope_type="default", rope_theta=1e6))
    assert ModelConfig.from_hf_dict(hf).rope_scaling is None


def test_qwen2_projects_qkv_with_bias():
    assert ModelConfig.from_hf_dict(dict(BASE, architectures=["Qwen2ForCausalLM"])).attention_bias


def test_qwen3_uses_qk_norm_and_its_explicit_head_dim():
    config = ModelConfig.from_hf_dict(dict(BASE, architectures=["Qwen3ForCausalLM"], head_dim=32))
    assert config.qk_norm and config.head_dim == 32 and config.q_size == 128


def test_head_dim_defaults_to_hidden_over_heads():
    assert ModelConfig.from_hf_dict(dict(BASE, architectures=["MistralForCausalLM"])).head_dim == 16


def test_architecture_falls_back_to_model_type():
    assert ModelConfig.from_hf_dict(dict(BASE, model_type="qwen2")).architecture == "Qwen2ForCausalLM"


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(ValueError, match=r"FalconForCausalLM is not supported; supported: LlamaForCausalLM"):
        ModelConfig.from_hf_dict(dict(BASE, architectures=["FalconForCausalLM"]))


def test_eos_ids_join_config_and_generation_config():
    hf = dict(BASE, architectures=["LlamaForCausalLM"], eos_token_id=128001, vocab_size=128256)
    config = ModelConfig.from_hf_dict(hf, generation_config={"eos_token_id": [128001, 128009]})
    assert config.eos_token_ids == (128001, 128009)


@pytest.mark.parametrize(
    ("key", "stored", "flag", "expected"),
    [
        ("torch_dtype", "bfloat16", "auto", torch.bfloat16),
        ("dtype", "float16", "auto", torch.float16),
        ("dtype", "bfloat16", "float32", torch.float32),
        (None, None, "auto", torch.float32),
    ],
)
def test_run_dtype_is_the_flag_else_the_checkpoint_dtype_else_float32(key, stored, flag, expected):
    hf = dict(BASE, architectures=["LlamaForCausalLM"], **({key: stored} if key else {}))
    assert ModelConfig.from_hf_dict(hf, dtype=flag).dtype == expected


def test_unsupported_checkpoint_dtype_names_it_and_the_flag():
    hf = dict(BASE, architectures=["LlamaForCausalLM"], torch_dtype="int8")
    with pytest.raises(ValueError, match=r"dtype 'int8'.*--dtype bfloat16, float16 or float32"):
        ModelConfig.from_hf_dict(hf)


def test_mistral_sliding_window_caps_the_context_to_the_window():
    hf = dict(BASE, architectures=["MistralForCausalLM"], sliding_window=4096, max_position_embeddings=32768)
    assert ModelConfig.from_hf_dict(hf).max_position_embeddings == 4096


def test_unused_qwen_sliding_window_leaves_the_context_alone():
    hf = dict(
        BASE, model_type="qwen2", sliding_window=4096, use_sliding_window=False, max_position_embeddings=32768
    )
    assert ModelConfig.from_hf_dict(hf).max_position_embeddings == 32768


def test_heads_not_a_multiple_of_kv_heads_is_rejected():
    with pytest.raises(
        ValueError, match=r"num_attention_heads \(4\) must be a multiple of num_key_value_heads"
    ):
        ModelConfig.from_hf_dict(dict(BASE, architectures=["LlamaForCausalLM"], num_key_value_heads=3))


@pytest.mark.parametrize("flag", ["attention_bias", "mlp_bias"])
def test_llama_biases_beyond_qwen2_qkv_are_rejected_by_name(flag):
    with pytest.raises(ValueError, match=rf"sets {flag}: true, which tpfuse does not implement"):
        ModelConfig.from_hf_dict(dict(BASE, architectures=["LlamaForCausalLM"], **{flag: True}))


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"rope_theta": 0}, "rope_theta"),
        ({"rope_theta": -10000.0}, "rope_theta"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"rms_norm_eps": "abc"}, "rms_norm_eps"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
         "rope_scaling.factor"),
        ({"num_attention_heads": 0}, "num_attention_heads"),
        ({"hidden_size": "64"}, "hidden_size"),
        ({"intermediate_size": -1}, "intermediate_size"),
        ({"max_position_embeddings": 1}, "max_position_embeddings"),
        ({"eos_token_id": -1}, "eos_token_id -1"),
        ({"eos_token_id": 1_000_000}, "eos_token_id 1000000"),
    ],
)  # fmt: skip
def test_config_values_that_would_give_garbage_or_a_crash_are_refused_naming_the_field(fields, named):
    """Each of these loaded before and produced the same token for ever (or a ZeroDivisionError)."""
    with pytest.raises(ValueError, match=re.escape(named)):
        ModelConfig.from_hf_dict(dict(BASE, architectures=["LlamaForCausalLM"], **fields))
