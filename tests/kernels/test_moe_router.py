"""The one-launch MoE router + top-k (kernels/moe_router.py) against float64 and the unfused path."""

import pytest
import torch

from tpfuse.kernels.decode_merge import arrival_counters
from tpfuse.kernels.moe_router import ROUTE_TILES, moe_route_ref, moe_route_triton
from tpfuse.kernels.moe_routing import moe_topk_triton


@pytest.mark.parametrize(
    "num_tokens,num_experts,hidden,top_k,renormalize",
    [(1, 5, 24, 2, True), (3, 60, 1100, 4, False), (2, 128, 64, 8, True), (1, 7, 33, 7, True)],
)
def test_route_matches_float64_router_and_topk(num_tokens, num_experts, hidden, top_k, renormalize):
    g = torch.Generator().manual_seed(num_experts + hidden)
    x = torch.randn(num_tokens, hidden, generator=g)
    gate = torch.randn(num_experts, hidden, generator=g) / hidden**0.5
    want_w, want_ids = moe_route_ref(x.double(), gate.double(), top_k, renormalize)
    for tile in ROUTE_TILES:
        weights, ids = moe_route_triton(x, gate, top_k, renormalize, tile)
        assert torch.equal(ids, want_ids), tile
        torch.testing.assert_close(weights.double(), want_w, rtol=1e-5, atol=1e-6)
    assert not arrival_counters(x.device, num_tokens)[:num_tokens].any(), "counters left non-zero"
    again = moe_route_triton(x, gate, top_k, renormalize)  # the counters were reset: same answer
    assert torch.equal(again[1], ids) and torch.equal(again[0], weights)


def test_half_precision_logits_are_rounded_as_the_router_linear_rounds_them():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 48, generator=g).half()
    gate = (torch.randn(16, 48, generator=g) / 7).half()
    weights, ids = moe_route_triton(x, gate, 3, True)
    logits = (x.double() @ gate.double().T).half()  # the router linear's output dtype
    want_w, want_ids = moe_topk_triton(logits.float(), 3, True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=1e-7)


def test_tied_experts_go_to_the_lower_id():
    gate = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    gate = torch.cat([gate, gate])  # experts 4..7 repeat 0..3: every logit tied with a lower id
    _, ids = moe_route_triton(torch.randn(3, 16), gate, 4, True)
    assert (ids[:, 0::2] < 4).all() and torch.equal(ids[:, 1::2], ids[:, 0::2] + 4)  # each pair low id first


def test_bad_shapes_are_refused_with_the_shapes():
    with pytest.raises(ValueError, match="disagree"):
        moe_route_triton(torch.randn(1, 8), torch.randn(4, 9), 2, True)
    with pytest.raises(ValueError, match="top_k"):
        moe_route_triton(torch.randn(1, 8), torch.randn(4, 8), 5, True)
