"""Llama-family decoder (Llama 3, Qwen2, Qwen3, Mistral) with tensor parallelism.

The residual stream crosses ranks only through `comm.fused_add_rmsnorm_all_reduce`, twice per layer:
after o_proj (applying post_attention_layernorm) and after down_proj (applying the next layer's
input_layernorm, or the final norm after the last layer). The embedding's partial sum enters the
same way, with a zero residual, so a forward pass of N layers makes exactly 2N + 1 such calls.
"""

from __future__ import annotations

import torch
from torch import nn

from tpfuse.kernels import rope_cos_sin_cache, silu_and_mul
from tpfuse.model.attention import Attention, AttentionMetadata
from tpfuse.model.config import ModelConfig
from tpfuse.model.layers import (
    ColumnParallelLinear,
    ParallelContext,
    ParallelLMHead,
    RMSNorm,
    RowParallelLinear,
    ShardSlot,
    VocabParallelEmbedding,
)

# Checkpoint tensors that may be present and carry nothing tpfuse needs.
IGNORABLE_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


def default_eagle3_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The layers whose inputs EAGLE-3 heads read by default: (2, N // 2, N - 3)."""
    return (2, num_layers // 2, num_layers - 3)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelContext):
        super().__init__()
        i = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [i, i], parallel, config.dtype)
        self.down_proj = RowParallelLinear(i, config.hidden_size, parallel, config.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H], this rank's partial sum."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, parallel: ParallelContext):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.self_attn = Attention(config, parallel)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype)
        self.mlp = MLP(config, parallel)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids, positions, attn, kv_caches) -> (hidden after the final norm, aux | None);
    compute_logits(hidden) -> full-vocabulary float32 logits on every rank.

    aux_hidden_state_layers: layer ids whose inputs (the residual stream) forward also returns,
    concatenated along the last dim (EAGLE-3 features); empty by default.
    """

    def __init__(self, config: ModelConfig, parallel: ParallelContext):
        super().__init__()
        self.config = config
        self.comm = parallel.comm
        self.eps = config.rms_norm_eps
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        dtype = config.dtype
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel, dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, parallel) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        tied = self.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel, dtype, tied_to=tied)
        cache = rope_cos_sin_cache(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, positions: [T] int64; kv_caches: per layer (k_cache, v_cache), each
        [num_blocks, block_size, num_kv_heads_local, head_dim], written at attn.slot_mapping.
        Returns hidden [T, H] after the final norm, and aux [T, len(aux_hidden_state_layers) * H] or None.
        """
        comm, eps, layers = self.comm, self.eps, self.layers
        partial = self.embed_tokens(input_ids)
        h, residual = comm.fused_add_rmsnorm_all_reduce(
            partial, torch.zeros_like(partial), layers[0].input_layernorm.weight, eps
        )
        aux = []
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            if i in self.aux_hidden_state_layers:
                aux.append(residual)
            partial = layer.self_attn(positions, h, attn, kv_caches[i], self.cos_sin_cache)
            h, residual = comm.fused_add_rmsnorm_all_reduce(
                partial, residual, layer.post_attention_layernorm.weight, eps
            )
            partial = layer.mlp(h)
            next_norm = self.norm if i == last else layers[i + 1].input_layernorm
            h, residual = comm.fused_add_rmsnorm_all_reduce(partial, residual, next_norm.weight, eps)
        return h, (torch.cat(aux, dim=-1) if aux else None)

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [N, H] -> [N, vocab_size] float32, the full vocabulary on every rank (written into
        out when given)."""
        return self.lm_head(hidden, out)

    def checkpoint_slots(self) -> dict[str, ShardSlot]:
        """Hugging Face tensor name -> where this rank's part of it goes. A tied lm_head has no slot."""
        slots = {"model.embed_tokens.weight": self.embed_tokens.slot(), "model.norm.weight": self.norm.slot()}
        if not self.config.tie_word_embeddings:
            slots["lm_head.weight"] = self.lm_head.slot()
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            slots[p + "input_layernorm.weight"] = layer.input_layernorm.slot()
            slots[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.slot()
            for part, name in enumerate(("q_proj", "k_proj", "v_proj")):
                slots[f"{p}self_attn.{name}.weight"] = attn.qkv_proj.slot(part)
                if attn.qkv_proj.bias is not None:
                    slots[f"{p}self_attn.{name}.bias"] = attn.qkv_proj.slot(part, bias=True)
            slots[p + "self_attn.o_proj.weight"] = attn.o_proj.slot()
            if attn.q_norm is not None:
                slots[p + "self_attn.q_norm.weight"] = attn.q_norm.slot()
                slots[p + "self_attn.k_norm.weight"] = attn.k_norm.slot()
            slots[p + "mlp.gate_proj.weight"] = mlp.gate_up_proj.slot(0)
            slots[p + "mlp.up_proj.weight"] = mlp.gate_up_proj.slot(1)
            slots[p + "mlp.down_proj.weight"] = mlp.down_proj.slot()
        return slots

    def is_ignorable_tensor(self, name: str) -> bool:
        """Checkpoint tensors the loader may skip: rotary caches, and lm_head when tied."""
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return True
        return name.endswith(IGNORABLE_TENSOR_SUFFIXES)
