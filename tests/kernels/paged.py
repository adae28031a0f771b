"""Builders shared by the kernel tests: random paged KV caches and float64 comparisons."""

from __future__ import annotations

import torch


def assert_close_to_float64(actual: torch.Tensor, expected_float64: torch.Tensor, dtype: torch.dtype) -> None:
    """actual (any float dtype) against a float64 reference, with a tolerance of a few ulps of dtype."""
    tol = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    assert actual.dtype == dtype
    assert torch.isfinite(actual).all(), "kernel output has non-finite values (unwritten or masked badly)"
    torch.testing.assert_close(actual.double(), expected_float64, atol=tol, rtol=tol)


def random_paged_kv(
    context_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    device: str | torch.device = "cpu",
    spare_blocks: int = 3,
    spare_columns: int = 2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (k_cache, v_cache, block_tables [B, width] int32, seq_lens [B] int32).

    Physical blocks are shuffled across sequences (tables are not contiguous runs); cache slots that
    hold no key of any sequence (past each seq_len, spare blocks) are NaN, and table entries past a
    sequence's last block are -1, so a kernel that reads beyond seq_len fails loudly.
    """
    blocks_per_seq = [(n + block_size - 1) // block_size for n in context_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen)
    width = max(blocks_per_seq, default=0) + spare_columns
    block_tables = torch.full((len(context_lens), width), -1, dtype=torch.int32)
    holds_a_key = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    used = 0
    for b, (n, count) in enumerate(zip(context_lens, blocks_per_seq, strict=True)):
        physical = order[used : used + count]
        used += count
        block_tables[b, :count] = physical.to(torch.int32)
        holds_a_key[physical] = True
        if n % block_size:
            holds_a_key[physical[-1], n % block_size :] = False
    holds_a_key = holds_a_key.to(device)
    k_cache[~holds_a_key] = float("nan")
    v_cache[~holds_a_key] = float("nan")
    seq_lens = torch.tensor(context_lens, dtype=torch.int32)
    return k_cache, v_cache, block_tables.to(device), seq_lens.to(device)
