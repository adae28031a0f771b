"""Triton all-reduce over peer memory: one-shot, two-shot, and the fused residual add + RMSNorm (+FP8).

Rows are split over a persistent grid (program p handles rows p, p + G, ...); program p of every rank
handles the same rows and synchronises only with program p of the other ranks (sync.py has the flag
protocol). Sums run in rank order in float32, so every rank computes bit-identical results.

- one-shot: every rank pushes its rows into slot [rank] of every rank's data region, waits for all
  flags, and reduces the world_size slots of its own buffer, then runs the epilogue.
- two-shot: the hidden dimension is cut into world_size chunks; rank j owns chunk j. Every rank pushes
  chunk j of its rows to rank j (scatter); the owner reduces it (+ residual for the fused op), rounds it
  to the activation dtype, pushes it into every rank's gather region; every rank then runs the epilogue
  on whole rows. Each rank moves 2 (world-1)/world rows per row instead of world - 1.

The row pieces below the constants (slot offsets, the push of a row to every rank, the rank-order sum
of the slots, the epilogue) are shared with allreduce_pcie.py and moe_finalize.py, so each schedule's
kernel holds only its own order of pushes, waits and sums.

Epilogue numerics (as tpfuse.kernels.rmsnorm): s = round(sum_fp32 + residual) is the new residual;
normed = round(s * rsqrt(mean(s^2) + eps) * weight) in float32; FP8: normed_fp32 / scale rounded to the
nearest-even float8_e4m3fn value and clamped to +-448 (saturating); FP8 rows: normed, as rounded
above, quantized one scale a row or a FP8_GROUP columns (kernels/fp8_rows.py), the scales stored
beside it; Half2X: one normed row, as rounded above, as the f16x2 INT4 GEMV's operands
(kernels/quant_int_half2.py; out_ptr its pairs, scale_ptr its stats).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpfuse.comm.sync import (
    FLAG_GATHER,
    FLAG_PUSH,
    PHASE_FINISH,
    PHASE_PUSH,
    PHASE_REDUCE,
    finish_launch,
    load_epoch,
    signal_peers,
    wait_for_peers,
)
from tpfuse.kernels.fp8_rows import BLOCK_GROUP, E4M3_MAX, round_to_e4m3, store_scales_of_row
from tpfuse.kernels.quant_int_half2 import store_half2x
from tpfuse.kernels.rmsnorm import rmsnorm_row

EPILOGUE_SUM = tl.constexpr(0)  # plain all-reduce
EPILOGUE_NORM = tl.constexpr(1)  # + residual, RMSNorm
EPILOGUE_NORM_FP8 = tl.constexpr(2)  # + residual, RMSNorm, FP8 e4m3 with a per-tensor scale
EPILOGUE_GATHER = tl.constexpr(3)  # all-gather: every rank's rows into the concatenated output (one-shot)
EPILOGUE_NORM_FP8_ROWS = tl.constexpr(4)  # + residual, RMSNorm, FP8 rows, one scale a row (fp8_rows.py)
EPILOGUE_NORM_FP8_GROUPS = tl.constexpr(5)  # ... one scale a FP8_GROUP columns (block FP8 weights' K block)
EPILOGUE_NORM_HALF2X = tl.constexpr(6)  # + residual, RMSNorm, one row as Half2X (quant_int_half2.py)
FP8_GROUP = tl.constexpr(BLOCK_GROUP)


@triton.jit
def _region(peer_table, peer, byte_offset, DTYPE: tl.constexpr):
    """Typed pointer to byte_offset inside rank `peer`'s buffer (regions are 256-byte aligned)."""
    return tl.multiple_of((tl.load(peer_table + peer) + byte_offset).to(tl.pointer_type(DTYPE)), 16)


@triton.jit
def _launch_slots(buffer_ptr):
    """(epoch, parity): this launch's epoch (sync.load_epoch) and which of the two data slot sets
    (int64 0 or 1, alternating per launch) it uses."""
    epoch = load_epoch(buffer_ptr)
    return epoch, (epoch & 1).to(tl.int64)


@triton.jit
def _slot(data_off, parity, source, slot_bytes, WS: tl.constexpr):
    """Byte offset of source rank's data slot in the slot set `parity`, in any rank's buffer."""
    return data_off + (parity * WS + source) * slot_bytes


@triton.jit
def _push_row(peer_table, slot, row, hidden, cols, v, mask, WS: tl.constexpr, DT: tl.constexpr):
    """Store v as row `row` of `slot` in every rank's buffer (plain stores; a flag release publishes them)."""
    for j in tl.static_range(WS):
        tl.store(_region(peer_table, j, slot, DT) + row * hidden + cols, v, mask=mask)


