"""Decoder families (Llama 3, Qwen2, Qwen3, Mistral, Qwen3-MoE, Mixtral) with tensor-parallel layers,
the model registry, loaders and presets."""

from tpfuse.model.attention import AttentionMetadata
from tpfuse.model.config import ModelConfig
from tpfuse.model.layers import ParallelContext
from tpfuse.model.llama import LlamaForCausalLM, default_eagle3_aux_layers
from tpfuse.model.loader import CheckpointError, load_model, load_model_config
from tpfuse.model.presets import PRESETS, preset_config
from tpfuse.model.registry import SUPPORTED_ARCHITECTURES, model_class
from tpfuse.model.tokenizer import load_tokenizer

__all__ = [
    "PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "AttentionMetadata",
    "CheckpointError",
    "LlamaForCausalLM",
    "ModelConfig",
    "ParallelContext",
    "default_eagle3_aux_layers",
    "load_model",
    "load_model_config",
    "load_tokenizer",
    "model_class",
    "preset_config",
]
