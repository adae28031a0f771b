"""Quantized fused-MoE experts as grouped GEMMs on the tensor cores: kernels/fused_moe.py's two products
over slots sorted by expert (kernels/moe_align.py), with each expert's weight tile dequantized in
registers, so every routed expert's weights are read once per row block rather than once per slot
(the per-slot routes of kernels/quant_moe.py and quant_moe_w8a8.py re-read an expert for each of its
slots: right for a few tokens, ruinous for a prefill chunk).

Weights are QuantExperts stacks (bits 0: e4m3 codes [E, N, K]; 4 / 8: packed int32 words
[E, N, K * bits / 32], symmetric, w = (q - 2^(bits-1)) s), scales [E, N, ceil(K / group)]. The weight
tile [BLOCK_N, BLOCK_K] is cast to x's dtype (FP8) or built from its words as kernels/quant_dot.py does
(each word loaded once, spread to its lanes in registers, q - 2^(bits-1) through the float bit
pattern, no int-to-float conversion). Scales are applied where constant (quant_dot.scale_plan; MODE
0 / 1 / 2 = its ROW / STEP / ELEMENT): ROW (one group over K) once after the K loop; STEP (the step
inside one group) to each step's product; ELEMENT (any other group) to each weight before the
product, rounded to x's dtype. Accumulation is float32; the SiLU-and-mul row and the weighted slot
rows are stored in x's dtype, as the bf16 route does. W8A8 (GroupedTile.fp8_activations, FP8
experts): x and then the SiLU-and-mul rows are quantized to e4m3 per row and activation step
(kernels/quant_moe_w8a8.activation_step, one launch each), the weights go to the FP8 MMA as loaded
and each step's product is scaled by the rows' scales. Graph-safe (moe_align's padded sizes depend
on T, k and E only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels.fused_moe import GROUP_M, _block_ids, _block_slots
from tpfuse.kernels.fused_moe_tiles import MoeTile
from tpfuse.kernels.moe_align import moe_align_triton
from tpfuse.kernels.quant_dot import ELEMENT, code_as_float, scale_plan, spread_words
from tpfuse.kernels.quant_fp8_w8a8 import quantize_fp8_rows_triton
from tpfuse.kernels.quant_moe import QuantExperts
from tpfuse.kernels.quant_moe_w8a8 import activation_step

__all__ = ["GROUPED_TILES", "W8A8_GROUPED_TILES", "GroupedTile", "grouped_slots_triton"]


@dataclass(frozen=True)
class GroupedTile(MoeTile):
    """A MoeTile of the grouped route; fp8_activations: FP8 experts against activations quantized per
    row and 128-column step, on the FP8 tensor cores (W8A8, for formats that quantize activations)."""

    fp8_activations: bool = False

    def label(self) -> str:
        return ("w8a8 " if self.fp8_activations else "") + super().label()


# Candidates start-up timing races (model/moe_choice.py), the default first. Compiled for sm_90 (gate/up
# carries two accumulators): the W8A16 tiles at a K step of 64 and the W8A8 ones (K step 128, the
# activation step) keep within 255 registers with at most 16 bytes of stack (docs/PERF.md).
GROUPED_TILES = (
    GroupedTile(64, 128, 64, 3, 8),
    GroupedTile(64, 64, 64, 3, 4),
    GroupedTile(16, 64, 128, 4, 4),
)
W8A8_GROUPED_TILES = (GroupedTile(64, 128, 128, 3, 8, True), GroupedTile(128, 64, 128, 3, 8, True))


@triton.jit
def _weight_tile(
    w_rows, s_rows, k0, hidden, col_ok, dtype: tl.constexpr, BITS: tl.constexpr, SCALE_K: tl.constexpr,
    MODE: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """[BLOCK_N, BLOCK_K] of dtype: the rows at w_rows ([BLOCK_N, 1] pointers to each row's codes;
    scales at s_rows, [BLOCK_N] pointers to each row's first), columns k0 .. k0 + BLOCK_K, dequantized
    (ELEMENT: scaled too; other modes leave the scale to the caller). Columns past hidden are 0."""
    ks = k0 + tl.arange(0, BLOCK_K)
    if BITS == 0:
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & (ks < hidden)[None, :], other=0.0)
        if MODE != 2:
            return w.to(dtype)
        w = w.to(tl.float32)
    else:
        PER_WORD: tl.constexpr = 32 // BITS
        WORDS: tl.constexpr = BLOCK_K // PER_WORD
        wk = k0 // PER_WORD + tl.arange(0, WORDS)
        words_ok = col_ok[:, None] & (wk < (hidden + PER_WORD - 1) // PER_WORD)[None, :]
        words = tl.load(w_rows + wk[None, :], mask=words_ok, other=0)
        shift = (tl.arange(0, BLOCK_K) % PER_WORD) * BITS
        f = code_as_float(spread_words(words, PER_WORD), shift[None, :], BITS)
        w = f * (1 << BITS) - ((1 << BITS) + (1 << (BITS - 1)))  # q - 2^(BITS-1), exact
        w = tl.where((ks < hidden)[None, :], w, 0.0)
    if MODE == 2:  # ELEMENT
        s = tl.load(s_rows[:, None] + (ks // SCALE_K)[None, :], mask=col_ok[:, None] & (ks < hidden)[None, :],
                    other=0.0)  # fmt: skip
        w = w * s.to(tl.float32)
    return w.to(dtype)


@triton.jit
def _rows_scale(s_rows, k0, col_ok, SCALE_K: tl.constexpr):
    """[BLOCK_N] float32: each row's scale of the group holding column k0 (k0 = 0: per-row scales)."""
    return tl.load(s_rows + k0 // SCALE_K, mask=col_ok, other=0.0).to(tl.float32)


@triton.jit
def _step_product(
    a, w, acc, xs_rows, s_rows, k0, row_ok, col_ok, SCALE_K: tl.constexpr, MODE: tl.constexpr,
    X_FP8: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """acc plus one K step's a [BLOCK_M, BLOCK_K] times w [BLOCK_N, BLOCK_K] transposed, scaled per
    step where that is constant over it: by the rows' activation scales (X_FP8: at xs_rows, [BLOCK_M]
    pointers to each row's first) and the weight rows' scales (STEP: at s_rows)."""
    if MODE != 1 and not X_FP8:
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    else:
        part = tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION)
        if X_FP8:
            part = part * tl.load(xs_rows + k0 // BLOCK_K, mask=row_ok, other=0.0)[:, None]
        if MODE == 1:  # STEP
            part = part * _rows_scale(s_rows, k0, col_ok, SCALE_K)[None, :]
        acc = acc + part
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, s_ptr, act_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, xs_ptr,
    num_slots, num_blocks, hidden, inter, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_act,
    stride_xs,
    TOP_K: tl.constexpr, BITS: tl.constexpr, SCALE_K: tl.constexpr, MODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr, X_FP8: tl.constexpr,
):  # fmt: skip
    """act[s, n] = silu(x[t] . gate_e[n]) * (x[t] . up_e[n]) for the block's slots s = t * k + j.
    X_FP8: x is e4m3 with float32 scales xs [T, K steps] (W8A8: the FP8 weights as loaded)."""
    pid_m, pid_n = _block_ids(num_blocks, inter, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert, slots, row_ok = _block_slots(block_expert_ptr, sorted_ptr, pid_m, num_slots, BLOCK_M)
    tokens = tl.where(row_ok, slots // TOP_K, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tokens[:, None] * stride_x + ks[None, :]
    g_rows = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    u_rows = g_rows + inter * stride_wn
    g_scales = s_ptr + expert * stride_se + cols.to(tl.int64) * stride_sn
    u_scales = g_scales + inter * stride_sn
    dtype = x_ptr.dtype.element_ty
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    xs_rows = xs_ptr + tokens * stride_xs
    for k0 in range(0, hidden, BLOCK_K):
        a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & ((ks + k0) < hidden)[None, :], other=0.0)
        g = _weight_tile(g_rows, g_scales, k0, hidden, col_ok, dtype, BITS, SCALE_K, MODE, BLOCK_K)
        u = _weight_tile(u_rows, u_scales, k0, hidden, col_ok, dtype, BITS, SCALE_K, MODE, BLOCK_K)
        acc_g = _step_product(a, g, acc_g, xs_rows, g_scales, k0, row_ok, col_ok,
                              SCALE_K, MODE, X_FP8, BLOCK_K, DOT_PRECISION)  # fmt: skip
        acc_u = _step_product(a, u, acc_u, xs_rows, u_scales, k0, row_ok, col_ok,
                              SCALE_K, MODE, X_FP8, BLOCK_K, DOT_PRECISION)  # fmt: skip
    if MODE == 0:  # ROW
        acc_g *= _rows_scale(g_scales, 0, col_ok, SCALE_K)[None, :]
        acc_u *= _rows_scale(u_scales, 0, col_ok, SCALE_K)[None, :]
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out = act_ptr + slots[:, None].to(tl.int64) * stride_act + cols[None, :]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, s_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, xs_ptr,
    num_slots, num_blocks, hidden, inter, stride_act, stride_we, stride_wn, stride_se, stride_sn, stride_out,
    stride_xs,
    BITS: tl.constexpr, SCALE_K: tl.constexpr, MODE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
    X_FP8: tl.constexpr,
):  # fmt: skip
    """out[s, n] = weight[s] * (act[s] . down_e[n]), rounded to out's dtype. X_FP8: act is e4m3 with
    float32 scales xs [T * k, K steps]."""
    pid_m, pid_n = _block_ids(num_blocks, hidden, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    expert, slots, row_ok = _block_slots(block_expert_ptr, sorted_ptr, pid_m, num_slots, BLOCK_M)
    safe = tl.where(row_ok, slots, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + safe[:, None] * stride_act + ks[None, :]
    w_rows = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + expert * stride_se + cols.to(tl.int64) * stride_sn
    dtype = act_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    xs_rows = xs_ptr + safe * stride_xs
    for k0 in range(0, inter, BLOCK_K):
        a = tl.load(a_ptrs + k0, mask=row_ok[:, None] & ((ks + k0) < inter)[None, :], other=0.0)
        w = _weight_tile(w_rows, s_rows, k0, inter, col_ok, dtype, BITS, SCALE_K, MODE, BLOCK_K)
        acc = _step_product(a, w, acc, xs_rows, s_rows, k0, row_ok, col_ok,
                            SCALE_K, MODE, X_FP8, BLOCK_K, DOT_PRECISION)  # fmt: skip
    if MODE == 0:  # ROW
        acc *= _rows_scale(s_rows, 0, col_ok, SCALE_K)[None, :]
    weight = tl.load(weights_ptr + safe, mask=row_ok, other=0.0)
    out = out_ptr + safe[:, None] * stride_out + cols[None, :]
    tl.store(
        out, (acc * weight[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :]
    )


def _plan(stack: QuantExperts, tile: GroupedTile) -> tuple[int, int]:
    """(K step, scale mode) of one stack at tile (quant_dot.scale_plan), the step a whole number of
    packed words; W8A8: the activation step of kernels/quant_moe_w8a8.py (ROW or STEP)."""
    if tile.fp8_activations:
        if stack.bits != 0:
            raise ValueError(f"W8A8 grouped tiles take FP8 experts; got {stack.bits}-bit integer codes")
        step = activation_step(stack)
        if step is None:
            raise ValueError(f"W8A8 needs scale groups with a power-of-two part >= 16; got {stack.group}")
        return step, scale_plan(step, stack.group, stack.cols, False)[1]
    step, mode = scale_plan(tile.block_k, stack.group, stack.cols, False)
    if stack.bits and step % (32 // stack.bits):
        step, mode = tile.block_k, ELEMENT
    return step, mode


def grouped_slots_triton(x, w13: QuantExperts, w2: QuantExperts, topk_weights, topk_ids, tile: MoeTile):
    """The grouped route: [T * k, H] of x.dtype, row t * k + j = topk_weights[t, j] * expert(x[t]) for
    expert topk_ids[t, j] (kernels/quant_moe.quant_slots_ref's contract; float32 accumulation, the
    SiLU-and-mul row stored in x.dtype). x [T, H] bf16/fp16/fp32; tile.block_m >= 16. A GroupedTile
    with fp8_activations quantizes x and the SiLU-and-mul rows per row and activation step first
    (one launch each) and computes what kernels/quant_moe_w8a8.w8a8_slots_ref does."""
    tile = tile if isinstance(tile, GroupedTile) else GroupedTile(**vars(tile))
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter = w13.codes.shape[:2]
    hidden, inter = x.shape[1], two_inter // 2
    if tile.block_m < 16:
        raise ValueError(f"the grouped route needs block_m >= 16 (the MMA's rows); got {tile.label()}")
    step13, mode13 = _plan(w13, tile)
    step2, mode2 = _plan(w2, tile)
    num_slots = num_tokens * top_k
    out = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    if num_slots == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).float().contiguous()
    sorted_slots, block_expert, num_padded = moe_align_triton(
        topk_ids.contiguous(), num_experts, tile.block_m
    )
    nb = block_expert.shape[0]
    common = dict(
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, GROUP_M=GROUP_M, X_FP8=tile.fp8_activations,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_stages=tile.num_stages, num_warps=tile.num_warps,
    )  # fmt: skip
    a, a_scales = quantize_fp8_rows_triton(x, step13) if tile.fp8_activations else (x, x)
    _gate_up_kernel[(nb * triton.cdiv(inter, tile.block_n),)](
        a, w13.codes, w13.scales, act, sorted_slots, block_expert, num_padded, a_scales,
        num_slots, nb, hidden, inter, a.stride(0), w13.codes.stride(0), w13.codes.stride(1),
        w13.scales.stride(0), w13.scales.stride(1), act.stride(0), a_scales.stride(0),
        TOP_K=top_k, BITS=w13.bits, SCALE_K=w13.group, MODE=mode13, BLOCK_K=step13, **common,
    )  # fmt: skip
    a, a_scales = quantize_fp8_rows_triton(act, step2) if tile.fp8_activations else (act, act)
    _down_kernel[(nb * triton.cdiv(hidden, tile.block_n),)](
        a, w2.codes, w2.scales, out, weights, sorted_slots, block_expert, num_padded, a_scales,
        num_slots, nb, hidden, inter, a.stride(0), w2.codes.stride(0), w2.codes.stride(1),
        w2.scales.stride(0), w2.scales.stride(1), out.stride(0), a_scales.stride(0),
        BITS=w2.bits, SCALE_K=w2.group, MODE=mode2, BLOCK_K=step2, **common,
    )  # fmt: skip
    return out
