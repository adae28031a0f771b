"""Named model shapes for random-weight runs: the embedded `tiny` model and real models' config.json values.

A preset always loads with dummy weights; its shapes (and so its memory traffic and timings) are
those of the real model. Values are copied from each model's public config.json and
generation_config.json.
"""

from __future__ import annotations

from tpfuse.model.config import ModelConfig

# The byte tokenizer's layout (model/tokenizer.py): 256 byte ids, then these specials in order.
BYTE_SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
TINY_VOCAB_SIZE = 256 + len(BYTE_SPECIAL_TOKENS)

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": _LLAMA3_ROPE,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
}
_QWEN = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": [151645, 151643],
}
_QWEN3 = {  # what the Qwen3 dense and MoE configs share
    **_QWEN,
    "architectures": ["Qwen3ForCausalLM"],
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
}
_QWEN3_MOE = {
    **_QWEN3,
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_key_value_heads": 4,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}

_MISTRAL_7B = {  # what mistral-7b and mixtral-8x7b (its 8-expert MoE) share
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 32768,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

_DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3 config.json (its weights are FP8 128x128 blocks; presets run bf16)
    "architectures": ["DeepseekV3ForCausalLM"],
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 1,
    "vocab_size": 129280,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},  # fmt: skip
    "max_position_embeddings": 163840,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}
_KIMI_K2 = {  # moonshotai/Kimi-K2-Instruct config.json (INT4 experts in K2-Thinking; presets run bf16)
    **_DEEPSEEK_V3,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 0,
    "vocab_size": 163840,
    "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},  # fmt: skip
    "max_position_embeddings": 131072,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
}

PRESETS: dict[str, dict] = {
    "tiny": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": TINY_VOCAB_SIZE,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 256 + BYTE_SPECIAL_TOKENS.index("<|bos|>"),
        "eos_token_id": [
            256 + BYTE_SPECIAL_TOKENS.index("<|eos|>"),
            256 + BYTE_SPECIAL_TOKENS.index("<|end|>"),
        ],
    },
    "llama-3.2-1b": {
        **_LLAMA3,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "head_dim": 64,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
        "tie_word_embeddings": True,
    },
    "llama-3.1-8b": {
        **_LLAMA3,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
    },
    "llama-3.1-70b": {
        **_LLAMA3,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
    },
    "qwen2.5-7b": {
        **_QWEN,
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "sliding_window": 131072,
        "use_sliding_window": False,
    },
    "qwen3-8b": {
        **_QWEN3,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
    },
    "qwen3-32b": {
        **_QWEN3,
        "hidden_size": 5120,
        "intermediate_size": 25600,
        "num_hidden_layers": 64,
        "num_attention_heads": 64,
    },
    "mistral-7b": {
        **_MISTRAL_7B,
        "architectures": ["MistralForCausalLM"],
        "head_dim": 128,
        "vocab_size": 32768,
    },
    "qwen3-30b-a3b": {
        **_QWEN3_MOE,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
    },
    "qwen3-235b-a22b": {
        **_QWEN3_MOE,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "moe_intermediate_size": 1536,
        "num_hidden_layers": 94,
        "num_attention_heads": 64,
    },
    "mixtral-8x7b": {
        **_MISTRAL_7B,
        "architectures": ["MixtralForCausalLM"],
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
    },
    "deepseek-v3": _DEEPSEEK_V3,
    # Reduced depth for one H200 (bf16 ~72 GB of weights): one dense layer, three MoE layers.
    "deepseek-v3-4l": {**_DEEPSEEK_V3, "num_hidden_layers": 4, "first_k_dense_replace": 1},
    "kimi-k2": _KIMI_K2,
    # Reduced depth for one H200 (bf16 ~72 GB of weights): one dense layer, two MoE layers.
    "kimi-k2-3l": {**_KIMI_K2, "num_hidden_layers": 3},
}


def is_preset(name: str) -> bool:
    return name in PRESETS


def preset_config(name: str, dtype: str = "auto") -> ModelConfig:
    """ModelConfig of a named preset; dtype is the engine's --dtype. Raises ValueError listing the presets."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    return ModelConfig.from_hf_dict(PRESETS[name], dtype=dtype, source=f"preset {name!r}")
