"""Merging the split-K partials of decode attention by their log-sum-exp.

Partials (written by the split kernels in decode_attention.py and mla_decode.py), contiguous float32:
out [B, Hq, NUM_SPLITS, HEAD_DIM] normalised within the split, lse [B, Hq, NUM_SPLITS] in the log2
domain, -inf for a split without keys. Two ways to merge them:
- `_decode_merge_kernel`: a second launch, one program per (sequence, query head);
- `merge_group_in_last_split`: inside the split kernel. Each split program bumps a per-(sequence,
  KV head) arrival counter after writing its partials; the last to arrive merges the group's heads
  and resets the counter to 0, so the buffer is ready for the next launch or CUDA-graph replay and
  no merge launch is needed;
- `_chunked_merge_kernel`: a second launch for any number of splits, one program per (sequence,
  head, BLOCK_D columns), reading the splits BLOCK_S at a time (MLA decode's hundreds of splits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl

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
    PDL: tl.constexpr,  # kernels/pdl.py
):
    pdl.begin(PDL)
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
        **pdl.launch(part_out.device),
    )


# Any number of splits (MLA decode uses up to a few hundred): splits are read BLOCK_S at a time with
# a running maximum, the next chunk's loads issued before this chunk is reduced (so the chunks'
# memory latencies overlap), and the head dim is cut into BLOCK_D columns, one program each, so a
# batch-1 merge still spreads over many SMs.
@triton.jit(do_not_specialize=["num_heads", "num_splits"])
def _chunked_merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh, num_heads, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):  # fmt: skip
    pdl.begin(PDL)
    row = tl.program_id(0).to(tl.int64)  # b * num_heads + head
    b = row // num_heads
    head = row % num_heads
    dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    offs_s = tl.arange(0, BLOCK_S)
    m = tl.max(tl.full([BLOCK_S], float("-inf"), dtype=tl.float32), axis=0)
    total = tl.sum(tl.zeros([BLOCK_S], dtype=tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    # Partial rows are loaded without waiting for their lse: a split without keys left its rows
    # unwritten, and where() below drops whatever they hold.
    next_lse = tl.load(
        part_lse_ptr + row * num_splits + offs_s, mask=offs_s < num_splits, other=float("-inf")
    )
    next_parts = tl.load(
        part_out_ptr + (row * num_splits + offs_s)[:, None] * HEAD_DIM + dims[None, :],
        mask=(offs_s < num_splits)[:, None] & dim_mask[None, :], other=0.0,
    )  # fmt: skip
    for s0 in range(0, num_splits, BLOCK_S):
        lse = next_lse
        parts = next_parts
        splits = s0 + BLOCK_S + offs_s
        next_lse = tl.load(
            part_lse_ptr + row * num_splits + splits, mask=splits < num_splits, other=float("-inf")
        )
        next_parts = tl.load(
            part_out_ptr + (row * num_splits + splits)[:, None] * HEAD_DIM + dims[None, :],
            mask=(splits < num_splits)[:, None] & dim_mask[None, :], other=0.0,
        )  # fmt: skip
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        # all -inf so far (no keys yet): weights 0, and a sequence without keys gives zeros
        safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m - safe)
        weight = tl.where(lse > float("-inf"), tl.exp2(lse - safe), 0.0)
        acc = acc * alpha + tl.sum(tl.where((weight > 0.0)[:, None], parts * weight[:, None], 0.0), axis=0)
        total = total * alpha + tl.sum(weight, axis=0)
        m = m_new
    out = acc / tl.where(total > 0.0, total, 1.0)
    out_row = out_ptr + b * stride_ob + head * stride_oh
    tl.store(out_row + dims, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def launch_chunked_merge(part_out, part_lse, out, num_splits: int) -> None:
    """out [B, H, D] from partials out [B, H, num_splits, D], lse [B, H, num_splits] (the layout
    above) for any num_splits; grid (B * H, D / BLOCK_D). Two chunk shapes of 1024 values, picked by
    the split count (a shape, so CUDA-graph safe): 64 splits x 16 columns past 16 splits (few rows,
    many splits: batch 1), else 16 x 64."""
    batch, num_heads, head_dim = out.shape
    block_s, block_d = (64, 16) if num_splits > 16 else (16, 64)
    block_d = min(block_d, max(triton.next_power_of_2(head_dim), 16))
    _chunked_merge_kernel[(batch * num_heads, triton.cdiv(head_dim, block_d))](
        part_out, part_lse, out, out.stride(0), out.stride(1), num_heads, num_splits,
        HEAD_DIM=head_dim, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4,
        **pdl.launch(part_out.device),
    )  # fmt: skip
