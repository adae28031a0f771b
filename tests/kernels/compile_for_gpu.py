"""Compiles every tpfuse Triton kernel for an NVIDIA target without a GPU (ttir -> ptx -> cubin).

The interpreter that CPU tests use accepts code the real compiler rejects (non-constexpr block
sizes, loop-carried type changes, dot shapes), so this runs the real compiler ahead of time.
Usage: python tests/kernels/compile_for_gpu.py [capability, default 90] [dtypes, default bf16,fp16]
with TRITON_INTERPRET unset.
Prints one line per kernel variant and exits non-zero if any fails.
"""

from __future__ import annotations

import itertools
import os
import sys
import traceback

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from tpfuse.kernels import (
    activation,
    counter_random,
    decode_attention,
    decode_merge,
    fused_moe,
    fused_moe_gemv,
    fused_moe_tiles,
    gemv,
    grouped_topk,
    kv_store,
    mla_attention,
    mla_decode,
    moe_align,
    moe_finalize,
    moe_grouped_router,
    moe_norm_router,
    moe_router,
    moe_routing,
    paged_attention_common,
    prefill_attention,
    qk_norm_rope_store_kv,
    quant_dot,
    quant_fp8,
    quant_fp8_w8a8,
    quant_int,
    quant_int_magic,
    quant_moe,
    quant_moe_grouped,
    quant_moe_w8a8,
    rmsnorm,
    rope,
    rope_decode_attention,
    rope_store_kv,
    sampling,
    sampling_cut,
    skinny_linear,
)
from tpfuse.kernels.mla_prefill import mla_prefill_tile_config
from tpfuse.kernels.prefill_attention import prefill_tile_config

SHARED_MEMORY_LIMIT = 227 * 1024  # bytes per block on H100 / H200
INT_ARGS = (  # i32 scalars by name
    "hidden", "inter", "vocab", "num_heads", "head_dim", "num_splits",
    "num_slots", "num_experts", "num_blocks",
)  # fmt: skip


def _signature(kernel, pointers: dict[str, str], scalars: dict[str, str], constexprs: dict):
    """Triton's signature of a launch variant. A kernel that takes PDL (kernels/pdl.py) compiles with it
    on, as Hopper runs it, unless constexprs says otherwise (set there in place)."""
    if "PDL" in kernel.arg_names:
        constexprs.setdefault("PDL", True)
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
        elif name in scalars:
            signature[name] = scalars[name]
        elif name.startswith("stride") or name in INT_ARGS:
            signature[name] = "i32"
        elif name.endswith("_ptr"):
            signature[name] = pointers["*"]
        else:
            raise KeyError(f"no type for argument {name} of {kernel.fn.__name__}")
    return signature


