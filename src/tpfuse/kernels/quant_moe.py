"""Quantized fused-MoE experts, per (token, slot) row: the layout of kernels/fused_moe_gemv.py with the
expert's weight tile dequantized in registers (kernels/quant_int.py's group-quantized codes, or
kernels/quant_fp8.py's e4m3 weights with one fp32 scale per (row, K block)).

Program (s, n) takes slot row s = t * k + j and streams expert ids[s]'s rows n-block once through the
dense GEMV steps (contiguous code loads, scales once per word / sub-tile / row, an accumulator
reduced once; with a Half2SlotTile, 4-bit codes through kernels/quant_int_half2.py's f16x2 rows),
so decode (few slots) reads each routed expert's packed bytes once per slot;
graph-safe (no data-dependent shapes). Larger slot counts re-read an expert for each of its slots:
a grouped quantized GEMM is the prefill route still to build.

QuantExperts holds one projection stack: codes [E, N, K*bits/32] int32 (or [E, N, K] e4m3),
scales [E, N, K / group] and for int offsets None (symmetric only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl, quant_int_half2
from tpfuse.kernels.moe_routing import MAX_EXPERTS, slot_expert
from tpfuse.kernels.quant_dot import pow2_part
from tpfuse.kernels.quant_fp8 import dequantize_fp8, fp8_rows_dot_x, gemv_steps
from tpfuse.kernels.quant_int import dequantize_int, gemv_block_k, int_words_times_x, values_per_word, x_pairs


@dataclass(frozen=True)
class QuantExperts:
    """codes [E, N, K*bits/32] int32 (bits 4/8) or [E, N, K] float8_e4m3fn (bits 0: FP8); scales
    [E, N, ceil(K / group)] (int: any float dtype; FP8: float32). row_block: runs of that many rows,
    from row 0, have the same scales (FP8 128 x 128 blocks expanded per row), so a program whose rows
    lie in one run reads them once (X_SCALE of kernels/quant_fp8.py); 1 where nothing is known."""

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int
    group: int
    cols: int  # K
    row_block: int = 1

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


@dataclass(frozen=True)
class Half2SlotTile:
    """The per-slot route with the f16x2 rows of kernels/quant_int_half2.py (4-bit symmetric codes,
    bf16 / fp16 x, K and group multiples of 32: fits): (rows a program, K step) of the gate/up and the
    down programs, and warps a program."""

    gate_up: tuple[int, int] = (4, 2048)
    down: tuple[int, int] = (4, 1024)
    num_warps: int = 1

    def label(self) -> str:
        up, down = self.gate_up, self.down
        return f"half2 slots up {up[0]}x{up[1]} down {down[0]}x{down[1]} w{self.num_warps}"

    def fits(self, x: torch.Tensor, w13: QuantExperts, w2: QuantExperts) -> bool:
        """Whether both stacks take the f16x2 rows with activations like x (bf16 / fp16, rows 16-byte
        aligned)."""
        aligned = x.data_ptr() % 16 == 0 and (x.dim() == 1 or x.stride(0) * x.element_size() % 16 == 0)
        return (
            aligned
            and x.dtype in (torch.bfloat16, torch.float16)
            and all(s.bits == 4 and s.cols % 32 == 0 for s in (w13, w2))
            and all(s.group >= s.cols or s.group % 32 == 0 for s in (w13, w2))
        )


# Start-up candidates at decode sizes (model/quant/experts.py): both K steps whole at Qwen3-30B-A3B's
# expert shapes (hidden 2048, intermediate 768: down masked to 1024 or three steps of 256).
HALF2_SLOT_TILES = (Half2SlotTile((4, 2048), (4, 1024)), Half2SlotTile((4, 2048), (16, 256)),
                    Half2SlotTile((8, 1024), (8, 1024)))  # fmt: skip


@triton.jit
def _rows_dot_x(
    w_rows,
    s_rows,
    x_row,
    hidden,
    col_mask,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr,
    SUBS: tl.constexpr,
    PER_ROW: tl.constexpr,
    EVEN: tl.constexpr,
    X_PAIRS: tl.constexpr,
    HALF2: tl.constexpr,
    X_FP16: tl.constexpr,
    INTERPRET: tl.constexpr,
    X_SCALE: tl.constexpr,
):
    """[BLOCK_N] float32: the expert rows at w_rows ([BLOCK_N, 1] pointers; scales at s_rows, [BLOCK_N]
    pointers to each row's first) dotted with x_row over K, through the dense GEMV steps
    (kernels/quant_fp8.py for BITS 0, kernels/quant_int.py for 4 / 8, kernels/quant_int_half2.py's
    rows_dot_x with HALF2, where EVEN covers both the rows and K). X_SCALE (FP8, rows sharing their
    scales): s_rows is one pointer, to the scales of the program's rows, and they multiply x."""
    if HALF2:
        out = quant_int_half2.rows_dot_x(
            w_rows[:, :, None], s_rows[:, None], s_rows[:, None], x_row, hidden, col_mask, GROUP, False,
            BLOCK_N, BLOCK_K, not EVEN, not EVEN, X_FP16, INTERPRET,
        )  # fmt: skip
    elif BITS == 0:
        out = fp8_rows_dot_x(
            w_rows, s_rows, x_row, hidden, col_mask, GROUP, PER_ROW, BLOCK_N, SUB_K, SUBS, EVEN, None, X_SCALE
        )
    else:
        WORDS: tl.constexpr = BLOCK_K // (32 // BITS)
        acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
        acc_x = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            a, b = int_words_times_x(
                w_rows, s_rows[:, None], s_rows[:, None], x_row, k0, hidden, col_mask,
                BITS, GROUP, False, BLOCK_N, WORDS, EVEN, X_PAIRS,
            )  # fmt: skip
            acc += a
            acc_x += b
        out = tl.sum(acc * (1 << BITS) - acc_x * ((1 << BITS) + (1 << (BITS - 1))), axis=1)
    return out


@triton.jit
def _scale_rows(expert_scales, cols, stride_sn, X_SCALE: tl.constexpr):
    """The scale pointers of rows cols ([BLOCK_N]) of an expert's stack: one each, or with X_SCALE one
    for all (the first row's: the rows share their scales)."""
    if X_SCALE:
        rows = tl.min(cols, axis=0)
    else:
        rows = cols
    return expert_scales + rows.to(tl.int64) * stride_sn


@triton.jit
def _slot_gate_up_kernel(
    x_ptr, w_ptr, s_ptr, act_ptr, ids_ptr, logits_ptr, weights_ptr, hidden, inter, num_experts,
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_act,
    TOP_K: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SUB_K: tl.constexpr, SUBS: tl.constexpr, PER_ROW: tl.constexpr,
    EVEN: tl.constexpr, X_PAIRS: tl.constexpr, HALF2: tl.constexpr, X_FP16: tl.constexpr,
    INTERPRET: tl.constexpr, ROUTE: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_TOPK: tl.constexpr, X_SCALE: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):  # fmt: skip
    """act[s, n] = silu(x[t] . gate_e[n]) * (x[t] . up_e[n]), e = ids[s], t = s // k; gate rows
    0..I-1 of the stack, up rows I..2I-1. ROUTE: e is picked from token t's router logits
    (moe_routing.slot_expert) and the slot's first program stores it to ids[s], its weight to weights[s]."""
    pdl.begin(PDL)  # which weights to read depends on ids / logits an earlier kernel wrote
    slot = tl.program_id(0)
    token = (slot // TOP_K).to(tl.int64)
    expert = slot_expert(ids_ptr, logits_ptr, weights_ptr, slot, num_experts, TOP_K, ROUTE, RENORMALIZE,
                         BLOCK_E, BLOCK_TOPK)  # fmt: skip
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    g_rows = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    g_scales = _scale_rows(s_ptr + expert * stride_se, cols, stride_sn, X_SCALE)
    x_row = x_ptr + token * stride_x
    g = _rows_dot_x(g_rows, g_scales, x_row, hidden, col_ok, BITS, GROUP, BLOCK_N, BLOCK_K, SUB_K, SUBS,
                    PER_ROW, EVEN, X_PAIRS, HALF2, X_FP16, INTERPRET, X_SCALE)  # fmt: skip
    u = _rows_dot_x(g_rows + inter * stride_wn, g_scales + inter * stride_sn, x_row, hidden, col_ok,
                    BITS, GROUP, BLOCK_N, BLOCK_K, SUB_K, SUBS, PER_ROW, EVEN, X_PAIRS, HALF2, X_FP16,
                    INTERPRET, X_SCALE)  # fmt: skip
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + slot.to(tl.int64) * stride_act + cols, act.to(act_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _slot_down_kernel(
    act_ptr, w_ptr, s_ptr, out_ptr, weights_ptr, ids_ptr, hidden, inter,
    stride_act, stride_we, stride_wn, stride_se, stride_sn, stride_out,
    BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr, SUBS: tl.constexpr, PER_ROW: tl.constexpr, EVEN: tl.constexpr,
    X_PAIRS: tl.constexpr, HALF2: tl.constexpr, X_FP16: tl.constexpr, INTERPRET: tl.constexpr,
    X_SCALE: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py
):  # fmt: skip
    """out[s, n] = weight[s] * (act[s] . down_e[n]), e = ids[s]."""
    pdl.begin(PDL)
    slot = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    rows = w_ptr + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
    scales = _scale_rows(s_ptr + expert * stride_se, cols, stride_sn, X_SCALE)
    y = _rows_dot_x(rows, scales, act_ptr + slot * stride_act, inter, col_ok, BITS, GROUP, BLOCK_N, BLOCK_K,
                    SUB_K, SUBS, PER_ROW, EVEN, X_PAIRS, HALF2, X_FP16, INTERPRET, X_SCALE)  # fmt: skip
    y = y * tl.load(weights_ptr + slot)
    tl.store(out_ptr + slot * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=col_ok)


def quant_slots_ref(x, w13: QuantExperts, w2: QuantExperts, topk_weights, topk_ids) -> torch.Tensor:
    """[T * k, H] of x.dtype: row t * k + j = topk_weights[t, j] * expert(x[t]) with the dequantized
    weights in float32, the SiLU-and-mul product rounded to x.dtype (as the kernels store it)."""
    return slots_ref(x, w13.dequantize(), w2.dequantize(), topk_weights, topk_ids)


def slots_ref(x, gate_up: torch.Tensor, down: torch.Tensor, topk_weights, topk_ids) -> torch.Tensor:
    """quant_slots_ref on already dequantized stacks gate_up [E, 2I, H] and down [E, H, I] (float32, or
    float64 for a float64 reference: the products run in the stacks' dtype)."""
    inter = gate_up.shape[1] // 2
    ids = topk_ids.reshape(-1).long()
    tokens = x.to(gate_up.dtype).repeat_interleave(topk_ids.shape[1], dim=0)
    h = torch.einsum("sk,snk->sn", tokens, gate_up[ids])
    act = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]).to(x.dtype).to(gate_up.dtype)
    out = torch.einsum("sk,snk->sn", act, down[ids]) * topk_weights.reshape(-1, 1).to(gate_up.dtype)
    return out.to(x.dtype)


def _steps(stack: QuantExperts, cols_k: int, block_n: int, num_cols: int, max_block_k: int, pairs: bool):
    """The constexpr K steps of one projection stack (K = cols_k) for the row kernels above: the
    largest power-of-two step up to max_block_k that divides K (masked steps where none of 64+ does);
    pairs: x may be read as bf16 pairs (quant_int.x_pairs)."""
    block_k = min(max_block_k, pow2_part(cols_k))
    if block_k < 64:
        block_k = min(max_block_k, triton.next_power_of_2(cols_k))
    if stack.bits:
        block_k = gemv_block_k(block_k, cols_k, stack.bits)
    # a short K step (the down projection's K is the intermediate size) takes more rows per program,
    # so each thread still has about as many weights per step to amortise the x loads over
    block_n = min(64, max(block_n, block_n * max_block_k // block_k))
    x_scale = stack.bits == 0 and stack.group < cols_k and stack.row_block % block_n == 0
    if stack.bits == 0:
        per_row, sub_k, subs = gemv_steps(block_k, stack.group, cols_k, x_scale)
    else:
        per_row, sub_k, subs = False, block_k, 1
    even = cols_k % (sub_k * subs if stack.bits == 0 else block_k) == 0 and num_cols % block_n == 0
    return dict(BITS=stack.bits, GROUP=stack.group, BLOCK_N=block_n, BLOCK_K=block_k, SUB_K=sub_k,
                SUBS=subs, PER_ROW=per_row, EVEN=even, X_PAIRS=pairs and stack.bits > 0, HALF2=False,
                X_FP16=False, INTERPRET=False, X_SCALE=x_scale)  # fmt: skip


def _half2_steps(stack: QuantExperts, cols_k: int, num_cols: int, shape: tuple[int, int], x_fp16: bool):
    """The constexprs of one projection stack for the f16x2 rows (Half2SlotTile's (rows, K step))."""
    block_n, block_k = shape
    block_k = max(32, min(block_k, triton.next_power_of_2(cols_k)))
    even = cols_k % block_k == 0 and num_cols % block_n == 0
    return dict(BITS=4, GROUP=stack.group, BLOCK_N=block_n, BLOCK_K=block_k, SUB_K=block_k, SUBS=1,
                PER_ROW=False, EVEN=even, X_PAIRS=False, HALF2=True, X_FP16=x_fp16,
                INTERPRET=quant_int_half2.interpreting(), X_SCALE=False)  # fmt: skip


def quant_slots_triton(
    x, w13: QuantExperts, w2: QuantExperts, topk_weights, topk_ids, block_n=16, block_k=None, tile=None
):
    """Triton quant_slots_ref (the per-slot route). x [T, H] bf16/fp16/fp32 contiguous. Integer
    stacks need a group size that is a multiple of the values in a packed word. block_n / block_k:
    expert rows per program and the widest K step (default 1024 for integer codes, 512 for FP8: the
    GEMV shapes with the fewest instructions per weight on sm_90, kernels/quant_int.py, quant_fp8.py).
    tile: a Half2SlotTile runs the f16x2 rows where it fits (else block_n / block_k as without)."""
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    return _slots(x, w13, w2, weights, ids, topk_ids.shape[1], None, False, block_n, block_k, tile)


def quant_routed_slots_triton(x, w13: QuantExperts, w2: QuantExperts, logits, top_k: int, renormalize: bool,
                              tile=None):  # fmt: skip
    """quant_slots_triton with the softmax top-k of logits [T, E] float32 inside the gate/up launch
    (each program picks its slot's expert, as moe_topk_triton would): -> (slots [T * k, H], topk_weights
    [T, k] float32, topk_ids [T, k] int32)."""
    num_tokens, num_experts = x.shape[0], w13.codes.shape[0]
    if logits.shape != (num_tokens, num_experts) or logits.dtype != torch.float32:
        raise ValueError(f"routed slots need float32 logits [{num_tokens}, {num_experts}], got "
                         f"{list(logits.shape)} {logits.dtype}")  # fmt: skip
    if not 1 <= top_k <= num_experts or num_experts > MAX_EXPERTS:
        raise ValueError(f"routed slots need 1 <= top_k ({top_k}) <= E ({num_experts}) <= {MAX_EXPERTS}")
    ids = torch.empty(num_tokens * top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(num_tokens * top_k, dtype=torch.float32, device=x.device)
    out = _slots(x, w13, w2, weights, ids, top_k, logits.contiguous(), renormalize, 16, None, tile)
    return out, weights.view(num_tokens, top_k), ids.view(num_tokens, top_k)


def _slots(x, w13, w2, weights, ids, top_k, logits, renormalize, block_n, block_k, tile):
    """The two per-slot launches; with logits the gate/up launch routes and fills ids and weights."""
    block_k = block_k or (1024 if w13.bits else 512)
    num_slots = ids.numel()
    hidden, inter = x.shape[1], w13.codes.shape[1] // 2
    out = torch.empty(num_slots, hidden, dtype=x.dtype, device=x.device)
    if num_slots == 0:
        return out
    for stack in (w13, w2):
        if stack.bits and stack.group < stack.cols and stack.group % values_per_word(stack.bits):
            raise ValueError(
                f"expert group size {stack.group} is not a multiple of the {values_per_word(stack.bits)} "
                f"values in a packed int32 word at {stack.bits} bits"
            )
    act = torch.empty(num_slots, inter, dtype=x.dtype, device=x.device)
    num_experts = w13.codes.shape[0]
    block_e = max(triton.next_power_of_2(num_experts), 16)
    routing = dict(ROUTE=logits is not None, RENORMALIZE=renormalize, BLOCK_E=block_e,
                   BLOCK_TOPK=triton.next_power_of_2(top_k))  # fmt: skip
    # act (x's dtype, rows of inter = w2.cols values) fits whenever x does
    half2 = tile is not None and tile.fits(x, w13, w2)
    warps = dict(num_warps=tile.num_warps) if half2 else {}
    x_fp16 = x.dtype == torch.float16
    if half2:
        up = _half2_steps(w13, hidden, inter, tile.gate_up, x_fp16)
    else:
        up = _steps(w13, hidden, block_n, inter, block_k, x_pairs(x))
    _slot_gate_up_kernel[(num_slots, triton.cdiv(inter, up["BLOCK_N"]))](
        x, w13.codes, w13.scales, act, ids, logits, weights, hidden, inter, num_experts, x.stride(0),
        w13.codes.stride(0), w13.codes.stride(1), w13.scales.stride(0), w13.scales.stride(1), act.stride(0),
        TOP_K=top_k, **up, **routing, **warps, **pdl.launch(x.device),
    )  # fmt: skip
    if half2:
        down = _half2_steps(w2, inter, hidden, tile.down, x_fp16)
    else:
        down = _steps(w2, inter, block_n, hidden, block_k, x_pairs(act))
    _slot_down_kernel[(num_slots, triton.cdiv(hidden, down["BLOCK_N"]))](
        act, w2.codes, w2.scales, out, weights, ids, hidden, inter, act.stride(0),
        w2.codes.stride(0), w2.codes.stride(1), w2.scales.stride(0), w2.scales.stride(1), out.stride(0),
        **down, **warps, **pdl.launch(x.device),
    )  # fmt: skip
    return out
