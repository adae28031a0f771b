"""MoE finalize across ranks: the weighted top-k combine, the all-reduce, the residual add and RMSNorm
in one one-shot kernel (what FlashInfer calls MoE-finalize fusion).

Each rank holds its experts' partial outputs per (token, slot), slot_out [T * k, H] (already weighted:
kernels/fused_moe.py). The push phase sums a token's k rows in float32, in slot order, rounds to the
activation dtype and pushes that row to every rank, where one_shot_kernel would push x's row; the
finish phase is one_shot_kernel's norm epilogue. So the result is bit-identical to the plain path
(kernels' combine, then the one-shot fused all-reduce + residual + RMSNorm), without the [T, H]
combine output and its launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.comm import launch
from tpfuse.comm.allreduce import (
    EPILOGUE_NORM,
    NO_RANK_SPECIALIZATION,
    _finish_row,
    _launch_slots,
    _push_row,
    _slot,
    _sum_slots,
    num_warps_for,
)
from tpfuse.comm.sync import (
    ALL_PHASES,
    FLAG_PUSH,
    PHASE_FINISH,
    PHASE_PUSH,
    finish_launch,
    interpreting,
    signal_peers,
    wait_for_peers,
)
from tpfuse.comm.workspace import RankWorkspace

ALGORITHM = "one_shot"  # the plan's choice under which the fused finalize runs
# Workspaces whose peers never share this GPU from another process: loading this kernel's module at
# its first launch cannot wait on a peer's spinning kernel (CUDA IPC may be ranks sharing one GPU).
SAFE_BACKENDS = ("symm_mem", "virtual")


def usable(ws: RankWorkspace) -> bool:
    return ws.backend in SAFE_BACKENDS


@triton.jit(do_not_specialize=NO_RANK_SPECIALIZATION)
def one_shot_moe_finalize_kernel(slot_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                                 peer_table, buffer_ptr, rank, num_rows, hidden, eps, timeout,
                                 flag_off, data_off, slot_bytes, max_programs,
                                 TOP_K: tl.constexpr, WS: tl.constexpr, WS_P2: tl.constexpr,
                                 BLOCK: tl.constexpr, PHASES: tl.constexpr,
                                 INTERPRET: tl.constexpr):  # fmt: skip
    """slot_out [num_rows * TOP_K, hidden], residual / outputs [num_rows, hidden], all contiguous."""
    DT: tl.constexpr = residual_ptr.dtype.element_ty
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    epoch, parity = _launch_slots(buffer_ptr)
    cols = tl.arange(0, BLOCK)
    in_row = cols < hidden
    if PHASE_PUSH & PHASES:
        own_slot = _slot(data_off, parity, rank, slot_bytes, WS)
        for row in range(pid, num_rows, nprog):
            combined = tl.zeros([BLOCK], dtype=tl.float32)
            for j in tl.static_range(TOP_K):
                src = slot_ptr + (row * TOP_K + j) * hidden + cols
                combined += tl.load(src, mask=in_row, other=0.0).to(tl.float32)
            _push_row(peer_table, own_slot, row, hidden, cols, combined.to(DT), in_row, WS, DT)
        signal_peers(peer_table, rank, epoch, FLAG_PUSH, flag_off, max_programs, WS, WS_P2, INTERPRET)
    if PHASE_FINISH & PHASES:
        wait_for_peers(peer_table, buffer_ptr, rank, epoch, FLAG_PUSH, flag_off, max_programs, timeout,
                       WS, WS_P2, INTERPRET)  # fmt: skip
        for row in range(pid, num_rows, nprog):
            acc = _sum_slots(peer_table, rank, data_off, parity, slot_bytes, row, hidden, cols, in_row, WS,
                             BLOCK, DT)  # fmt: skip
            # EPILOGUE_NORM never reads the FP8 scale pointer: weight_ptr stands in for it
            _finish_row(acc, row, cols, in_row, hidden, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
                        weight_ptr, eps, DT, EPILOGUE_NORM)  # fmt: skip
        finish_launch(buffer_ptr, epoch)


def moe_finalize_all_reduce(
    ws: RankWorkspace,
    slot_out: torch.Tensor,
    top_k: int,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    outputs: tuple[torch.Tensor, torch.Tensor] | None = None,
    phases: int = ALL_PHASES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """s = round(all_reduce(round(sum_j slot_out[t * k + j])) + residual); returns (normed, s), new
    [T, H] tensors unless `outputs` gives them. Every rank calls it with the same shapes (one rank's
    part of a collective). Raises ValueError on shapes, or when [T, H] does not fit one slot."""
    num_rows, hidden = residual.shape
    if slot_out.shape != (num_rows * top_k, hidden) or slot_out.dtype != residual.dtype:
        raise ValueError(
            f"moe_finalize_all_reduce: slot_out {tuple(slot_out.shape)} {slot_out.dtype} must be "
            f"[T * {top_k}, H] of residual's dtype; residual {tuple(residual.shape)} {residual.dtype}"
        )
    if weight.shape != (hidden,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({hidden},)")
    residual = residual.contiguous()
    if not launch.fits(ws, residual, ALGORITHM) or residual.device != ws.device:
        raise ValueError(
            f"moe_finalize_all_reduce of {tuple(residual.shape)} {residual.dtype} does not fit the peer "
            f"workspace on {ws.device} ({ws.layout.slot_bytes} bytes per slot); use the plain path"
        )
    normed, res_out = outputs or (torch.empty_like(residual), torch.empty_like(residual))
    if num_rows == 0 or hidden == 0:
        return normed, res_out
    interpret = interpreting()
    lay, block = ws.layout, triton.next_power_of_2(hidden)
    one_shot_moe_finalize_kernel[(min(num_rows, lay.max_programs),)](
        slot_out.contiguous(), residual, weight, normed, res_out, ws.peer_table, ws.words,
        ws.rank, num_rows, hidden, eps, ws.timeout_for_kernel(interpret), lay.flag_off, lay.data_off,
        lay.slot_bytes, lay.max_programs, TOP_K=top_k, WS=ws.world_size,
        WS_P2=triton.next_power_of_2(ws.world_size), BLOCK=block, PHASES=phases, INTERPRET=interpret,
        num_warps=num_warps_for(block),
    )  # fmt: skip
    return normed, res_out
