"""Mixtral (MixtralForCausalLM): Mistral attention and a sparse MoE block in every layer, named
"block_sparse_moe" (router "gate", experts "experts.{e}.w1" gate, "w3" up, "w2" down); the top-k
router probabilities are always renormalised."""

from __future__ import annotations

from tpfuse.model.blocks import DecoderLayer
from tpfuse.model.config import ModelConfig
from tpfuse.model.decoder import DecoderForCausalLM
from tpfuse.model.layers import ParallelContext
from tpfuse.model.moe import ExpertNames, SparseMoeBlock

MIXTRAL_EXPERT_NAMES = ExpertNames(gate="w1", up="w3", down="w2")


class MixtralForCausalLM(DecoderForCausalLM):
    def make_layer(self, config: ModelConfig, parallel: ParallelContext, index: int) -> DecoderLayer:
        def make_ffn():
            return SparseMoeBlock(
                config.hidden_size, config.num_experts, config.num_experts_per_tok,
                config.moe_intermediate_size, True, parallel, config.dtype, MIXTRAL_EXPERT_NAMES,
            )  # fmt: skip

        return DecoderLayer(config, parallel, make_ffn, ffn_name="block_sparse_moe")
