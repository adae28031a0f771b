"""MLA decode attention: one query token per sequence, all heads over the absorbed latent cache.

Shapes: q_latent [B, H, R] (q_nope already multiplied by each head's W_UK), q_rope [B, H, P] (rotated),
cache [num_blocks, block_size, R + P] (latent c, then rotated k_pe), output [B, H, R] in the latent
space.

The kernel: grid (num_splits, B, head groups). A program takes BLOCK_H heads of one sequence (all of
them up to 64) and one contiguous key range (its split), so each latent tile it loads serves every
head of the group, once for the scores and once as the value. Splits fill the SMs at small batch;
their partials are merged in split order (decode_merge.launch_chunked_merge: deterministic). The
split count comes from shapes only (batch, head groups, block-table width, SM count), never from
seq_lens, so every CUDA-graph replay launches the same grid; each split's key range is derived from
seq_len on the device. The tile (BLOCK_H, BLOCK_N, warps, stages) depends on the head count only,
so an engine compiles two variants (split and unsplit) per model, and the merge two chunk shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels.decode_merge import launch_chunked_merge
from tpfuse.kernels.mla_attention import _load_latent_tile, check_mla_inputs
from tpfuse.kernels.paged_attention_common import device_sms, split_key_range, split_partials


@triton.jit(do_not_specialize=["stride_bt", "num_splits"])
def _mla_decode_kernel(
    q_lat_ptr, q_rope_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2e, stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_ot, stride_oh,
    stride_cb, stride_cs, stride_bt, num_splits,
    HEADS: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SPLIT_KEYS: tl.constexpr, SWAP_AB: tl.constexpr,
):  # fmt: skip
    split = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < HEADS
    lat = tl.arange(0, BLOCK_R)
    rot = tl.arange(0, BLOCK_P)
    # Constant masks along the row keep the 16-byte vector loads when the width is a power of two.
    if RANK == BLOCK_R:
        lat_mask = lat < BLOCK_R
    else:
        lat_mask = lat < RANK
    if ROPE == BLOCK_P:
        rot_mask = rot < BLOCK_P
    else:
        rot_mask = rot < ROPE
    q_lat = tl.load(
        q_lat_ptr + b * stride_qlt + heads[:, None] * stride_qlh + lat[None, :],
        mask=head_mask[:, None] & lat_mask[None, :], other=0.0,
    )  # fmt: skip
    q_rope = tl.load(
        q_rope_ptr + b * stride_qrt + heads[:, None] * stride_qrh + rot[None, :],
        mask=head_mask[:, None] & rot_mask[None, :], other=0.0,
    )  # fmt: skip
    seq_len = tl.load(seq_lens_ptr + b)
    start, end = split_key_range(seq_len, split, num_splits, BLOCK_N)
    block_table_row = block_tables_ptr + b * stride_bt

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if SWAP_AB:  # keys as the MMA rows: [BLOCK_N keys, BLOCK_H heads] scores, [RANK, BLOCK_H] accumulator
        acc_t = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        keys = tile_start + tl.arange(0, BLOCK_N)
        key_mask = keys < end
        c, k_pe = _load_latent_tile(
            cache_ptr, block_table_row, keys, key_mask, lat, lat_mask, rot, rot_mask, stride_cb, stride_cs,
            RANK, BLOCK_SIZE,
        )  # fmt: skip
        c = c.to(q_lat.dtype)
        k_pe = k_pe.to(q_rope.dtype)
        if SWAP_AB:
            s_t = tl.dot(c, tl.trans(q_lat), input_precision=DOT_PRECISION)
            s_t = tl.dot(k_pe, tl.trans(q_rope), s_t, input_precision=DOT_PRECISION)
            s_t = tl.where(key_mask[:, None], s_t * scale_log2e, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s_t, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p_t = tl.exp2(s_t - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p_t, axis=0)
            acc_t = tl.dot(
                tl.trans(c), p_t.to(q_lat.dtype), acc_t * alpha[None, :], input_precision=DOT_PRECISION
            )
        else:
            s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
            s = tl.dot(q_rope, tl.trans(k_pe), s, input_precision=DOT_PRECISION)
            s = tl.where(key_mask[None, :], s * scale_log2e, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(q_lat.dtype), c, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    has_keys = l_i > 0.0
    inv_l = 1.0 / tl.where(has_keys, l_i, 1.0)
    if SWAP_AB:
        out = tl.trans(acc_t * inv_l[None, :])
    else:
        out = acc * inv_l[:, None]
    if not SPLIT_KEYS:
        offsets = b * stride_ot + heads[:, None] * stride_oh + lat[None, :]
        out_mask = head_mask[:, None] & lat_mask[None, :]
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials as decode_merge.launch_chunked_merge reads them: out [B, H, num_splits, RANK]
        # normalised within the split (not written where the split has no keys), lse [B, H, num_splits]
        # in the log2 domain (-inf: no keys in this split)
        part_row = (b * HEADS + heads) * num_splits + split
        tl.store(part_out_ptr + part_row[:, None] * RANK + lat[None, :], out,
                 mask=(head_mask & has_keys)[:, None] & lat_mask[None, :])  # fmt: skip
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=head_mask)


def gather_latent(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """cache [num_blocks, block_size, R + P] -> [length, R + P] of one sequence."""
    block_size = cache.shape[1]
    blocks = (length + block_size - 1) // block_size
    return cache[block_table[:blocks].long()].flatten(0, 1)[:length]


def mla_decode_ref(q_latent, q_rope, cache, block_tables, seq_lens, scale):
    """q_latent [B, H, R], q_rope [B, H, P]; cache [num_blocks, block_size, R + P]; block_tables
    [B, max_blocks] int32; seq_lens [B] int32 (keys 0..seq_len-1, the current token's included).
    Returns a new [B, H, R] of q_latent.dtype, computed in the input dtype's float32 (float64 stays
    float64); a sequence with seq_len 0 gives zeros."""
    check_mla_inputs(q_latent, q_rope, cache)
    rank = q_latent.shape[-1]
    acc = torch.float64 if q_latent.dtype == torch.float64 else torch.float32
    out = torch.zeros_like(q_latent)
    for b in range(q_latent.shape[0]):
        n = int(seq_lens[b])
        if n == 0:
            continue
        kv = gather_latent(cache, block_table=block_tables[b], length=n).to(acc)
        scores = (q_latent[b].to(acc) @ kv[:, :rank].T + q_rope[b].to(acc) @ kv[:, rank:].T) * scale
        out[b] = (scores.softmax(-1) @ kv[:, :rank]).to(q_latent.dtype)
    return out


def mla_decode_tile(heads: int) -> tuple[int, int, int, int, bool]:
    """(block_h, block_n, num_warps, num_stages, swap_ab) for `heads` query heads per rank: every
    head of a sequence in one program up to 64 (the float32 accumulator is block_h x kv_lora_rank).
    swap_ab (keys on the MMA's 64-row side, so 16 or 32 heads get Hopper's wgmma) is a tile option
    the benchmark compares; on the H200 it was slower than these tiles at 16 and 32 heads (PERF.md)."""
    block_h = min(max(triton.next_power_of_2(heads), 16), 64)
    if block_h == 64:  # 3 stages: 4-11 % faster than 2 on the H200 at 128 heads (PERF.md)
        return 64, 64, 8, 3, False
    if block_h == 16:  # 3 stages: 1-4 % faster than 2 on the H200's memory-bound cases (PERF.md)
        return 16, 32, 4, 3, False
    return block_h, 32, 4, 2, False


def _programs_per_sm(tile) -> int:
    """Programs of this tile the split rule puts on each SM: one where a program takes most of the
    SM's shared memory (64 heads, or 64 keys swapped: ~160-220 KB), else 64 / block_h (measured best
    for the 32-key tiles at 16 and 32 heads)."""
    block_h, block_n, _, _, swap_ab = tile
    return 1 if block_h == 64 or (swap_ab and block_n >= 64) else max(64 // block_h, 1)


# The fewest key tiles a split is given (below that the partials' float32 traffic outweighs the
# parallelism it buys) and the most splits.
MLA_DECODE_MIN_TILES_PER_SPLIT = 4
MLA_DECODE_MAX_SPLITS = 256


def mla_decode_splits_for(batch, heads, max_blocks, block_size, num_sms, per_sm=None, tile=None) -> int:
    """Splits per sequence from shapes only (CUDA-graph safe): per_sm (None: _programs_per_sm) programs per SM
    counting every (sequence, head group, split), rounded down, no split shorter than
    MLA_DECODE_MIN_TILES_PER_SPLIT tiles of the block-table width, at most MLA_DECODE_MAX_SPLITS, at
    least 1 (no merge)."""
    tile = mla_decode_tile(heads) if tile is None else tile
    block_h, block_n = tile[:2]
    per_sm = _programs_per_sm(tile) if per_sm is None else per_sm
    groups = batch * triton.cdiv(heads, block_h)
    max_tiles = triton.cdiv(max_blocks * block_size, block_n)
    wanted = per_sm * num_sms // max(groups, 1)
    return max(1, min(wanted, max_tiles // MLA_DECODE_MIN_TILES_PER_SPLIT, MLA_DECODE_MAX_SPLITS))


def mla_decode_num_splits(batch: int, heads: int, max_blocks: int, block_size: int, device) -> int:
    """mla_decode_splits_for on this device's SM count (8 SMs stand in on CPU)."""
    return mla_decode_splits_for(batch, heads, max_blocks, block_size, device_sms(device))


