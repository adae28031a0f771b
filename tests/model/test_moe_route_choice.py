"""The start-up choice between the one-launch router + top-k and the router linear + top-k
(model/moe_choice.py): recorded per token bucket, never above MAX_TOKENS, and the same on every rank."""

import torch

from tpfuse.kernels.moe_router import MAX_TOKENS, ROUTE_TILES
from tpfuse.model import moe_choice
from tpfuse.model.layers import ParallelContext
from tpfuse.model.moe import SparseMoeBlock


def _block():
    return SparseMoeBlock(16, 6, 2, 8, True, ParallelContext(0, 1, None), torch.float32)


def test_each_token_bucket_takes_the_measured_route(monkeypatch):
    block = _block()

    def times(
        gate, tokens, top_k, renormalize
    ):  # the second tile fastest up to 4 tokens, then linear + top-k
        return {None: 2.0 if tokens <= 4 else 0.5, **{t: 1.0 + (t != ROUTE_TILES[1]) for t in ROUTE_TILES}}

    monkeypatch.setattr(moe_choice, "_time_route", times)
    tensors: dict = {}
    decisions = moe_choice._route_decisions(block, 16, set(), tensors)
    assert [(k[2], tile) for _, k, tile in decisions] == [
        (1, ROUTE_TILES[1]), (2, ROUTE_TILES[1]), (4, ROUTE_TILES[1]), (8, None), (16, None)
    ]  # fmt: skip
    moe_choice._apply(decisions, tensors, [])
    tokens = (1, 3, 4, 5, 16, MAX_TOKENS + 1)
    got = [moe_choice.route_tile(torch.empty(t, 16), block.gate.weight) for t in tokens]
    assert got == [ROUTE_TILES[1]] * 3 + [None] * 3


def test_a_tie_keeps_the_linear_and_topk_route(monkeypatch):
    block = _block()
    monkeypatch.setattr(moe_choice, "_time_route", lambda *a: {None: 1.0, **dict.fromkeys(ROUTE_TILES, 1.0)})
    assert moe_choice._route_decisions(block, 1, set(), {})[0][2] is None


def test_the_fused_route_gives_the_linear_and_topk_result():
    block = _block()
    torch.nn.init.normal_(block.gate.weight)
    x = torch.randn(5, 16)
    from tpfuse.kernels import moe_route, moe_topk

    got = moe_route(x, block.gate.weight, 2, True)
    want = moe_topk(block.gate(x), 2, True)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0])