def _variants(dtype: str):
    """(kernel, pointer types, scalar types, constexprs[, compile options]) per launch variant."""
    p = "*" + dtype
    attention = dict(scale_log2e="fp32")
    decode_common = dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_G=16, BLOCK_D=128, DOT_PRECISION="tf32")
    yield rmsnorm._rmsnorm_kernel, {"*": p}, {"eps": "fp32"}, dict(BLOCK_H=4096)
    skinny = dict(HIDDEN=4096, K_PER_SPLIT=2048, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, EVEN=True,
                  HAS_BIAS=False)  # fmt: skip
    for split, swap in itertools.product((1, 2), (False, True)):
        yield (
            skinny_linear._skinny_linear_kernel, {"*": p, "partials_ptr": "*fp32", "counter_ptr": "*i32"},
            {"num_rows": "i32", "num_cols": "i32"}, dict(skinny, SPLIT_K=split, SWAP=swap),
        )  # fmt: skip
    plain_norm = dict(BLOCK_H=4096, FP8_GROUP=0, HALF2X=False)
    yield rmsnorm._fused_add_rmsnorm_kernel, {"*": p}, {"eps": "fp32"}, plain_norm
    for group in (4096, 128):  # FP8 rows: a scale a row, a scale a 128-column group
        yield (
            rmsnorm._fused_add_rmsnorm_kernel, {"*": p, "out_ptr": "*fp8e4nv", "scales_ptr": "*fp32"},
            {"eps": "fp32"}, dict(BLOCK_H=4096, FP8_GROUP=group, HALF2X=False),
        )  # fmt: skip
    half2x = {"*": p, "scales_ptr": "*fp32", "pairs_ptr": "*i32"}  # the INT4 GEMV's x: pairs, stats
    yield rmsnorm._fused_add_rmsnorm_kernel, half2x, {"eps": "fp32"}, dict(plain_norm, HALF2X=True)
    yield (
        rope._rope_kernel,
        {"*": p, "positions_ptr": "*i64", "cache_ptr": "*fp32"},
        {"num_q_heads": "i32", "num_k_heads": "i32"},
        dict(HALF=64, BLOCK_HALF=64, BLOCK_QH=32, BLOCK_KH=8),
    )
    yield (
        rope_store_kv._rope_store_kv_kernel,
        {"*": p, "positions_ptr": "*i64", "slot_ptr": "*i64", "cos_sin_ptr": "*fp32"},
        {"num_q_heads": "i32", "num_kv_heads": "i32"},
        dict(HALF=64, BLOCK_HALF=64, BLOCK_QH=32, BLOCK_KH=8, BLOCK_SIZE=16),
    )
    yield (
        qk_norm_rope_store_kv._qk_norm_rope_store_kv_kernel,
        {"*": p, "positions_ptr": "*i64", "slot_ptr": "*i64", "cos_sin_ptr": "*fp32"},
        {"num_q_heads": "i32", "eps": "fp32"},
        dict(HALF=64, BLOCK_D=128, BLOCK_HALF=64, BLOCK_SIZE=16),
        {"num_warps": 1},
    )
    yield activation._silu_and_mul_kernel, {"*": p}, {}, dict(BLOCK=1024, HALF2X=False)
    half2x = {"*": p, "pairs_ptr": "*i32", "stats_ptr": "*fp32"}
    yield activation._silu_and_mul_kernel, half2x, {}, dict(BLOCK=1024, HALF2X=True)
    yield (
        kv_store._store_kv_kernel,
        {"*": p, "slot_ptr": "*i64"},
        {},
        dict(BLOCK_SIZE=16, BLOCK_HEADS=8, BLOCK_D=128),
    )
    kv = {"*": p, "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "counter_ptr": "*i32"}
    for splits, merge_in_kernel in ((1, False), (8, False), (16, True)):
        parts = {"part_out_ptr": p if splits == 1 else "*fp32", "part_lse_ptr": p if splits == 1 else "*fp32"}
        yield (
            decode_attention._decode_split_kernel,
            {**kv, **parts},
            attention,
            dict(decode_common, NUM_SPLITS=splits, BLOCK_N=paged_attention_common.DECODE_BLOCK_N,
                 MERGE_IN_KERNEL=merge_in_kernel),
        )  # fmt: skip
    rope_kv = {**kv, "positions_ptr": "*i64", "slot_ptr": "*i64", "cos_sin_ptr": "*fp32"}
    for splits, qk_norm in ((1, True), (16, True), (16, False)):
        parts = {"part_out_ptr": p if splits == 1 else "*fp32", "part_lse_ptr": p if splits == 1 else "*fp32"}
        yield (
            rope_decode_attention._rope_decode_split_kernel,
            {**rope_kv, **parts},
            dict(attention, eps="fp32"),
            dict(decode_common, HALF=64, NUM_SPLITS=splits, BLOCK_N=paged_attention_common.DECODE_BLOCK_N,
                 QK_NORM=qk_norm, MERGE_IN_KERNEL=False),
        )  # fmt: skip
    yield (
        decode_merge._decode_merge_kernel,
        {"*": p, "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"},
        {},
        dict(HEAD_DIM=128, BLOCK_S=16, BLOCK_D=128),
    )
    prefill_tiles = {prefill_tile_config(q, 128, group=4) for q in (1, 4, 64, 4096)}
    for (block_m, block_n, num_warps, num_stages), tree, splits in itertools.product(
        prefill_tiles, (False, True), (1, 16)
    ):
        yield (
            prefill_attention._prefill_kernel,
            {
                **kv,
                "part_out_ptr": "*fp32",
                "part_lse_ptr": "*fp32",
                "query_start_loc_ptr": "*i32",
                "tree_mask_ptr": "*i64",
            },
            attention,
            dict(
                HAS_TREE_MASK=tree,
                GROUP=4,
                HEAD_DIM=128,
                BLOCK_SIZE=16,
                BLOCK_M=block_m,
                BLOCK_N=block_n,
                BLOCK_D=128,
                DOT_PRECISION="tf32",
                SPLIT_KEYS=splits > 1,
            ),
            {"num_warps": num_warps, "num_stages": num_stages},
        )
    yield (
        counter_random._uniform_kernel,
        {"seeds_ptr": "*i64", "counters_ptr": "*i64", "out_ptr": "*fp64"},
        {"stream_word": "i64", "n": "i32", "stride_cb": "i64"},
        dict(BLOCK=counter_random.UNIFORM_BLOCK),
    )
    sample = {
        "*": "*fp32",
        "logits_ptr": p,
        "seeds_ptr": "*i64",
        "out_ptr": "*i64",
        "part_tokens_ptr": "*i32",
    }
    modes = ((False, False, True), (True, False, True), (False, True, True), (False, True, False))
    for filtered, cut, split in modes:  # (FILTERED, CUT, SPLIT)
        yield (
            sampling._sample_kernel, sample, {"chunk": "i32"},
            dict(FILTERED=filtered, CUT=cut, BLOCK_V=sampling.SAMPLE_BLOCK, SPLIT=split),
            {"num_warps": sampling.SAMPLE_WARPS},
        )  # fmt: skip
    yield sampling._merge_kernel, sample, {"parts": "i32"}, dict(PARTS=128), {"num_warps": 1}
    cut = {"*": "*fp32", "logits_ptr": p, "top_ks_ptr": "*i64", "counts_ptr": "*i32", "work_ptr": "*i64"}
    cut_ints = {"chunk": "i32", "parts": "i32"}
    parts = sampling_cut.parts_per_row(1, 128256)
    for kernel, constexprs in sampling_cut.pass_launches(parts):
        yield kernel, cut, cut_ints, constexprs, {"num_warps": sampling_cut.PASS_WARPS}
    yield sampling_cut._finish_kernel, cut, cut_ints, {}, {"num_warps": 1}
    for hidden, even, has_bias in ((4096, True, False), (14336, True, False), (2000, False, True)):
        yield (
            gemv._gemv_kernel,
            {"*": p},
            {"num_cols": "i32"},
            dict(HIDDEN=hidden, BLOCK_N=gemv.BLOCK_N, BLOCK_K=gemv.BLOCK_K, EVEN=even, HAS_BIAS=has_bias),
            {"num_warps": gemv.NUM_WARPS, "num_stages": 1},
        )
    yield from _moe_variants(p)
    yield from _quant_variants(p)
    yield from _mla_variants(p)


def _mla_variants(p: str):
    """The MLA decode kernel and the MLA prefill / verify kernel at DeepSeek-V3's latent (rank 512 +
    rope 64) and 16 heads a rank (TP 8), keys whole and split."""
    latent = dict(HEADS=16, RANK=512, ROPE=64, BLOCK_SIZE=16, BLOCK_R=512, BLOCK_P=64, DOT_PRECISION="tf32")
    block_h, block_n, warps, stages, swap = mla_decode.mla_decode_tile(16)
    prefill_m, prefill_n, prefill_warps, prefill_stages = mla_prefill_tile_config(8, 16)
    for splits in (1, 2):
        part = "*fp32" if splits > 1 else p
        ptrs = {"*": p, "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "part_out_ptr": part,
                "part_lse_ptr": part}  # fmt: skip
        yield (
            mla_decode._mla_decode_kernel, ptrs, {"scale_log2e": "fp32"},
            dict(latent, BLOCK_H=block_h, BLOCK_N=block_n, SPLIT_KEYS=splits > 1, SWAP_AB=swap),
            {"num_warps": warps, "num_stages": stages},
        )  # fmt: skip
        yield (
            mla_attention._mla_kernel, {**ptrs, "query_start_loc_ptr": "*i32"}, {"scale_log2e": "fp32"},
            dict(latent, BLOCK_M=prefill_m, BLOCK_N=prefill_n, SPLIT_KEYS=splits > 1, IS_DECODE=False),
            {"num_warps": prefill_warps, "num_stages": prefill_stages},
        )  # fmt: skip


def _quant_variants(p: str):
    """The weight-only kernels in each form and scale mode at a tile start-up timing tries
    (model/linear_choice.py), the FP8 W8A8 product and the quantized expert slots, at the engine's
    layouts (4096-wide, group 128 / 32, 128-column FP8 blocks or per-channel)."""
    from tpfuse.model.linear_choice import QUANT_TILES

    fp8, i32 = "*fp8e4nv", "*i32"
    ints = {"num_rows": "i32", "num_cols": "i32", "k_per_split": "i32"}
    for group in (128, 32):
        tile = QUANT_TILES[1][0]
        yield (
            quant_int._int_gemv_kernel, {"*": p, "q_ptr": i32}, ints,
            dict(BITS=4, GROUP=group, HAS_OFFSET=False, HAS_BIAS=False, BLOCK_N=tile.block_n,
                 BLOCK_K=quant_int.gemv_block_k(tile.block_k, 4096, 4), EVEN=True, X_PAIRS=group == 128),
            {"num_warps": tile.num_warps, "num_stages": tile.num_stages},
        )  # fmt: skip
    magic = {"*": p, "q_ptr": i32, "partials_ptr": "*fp32", "counter_ptr": i32}
    magic_ints = {"num_cols": "i32", "k_per_split": "i32", "nibbles": "i32"}
    for tile in (t for t in QUANT_TILES[1] if isinstance(t, quant_int.MagicTile)):
        for group, offsets in ((128, False), (32, True)):
            yield (
                quant_int_magic._magic_kernel, magic, magic_ints,
                dict(GROUP=group, HAS_OFFSET=offsets, HAS_BIAS=offsets, BLOCK_N=tile.block_n,
                     BLOCK_K=quant_int_magic.magic_block_k(tile.block_k, 4096, group),
                     SUM_STEPS=quant_int_magic.SUM_STEPS, SPLIT_K=tile.split_k,
                     PREFETCH=tile.num_stages == 1, EVEN=not offsets),
                {"num_warps": tile.num_warps, "num_stages": tile.num_stages},
            )  # fmt: skip
    gemv_forms = quant_int.quant_int_gemv
    form_ints = {"num_cols": "i32", "m_lo": "i32", "m_hi": "i32", "zero": "i32"}
    for index, tile in enumerate(t for t in QUANT_TILES[1] if isinstance(t, gemv_forms.GemvTile)):
        cases = [(4, 4096, 128, False), (4, 14336, 128, False), (4, 4096, 32, True)]
        for bits, hidden, group, odd in cases + [(8, 4096, 128, True)] * (index == 0):
            block_k = gemv_forms.gemv_step(tile, hidden, bits)
            xs = tile.form == "xs" and block_k >= hidden
            kernel = gemv_forms._xs_kernel if xs else gemv_forms._vec_kernel
            yield (
                kernel, {"*": p, "q_ptr": i32, "o_ptr": "*fp32"}, form_ints,
                dict(hidden=hidden, stride_qn=hidden * bits // 32, stride_sn=hidden // group, BITS=bits,
                     GROUP=group, HAS_OFFSET=odd, HAS_BIAS=odd, BLOCK_N=tile.block_n, BLOCK_K=block_k,
                     PREFETCH=tile.prefetch, EVEN_N=not odd, K_MASK=gemv_forms.k_mask(hidden, block_k, bits),
                     X_PAIRS=p == "*bf16", PIN=tile.pin),
                {"num_warps": tile.num_warps, "num_stages": 1}
                | ({"maxnreg": tile.max_registers} if tile.max_registers else {}),
            )  # fmt: skip
    for scale_n, scale_k in ((1, 128), (1, 4096), (128, 128)):  # per-row blocks, per-channel, X_SCALE
        tile = quant_fp8.FP8_TILES[1][0]
        x_scale = scale_n % tile.block_n == 0 and scale_k < 4096
        per_row, sub_k, subs = quant_fp8.gemv_steps(tile.block_k, scale_k, 4096, x_scale)
        yield (
            quant_fp8._fp8_gemv_kernel, {"*": p, "w_ptr": fp8, "s_ptr": "*fp32"}, ints,
            dict(SCALE_N=scale_n, SCALE_K=scale_k, PER_ROW=per_row, HAS_BIAS=False, BLOCK_N=tile.block_n,
                 SUB_K=sub_k, SUBS=subs, EVEN=True, X_SCALE=x_scale),
            {"num_warps": tile.num_warps, "num_stages": tile.num_stages},
        )  # fmt: skip
    fp8_tiles = quant_fp8.FP8_TILES
    dots = [(4, 128, QUANT_TILES[16][0], False), (4, 128, QUANT_TILES[64][1], False),
            (0, 128, fp8_tiles[16][0], False), (0, 128, fp8_tiles[64][1], False),
            (0, 4096, fp8_tiles[32][0], False), (4, 128, quant_dot.default_tile(65), True),
            (0, 128, fp8_tiles[64][2], False), (4, 128, QUANT_TILES[16][2], False)]  # fmt: skip
    # the W8A8 decode candidates (kernels/quant_fp8_w8a8.py) at per-channel and 128-block scales
    dots += [(0, scale_k, tile, False) for tiles in quant_fp8_w8a8.W8A8_TILES.values() for tile in tiles
             for scale_k in (128, 4096)]  # fmt: skip
    for bits, scale_k, tile, offsets in dots:
        block_k, mode = quant_dot.scale_plan(tile.block_k, scale_k, 4096, offsets)
        scales = "*fp32" if bits == 0 else p
        x_fp8 = quant_dot.X_AS_IS
        if isinstance(tile, quant_fp8_w8a8.W8A8Tile):
            x_fp8 = quant_dot.X_QUANTIZED if tile.prequantize else quant_dot.X_QUANTIZE_HERE
        yield (
            quant_dot._quant_dot_kernel,
            {"*": p, "w_ptr": fp8 if bits == 0 else i32, "s_ptr": scales, "o_ptr": "*fp32",
             "partials_ptr": "*fp32", "counter_ptr": i32, "xs_ptr": "*fp32"}
            | ({"x_ptr": fp8} if x_fp8 == quant_dot.X_QUANTIZED else {}), ints,
            dict(BITS=bits, SCALE_N=1, SCALE_K=scale_k, SCALE_MODE=mode, HAS_OFFSET=offsets,
                 HAS_BIAS=offsets, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k,
                 SWAP=tile.swap, SPLIT_K=tile.split_k, EVEN_K=not offsets, DOT_PRECISION="tf32", X_FP8=x_fp8),
            {"num_warps": tile.num_warps, "num_stages": tile.num_stages},
        )  # fmt: skip
    for per_block, (block_m, warps) in ((True, (64, 4)), (False, (128, 8))):
        yield (
            quant_fp8_w8a8._fp8_w8a8_kernel,
            {"*": p, "xq_ptr": fp8, "w_ptr": fp8, "xs_ptr": "*fp32", "s_ptr": "*fp32"}, ints,
            dict(HIDDEN=4096, SCALE_N=128 if per_block else 1, PER_BLOCK=per_block, HAS_BIAS=False,
                 BLOCK_M=block_m, BLOCK_N=128,
                 BLOCK_K=128),
            {"num_warps": warps, "num_stages": 3},
        )  # fmt: skip
    for group in (128, 4096):  # the W8A8 activations: a scale a 128-column group, a scale a row
        yield (
            quant_fp8_w8a8._quantize_rows_kernel, {"*": p, "q_ptr": fp8, "s_ptr": "*fp32"}, {},
            dict(HIDDEN=4096, GROUP=group, BLOCK=group),
        )  # fmt: skip
    gate_up, down = quant_moe._slot_gate_up_kernel, quant_moe._slot_down_kernel
    experts = ((gate_up, 4, 128, 2048, 768, 1), (down, 4, 128, 768, 2048, 1),
               (gate_up, 0, 128, 2048, 768, 1), (down, 0, 768, 768, 2048, 1),
               (gate_up, 0, 128, 7168, 2048, 128), (down, 0, 128, 2048, 7168, 128))  # fmt: skip
    for kernel, bits, group, cols_k, n, row_block in experts:  # row_block 128: DeepSeek-V3's FP8 blocks
        codes = {"w_ptr": i32 if bits else fp8, "s_ptr": p if bits else "*fp32"}
        stack = quant_moe.QuantExperts(None, None, bits, group, cols_k, row_block)
        steps = quant_moe._steps(stack, cols_k, 16, n, 1024 if bits else 512, True)
        routes = (dict(TOP_K=8, ROUTE=r, RENORMALIZE=True, BLOCK_E=128, BLOCK_TOPK=8) for r in (False, True))
        for extra in routes if kernel is gate_up else ({},):  # gate/up: expert ids read, or routed in it
            pointers = {"*": p, **codes, "ids_ptr": "*i32", "weights_ptr": "*fp32", "logits_ptr": "*fp32"}
            yield kernel, pointers, {}, dict(steps, **extra)
    for tile in quant_moe.HALF2_SLOT_TILES:  # the f16x2 INT4 slots (kernels/quant_int_half2.py's rows)
        for kernel, cols_k, n, shape in ((gate_up, 2048, 768, tile.gate_up), (down, 768, 2048, tile.down)):
            stack = quant_moe.QuantExperts(None, None, 4, 128, cols_k)
            steps = quant_moe._half2_steps(stack, cols_k, n, shape, p == "*fp16")
            routed = dict(TOP_K=8, ROUTE=True, RENORMALIZE=True, BLOCK_E=128, BLOCK_TOPK=8)
            extra = routed if kernel is gate_up else {}
            pointers = {"*": p, "w_ptr": i32, "ids_ptr": "*i32", "weights_ptr": "*fp32"}
            pointers["logits_ptr"] = "*fp32"
            yield kernel, pointers, {}, dict(steps, INTERPRET=False, **extra), {"num_warps": tile.num_warps}
    half2 = quant_int.quant_int_half2
    for tile in (t for t in QUANT_TILES[1] if isinstance(t, half2.Half2Tile)):  # the f16x2 INT4 GEMV
        for (hidden, group, odd), ready in itertools.product(
            ((4096, 128, False), (14336, 128, False), (4096, 32, True)), (False, True)
        ):
            block_k = half2.half2_step(tile, hidden)
            split_k, k_per_split = half2.half2_split(tile, hidden)
            yield (
                half2._half2_kernel,
                {"*": p, "q_ptr": i32, "o_ptr": "*fp32", "pairs_ptr": i32, "inv_m_ptr": "*fp32",
                 "sums_ptr": "*fp32", "partials_ptr": "*fp32", "counter_ptr": i32},
                {"num_cols": "i32"},
                dict(hidden=hidden, stride_qn=hidden // 8, stride_sn=hidden // group, GROUP=group,
                     HAS_OFFSET=odd, HAS_BIAS=odd, BLOCK_N=tile.block_n, BLOCK_K=block_k, EVEN_N=not odd,
                     K_MASK=hidden % block_k != 0, X_FP16=p == "*fp16", X_READY=ready, INTERPRET=False,
                     SPLIT_K=split_k, K_PER_SPLIT=k_per_split),
                {"num_warps": tile.num_warps, "num_stages": 1},
            )  # fmt: skip
    w8a8_slots = {"*": p, "w_ptr": fp8, "s_ptr": "*fp32", "ids_ptr": "*i32", "weights_ptr": "*fp32",
                  "h_ptr": "*fp32"}  # fmt: skip
    for tile in quant_moe_w8a8.SLOT_TILES:  # FP8 W8A8 slots: qwen3-30b-a3b's experts, block and channel
        for kernel, k, group in ((quant_moe_w8a8._slot_gate_up_kernel, 2048, 128),
                                 (quant_moe_w8a8._slot_down_kernel, 768, 768)):  # fmt: skip
            extra = dict(TOP_K=8) if kernel is quant_moe_w8a8._slot_gate_up_kernel else {}
            yield (
                kernel, w8a8_slots, {"rows": "i32"},
                dict(GROUP=group, PER_ROW=group >= k, BLOCK_N=tile.block_n, BLOCK_K=128, EVEN_K=True,
                     STAGES=tile.num_stages, **extra),
                {"num_warps": tile.num_warps},
            )  # fmt: skip
    grouped = {"*": p, "s_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
               "num_padded_ptr": "*i32", "weights_ptr": "*fp32", "xs_ptr": "*fp32"}  # fmt: skip
    # grouped GEMMs at qwen3-30b-a3b's gate/up K: FP8 block / channel, INT4 group 32, W8A8 block / channel
    for tile in quant_moe_grouped.GROUPED_TILES + quant_moe_grouped.W8A8_GROUPED_TILES:
        for bits, group in ((0, 128), (0, 2048)) + ((4, 32),) * (not tile.fp8_activations):
            step, mode = quant_moe_grouped._plan(quant_moe.QuantExperts(None, None, bits, group, 2048), tile)
            types = grouped | {"w_ptr": fp8 if bits == 0 else i32}
            common = dict(BITS=bits, SCALE_K=group, MODE=mode, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                          BLOCK_K=step, GROUP_M=8, DOT_PRECISION="tf32",
                          X_FP8=tile.fp8_activations)  # fmt: skip
            options = {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
            up = types | ({"x_ptr": fp8} if tile.fp8_activations else {})
            down = types | ({"act_ptr": fp8} if tile.fp8_activations else {})
            yield quant_moe_grouped._gate_up_kernel, up, {}, dict(common, TOP_K=8), options
            yield quant_moe_grouped._down_kernel, down, {}, common, options


def _moe_variants(p: str):
    """The MoE routing, grouping and grouped-GEMM kernels at the default tiles."""
    for top_k, block_e in ((8, 128), (2, 16)):
        yield (
            moe_routing._moe_topk_kernel,
            {"*": p, "weights_ptr": "*fp32", "ids_ptr": "*i32"},
            {},
            dict(TOP_K=top_k, RENORMALIZE=True, BLOCK_E=block_e, BLOCK_K=top_k),
        )
    router = {"*": p, "logits_ptr": "*fp32", "counter_ptr": "*i32", "weights_ptr": "*fp32", "ids_ptr": "*i32"}
    for tile in moe_router.ROUTE_TILES:
        yield (
            moe_router._moe_route_kernel, router, {},
            dict(TOP_K=8, RENORMALIZE=True, BLOCK_R=tile.rows, BLOCK_H=1024, BLOCK_E=128, BLOCK_K=8),
            {"num_warps": tile.num_warps},
        )  # fmt: skip
    deepseek = dict(NUM_GROUPS=8, PER_GROUP=32, TOPK_GROUPS=4, TOP_K=8, NORM=True, HAS_BIAS=True, BLOCK_G=8,
                    BLOCK_P=32, BLOCK_K=8)  # fmt: skip
    grouped = {"*": "*fp32", "ids_ptr": "*i32", "counter_ptr": "*i32"}
    yield grouped_topk._grouped_topk_kernel, grouped, {"scaling": "fp32"}, dict(deepseek)
    for tile in moe_router.ROUTE_TILES:
        yield (
            moe_grouped_router._grouped_route_kernel, grouped | {"x_ptr": p}, {"scaling": "fp32"},
            dict(deepseek, BLOCK_R=tile.rows, BLOCK_H=1024), {"num_warps": tile.num_warps},
        )  # fmt: skip
    for tile in moe_norm_router.NORM_ROUTER_TILES:
        yield (
            moe_norm_router._moe_norm_router_kernel, {"*": p, "logits_ptr": "*fp32"}, {"eps": "fp32"},
            dict(BLOCK_R=tile.rows, BLOCK_H=2048), {"num_warps": tile.num_warps},
        )  # fmt: skip
    i32 = {"*": "*i32"}
    yield moe_align._count_kernel, i32, {}, dict(BLOCK=256)
    yield moe_align._offsets_kernel, i32, {}, dict(BLOCK_M=16, BLOCK_E=128, BLOCK_B=32)
    yield moe_align._scatter_kernel, i32, {}, dict(BLOCK=256)
    grouped = {"*": p, "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "num_padded_ptr": "*i32"}
    for tile in fused_moe_tiles.CANDIDATE_TILES:
        blocks = dict(
            BLOCK_M=tile.block_m,
            BLOCK_N=tile.block_n,
            BLOCK_K=tile.block_k,
            GROUP_M=fused_moe.GROUP_M,
            DOT_PRECISION="tf32",
        )
        options = {"num_warps": tile.num_warps, "num_stages": tile.num_stages}
        if tile.block_m == 1:
            slot = {"*": p, "ids_ptr": "*i32", "weights_ptr": "*fp32", "logits_ptr": "*fp32"}
            gemv_blocks = dict(BLOCK_N=tile.block_n, BLOCK_K=tile.block_k)
            for route in (False, True):  # expert ids read, or picked from the router logits
                routing = dict(ROUTE=route, RENORMALIZE=True, BLOCK_E=128, BLOCK_TOPK=8)
                yield (
                    fused_moe_gemv._slot_gate_up_kernel,
                    slot,
                    {},
                    dict(gemv_blocks, TOP_K=8, **routing),
                    options,
                )
            yield fused_moe_gemv._slot_down_kernel, slot, {}, gemv_blocks, options
            continue
        yield fused_moe._gate_up_kernel, grouped, {}, dict(blocks, TOP_K=8), options
        yield fused_moe._down_kernel, {**grouped, "weights_ptr": "*fp32"}, {}, blocks, options
    yield fused_moe._combine_kernel, {"*": p}, {}, dict(TOP_K=8, BLOCK=1024)
    for shared in (False, True):
        constexprs = dict(TOP_K=8, HAS_SHARED=shared, BLOCK_H=2048)
        yield moe_finalize._moe_finalize_kernel, {"*": p}, {"eps": "fp32"}, constexprs


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: this compiles the kernels for real")
        return 2
    capability = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    target = GPUTarget("cuda", capability, 32)
    failures = 0
    dtypes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["bf16", "fp16"]
    for dtype in dtypes:
        for kernel, pointers, scalars, constexprs, *options in _variants(dtype):
            options = options[0] if options else {}
            name = f"{kernel.fn.__name__}[{dtype} {constexprs} {options}]"
            try:
                signature = _signature(kernel, pointers, scalars, constexprs)
                compiled = triton.compile(
                    ASTSource(kernel, signature, constexprs=constexprs), target=target, options=options
                )
                shared = compiled.metadata.shared
                if shared > SHARED_MEMORY_LIMIT:
                    raise RuntimeError(
                        f"needs {shared} bytes of shared memory; sm_90 has {SHARED_MEMORY_LIMIT}"
                    )
                print(f"ok   {name} shared={shared}")
            except Exception:  # report every kernel, then fail
                failures += 1
                print(f"FAIL {name}\n{traceback.format_exc()}")
    print(f"triton {triton.__version__} sm_{capability}: {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
