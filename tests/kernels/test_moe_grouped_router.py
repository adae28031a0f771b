"""DeepSeek-V3's router + grouped top-k in one launch (kernels/moe_grouped_router.py) against float64
and the unfused grouped top-k kernel."""

import pytest
import torch

from tpfuse.kernels.decode_merge import arrival_counters
from tpfuse.kernels.grouped_topk import grouped_topk_triton
from tpfuse.kernels.moe_grouped_router import grouped_route_ref, grouped_route_triton
from tpfuse.kernels.moe_router import ROUTE_TILES


def _by_id(weights, ids):
    order = ids.long().argsort(-1)
    return weights.gather(1, order), ids.long().gather(1, order)


@pytest.mark.parametrize(
    "tokens,experts,hidden,top_k,groups,topk_groups,norm,bias,dtype",
    [
        (1, 256, 96, 8, 8, 4, True, True, torch.bfloat16),  # DeepSeek-V3's routing, narrow hidden
        (3, 24, 1100, 5, 6, 3, True, True, torch.float32),  # hidden past one 1024-column step
        (2, 12, 33, 4, 4, 2, False, False, torch.float16),
        (5, 16, 40, 3, 1, 1, True, True, torch.float32),  # one group: no group limit
    ],
    ids=["deepseek-v3", "two-steps", "no-bias", "one-group"],
)
def test_route_matches_float64(tokens, experts, hidden, top_k, groups, topk_groups, norm, bias, dtype):
    g = torch.Generator().manual_seed(experts + hidden)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    gate = torch.randn(experts, hidden, generator=g) / hidden**0.5
    correction = torch.randn(experts, generator=g) * 0.1 if bias else None
    routing = (correction, top_k, groups, topk_groups, norm, 2.5)
    want = _by_id(*grouped_route_ref(x.double(), gate.double(), *routing))
    for tile in ROUTE_TILES:
        weights, ids = grouped_route_triton(x, gate, *routing, tile)
        got = _by_id(weights, ids)
        assert torch.equal(got[1], want[1]), tile
        torch.testing.assert_close(got[0].double(), want[0], rtol=1e-5, atol=1e-6)
    assert not arrival_counters(x.device, tokens)[:tokens].any(), "counters left non-zero"


def test_exact_logits_route_as_the_grouped_topk_kernel_bit_for_bit():
    """Small-integer x and gate make every float32 sum exact in any order, so the fused route must give
    the unfused kernel's ids and weights exactly, ties included (groups 0-1 copy each other)."""
    g = torch.Generator().manual_seed(7)
    gate = torch.randint(-3, 4, (32, 64), generator=g).float() / 8
    gate[4:8] = gate[0:4]
    x = torch.randint(-4, 5, (6, 64), generator=g).bfloat16()
    bias = torch.randint(-2, 3, (32,), generator=g).float() / 16
    for tile in ROUTE_TILES:
        got = grouped_route_triton(x, gate, bias, 6, 8, 3, True, 1.5, tile)
        want = grouped_topk_triton(x.float() @ gate.T, bias, 6, 8, 3, True, 1.5)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), tile


def test_a_nan_row_still_routes_inside_the_expert_stack():
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(4))
    x[0, 3] = float("nan")
    gate = torch.randn(24, 32, generator=torch.Generator().manual_seed(5))
    weights, ids = grouped_route_triton(x, gate, None, 4, 6, 2, True, 1.0)
    assert ((ids >= 0) & (ids < 24)).all(), ids
    assert all(len(set(row.tolist())) == 4 for row in ids)
    assert torch.equal(ids[1], grouped_route_triton(x[1:], gate, None, 4, 6, 2, True, 1.0)[1][0])


def test_bad_inputs_are_refused_by_name():
    x, gate = torch.randn(1, 8), torch.randn(16, 8)
    with pytest.raises(ValueError, match="float32"):
        grouped_route_triton(x, gate.bfloat16(), None, 2, 4, 2, True, 1.0)
    with pytest.raises(ValueError, match="disagree"):
        grouped_route_triton(x, torch.randn(16, 9), None, 2, 4, 2, True, 1.0)
    with pytest.raises(ValueError, match="bias"):
        grouped_route_triton(x, gate, torch.zeros(15), 2, 4, 2, True, 1.0)
    with pytest.raises(ValueError, match="n_group"):
        grouped_route_triton(x, gate, None, 2, 5, 2, True, 1.0)
