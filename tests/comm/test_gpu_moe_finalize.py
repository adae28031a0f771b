"""The one-shot MoE finalize on virtual ranks of one GPU (real spins): bit-identical to the plain path
(combine, then the one-shot fused all-reduce + residual + RMSNorm) and equal on every rank, eagerly and
replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from tests.comm.reference import assert_close_to, poisoned
from tests.comm.test_gpu_virtual_ranks import _workspaces
from tests.comm.virtual_ranks import on_streams
from tpfuse.comm import launch
from tpfuse.comm.moe_finalize import moe_finalize_all_reduce
from tpfuse.kernels.fused_moe import combine_slots_triton

pytestmark = pytest.mark.gpu
EPS = 1e-6


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("num_tokens", [1, 64, 257])
def test_moe_finalize_equals_plain_path_on_virtual_ranks(world_size, num_tokens):
    top_k, hidden, dtype = 8, 2048, torch.bfloat16
    slots = [torch.randn(num_tokens * top_k, hidden, device="cuda").to(dtype) for _ in range(world_size)]
    residual = torch.randn(num_tokens, hidden, device="cuda").to(dtype)
    weight = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    combined = [combine_slots_triton(s, top_k) for s in slots]
    fused_ws = _workspaces(world_size, num_tokens, hidden)
    plain_ws = _workspaces(world_size, num_tokens, hidden)

    def outputs():
        return [(poisoned((num_tokens, hidden), dtype).cuda(), poisoned((num_tokens, hidden), dtype).cuda())
                for _ in range(world_size)]  # fmt: skip

    fused_out, plain_out = outputs(), outputs()
    on_streams(world_size, lambda r: moe_finalize_all_reduce(
        fused_ws[r], slots[r], top_k, residual, weight, EPS, outputs=fused_out[r]))  # fmt: skip
    on_streams(world_size, lambda r: launch.fused_add_rmsnorm(
        plain_ws[r], combined[r], residual, weight, EPS, "one_shot", outputs=plain_out[r]))  # fmt: skip
    total = sum(s.double().view(num_tokens, top_k, hidden).sum(1) for s in slots) + residual.double()
    for (normed, new_residual), (plain_normed, plain_residual) in zip(fused_out, plain_out, strict=True):
        assert torch.equal(normed, plain_normed) and torch.equal(new_residual, plain_residual)
        assert torch.equal(normed, fused_out[0][0])
        assert_close_to(new_residual, total, ulps=8)
