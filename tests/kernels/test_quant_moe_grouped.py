"""The grouped quantized expert GEMMs (kernels/quant_moe_grouped.py) under the interpreter against
float64 products of the dequantized experts: FP8 per-channel and 128-column blocks, INT4 groups of 32
and 128 and a group that no K step lies in, odd token, expert, hidden and intermediate counts, experts
that no token routes to and one that every token routes to."""

import pytest
import torch

from tpfuse.kernels import quant_int
from tpfuse.kernels.fused_moe_tiles import MoeTile
from tpfuse.kernels.quant_fp8 import FP8_DTYPE
from tpfuse.kernels.quant_moe import QuantExperts, slots_ref
from tpfuse.kernels.quant_moe_grouped import grouped_slots_triton


def _stack(experts, n, k, bits, group, gen):
    group = group or k
    if bits:
        values = torch.randint(0, 2**bits, (experts, n, k), generator=gen)
        codes = torch.stack([quant_int.pack_int(v, bits) for v in values])
    else:
        codes = (torch.randn(experts, n, k, generator=gen) * 2).to(FP8_DTYPE)
    scales = torch.rand(experts, n, -(-k // group), generator=gen) * 0.05 + 1e-3
    return QuantExperts(codes, scales, bits, group, k)


@pytest.mark.parametrize(
    "bits,group,experts,hidden,inter,tokens,top_k,tile",
    [
        (0, 128, 5, 160, 48, 9, 2, MoeTile(16, 32, 64)),  # block scales, K steps inside the blocks
        (0, None, 3, 96, 40, 7, 3, MoeTile(16, 16, 128)),  # per-channel: scaled after the K loop
        (4, 32, 4, 128, 64, 6, 2, MoeTile(16, 32, 64)),  # INT4 group 32: steps of 32
        (4, 128, 6, 256, 96, 5, 2, MoeTile(32, 32, 128)),
        (4, 24, 3, 96, 48, 4, 2, MoeTile(16, 16, 64)),  # no power-of-two step >= 16: each weight scaled
        (8, 64, 3, 128, 32, 5, 1, MoeTile(16, 32, 64)),  # 8-bit codes
    ],
)
def test_grouped_route_matches_float64(bits, group, experts, hidden, inter, tokens, top_k, tile):
    gen = torch.Generator().manual_seed(bits * 100 + hidden + tokens)
    w13 = _stack(experts, 2 * inter, hidden, bits, group, gen)
    w2 = _stack(experts, hidden, inter, bits, group, gen)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).int()
    ids[:, 0] = 1  # every token routes to expert 1 (and some experts to none)
    weights = torch.rand(tokens, top_k, generator=gen)
    expected = slots_ref(
        x.double(), w13.dequantize().double(), w2.dequantize().double(), weights.double(), ids
    )
    out = grouped_slots_triton(x, w13, w2, weights, ids, tile)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    err = (out.double() - expected.double()).abs().max().item()
    assert err <= 1e-4 * expected.abs().max().item()


def test_refuses_a_tile_below_the_mma_rows():
    gen = torch.Generator().manual_seed(0)
    w13, w2 = _stack(2, 32, 64, 0, None, gen), _stack(2, 64, 16, 0, None, gen)
    with pytest.raises(ValueError, match="block_m >= 16"):
        grouped_slots_triton(torch.randn(1, 64), w13, w2, torch.ones(1, 1), torch.zeros(1, 1).int(),
                             MoeTile(1, 32, 256))  # fmt: skip


@pytest.mark.parametrize("group", [128, 64, None])
def test_w8a8_tiles_compute_what_the_w8a8_slot_route_does(group):
    """W8A8 grouped tiles quantize the activations as the per-slot W8A8 route does (per row and
    activation step), so the two agree; that route is checked against float64 in
    tests/kernels/test_quant_moe_w8a8.py."""
    from tpfuse.kernels.quant_moe_grouped import W8A8_GROUPED_TILES, GroupedTile
    from tpfuse.kernels.quant_moe_w8a8 import SLOT_TILES, w8a8_slots_triton

    gen = torch.Generator().manual_seed(group or 1)
    w13, w2 = _stack(5, 96, 256, 0, group, gen), _stack(5, 256, 48, 0, group, gen)
    x = torch.randn(7, 256, generator=gen)
    ids = torch.stack([torch.randperm(5, generator=gen)[:2] for _ in range(7)]).int()
    weights = torch.rand(7, 2, generator=gen)
    expected = w8a8_slots_triton(x, w13, w2, weights, ids, SLOT_TILES[0]).double()
    for tile in (GroupedTile(16, 32, 128, 1, 4, True), W8A8_GROUPED_TILES[0]):
        out = grouped_slots_triton(x, w13, w2, weights, ids, tile)
        assert (out.double() - expected).abs().max() <= 1e-3 * expected.abs().max()


def test_w8a8_tiles_refuse_integer_experts():
    from tpfuse.kernels.quant_moe_grouped import W8A8_GROUPED_TILES

    gen = torch.Generator().manual_seed(2)
    w13, w2 = _stack(2, 32, 64, 4, 32, gen), _stack(2, 64, 16, 4, 16, gen)
    with pytest.raises(ValueError, match="take FP8 experts"):
        grouped_slots_triton(torch.randn(1, 64), w13, w2, torch.ones(1, 1), torch.zeros(1, 1).int(),
                             W8A8_GROUPED_TILES[0])  # fmt: skip
