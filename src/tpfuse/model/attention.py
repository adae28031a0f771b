"""Attention metadata shared by the engine (which fills it) and the attention layer (which reads it),
and the attention layer."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from tpfuse.kernels import (
    decode_attention_op,
    prefill_attention_op,
    qk_norm_rope_store_kv_op,
    rope_decode_attention_op,
    rope_store_kv_op,
)
from tpfuse.model.config import ModelConfig
from tpfuse.model.input_forms import InputForm, input_form
from tpfuse.model.layers import ParallelContext, QKVParallelLinear, RMSNorm, RowParallelLinear, ShardSlot


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
    tree_mask: torch.Tensor | None = None  # [T] int64 tree attention bits (speculative trees), None: causal
    num_decode_rows: int = 0  # leading sequences with one query token (a mixed step's decodes)
    graph_break: GraphBreak | None = None  # set only while a piecewise CUDA graph is captured

    @functools.cached_property
    def chunks(self) -> AttentionMetadata:
        """The sequences after the leading num_decode_rows, as metadata of their own, built once a
        step. Fresh copies, not views: a view past row 0 is not 16-byte aligned, and Triton would
        compile new variants of the kernels warmed up at start-up for it."""
        d = self.num_decode_rows
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[d:],  # the decodes' d tokens come first
            block_tables=self.block_tables[d:].clone(),
            seq_lens=self.seq_lens[d:].clone(),
            query_start_loc=self.query_start_loc[d:] - d,
            max_query_len=self.max_query_len,
            max_seq_len=self.max_seq_len,
            is_decode=False,
        )


class GraphBreak(Protocol):
    """Set as AttentionMetadata.graph_break while a piecewise CUDA graph is captured
    (engine/piecewise_graphs.py): the layer's attention core is not run in place, but handed over.

    attend(core, inputs, like) ends the graph piece being captured (inputs copied into static
    buffers first), arranges that at replay core(step_attn, *inputs[:T], out[:T]) runs eagerly
    between this piece and the next on the step's own metadata, starts the next piece, and returns
    out: the static tensor (like's shape and dtype) the core will have written.
    """

    def attend(
        self, core: Callable[..., None], inputs: tuple[torch.Tensor, ...], like: torch.Tensor
    ) -> torch.Tensor: ...


def paged_attention(
    positions,
    q,
    k,
    v,
    kv_cache,
    cos_sin_cache,
    attn: AttentionMetadata,
    scale: float,
    qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
):
    """(Per-head q/k RMSNorm,) rotary embedding, KV-cache store and attention over the paged cache, for
    one layer.

    positions: [T]; q: [T, Hq, D] (may be normed and rotated in place); k, v: [T, Hk, D] (not modified;
    the normed, rotated k and v are written into kv_cache = (k_cache, v_cache) at attn.slot_mapping).
    qk_norm: (q_norm, k_norm) over head_dim, of one eps (Qwen3), or None. Returns [T, Hq, D]:
    attend_paged's result (or, while a piecewise graph is captured, the graph break's output). A decode
    step does it all in the attention launch (kernels/rope_decode_attention.py).
    """
    k_cache, v_cache = kv_cache
    if attn.is_decode and attn.graph_break is None:
        norms = None if qk_norm is None else (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps)
        return rope_decode_attention_op(
            positions, q, k, v, cos_sin_cache, k_cache, v_cache, attn.slot_mapping, attn.block_tables,
            attn.seq_lens, scale, norms,
        )  # fmt: skip
    # One launch: q (normed and) rotated in place, rotated k and v written to their slots (k untouched).
    if qk_norm is None:
        rope_store_kv_op(positions, q, k, v, cos_sin_cache, k_cache, v_cache, attn.slot_mapping)
    else:
        q_norm, k_norm = qk_norm
        qk_norm_rope_store_kv_op(
            positions, q, k, v, q_norm.weight, k_norm.weight, q_norm.eps, cos_sin_cache, k_cache, v_cache,
            attn.slot_mapping,
        )  # fmt: skip
    if attn.graph_break is not None:

        def core(step_attn: AttentionMetadata, q: torch.Tensor, out: torch.Tensor) -> None:
            attend_paged(q, kv_cache, step_attn, scale, out)

        return attn.graph_break.attend(core, (q,), q)
    return attend_paged(q, kv_cache, attn, scale)


def attend_paged(q, kv_cache, attn: AttentionMetadata, scale: float, out=None) -> torch.Tensor:
    """Attention of q [T, Hq, D] over the paged cache (its K/V already stored): decode attention when
    every sequence has one query token, decode rows then prompt chunks for a mixed step, else prefill
    attention (causal, or the speculative tree mask). Written into out ([T, Hq, D]) when given."""
    k_cache, v_cache = kv_cache
    if attn.is_decode:
        return decode_attention_op(q, k_cache, v_cache, attn.block_tables, attn.seq_lens, scale, out=out)
    if 0 < attn.num_decode_rows < attn.block_tables.shape[0] and attn.tree_mask is None:
        return mixed_attention(q, kv_cache, attn, scale, out)
    return prefill_attention_op(
        q,
        k_cache,
        v_cache,
        attn.block_tables,
        attn.seq_lens,
        attn.query_start_loc,
        attn.max_query_len,
        scale,
        tree_mask=attn.tree_mask,
        out=out,
    )


def mixed_attention(q, kv_cache, attn: AttentionMetadata, scale: float, out=None) -> torch.Tensor:
    """Attention of a mixed step whose first D = attn.num_decode_rows sequences have one query token
    (rows 0..D-1 of q): those by the decode kernel, the prompt chunks after them by the prefill
    kernel, whose tiles are sized for a chunk and would run a decode row at a few rows of 128.
    Each writes its rows of out (a new tensor when None). Returns [T, Hq, D_head] as attend_paged."""
    k_cache, v_cache = kv_cache
    d, rest = attn.num_decode_rows, attn.chunks
    out = torch.empty_like(q) if out is None else out
    # Unsplit: the split rule depends on d and the table width, and each count is a compile.
    decode_attention_op(
        q[:d], k_cache, v_cache, attn.block_tables[:d], attn.seq_lens[:d], scale, split=False, out=out[:d]
    )
    prefill_attention_op(
        q[d:], k_cache, v_cache, rest.block_tables, rest.seq_lens, rest.query_start_loc, rest.max_query_len,
        scale, out=out[d:],
    )  # fmt: skip
    return out


class Attention(nn.Module):
    """Self-attention of one decoder layer over the paged KV cache, heads split over ranks.

    qkv projection -> (Qwen3: per-head RMSNorm of q and k, in the same launch as) rotary embedding fused
    with the K/V store into the cache -> paged decode or prefill attention (a decode step may do all of
    it in the attention launch) -> o_proj, whose output is this rank's partial sum.
    """

    def __init__(self, config: ModelConfig, parallel: ParallelContext):
        super().__init__()
        dtype, d = config.dtype, config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            d,
            config.num_heads,
            config.num_kv_heads,
            parallel,
            dtype,
            bias=config.attention_bias,
        )
        self.num_heads = self.qkv_proj.num_heads_local
        self.num_kv_heads = self.qkv_proj.num_kv_heads_local
        self.head_dim = d
        self.scale = d**-0.5
        self.o_proj = RowParallelLinear(config.num_heads * d, config.hidden_size, parallel, dtype)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(d, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def checkpoint_slots(self, prefix: str) -> dict[str, ShardSlot]:
        """Checkpoint tensor name (under prefix, e.g. "model.layers.0.self_attn.") -> this rank's slot."""
        slots = self.qkv_proj.checkpoint_slots([prefix + name for name in ("q_proj", "k_proj", "v_proj")])
        slots.update(self.o_proj.checkpoint_slots(prefix + "o_proj"))
        if self.q_norm is not None:
            slots[prefix + "q_norm.weight"] = self.q_norm.slot()
            slots[prefix + "k_norm.weight"] = self.k_norm.slot()
        return slots

    def input_form(self, num_tokens: int) -> InputForm | None:
        """The form the input norm should write this layer's input in (model/input_forms.py), None for
        the plain tensor: its qkv projection's choice."""
        return input_form(self.qkv_proj, num_tokens)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        """positions: [T] int64; hidden: [T, H] (normed; in input_form's form); kv_cache: (k, v)
        each [num_blocks, block_size, num_kv_heads_local, head_dim], written at attn.slot_mapping.
        Returns [T, H], this rank's partial sum of the attention output."""
        num_tokens, d = positions.shape[0], self.head_dim
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q = q.view(num_tokens, self.num_heads, d)
        k = k.view(num_tokens, self.num_kv_heads, d)
        v = v.view(num_tokens, self.num_kv_heads, d)
        qk_norm = None if self.q_norm is None else (self.q_norm, self.k_norm)
        out = paged_attention(positions, q, k, v, kv_cache, cos_sin_cache, attn, self.scale, qk_norm)
        return self.o_proj(out.view(num_tokens, self.num_heads * d))
