"""Small-batch linear layer (GEMV): out[M, N] = x[M, K] @ weight[N, K].T for M = 1..16 decode rows.

A decode projection at batch 1..16 is bound by reading the weight once, so the Triton kernel is
laid out for bandwidth: the grid is (column block, K split); each program streams a
[BLOCK_N, BLOCK_K] tile of weight rows per step (contiguous along K, 16-byte vectors) and keeps
the M rows of x for the same K range beside it. Two inner products, chosen per launch:
- `USE_DOT=False`: broadcast multiply and a sum over K in registers (small M);
- `USE_DOT=True`: tl.dot with the rows padded to 16 (tensor cores; larger M).

When the column blocks alone would not fill the GPU, K is split. Each split program writes its
fp32 partial [M, BLOCK_N] to a scratch buffer and bumps its column block's arrival counter; the
last to arrive sums the partials in split order (deterministic: no atomics on values), writes
the output and resets the counter to 0, so the next launch or CUDA-graph replay finds it ready.
The split count depends only on shapes and the device, so every TP rank launches the same.
The sum order differs between split counts, so results of different split counts agree to fp32
rounding before the cast, not bit for bit; one split count gives bit-identical repeats.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

MAX_ROWS = 16
GEMV_PROGRAMS_PER_SM = 4  # starting guess; benchmarks/gemv.py sweeps it on the H200
GEMV_MAX_SPLITS = 16
# The interpreter's tl.dot mis-multiplies bf16 (numpy has no bf16), so under TRITON_INTERPRET=1 the
# tiles go to fp32 first: the same products (exact in fp32) and fp32 accumulation as tensor cores.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K]; weight: [N, K] (nn.Linear layout), same dtype. Returns [M, N] of x.dtype:
    x.float() @ weight.float().T rounded once. out, when given ([M, N], x.dtype), is written and
    returned."""
    result = (x.float() @ weight.float().T).to(x.dtype)
    if out is None:
        return result
    out.copy_(result)
    return out


def _column_counters(device: torch.device, count: int) -> torch.Tensor:
    """[>= count] int32 zeros kept for the life of the process (captured graphs keep the address);
    the kernel leaves every counter at 0. A larger request allocates a new buffer and keeps the
    old ones alive for graphs captured with them."""
    buffers = _COUNTERS.setdefault(device, [])
    if not buffers or buffers[-1].numel() < count:
        buffers.append(torch.zeros(max(count, 8192), dtype=torch.int32, device=device))
    return buffers[-1]


