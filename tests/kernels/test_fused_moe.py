"""Fused MoE under the interpreter against float64: routing (softmax, top-k, ties to the lower id,
renormalisation), grouping by expert, the grouped GEMMs at odd token and expert counts, and the
TP = 1 finalize (combine + residual + RMSNorm)."""

from __future__ import annotations

import pytest
import torch

from tpfuse.kernels.fused_moe import fused_experts_ref, fused_experts_triton
from tpfuse.kernels.fused_moe_tiles import MoeTile
from tpfuse.kernels.moe_align import max_blocks, moe_align_triton
from tpfuse.kernels.moe_finalize import moe_finalize_ref, moe_finalize_triton
from tpfuse.kernels.moe_routing import moe_topk_ref, moe_topk_triton

DECODE_TILE = MoeTile(16, 32, 32, 1, 4)
SLOT_GEMV_TILE = MoeTile(1, 16, 32, 1, 4)
PREFILL_TILE = MoeTile(32, 32, 16, 1, 4)


def experts(num_experts: int, hidden: int, inter: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * 0.2
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * 0.2
    return w13, w2


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("num_experts,top_k,renormalize", [(5, 1, False), (13, 3, True), (67, 8, False)])
def test_topk_matches_float64_softmax_and_sort(num_experts, top_k, renormalize):
    logits = torch.randn(9, num_experts, generator=torch.Generator().manual_seed(num_experts))
    weights, ids = moe_topk_triton(logits, top_k, renormalize)
    want_w, want_ids = moe_topk_ref(logits.double(), top_k, renormalize)
    assert torch.equal(ids, want_ids)
    assert (weights.double() - want_w).abs().max() <= 1e-6


def test_tied_router_scores_go_to_the_lower_expert_id():
    logits = torch.tensor([[0.5, 2.0, 2.0, 1.0, 2.0], [0.0] * 5, [3.0, -1.0, 3.0, 3.0, 0.0]])
    _, ids = moe_topk_triton(logits, 2, renormalize=True)
    assert ids.tolist() == [[1, 2], [0, 1], [0, 2]]
    assert torch.equal(ids, moe_topk_ref(logits, 2, renormalize=True)[1])


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,block_m", [(1, 5, 2, 16), (37, 13, 3, 16), (50, 3, 2, 32)]
)
def test_align_groups_every_slot_once_in_single_expert_blocks(num_tokens, num_experts, top_k, block_m):
    g = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(num_tokens)]).int()
    sorted_slots, block_expert, num_padded = moe_align_triton(ids, num_experts, block_m)
    num_slots = ids.numel()
    assert sorted_slots.numel() == max_blocks(num_slots, num_experts, block_m) * block_m
    used = int(num_padded)
    assert used % block_m == 0
    real = sorted_slots[:used][sorted_slots[:used] < num_slots]
    assert sorted(real.tolist()) == list(range(num_slots))
    assert (sorted_slots[used:] == num_slots).all()
    flat = ids.reshape(-1)
    for b in range(used // block_m):
        rows = sorted_slots[b * block_m : (b + 1) * block_m]
        rows = rows[rows < num_slots].long()
        assert rows.numel() > 0 and (flat[rows] == block_expert[b]).all()


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,tile",
    [
        (1, 5, 2, DECODE_TILE),
        (7, 13, 3, DECODE_TILE),
        (33, 3, 2, PREFILL_TILE),
        (45, 7, 1, PREFILL_TILE),
        (1, 5, 2, SLOT_GEMV_TILE),
        (9, 7, 3, SLOT_GEMV_TILE),
        (9, 7, 3, MoeTile(1, 16, 32, 1, 4, down=(32, 16, 2))),  # the down product at its own shape
    ],
)
def test_fused_experts_match_float64_at_odd_sizes(num_tokens, num_experts, top_k, tile):
    hidden, inter = 40, 24  # neither a multiple of the 32-column tiles
    w13, w2 = experts(num_experts, hidden, inter, seed=num_tokens)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(num_tokens, hidden, generator=g)
    weights, ids = moe_topk_triton(torch.randn(num_tokens, num_experts, generator=g), top_k, True)
    got = fused_experts_triton(x, w13, w2, weights, ids, tile=tile)
    want = fused_experts_ref(x.double(), w13.double(), w2.double(), weights.double(), ids)
    assert got.shape == (num_tokens, hidden) and got.dtype == x.dtype
    assert relative_error(got, want) <= 1e-5


