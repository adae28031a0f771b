"""Merging the split-K partials of decode attention by their log-sum-exp.

Partials (written by the split kernel in decode_attention.py), contiguous float32:
out [B, Hq, NUM_SPLITS, HEAD_DIM] normalised within the split, lse [B, Hq, NUM_SPLITS] in the log2
domain, -inf for a split without keys. Two ways to merge them:
- `_decode_merge_kernel`: a second launch, one program per (sequence, query head);
- `merge_group_in_last_split`: inside the split kernel. Each split program bumps a per-(sequence,
  KV head) arrival counter after writing its partials; the last to arrive merges the group's heads
  and resets the counter to 0, so the buffer is ready for the next launch or CUDA-graph replay and
  no merge launch is needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MERGE_MAX_SPLITS = 16  # the most splits decode (DECODE_MAX_SPLITS) and verify attention use; more still work

_ARRIVAL_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """[>= count] int32 zeros that stay allocated for the life of the process (CUDA graphs keep
    their address). The kernel leaves every counter at 0 when it returns. A larger request
    allocates a new buffer; older ones stay alive for graphs captured with them."""
    buffers = _ARRIVAL_COUNTERS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < count:
        buffers.append(torch.zeros(max(count, 4096), dtype=torch.int32, device=device))
    return buffers[-1]


@triton.jit
def merge_group_in_last_split(
    part_out_ptr, part_lse_ptr, out_ptr, counter_ptr, b, kv_head, rows, heads, head_mask, dims, dim_mask,
    stride_ob, stride_oh, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Called by every split program after it stored its partials; rows: [BLOCK_G] b * Hq + head."""
    # Every thread's partial stores happen before the release below (barrier, then one atomic).
    tl.debug_barrier()
    counter = counter_ptr + b * tl.num_programs(1) + kv_head
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == NUM_SPLITS - 1:
        tl.debug_barrier()
        lse_max = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        for s in tl.static_range(NUM_SPLITS):
            lse = tl.load(part_lse_ptr + rows * NUM_SPLITS + s, mask=head_mask, other=float("-inf"),
                          cache_modifier=".cg")  # fmt: skip
            lse_max = tl.maximum(lse_max, lse)
        # A sequence with no keys (seq_len 0: a padding row) gives zeros, as the reference does.
        safe_max = tl.where(lse_max > float("-inf"), lse_max, 0.0)
        total = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
        for s in tl.static_range(NUM_SPLITS):
            lse = tl.load(part_lse_ptr + rows * NUM_SPLITS + s, mask=head_mask, other=float("-inf"),
                          cache_modifier=".cg")  # fmt: skip
            weight = tl.where(lse > float("-inf"), tl.exp2(lse - safe_max), 0.0)
            part = tl.load(
                part_out_ptr + (rows * NUM_SPLITS + s)[:, None] * HEAD_DIM + dims[None, :],
                mask=(weight > 0.0)[:, None] & dim_mask[None, :],
                other=0.0,
                cache_modifier=".cg",
            )
            acc += part * weight[:, None]
            total += weight
        out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=head_mask[:, None] & dim_mask[None, :],
        )
        tl.atomic_xchg(counter, 0)


# One compiled variant for every split count (runtime, not specialised, BLOCK_S the largest), so an
# eager step with a split count not seen before does not stop to compile (prefill_attention.py).
@triton.jit(do_not_specialize=["num_heads", "num_splits"])
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    num_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    row = (b * num_heads + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + row, mask=splits < num_splits, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    # A sequence with no keys (seq_len 0: a padding row) gives zeros, as the reference does.
    weight = tl.where(
        lse > float("-inf"), tl.exp2(lse - tl.where(lse_max > float("-inf"), lse_max, 0.0)), 0.0
    )
    parts = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + dims[None, :],
        mask=(weight > 0.0)[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )
    total = tl.sum(weight, axis=0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + b * stride_ob + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def launch_merge(part_out, part_lse, out, num_splits: int, block_d: int) -> None:
    """The separate merge launch: out [B, Hq, D] written from the partials."""
    batch, num_heads, head_dim = out.shape
    _decode_merge_kernel[(batch, num_heads)](
        part_out,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        num_heads,
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=max(triton.next_power_of_2(max(num_splits, MERGE_MAX_SPLITS)), 2),
        BLOCK_D=block_d,
        num_warps=4,
    )
