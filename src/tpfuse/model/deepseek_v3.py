"""DeepSeek-V3 (DeepseekV3ForCausalLM, also what Kimi-K2 checkpoints declare): multi-head latent
attention (model/mla.py) and, after the first first_k_dense_replace dense layers, a MoE of routed
experts under group-limited sigmoid routing plus always-on shared experts.

Tensor parallelism: attention heads split over ranks, the latent cache replicated on every rank
(LatentCacheLayout); every rank holds every routed expert's slice of the intermediate dim
(FusedMoE) and a slice of the shared experts; the shared output is one more slot of each token in
the MoE finalize (routed combine + shared + all-reduce + residual + RMSNorm in the layer's last
sync). Every layer is built under its checkpoint prefix (module_prefix("model.layers.{i}.")), so a
format's per-module choices apply: Kimi K2's INT4 routed experts beside its bf16 attention, shared
experts and dense MLPs. Checkpoint tensors of the MTP (NextN) layers,
model.layers.{num_hidden_layers + i}.*, are skipped here; model/deepseek_v3_mtp.py loads the first
one as the MTP drafter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpfuse.kernels import grouped_route, grouped_topk_op, moe_finalize_op
from tpfuse.kernels.moe_router import RouteTile
from tpfuse.model import moe_choice
from tpfuse.model.blocks import FeedForwardBlock, GatedMLP
from tpfuse.model.config import ModelConfig
from tpfuse.model.decoder import DecoderForCausalLM
from tpfuse.model.input_forms import fused_norm
from tpfuse.model.kv_layout import LatentCacheLayout
from tpfuse.model.layers import ParallelContext, RMSNorm, ShardSlot
from tpfuse.model.linear_method import expert_method_for, module_prefix
from tpfuse.model.mla import MLAAttention
from tpfuse.model.moe import ExpertNames, FusedMoE, UnquantizedExperts


def _replicated(param: nn.Parameter) -> ShardSlot:
    return ShardSlot(param, tuple(param.shape), 0, 0, param.shape[0])


class DeepseekV3MoE(FeedForwardBlock):
    """Router "gate" (float32 [E, H] weight and e_score_correction_bias, replicated) -> grouped top-k ->
    FusedMoE "experts", plus GatedMLP "shared_experts"; the feed-forward block contract of
    model/blocks.py."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext):
        super().__init__()
        routing = config.grouped_routing
        h, e = config.hidden_size, config.num_experts
        self.routing = routing
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate_weight = nn.Parameter(torch.empty(e, h, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(e, dtype=torch.float32), requires_grad=False)
        names = ExpertNames()
        method = expert_method_for([f"experts.0.{n}" for n in (names.gate, names.up, names.down)])
        self.experts = FusedMoE(
            e, h, config.moe_intermediate_size, parallel, config.dtype, names, method or UnquantizedExperts()
        )
        self.shared_experts = None
        if routing.n_shared_experts:
            shared = config.moe_intermediate_size * routing.n_shared_experts
            with module_prefix("shared_experts."):
                self.shared_experts = GatedMLP(h, shared, parallel, config.dtype)

    @property
    def router_weight(self) -> torch.Tensor:
        return self.gate_weight

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_weights [T, k] float32, topk_ids [T, k] int32), logits in float32, through
        the route model/moe_choice.py measured fastest for T (route_tile)."""
        return self.route_with(x, moe_choice.route_tile(x, self.gate_weight))

    def route_with(self, x: torch.Tensor, tile: RouteTile | None) -> tuple[torch.Tensor, torch.Tensor]:
        """route with the float32 router product and the grouped top-k in one launch of shape tile
        (kernels/moe_grouped_router.py), or with None the router linear then the grouped top-k."""
        r = self.routing
        routing = (self.e_score_correction_bias, self.top_k, r.n_group, r.topk_group, self.norm_topk_prob,
                   r.routed_scaling_factor)  # fmt: skip
        if tile is not None:
            return grouped_route(x, self.gate_weight, *routing, tile)
        return grouped_topk_op(F.linear(x.float(), self.gate_weight), *routing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] (normed) -> [T, H], this rank's partial sum of routed + shared experts."""
        topk_weights, topk_ids = self.route(x)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def forward_add_rmsnorm(self, x, residual, weight, eps, comm, form=None):
        """As SparseMoeBlock's: the combine ends in the layer's last sync (MoE finalize), with the shared
        experts' output as one more slot of each token, so routed and shared outputs are summed in
        float32 and rounded once, then all-reduced with the residual add and the next norm (at TP = 1
        the finalize reads the shared output where it lies; across ranks it joins the slots)."""
        topk_weights, topk_ids = self.route(x)
        slots_per_token = self.top_k + (self.shared_experts is not None)
        fused = comm.world_size > 1 or moe_choice.fuse_finalize(x, x.shape[0] * slots_per_token)
        if not fused:
            return fused_norm(comm, self(x), residual, weight, eps, form)
        slots = self.experts.slot_outputs(x, topk_weights, topk_ids)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if comm.world_size == 1:
            return moe_finalize_op(slots, self.top_k, residual, weight, eps, shared)
        if shared is not None:
            num_tokens, hidden = x.shape
            routed = slots.view(num_tokens, self.top_k, hidden)
            slots = torch.cat([routed, shared.view(num_tokens, 1, hidden)], dim=1).view(-1, hidden)
        return comm.moe_finalize_all_reduce(slots, slots_per_token, residual, weight, eps)

    def checkpoint_slots(self, prefix: str) -> dict[str, ShardSlot]:
        slots = {
            prefix + "gate.weight": _replicated(self.gate_weight),
            prefix + "gate.e_score_correction_bias": _replicated(self.e_score_correction_bias),
        }
        slots.update(self.experts.checkpoint_slots(prefix + "experts."))
        if self.shared_experts is not None:
            slots.update(self.shared_experts.checkpoint_slots(prefix + "shared_experts."))
        return slots


