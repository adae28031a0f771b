"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over the paged latent cache, heads split over ranks.

Per token: q from the hidden state (through the q LoRA: q_a_proj -> q_a_layernorm -> q_b_proj, or one
q_proj), and the latent c (kv_lora_rank) plus the shared rope key k_pe from kv_a_proj_with_mqa. The
cache keeps c (normalised by kv_a_layernorm) and rotated k_pe, one row per token, on every rank. The
key up-projection is absorbed into the query, q_latent = q_nope @ W_UK per head, so attention runs over
the latent (kernels/mla_decode.py, kernels/mla_prefill.py) and returns o_latent; v = o_latent @ W_UV.T
per head, then o_proj gives this rank's partial sum. W_UK and W_UV are the two row blocks of each
head in kv_b_proj ([H * (nope + v), kv_lora_rank]), used in place; a quantized checkpoint's kv_b_proj
is dequantized at load into that weight (model/quant/dequantized.py: it is small, and read by the
batched products, not a linear kernel). The q and kv "a" projections are one GEMM (q's part split by
heads, the latent replicated). Every linear takes the checkpoint's method by its checkpoint name
(built under the layer's module_prefix, e.g. "model.layers.3.self_attn.").
"""

from __future__ import annotations

import torch
from torch import nn

from tpfuse.kernels import mla_decode_op, mla_prefill_op, mla_rope_norm_store_op
from tpfuse.model.attention import AttentionMetadata
from tpfuse.model.layers import (
    ColumnParallelLinear,
    ParallelContext,
    RMSNorm,
    RowParallelLinear,
    ShardSlot,
    divide,
)
from tpfuse.model.linear_method import method_for
from tpfuse.model.mla_config import MLAShape
from tpfuse.model.quant.dequantized import DequantizedAtLoad


class MLAAttention(nn.Module):
    """forward(positions [T], hidden [T, H] normed, attn, kv_cache (latent_cache,), cos_sin_cache
    [max_pos, rope_dim]) -> [T, H], this rank's partial sum; writes each token's latent row into
    latent_cache [num_blocks, block_size, kv_lora_rank + rope_dim] at attn.slot_mapping."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        shape: MLAShape,
        eps: float,
        scale: float,
        parallel: ParallelContext,
        dtype: torch.dtype,
    ):
        super().__init__()
        self.shape = shape
        self.scale = scale
        self.num_heads = divide(num_heads, parallel.tp_size, "num_attention_heads")
        heads, rank = self.num_heads, parallel.tp_rank
        latent = shape.kv_lora_rank + shape.qk_rope_head_dim
        latent_range = (latent, 0, latent)  # replicated: every rank computes the whole latent
        if shape.q_lora_rank is not None:
            q_range = (shape.q_lora_rank, 0, shape.q_lora_rank)
            self.q_b_proj = ColumnParallelLinear(
                shape.q_lora_rank, [num_heads * shape.qk_head_dim], parallel, dtype,
                method=method_for("column", ["q_b_proj"]),
            )  # fmt: skip
            self.q_a_layernorm = RMSNorm(shape.q_lora_rank, eps, dtype)
        else:
            q_local = heads * shape.qk_head_dim
            q_range = (num_heads * shape.qk_head_dim, rank * q_local, q_local)
            self.q_b_proj = self.q_a_layernorm = None
        self.a_names = ["q_proj" if self.q_b_proj is None else "q_a_proj", "kv_a_proj_with_mqa"]
        self.fused_a_proj = ColumnParallelLinear(
            hidden_size, [], parallel, dtype, part_ranges=[q_range, latent_range],
            method=method_for("column", self.a_names),
        )  # fmt: skip
        self.kv_a_layernorm = RMSNorm(shape.kv_lora_rank, eps, dtype)
        per_head = shape.qk_nope_head_dim + shape.v_head_dim
        absorbed = DequantizedAtLoad(method_for("column", ["kv_b_proj"]), "MLA's absorbed W_UK / W_UV")
        self.kv_b_proj = ColumnParallelLinear(
            shape.kv_lora_rank, [num_heads * per_head], parallel, dtype, method=absorbed
        )
        self.o_proj = RowParallelLinear(
            num_heads * shape.v_head_dim, hidden_size, parallel, dtype, method=method_for("row", ["o_proj"])
        )

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H_local, nope, kv_lora_rank], W_UV [H_local, v, kv_lora_rank]), views of kv_b_proj's
        weight (the run dtype; dequantized at load from a quantized checkpoint)."""
        s = self.shape
        weight = self.kv_b_proj.weight
        per_head = weight.view(self.num_heads, s.qk_nope_head_dim + s.v_head_dim, s.kv_lora_rank)
        return per_head[:, : s.qk_nope_head_dim], per_head[:, s.qk_nope_head_dim :]

    def input_form(self, num_tokens: int) -> None:
        """None, the plain tensor: the latent and query projections share the normed input
        (model/attention.py's Attention.input_form)."""
        return None

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, ...],
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        if attn.tree_mask is not None:
            raise NotImplementedError(
                "tree attention (--speculative-eagle-topk > 1) is not implemented for MLA"
            )
        s, heads, num_tokens = self.shape, self.num_heads, hidden.shape[0]
        (latent_cache,) = kv_cache
        a = self.fused_a_proj(hidden)
        q_part, latent = a.split(self.fused_a_proj.local_sizes, dim=-1)
        if self.q_b_proj is not None:
            q_part = self.q_b_proj(self.q_a_layernorm(q_part))
        q = q_part.view(num_tokens, heads, s.qk_head_dim)
        q_nope, q_pe = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        c, k_pe = latent.split([s.kv_lora_rank, s.qk_rope_head_dim], dim=-1)
        norm = self.kv_a_layernorm
        q_pe = mla_rope_norm_store_op(
            positions, q_pe, c, k_pe, norm.weight, norm.eps, cos_sin_cache, latent_cache, attn.slot_mapping,
            s.rope_interleave,
        )  # fmt: skip
        w_uk, w_uv = self.absorbed_weights()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, kv_lora_rank]
        if attn.graph_break is not None:

            def core(step_attn: AttentionMetadata, q_latent, q_pe, out) -> None:
                out.copy_(self._attend(q_latent, q_pe, latent_cache, step_attn))

            o = attn.graph_break.attend(core, (q_latent, q_pe), q_latent)
        else:
            o = self._attend(q_latent, q_pe, latent_cache, attn)
        v = torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, v_head_dim]
        return self.o_proj(v.transpose(0, 1).reshape(num_tokens, heads * s.v_head_dim))

    def _attend(self, q_latent, q_pe, latent_cache, attn: AttentionMetadata) -> torch.Tensor:
        """Absorbed attention over the latent cache (its entries already stored): [T, H, kv_lora_rank]."""
        if attn.is_decode:
            return mla_decode_op(q_latent, q_pe, latent_cache, attn.block_tables, attn.seq_lens, self.scale)
        return mla_prefill_op(
            q_latent, q_pe, latent_cache, attn.block_tables, attn.seq_lens, attn.query_start_loc,
            attn.max_query_len, self.scale,
        )  # fmt: skip

    def checkpoint_slots(self, prefix: str) -> dict[str, ShardSlot]:
        """prefix: e.g. "model.layers.3.self_attn."."""
        slots = {prefix + "kv_a_layernorm.weight": self.kv_a_layernorm.slot()}
        slots.update(self.fused_a_proj.checkpoint_slots([prefix + name for name in self.a_names]))
        slots.update(self.kv_b_proj.checkpoint_slots([prefix + "kv_b_proj"]))
        slots.update(self.o_proj.checkpoint_slots(prefix + "o_proj"))
        if self.q_b_proj is not None:
            slots[prefix + "q_a_layernorm.weight"] = self.q_a_layernorm.slot()
            slots.update(self.q_b_proj.checkpoint_slots([prefix + "q_b_proj"]))
        return slots