def test_every_token_picking_the_same_experts_fills_many_blocks_of_them():
    num_tokens, num_experts, hidden, inter = 41, 6, 32, 16
    w13, w2 = experts(num_experts, hidden, inter, seed=3)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(4))
    logits = torch.zeros(num_tokens, num_experts)
    logits[:, 4], logits[:, 1] = 9.0, 8.0
    weights, ids = moe_topk_triton(logits, 2, renormalize=False)
    assert (ids == torch.tensor([4, 1], dtype=torch.int32)).all()
    for tile in (DECODE_TILE, SLOT_GEMV_TILE):
        got = fused_experts_triton(x, w13, w2, weights, ids, tile=tile)
        want = fused_experts_ref(x.double(), w13.double(), w2.double(), weights.double(), ids)
        assert relative_error(got, want) <= 1e-5


def test_half_precision_matches_float64_within_rounding():  # float16: the interpreter mis-handles bf16 dots
    w13, w2 = experts(5, 64, 32, seed=5)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(6))
    weights, ids = moe_topk_ref(torch.randn(9, 5, generator=torch.Generator().manual_seed(8)), 2, True)
    half = [t.to(torch.float16) for t in (x, w13, w2)]
    got = fused_experts_triton(*half, weights, ids, tile=DECODE_TILE)
    want = fused_experts_ref(*(t.double() for t in half), weights.double(), ids)
    assert got.dtype == torch.float16
    assert relative_error(got, want) <= 2e-3


@pytest.mark.parametrize("num_tokens,top_k,hidden", [(1, 2, 40), (13, 3, 72), (6, 8, 33)])
def test_moe_finalize_combines_adds_residual_and_norms_like_float64(num_tokens, top_k, hidden):
    g = torch.Generator().manual_seed(num_tokens * top_k)
    slots = torch.randn(num_tokens * top_k, hidden, generator=g)
    residual = torch.randn(num_tokens, hidden, generator=g)
    weight = torch.rand(hidden, generator=g) + 0.5
    before = (slots.clone(), residual.clone())
    normed, new_residual = moe_finalize_triton(slots, top_k, residual, weight, 1e-6)
    want = moe_finalize_ref(slots.double(), top_k, residual.double(), weight.double(), 1e-6)
    assert relative_error(new_residual, want[1]) <= 1e-6
    assert relative_error(normed, want[0]) <= 1e-5
    assert torch.equal(slots, before[0]) and torch.equal(residual, before[1])  # not written in place


@pytest.mark.parametrize("num_tokens,top_k,hidden", [(1, 8, 40), (7, 3, 72)])
def test_moe_finalize_with_a_shared_row_equals_the_shared_row_as_one_more_slot(num_tokens, top_k, hidden):
    """DeepSeek-V3's shared experts: read where they lie, summed after the k slots, the same bits as
    concatenated as slot k + 1; and float64 of the sum."""
    g = torch.Generator().manual_seed(num_tokens + hidden)
    slots = torch.randn(num_tokens * top_k, hidden, generator=g).bfloat16()
    shared = torch.randn(num_tokens, hidden, generator=g).bfloat16()
    residual = torch.randn(num_tokens, hidden, generator=g).bfloat16()
    weight = (torch.rand(hidden, generator=g) + 0.5).bfloat16()
    joined = torch.cat([slots.view(num_tokens, top_k, hidden), shared.view(num_tokens, 1, hidden)], 1)
    got = moe_finalize_triton(slots, top_k, residual, weight, 1e-6, shared)
    as_slot = moe_finalize_triton(joined.view(-1, hidden), top_k + 1, residual, weight, 1e-6)
    assert torch.equal(got[0], as_slot[0]) and torch.equal(got[1], as_slot[1])
    want = moe_finalize_ref(slots.double(), top_k, residual.double(), weight.double(), 1e-6, shared.double())
    assert relative_error(got[1], want[1]) <= 1e-2 and relative_error(got[0], want[0]) <= 2e-2
    with pytest.raises(ValueError, match=rf"and shared \[{num_tokens}, {hidden - 1}\] disagree"):
        moe_finalize_triton(slots, top_k, residual, weight, 1e-6, shared[:, 1:])
