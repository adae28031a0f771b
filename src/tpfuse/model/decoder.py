"""DecoderForCausalLM: the body every decoder family shares (embedding, layers, final norm, lm_head).

A family subclasses it and says how to build layer i (`make_layer`); everything else (the forward
loop, logits, checkpoint names) is here. The residual stream crosses ranks only through
`comm.fused_add_rmsnorm_all_reduce` (or a feed-forward block's fused form of it), twice per layer:
after o_proj (applying post_attention_layernorm; the feed-forward block's forward_after_attention runs
it, model/blocks.py) and after the feed-forward block (applying the next layer's input_layernorm, or
the final norm after the last layer). The embedding's partial sum enters the same way, with a zero
residual, so a forward pass of N layers makes exactly 2N + 1 such calls. A norm writes its output in
the form the layer that reads it takes (model/input_forms.py: FP8 rows for FP8 W8A8 projections,
Half2X for the INT4 GEMV, where start-up timing chose that route), so the product converts nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from tpfuse.kernels import rope_cos_sin_cache
from tpfuse.model.attention import AttentionMetadata
from tpfuse.model.blocks import DecoderLayer
from tpfuse.model.config import ModelConfig
from tpfuse.model.input_forms import fused_norm
from tpfuse.model.layers import ParallelContext, ParallelLMHead, RMSNorm, ShardSlot, VocabParallelEmbedding

# Checkpoint tensors that may be present and carry nothing tpfuse needs.
IGNORABLE_TENSOR_SUFFIXES = ("rotary_emb.inv_freq",)


class DecoderForCausalLM(nn.Module):
    """forward(input_ids, positions, attn, kv_caches) -> (hidden after the final norm, aux | None);
    compute_logits(hidden) -> full-vocabulary float32 logits on every rank.

    aux_hidden_state_layers: layer ids whose inputs (the residual stream) forward also returns,
    concatenated along the last dim (EAGLE-3 features); empty by default. aux_final_hidden: aux also
    ends with the hidden state after the final norm (the MTP drafter's feature).
    """

    def __init__(self, config: ModelConfig, parallel: ParallelContext):
        super().__init__()
        self.config = config
        self.comm = parallel.comm
        self.eps = config.rms_norm_eps
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        self.aux_final_hidden = False
        dtype = config.dtype
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel, dtype)
        self.layers = nn.ModuleList(self.make_layer(config, parallel, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        tied = self.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel, dtype, tied_to=tied)
        cache = rope_cos_sin_cache(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def make_layer(self, config: ModelConfig, parallel: ParallelContext, index: int) -> DecoderLayer:
        """Layer index of the family; every family file overrides it."""
        raise NotImplementedError(f"{type(self).__name__} must define make_layer (one decoder layer)")

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, positions: [T] int64; kv_caches: per layer (k_cache, v_cache), each
        [num_blocks, block_size, num_kv_heads_local, head_dim], written at attn.slot_mapping.
        Returns hidden [T, H] after the final norm, and aux [T, n * H] or None (n: the
        aux_hidden_state_layers, plus one with aux_final_hidden).
        """
        comm, eps, layers = self.comm, self.eps, self.layers
        num_tokens = input_ids.shape[0]
        partial = self.embed_tokens(input_ids)
        form = layers[0].self_attn.input_form(num_tokens)
        h, residual = fused_norm(
            comm, partial, torch.zeros_like(partial), layers[0].input_layernorm.weight, eps, form
        )
        aux = []
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            if i in self.aux_hidden_state_layers:
                aux.append(residual)
            partial = layer.self_attn(positions, h, attn, kv_caches[i], self.cos_sin_cache)
            next_norm = self.norm if i == last else layers[i + 1].input_layernorm
            post_norm = layer.post_attention_layernorm
            form = None if i == last else layers[i + 1].self_attn.input_form(num_tokens)
            h, residual = layer.mlp.forward_after_attention(
                partial, residual, post_norm.weight, next_norm.weight, eps, comm, form
            )
        if self.aux_final_hidden:
            aux.append(h)
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
            slots.update(layer.checkpoint_slots(f"model.layers.{i}."))
        return slots

    def is_ignorable_tensor(self, name: str) -> bool:
        """Checkpoint tensors the loader may skip: rotary caches, and lm_head when tied."""
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return True
        return name.endswith(IGNORABLE_TENSOR_SUFFIXES)
