"""Attention metadata shared by the engine (which fills it) and the attention layer (which reads it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each token of a forward pass lives in the paged KV cache.

    T tokens of B sequences, concatenated in sequence order. Under CUDA graphs every tensor is a
    static buffer and the Python ints are upper bounds, so kernels must not depend on them for
    correctness, only for launch sizes.
    """

    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset; < 0: padding, not stored
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [B] int32: context length including this pass's tokens
    query_start_loc: torch.Tensor  # [B + 1] int32: cumulative query lengths
    max_query_len: int
    max_seq_len: int
    is_decode: bool  # every sequence has exactly one query token
