"""Few-row linear layer: out[M, N] = x[M, K] @ weight[N, K].T (+ bias) for 2 <= M <= 64 rows.

A speculative verify pass (k + 1 rows per sequence) and small decode batches are still a stream of
the weights through the SMs, but more rows than the one-row GEMV (kernels/gemv.py) can carry in
plain multiply-adds: here each program takes BLOCK_N weight rows over the whole of K and multiplies
them with all the rows of x at once on the tensor cores (tl.dot, x padded to BLOCK_M rows with
zeros), BLOCK_K columns per step, with the loads software-pipelined num_stages deep so enough
weight bytes are in flight.

split_k > 1 divides K among that many programs per column block, for weights with few rows
(o_proj, down) where one program per block leaves SMs idle or re-reads x too often: each writes its
fp32 partial, and the last to arrive (an arrival counter per column block, reset to 0 by it, so the
kernel is CUDA-graph safe) sums the partials in split order, so results are bit-identical from run
to run whatever the arrival order.

SWAP puts the weight tile on the left of the product (out.T = weight @ x.T): the MMA's wide side
then spans weight rows instead of padded x rows. Which tile and which form is faster depends on
the shape, the row count and the GPU, so nothing is assumed: model/linear_choice.py times it
against cuBLAS per weight shape and row bucket at start-up.

K is a compile-time constant, as in the GEMV: the trip count is known and, where BLOCK_K divides
K and BLOCK_N divides N, weight loads carry no mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels.decode_merge import arrival_counters
from tpfuse.kernels.gemv import check_dtypes_and_bias, gemv_ref

MAX_ROWS = 64


@dataclass(frozen=True)
class Tile:
    """One launch configuration. block_m is the row bucket (x padded to it); swap: see the module doc."""

    block_m: int = 16
    block_n: int = 32
    block_k: int = 256
    num_stages: int = 4
    num_warps: int = 4
    swap: bool = False
    split_k: int = 1

    def label(self) -> str:
        form = (" swap" if self.swap else "") + (f" split{self.split_k}" if self.split_k > 1 else "")
        return f"m{self.block_m} n{self.block_n} k{self.block_k} s{self.num_stages} w{self.num_warps}{form}"


_PARTIALS: dict[torch.device, list[torch.Tensor]] = {}


@triton.jit
def sum_splits_in_last(part, partials_ptr, counter_ptr, offsets, mask, split_stride, SPLIT_K: tl.constexpr):
    """The end of a split-K program (program_id(1) its split): stores its float32 partial `part` at
    partials_ptr + split * split_stride + offsets (mask), and the last of the SPLIT_K programs counting
    at counter_ptr to arrive gets (the partials summed in split order, True), every other (part, False);
    the last leaves the counter at 0 for the next launch or graph replay. The sum does not depend on the
    order of arrival."""
    tl.store(partials_ptr + tl.program_id(1) * split_stride + offsets, part, mask=mask)
    tl.debug_barrier()  # every thread's partial stores before the release below
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
    total = part
    if last:
        tl.debug_barrier()
        total = tl.zeros_like(part)
        for split in tl.static_range(SPLIT_K):
            total += tl.load(partials_ptr + split * split_stride + offsets, mask=mask, other=0.0,
                             cache_modifier=".cg")  # fmt: skip
        tl.atomic_xchg(counter_ptr, 0)
    return total, last


@triton.jit
def store_row_split_k(out, partials_ptr, counter_ptr, cols, mask, num_cols, bias_ptr, out_ptr,
                      HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):  # fmt: skip
    """The end of a one-row GEMV program (program_id(0) its column block, program_id(1) its split):
    out [BLOCK_N] float32 at cols (mask), summed over the splits by the last to arrive
    (sum_splits_in_last; partials [SPLIT_K, num_cols]), plus bias, stored in out_ptr's dtype."""
    last = True
    if SPLIT_K > 1:
        out, last = sum_splits_in_last(out, partials_ptr, counter_ptr + tl.program_id(0), cols, mask,
                                       num_cols, SPLIT_K)  # fmt: skip
    if last:
        if HAS_BIAS:
            out += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def partials_buffer(device: torch.device, numel: int) -> torch.Tensor:
    """Split-K partials, float32, at least numel. Every buffer stays allocated for the life of the
    process (CUDA graphs captured with an older, smaller one keep its address). Grown only outside
    a capture: run a split-K shape once before capturing it (model/linear_choice.py times every
    candidate tile at start-up, before any capture)."""
    buffers = _PARTIALS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < numel:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"skinny_linear needs {numel} split-K partials on {device} during a CUDA-graph capture; "
                "run the shape once before capturing"
            )
        buffers.append(torch.empty(numel, dtype=torch.float32, device=device))
    return buffers[-1]


