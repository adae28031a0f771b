"""Writes each token's key and value into its slot of the paged KV cache."""

from __future__ import annotations

import torch


def store_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, Hk, D]; k_cache, v_cache: [num_blocks, block_size, Hk, D], written in place.

    slot_mapping: [T] int, slot = block * block_size + offset; a negative slot means "do not store"
    (padding tokens of a CUDA-graph batch).
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)
