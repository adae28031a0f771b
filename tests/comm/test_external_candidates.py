"""FlashInfer as an optional measured candidate: tpfuse works without it, and when a library with the
unified API is importable it is built, raced and routed to (a stand-in module here; no FlashInfer on CPU)."""

from __future__ import annotations

import sys
import types

import torch

from tpfuse.comm import external
from tpfuse.comm.hybrid import CustomCommunicator
from tpfuse.comm.plan import Bucket, Plan
from tpfuse.comm.tuning import candidates
from tpfuse.comm.workspace import create_virtual_workspaces


def test_without_flashinfer_the_guard_says_why_and_nothing_is_added(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "flashinfer.comm", None)
    fc, why = external.flashinfer_comm()
    assert fc is None and "flashinfer not importable" in why


def test_a_flashinfer_without_the_unified_api_is_refused(monkeypatch):
    package = types.ModuleType("flashinfer")
    package.comm = types.ModuleType("flashinfer.comm")
    monkeypatch.setitem(sys.modules, "flashinfer", package)
    monkeypatch.setitem(sys.modules, "flashinfer.comm", package.comm)
    assert "no allreduce_fusion API" in external.flashinfer_comm()[1]


class FakeComm:
    """The two calls tpfuse makes, computing what one rank of a 2-rank group would get."""

    class AllReduceFusionPattern:
        kAllReduce, kARResidualRMSNorm = 0, 1

    def __init__(self):
        self.calls = []

    def create_allreduce_fusion_workspace(self, **kwargs):
        self.calls.append(("workspace", kwargs))
        return kwargs

    def allreduce_fusion(self, *, input, workspace, pattern, output=None, residual_out=None, norm_out=None,
                         residual_in=None, rms_gamma=None, rms_eps=1e-6):  # fmt: skip
        self.calls.append(("fusion", pattern))
        total = input * workspace["world_size"]
        if pattern == self.AllReduceFusionPattern.kAllReduce:
            output.copy_(total)
            return output
        residual_out.copy_(total + residual_in)
        norm_out.copy_(torch.nn.functional.rms_norm(residual_out, (input.shape[-1],), rms_gamma, rms_eps))
        return norm_out


def test_an_importable_flashinfer_becomes_a_raced_and_routed_candidate():
    fake = FakeComm()
    candidate = external.FlashInferAllReduce(fake, None, 0, 2, 4, 8, torch.float32)
    assert fake.calls[0][1]["backend"] == "trtllm" and fake.calls[0][1]["max_token_num"] == 4
    ws = create_virtual_workspaces(2, "cpu", 4 * 8 * 4, 2)[0]
    name = external.FLASHINFER
    plan = Plan("none", [Bucket("fused", 128, 4, name), Bucket("all_reduce", 128, 4, name)])
    comm = CustomCommunicator(ws, plan, None)
    comm.externals = {external.FLASHINFER: candidate}
    x, residual, weight = torch.randn(3, 8), torch.randn(3, 8), torch.rand(8) + 0.5
    assert external.FLASHINFER in candidates(comm, "fused", x, residual, weight)
    normed, new_residual = comm.fused_add_rmsnorm_all_reduce(x, residual, weight, 1e-6)
    torch.testing.assert_close(new_residual, 2 * x + residual)
    torch.testing.assert_close(comm.all_reduce(x), 2 * x)
    assert [c for c in fake.calls if c[0] == "fusion"] == [("fusion", 1), ("fusion", 0)]
    assert not candidate.fits(torch.randn(5, 8)), "more rows than its workspace holds"
