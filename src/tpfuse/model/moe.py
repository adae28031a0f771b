"""The mixture-of-experts block: a replicated router and the experts as one FusedMoE module.

Tensor parallelism over experts: every rank holds every expert's slice of the intermediate dim
(w13 [E, 2 * I_local, H]: gate rows then up rows; w2 [E, H, I_local]), so each rank's output is a
partial sum and the layer ends in the fused all-reduce + residual + RMSNorm like a dense MLP.
The expert weights and their product belong to an ExpertMethod (creation, checkpoint slots, apply in
one small object) so a quantized variant replaces only that object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from tpfuse.kernels import (
    fused_experts,
    fused_experts_slots,
    moe_finalize_op,
    moe_norm_route,
    moe_route,
    moe_topk,
    routed_expert_slots,
)
from tpfuse.kernels.fused_moe_tiles import tile_for
from tpfuse.kernels.moe_router import RouteTile
from tpfuse.model import moe_choice
from tpfuse.model.blocks import FeedForwardBlock
from tpfuse.model.input_forms import fused_norm
from tpfuse.model.layers import Linear, ParallelContext, ShardSlot, divide
from tpfuse.model.linear_method import expert_method_for


@dataclass(frozen=True)
class ExpertNames:
    """How a checkpoint names expert e's tensors: f"{prefix}{e}.{gate}.weight", and so on."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