class DeepseekV3DecoderLayer(nn.Module):
    """input norm -> MLA -> post-attention norm -> dense GatedMLP or DeepseekV3MoE ("mlp"); the norms
    run in the decoder loop, fused with the all-reduces. Checkpoint prefix: model.layers.{index}."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext, index: int):
        super().__init__()
        h, eps, dtype = config.hidden_size, config.rms_norm_eps, config.dtype
        mla = config.mla
        self.input_layernorm = RMSNorm(h, eps, dtype)
        with module_prefix(f"model.layers.{index}.self_attn."):
            self.self_attn = MLAAttention(
                h, config.num_heads, mla, eps, mla.softmax_scale(config.rope_scaling), parallel, dtype
            )
        self.post_attention_layernorm = RMSNorm(h, eps, dtype)
        with module_prefix(f"model.layers.{index}.mlp."):
            if config.is_moe_layer(index):
                self.mlp = DeepseekV3MoE(config, parallel)
            else:
                self.mlp = GatedMLP(h, config.intermediate_size, parallel, dtype)

    def checkpoint_slots(self, prefix: str) -> dict[str, ShardSlot]:
        slots = {
            prefix + "input_layernorm.weight": self.input_layernorm.slot(),
            prefix + "post_attention_layernorm.weight": self.post_attention_layernorm.slot(),
        }
        slots.update(self.self_attn.checkpoint_slots(prefix + "self_attn."))
        slots.update(self.mlp.checkpoint_slots(prefix + "mlp."))
        return slots


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    """The shared decoder body (model/decoder.py) with DeepSeek-V3 layers; its rotary cache covers
    qk_rope_head_dim (config.head_dim) with the checkpoint's YaRN scaling."""

    def __init__(self, config: ModelConfig, parallel: ParallelContext):
        if config.mla is None or config.grouped_routing is None:
            raise ValueError("DeepseekV3ForCausalLM needs a config with MLA and grouped-routing fields")
        super().__init__(config, parallel)

    def make_layer(
        self, config: ModelConfig, parallel: ParallelContext, index: int
    ) -> DeepseekV3DecoderLayer:
        return DeepseekV3DecoderLayer(config, parallel, index)

    def kv_cache_layout(self, tp_size: int) -> LatentCacheLayout:
        """One latent row per token and layer, replicated on every rank (tp_size does not shrink it)."""
        mla = self.config.mla
        return LatentCacheLayout(
            self.config.num_layers, mla.kv_lora_rank, mla.qk_rope_head_dim, self.config.dtype
        )

    def is_ignorable_tensor(self, name: str) -> bool:
        """Also the MTP / NextN layers' tensors (model.layers.{i} for i >= num_hidden_layers)."""
        if name.startswith("model.layers."):
            index = name.split(".")[2]
            if index.isdigit() and int(index) >= self.config.num_layers:
                return True
        return super().is_ignorable_tensor(name)