@triton.jit
def _store_normed(s_row, row, cols, in_row, hidden, weight_ptr, out_ptr, residual_out_ptr, scale_ptr, eps,
                  EPILOGUE: tl.constexpr):  # fmt: skip
    """s_row: the new residual row (activation dtype; 0 past hidden); stores it, and its RMSNorm (+FP8)
    to out_ptr (FP8 rows: the row's scale to scale_ptr + row; Half2X, row 0 only: out_ptr its pairs,
    scale_ptr its stats [2, hidden / 32])."""
    tl.store(residual_out_ptr + row * hidden + cols, s_row, mask=in_row)
    y = rmsnorm_row(s_row.to(tl.float32), weight_ptr, cols, in_row, hidden, eps)
    if EPILOGUE == EPILOGUE_NORM_HALF2X:  # the row as the plain epilogue rounds it
        store_half2x(y.to(s_row.dtype).to(tl.float32), out_ptr, scale_ptr, 0, hidden // 32, cols.shape[0])
    else:
        if EPILOGUE == EPILOGUE_NORM_FP8:
            y = tl.clamp(round_to_e4m3(y / tl.load(scale_ptr)), -E4M3_MAX, E4M3_MAX)
        if EPILOGUE == EPILOGUE_NORM_FP8_ROWS:  # the row as the plain epilogue rounds it, then quantized
            y = store_scales_of_row(y.to(s_row.dtype).to(tl.float32), scale_ptr, row, hidden, cols.shape[0])
        if EPILOGUE == EPILOGUE_NORM_FP8_GROUPS:
            y = store_scales_of_row(y.to(s_row.dtype).to(tl.float32), scale_ptr, row, hidden, FP8_GROUP)
        tl.store(out_ptr + row * hidden + cols, y.to(out_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _finish_row(acc, row, cols, in_row, hidden, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                scale_ptr, eps, DT: tl.constexpr, EPILOGUE: tl.constexpr):  # fmt: skip
    """acc: the float32 sum of one row; stores the plain sum, or the residual and the normed row."""
    if EPILOGUE == EPILOGUE_SUM:
        tl.store(out_ptr + row * hidden + cols, acc.to(DT), mask=in_row)
    else:
        acc += tl.load(residual_ptr + row * hidden + cols, mask=in_row, other=0.0).to(tl.float32)
        _store_normed(acc.to(DT), row, cols, in_row, hidden, weight_ptr, out_ptr, residual_out_ptr, scale_ptr,
                      eps, EPILOGUE)  # fmt: skip


@triton.jit
def _sum_slots(peer_table, rank, data_off, parity, slot_bytes, row, hidden, cols, mask, WS: tl.constexpr,
               BLOCK: tl.constexpr, DT: tl.constexpr):  # fmt: skip
    """Row `row` (columns `cols`) of the WS data slots in this rank's own buffer, summed in float32 in
    rank order (volatile loads: peers wrote them; the flag wait before made them visible)."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(WS):
        src = _region(peer_table, rank, _slot(data_off, parity, s, slot_bytes, WS), DT)
        acc += tl.load(src + row * hidden + cols, mask=mask, other=0.0, volatile=True).to(tl.float32)
    return acc


# Every rank must run the same compiled binary: an integer argument equal to 1 or divisible by 16 is
# specialised by Triton, so without this rank 0, rank 1 and rank 2 would each compile (and load) their own
# variant, and loading a module while a peer's kernel spins on this GPU waits for that kernel to end.
# Row counts vary with the batch, so they are not specialised either (one binary for every batch size).
NO_RANK_SPECIALIZATION = ("rank", "num_rows", "timeout")


@triton.jit(do_not_specialize=(*NO_RANK_SPECIALIZATION, "gather_rows"))
def one_shot_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr,
                    peer_table, buffer_ptr, rank, num_rows, hidden, eps, timeout,
                    flag_off, data_off, slot_bytes, max_programs,
                    gather_rows, gather_source_stride, gather_row_stride,
                    WS: tl.constexpr, WS_P2: tl.constexpr, BLOCK: tl.constexpr, EPILOGUE: tl.constexpr,
                    PHASES: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """x: [num_rows, hidden] contiguous; out_ptr as the epilogue says (launch.py).

    EPILOGUE_GATHER writes row `row` of source rank s to element offset
    (row // gather_rows) * WS * gather_source_stride + s * gather_source_stride
    + (row % gather_rows) * gather_row_stride of out_ptr: the rows form blocks of gather_rows, and each
    block holds every rank's block in rank order, which is torch.cat along any dim. The gather_* strides
    are ignored by the other epilogues."""
    DT: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch, parity = _launch_slots(buffer_ptr)
    cols = tl.arange(0, BLOCK)
    in_row = cols < hidden
    if PHASE_PUSH & PHASES:
        own_slot = _slot(data_off, parity, rank, slot_bytes, WS)
        for row in range(pid, num_rows, nprog):
            v = tl.load(x_ptr + row * hidden + cols, mask=in_row)
            _push_row(peer_table, own_slot, row, hidden, cols, v, in_row, WS, DT)
        signal_peers(peer_table, rank, epoch, FLAG_PUSH, flag_off, max_programs, WS, WS_P2, INTERPRET)
    if PHASE_FINISH & PHASES:
        wait_for_peers(peer_table, buffer_ptr, rank, epoch, FLAG_PUSH, flag_off, max_programs, timeout,
                       WS, WS_P2, INTERPRET)  # fmt: skip
        for row in range(pid, num_rows, nprog):
            if EPILOGUE == EPILOGUE_GATHER:
                block_start = (row // gather_rows) * WS * gather_source_stride
                out_row = out_ptr + block_start + (row % gather_rows) * gather_row_stride
                for s in tl.static_range(WS):
                    src = _region(peer_table, rank, _slot(data_off, parity, s, slot_bytes, WS), DT)
                    v = tl.load(src + row * hidden + cols, mask=in_row, volatile=True)
                    tl.store(out_row + s * gather_source_stride + cols, v, mask=in_row)
            else:
                acc = _sum_slots(peer_table, rank, data_off, parity, slot_bytes, row, hidden, cols, in_row,
                                 WS, BLOCK, DT)  # fmt: skip
                _finish_row(acc, row, cols, in_row, hidden, residual_ptr, weight_ptr, out_ptr,
                            residual_out_ptr, scale_ptr, eps, DT, EPILOGUE)  # fmt: skip
        finish_launch(buffer_ptr, epoch)


@triton.jit(do_not_specialize=NO_RANK_SPECIALIZATION)
def two_shot_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, scale_ptr,
                    peer_table, buffer_ptr, rank, num_rows, hidden, chunk, eps, timeout,
                    flag_off, data_off, gather_off, slot_bytes, max_programs,
                    WS: tl.constexpr, WS_P2: tl.constexpr, BLOCK: tl.constexpr, CHUNK_BLOCK: tl.constexpr,
                    EPILOGUE: tl.constexpr, PHASES: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """x: [num_rows, hidden] contiguous; rank j owns columns [j * chunk, (j + 1) * chunk)."""
    DT: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch, parity = _launch_slots(buffer_ptr)
    chunk_cols = tl.arange(0, CHUNK_BLOCK)
    if PHASE_PUSH & PHASES:
        own_slot = _slot(data_off, parity, rank, slot_bytes, WS)
        for row in range(pid, num_rows, nprog):
            for j in tl.static_range(WS):
                cols = j * chunk + chunk_cols
                m = (chunk_cols < chunk) & (cols < hidden)
                v = tl.load(x_ptr + row * hidden + cols, mask=m)
                tl.store(_region(peer_table, j, own_slot, DT) + row * hidden + cols, v, mask=m)
        signal_peers(peer_table, rank, epoch, FLAG_PUSH, flag_off, max_programs, WS, WS_P2, INTERPRET)
    if PHASE_REDUCE & PHASES:
        wait_for_peers(peer_table, buffer_ptr, rank, epoch, FLAG_PUSH, flag_off, max_programs, timeout,
                       WS, WS_P2, INTERPRET)  # fmt: skip
        cols = rank * chunk + chunk_cols
        m = (chunk_cols < chunk) & (cols < hidden)
        gather = gather_off + parity * slot_bytes
        for row in range(pid, num_rows, nprog):
            acc = _sum_slots(peer_table, rank, data_off, parity, slot_bytes, row, hidden, cols, m, WS,
                             CHUNK_BLOCK, DT)  # fmt: skip
            if EPILOGUE != EPILOGUE_SUM:
                acc += tl.load(residual_ptr + row * hidden + cols, mask=m, other=0.0).to(tl.float32)
            _push_row(peer_table, gather, row, hidden, cols, acc.to(DT), m, WS, DT)
        signal_peers(peer_table, rank, epoch, FLAG_GATHER, flag_off, max_programs, WS, WS_P2, INTERPRET)
    if PHASE_FINISH & PHASES:
        wait_for_peers(peer_table, buffer_ptr, rank, epoch, FLAG_GATHER, flag_off, max_programs, timeout,
                       WS, WS_P2, INTERPRET)  # fmt: skip
        cols = tl.arange(0, BLOCK)
        in_row = cols < hidden
        src = _region(peer_table, rank, gather_off + parity * slot_bytes, DT)
        for row in range(pid, num_rows, nprog):
            s_row = tl.load(src + row * hidden + cols, mask=in_row, other=0.0, volatile=True)
            if EPILOGUE == EPILOGUE_SUM:
                tl.store(out_ptr + row * hidden + cols, s_row, mask=in_row)
            else:
                _store_normed(s_row, row, cols, in_row, hidden, weight_ptr, out_ptr, residual_out_ptr,
                              scale_ptr, eps, EPILOGUE)  # fmt: skip
        finish_launch(buffer_ptr, epoch)


def num_warps_for(block: int) -> int:
    """Warps per program for a row of `block` elements: about 8 elements per thread, 1..16 warps."""
    return max(1, min(16, triton.next_power_of_2(block) // 256))
