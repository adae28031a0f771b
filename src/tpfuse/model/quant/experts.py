"""Quantized MoE experts (model/moe.py's ExpertMethod): every expert's gate/up/down in the checkpoint's
per-expert tensors, stacked per projection as kernels/quant_moe.py runs them.

- IntGroupExperts: compressed-tensors pack-quantized (symmetric, group-wise; Kimi K2's INT4 experts):
  <prefix><e>.<proj>.weight_packed / weight_scale / weight_shape.
- Fp8Experts: FP8 e4m3 with per-channel weight_scale (compressed-tensors) or block weight_scale_inv
  (Qwen3-FP8 MoE, DeepSeek-V3), scales expanded at load to one per (row, K block).
Tensor parallelism splits every expert's intermediate dim (gate/up rows, down columns) as the bf16
experts do; down's K shard must start on a scale group.
CUDA routes (Route): per slot with W8A16 products (kernels/quant_moe.py; f16x2 for 4-bit codes with a
Half2SlotTile), grouped GEMMs over slots
sorted by expert (kernels/quant_moe_grouped.py), and for FP8 formats that quantize activations on GPUs
with FP8 tensor cores W8A8 forms of both (kernels/quant_moe_w8a8.py; GroupedTile.fp8_activations).
Start-up timing picks one per expert shape and slot bucket (model/moe_choice.py: route_candidates,
set_slot_route); unmeasured, decode sizes run per slot W8A16 and larger steps the grouped GEMMs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from tpfuse.kernels import moe_combine, moe_topk, use_triton
from tpfuse.kernels.fused_moe import combine_slots_ref
from tpfuse.kernels.fused_moe_tiles import DECODE_MAX_SLOTS, MoeTile, slots_bucket
from tpfuse.kernels.quant_fp8 import FP8_DTYPE
from tpfuse.kernels.quant_fp8_w8a8 import fp8_dot_supported
from tpfuse.kernels.quant_int import values_per_word
from tpfuse.kernels.quant_moe import (
    HALF2_SLOT_TILES,
    Half2SlotTile,
    QuantExperts,
    quant_routed_slots_triton,
    quant_slots_triton,
    slots_ref,
)
from tpfuse.kernels.quant_moe_grouped import GROUPED_TILES, W8A8_GROUPED_TILES, grouped_slots_triton
from tpfuse.kernels.quant_moe_w8a8 import SLOT_TILES, W8A8SlotTile, activation_step, w8a8_slots_triton
from tpfuse.model.quant.common import (
    FP8_STORED,
    INT_STORED,
    dummy_codes,
    dummy_fp8,
    dummy_group_scale,
    dummy_scale,
)
from tpfuse.model.shard import ShardSlot, empty_parameter

# A slot route: None (the W8A16 per-slot route, kernels/quant_moe.py), a Half2SlotTile (the same with
# f16x2 products for 4-bit codes), a W8A8SlotTile (the FP8 per-slot route, kernels/quant_moe_w8a8.py)
# or a MoeTile (grouped GEMMs, kernels/quant_moe_grouped.py)
Route = W8A8SlotTile | MoeTile | Half2SlotTile | None
# (gate/up codes' shape, device, slots bucket) -> the route start-up timing chose
_SLOT_ROUTES: dict[tuple, Route] = {}


class _QuantizedExperts(ABC):
    """apply / apply_slots through the CUDA slot routes (route_candidates, chosen at start-up) or the
    dequantized reference, kept once."""

    @abstractmethod
    def stacks(self, experts) -> tuple[QuantExperts, QuantExperts]:
        """The (w13, w2) quantized stacks of experts' parameters."""

    def route_candidates(self, experts, bucket: int) -> tuple[Route, ...]:
        """The routes start-up timing races at a slots bucket, the default first: at decode sizes the
        per-slot route and the grouped tiles, above them the grouped tiles."""
        if bucket > DECODE_MAX_SLOTS:
            return GROUPED_TILES
        return (None, *GROUPED_TILES)

    def run_slots(self, experts, x, topk_weights, topk_ids, route: Route):
        """[T * k, H]: the CUDA slot products by route (what start-up timing times)."""
        w13, w2 = self.stacks(experts)
        if route is None or isinstance(route, Half2SlotTile):
            return quant_slots_triton(x, w13, w2, topk_weights, topk_ids, tile=route)
        if isinstance(route, MoeTile):
            return grouped_slots_triton(x, w13, w2, topk_weights, topk_ids, route)
        return w8a8_slots_triton(x, w13, w2, topk_weights, topk_ids, route)

    def apply_slots(self, experts, x, topk_weights, topk_ids):
        w13, w2 = self.stacks(experts)
        if use_triton(x):
            route = slot_route(w13.codes, topk_ids.numel())
            return self.run_slots(experts, x, topk_weights, topk_ids, route)
        cached = experts.__dict__.get("reference_weights")
        if cached is None:  # the reference path: dequantize once (exact), products in float32
            cached = (w13.dequantize(), w2.dequantize())
            experts.__dict__["reference_weights"] = cached
        return slots_ref(x, *cached, topk_weights, topk_ids)

    def routes_slots(self, experts, num_slots: int) -> bool:
        """The per-slot routes (W8A16 or f16x2 rows) pick their experts from the router logits; the
        grouped and W8A8 routes read the top-k kernel's ids."""
        route = slot_route(self.stacks(experts)[0].codes, num_slots)
        return route is None or isinstance(route, Half2SlotTile)

    def apply_routed_slots(self, experts, x, logits, top_k, renormalize):
        if not use_triton(x):  # the reference: the top-k, then the dequantized products
            weights, ids = moe_topk(logits, top_k, renormalize)
            return self.apply_slots(experts, x, weights, ids), weights, ids
        w13, w2 = self.stacks(experts)
        tile = slot_route(w13.codes, x.shape[0] * top_k)
        return quant_routed_slots_triton(x, w13, w2, logits, top_k, renormalize, tile=tile)

    def apply(self, experts, x, topk_weights, topk_ids):
        slots = self.apply_slots(experts, x, topk_weights, topk_ids)
        k = topk_ids.shape[1]
        return moe_combine(slots, k) if use_triton(x) else combine_slots_ref(slots, k)


