"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3 attention (q/k norms), sparse MoE blocks named "mlp"
(router "mlp.gate", experts "mlp.experts.{e}.{gate,up,down}_proj"), and dense MLPs of
intermediate_size in the layers mlp_only_layers and decoder_sparse_step leave dense."""

from __future__ import annotations

from tpfuse.model.blocks import DecoderLayer, GatedMLP
from tpfuse.model.config import ModelConfig
from tpfuse.model.decoder import DecoderForCausalLM
from tpfuse.model.layers import ParallelContext
from tpfuse.model.moe import SparseMoeBlock


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    def make_layer(self, config: ModelConfig, parallel: ParallelContext, index: int) -> DecoderLayer:
        h, dtype = config.hidden_size, config.dtype

        def make_ffn():
            if not config.is_moe_layer(index):
                return GatedMLP(h, config.intermediate_size, parallel, dtype)
            return SparseMoeBlock(
                h, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                config.norm_topk_prob, parallel, dtype,
            )  # fmt: skip

        return DecoderLayer(config, parallel, make_ffn)