@triton.jit
def _partial_product(x_ptr, w_ptr, rows, row_mask, cols, col_mask, k_start, k_end, hidden, stride_xm,
                     stride_wn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     USE_DOT: tl.constexpr, DOT_IN_FP32: tl.constexpr):  # fmt: skip
    """[BLOCK_M, BLOCK_N] fp32: x[rows, k_start:k_end] @ weight[cols, k_start:k_end].T."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    for k0 in range(k_start, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        # Tiles never straddle a split (k_per_split is a multiple of BLOCK_K), so only the end of K
        # is masked: with K a multiple of 16 (specialised at launch) the loads stay 16-byte vectors.
        k_mask = ks < hidden
        w = tl.load(w_rows + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_rows + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if USE_DOT:
            if DOT_IN_FP32:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            prod = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            acc += tl.sum(prod, axis=2)
    return acc


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    counter_ptr,
    num_rows,
    num_cols,
    hidden,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
):
    col_block = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    col_mask = cols < num_cols
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, hidden)
    acc = _partial_product(x_ptr, w_ptr, rows, row_mask, cols, col_mask, k_start, k_end, hidden, stride_xm,
                           stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, DOT_IN_FP32)  # fmt: skip
    out_mask = row_mask[:, None] & col_mask[None, :]
    out_offsets = rows[:, None] * stride_om + cols[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials: [SPLIT_K, num_rows, num_cols] fp32, contiguous
        part_offsets = rows[:, None] * num_cols + cols[None, :]
        split_stride = num_rows * num_cols
        tl.store(part_ptr + split * split_stride + part_offsets, acc, mask=out_mask)
        # Hand-off, ordered under the PTX memory model by one chain of base causality order:
        # each thread's partial stores -> bar.sync (synchronises the CTA) -> thread 0's
        # atom.acq_rel.gpu (release: cumulative, so it carries the stores the barrier ordered
        # before it) -> the last arriver's same atomic (acquire; same address and scope, so it
        # synchronises with every earlier release in the counter's RMW chain) -> bar.sync ->
        # each reader thread's loads. Causality order is transitive, so every load sees its
        # split's store (the pattern of CUTLASS's split-K semaphore). The two barriers are written
        # here rather than left to how Triton broadcasts a scalar atomic's result. .cg loads
        # read L2, the point of coherence, never an L1 line.
        tl.debug_barrier()
        arrived = tl.atomic_add(counter_ptr + col_block, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            tl.debug_barrier()
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(part_ptr + s * split_stride + part_offsets, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")  # fmt: skip
            tl.store(out_ptr + out_offsets, total.to(out_ptr.dtype.element_ty), mask=out_mask)
            tl.atomic_xchg(counter_ptr + col_block, 0)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_k_for(num_cols: int, hidden: int, block_n: int, block_k: int, num_sms: int) -> int:
    """K splits from shapes only (CUDA-graph and TP safe): enough programs for about
    GEMV_PROGRAMS_PER_SM per SM, never more splits than K tiles, at most GEMV_MAX_SPLITS."""
    col_blocks = triton.cdiv(num_cols, block_n)
    wanted = GEMV_PROGRAMS_PER_SM * num_sms // col_blocks
    return max(1, min(wanted, triton.cdiv(hidden, block_k), GEMV_MAX_SPLITS))


def gemv_config(num_rows: int) -> dict:
    """Tile and inner product for M rows (starting guesses until benchmarks/gemv.py is run):
    broadcast-sum for M <= 2, tl.dot for more rows."""
    if num_rows <= 2:
        return dict(block_n=16, block_k=512 // triton.next_power_of_2(num_rows), use_dot=False,
                    num_warps=4, num_stages=3)  # fmt: skip
    return dict(block_n=64, block_k=128, use_dot=True, num_warps=4, num_stages=4)


def _check(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"gemv needs x [M, K] and weight [N, K]; got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"gemv handles at most {MAX_ROWS} rows; got {x.shape[0]}: use torch.matmul")
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"gemv needs x and weight both bf16 or both fp16; got {x.dtype} and {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("gemv needs x and weight contiguous along K: call .contiguous() first")
    if out is not None and (
        out.shape != (x.shape[0], weight.shape[0]) or out.dtype != x.dtype or out.stride(1) != 1
    ):
        raise ValueError(f"out must be [{x.shape[0]}, {weight.shape[0]}] {x.dtype}, contiguous along N")


def gemv_launch(x, weight, out=None, *, split_k, block_n, block_k, use_dot, num_warps=4, num_stages=3):
    """gemv_triton with an explicit split count and tile (tests, benchmarks); same shapes and errors."""
    _check(x, weight, out)
    num_rows, hidden = x.shape
    num_cols = weight.shape[0]
    if out is None:
        out = torch.empty((num_rows, num_cols), dtype=x.dtype, device=x.device)
    if num_rows == 0 or num_cols == 0:
        return out
    if hidden == 0:
        return out.zero_()
    k_tiles = triton.cdiv(hidden, block_k)
    split_k = max(1, min(split_k, k_tiles))
    k_per_split = triton.cdiv(k_tiles, split_k) * block_k
    split_k = triton.cdiv(hidden, k_per_split)  # no empty splits
    col_blocks = triton.cdiv(num_cols, block_n)
    if split_k > 1:
        partials = torch.empty((split_k, num_rows, num_cols), dtype=torch.float32, device=x.device)
        counters = _column_counters(x.device, col_blocks)
    else:
        partials = counters = out
    block_m = 16 if use_dot else triton.next_power_of_2(num_rows)
    _gemv_kernel[(col_blocks, split_k)](
        x, weight, out, partials, counters, num_rows, num_cols, hidden, k_per_split,
        x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, USE_DOT=use_dot,
        DOT_IN_FP32=_INTERPRETED,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton gemv_ref: x [M, K] with M <= 16, weight [N, K], both bf16 or both fp16, contiguous
    along K; fp32 accumulation, one rounding to x.dtype. Returns out (allocated when None) [M, N].
    The split count comes from shapes and the SM count (8 stand in on CPU).

    Raises ValueError for mismatched shapes or dtypes, more than 16 rows, or a strided K."""
    config = gemv_config(max(x.shape[0], 1))
    sms = (
        _num_sms(x.device.index if x.device.index is not None else torch.cuda.current_device())
        if x.is_cuda
        else 8
    )
    split_k = split_k_for(weight.shape[0], weight.shape[1], config["block_n"], config["block_k"], sms)
    return gemv_launch(x, weight, out, split_k=split_k, **config)
