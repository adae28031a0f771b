"""The start-up choice between the one-launch router + top-k and the router linear + top-k
(model/moe_choice.py): recorded per token bucket, never above MAX_TOKENS, and the same on every rank."""

import torch

from tpfuse.kernels.moe_router import MAX_TOKENS
from tpfuse.model import moe_choice
from tpfuse.model.layers import ParallelContext
from tpfuse.model.moe import SparseMoeBlock


def _block():
    return SparseMoeBlock(16, 6, 2, 8, True, ParallelContext(0, 1, None), torch.float32)


def test_each_token_bucket_takes_the_measured_route(monkeypatch):
    block = _block()
    # one launch faster up to 4 tokens, slower above
    monkeypatch.setattr(
        moe_choice, "_time_route", lambda gate, tokens, k, renorm: (1.0, 2.0 if tokens <= 4 else 0.5)
    )
    tensors: dict = {}
    decisions = moe_choice._route_decisions(block, 16, set(), tensors)
    assert [(k[2], fused) for _, k, fused in decisions] == [
        (1, True),
        (2, True),
        (4, True),
        (8, False),
        (16, False),
    ]
    moe_choice._apply(decisions, tensors, [])
    fused = [
        moe_choice.fuse_route(torch.empty(t, 16), block.gate.weight) for t in (1, 3, 4, 5, 16, MAX_TOKENS + 1)
    ]
    assert fused == [True, True, True, False, False, False]


def test_the_fused_route_gives_the_linear_and_topk_result():
    block = _block()
    torch.nn.init.normal_(block.gate.weight)
    x = torch.randn(5, 16)
    from tpfuse.kernels import moe_route, moe_topk

    got = moe_route(x, block.gate.weight, 2, True)
    want = moe_topk(block.gate(x), 2, True)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0])
