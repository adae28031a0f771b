"""FP8 W8A8 linear layer (where the GPU has FP8 tensor cores): out = quant(x) @ (weight * scale).T.

Weights and scales are kernels/quant_fp8.py's layout. fp8_dot_supported probes the tensor cores by
compiling and running a tiny FP8 tl.dot, never by architecture. Two forms:
  - prefill (fp8_w8a8_triton): x is quantized per row (per-channel weights) or per row and 128-column
    group (block weights) by quantize_fp8_rows, then FP8 x FP8 -> fp32 on the tensor cores, the scales
    applied per K block (block weights) or once at the end (per-channel);
  - decode, 1-64 rows (fp8_w8a8_decode_triton, a W8A8Tile): kernels/quant_dot.py on e4m3 x with one
    scale per row and K step (decode_group columns: 128, or the weight's K block where smaller),
    quantized inside the kernel (no launch added; every program quantizes its x tile, cheap for a few
    rows) or, for a prequantize tile, by quantize_fp8_rows first (one launch, a lean K loop for many
    rows). No weight is converted: the W8A16 forms convert every weight on the conversion pipe, which
    bounds them below the copy bandwidth (docs/PERF.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels.fp8_rows import Fp8Rows, quantize_groups
from tpfuse.kernels.gemv import rounded_linear_ref
from tpfuse.kernels.quant_dot import (
    ELEMENT,
    ROW,
    X_QUANTIZE_HERE,
    X_QUANTIZED,
    IntTile,
    quant_dot,
    scale_plan,
)
from tpfuse.kernels.quant_dot import IntTile as Fp8Tile
from tpfuse.kernels.quant_fp8 import FP8_DTYPE, FP8_MAX, check_fp8_weights, dequantize_fp8


def quantize_fp8_rows_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (xq [M, K] e4m3, scales [M, ceil(K / group)] float32) with x ~= xq * scale per
    (row, group of `group` columns); scale = amax / 448 (1 where a group is all zero)."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.zeros(m, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    amax = padded.view(m, groups, group).abs().amax(-1)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    xq = (padded.view(m, groups, group) / scales[..., None]).clamp(-FP8_MAX, FP8_MAX)
    return xq.view(m, -1)[:, :k].to(FP8_DTYPE), scales


def fp8_rounded_rows_ref(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] as its e4m3 quantization per (row, group columns) gives it back: float32 xq * scale."""
    xq, xs = quantize_fp8_rows_ref(x, group)
    return xq.float() * xs.repeat_interleave(group, 1)[:, : x.shape[1]]


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, stride_xm, stride_sm, stride_sg,
    HIDDEN: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    group = tl.program_id(1)
    ks = group * GROUP + tl.arange(0, BLOCK)
    mask = (ks < HIDDEN) & (tl.arange(0, BLOCK) < GROUP)
    x = tl.load(x_ptr + row * stride_xm + ks, mask=mask, other=0.0).to(tl.float32)
    q, scale = quantize_groups(x, BLOCK, BLOCK)  # the arithmetic every FP8-rows writer shares
    tl.store(q_ptr + row * HIDDEN + ks, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + group * stride_sg + tl.arange(0, 1), scale)


