"""Kernels: each op has a Triton kernel and a plain-torch reference in the same file.

This module is the one place that chooses between them: CUDA tensors take the Triton kernel, CPU
tensors take the reference. `TPFUSE_KERNELS=torch` forces the references everywhere (debugging,
parity checks), `TPFUSE_KERNELS=triton` forces Triton (CPU tests under TRITON_INTERPRET=1).
Callers import the op names below and never branch themselves.
"""

from __future__ import annotations

import torch

from tpfuse import knobs
from tpfuse.kernels import (
    activation,
    counter_random,
    decode_attention,
    fp8_scaled_mm,
    fused_moe,
    gemv,
    grouped_topk,
    kv_store,
    mla_decode,
    mla_prefill,
    mla_rope,
    mla_rope_store,
    mla_store,
    moe_finalize,
    moe_grouped_router,
    moe_norm_router,
    moe_router,
    moe_routing,
    prefill_attention,
    qk_norm_rope_store_kv,
    quant_fp8,
    quant_fp8_w8a8,
    quant_int,
    rmsnorm,
    rope,
    rope_decode_attention,
    rope_store_kv,
    sampling,
    skinny_linear,
)

__all__ = [
    "counter_uniform",
    "decode_attention_op",
    "fp8_linear_op",
    "fp8_rows_linear_op",
    "fused_add_rmsnorm",
    "fused_add_rmsnorm_fp8_rows",
    "fused_add_rmsnorm_half2x",
    "quantize_fp8_rows",
    "fused_experts",
    "fused_experts_slots",
    "int_linear_op",
    "gemv_op",
    "grouped_route",
    "grouped_topk_op",
    "mla_decode_op",
    "mla_prefill_op",
    "mla_rope_norm_store_op",
    "mla_rope_op",
    "moe_combine",
    "moe_finalize_op",
    "moe_norm_route",
    "moe_route",
    "moe_topk",
    "prefill_attention_op",
    "qk_norm_rope_store_kv_op",
    "rmsnorm_op",
    "routed_expert_slots",
    "rope_decode_attention_op",
    "rope_op",
    "rope_store_kv_op",
    "rope_cos_sin_cache",
    "sample",
    "silu_and_mul",
    "silu_and_mul_half2x",
    "skinny_linear_op",
    "store_kv",
    "store_latent_op",
    "use_triton",
    "warm_up_mla_attention",
    "warm_up_prefill_attention",
    "warm_up_sampling",
]

rope_cos_sin_cache = rope.rope_cos_sin_cache


def use_triton(x: torch.Tensor) -> bool:
    mode = knobs.current.kernels
    if mode == "torch":
        return False
    if mode == "triton":
        return True
    return x.is_cuda


def _pick(module, name: str, x: torch.Tensor):
    impl = getattr(module, f"{name}_triton" if use_triton(x) else f"{name}_ref")
    return impl


def rmsnorm_op(x, weight, eps):
    return _pick(rmsnorm, "rmsnorm", x)(x, weight, eps)


def fused_add_rmsnorm(x, residual, weight, eps):
    return _pick(rmsnorm, "fused_add_rmsnorm", x)(x, residual, weight, eps)


def fused_add_rmsnorm_fp8_rows(x, residual, weight, eps, group):
    """fused_add_rmsnorm with the normed rows as kernels/fp8_rows.py's Fp8Rows, `group` columns a scale:
    (rows, new_residual)."""
    return _pick(rmsnorm, "fused_add_rmsnorm_fp8_rows", x)(x, residual, weight, eps, group)


def fused_add_rmsnorm_half2x(x, residual, weight, eps):
    """fused_add_rmsnorm of one row with the normed row as kernels/quant_int_half2.py's Half2X, the f16x2
    INT4 GEMV's operands: (Half2X, new_residual)."""
    return _pick(rmsnorm, "fused_add_rmsnorm_half2x", x)(x, residual, weight, eps)


