"""Builders shared by the spec tests: a tiny target config, random tpfuse models, their KV caches."""

import torch

from tpfuse.comm.communicator import SingleRankCommunicator
from tpfuse.model.config import ModelConfig
from tpfuse.model.layers import ParallelContext
from tpfuse.model.llama import LlamaForCausalLM


def tiny_target_config() -> ModelConfig:
    """8 layers (default EAGLE-3 capture layers 2, 4, 5), hidden 32, vocabulary 50, float32."""
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


def random_model(config: ModelConfig, seed: int, std: float = 0.3) -> LlamaForCausalLM:
    """A TP=1 model with norm weights 1 and normal(0, std) matrices: peaked logits, no argmax ties."""
    model = LlamaForCausalLM(config, ParallelContext(0, 1, SingleRankCommunicator()))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(
                torch.ones_like(p)
                if name.endswith("norm.weight")
                else torch.randn(p.shape, generator=gen) * std
            )
    return model.eval()


def model_kv_caches(model: LlamaForCausalLM, num_blocks: int, block_size: int):
    c, param = model.config, next(model.parameters())
    shape = (num_blocks, block_size, c.num_kv_heads, c.head_dim)
    kw = dict(device=param.device, dtype=param.dtype)
    return [(torch.zeros(shape, **kw), torch.zeros(shape, **kw)) for _ in range(c.num_layers)]


def sharded_copy(full_model: LlamaForCausalLM, parallel: ParallelContext) -> LlamaForCausalLM:
    """This rank's shard of a TP=1 model, through the model's own checkpoint slots."""
    full = {name: slot.destination() for name, slot in full_model.checkpoint_slots().items()}
    model = LlamaForCausalLM(full_model.config, parallel)
    with torch.no_grad():
        for name, slot in model.checkpoint_slots().items():
            slot.destination().copy_(full[name][slot.source_index()])
    return model.eval()