def quantize_fp8_rows_triton(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton quantize_fp8_rows_ref (one program per row and group)."""
    m, k = x.shape
    group = min(group, k)
    xq = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((m, -(-k // group)), dtype=torch.float32, device=x.device)
    return quantize_fp8_rows_into(x, group, xq, scales)


def quantize_fp8_rows_into(x, group: int, xq, scales) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_fp8_rows_triton into given outputs: xq [>= M, K] e4m3 contiguous and scales
    [>= M, ceil(K / group)] float32 of any strides (torch._scaled_mm takes them column-major); rows
    past x's are left as they were. Returns (xq, scales)."""
    m, k = x.shape
    group = min(group, k)
    groups = -(-k // group)
    if m:
        _quantize_rows_kernel[(m, groups)](
            x,
            xq,
            scales,
            x.stride(0),
            scales.stride(0),
            scales.stride(1),
            HIDDEN=k,
            GROUP=group,
            BLOCK=triton.next_power_of_2(group),
        )
    return xq, scales


@triton.jit
def _fp8_w8a8_kernel(
    xq_ptr,
    xs_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    num_cols,
    stride_xsm,
    stride_wn,
    stride_sn,
    stride_om,
    HIDDEN: tl.constexpr,
    SCALE_N: tl.constexpr,
    PER_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # rows fastest: the programs running at once share weight tiles (each read once from memory)
    # while the quantized x, far smaller, stays in L2
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Block scales over whole tiles (SCALE_N a multiple of BLOCK_N): one weight scale a K step, folded
    # into the rows' scales, so the step's promotion is one FFMA an element (sm_90: 179 registers
    # and no FMUL where a scale per column took 224 and an FMUL an element; docs/PERF.md).
    TILE_SCALE: tl.constexpr = PER_BLOCK and SCALE_N % BLOCK_N == 0
    tile_scales = s_ptr + (tl.program_id(1) * BLOCK_N // SCALE_N) * stride_sn
    row_mask = rows < num_rows
    col_mask = cols < num_cols
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < HIDDEN
        xt = tl.load(
            xq_ptr + rows.to(tl.int64)[:, None] * HIDDEN + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        wt = tl.load(
            w_ptr + cols.to(tl.int64)[:, None] * stride_wn + ks[None, :],
            mask=col_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if TILE_SCALE:
            kb = k0 // BLOCK_K
            xs = tl.load(xs_ptr + rows * stride_xsm + kb, mask=row_mask, other=0.0)
            acc += tl.dot(xt, tl.trans(wt)) * (xs * tl.load(tile_scales + kb))[:, None]
        elif PER_BLOCK:
            kb = k0 // BLOCK_K
            xs = tl.load(xs_ptr + rows * stride_xsm + kb, mask=row_mask, other=0.0)
            ws = tl.load(s_ptr + (cols // SCALE_N) * stride_sn + kb, mask=col_mask, other=0.0)
            acc += tl.dot(xt, tl.trans(wt)) * xs[:, None] * ws[None, :]
        else:
            acc = tl.dot(xt, tl.trans(wt), acc)
    if not PER_BLOCK:
        xs = tl.load(xs_ptr + rows * stride_xsm, mask=row_mask, other=0.0)
        ws = tl.load(s_ptr + (cols // SCALE_N) * stride_sn, mask=col_mask, other=0.0)
        acc = acc * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def activation_group(block: tuple[int, int], hidden: int) -> int:
    """Columns per activation scale in the W8A8 form: the weight's K block (whole rows for per-channel)."""
    return hidden if block[1] >= hidden else block[1]


def fp8_w8a8_ref(x, weight, scale, block, bias=None, group: int | None = None):
    """What fp8_w8a8_triton computes: x quantized per (row, group columns; default activation_group) to
    e4m3, times the dequantized weight, in float32; rounded once to x.dtype."""
    xd = fp8_rounded_rows_ref(x, group or activation_group(block, x.shape[1]))
    return rounded_linear_ref(xd, dequantize_fp8(weight, scale, block), bias, x.dtype)


def fp8_w8a8_triton(x, weight, scale, block, bias=None, *, tile: Fp8Tile | None = None):
    """FP8 x FP8 tensor-core product (prefill). Block scales need block[1] == tile.block_k (128)."""
    num_rows, hidden = x.shape
    check_fp8_weights(weight, scale, block, hidden)
    xq, xs = quantize_fp8_rows_triton(x, activation_group(block, hidden))
    return _w8a8_product(xq, xs, weight, scale, block, bias, tile, x.dtype)


def fp8_w8a8_rows_ref(rows: Fp8Rows, weight, scale, block, bias=None):
    """What fp8_w8a8_rows_triton computes: the rows' values times the dequantized weight in float32,
    rounded once to rows.dtype."""
    return rounded_linear_ref(rows.dequantize(), dequantize_fp8(weight, scale, block), bias, rows.dtype)


def fp8_w8a8_rows_triton(rows: Fp8Rows, weight, scale, block, bias=None, *, tile: Fp8Tile | None = None):
    """fp8_w8a8_triton on activations already quantized (kernels/fp8_rows.py: the bits fp8_w8a8_triton's
    own quantization gives them) with the weight's activation group (the whole row for per-channel and
    per-tensor weights, the K block for block weights); out [T, N] of rows.dtype. Raises ValueError for
    rows of another group."""
    hidden = rows.shape[1]
    check_fp8_weights(weight, scale, block, hidden)
    group = activation_group(block, hidden)
    if min(rows.group, hidden) != group:
        raise ValueError(f"FP8 rows of {rows.group} columns a scale; weights of {block} blocks take {group}")
    return _w8a8_product(rows.data, rows.scales, weight, scale, block, bias, tile, rows.dtype)


def _w8a8_product(xq, xs, weight, scale, block, bias, tile: Fp8Tile | None, out_dtype):
    """The tensor-core product of xq [M, K] e4m3 (contiguous) with scales xs [M, groups] float32."""
    num_rows, hidden = xq.shape
    per_block = activation_group(block, hidden) < hidden
    # per-block scales: 4 warps keep the loads on cp.async (8 warps fall back to plain loads and
    # 255 registers on sm_90); per-row: 128x128 on 8 warps, 117 registers
    tile = tile or (Fp8Tile(64, 128, 128, 3, 4) if per_block else Fp8Tile(128, 128, 128, 3, 8))
    if per_block and tile.block_k != block[1]:
        raise ValueError(f"block scales {block} need tile.block_k == {block[1]}")
    num_cols = weight.shape[0]
    out = torch.empty((num_rows, num_cols), dtype=out_dtype, device=xq.device)
    if num_rows == 0 or num_cols == 0:
        return out
    grid = (triton.cdiv(num_rows, tile.block_m), triton.cdiv(num_cols, tile.block_n))
    _fp8_w8a8_kernel[grid](
        xq,
        xs,
        weight,
        scale,
        bias if bias is not None else out,
        out,
        num_rows,
        num_cols,
        xs.stride(0),
        weight.stride(0),
        scale.stride(0),
        out.stride(0),
        HIDDEN=hidden,
        SCALE_N=block[0],
        PER_BLOCK=per_block,
        HAS_BIAS=bias is not None,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )
    return out


@dataclass(frozen=True)
class W8A8Tile(IntTile):
    """A launch of the decode form (block_m >= 16 for tl.dot; rows past x's are masked); prequantize:
    x quantized by its own launch first, else inside the product kernel."""

    prequantize: bool = False

    def label(self) -> str:
        return ("w8a8 pre-quantized " if self.prequantize else "w8a8 ") + super().label()


# Decode candidates per row bucket, timed at start-up beside the W8A16 tiles (model/quant/fp8.py). Their
# K loops, compiled for sm_90 (docs/PERF.md): quantizing x in the kernel costs about 1.5 instructions
# per weight at 16 rows on 256 weight rows a program (3.3 on 64), 2.1 at 32 rows and 3.2 at 64, so
# from 32 rows x is also quantized first. The 256-row tiles leave the 4096-row projections 16
# programs: split-K 4 (or 128 rows and split-K 2) fill the SMs. At 64 rows the 64-row tiles give
# o_proj 64 programs (14.1 us on an H100 for 16.8 MB: 39 % of the copy bandwidth), so they come with
# split-K 2 and 4 too.
_QUANTIZE_HERE = (W8A8Tile(16, 256, 128, 3, 8, swap=True), W8A8Tile(16, 256, 128, 3, 8, swap=True, split_k=4),
                  W8A8Tile(16, 128, 128, 4, 8, swap=True, split_k=2))
W8A8_TILES = {
    1: _QUANTIZE_HERE,
    16: _QUANTIZE_HERE,
    32: (W8A8Tile(32, 256, 128, 3, 8, swap=True, split_k=4),
         W8A8Tile(32, 128, 128, 4, 8, swap=True, split_k=2, prequantize=True)),
    64: (W8A8Tile(64, 128, 128, 4, 8, swap=True, split_k=2, prequantize=True),
         W8A8Tile(64, 64, 128, 4, 4, swap=True, prequantize=True),
         W8A8Tile(64, 64, 128, 4, 4, swap=True, split_k=2, prequantize=True),
         W8A8Tile(64, 64, 128, 4, 4, swap=True, split_k=4, prequantize=True)),
}  # fmt: skip


def decode_group(block: tuple[int, int], hidden: int, tile: IntTile | None = None) -> int:
    """Columns per activation scale in the decode form: the kernel's K step (128, or the power-of-two
    part of the weight's K block where smaller); a prequantize tile with per-row weight scales takes
    whole rows (one scale a row, applied after the K loop). Raises ValueError where the K block allows
    no step of 16 or more."""
    tile = tile or W8A8_TILES[1][0]
    step, mode = scale_plan(tile.block_k, block[1], hidden, False)
    if mode == ELEMENT:
        raise ValueError(f"the W8A8 decode form needs K blocks with a power-of-two part >= 16; got {block}")
    return hidden if getattr(tile, "prequantize", False) and mode == ROW else step


def fp8_w8a8_decode_ref(x, weight, scale, block, bias=None, tile: IntTile | None = None):
    """What fp8_w8a8_decode_triton computes (fp8_w8a8_ref at decode_group's columns)."""
    return fp8_w8a8_ref(x, weight, scale, block, bias, group=decode_group(block, x.shape[1], tile))


def fp8_w8a8_decode_triton(x, weight, scale, block, bias=None, *, tile: W8A8Tile | None = None):
    """The decode form: x [M, K] (any M; made for 1-64) quantized per (row, decode_group columns), FP8 x
    FP8 on the tensor cores (kernels/quant_dot.py). Returns a new [M, N] of x's dtype."""
    hidden = x.shape[1]
    check_fp8_weights(weight, scale, block, hidden)
    if x.stride(1) != 1:
        raise ValueError("fp8_w8a8_decode needs x contiguous along K: call .contiguous() first")
    tile = tile or W8A8_TILES[1][0]
    group = decode_group(block, hidden, tile)  # raises where no step fits the weight's K blocks
    how = dict(bits=0, scale_n=block[0], scale_k=block[1], tile=tile, out_dtype=x.dtype)
    if getattr(tile, "prequantize", False):
        xq, xs = quantize_fp8_rows_triton(x, group)
        return quant_dot(xq, weight, scale.contiguous(), None, bias, x_fp8=X_QUANTIZED, x_scales=xs, **how)
    return quant_dot(x, weight, scale.contiguous(), None, bias, x_fp8=X_QUANTIZE_HERE, **how)


@triton.jit
def _fp8_dot_probe_kernel(a_ptr, b_ptr, out_ptr):
    r = tl.arange(0, 16)
    ks = tl.arange(0, 32)
    a = tl.load(a_ptr + r[:, None] * 32 + ks[None, :])
    b = tl.load(b_ptr + r[:, None] * 32 + ks[None, :])
    tl.store(out_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, tl.trans(b)))


@functools.cache
def fp8_dot_supported(device: torch.device) -> bool:
    """Whether this CUDA device compiles and correctly runs an FP8 x FP8 tl.dot (asked once per device)."""
    if device.type != "cuda":
        return False
    try:
        generator = torch.Generator(device).manual_seed(0)
        a = torch.randn(16, 32, device=device, generator=generator).to(FP8_DTYPE)
        b = torch.randn(16, 32, device=device, generator=generator).to(FP8_DTYPE)
        out = torch.empty(16, 16, device=device)
        _fp8_dot_probe_kernel[(1,)](a, b, out)
        torch.cuda.synchronize(device)
        return bool(torch.allclose(out, a.float() @ b.float().T, rtol=1e-3, atol=1e-3))
    except Exception:  # noqa: BLE001 - any failure to compile or run means no FP8 tensor cores here
        return False