def slot_route(w13_codes: torch.Tensor, num_slots: int) -> Route:
    """The route start-up timing chose for experts whose gate/up codes are w13_codes at num_slots' bucket;
    where nothing was measured (CPU, or a bucket not timed) the default: the W8A16 per-slot route up
    to DECODE_MAX_SLOTS slots, the grouped GEMMs' first tile above."""
    bucket = slots_bucket(num_slots)
    default = None if bucket <= DECODE_MAX_SLOTS else GROUPED_TILES[0]
    return _SLOT_ROUTES.get((tuple(w13_codes.shape), w13_codes.device, bucket), default)


def set_slot_route(w13_codes: torch.Tensor, bucket: int, route: Route) -> None:
    """Records the route for experts of w13_codes' shape on its device at a slots bucket
    (model/moe_choice.py)."""
    _SLOT_ROUTES[(tuple(w13_codes.shape), w13_codes.device, bucket)] = route


class IntGroupExperts(_QuantizedExperts):
    def __init__(self, bits: int, group_size: int):
        values_per_word(bits)
        self.bits, self.group = bits, group_size
        self.name = f"int{bits} group {group_size} experts"

    def route_candidates(self, experts, bucket: int):
        """_QuantizedExperts' routes, and at decode sizes the f16x2 per-slot tiles where they fit the
        stacks (4 bits, groups and both K multiples of 32, bf16 / fp16 activations)."""
        routes = super().route_candidates(experts, bucket)
        if bucket > DECODE_MAX_SLOTS or experts.dtype not in (torch.bfloat16, torch.float16):
            return routes
        w13, w2 = self.stacks(experts)
        probe = torch.empty(1, w13.cols, dtype=experts.dtype, device=w13.codes.device)
        return routes + tuple(t for t in HALF2_SLOT_TILES if t.fits(probe, w13, w2))

    def create_weights(self, experts) -> None:
        e, h, i = experts.num_experts, experts.hidden_size, experts.intermediate_local
        if experts.intermediate_start % self.group:
            raise ValueError(
                f"the experts' intermediate shard starts at {experts.intermediate_start}, "
                "inside a quantization "
                f"group of {self.group}; choose a --tp-size that splits it into whole groups"
            )
        per_word = values_per_word(self.bits)
        experts.w13_packed = empty_parameter(e, 2 * i, -(-h // per_word), dtype=torch.int32)
        experts.w13_scale = empty_parameter(e, 2 * i, -(-h // self.group), dtype=experts.dtype)
        experts.w2_packed = empty_parameter(e, h, -(-i // per_word), dtype=torch.int32)
        experts.w2_scale = empty_parameter(e, h, -(-i // self.group), dtype=experts.dtype)
        experts.weight_shapes = empty_parameter(e, 6, dtype=torch.int64)

    def checkpoint_slots(self, experts, prefix: str) -> dict[str, ShardSlot]:
        names, h, i_full = experts.names, experts.hidden_size, experts.intermediate_size
        i, start = experts.intermediate_local, experts.intermediate_start
        per_word, group = values_per_word(self.bits), self.group
        codes = {"stored_dtypes": INT_STORED, "dummy": dummy_codes}
        scale = {"dummy": dummy_group_scale(self.bits)}
        slots = {}
        for e in range(experts.num_experts):
            p = f"{prefix}{e}."
            for name, offset in ((names.gate, 0), (names.up, i)):
                slots[f"{p}{name}.weight_packed"] = ShardSlot(
                    experts.w13_packed, (i_full, -(-h // per_word)), 0, start, i, offset, index=e, **codes
                )
                slots[f"{p}{name}.weight_scale"] = ShardSlot(
                    experts.w13_scale, (i_full, -(-h // group)), 0, start, i, offset, index=e, **scale
                )
            w2p, w2s = experts.w2_packed, experts.w2_scale
            slots[f"{p}{names.down}.weight_packed"] = ShardSlot(
                w2p, (h, -(-i_full // per_word)), 1, start // per_word, w2p.shape[2], index=e, **codes
            )
            slots[f"{p}{names.down}.weight_scale"] = ShardSlot(
                w2s, (h, -(-i_full // group)), 1, start // group, w2s.shape[2], index=e, **scale
            )
            for n, (name, shape) in enumerate(
                ((names.gate, (i_full, h)), (names.up, (i_full, h)), (names.down, (h, i_full)))
            ):

                def dummy(dest, generator, shape=shape):
                    dest.copy_(torch.tensor(shape))

                slots[f"{p}{name}.weight_shape"] = ShardSlot(
                    experts.weight_shapes,
                    (2,),
                    0,
                    0,
                    2,
                    2 * n,
                    index=e,
                    stored_dtypes=("I32", "I64"),
                    dummy=dummy,
                )
        return slots

    def process_weights(self, experts) -> None:
        h, i_full = experts.hidden_size, experts.intermediate_size
        expected = torch.tensor([i_full, h, i_full, h, h, i_full], device=experts.weight_shapes.device)
        bad = (experts.weight_shapes.data != expected).any(dim=1).nonzero().flatten().tolist()
        if bad:
            raise ValueError(
                f"expert {bad[0]}'s weight_shape tensors are {experts.weight_shapes.data[bad[0]].tolist()} "
                "but the "
                f"config needs {expected.tolist()} (gate, up, down); check config.json against the checkpoint"
            )

    def stacks(self, experts):
        h, i = experts.hidden_size, experts.intermediate_local
        return (
            QuantExperts(experts.w13_packed, experts.w13_scale, self.bits, self.group, h),
            QuantExperts(experts.w2_packed, experts.w2_scale, self.bits, self.group, i),
        )


class Fp8Experts(_QuantizedExperts):
    """FP8 e4m3 experts: per-channel weight_scale (compressed-tensors) or block weight_scale_inv
    (Qwen3-FP8 MoE, DeepSeek-V3), kept as one float32 scale per (row, K group): [E, N, 1] per-channel,
    [E, N, ceil(K / block_k)] block (expanded from the block rows at load, exact)."""

    def __init__(self, strategy: str, block: tuple[int, int] | None, activations: bool = True):
        if strategy not in ("channel", "block"):
            raise ValueError(f"FP8 experts with {strategy} scales are not supported (channel or block)")
        self.strategy, self.block, self.activations = strategy, block, activations
        self.name = f"fp8-{strategy} experts"

    def route_candidates(self, experts, bucket: int):
        """_QuantizedExperts' routes, and W8A8 ones (the per-slot tiles at decode sizes, the grouped
        W8A8 tiles at every size) where the format quantizes activations, the GPU has FP8 tensor cores
        and both stacks' scale groups allow a K step."""
        routes = super().route_candidates(experts, bucket)
        if not (self.activations and experts.w13.is_cuda and fp8_dot_supported(experts.w13.device)):
            return routes
        if any(activation_step(stack) is None for stack in self.stacks(experts)):
            return routes
        return routes + W8A8_GROUPED_TILES + (SLOT_TILES if bucket <= DECODE_MAX_SLOTS else ())

    def create_weights(self, experts) -> None:
        e, h, i = experts.num_experts, experts.hidden_size, experts.intermediate_local
        experts.w13 = empty_parameter(e, 2 * i, h, dtype=FP8_DTYPE)
        experts.w2 = empty_parameter(e, h, i, dtype=FP8_DTYPE)
        if self.strategy == "channel":
            experts.w13_scale = empty_parameter(e, 2 * i, 1, dtype=torch.float32)
            experts.w2_scale = empty_parameter(e, h, 1, dtype=torch.float32)
            return
        bn, bk = self.block
        start = experts.intermediate_start
        if start % bk:
            raise ValueError(
                f"the experts' intermediate shard starts at {start}, inside a {bk}-column FP8 scale block; "
                "choose a --tp-size that splits it into whole blocks"
            )
        rows = -(-(start + i) // bn) - start // bn
        experts.gate_block_scales = empty_parameter(e, rows, -(-h // bk), dtype=torch.float32)
        experts.up_block_scales = empty_parameter(e, rows, -(-h // bk), dtype=torch.float32)
        experts.down_block_scales = empty_parameter(e, -(-h // bn), -(-i // bk), dtype=torch.float32)

    def checkpoint_slots(self, experts, prefix: str) -> dict[str, ShardSlot]:
        names, h, i_full = experts.names, experts.hidden_size, experts.intermediate_size
        i, start = experts.intermediate_local, experts.intermediate_start
        codes = {"stored_dtypes": FP8_STORED, "dummy": dummy_fp8}
        slots = {}
        for e in range(experts.num_experts):
            p = f"{prefix}{e}."
            gate, up, down = (f"{p}{n}" for n in (names.gate, names.up, names.down))
            slots[f"{gate}.weight"] = ShardSlot(experts.w13, (i_full, h), 0, start, i, 0, index=e, **codes)
            slots[f"{up}.weight"] = ShardSlot(experts.w13, (i_full, h), 0, start, i, i, index=e, **codes)
            slots[f"{down}.weight"] = ShardSlot(experts.w2, (h, i_full), 1, start, i, 0, index=e, **codes)
            if self.strategy == "channel":
                s13, s2 = experts.w13_scale, experts.w2_scale
                slots[f"{gate}.weight_scale"] = ShardSlot(
                    s13, (i_full, 1), 0, start, i, 0, index=e, dummy=dummy_scale
                )
                slots[f"{up}.weight_scale"] = ShardSlot(
                    s13, (i_full, 1), 0, start, i, i, index=e, dummy=dummy_scale
                )
                slots[f"{down}.weight_scale"] = ShardSlot(s2, (h, 1), 0, 0, h, 0, index=e, dummy=dummy_scale)
                continue
            bn, bk = self.block
            up_shape = (-(-i_full // bn), -(-h // bk))
            for name, raw in ((gate, experts.gate_block_scales), (up, experts.up_block_scales)):
                slots[f"{name}.weight_scale_inv"] = ShardSlot(
                    raw, up_shape, 0, start // bn, raw.shape[1], index=e, dummy=dummy_scale
                )
            raw = experts.down_block_scales
            slots[f"{down}.weight_scale_inv"] = ShardSlot(
                raw, (-(-h // bn), -(-i_full // bk)), 1, start // bk, raw.shape[2], index=e, dummy=dummy_scale
            )
        return slots

    def process_weights(self, experts) -> None:
        if self.strategy != "block":
            return
        bn = self.block[0]
        start, i, h = experts.intermediate_start, experts.intermediate_local, experts.hidden_size
        device = experts.w13.device
        rows = torch.arange(start, start + i, device=device) // bn - start // bn
        w13_scale = torch.cat(
            [experts.gate_block_scales.data[:, rows], experts.up_block_scales.data[:, rows]], 1
        )
        w2_scale = experts.down_block_scales.data[:, torch.arange(h, device=device) // bn]
        for name in ("gate_block_scales", "up_block_scales", "down_block_scales"):
            delattr(experts, name)
        experts.w13_scale = nn.Parameter(w13_scale.contiguous(), requires_grad=False)
        experts.w2_scale = nn.Parameter(w2_scale.contiguous(), requires_grad=False)

    def stacks(self, experts):
        h, i = experts.hidden_size, experts.intermediate_local
        if self.strategy == "channel":
            return (
                QuantExperts(experts.w13, experts.w13_scale, 0, h, h),
                QuantExperts(experts.w2, experts.w2_scale, 0, i, i),
            )
        bn, bk = self.block
        # the expanded scales repeat in runs of bn rows where the shard's gate and up rows start on
        # blocks (process_weights); the down rows always do
        whole = experts.intermediate_start % bn == 0 and i % bn == 0
        return (
            QuantExperts(experts.w13, experts.w13_scale, 0, bk, h, row_block=bn if whole else 1),
            QuantExperts(experts.w2, experts.w2_scale, 0, bk, i, row_block=bn),
        )