def mla_decode_launch(q_latent, q_rope, cache, block_tables, seq_lens, scale, num_splits, tile=None):
    """mla_decode_triton with an explicit split count and tile (block_h, block_n, num_warps,
    num_stages, swap_ab; None: mla_decode_tile) for tests, benchmarks and the compile-ahead pass."""
    check_mla_inputs(q_latent, q_rope, cache)
    batch, heads, rank = q_latent.shape
    rope = q_rope.shape[-1]
    block_h, block_n, num_warps, num_stages, swap_ab = mla_decode_tile(heads) if tile is None else tile
    out = torch.empty_like(q_latent)
    if batch == 0:
        return out
    block_r = max(triton.next_power_of_2(rank), 16)
    part_out, part_lse = split_partials(out, num_splits)
    grid = (num_splits, batch, triton.cdiv(heads, block_h))
    _mla_decode_kernel[grid](
        q_latent, q_rope, cache, block_tables, seq_lens, out, part_out, part_lse, scale * 1.4426950408889634,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        out.stride(0), out.stride(1), cache.stride(0), cache.stride(1), block_tables.stride(0), num_splits,
        HEADS=heads, RANK=rank, ROPE=rope, BLOCK_SIZE=cache.shape[1], BLOCK_H=block_h, BLOCK_N=block_n,
        BLOCK_R=block_r, BLOCK_P=max(triton.next_power_of_2(rope), 16),
        DOT_PRECISION="ieee" if q_latent.dtype == torch.float32 else "tf32", SPLIT_KEYS=num_splits > 1,
        SWAP_AB=swap_ab, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        launch_chunked_merge(part_out, part_lse, out, num_splits)
    return out


def mla_decode_triton(q_latent, q_rope, cache, block_tables, seq_lens, scale):
    """Triton mla_decode_ref (same shapes and dtypes). CUDA-graph safe: the launch depends only on
    shapes; seq_lens is read on the device. Raises ValueError on mismatched shapes, a strided last
    dim or a block_size that is not a power of two."""
    num_splits = mla_decode_num_splits(
        q_latent.shape[0], q_latent.shape[1], block_tables.shape[1], cache.shape[1], q_latent.device
    )
    return mla_decode_launch(q_latent, q_rope, cache, block_tables, seq_lens, scale, num_splits)
