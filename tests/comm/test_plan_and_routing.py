"""The per-bucket plan (the 'never slower than the fallback' rule) and the CustomCommunicator's routing."""

from __future__ import annotations

import pytest
import torch

from tpfuse.comm.communicator import SingleRankCommunicator
from tpfuse.comm.hybrid import CustomCommunicator
from tpfuse.comm.plan import FALLBACK, Bucket, Plan, bucket_tokens, decide, unmeasured_plan
from tpfuse.comm.workspace import create_virtual_workspaces


def test_a_bucket_where_the_custom_kernel_is_not_faster_uses_the_fallback():
    assert decide({"one_shot": 9.0, "two_shot": 12.0, FALLBACK: 9.0})[0] == FALLBACK
    assert decide({"one_shot": 9.0, "two_shot": 12.0, FALLBACK: 8.0})[0] == FALLBACK


def test_the_fastest_custom_algorithm_wins_when_faster_than_the_fallback():
    algorithm, reason = decide({"one_shot": 14.0, "two_shot": 6.0, FALLBACK: 12.0})
    assert algorithm == "two_shot" and "2.00x faster" in reason


def test_plan_picks_the_smallest_bucket_that_holds_the_message_and_falls_back_past_the_last():
    plan = Plan("nccl", [Bucket("fused", 100, 1, "one_shot"), Bucket("fused", 400, 4, "two_shot")])
    assert plan.choose("fused", 1) == "one_shot"
    assert plan.choose("fused", 100) == "one_shot"
    assert plan.choose("fused", 101) == "two_shot"
    assert plan.choose("fused", 401) == FALLBACK
    assert plan.choose("all_reduce", 1) == FALLBACK


def test_bucket_tokens_are_powers_of_two_up_to_and_including_the_maximum():
    assert bucket_tokens(1) == [1]
    assert bucket_tokens(12) == [1, 2, 4, 8, 12]


def test_unmeasured_plan_switches_to_two_shot_for_large_messages():
    plan = unmeasured_plan("none", 8, row_bytes=16384, max_tokens=512, reason="default")
    assert plan.choose("fused", 16384) == "one_shot"
    assert plan.choose("fused", 512 * 16384) == "two_shot"


def test_describe_lists_each_bucket_with_its_algorithm_and_reason():
    plan = Plan(
        "nccl", [Bucket("fused", 8192, 1, "one_shot", {"one_shot": 5.0, FALLBACK: 20.0}, "4.00x faster")]
    )
    text = plan.describe()
    assert "fallback: nccl" in text and "one_shot" in text and "4.00x faster" in text and "8 KiB" in text


class RecordingFallback(SingleRankCommunicator):
    def __init__(self):
        self.calls = []

    def all_reduce(self, x):
        self.calls.append("all_reduce")
        return x

    def fused_add_rmsnorm_all_reduce(self, x, residual, weight, eps):
        self.calls.append("fused")
        return super().fused_add_rmsnorm_all_reduce(x, residual, weight, eps)

    def all_gather(self, x, dim=-1):
        self.calls.append("all_gather")
        return x


def _comm(plan, fallback, slot_bytes=256, checked=False, world_size=2):
    ws = create_virtual_workspaces(world_size, "cpu", slot_bytes, max_programs=2, timeout_s=0.1)
    return CustomCommunicator(ws[0], plan, fallback, checked=checked)


def test_messages_the_plan_sends_to_the_fallback_go_there():
    fallback = RecordingFallback()
    comm = _comm(Plan("nccl"), fallback)
    comm.all_reduce(torch.randn(2, 8))
    comm.fused_add_rmsnorm_all_reduce(torch.randn(2, 8), torch.randn(2, 8), torch.ones(8), 1e-6)
    assert fallback.calls == ["all_reduce", "fused"]


def test_messages_larger_than_the_workspace_go_to_the_fallback_even_if_the_plan_says_custom():
    fallback = RecordingFallback()
    comm = _comm(unmeasured_plan("nccl", 2, 4096, 64, "test"), fallback)
    comm.all_reduce(torch.randn(64, 1024))
    comm.all_gather(torch.randn(64, 1024))
    assert fallback.calls == ["all_reduce", "all_gather"]


def test_without_a_fallback_a_message_that_does_not_fit_raises_with_the_fix():
    comm = _comm(unmeasured_plan("none", 2, 32, 8, "test"), None)
    with pytest.raises(ValueError, match="create it for more tokens"):
        comm.all_reduce(torch.randn(64, 1024))


def test_checked_mode_raises_naming_the_peer_that_never_arrived():
    # rank 0 runs alone (the interpreter cannot run rank 1 concurrently): rank 1 looks crashed
    comm = _comm(unmeasured_plan("none", 2, 32, 2, "test"), None, checked=True)
    with pytest.raises(RuntimeError, match="rank 1 never arrived"):
        comm.all_reduce(torch.randn(2, 8))