def quantize_fp8_rows(x, group):
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K / group)]) per (row, group columns)
    (kernels/quant_fp8_w8a8.py)."""
    return _pick(quant_fp8_w8a8, "quantize_fp8_rows", x)(x, group)


def rope_op(positions, q, k, cos_sin_cache):
    return _pick(rope, "rope", q)(positions, q, k, cos_sin_cache)


def rope_store_kv_op(positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping):
    """Rotates q in place and returns it; writes the rotated k and v into their cache slots."""
    return _pick(rope_store_kv, "rope_store_kv", q)(
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping
    )


def qk_norm_rope_store_kv_op(
    positions, q, k, v, q_norm_weight, k_norm_weight, eps, cos_sin_cache, k_cache, v_cache, slot_mapping
):
    """rope_store_kv_op after a per-head RMSNorm of q and k (Qwen3's q_norm / k_norm), in one launch: q is
    normalised and rotated in place and returned; k is normalised, rotated and stored with v."""
    return _pick(qk_norm_rope_store_kv, "qk_norm_rope_store_kv", q)(
        positions, q, k, v, q_norm_weight, k_norm_weight, eps, cos_sin_cache, k_cache, v_cache, slot_mapping
    )


def rope_decode_attention_op(
    positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale,
    qk_norm=None,
):  # fmt: skip
    """A decode step's (q/k norm,) rope, KV store and decode attention, in one launch (plus the merge)
    where that is faster (kernels/rope_decode_attention.py): k, v only read, q may be rotated in place;
    returns [B, Hq, D]. qk_norm: (q_w, k_w, eps) or None."""
    return _pick(rope_decode_attention, "rope_decode_attention", q)(
        positions, q, k, v, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, seq_lens, scale,
        qk_norm,
    )  # fmt: skip


def silu_and_mul(x):
    return _pick(activation, "silu_and_mul", x)(x)


def silu_and_mul_half2x(x):
    """silu_and_mul of one row as kernels/quant_int_half2.py's Half2X, the f16x2 INT4 GEMV's operands."""
    return _pick(activation, "silu_and_mul_half2x", x)(x)


def store_kv(k, v, k_cache, v_cache, slot_mapping):
    return _pick(kv_store, "store_kv", k)(k, v, k_cache, v_cache, slot_mapping)


def decode_attention_op(q, k_cache, v_cache, block_tables, seq_lens, scale, split=True, out=None):
    """split False: one program per (sequence, KV head) (kernels/decode_attention.py); out: where to
    write the result (a view of q's shape), None: a new tensor."""
    return _pick(decode_attention, "decode_attention", q)(
        q, k_cache, v_cache, block_tables, seq_lens, scale, split, out
    )


def prefill_attention_op(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale, tree_mask=None,
    out=None,
):  # fmt: skip
    """tree_mask: None (causal) or [T] int64 relative visibility bits (kernels/prefill_attention.py);
    out: where to write the result (a view of q's shape), None: a new tensor."""
    return _pick(prefill_attention, "prefill_attention", q)(
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale, tree_mask, out
    )


def warm_up_prefill_attention(k_cache, v_cache, num_q_heads, max_query_len, tree) -> int:
    """Compiles every prefill-attention variant an engine can meet before it serves, and the unsplit
    decode kernel a mixed step's decode rows take (CUDA with Triton only: elsewhere nothing compiles
    at first use). Returns the number of launches."""
    if not (k_cache.is_cuda and use_triton(k_cache)):
        return 0
    launches = prefill_attention.compile_prefill_variants(k_cache, v_cache, num_q_heads, max_query_len, tree)
    return launches + decode_attention.compile_unsplit_variants(k_cache, v_cache, num_q_heads)


def warm_up_mla_attention(cache, rope_dim, num_heads, max_query_len) -> int:
    """Compiles every MLA attention variant an engine can meet before it serves (CUDA with Triton
    only). Returns the number of launches."""
    if not (cache.is_cuda and use_triton(cache)):
        return 0
    return mla_prefill.compile_mla_variants(cache, rope_dim, num_heads, max_query_len)


def warm_up_sampling(vocab: int, device: torch.device) -> int:
    """Compiles the sampler's variants before serving (CUDA with Triton only: elsewhere nothing
    compiles at first use). Returns the number of launches."""
    if device.type != "cuda" or knobs.current.kernels == "torch":
        return 0
    return sampling.warm_up_sampling(vocab, device)


def sample(logits, temperatures, top_ks, top_ps, seeds, plan=None):
    """plan: sampling.filter_plan of the rows, when the caller knows it (the Triton path then needs
    no host sync)."""
    return _pick(sampling, "sample", logits)(logits, temperatures, top_ks, top_ps, seeds, plan)


def gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T (+ bias) -> [1, N] of x.dtype, bf16/fp16 (kernels/gemv.py). The model
    calls it only for the weight shapes model/linear_choice.py measured it faster for."""
    return _pick(gemv, "gemv", x)(x, weight, bias)


def skinny_linear_op(x, weight, bias=None, tile=None):
    """x [M, K] @ weight[N, K].T (+ bias) -> [M, N] for 1 <= M <= 64, bf16/fp16 (kernels/skinny_linear.py;
    tile: its launch configuration). The model calls it only for the (weight shape, row bucket) cases
    model/linear_choice.py measured it faster for."""
    if use_triton(x):
        return skinny_linear.skinny_linear_triton(x, weight, bias, tile=tile)
    return skinny_linear.skinny_linear_ref(x, weight, bias)


def counter_uniform(seeds, stream, counters):
    """uniform(seed, stream, counter) draws, [B, N] float64 (kernels/counter_random.py)."""
    return _pick(counter_random, "uniform", seeds)(seeds, stream, counters)


def int_linear_op(x, packed, scales, offsets, bits, group_size, bias=None, tile=None):
    """x [M, K] @ dequant(packed [N, K*bits/32] int32, scales/offsets [N, K/group]).T (+ bias) -> [M, N]
    (kernels/quant_int.py: W4A16/W8A16, group-wise; tile: its launch configuration). x may be one row
    made beforehand as the f16x2 GEMV's operands (kernels/quant_int_half2.py's Half2X)."""
    if use_triton(x):
        return quant_int.int_linear_triton(x, packed, scales, offsets, bits, group_size, bias, tile=tile)
    return quant_int.int_linear_ref(x, packed, scales, offsets, bits, group_size, bias)


def fp8_rows_linear_op(rows, weight, scale, block, bias=None):
    """rows (kernels/fp8_rows.py's Fp8Rows [M, K]) @ (weight [N, K] e4m3 * scale).T (+ bias) -> [M, N] of
    rows.dtype: the W8A8 prefill product without its own quantization (rows.group the weight's
    activation group; kernels/quant_fp8_w8a8.py)."""
    if use_triton(rows.data):
        return quant_fp8_w8a8.fp8_w8a8_rows_triton(rows, weight, scale, block, bias)
    return quant_fp8_w8a8.fp8_w8a8_rows_ref(rows, weight, scale, block, bias)


def fp8_linear_op(x, weight, scale, block, bias=None, tile=None, w8a8=False):
    """x [M, K] @ (weight [N, K] e4m3 * scale [N/block[0], K/block[1]] fp32).T (+ bias) -> [M, N]
    (kernels/quant_fp8.py). w8a8: x quantized to FP8 too, FP8 tensor cores (kernels/quant_fp8_w8a8.py:
    prefill on GPUs where fp8_dot_supported); a W8A8Tile: its decode form at that tile; a GemmRoute:
    W8A8 on the Triton prefill kernel or torch._scaled_mm (kernels/fp8_scaled_mm.py)."""
    if isinstance(tile, fp8_scaled_mm.GemmRoute):
        if not use_triton(x):
            return quant_fp8_w8a8.fp8_w8a8_ref(x, weight, scale, block, bias)
        if tile.scaled_mm:
            return fp8_scaled_mm.fp8_scaled_mm(x, weight, scale, block, bias)
        return quant_fp8_w8a8.fp8_w8a8_triton(x, weight, scale, block, bias)
    if isinstance(tile, quant_fp8_w8a8.W8A8Tile):
        if use_triton(x):
            return quant_fp8_w8a8.fp8_w8a8_decode_triton(x, weight, scale, block, bias, tile=tile)
        return quant_fp8_w8a8.fp8_w8a8_decode_ref(x, weight, scale, block, bias, tile=tile)
    if use_triton(x):
        if w8a8:
            return quant_fp8_w8a8.fp8_w8a8_triton(x, weight, scale, block, bias, tile=tile)
        return quant_fp8.fp8_linear_triton(x, weight, scale, block, bias, tile=tile)
    if w8a8:
        return quant_fp8_w8a8.fp8_w8a8_ref(x, weight, scale, block, bias)
    return quant_fp8.fp8_linear_ref(x, weight, scale, block, bias)


def store_latent_op(latent, k_pe, cache, slot_mapping):
    """MLA: latent [T, R] and rotated k_pe [T, P] into cache [num_blocks, block_size, R + P] at
    slot_mapping (slot < 0 skipped; kernels/mla_store.py)."""
    return _pick(mla_store, "store_latent", latent)(latent, k_pe, cache, slot_mapping)


def mla_decode_op(q_latent, q_rope, cache, block_tables, seq_lens, scale):
    """MLA decode over the absorbed latent: q_latent [B, H, R], q_rope [B, H, P] -> [B, H, R]
    (kernels/mla_decode.py)."""
    return _pick(mla_decode, "mla_decode", q_latent)(q_latent, q_rope, cache, block_tables, seq_lens, scale)


def mla_prefill_op(q_latent, q_rope, cache, block_tables, seq_lens, query_start_loc, max_query_len, scale):
    """MLA causal prefill / verify over the absorbed latent: [T, H, R] (kernels/mla_prefill.py)."""
    return _pick(mla_prefill, "mla_prefill", q_latent)(
        q_latent, q_rope, cache, block_tables, seq_lens, query_start_loc, max_query_len, scale
    )


def mla_rope_op(positions, q_pe, k_pe, cos_sin_cache, interleaved):
    """MLA rope of q_pe [T, H, P] and k_pe [T, P] -> new (q_rot, k_rot) in halves order; torch on every
    device (kernels/mla_rope.py)."""
    return mla_rope.mla_rope_ref(positions, q_pe, k_pe, cos_sin_cache, interleaved)


def mla_rope_norm_store_op(
    positions, q_pe, latent, k_pe, norm_weight, eps, cos_sin_cache, cache, slot_mapping, interleaved
):  # fmt: skip
    """MLA prologue: returns q_rot [T, H, P] (new); writes [rmsnorm(latent), rotated k_pe] into cache
    at slot_mapping (slot < 0 skipped; kernels/mla_rope_store.py)."""
    return _pick(mla_rope_store, "mla_rope_norm_store", q_pe)(
        positions, q_pe, latent, k_pe, norm_weight, eps, cos_sin_cache, cache, slot_mapping, interleaved
    )


def grouped_topk_op(router_logits, correction_bias, top_k, num_groups, topk_groups, norm_topk_prob, scaling):
    """Group-limited sigmoid routing (DeepSeek-V3) -> (weights [T, k] float32, ids [T, k] int32),
    CUDA-graph safe (kernels/grouped_topk.py)."""
    return _pick(grouped_topk, "grouped_topk", router_logits)(
        router_logits, correction_bias, top_k, num_groups, topk_groups, norm_topk_prob, scaling
    )


def grouped_route(x, gate, bias, top_k, num_groups, topk_groups, norm_topk_prob, scaling, tile=None):
    """x [T, H], float32 router weight gate [E, H] -> grouped_topk_op(x @ gate.T in float32, ...) in one
    launch (kernels/moe_grouped_router.py) of launch shape `tile` (a RouteTile; None: the default); for
    decode-sized T, model/moe_choice.py measures where it wins."""
    args = (x, gate, bias, top_k, num_groups, topk_groups, norm_topk_prob, scaling)
    if not use_triton(x):
        return moe_grouped_router.grouped_route_ref(*args)
    return moe_grouped_router.grouped_route_triton(*args, tile or moe_router.ROUTE_TILES[0])


def moe_topk(router_logits, top_k: int, renormalize: bool):
    """router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int32): softmax, the k
    largest (ties: lower id), renormalised to sum 1 when asked (kernels/moe_routing.py)."""
    return _pick(moe_routing, "moe_topk", router_logits)(router_logits, top_k, renormalize)


def moe_route(x, gate, top_k: int, renormalize: bool, tile=None):
    """x [T, H], router weight gate [E, H] -> moe_topk(x @ gate.T rounded to x.dtype, ...) in one launch
    (kernels/moe_router.py) of launch shape `tile` (a RouteTile; None: the default); for decode-sized T,
    model/moe_choice.py measures where it wins."""
    if not use_triton(x):
        return moe_router.moe_route_ref(x, gate, top_k, renormalize)
    return moe_router.moe_route_triton(x, gate, top_k, renormalize, tile or moe_router.ROUTE_TILES[0])


def moe_norm_route(x, residual, norm_weight, gate, eps, tile=None):
    """x (the attention's partial sum), residual [T, H], norm_weight [H], gate [E, H] -> (normed, new
    residual, router logits [T, E] float32): fused_add_rmsnorm then the router linear, in one launch
    (kernels/moe_norm_router.py) of launch shape `tile` (a NormRouterTile; None: the default)."""
    if not use_triton(x):
        return moe_norm_router.moe_norm_router_ref(x, residual, norm_weight, gate, eps)
    tile = tile or moe_norm_router.NORM_ROUTER_TILES[0]
    return moe_norm_router.moe_norm_router_triton(x, residual, norm_weight, gate, eps, tile)


def routed_expert_slots(x, w13, w2, logits, top_k: int, renormalize: bool, tile):
    """fused_experts_slots with the softmax top-k of logits [T, E] float32 inside the per-slot gate/up
    launch (tile: a per-slot MoeTile): -> (slots [T * k, H], topk_weights [T, k], topk_ids [T, k])."""
    if not use_triton(x):
        return fused_moe.routed_slot_outputs_ref(x, w13, w2, logits, top_k, renormalize)
    return fused_moe.routed_slot_outputs_triton(x, w13, w2, logits, top_k, renormalize, tile)


def fused_experts(x, w13, w2, topk_weights, topk_ids):
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk [T, k] -> [T, H] of x.dtype, the weighted sum of
    each token's k experts (kernels/fused_moe.py)."""
    return _pick(fused_moe, "fused_experts", x)(x, w13, w2, topk_weights, topk_ids)


def fused_experts_slots(x, w13, w2, topk_weights, topk_ids):
    """fused_experts without the combine: [T * k, H] of x.dtype, row t * k + j = topk_weights[t, j] *
    expert_{ids[t, j]}(x[t]) (kernels/fused_moe.py), for an epilogue that sums the rows."""
    if use_triton(x):
        return fused_moe.fused_slots_triton(x, w13, w2, topk_weights, topk_ids)
    return fused_moe.fused_experts_ref(x, w13, w2, topk_weights, topk_ids, combine=False).flatten(0, 1)


def moe_finalize_op(slot_out, top_k, residual, weight, eps, shared=None):
    """TP = 1 MoE finalize: (rmsnorm(s) * weight, s) with s = round(sum of each token's k slot rows
    (+ its shared row) + residual) (kernels/moe_finalize.py)."""
    return _pick(moe_finalize, "moe_finalize", residual)(slot_out, top_k, residual, weight, eps, shared)


def moe_combine(slot_out, top_k: int):
    """[T * k, H] -> [T, H]: each token's k rows summed in float32 in slot order, rounded once."""
    if use_triton(slot_out):
        return fused_moe.combine_slots_triton(slot_out, top_k)
    return fused_moe.combine_slots_ref(slot_out, top_k)
