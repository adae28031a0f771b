"""Tokens grouped by expert on the device, in fixed upper-bound shapes (CUDA-graph safe, no host sync).

The T * k (token, slot) pairs of topk_ids [T, k] ("slots", s = t * k + j) are grouped by expert, each
expert's run padded to a multiple of block_m, so a grouped GEMM program takes block_m rows of one
expert. Outputs, all sized from T, k, E and block_m alone:
  sorted_slots [max_blocks * block_m] int32: slot ids by expert; padding holds T * k (no slot);
  block_expert [max_blocks] int32: the expert of each block of block_m rows (blocks past the used
      ones are never read);
  num_padded [1] int32: rows in use (a multiple of block_m), the rest of sorted_slots is padding.
max_blocks = cdiv(T * k, block_m) + min(E, T * k): each expert with tokens wastes less than one block.
Within an expert the slot order depends on atomics; every row is computed on its own, so the results
do not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 256


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    return triton.cdiv(num_slots, block_m) + min(num_experts, num_slots)


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, rank_ptr, num_slots, BLOCK: tl.constexpr):
    s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = s < num_slots
    expert = tl.load(ids_ptr + s, mask=valid, other=0)
    rank = tl.atomic_add(counts_ptr + expert, 1, mask=valid)
    tl.store(rank_ptr + s, rank, mask=valid)


@triton.jit
def _offsets_kernel(
    counts_ptr, starts_ptr, block_expert_ptr, num_padded_ptr, num_experts, num_blocks,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + e, mask=e < num_experts, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_ends = tl.cumsum(blocks, axis=0)
    tl.store(starts_ptr + e, (block_ends - blocks) * BLOCK_M, mask=e < num_experts)
    tl.store(num_padded_ptr, tl.sum(blocks, axis=0) * BLOCK_M)
    for first in range(0, num_blocks, BLOCK_B):
        b = first + tl.arange(0, BLOCK_B)
        # the expert of block b: how many experts' runs end at or before it
        owner = tl.sum((block_ends[None, :] <= b[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.minimum(owner, num_experts - 1), mask=b < num_blocks)


@triton.jit
def _scatter_kernel(ids_ptr, rank_ptr, starts_ptr, sorted_ptr, num_slots, BLOCK: tl.constexpr):
    s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    valid = s < num_slots
    expert = tl.load(ids_ptr + s, mask=valid, other=0)
    rank = tl.load(rank_ptr + s, mask=valid, other=0)
    start = tl.load(starts_ptr + expert, mask=valid, other=0)
    tl.store(sorted_ptr + start + rank, s.to(tl.int32), mask=valid)


def moe_align_triton(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] int32 -> (sorted_slots, block_expert, num_padded) as the module says."""
    num_slots = topk_ids.numel()
    device = topk_ids.device
    ids = topk_ids.reshape(-1)
    nb = max_blocks(num_slots, num_experts, block_m)
    sorted_slots = torch.full((nb * block_m,), num_slots, dtype=torch.int32, device=device)
    block_expert = torch.empty(nb, dtype=torch.int32, device=device)
    num_padded = torch.zeros(1, dtype=torch.int32, device=device)
    if num_slots == 0:
        return sorted_slots, block_expert, num_padded
    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    rank = torch.empty(num_slots, dtype=torch.int32, device=device)
    starts = torch.empty(num_experts, dtype=torch.int32, device=device)
    grid = (triton.cdiv(num_slots, _BLOCK),)
    _count_kernel[grid](ids, counts, rank, num_slots, BLOCK=_BLOCK)
    block_e = max(triton.next_power_of_2(num_experts), 16)
    _offsets_kernel[(1,)](
        counts, starts, block_expert, num_padded, num_experts, nb,
        BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_B=max(16, 4096 // block_e),
    )  # fmt: skip
    _scatter_kernel[grid](ids, rank, starts, sorted_slots, num_slots, BLOCK=_BLOCK)
    return sorted_slots, block_expert, num_padded
