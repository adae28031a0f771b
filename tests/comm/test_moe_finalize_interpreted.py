"""The one-shot MoE finalize (combine + all-reduce + residual + RMSNorm in one kernel) under the
interpreter on virtual ranks: bit-identical to the plain path (combine, then the one-shot fused
all-reduce) and within rounding of float64."""

from __future__ import annotations

import pytest
import torch

from tests.comm.reference import assert_close_to, poisoned, run_ranks_in_phases
from tpfuse.comm import launch
from tpfuse.comm.moe_finalize import moe_finalize_all_reduce
from tpfuse.comm.workspace import create_virtual_workspaces
from tpfuse.kernels.fused_moe import combine_slots_triton

EPS = 1e-6


@pytest.mark.parametrize(
    ("world_size", "rows", "top_k", "hidden", "dtype"),
    [(2, 3, 2, 37, torch.float32), (4, 5, 3, 24, torch.float16), (3, 1, 8, 40, torch.float32)],
)
def test_moe_finalize_all_reduce_equals_plain_path_and_float64(world_size, rows, top_k, hidden, dtype):
    g = torch.Generator().manual_seed(rows * hidden)
    slots = [torch.randn(rows * top_k, hidden, generator=g).to(dtype) for _ in range(world_size)]
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    nbytes = rows * hidden * torch.finfo(dtype).bits // 8
    fused_ws = create_virtual_workspaces(world_size, "cpu", nbytes, 4)
    plain_ws = create_virtual_workspaces(world_size, "cpu", nbytes, 4)
    fused = [(poisoned((rows, hidden), dtype), poisoned((rows, hidden), dtype)) for _ in range(world_size)]
    plain = [(poisoned((rows, hidden), dtype), poisoned((rows, hidden), dtype)) for _ in range(world_size)]
    combined = [combine_slots_triton(s, top_k) for s in slots]
    run_ranks_in_phases(
        lambda r, ph: moe_finalize_all_reduce(
            fused_ws[r], slots[r], top_k, residual, weight, EPS, outputs=fused[r], phases=ph
        ),
        world_size,
    )
    run_ranks_in_phases(
        lambda r, ph: launch.fused_add_rmsnorm(
            plain_ws[r], combined[r], residual, weight, EPS, "one_shot", outputs=plain[r], phases=ph
        ),
        world_size,
    )
    total = sum(s.double().view(rows, top_k, hidden).sum(1) for s in slots) + residual.double()
    normed64 = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
    for (normed, new_residual), (plain_normed, plain_residual) in zip(fused, plain, strict=True):
        assert torch.equal(normed, plain_normed) and torch.equal(new_residual, plain_residual)
        assert_close_to(new_residual, total, ulps=4)
        assert_close_to(normed, normed64, ulps=6)
