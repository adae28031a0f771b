"""MLA decode attention: one query token per sequence, all heads over the absorbed latent cache.

Shapes: q_latent [B, H, R] (q_nope already multiplied by each head's W_UK), q_rope [B, H, P] (rotated),
cache [num_blocks, block_size, R + P] (latent c, then rotated k_pe), output [B, H, R] in the latent
space. The Triton path is mla_attention.py's kernel at q_len 1, split over the sequence: the split
count comes from shapes only (batch, head tiles, block-table width, SM count), never from seq_lens,
so every CUDA-graph replay launches the same grid; the partials are merged in split order.
"""

from __future__ import annotations

import torch
import triton

from tpfuse.kernels.decode_attention import choose_num_splits
from tpfuse.kernels.mla_attention import check_mla_inputs, mla_attention_launch

# Rows (heads) per program, at most, and keys per tile: a first choice, not yet measured; to be set
# from benchmarks/mla_decode.py on the H200.
MLA_DECODE_BLOCK_M = 32
MLA_DECODE_BLOCK_N = 32


def decode_block_m(heads: int) -> int:
    """Heads per program: all of them up to MLA_DECODE_BLOCK_M, never fewer than 16 (tl.dot's minimum)."""
    return max(16, min(triton.next_power_of_2(heads), MLA_DECODE_BLOCK_M))


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
        kv = gather_latent(cache, block_tables[b], n).to(acc)
        scores = (q_latent[b].to(acc) @ kv[:, :rank].T + q_rope[b].to(acc) @ kv[:, rank:].T) * scale
        out[b] = (scores.softmax(-1) @ kv[:, :rank]).to(q_latent.dtype)
    return out


def mla_decode_num_splits(batch: int, heads: int, max_blocks: int, block_size: int, device) -> int:
    """Splits per sequence from shapes only (CUDA-graph safe), decode_attention's rule with the
    head tiles of one sequence in place of its KV heads."""
    head_tiles = triton.cdiv(heads, decode_block_m(heads))
    return choose_num_splits(batch, head_tiles, max_blocks, block_size, device)


def mla_decode_launch(
    q_latent, q_rope, cache, block_tables, seq_lens, scale, num_splits,
    block_m=None, block_n=MLA_DECODE_BLOCK_N, num_warps=4, num_stages=2,
):  # fmt: skip
    """mla_decode_triton with explicit splits and tiles (tests, benchmarks); block_m None: decode_block_m."""
    if block_m is None:
        block_m = decode_block_m(q_latent.shape[1])
    return mla_attention_launch(
        q_latent, q_rope, cache, block_tables, seq_lens, None, 1, scale,
        num_splits, block_m, block_n, num_warps, num_stages,
    )  # fmt: skip


def mla_decode_triton(q_latent, q_rope, cache, block_tables, seq_lens, scale):
    """Triton mla_decode_ref (same shapes and dtypes). CUDA-graph safe: the launch depends only on
    shapes; seq_lens is read on the device. Raises ValueError on mismatched shapes, a strided last
    dim or a block_size that is not a power of two."""
    num_splits = mla_decode_num_splits(
        q_latent.shape[0], q_latent.shape[1], block_tables.shape[1], cache.shape[1], q_latent.device
    )
    return mla_decode_launch(q_latent, q_rope, cache, block_tables, seq_lens, scale, num_splits)