def row_bucket(rows: int) -> int:
    """The padded row count (BLOCK_M) for `rows` rows: 16, 32 or 64 (tl.dot needs at least 16)."""
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"skinny_linear takes 1..{MAX_ROWS} rows; got {rows}: use F.linear for more")
    return max(16, triton.next_power_of_2(rows))


def skinny_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [M, K]; weight: [N, K] (nn.Linear layout); bias: [N] or None; all one dtype. Returns [M, N]
    of x.dtype: x.float() @ weight.float().T (+ bias) rounded once, as gemv_ref computes it for any
    number of rows; written into out when given."""
    return gemv_ref(x, weight, bias, out)


@triton.jit
def _skinny_linear_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    partials_ptr,
    counter_ptr,
    num_rows,
    num_cols,
    stride_xm,
    stride_wn,
    stride_om,
    HIDDEN: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,  # columns of K per split (a multiple of BLOCK_K unless SPLIT_K == 1)
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # BLOCK_N divides num_cols and BLOCK_K divides HIDDEN: weight loads unmasked
    HAS_BIAS: tl.constexpr,
    SWAP: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    col_mask = cols < num_cols
    x_rows = x_ptr + rows[:, None] * stride_xm
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = tl.program_id(1) * K_PER_SPLIT
    for k0 in range(k_start, min(k_start + K_PER_SPLIT, HIDDEN), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN:
            x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None], other=0.0)
            w = tl.load(w_rows + ks[None, :], eviction_policy="evict_first")
        else:
            k_mask = ks < HIDDEN
            x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0,
                        eviction_policy="evict_first")  # fmt: skip
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if SWAP:
        acc = tl.trans(acc)
    out_mask = row_mask[:, None] & col_mask[None, :]
    last = True
    if SPLIT_K > 1:  # the column block's splits summed in split order by the last to arrive
        tile = rows[:, None] * num_cols + cols[None, :]
        acc, last = sum_splits_in_last(acc, partials_ptr, counter_ptr + tl.program_id(0), tile, out_mask,
                                       BLOCK_M * num_cols, SPLIT_K)  # fmt: skip
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def _check(x, weight, bias, out) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"skinny_linear needs x [M, K] and weight [N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    row_bucket(x.shape[0])
    num_rows, num_cols = x.shape[0], weight.shape[0]
    check_dtypes_and_bias("skinny_linear", x, weight, bias)
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("skinny_linear needs x and weight contiguous along K: call .contiguous() first")
    if out is not None and (out.shape != (num_rows, num_cols) or out.dtype != x.dtype or out.stride(1) != 1):
        raise ValueError(f"out must be [{num_rows}, {num_cols}] {x.dtype}, contiguous along N")


def skinny_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    tile: Tile | None = None,
) -> torch.Tensor:
    """Triton skinny_linear_ref: x [M, K] with 1 <= M <= 64, weight [N, K], both contiguous along K,
    bias [N] or None, all bf16 or all fp16; fp32 accumulation, one rounding. Returns out (allocated
    when None) [M, N]. tile: the launch configuration (default: Tile() at M's row bucket).

    Raises ValueError for mismatched shapes or dtypes, more than 64 rows, or a strided K."""
    _check(x, weight, bias, out)
    num_rows = x.shape[0]
    num_cols, hidden = weight.shape
    if out is None:
        out = torch.empty((num_rows, num_cols), dtype=x.dtype, device=x.device)
    if num_cols == 0:
        return out
    if hidden == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand_as(out))
    tile = tile or Tile(block_m=row_bucket(num_rows))
    if tile.block_m < num_rows:
        raise ValueError(f"tile.block_m={tile.block_m} is smaller than the {num_rows} rows of x")
    block_k = max(16, min(tile.block_k, triton.next_power_of_2(hidden)))
    split_k = max(1, min(tile.split_k, triton.cdiv(hidden, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(hidden, split_k), block_k) * block_k
    split_k = triton.cdiv(hidden, k_per_split)  # no empty split
    full_splits = hidden % block_k == 0 and (split_k == 1 or k_per_split * split_k == hidden)
    col_blocks = triton.cdiv(num_cols, tile.block_n)
    partials = counters = out
    if split_k > 1:
        partials = partials_buffer(x.device, split_k * tile.block_m * num_cols)
        counters = arrival_counters(x.device, col_blocks)
    _skinny_linear_kernel[(col_blocks, split_k)](
        x, weight, bias if bias is not None else x, out, partials, counters,
        num_rows, num_cols, x.stride(0), weight.stride(0), out.stride(0),
        HIDDEN=hidden, K_PER_SPLIT=k_per_split if split_k > 1 else hidden, SPLIT_K=split_k,
        BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=block_k,
        EVEN=num_cols % tile.block_n == 0 and full_splits,
        HAS_BIAS=bias is not None, SWAP=tile.swap, num_warps=tile.num_warps, num_stages=tile.num_stages,
    )  # fmt: skip
    return out
