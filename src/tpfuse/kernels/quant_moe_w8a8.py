"""FP8 W8A8 fused-MoE experts per (token, slot) row: kernels/quant_moe.py's per-slot route with the
expert's e4m3 weights fed to the FP8 tensor cores as they are, and the slot's activations quantized
in the kernel (one e4m3 scale per 128-column step, or per step of the weight's K group where smaller).

Two launches. Gate/up: program (s, n) takes slot row s = t * k + j and the n-th block of BLOCK_N of
the 2I gate-then-up rows of expert ids[s], and stores h[s, rows] in float32. Down: program (s, n)
forms the slot's SiLU-and-mul row silu(h[s, :I]) * h[s, I:] step by step as it reads it (rounded to
the output dtype, as the W8A16 route stores it), times the n-th block of the expert's down rows,
times the slot's routing weight. Each K step quantizes the step's activations (scale = amax / 448,
1 where all zero) into column 0 of a 16-column MMA operand (zeros elsewhere: the MMA's smallest N)
and takes the MMA of the [BLOCK_N, BLOCK_K] e4m3 tile against it; the step's product is scaled by
the activation scale and, for K-group weight scales, the group's scale; per-row weight scales
multiply once after the loop. No weight is converted to another type (the W8A16 route converts every
weight, which bounds it below the copy bandwidth: docs/PERF.md). BLOCK_N is at least 64 on 4 warps:
Hopper's FP8 MMA (wgmma) takes 64 rows a warp group, and smaller tiles fall back to converting the
weights for a 16-bit MMA. Graph-safe: no data-dependent shapes. Weight layout of QuantExperts
(bits 0): codes [E, N, K] e4m3, scales [E, N, ceil(K / group)] float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl
from tpfuse.kernels.fp8_rows import e4m3_ready
from tpfuse.kernels.quant_dot import pow2_part
from tpfuse.kernels.quant_fp8_w8a8 import fp8_rounded_rows_ref
from tpfuse.kernels.quant_moe import QuantExperts

__all__ = [
    "SLOT_TILES",
    "W8A8SlotTile",
    "activation_step",
    "w8a8_down_triton",
    "w8a8_gate_up_triton",
    "w8a8_slots_ref",
    "w8a8_slots_triton",
]


@dataclass(frozen=True)
class W8A8SlotTile:
    """One launch shape of both slot kernels: expert rows per program, pipeline stages, warps (the K
    step is activation_step's)."""

    block_n: int = 64
    num_stages: int = 4
    num_warps: int = 4

    def label(self) -> str:
        return f"w8a8 slots n{self.block_n} s{self.num_stages} w{self.num_warps}"


# Candidates start-up timing races against the W8A16 route (model/moe_choice.py); qwen3-30b-a3b at
# one token: 8 slots x 1536 gate/up rows / 64 = 192 programs, 8 x 2048 down rows / 64 = 256.
SLOT_TILES = (W8A8SlotTile(64, 3, 4), W8A8SlotTile(64, 5, 4), W8A8SlotTile(128, 4, 8))


def activation_step(stack: QuantExperts) -> int | None:
    """Columns per activation scale (= the K step) for stack: 128 capped at next_power_of_2(K), then at
    the power-of-two part of a K group smaller than K. None where that leaves a step below 16 (the
    MMA's K), which this route cannot run."""
    step = min(128, triton.next_power_of_2(stack.cols))
    if stack.group < stack.cols:
        step = min(step, pow2_part(stack.group))
    return step if step >= 16 else None


@triton.jit
def _rows_dot_quantized(
    w_rows, s_rows, x_row, hidden, col_ok, GATED: tl.constexpr, ACT_DTYPE: tl.constexpr, GROUP: tl.constexpr,
    PER_ROW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """[BLOCK_N] float32: the e4m3 rows at w_rows ([BLOCK_N, 1] pointers, scales at s_rows) dotted with
    the activations at x_row over K = hidden, quantized per K step. GATED: x_row holds the gate/up
    product h [2 * hidden] and the activations are silu(h[:hidden]) * h[hidden:] rounded to ACT_DTYPE
    (the SiLU-and-mul row the W8A16 route stores) before they are quantized."""
    acc = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for k0 in tl.range(0, hidden, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        if EVEN_K:
            x = tl.load(x_row + ks).to(tl.float32)
        else:
            x = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)
        if GATED:
            up = tl.load(x_row + hidden + ks, mask=k_ok, other=0.0).to(tl.float32)
            x = (x / (1.0 + tl.exp(-x)) * up).to(ACT_DTYPE).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        x_scale = tl.where(amax > 0, amax / 448.0, 1.0)
        # the activations in column 0 of the MMA's 16 (the others zero)
        x_e4m3 = e4m3_ready(x * (1.0 / x_scale))
        xt = tl.where(tl.arange(0, 16)[None, :] == 0, x_e4m3[:, None], 0.0).to(tl.float8e4nv)
        if EVEN_K:
            w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None], other=0.0, eviction_policy="evict_first")
        else:
            w_mask = col_ok[:, None] & k_ok[None, :]
            w = tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0, eviction_policy="evict_first")
        part = tl.dot(w, xt)
        if PER_ROW:
            acc += part * x_scale
        else:
            acc += part * (x_scale * tl.load(s_rows + k0 // GROUP, mask=col_ok, other=0.0))[:, None]
    out = tl.sum(acc, axis=1)
    if PER_ROW:
        out *= tl.load(s_rows, mask=col_ok, other=0.0)
    return out


@triton.jit
def _slot_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, h_ptr, ids_ptr, hidden, rows,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h,
    TOP_K: tl.constexpr, GROUP: tl.constexpr, PER_ROW: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):  # fmt: skip
    """h[s, n] = x[t] . w13_e[n] for all 2I rows (gate then up), e = ids[s], t = s // k."""
    pdl.begin(PDL)  # which weights to read depends on ids an earlier kernel wrote
    slot = tl.program_id(0)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    token = (slot // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < rows
    w_rows = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + expert * stride_se + cols.to(tl.int64) * stride_sn
    h = _rows_dot_quantized(w_rows, s_rows, x_ptr + token * stride_x, hidden, col_ok,
                            False, tl.float32, GROUP, PER_ROW, BLOCK_N, BLOCK_K, EVEN_K, STAGES)  # fmt: skip
    tl.store(h_ptr + slot.to(tl.int64) * stride_h + cols, h.to(h_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _slot_down_kernel(
    h_ptr, w_ptr, s_ptr, out_ptr, weights_ptr, ids_ptr, hidden, inter,
    stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_out,
    GROUP: tl.constexpr, PER_ROW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, STAGES: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):  # fmt: skip
    """out[s, n] = weight[s] * (silu(h[s, :I]) * h[s, I:]) . down_e[n], e = ids[s]."""
    pdl.begin(PDL)
    slot = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_rows = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + expert * stride_se + cols.to(tl.int64) * stride_sn
    y = _rows_dot_quantized(w_rows, s_rows, h_ptr + slot * stride_h, inter, col_ok,
                            True, out_ptr.dtype.element_ty, GROUP, PER_ROW, BLOCK_N, BLOCK_K, EVEN_K,
                            STAGES)  # fmt: skip
    y = y * tl.load(weights_ptr + slot)
    tl.store(out_ptr + slot * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=col_ok)


def _check(stack: QuantExperts) -> int:
    if stack.bits != 0:
        raise ValueError(f"the W8A8 slot route takes FP8 experts; got {stack.bits}-bit integer codes")
    step = activation_step(stack)
    if step is None:
        raise ValueError(
            f"the W8A8 slot route needs expert scale groups with a power-of-two part >= 16; got {stack.group}"
        )
    return step


def w8a8_slots_ref(x, w13: QuantExperts, w2: QuantExperts, topk_weights, topk_ids) -> torch.Tensor:
    """What w8a8_slots_triton computes, in float32: each token's row quantized per activation_step
    columns times the dequantized gate/up rows, the SiLU-and-mul row rounded to x.dtype and quantized
    the same way, times the down rows, times the slot's weight. [T * k, H] of x.dtype."""
    g13, g2 = _check(w13), _check(w2)
    gate_up, down = w13.dequantize(), w2.dequantize()
    inter = gate_up.shape[1] // 2
    ids = topk_ids.reshape(-1).long()
    tokens = fp8_rounded_rows_ref(x, g13).repeat_interleave(topk_ids.shape[1], dim=0)
    h = torch.einsum("sk,snk->sn", tokens, gate_up[ids])
    act = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(x.dtype)
    out = torch.einsum("sk,snk->sn", fp8_rounded_rows_ref(act, g2), down[ids])
    return (out * topk_weights.reshape(-1, 1).float()).to(x.dtype)


def w8a8_gate_up_triton(x, w13: QuantExperts, topk_ids, tile: W8A8SlotTile) -> torch.Tensor:
    """h [T * k, 2I] float32: row t * k + j = x[t] (quantized per activation_step columns) times expert
    topk_ids[t, j]'s gate rows, then its up rows. x [T, H] contiguous along H."""
    step = _check(w13)
    num_tokens, top_k = topk_ids.shape
    hidden, rows = x.shape[1], w13.codes.shape[1]
    h = torch.empty(num_tokens * top_k, rows, dtype=torch.float32, device=x.device)
    if h.numel() == 0:
        return h
    if x.stride(1) != 1:
        raise ValueError("the W8A8 slot route needs x contiguous along the hidden size: call .contiguous()")
    _slot_gate_up_kernel[(h.shape[0], triton.cdiv(rows, tile.block_n))](
        x, w13.codes, w13.scales, h, topk_ids.reshape(-1).contiguous(), hidden, rows, x.stride(0),
        w13.codes.stride(0), w13.codes.stride(1), w13.scales.stride(0), w13.scales.stride(1), h.stride(0),
        TOP_K=top_k, GROUP=w13.group, PER_ROW=w13.group >= hidden, BLOCK_N=tile.block_n, BLOCK_K=step,
        EVEN_K=hidden % step == 0, STAGES=tile.num_stages, num_warps=tile.num_warps, **pdl.launch(x.device),
    )  # fmt: skip
    return h


def w8a8_down_triton(
    h, w2: QuantExperts, topk_weights, topk_ids, tile: W8A8SlotTile, out_dtype
) -> torch.Tensor:
    """[T * k, H] of out_dtype: row s = topk_weights[s] * (silu(h[s, :I]) * h[s, I:], rounded to
    out_dtype and quantized per activation_step columns) times expert topk_ids[s]'s down rows
    (s = t * k + j). h [T * k, 2I] float32 (w8a8_gate_up_triton's)."""
    step = _check(w2)
    hidden, inter = w2.codes.shape[1], h.shape[1] // 2
    out = torch.empty(h.shape[0], hidden, dtype=out_dtype, device=h.device)
    if out.numel() == 0:
        return out
    if h.stride(1) != 1:
        raise ValueError("the W8A8 slot route needs h contiguous along its columns")
    _slot_down_kernel[(h.shape[0], triton.cdiv(hidden, tile.block_n))](
        h, w2.codes, w2.scales, out, topk_weights.reshape(-1).float().contiguous(),
        topk_ids.reshape(-1).contiguous(), hidden, inter, h.stride(0),
        w2.codes.stride(0), w2.codes.stride(1), w2.scales.stride(0), w2.scales.stride(1), out.stride(0),
        GROUP=w2.group, PER_ROW=w2.group >= inter, BLOCK_N=tile.block_n, BLOCK_K=step,
        EVEN_K=inter % step == 0, STAGES=tile.num_stages, num_warps=tile.num_warps, **pdl.launch(h.device),
    )  # fmt: skip
    return out


def w8a8_slots_triton(x, w13: QuantExperts, w2: QuantExperts, topk_weights, topk_ids, tile: W8A8SlotTile):
    """The route of w8a8_slots_ref on the FP8 tensor cores: w8a8_gate_up_triton then w8a8_down_triton.
    x [T, H] bf16/fp16/fp32; topk_weights / topk_ids [T, k]. Returns a new [T * k, H] of x.dtype."""
    h = w8a8_gate_up_triton(x, w13, topk_ids, tile)
    return w8a8_down_triton(h, w2, topk_weights, topk_ids, tile, x.dtype)
