"""A decode-sized MoE layer in two launches fewer, under the interpreter: the post-attention add +
RMSNorm inside the router product (kernels/moe_norm_router.py), and the top-k inside the per-slot
gate/up launch (fused_moe.routed_slot_outputs_triton), against float64 and the unfused kernels."""

from __future__ import annotations

import pytest
import torch

from tpfuse.kernels.fused_moe import (
    expert_slot_outputs,
    fused_experts_ref,
    routed_slot_outputs_ref,
    routed_slot_outputs_triton,
)
from tpfuse.kernels.fused_moe_tiles import MoeTile
from tpfuse.kernels.moe_norm_router import (
    MAX_HIDDEN,
    NORM_ROUTER_TILES,
    moe_norm_router_ref,
    moe_norm_router_triton,
)
from tpfuse.kernels.moe_routing import moe_topk_ref, moe_topk_triton
from tpfuse.kernels.rmsnorm import fused_add_rmsnorm_triton

SLOT_TILES = (MoeTile(1, 16, 32, 1, 4), MoeTile(1, 8, 16, 1, 2, down=(32, 16, 2)))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.mark.parametrize(
    "num_tokens,hidden,num_experts", [(1, 24, 5), (3, 33, 60), (2, 64, 128), (1, 100, 7)]
)
def test_norm_router_matches_float64_and_the_fused_add_rmsnorm(num_tokens, hidden, num_experts):
    g = torch.Generator().manual_seed(hidden + num_experts)
    x, residual = torch.randn(num_tokens, hidden, generator=g), torch.randn(num_tokens, hidden, generator=g)
    norm_weight = torch.rand(hidden, generator=g) + 0.5
    gate = torch.randn(num_experts, hidden, generator=g) / hidden**0.5
    before = (x.clone(), residual.clone())
    want = moe_norm_router_ref(*(t.double() for t in (x, residual, norm_weight, gate)), 1e-6)
    plain = fused_add_rmsnorm_triton(x, residual, norm_weight, 1e-6)
    first = None
    for tile in NORM_ROUTER_TILES:
        normed, new_residual, logits = moe_norm_router_triton(x, residual, norm_weight, gate, 1e-6, tile)
        assert logits.shape == (num_tokens, num_experts) and logits.dtype == torch.float32
        assert torch.equal(normed, plain[0]) and torch.equal(new_residual, plain[1]), tile
        assert relative_error(logits, want[2]) <= 1e-5, tile
        first = first if first is not None else logits
        assert torch.equal(logits, first), f"{tile}: the launch shape changed a logit"
    assert torch.equal(x, before[0]) and torch.equal(residual, before[1])  # inputs not written


def test_norm_router_rounds_half_precision_logits_as_the_router_linear_does():
    g = torch.Generator().manual_seed(5)
    x, residual = (torch.randn(2, 48, generator=g).half() for _ in range(2))
    norm_weight, gate = torch.ones(48).half(), (torch.randn(16, 48, generator=g) / 7).half()
    normed, _, logits = moe_norm_router_triton(x, residual, norm_weight, gate, 1e-6)
    assert torch.equal(logits, (normed.double() @ gate.double().T).half().float())


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,renormalize",
    [(1, 5, 2, True), (3, 13, 3, False), (2, 7, 7, True), (4, 64, 8, True), (1, 3, 1, False)],
)
def test_routed_slots_equal_topk_then_slot_products(num_tokens, num_experts, top_k, renormalize):
    hidden, inter = 40, 24  # neither a multiple of the tiles' columns
    g = torch.Generator().manual_seed(num_experts * top_k)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * 0.2
    x = torch.randn(num_tokens, hidden, generator=g)
    logits = torch.randn(num_tokens, num_experts, generator=g)
    want_w, want_ids = moe_topk_triton(logits, top_k, renormalize)
    for tile in SLOT_TILES:
        slot_out, weights, ids = routed_slot_outputs_triton(x, w13, w2, logits, top_k, renormalize, tile)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_w), tile  # the top-k kernel's bits
        assert torch.equal(slot_out, expert_slot_outputs(x, w13, w2, want_w, want_ids, tile)), tile
        ref_w, ref_ids = moe_topk_ref(logits.double(), top_k, renormalize)
        want = fused_experts_ref(x.double(), w13.double(), w2.double(), ref_w, ref_ids, combine=False)
        assert relative_error(slot_out, want.flatten(0, 1)) <= 1e-5


