"""Host side of the peer-memory kernels: shapes, checks, grid, and the launch.

Every function here is one rank's part of a collective: all ranks of the workspace must call the same
function with the same shapes, in the same order (that is what keeps the device epochs in step).
`phases` exists for the Triton interpreter, which cannot run ranks concurrently: tests call each step
for every rank in turn (bit i of the mask is step i; a schedule has schedules.get(name).steps(world)
steps: push on all ranks, then reduce, then finish, ...). On the GPU leave it at ALL_PHASES.
The schedules themselves (what each algorithm name launches) are in schedules.py.
"""

from __future__ import annotations

import math

import torch
import triton

from tpfuse.comm import allreduce as k
from tpfuse.comm import schedules
from tpfuse.comm.schedules import ALGORITHMS, NO_GATHER  # noqa: F401 - the names callers know
from tpfuse.comm.sync import ALL_PHASES, interpreting
from tpfuse.comm.workspace import RankWorkspace
from tpfuse.kernels.fp8_rows import Fp8Rows
from tpfuse.kernels.quant_int_half2 import check_holds, empty_half2x


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0:
        x = x.reshape(1)
    return x.reshape(-1, x.shape[-1]).contiguous()


def _check_fits(ws: RankWorkspace, rows: torch.Tensor, what: str, algorithm: str = "one_shot") -> None:
    nbytes = schedules.get(algorithm).slot_bytes_needed(rows.numel(), rows.element_size())
    if nbytes > ws.layout.slot_bytes:
        raise ValueError(
            f"{what} of {tuple(rows.shape)} {rows.dtype} ({nbytes} bytes of slot for {algorithm}) exceeds "
            f"the peer workspace slot of {ws.layout.slot_bytes} bytes; build the workspace for more tokens "
            "or use the fallback"
        )
    if rows.device != ws.device:
        raise ValueError(f"{what}: tensor on {rows.device} but the workspace is on {ws.device}")


def _common(ws: RankWorkspace, num_rows: int) -> tuple[tuple[int], dict]:
    interpret = interpreting()
    grid = (min(num_rows, ws.layout.max_programs),)
    meta = dict(WS=ws.world_size, WS_P2=triton.next_power_of_2(ws.world_size), INTERPRET=interpret)
    return grid, meta


def fits(ws: RankWorkspace, x: torch.Tensor, algorithm: str = "one_shot") -> bool:
    """Whether x (any shape) fits one slot of the workspace for `algorithm`."""
    return schedules.fits(ws, x, algorithm)


def _launch(ws, algorithm, rows, residual, weight, out, residual_out, scale, eps, epilogue, phases):
    schedule = schedules.get(algorithm)
    unavailable = schedule.available(ws)
    if unavailable:
        raise ValueError(f"all-reduce algorithm {algorithm!r} cannot run on this workspace: {unavailable}")
    num_rows, hidden = rows.shape
    if num_rows == 0 or hidden == 0:
        return
    grid, meta = _common(ws, num_rows)
    tensors = (rows, residual, weight, out, residual_out, scale, ws.peer_table, ws.words)
    schedule.launch(ws, grid, meta, tensors, num_rows, hidden, eps, epilogue, phases)


def all_reduce(
    ws: RankWorkspace,
    x: torch.Tensor,
    algorithm: str = "one_shot",
    out: torch.Tensor | None = None,
    phases: int = ALL_PHASES,
) -> torch.Tensor:
    """Sum of x over the workspace's ranks. x: any shape, bf16/fp16/fp32, on the workspace's device,
    unchanged. Returns `out` (new unless given), same shape and dtype. Raises ValueError if x does not
    fit a slot."""
    rows = _as_rows(x)
    _check_fits(ws, rows, "all_reduce input", algorithm)
    out = torch.empty_like(rows) if out is None else out
    _launch(ws, algorithm, rows, rows, rows, out, out, rows, 0.0, k.EPILOGUE_SUM.value, phases)
    return out.view(x.shape)


