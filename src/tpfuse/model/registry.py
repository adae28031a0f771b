"""The model registry: a checkpoint's `architectures` entry -> the class that builds it.

A new family is a new file plus one line here. Classes are named as "module:Class" and imported on
first use, so reading a config.json never imports model code (model/config.py checks names here).
"""

from __future__ import annotations

import importlib

MODEL_CLASSES: dict[str, str] = {
    "LlamaForCausalLM": "tpfuse.model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "tpfuse.model.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "tpfuse.model.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "tpfuse.model.llama:LlamaForCausalLM",
    "Qwen3MoeForCausalLM": "tpfuse.model.qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "tpfuse.model.mixtral:MixtralForCausalLM",
    "DeepseekV3ForCausalLM": "tpfuse.model.deepseek_v3:DeepseekV3ForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(MODEL_CLASSES)


def model_class(architecture: str) -> type:
    """The model class of a checkpoint architecture. Raises ValueError naming the supported ones."""
    if architecture not in MODEL_CLASSES:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module, name = MODEL_CLASSES[architecture].split(":")
    return getattr(importlib.import_module(module), name)
