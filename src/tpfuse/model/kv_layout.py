"""KV-cache layouts: what a model keeps per token and layer, declared by the model, sized and allocated
by the engine.

A layout says how many bytes one paged block costs on this rank, allocates every layer's cache
tensors (zeroed: masked-out lanes of attention kernels may read stale slots, which must not hold
NaN) and compiles the attention variants an engine can meet before it serves. Every layer's cache
is a tuple of tensors whose first two dims are [num_blocks, block_size], so slot s of a tensor t is
t.view(-1, *t.shape[2:])[s] (speculative KV moves, CUDA graphs and the prefix cache need no more).

- GQACacheLayout: (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads_local, head_dim].
- LatentCacheLayout (MLA): (latent_cache,) [num_blocks, block_size, kv_lora_rank + rope_dim], one
  "head" per token, replicated on every tensor-parallel rank.
A model without a `kv_cache_layout(tp_size)` method gets the GQA layout of its config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from tpfuse.kernels import warm_up_mla_attention, warm_up_prefill_attention

LayerCache = tuple[torch.Tensor, ...]


class KVCacheLayout(Protocol):
    num_layers: int

    def bytes_per_block(self, block_size: int) -> int: ...

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> list[LayerCache]: ...

    def warm_up(self, layer_cache: LayerCache, num_q_heads: int, max_query_len: int, tree: bool) -> int: ...


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class GQACacheLayout:
    """Per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]; num_kv_heads
    is this rank's share."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        return (
            2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * _element_size(self.dtype)
        )

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> list[LayerCache]:
        shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=device),
                torch.zeros(shape, dtype=self.dtype, device=device),
            )
            for _ in range(self.num_layers)
        ]

    def warm_up(self, layer_cache: LayerCache, num_q_heads: int, max_query_len: int, tree: bool) -> int:
        return warm_up_prefill_attention(*layer_cache, num_q_heads, max_query_len, tree)


@dataclass(frozen=True)
class LatentCacheLayout:
    """Per layer (latent_cache,) [num_blocks, block_size, kv_lora_rank + rope_dim]: MLA's compressed
    KV, the same on every rank (attention heads split, the latent does not)."""

    num_layers: int
    kv_lora_rank: int
    rope_dim: int
    dtype: torch.dtype

    @property
    def row_width(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def bytes_per_block(self, block_size: int) -> int:
        return self.num_layers * block_size * self.row_width * _element_size(self.dtype)

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> list[LayerCache]:
        shape = (num_blocks, block_size, self.row_width)
        return [(torch.zeros(shape, dtype=self.dtype, device=device),) for _ in range(self.num_layers)]

    def warm_up(self, layer_cache: LayerCache, num_q_heads: int, max_query_len: int, tree: bool) -> int:
        del tree  # MLA has no tree-mask variant (tree drafting is refused by the attention layer)
        return warm_up_mla_attention(layer_cache[0], self.rope_dim, num_q_heads, max_query_len)