def fused_add_rmsnorm(
    ws: RankWorkspace,
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    algorithm: str = "one_shot",
    fp8_scale: torch.Tensor | None = None,
    outputs: tuple | None = None,
    phases: int = ALL_PHASES,
    fp8_group: int | None = None,
    half2x: bool = False,
) -> tuple:
    """s = round(all_reduce(x) + residual); returns (normed, s), both new [T, H] tensors unless
    `outputs` gives them. x, residual: [T, H] of one dtype, residual identical on every rank (as in
    tensor parallelism; two-shot adds the owner's copy); weight: [H]. normed has x's dtype, or
    float8_e4m3fn when fp8_scale (a float32 tensor of one element: normed / scale is stored) is given,
    or kernels/fp8_rows.py's Fp8Rows of fp8_group columns a scale (the whole row, or
    allreduce.FP8_GROUP; outputs then (Fp8Rows, s)), or with half2x the one normed row as
    kernels/quant_int_half2.py's Half2X (H a multiple of 32, bf16 / fp16; outputs then (Half2X, s)).
    Bit-identical on every rank. Raises ValueError on shape or size problems."""
    rows = _as_rows(x)
    _check_fits(ws, rows, "fused all-reduce input", algorithm)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} must match x {tuple(x.shape)} {x.dtype}"
        )
    if weight.shape != (rows.shape[1],):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({rows.shape[1]},)")
    if (fp8_group is not None) + (fp8_scale is not None) + half2x > 1:
        raise ValueError("give one output form: fp8_group, fp8_scale or half2x")
    if half2x:
        check_holds(*rows.shape, rows.dtype)
    if fp8_group is not None and fp8_group < rows.shape[1] and fp8_group != k.FP8_GROUP.value:
        groups = f"one scale a row or a {k.FP8_GROUP.value}-column group"
        raise ValueError(f"FP8 rows take {groups}; got {fp8_group}")
    res_rows = _as_rows(residual)
    if outputs is None and half2x:
        outputs = (empty_half2x(rows.shape[1], rows.dtype, rows.device), torch.empty_like(rows))
    if outputs is None:
        fp8 = fp8_scale is not None or fp8_group is not None
        out_dtype = torch.float8_e4m3fn if fp8 else rows.dtype
        normed = torch.empty(rows.shape, dtype=out_dtype, device=rows.device)
        if fp8_group is not None:
            num_scales = -(-rows.shape[1] // fp8_group)
            scales = torch.empty((rows.shape[0], num_scales), dtype=torch.float32, device=rows.device)
            normed = Fp8Rows(normed, scales, rows.dtype, fp8_group)
        outputs = (normed, torch.empty_like(rows))
    normed, res_out = outputs
    if half2x:
        out, scale, epilogue = normed.pairs, normed.stats, k.EPILOGUE_NORM_HALF2X.value
    elif fp8_group is not None:
        by_row = normed.group >= rows.shape[1]
        epilogue = (k.EPILOGUE_NORM_FP8_ROWS if by_row else k.EPILOGUE_NORM_FP8_GROUPS).value
        out, scale = normed.data, normed.scales
    elif fp8_scale is None:
        out, scale, epilogue = normed, weight, k.EPILOGUE_NORM.value
    else:
        out, scale, epilogue = normed, fp8_scale.to(torch.float32).reshape(1), k.EPILOGUE_NORM_FP8.value
    _launch(ws, algorithm, rows, res_rows, weight, out, res_out, scale, eps, epilogue, phases)
    if fp8_group is not None or half2x:
        return normed, res_out.view(x.shape)
    return normed.view(x.shape), res_out.view(x.shape)


def gathered_shape(shape: torch.Size | tuple[int, ...], world_size: int, dim: int) -> tuple[int, ...]:
    """Shape of torch.cat of world_size tensors of `shape` along dim. Raises ValueError for a 0-d shape
    or a dim out of range."""
    if len(shape) == 0:
        raise ValueError("all_gather needs a tensor of at least one dimension; reshape a scalar to (1,)")
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"all_gather dim {dim} is out of range for a tensor of shape {tuple(shape)}")
    dim %= len(shape)
    return tuple(n * world_size if d == dim else n for d, n in enumerate(shape))


def _gather_layout(shape: tuple[int, ...], world_size: int, dim: int) -> tuple[int, int, int]:
    """(gather_rows, gather_source_stride, gather_row_stride) of one_shot_kernel for a contiguous output
    concatenated along dim (already in range). Rows are x flattened to [-1, shape[-1]]."""
    hidden = shape[-1]
    num_rows = math.prod(shape[:-1])
    if dim == len(shape) - 1:  # rank s owns columns [s * hidden, (s + 1) * hidden) of each output row
        return num_rows, hidden, world_size * hidden
    block_rows = math.prod(shape[dim:-1])  # the rows of x under one index of the dims before dim
    return block_rows, block_rows * hidden, hidden


def all_gather(
    ws: RankWorkspace,
    x: torch.Tensor,
    out: torch.Tensor | None = None,
    dim: int = -1,
    phases: int = ALL_PHASES,
) -> torch.Tensor:
    """Every rank's x concatenated along dim in rank order, as torch.cat would give, written by the
    kernel straight into `out`: no torch op runs after the kernel.

    x: at least 1-D, any dtype the kernels take, on the workspace's device, unchanged; every rank passes
    the same shape. out: new unless given; if given it must be contiguous, of gathered_shape(x.shape,
    world_size, dim) and of x's dtype and device. Returns out; all_gather(ws, x.unsqueeze(0), dim=0)
    gives the stacked form [world_size, *x.shape]. Raises ValueError if x does not fit a slot,
    dim is out of range, or out does not match.
    """
    shape = gathered_shape(x.shape, ws.world_size, dim)
    dim %= x.dim()
    rows = _as_rows(x)
    _check_fits(ws, rows, "all_gather input")
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif (tuple(out.shape), out.dtype, out.device, out.is_contiguous()) != (shape, x.dtype, x.device, True):
        raise ValueError(
            f"all_gather out is {tuple(out.shape)} {out.dtype} on {out.device} (contiguous: "
            f"{out.is_contiguous()}); it must be a contiguous {shape} {x.dtype} on {x.device}"
        )
    num_rows, hidden = rows.shape
    if rows.numel():
        grid, meta = _common(ws, num_rows)
        lay = ws.layout
        block = triton.next_power_of_2(hidden)
        k.one_shot_kernel[grid](
            rows, rows, rows, out, out, rows, ws.peer_table, ws.words, ws.rank, num_rows, hidden, 0.0,
            ws.timeout_for_kernel(meta["INTERPRET"]), lay.flag_off, lay.data_off, lay.slot_bytes,
            lay.max_programs, *_gather_layout(tuple(x.shape), ws.world_size, dim), BLOCK=block,
            EPILOGUE=k.EPILOGUE_GATHER.value, PHASES=phases, num_warps=k.num_warps_for(block), **meta,
        )  # fmt: skip
    return out
