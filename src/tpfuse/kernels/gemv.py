"""Small-batch linear layer (GEMV): out[M, N] = x[M, K] @ weight[N, K].T (+ bias) for M = 1..4 rows
(batch-1 decode, and a speculative verify of up to 3 draft tokens at batch 1).

At so few rows a projection is a stream of its weight through the SMs, so the kernel is laid out for
bandwidth alone: one program per BLOCK_N weight rows over the whole of K (no split-K, so no partials
and no hand-off), BLOCK_K columns per step as 16-byte vectors, and an fp32 accumulator of plain
multiply-adds per (row of x, weight row, column), reduced across K once after the loop (a reduction
per step costs shuffles on the path of every load). Each weight tile is loaded once for all M rows.
Weight loads are marked evict-first: each byte is read once per step, while x, the residual and the
KV cache should stay in L2.

The accumulator holds BLOCK_M x BLOCK_N x BLOCK_K fp32 values, so K per step shrinks as rows grow
(tile_for_rows). On one H200 (benchmarks/gemv.py, docs/PERF.md) the one-row tile, BLOCK_N = 4,
BLOCK_K = 2048, 4 warps, beat cuBLAS at every Llama-3.1-8B projection, by 1.04x (gate_up) to 1.34x
(o_proj). Whether a model uses it is decided per weight shape and row count by measurement at
start-up (model/gemv_choice.py), never assumed.

K is a compile-time constant (one variant per distinct K of a model, compiled during that
measurement): the trip count is known and, where BLOCK_K divides K, no load is masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 4
BLOCK_N = 4
NUM_WARPS = 4
ACCUMULATOR = 8192  # fp32 values per program: 64 registers a thread at 4 warps


def tile_for_rows(num_rows: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_K) for num_rows <= MAX_ROWS: rows padded to a power of two, and K per step
    such that BLOCK_M * BLOCK_N * BLOCK_K = ACCUMULATOR (one row: 2048)."""
    block_m = triton.next_power_of_2(max(num_rows, 1))
    return block_m, ACCUMULATOR // (block_m * BLOCK_N)


def gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [M, K]; weight: [N, K] (nn.Linear layout); bias: [N] or None; all one dtype. Returns [M, N]
    of x.dtype: x.float() @ weight.float().T (+ bias) rounded once; written into out when given."""
    result = x.float() @ weight.float().T
    if bias is not None:
        result += bias.float()
    result = result.to(x.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


@triton.jit
def _weight_tile(w_rows, ks, col_mask, HIDDEN: tl.constexpr, EVEN: tl.constexpr):
    """[BLOCK_N, BLOCK_K] weights at columns ks, as fp32 (0 past the edges)."""
    if EVEN:
        w = tl.load(w_rows + ks[None, :], eviction_policy="evict_first")
    else:
        mask = col_mask[:, None] & (ks < HIDDEN)[None, :]
        w = tl.load(w_rows + ks[None, :], mask=mask, other=0.0, eviction_policy="evict_first")
    return w.to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    num_cols,
    stride_xm,
    stride_wn,
    stride_om,
    HIDDEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # BLOCK_N divides num_cols and BLOCK_K divides HIDDEN: no masks on weights
    HAS_BIAS: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_M)
    row_mask = rows < num_rows
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < num_cols
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    if BLOCK_M == 1:  # the batch-1 decode path, kept 2-D
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            w = _weight_tile(w_rows, ks, col_mask, HIDDEN, EVEN)
            if EVEN:
                x = tl.load(x_ptr + ks)
            else:
                x = tl.load(x_ptr + ks, mask=ks < HIDDEN, other=0.0)
            acc += w * x.to(tl.float32)[None, :]
        out = tl.sum(acc, axis=1)[None, :]
    else:
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            w = _weight_tile(w_rows, ks, col_mask, HIDDEN, EVEN)
            x_mask = row_mask[:, None] & (ks < HIDDEN)[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=x_mask, other=0.0)
            acc3 += w[None, :, :] * x.to(tl.float32)[:, None, :]
        out = tl.sum(acc3, axis=2)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_offsets = rows[:, None] * stride_om + cols[None, :]
    tl.store(
        out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :]
    )


def _check(x, weight, bias, out) -> None:
    num_cols = weight.shape[0] if weight.dim() == 2 else None
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"gemv needs x [M, K] and weight [N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"gemv computes 1 to {MAX_ROWS} rows; got {x.shape[0]}: use F.linear")
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gemv needs x and weight both bf16 or both fp16; got {x.dtype} and {weight.dtype}")
    if not (x.stride(1) == 1 and weight.stride(1) == 1):
        raise ValueError("gemv needs x and weight contiguous along K: call .contiguous() first")
    if bias is not None and (bias.shape != (num_cols,) or bias.dtype != x.dtype or bias.stride(0) != 1):
        raise ValueError(
            f"bias must be [{num_cols}] {x.dtype}, contiguous; got {tuple(bias.shape)} {bias.dtype}"
        )
    if out is not None and (
        out.shape != (x.shape[0], num_cols) or out.dtype != x.dtype or out.stride(1) != 1
    ):
        raise ValueError(f"out must be [{x.shape[0]}, {num_cols}] {x.dtype}, contiguous along N")


def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    block_n: int = BLOCK_N,
    block_k: int | None = None,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """Triton gemv_ref: x [M, K] with M <= MAX_ROWS, weight [N, K], both contiguous along K, bias [N]
    or None, all bf16 or all fp16; fp32 accumulation, one rounding. Returns out (allocated when None)
    [M, N]. block_n / block_k / num_warps: the tile (default tile_for_rows; benchmarks and tests sweep
    it; block_k is capped at K).

    Raises ValueError for mismatched shapes or dtypes, 0 or more than MAX_ROWS rows, or a strided K."""
    _check(x, weight, bias, out)
    num_rows, hidden = x.shape
    num_cols = weight.shape[0]
    if out is None:
        out = torch.empty((num_rows, num_cols), dtype=x.dtype, device=x.device)
    if num_cols == 0:
        return out
    if hidden == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(num_rows, num_cols))
    block_m, default_k = tile_for_rows(num_rows)
    block_k = min(block_k or default_k, triton.next_power_of_2(hidden))
    _gemv_kernel[(triton.cdiv(num_cols, block_n),)](
        x, weight, bias if bias is not None else x, out, num_rows, num_cols,
        x.stride(0), weight.stride(0), out.stride(0),
        HIDDEN=hidden, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=num_cols % block_n == 0 and hidden % block_k == 0, HAS_BIAS=bias is not None,
        num_warps=num_warps, num_stages=1,
    )  # fmt: skip
    return out
