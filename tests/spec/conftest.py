import pytest
import torch

from tpfuse.model.config import ModelConfig


@pytest.fixture
def target_config() -> ModelConfig:
    """A tiny Llama target: 8 layers (default EAGLE-3 capture layers 2, 4, 5), vocabulary 50."""
    return ModelConfig(
        architecture="LlamaForCausalLM",
        hidden_size=32,
        num_layers=8,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=50,
        max_position_embeddings=128,
        dtype=torch.float32,
    )
