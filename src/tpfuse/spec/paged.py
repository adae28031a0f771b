"""AttentionMetadata for a drafter's forward passes over its paged KV cache.

A drafter's cache holds one entry per position of each sequence, like the target's, so it can use
the target's block tables (the engine then allocates the drafter's K/V tensors with the same number
of blocks) or block tables of its own. The engine must have allocated blocks for every position a
drafter writes: the verified positions plus num_draft_tokens of lookahead.
"""

from __future__ import annotations

import torch

from tpfuse.model.attention import AttentionMetadata


def slots_of_positions(
    block_tables: torch.Tensor, block_size: int, seq_index: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """block_tables: [B, M] int32; seq_index, positions: [T] int64. Returns [T] int64 cache slots."""
    blocks = block_tables[seq_index, positions // block_size].to(torch.int64)
    return blocks * block_size + positions % block_size


def metadata_for_positions(
    block_tables: torch.Tensor,
    block_size: int,
    positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> AttentionMetadata:
    """Metadata for a pass whose tokens of sequence b are positions[query_start_loc[b]:
    query_start_loc[b+1]], contiguous and ending the sequence's context (so seq_len = last + 1).

    block_tables: [B, M] int32; positions: [T] int64; query_start_loc: [B + 1] int32, every
    sequence with at least one token. max_query_len / max_seq_len: host-known upper bounds (the
    engine's); without them they are read from the device (a synchronisation, not capturable).
    """
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int64)
    seq_index = torch.repeat_interleave(  # output_size given: no device-to-host read
        torch.arange(len(query_lens), device=positions.device), query_lens, output_size=positions.shape[0]
    )
    last = positions[query_start_loc[1:].to(torch.int64) - 1]
    seq_lens = (last + 1).to(torch.int32)
    if max_query_len is None:
        max_query_len = int(query_lens.max()) if len(query_lens) else 0
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if len(seq_lens) else 0
    return AttentionMetadata(
        slot_mapping=slots_of_positions(block_tables, block_size, seq_index, positions),
        block_tables=block_tables,
        seq_lens=seq_lens,
        query_start_loc=query_start_loc.to(torch.int32),
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        is_decode=max_query_len == 1,
    )


def decode_metadata(
    block_tables: torch.Tensor, block_size: int, positions: torch.Tensor, max_seq_len: int | None = None
) -> AttentionMetadata:
    """Metadata for one token per sequence at positions [B] int64 (each the sequence's newest).
    max_seq_len: a host-known bound of positions + 1 (skips a device read)."""
    batch = positions.shape[0]
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=positions.device)
    return metadata_for_positions(block_tables, block_size, positions, query_start_loc, 1, max_seq_len)
