"""Which fused-MoE tile runs each expert weight shape, measured per slot-count bucket at start-up.

The grouped GEMMs of kernels/fused_moe.py take a MoeTile (rows of one expert per program, output and
reduction columns, stages, warps). At decode the product streams each routed expert's weights for a
few rows; at prefill it is a tensor-core GEMM per expert; which tile is fastest depends on the shape,
the routing spread and the GPU, so it is timed, never assumed: for each distinct (w13, w2) shape of a
model's FusedMoE layers and each power-of-two bucket of T * k slots up to the engine's largest step,
every candidate (DECODE_TILES up to DECODE_MAX_SLOTS slots, PREFILL_TILES above) is timed by
CUDA-graph replay on uniformly random routing over the model's own weights, and the fastest is
recorded with fused_moe.set_tile. On CPU nothing is timed (the interpreter runs the default tiles).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from tpfuse.gpu_timing import graph_us
from tpfuse.kernels import fused_moe
from tpfuse.kernels.fused_moe import MoeTile

log = logging.getLogger("tpfuse")


@dataclass(frozen=True)
class MoeChoice:
    w13_shape: tuple[int, ...]
    slots_bucket: int
    tile: MoeTile
    us: float
    default_us: float

    def describe(self) -> str:
        e, two_i, h = self.w13_shape
        return (
            f"experts {e}x{two_i}x{h} at <= {self.slots_bucket} slots: {self.tile.label()} "
            f"({self.us:.1f} us, default {self.default_us:.1f} us)"
        )


def slot_buckets(top_k: int, max_decode_rows: int, max_prefill_tokens: int) -> list[int]:
    """Power-of-two slot buckets from one token up to the largest decode step and prefill chunk."""
    top = fused_moe.slots_bucket(top_k * max(max_decode_rows, max_prefill_tokens, 1))
    buckets, b = [], fused_moe.slots_bucket(top_k)
    while b <= top:
        buckets.append(b)
        b *= 2
    return buckets


def _time_tile(experts, tile: MoeTile, num_tokens: int, top_k: int) -> float:
    w13, w2 = experts.w13, experts.w2
    g = torch.Generator(device=w13.device).manual_seed(num_tokens)
    x = torch.randn(num_tokens, w13.shape[2], device=w13.device, generator=g).to(w13.dtype)
    scores = torch.rand(num_tokens, w13.shape[0], device=w13.device, generator=g)
    ids = scores.topk(top_k, dim=-1).indices.to(torch.int32)
    weights = torch.full((num_tokens, top_k), 1.0 / top_k, device=w13.device)
    return graph_us([lambda: fused_moe.fused_experts_triton(x, w13, w2, weights, ids, tile=tile)],
                    min_launches=4, replays=3, samples=3)  # fmt: skip


@torch.inference_mode()
def choose(model: nn.Module, max_decode_rows: int, max_prefill_tokens: int) -> list[MoeChoice]:
    """Times and records the tile of every distinct FusedMoE shape of model at each slot bucket.
    Runs on the GPU before any CUDA graph is captured; returns the decisions (none on CPU)."""
    from tpfuse.model.moe import FusedMoE

    seen, decided = set(), []
    for block in model.modules():  # every MoE block: a FusedMoE "experts" and its top_k
        experts = getattr(block, "experts", None)
        if not isinstance(experts, FusedMoE) or not hasattr(experts, "w13"):
            continue
        if not experts.w13.is_cuda:
            continue
        for bucket in slot_buckets(block.top_k, max_decode_rows, max_prefill_tokens):
            key = (tuple(experts.w13.shape), experts.w13.dtype, bucket)
            if key in seen:
                continue
            seen.add(key)
            num_tokens = max(bucket // block.top_k, 1)
            decode = bucket <= fused_moe.DECODE_MAX_SLOTS
            candidates = fused_moe.DECODE_TILES if decode else fused_moe.PREFILL_TILES
            times = [(_time_tile(experts, t, num_tokens, block.top_k), i) for i, t in enumerate(candidates)]
            us, best = min(times)
            fused_moe.set_tile(experts.w13, bucket, candidates[best])
            decided.append(MoeChoice(key[0], bucket, candidates[best], us, times[0][0]))
    if decided:
        log.info("fused-MoE tiles: %s", "; ".join(c.describe() for c in decided))
    return decided
