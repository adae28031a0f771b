"""Batch-1 linear layer (GEMV): out[1, N] = x[1, K] @ weight[N, K].T (+ bias), for decode at one row.

At one row a projection is a stream of its weight through the SMs, so the kernel is laid out for
bandwidth alone: one program per BLOCK_N weight rows over the whole of K (no split-K, so no partials
and no hand-off), BLOCK_K columns per step as 16-byte vectors, and a [BLOCK_N, BLOCK_K] fp32
accumulator of plain multiply-adds, reduced across K once after the loop (a reduction per step
costs shuffles on the path of every load). Weight loads are marked evict-first: each byte is read
once per step, while x, the residual and the KV cache should stay in L2.

On one H200 (benchmarks/gemv.py, docs/PERF.md) BLOCK_N = 4, BLOCK_K = 2048 and 4 warps beat
cuBLAS at every Llama-3.1-8B projection, by 1.04x (gate_up) to 1.34x (o_proj).
Whether a model uses it is decided per weight shape by measurement at start-up
(model/linear_choice.py), never assumed. One row only: the same layout sharing each weight tile
across 2-4 rows (a [rows, 4, 2048 / rows] accumulator) ran 1.4-1.9x slower than cuBLAS there
(6bd867b, reverted); 2-64 rows go to the tensor-core tiles of kernels/skinny_linear.py instead.

K is a compile-time constant (one variant per distinct K of a model, compiled during that
measurement): the trip count is known and, where BLOCK_K divides K, no load is masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels import pdl

BLOCK_N = 4
BLOCK_K = 2048
NUM_WARPS = 4


def rounded_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) in x's (float) precision, rounded once to dtype: the
    reference epilogue of every dense and quantized linear."""
    result = x @ weight.T
    if bias is not None:
        result += bias.float()
    return result.to(dtype)


def gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [1, K]; weight: [N, K] (nn.Linear layout); bias: [N] or None; all one dtype. Returns [1, N]
    of x.dtype: x.float() @ weight.float().T (+ bias) rounded once; written into out when given."""
    result = rounded_linear_ref(x.float(), weight.float(), bias, x.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


@triton.jit
def _step_weights(w_rows, col_mask, k0, HIDDEN: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weights of the K step at k0."""
    ks = k0 + tl.arange(0, BLOCK_K)
    if EVEN:
        return tl.load(w_rows + ks[None, :], eviction_policy="evict_first")
    mask = col_mask[:, None] & (ks < HIDDEN)[None, :]
    return tl.load(w_rows + ks[None, :], mask=mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _step_x(x_ptr, k0, HIDDEN: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """x's [BLOCK_K] float32 values of the K step at k0."""
    ks = k0 + tl.arange(0, BLOCK_K)
    if EVEN:
        return tl.load(x_ptr + ks).to(tl.float32)
    return tl.load(x_ptr + ks, mask=ks < HIDDEN, other=0.0).to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    num_cols,
    stride_wn,
    HIDDEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # BLOCK_N divides num_cols and BLOCK_K divides HIDDEN: no masks
    HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr,  # kernels/pdl.py: the first step's weights load before the wait
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < num_cols
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    w = _step_weights(w_rows, col_mask, 0, HIDDEN, BLOCK_K, EVEN)
    pdl.begin(PDL)
    acc = w.to(tl.float32) * _step_x(x_ptr, 0, HIDDEN, BLOCK_K, EVEN)[None, :]
    for k0 in range(BLOCK_K, HIDDEN, BLOCK_K):
        w = _step_weights(w_rows, col_mask, k0, HIDDEN, BLOCK_K, EVEN)
        acc += w.to(tl.float32) * _step_x(x_ptr, k0, HIDDEN, BLOCK_K, EVEN)[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=col_mask)


def check_dtypes_and_bias(
    kernel: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """The checks the linear kernels share (this one and skinny_linear.py): x and weight both bf16 or
    both fp16, bias None or [N] of their dtype, contiguous."""
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"{kernel} needs x and weight both bf16 or both fp16; got {x.dtype} and {weight.dtype}"
        )
    num_cols = weight.shape[0]
    if bias is not None and (bias.shape != (num_cols,) or bias.dtype != x.dtype or bias.stride(0) != 1):
        raise ValueError(
            f"bias must be [{num_cols}] {x.dtype}, contiguous; got {tuple(bias.shape)} {bias.dtype}"
        )


def _check(x, weight, bias, out) -> None:
    num_cols = weight.shape[0] if weight.dim() == 2 else None
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"gemv needs x [1, K] and weight [N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.shape[0] != 1:
        raise ValueError(f"gemv computes one row; got {x.shape[0]}: use F.linear for more")
    check_dtypes_and_bias("gemv", x, weight, bias)
    if not (x.is_contiguous() and weight.stride(1) == 1):
        raise ValueError("gemv needs x contiguous and weight contiguous along K: call .contiguous() first")
    if out is not None and (out.shape != (1, num_cols) or out.dtype != x.dtype or not out.is_contiguous()):
        raise ValueError(f"out must be [1, {num_cols}] {x.dtype}, contiguous")


def gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """Triton gemv_ref: x [1, K] contiguous, weight [N, K] contiguous along K, bias [N] or None, all
    bf16 or all fp16; fp32 accumulation, one rounding. Returns out (allocated when None) [1, N].
    block_n / block_k / num_warps: the tile (benchmarks and tests sweep them; block_k is capped at K).

    Raises ValueError for mismatched shapes or dtypes, more than one row, or a strided K."""
    _check(x, weight, bias, out)
    num_cols, hidden = weight.shape
    if out is None:
        out = torch.empty((1, num_cols), dtype=x.dtype, device=x.device)
    if num_cols == 0:
        return out
    if hidden == 0:
        return out.zero_() if bias is None else out.copy_(bias[None])
    block_k = min(block_k, triton.next_power_of_2(hidden))
    _gemv_kernel[(triton.cdiv(num_cols, block_n),)](
        x, weight, bias if bias is not None else x, out, num_cols, weight.stride(0),
        HIDDEN=hidden, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=num_cols % block_n == 0 and hidden % block_k == 0, HAS_BIAS=bias is not None,
        num_warps=num_warps, num_stages=1, **pdl.launch(x.device),
    )  # fmt: skip
    return out