class ExpertMethod(Protocol):
    """Owns the expert weights of a FusedMoE: creates them, maps checkpoint tensors onto them, and
    computes the experts' weighted output."""

    def create_weights(self, experts: FusedMoE) -> None: ...

    def checkpoint_slots(self, experts: FusedMoE, prefix: str) -> dict[str, ShardSlot]: ...

    def apply(
        self, experts: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """-> [T, H], the weighted sum of each token's k experts (this rank's partial sum)."""
        ...

    def apply_slots(
        self, experts: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """-> [T * k, H], row t * k + j the weighted output of token t's j-th expert (uncombined)."""
        ...

    def routes_slots(self, experts: FusedMoE, num_slots: int) -> bool:
        """Whether apply_routed_slots runs at num_slots = T * k (its kernels pick the experts)."""
        ...

    def apply_routed_slots(
        self, experts: FusedMoE, x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """apply_slots with the softmax top-k of the router logits [T, E] float32 done by the experts'
        own first kernel: -> (slots [T * k, H], topk_weights [T, k], topk_ids [T, k])."""
        ...


class UnquantizedExperts:
    """w13 [E, 2 * I_local, H] and w2 [E, H, I_local] in the model dtype, run by kernels.fused_experts."""

    def create_weights(self, experts: FusedMoE) -> None:
        e, h, i = experts.num_experts, experts.hidden_size, experts.intermediate_local
        experts.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=experts.dtype), requires_grad=False)
        experts.w2 = nn.Parameter(torch.empty(e, h, i, dtype=experts.dtype), requires_grad=False)

    def checkpoint_slots(self, experts: FusedMoE, prefix: str) -> dict[str, ShardSlot]:
        names, h, i_full = experts.names, experts.hidden_size, experts.intermediate_size
        i, start = experts.intermediate_local, experts.intermediate_start
        slots = {}
        for e in range(experts.num_experts):
            p = f"{prefix}{e}."
            slots[f"{p}{names.gate}.weight"] = ShardSlot(experts.w13, (i_full, h), 0, start, i, 0, index=e)
            slots[f"{p}{names.up}.weight"] = ShardSlot(experts.w13, (i_full, h), 0, start, i, i, index=e)
            slots[f"{p}{names.down}.weight"] = ShardSlot(experts.w2, (h, i_full), 1, start, i, 0, index=e)
        return slots

    def apply(self, experts, x, topk_weights, topk_ids):
        return fused_experts(x, experts.w13, experts.w2, topk_weights, topk_ids)

    def apply_slots(self, experts, x, topk_weights, topk_ids):
        return fused_experts_slots(x, experts.w13, experts.w2, topk_weights, topk_ids)

    def routes_slots(self, experts, num_slots):
        return tile_for(experts.w13, num_slots).block_m == 1  # the per-slot GEMVs, chosen at start-up

    def apply_routed_slots(self, experts, x, logits, top_k, renormalize):
        tile = tile_for(experts.w13, x.shape[0] * top_k)
        return routed_expert_slots(x, experts.w13, experts.w2, logits, top_k, renormalize, tile)


class FusedMoE(nn.Module):
    """All experts of one layer. forward(x [T, H], topk_weights [T, k] float32, topk_ids [T, k] int32)
    -> [T, H], this rank's partial sum of sum_j weight_j * expert_j(x)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        parallel: ParallelContext,
        dtype: torch.dtype,
        names: ExpertNames = ExpertNames(),
        method: ExpertMethod | None = None,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.intermediate_local = divide(intermediate_size, parallel.tp_size, "the expert intermediate size")
        self.intermediate_start = parallel.tp_rank * self.intermediate_local
        self.dtype = dtype
        self.names = names
        self.method = method or expert_method_for() or UnquantizedExperts()
        self.method.create_weights(self)

    def checkpoint_slots(self, prefix: str) -> dict[str, ShardSlot]:
        """prefix: the experts' module prefix, e.g. "model.layers.0.mlp.experts."."""
        return self.method.checkpoint_slots(self, prefix)

    def forward(self, x, topk_weights, topk_ids):
        return self.method.apply(self, x, topk_weights, topk_ids)

    def slot_outputs(self, x, topk_weights, topk_ids):
        """[T * k, H]: each (token, slot)'s weighted expert output, not yet summed over k."""
        return self.method.apply_slots(self, x, topk_weights, topk_ids)

    def routes_slots(self, num_slots: int) -> bool:
        return self.method.routes_slots(self, num_slots)

    def routed_slot_outputs(self, x, logits, top_k: int, renormalize: bool):
        """slot_outputs with the top-k in the experts' first kernel: -> (slots, topk_weights, topk_ids)."""
        return self.method.apply_routed_slots(self, x, logits, top_k, renormalize)


class SparseMoeBlock(FeedForwardBlock):
    """Router (replicated [E, H] linear, named "gate") -> top-k -> FusedMoE ("experts"); the
    feed-forward block contract of model/blocks.py."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        parallel: ParallelContext,
        dtype: torch.dtype,
        names: ExpertNames = ExpertNames(),
    ):
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts, bias=False, dtype=dtype)
        self.gate.weight.requires_grad_(False)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, parallel, dtype, names)

    @property
    def router_weight(self) -> torch.Tensor:
        return self.gate.weight

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_weights [T, k] float32, topk_ids [T, k] int32) through the route
        model/moe_choice.py measured fastest for T (route_tile)."""
        return self.route_with(x, moe_choice.route_tile(x, self.gate.weight))

    def route_with(self, x: torch.Tensor, tile: RouteTile | None) -> tuple[torch.Tensor, torch.Tensor]:
        """route with the router linear + top-k in one launch of shape tile, or with None the router
        linear then the top-k kernel."""
        if tile is not None:
            return moe_route(x, self.gate.weight, self.top_k, self.renormalize, tile)
        return moe_topk(self.gate(x), self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] (normed) -> [T, H], this rank's partial sum."""
        topk_weights, topk_ids = self.route(x)
        return self.experts(x, topk_weights, topk_ids)

    def forward_add_rmsnorm(self, x, residual, weight, eps, comm, form=None):
        """The weighted combine ends inside the layer's last sync: at TP > 1 in the communicator's MoE
        finalize (combine + all-reduce + residual + RMSNorm, one kernel where it can:
        comm/moe_finalize.py); at TP = 1, where model/moe_choice.py measured it faster, in the fused
        combine + residual + RMSNorm (kernels/moe_finalize.py), else combine then fused add + RMSNorm (the
        only form that writes `form`)."""
        topk_weights, topk_ids = self.route(x)
        if comm.world_size > 1:
            slots = self.experts.slot_outputs(x, topk_weights, topk_ids)
            return comm.moe_finalize_all_reduce(slots, self.top_k, residual, weight, eps)
        if moe_choice.fuse_finalize(x, topk_ids.numel()):
            slots = self.experts.slot_outputs(x, topk_weights, topk_ids)
            return moe_finalize_op(slots, self.top_k, residual, weight, eps)
        partial = self.experts(x, topk_weights, topk_ids)
        return fused_norm(comm, partial, residual, weight, eps, form)

    def forward_after_attention(self, partial, residual, post_weight, weight, eps, comm, form=None):
        """At TP = 1 on decode-sized steps, where model/moe_choice.py measured it faster, two launches
        fewer: the post-attention add + RMSNorm runs inside the router product
        (kernels/moe_norm_router.py) and the top-k inside the experts' first kernel; else the plain
        sequence of model/blocks.py."""
        tile = moe_choice.norm_route_tile(partial, self) if comm.world_size == 1 else None
        if tile is None:
            args = (partial, residual, post_weight, weight, eps, comm, form)
            return super().forward_after_attention(*args)
        h, residual, logits = moe_norm_route(partial, residual, post_weight, self.gate.weight, eps, tile)
        slots, _, _ = self.experts.routed_slot_outputs(h, logits, self.top_k, self.renormalize)
        return moe_finalize_op(slots, self.top_k, residual, weight, eps)

    def checkpoint_slots(self, prefix: str) -> dict[str, ShardSlot]:
        weight = self.gate.weight
        slots = {prefix + "gate.weight": ShardSlot(weight, tuple(weight.shape), 0, 0, weight.shape[0])}
        slots.update(self.experts.checkpoint_slots(prefix + "experts."))
        return slots
