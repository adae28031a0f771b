"""Float64 references, the sequential phase runner for interpreted (CPU) kernel tests, and the fused /
all-reduce calls over virtual ranks it drives."""

from __future__ import annotations

import torch

from tpfuse.comm import launch
from tpfuse.comm.sync import PHASE_FINISH, PHASE_PUSH, PHASE_REDUCE

PHASES_IN_ORDER = (PHASE_PUSH.value, PHASE_REDUCE.value, PHASE_FINISH.value)
FP8_MAX = 448.0
EPS = 1e-5


def sum64(inputs: list[torch.Tensor]) -> torch.Tensor:
    return sum(x.double() for x in inputs)


def fused64(inputs, residual, weight, eps):
    """(normed, new_residual) in float64, no rounding anywhere."""
    s = sum64(inputs) + residual.double()
    normed = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    return normed, s


def assert_close_to(actual: torch.Tensor, expected64: torch.Tensor, ulps: float = 2.0):
    """|actual - expected| within `ulps` units of actual's dtype precision, relative to each value plus a
    floor of a quarter of the largest value (float32 sums lose digits to cancellation)."""
    eps = torch.finfo(actual.dtype).eps
    err = (actual.double() - expected64).abs()
    bound = ulps * eps * (expected64.abs() + 0.25 * expected64.abs().max())
    worst = (err - bound).max().item()
    assert worst <= 0, f"max error {err.max().item():.3g} exceeds {ulps} ulp of {actual.dtype}"
    assert torch.isfinite(actual.float()).all(), "non-finite values (poisoned output not overwritten?)"


def poisoned(shape, dtype):
    if dtype.is_floating_point and dtype.itemsize == 1:
        return torch.full(shape, float("nan")).to(dtype)
    return torch.full(shape, float("nan"), dtype=dtype)


def run_ranks_in_phases(call, world_size: int, phases=PHASES_IN_ORDER, ranks=None):
    """Interpreter stand-in for concurrent ranks: each phase runs on every rank before the next phase.
    call(rank, phases) launches one rank's kernel restricted to `phases`."""
    ranks = range(world_size) if ranks is None else ranks
    for phase in phases:
        for rank in ranks:
            call(rank, phase)


def fused_in_phases(
    wss, xs, residual, weight, algorithm, fp8_scale=None, phases=PHASES_IN_ORDER, fp8_group=None, half2x=False
):
    """launch.fused_add_rmsnorm (eps EPS) of every virtual rank, run phase by phase, into poisoned
    (normed, new_residual) outputs (normed e4m3 when fp8_scale is given, Fp8Rows of fp8_group columns
    a scale with NaN scales where fp8_group is, a Half2X of -1 pairs and NaN stats with half2x);
    returns them in rank order."""
    from tpfuse.kernels.fp8_rows import Fp8Rows
    from tpfuse.kernels.quant_int_half2 import empty_half2x

    rows, hidden = xs[0].shape
    dtype = torch.float8_e4m3fn if fp8_scale is not None or fp8_group else xs[0].dtype

    def normed():
        if half2x:
            out = empty_half2x(hidden, xs[0].dtype, xs[0].device)
            out.pairs.fill_(-1)
            out.stats.fill_(float("nan"))
            return out
        out = poisoned(xs[0].shape, dtype)
        if fp8_group is None:
            return out
        return Fp8Rows(out, torch.full((rows, -(-hidden // fp8_group)), float("nan")), xs[0].dtype, fp8_group)

    outs = [(normed(), poisoned(xs[0].shape, xs[0].dtype)) for _ in wss]
    run_ranks_in_phases(
        lambda r, ph: launch.fused_add_rmsnorm(
            wss[r], xs[r], residual, weight, EPS, algorithm, fp8_scale=fp8_scale, outputs=outs[r], phases=ph,
            fp8_group=fp8_group, half2x=half2x,
        ),
        len(wss),
        phases=phases,
    )
    return outs


def all_reduce_in_phases(wss, xs, algorithm, phases=PHASES_IN_ORDER):
    """launch.all_reduce of every virtual rank, run phase by phase, into poisoned outputs (rank order)."""
    outs = [poisoned(xs[0].shape, xs[0].dtype) for _ in wss]
    run_ranks_in_phases(
        lambda r, ph: launch.all_reduce(wss[r], xs[r], algorithm, out=outs[r], phases=ph),
        len(wss),
        phases=phases,
    )
    return outs


def repeat_and_replay_mismatches(comm, x, residual, weight, eps, calls=10_000, replays=1000):
    """(elements differing from the first call over `calls` back-to-back calls, the same over `replays`
    replays of the call captured in a CUDA graph): both 0 when the protocol is exact under repetition."""
    import torch

    first = comm.fused_add_rmsnorm_all_reduce(x, residual, weight, eps)
    mismatches = torch.zeros((), dtype=torch.int64, device=x.device)
    for _ in range(calls):
        normed, new_residual = comm.fused_add_rmsnorm_all_reduce(x, residual, weight, eps)
        mismatches += (normed != first[0]).sum() + (new_residual != first[1]).sum()
    torch.cuda.synchronize()
    back_to_back = int(mismatches)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = comm.fused_add_rmsnorm_all_reduce(x, residual, weight, eps)
    mismatches.zero_()
    for _ in range(replays):
        graph.replay()
        mismatches += (graph_out[0] != first[0]).sum() + (graph_out[1] != first[1]).sum()
    torch.cuda.synchronize()
    return back_to_back, int(mismatches)