def test_routed_slots_send_tied_scores_to_the_lower_expert_id():
    g = torch.Generator().manual_seed(9)
    w13, w2 = torch.randn(6, 16, 8, generator=g), torch.randn(6, 8, 8, generator=g)
    logits = torch.zeros(5, 6)
    logits[:, [1, 4]] = 3.0  # experts 1 and 4 tie for first, the other four tie behind them
    _, weights, ids = routed_slot_outputs_triton(torch.randn(5, 8, generator=g), w13, w2, logits, 3, True,
                                                 SLOT_TILES[0])  # fmt: skip
    assert (ids == torch.tensor([1, 4, 0], dtype=torch.int32)).all()
    assert torch.allclose(weights.sum(dim=1), torch.ones(5))


def test_the_reference_matches_the_kernel():
    g = torch.Generator().manual_seed(11)
    w13, w2 = torch.randn(5, 16, 12, generator=g) * 0.3, torch.randn(5, 12, 8, generator=g) * 0.3
    x, logits = torch.randn(3, 12, generator=g), torch.randn(3, 5, generator=g)
    got = routed_slot_outputs_triton(x, w13, w2, logits, 2, True, SLOT_TILES[0])
    want = routed_slot_outputs_ref(x.double(), w13.double(), w2.double(), logits.double(), 2, True)
    assert torch.equal(got[2], want[2])
    assert relative_error(got[0], want[0]) <= 1e-5 and relative_error(got[1], want[1]) <= 1e-6


def test_bad_inputs_are_refused_with_what_disagrees():
    w13, w2, x = torch.randn(4, 16, 12), torch.randn(4, 12, 8), torch.randn(2, 12)
    with pytest.raises(ValueError, match="per-slot tile"):
        routed_slot_outputs_triton(x, w13, w2, torch.randn(2, 4), 2, True, MoeTile(16, 32, 32, 1, 4))
    with pytest.raises(ValueError, match=r"float32 logits \[2, 4\]"):
        routed_slot_outputs_triton(x, w13, w2, torch.randn(2, 5), 2, True, SLOT_TILES[0])
    with pytest.raises(ValueError, match="top_k"):
        routed_slot_outputs_triton(x, w13, w2, torch.randn(2, 4), 5, True, SLOT_TILES[0])
    with pytest.raises(ValueError, match="disagree"):
        moe_norm_router_triton(x, torch.randn(2, 12), torch.ones(12), torch.randn(4, 11), 1e-6)
    big = MAX_HIDDEN + 1
    with pytest.raises(ValueError, match="registers"):
        moe_norm_router_triton(
            torch.randn(1, big), torch.randn(1, big), torch.ones(big), torch.randn(2, big), 1e-6
        )


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the NaNs, on purpose
def test_nan_router_logits_still_route_inside_the_expert_stack():
    """A NaN row (a broken activation upstream) must not send a kernel to an expert that does not
    exist: that would read past the weights and take the whole engine down."""
    g = torch.Generator().manual_seed(13)
    w13, w2 = torch.randn(6, 16, 8, generator=g), torch.randn(6, 8, 8, generator=g)
    logits = torch.randn(3, 6, generator=g)
    logits[0] = float("nan")
    logits[1, 2] = float("nan")
    want_w, want_ids = moe_topk_triton(logits, 4, True)
    _, weights, ids = routed_slot_outputs_triton(torch.randn(3, 8, generator=g), w13, w2, logits, 4, True,
                                                 SLOT_TILES[0])  # fmt: skip
    for got in (ids, want_ids):
        assert ((got >= 0) & (got < 6)).all(), got
        assert all(len(set(row.tolist())) == 4 for row in got)  # k distinct experts a token
    assert torch.equal(ids, want_ids)
    assert torch.equal(ids[2], moe_topk_ref(logits[2:].double(), 4, True)[1][0])  # a clean row is unchanged
