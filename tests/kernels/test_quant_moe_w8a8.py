"""The FP8 W8A8 expert slot kernels (kernels/quant_moe_w8a8.py) under the interpreter against float64:
activations chosen so that their per-step e4m3 quantization is exact, odd expert, hidden and
intermediate sizes, per-channel and 128-column block scales. The composed route against
w8a8_slots_ref runs on the GPU (tests/kernels/test_gpu_quant_kernels.py): its SiLU-and-mul rows need
rounding to e4m3, which the interpreter's cast does not always round to nearest."""

import pytest
import torch

from tests.kernels.float64_linear import e4m3_exact_activations
from tpfuse.kernels import quant_moe_w8a8 as w8a8
from tpfuse.kernels.quant_fp8 import FP8_DTYPE
from tpfuse.kernels.quant_moe import QuantExperts


def _stack(experts, n, k, group, gen):
    codes = (torch.randn(experts, n, k, generator=gen) * 2).to(FP8_DTYPE)
    scales = torch.rand(experts, n, -(-k // group), generator=gen) * 0.05 + 1e-3
    return QuantExperts(codes, scales, 0, group, k)


def _close(out, expected):
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    scale = expected.abs().max().item() + 1e-9
    assert (out.double() - expected).abs().max().item() <= 1e-4 * scale


def _routing(tokens, top_k, experts, gen):
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).int()
    return torch.rand(tokens, top_k, generator=gen), ids


CASES = [  # experts, hidden, inter, tokens, top_k, group (None: per-channel), tile
    (4, 160, 40, 3, 2, 128, w8a8.W8A8SlotTile(64, 1, 4)),  # K steps of 128 + 32, rows past N masked
    (3, 96, 48, 2, 3, None, w8a8.W8A8SlotTile(64, 2, 4)),  # per-channel: one scale a row after the loop
    (5, 256, 96, 1, 2, 64, w8a8.W8A8SlotTile(128, 1, 8)),  # 64-column groups: steps of 64
]


@pytest.mark.parametrize("experts,hidden,inter,tokens,top_k,group,tile", CASES)
def test_gate_up_matches_float64_of_quantized_tokens(experts, hidden, inter, tokens, top_k, group, tile):
    gen = torch.Generator().manual_seed(hidden + inter)
    w13 = _stack(experts, 2 * inter, hidden, group or hidden, gen)
    step = w8a8.activation_step(w13)
    x = e4m3_exact_activations(tokens, hidden, step, gen)
    _, ids = _routing(tokens, top_k, experts, gen)
    rows = w13.dequantize().double()[ids.view(-1).long()]
    expected = torch.einsum("sk,snk->sn", x.double().repeat_interleave(top_k, 0), rows)
    _close(w8a8.w8a8_gate_up_triton(x, w13, ids, tile), expected)


@pytest.mark.parametrize("experts,hidden,inter,tokens,top_k,group,tile", CASES)
def test_down_matches_float64_of_quantized_slots(experts, hidden, inter, tokens, top_k, group, tile):
    """The SiLU-and-mul row is exact here: gates of 32 (silu(32) = 32 in float32) times up rows whose
    steps quantize exactly."""
    gen = torch.Generator().manual_seed(hidden * inter)
    w2 = _stack(experts, hidden, inter, group or inter, gen)
    up = e4m3_exact_activations(tokens * top_k, inter, w8a8.activation_step(w2), gen) / 32
    h = torch.cat([torch.full_like(up, 32.0), up], dim=1)
    weights, ids = _routing(tokens, top_k, experts, gen)
    rows = w2.dequantize().double()[ids.view(-1).long()]
    act = torch.nn.functional.silu(h[:, :inter].double()) * up.double()
    expected = torch.einsum("sk,snk->sn", act, rows) * weights.view(-1, 1).double()
    _close(w8a8.w8a8_down_triton(h, w2, weights, ids, tile, torch.float32), expected)


def test_refuses_what_it_cannot_run():
    gen = torch.Generator().manual_seed(6)
    x, ids = torch.randn(1, 96), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="power-of-two part >= 16"):
        w8a8.w8a8_gate_up_triton(x, _stack(1, 32, 96, 24, gen), ids, w8a8.SLOT_TILES[0])
    codes = QuantExperts(torch.zeros(1, 32, 12, dtype=torch.int32), torch.ones(1, 32, 1), 4, 96, 96)
    with pytest.raises(ValueError, match="takes FP8 experts"):
        w8a8.w8a8_gate_up_triton(x, codes, ids, w8a8.SLOT_TILES[0])
