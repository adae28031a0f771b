"""Quantized fused-MoE experts, per (token, slot) row: the layout of kernels/fused_moe_gemv.py with the
expert's weight tile dequantized in registers (kernels/quant_int.py's group-quantized codes, or
kernels/quant_fp8.py's e4m3 weights with one fp32 scale per (row, K block)).

Program (s, n) takes slot row s = t * k + j and streams expert ids[s]'s rows n-block once, so decode
(few slots) reads each routed expert's packed bytes once per slot; graph-safe (no data-dependent
shapes). Larger slot counts re-read an expert for each of its slots: a grouped quantized GEMM is the
prefill route still to build.

QuantExperts holds one projection stack: codes [E, N, K*bits/32] int32 (or [E, N, K] e4m3),
scales [E, N, K / group] and for int offsets None (symmetric only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels.quant_fp8 import dequantize_fp8
from tpfuse.kernels.quant_int import dequantize_int


@dataclass(frozen=True)
class QuantExperts:
    """codes [E, N, K*bits/32] int32 (bits 4/8) or [E, N, K] float8_e4m3fn (bits 0: FP8); scales
    [E, N, ceil(K / group)] (int: any float dtype; FP8: float32)."""

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    group: int
    cols: int  # K

    def dequantize(self) -> torch.Tensor:
        """[E, N, K] float32 (exact)."""
        if self.bits == 0:
            return torch.stack(
                [dequantize_fp8(c, s, (1, self.group)) for c, s in zip(self.codes, self.scales, strict=True)]
            )
        return torch.stack(
            [
                dequantize_int(c, s, None, self.bits, self.group, self.cols)
                for c, s in zip(self.codes, self.scales, strict=True)
            ]
        )


@triton.jit
def _load_tile(
    w_ptr,
    s_ptr,
    expert,
    cols,
    ks,
    mask,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
):
    """[BLOCK_N, BLOCK_K] float32 weights of expert rows cols at columns ks."""
    s = tl.load(
        s_ptr + expert * stride_se + cols[:, None].to(tl.int64) * stride_sn + (ks // GROUP)[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    rows = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
    if BITS == 0:
        w = (
            tl.load(rows + ks[None, :], mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            * s
        )
    else:
        per_word = 32 // BITS
        words = tl.load(rows + (ks // per_word)[None, :], mask=mask, other=0, eviction_policy="evict_first")
        q = (words >> ((ks % per_word) * BITS)[None, :]) & ((1 << BITS) - 1)
        w = (q - (1 << (BITS - 1))).to(tl.float32) * s
    return w


@triton.jit
def _slot_gate_up_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    act_ptr,
    ids_ptr,
    hidden,
    inter,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_act,
    TOP_K: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """act[s, n] = silu(x[t] . gate_e[n]) * (x[t] . up_e[n]), e = ids[s], t = s // k; gate rows
    0..I-1 of the stack, up rows I..2I-1."""
    slot = tl.program_id(0)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    token = (slot // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        xk = tl.load(x_ptr + token * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)
        mask = col_ok[:, None] & k_ok[None, :]
        g = _load_tile(
            w_ptr, s_ptr, expert, cols, ks, mask, stride_we, stride_wn, stride_se, stride_sn, BITS, GROUP
        )
        u = _load_tile(
            w_ptr,
            s_ptr,
            expert,
            cols + inter,
            ks,
            mask,
            stride_we,
            stride_wn,
            stride_se,
            stride_sn,
            BITS,
            GROUP,
        )
        acc_g += g * xk[None, :]
        acc_u += u * xk[None, :]
    g, u = tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + slot.to(tl.int64) * stride_act + cols, act.to(act_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _slot_down_kernel(
    act_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    weights_ptr,
    ids_ptr,
    hidden,
    inter,
    stride_act,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[s, n] = weight[s] * (act[s] . down_e[n]), e = ids[s]."""
    slot = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(act_ptr + slot * stride_act + ks, mask=k_ok, other=0.0).to(tl.float32)
        mask = col_ok[:, None] & k_ok[None, :]
        w = _load_tile(
            w_ptr, s_ptr, expert, cols, ks, mask, stride_we, stride_wn, stride_se, stride_sn, BITS, GROUP
        )
        acc += w * a[None, :]
    y = tl.sum(acc, axis=1) * tl.load(weights_ptr + slot)
    tl.store(out_ptr + slot * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=col_ok)


def quant_slots_ref(x, w13: QuantExperts, w2: QuantExperts, topk_weights, topk_ids) -> torch.Tensor:
    """[T * k, H] of x.dtype: row t * k + j = topk_weights[t, j] * expert(x[t]) with the dequantized
    weights in float32, the SiLU-and-mul product rounded to x.dtype (as the kernels store it)."""
    return slots_ref(x, w13.dequantize(), w2.dequantize(), topk_weights, topk_ids)


def slots_ref(x, gate_up: torch.Tensor, down: torch.Tensor, topk_weights, topk_ids) -> torch.Tensor:
    """quant_slots_ref on already dequantized float32 stacks gate_up [E, 2I, H] and down [E, H, I]."""
    inter = gate_up.shape[1] // 2
    ids = topk_ids.reshape(-1).long()
    tokens = x.float().repeat_interleave(topk_ids.shape[1], dim=0)
    h = torch.einsum("sk,snk->sn", tokens, gate_up[ids])
    act = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(x.dtype).float()
    out = torch.einsum("sk,snk->sn", act, down[ids]) * topk_weights.reshape(-1, 1).float()
    return out.to(x.dtype)


def quant_slots_triton(
    x, w13: QuantExperts, w2: QuantExperts, topk_weights, topk_ids, block_n=4, block_k=256
):
    """Triton quant_slots_ref (the per-slot route). x [T, H] bf16/fp16/fp32 contiguous."""
    num_tokens, top_k = topk_ids.shape
    hidden, inter = x.shape[1], w13.codes.shape[1] // 2
    num_slots = num_tokens * top_k
    out = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    if num_slots == 0:
        return out
    act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    _slot_gate_up_kernel[(num_slots, triton.cdiv(inter, block_n))](
        x,
        w13.codes,
        w13.scales,
        act,
        ids,
        hidden,
        inter,
        x.stride(0),
        w13.codes.stride(0),
        w13.codes.stride(1),
        w13.scales.stride(0),
        w13.scales.stride(1),
        act.stride(0),
        TOP_K=top_k,
        BITS=w13.bits,
        GROUP=w13.group,
        BLOCK_N=block_n,
        BLOCK_K=min(block_k, triton.next_power_of_2(hidden)),
    )
    _slot_down_kernel[(num_slots, triton.cdiv(hidden, block_n))](
        act,
        w2.codes,
        w2.scales,
        out,
        weights,
        ids,
        hidden,
        inter,
        act.stride(0),
        w2.codes.stride(0),
        w2.codes.stride(1),
        w2.scales.stride(0),
        w2.scales.stride(1),
        out.stride(0),
        BITS=w2.bits,
        GROUP=w2.group,
        BLOCK_N=block_n,
        BLOCK_K=min(block_k, triton.next_power_of_2(inter)),
    )
    return out
