"""Quantized linear kernels (kernels/quant_int.py, quant_fp8.py, quant_fp8_w8a8.py) under the interpreter
against float64 products of the dequantized weights, at odd shapes and group sizes."""

import pytest
import torch

from tests.kernels.float64_linear import e4m3_exact_activations
from tpfuse.kernels import quant_fp8, quant_fp8_w8a8, quant_int
from tpfuse.kernels.quant_int import IntTile


def _float64_product(x, weight, bias):
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def _close(out, expected, dtype):
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    scale = expected.abs().max().item() + 1e-6
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    assert (out.double() - expected).abs().max().item() <= tol * scale


def _int_weights(n, k, bits, group, asymmetric, gen):
    values = torch.randint(0, 2**bits, (n, k), generator=gen)
    groups = -(-k // group)
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
    offsets = (torch.randn(n, groups, generator=gen) * 0.05) if asymmetric else None
    return quant_int.pack_int(values, bits), values, scales, offsets


def test_pack_int_matches_the_compressed_tensors_order():
    values = torch.arange(16).view(1, 16) % 16
    packed = quant_int.pack_int(values, 4)
    # word j holds k = 8j..8j+7, value i in bits [4i, 4i+4): word 0 = 0x76543210
    assert packed.tolist() == [[0x76543210, 0xFEDCBA98 - 2**32]]
    assert torch.equal(quant_int.unpack_int(packed, 4, 16), values.to(torch.int32))


@pytest.mark.parametrize(
    "rows,n,k,bits,group,asymmetric,dtype",
    [
        (1, 37, 200, 4, 32, False, torch.float32),
        (1, 19, 256, 4, 128, True, torch.bfloat16),
        (5, 37, 200, 4, 32, False, torch.float16),  # bf16 tl.dot is wrong under the interpreter
        (33, 70, 136, 8, 32, False, torch.float32),
        (70, 45, 256, 4, 128, True, torch.float32),
    ],
)
def test_int_linear_matches_float64_reference(rows, n, k, bits, group, asymmetric, dtype):
    gen = torch.Generator().manual_seed(rows * 7 + n)
    packed, values, scales, offsets = _int_weights(n, k, bits, group, asymmetric, gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if rows == 5 else None
    weight = quant_int.dequantize_int(packed, scales, offsets, bits, group, k)
    s = scales.double().repeat_interleave(group, 1)[:, :k]
    manual = values.double() * s + (offsets.double().repeat_interleave(group, 1)[:, :k] if asymmetric
                                    else -(2 ** (bits - 1)) * s)  # fmt: skip
    torch.testing.assert_close(weight.double(), manual, rtol=1e-6, atol=1e-7)
    expected = _float64_product(x, weight, bias)
    _close(quant_int.int_linear_triton(x, packed, scales, offsets, bits, group, bias), expected, dtype)
    _close(quant_int.int_linear_ref(x, packed, scales, offsets, bits, group, bias), expected, dtype)


def test_int_linear_gemv_tile_and_explicit_tiles_agree():
    gen = torch.Generator().manual_seed(3)
    packed, _, scales, _ = _int_weights(24, 96, 4, 32, False, gen)
    x = torch.randn(1, 96, generator=gen)
    ref = quant_int.int_linear_ref(x, packed, scales, None, 4, 32)
    for tile in (IntTile(1, 8, 64, 1, 4), IntTile(16, 16, 32, 2, 4)):
        torch.testing.assert_close(
            quant_int.int_linear_triton(x, packed, scales, None, 4, 32, tile=tile), ref
        )


def test_int_linear_rejects_a_truncated_scale_tensor():
    gen = torch.Generator().manual_seed(4)
    packed, _, scales, _ = _int_weights(8, 64, 4, 32, False, gen)
    with pytest.raises(ValueError, match=r"scales must be \[8, 2\]"):
        quant_int.int_linear_triton(torch.randn(1, 64), packed, scales[:, :1], None, 4, 32)


def _fp8_weights(n, k, block, gen):
    weight = (torch.randn(n, k, generator=gen) * 2).to(quant_fp8.FP8_DTYPE)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) * 0.01 + 1e-3
    return weight, scale


@pytest.mark.parametrize(
    "rows,n,k,block,dtype",
    [
        (1, 37, 200, (1, 200), torch.float32),
        (1, 150, 300, (128, 128), torch.bfloat16),
        (7, 37, 200, (1, 200), torch.float16),
        (40, 150, 300, (128, 128), torch.float32),
        (70, 33, 130, (128, 128), torch.float32),
    ],
)
def test_fp8_linear_matches_float64_reference(rows, n, k, block, dtype):
    gen = torch.Generator().manual_seed(rows + n)
    weight, scale = _fp8_weights(n, k, block, gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if rows == 7 else None
    dequantized = quant_fp8.dequantize_fp8(weight, scale, block)
    expected = _float64_product(x, dequantized, bias)
    _close(quant_fp8.fp8_linear_triton(x, weight, scale, block, bias), expected, dtype)
    _close(quant_fp8.fp8_linear_ref(x, weight, scale, block, bias), expected, dtype)


# block scales: one per 128-column tile (128), one per two tiles (256: the scale row changes between
# the tiles), and a scale per column within a tile (64: the per-column form)
@pytest.mark.parametrize(
    "n,k,block", [(70, 200, (1, 200)), (150, 300, (128, 128)), (300, 256, (256, 128)), (200, 256, (64, 128))]
)
def test_fp8_w8a8_matches_float64_of_quantized_activations(n, k, block):
    gen = torch.Generator().manual_seed(n)
    weight, scale = _fp8_weights(n, k, block, gen)
    x = torch.randn(67, k, generator=gen)
    group = quant_fp8_w8a8.activation_group(block, k)
    xq, xs = quant_fp8_w8a8.quantize_fp8_rows_triton(x, group)
    xq_ref, xs_ref = quant_fp8_w8a8.quantize_fp8_rows_ref(x, group)
    assert torch.equal(xs, xs_ref)
    # the kernel rounds to e4m3 by hand (kernels/fp8_rows.py round_to_e4m3), so its codes are the
    # reference's under the interpreter too, whose own float -> e4m3 cast mis-rounds (124.7 -> 64)
    assert torch.equal(xq.view(torch.uint8), xq_ref.view(torch.uint8))
    dequantized = quant_fp8.dequantize_fp8(weight, scale, block)
    for quantized, out in (
        (xq, quant_fp8_w8a8.fp8_w8a8_triton(x, weight, scale, block)),
        (xq_ref, quant_fp8_w8a8.fp8_w8a8_ref(x, weight, scale, block)),
    ):
        x_dequantized = quantized.double() * xs.double().repeat_interleave(group, 1)[:, :k]
        _close(out, _float64_product(x_dequantized, dequantized, None), torch.float32)


@pytest.mark.parametrize(
    "n,k,block,dtype", [(70, 200, (1, 200), torch.bfloat16), (33, 96, (1, 96), torch.float16),
                        (150, 300, (128, 128), torch.bfloat16)]
)  # fmt: skip
def test_fp8_w8a8_on_fp8_rows_matches_float64_of_the_rows(n, k, block, dtype):
    """The prefill product on activations a producer already quantized (kernels/fp8_rows.py: a scale a
    row for per-channel weights, a 128-column group for 128 x 128 blocks), with bias, into x's dtype;
    rows of another group are refused."""
    from tpfuse.kernels.fp8_rows import Fp8Rows

    gen = torch.Generator().manual_seed(n + k)
    weight, scale = _fp8_weights(n, k, block, gen)
    group = quant_fp8_w8a8.activation_group(block, k)
    data, scales = quant_fp8_w8a8.quantize_fp8_rows_ref(torch.randn(67, k, generator=gen), group)
    rows = Fp8Rows(data, scales, dtype, group)
    bias = torch.randn(n, generator=gen).to(dtype)
    dequantized = quant_fp8.dequantize_fp8(weight, scale, block)
    expected = _float64_product(rows.dequantize(torch.float64), dequantized, bias)
    for out in (
        quant_fp8_w8a8.fp8_w8a8_rows_triton(rows, weight, scale, block, bias),
        quant_fp8_w8a8.fp8_w8a8_rows_ref(rows, weight, scale, block, bias),
    ):
        assert out.shape == (67, n)
        _close(out, expected, dtype)
    other = 64 if group == k else k
    other_x = torch.randn(5, k, generator=gen)
    other_rows = Fp8Rows(*quant_fp8_w8a8.quantize_fp8_rows_ref(other_x, other), dtype, other)
    with pytest.raises(ValueError, match="columns a scale"):
        quant_fp8_w8a8.fp8_w8a8_rows_triton(other_rows, weight, scale, block)


def test_fp8_activations_quantize_into_padded_column_major_scales_as_torch_scaled_mm_takes_them():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 300, generator=gen)
    xq_ref, xs_ref = quant_fp8_w8a8.quantize_fp8_rows_ref(x, 128)
    xq = torch.full((8, 300), 7.0).to(quant_fp8.FP8_DTYPE)  # 8 rows: 3 of padding keep their bytes
    scales = torch.full((3, 8), -1.0).t()  # [8, 3], column-major
    quant_fp8_w8a8.quantize_fp8_rows_into(x, 128, xq, scales)
    assert scales.stride() == (1, 8)
    assert torch.equal(scales[:5], xs_ref) and (scales[5:] == -1.0).all()
    assert (xq[5:].float() == 7.0).all()
    assert torch.equal(xq[:5].view(torch.uint8), xq_ref.view(torch.uint8))


def test_fp8_scale_of_the_wrong_block_count_is_refused():
    gen = torch.Generator().manual_seed(5)
    weight, scale = _fp8_weights(150, 300, (128, 128), gen)
    with pytest.raises(ValueError, match=r"must be \[2, 3\] float32"):
        quant_fp8.fp8_linear_triton(torch.randn(1, 300), weight, scale[:1], (128, 128))


def _expert_stack(gen, bits: int, experts: int, n: int, k: int, group: int):
    """A random quantized expert stack [experts, n, k]: 4-bit codes or FP8 e4m3 (bits 0), group scales."""
    from tpfuse.kernels import quant_moe

    if bits:
        codes = torch.stack(
            [quant_int.pack_int(torch.randint(0, 16, (n, k), generator=gen), 4) for _ in range(experts)]
        )
    else:
        codes = (torch.randn(experts, n, k, generator=gen) * 2).to(quant_fp8.FP8_DTYPE)
    scales = torch.rand(experts, n, k // group, generator=gen) * 0.05 + 1e-3
    return quant_moe.QuantExperts(codes, scales, bits, group, k)


@pytest.mark.parametrize("bits", [4, 0])  # 0: FP8 e4m3
def test_quantized_expert_slots_match_float64(bits):
    from tpfuse.kernels import quant_moe

    gen = torch.Generator().manual_seed(bits)
    experts, hidden, inter, tokens, top_k, group = 5, 96, 64, 3, 2, 32
    w13, w2 = (
        _expert_stack(gen, bits, experts, n, k, group) for n, k in ((2 * inter, hidden), (hidden, inter))
    )
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen).int()
    weights = torch.rand(tokens, top_k, generator=gen)
    gate_up, down = w13.dequantize().double(), w2.dequantize().double()
    rows = []
    for t in range(tokens):
        for j in range(top_k):
            h = gate_up[ids[t, j]] @ x[t].double()
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            rows.append(weights[t, j].double() * (down[ids[t, j]] @ act))
    expected = torch.stack(rows)
    _close(quant_moe.quant_slots_triton(x, w13, w2, weights, ids), expected, torch.float32)
    _close(quant_moe.quant_slots_ref(x, w13, w2, weights, ids), expected, torch.float32)
    if bits:  # the f16x2 rows (their fp32 stand-in here): bf16 activations, rows and K masked or not
        xb = x.bfloat16()
        expected_bf16 = quant_moe.slots_ref(xb.double(), gate_up, down, weights, ids)
        for tile in (*quant_moe.HALF2_SLOT_TILES, quant_moe.Half2SlotTile((16, 64), (8, 32))):
            assert tile.fits(xb, w13, w2)
            out = quant_moe.quant_slots_triton(xb, w13, w2, weights, ids, tile=tile)
            _close(out, expected_bf16, torch.bfloat16)
        assert not quant_moe.HALF2_SLOT_TILES[0].fits(x, w13, w2)  # fp32 activations: the W8A16 route


@pytest.mark.parametrize("bits", [4, 0])  # 0: FP8 e4m3
def test_quantized_routed_slots_pick_the_topk_kernels_experts(bits):
    """The routing inside the gate/up launch: the top-k kernel's ids and weights bit for bit, and the
    slot products of quant_slots_triton at that routing (W8A16 rows and, for 4 bits, f16x2 rows)."""
    from tpfuse.kernels import quant_moe
    from tpfuse.kernels.moe_routing import moe_topk_triton

    gen = torch.Generator().manual_seed(bits + 20)
    experts, hidden, inter, tokens, top_k, group = 7, 64, 32, 3, 3, 32
    w13, w2 = (
        _expert_stack(gen, bits, experts, n, k, group) for n, k in ((2 * inter, hidden), (hidden, inter))
    )
    logits = torch.randn(tokens, experts, generator=gen)
    want_w, want_ids = moe_topk_triton(logits, top_k, True)
    x = torch.randn(tokens, hidden, generator=gen)
    routes = [(x, None)] + ([(x.bfloat16(), quant_moe.HALF2_SLOT_TILES[0])] if bits else [])
    for x, tile in routes:
        out, weights, ids = quant_moe.quant_routed_slots_triton(x, w13, w2, logits, top_k, True, tile=tile)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
        assert torch.equal(out, quant_moe.quant_slots_triton(x, w13, w2, want_w, want_ids, tile=tile))
    with pytest.raises(ValueError, match="float32 logits"):
        quant_moe.quant_routed_slots_triton(x, w13, w2, logits[:, :3], top_k, True)


def _int_expected(x, packed, values, scales, offsets, bits, group):
    k = x.shape[1]
    s = scales.double().repeat_interleave(group, 1)[:, :k]
    if offsets is None:
        shift = -(2 ** (bits - 1)) * s
    else:
        shift = offsets.double().repeat_interleave(group, 1)[:, :k]
    return _float64_product(x, values.double() * s + shift, None)


@pytest.mark.parametrize(
    "rows,n,k,bits,group,asymmetric,tile",
    [
        (1, 24, 256, 4, 128, False, IntTile(1, 8, 64, 1, 4)),  # GEMV, one scale vector per step
        (1, 20, 192, 4, 64, True, IntTile(1, 8, 64, 1, 4)),  # the same with offsets, N masked
        (1, 16, 128, 8, 64, False, IntTile(1, 4, 64, 1, 4)),
        (1, 12, 200, 8, 20, False, IntTile(1, 4, 64, 1, 4)),  # K and N masked, 8-bit groups of 20
        (3, 40, 96, 4, 32, False, IntTile(16, 32, 32, 1, 4, swap=True)),  # tl.dot, scale per step
        (5, 24, 120, 4, 40, True, IntTile(16, 16, 64, 1, 4)),  # group 40: scale per element
        (4, 24, 200, 4, 200, False, IntTile(16, 16, 64, 1, 4, swap=True)),  # one group: after the loop
        (5, 24, 192, 4, 32, True, IntTile(16, 16, 32, 1, 4, split_k=4)),  # split-K, offsets per step
        (6, 20, 200, 8, 20, False, IntTile(16, 16, 64, 1, 4)),  # 8-bit tl.dot: per element, words masked
        (3, 20, 100, 4, 100, False, IntTile(16, 16, 64, 1, 4, swap=True)),  # last word half used
    ],
)
def test_int_linear_tiles_and_scale_modes_match_float64(rows, n, k, bits, group, asymmetric, tile):
    gen = torch.Generator().manual_seed(rows * 11 + k)
    packed, values, scales, offsets = _int_weights(n, k, bits, group, asymmetric, gen)
    x = torch.randn(rows, k, generator=gen)
    out = quant_int.int_linear_triton(x, packed, scales, offsets, bits, group, tile=tile)
    _close(out, _int_expected(x, packed, values, scales, offsets, bits, group), torch.float32)
    if rows == 1:  # bf16 x: the GEMV reads it as int32 pairs
        xb = x.bfloat16()
        assert quant_int.x_pairs(xb)
        out = quant_int.int_linear_triton(xb, packed, scales, offsets, bits, group, tile=tile)
        _close(out, _int_expected(xb, packed, values, scales, offsets, bits, group), torch.bfloat16)


def test_int_linear_refuses_a_group_that_splits_a_packed_word():
    gen = torch.Generator().manual_seed(6)
    packed, _, scales, _ = _int_weights(8, 48, 4, 12, False, gen)
    with pytest.raises(ValueError, match="group size 12 is not a multiple of the 8 values"):
        quant_int.int_linear_triton(torch.randn(1, 48), packed, scales, None, 4, 12)


@pytest.mark.parametrize(
    "rows,n,k,block,tile",
    [
        (1, 40, 384, (1, 128), IntTile(1, 8, 512, 1, 4)),  # GEMV: 4 sub-tiles of a 128 block per step
        (1, 20, 100, (3, 24), IntTile(1, 4, 64, 1, 4)),  # odd blocks: 8-column sub-tiles
        (1, 150, 300, (128, 128), IntTile(1, 16, 512, 1, 4)),  # rows share scales: on x, masked
        (1, 256, 384, (128, 128), IntTile(1, 32, 128, 1, 4)),  # on x, no masks
        (1, 70, 200, (64, 96), IntTile(1, 8, 256, 1, 4)),  # on x, K blocks across a step's sub-tile
        (6, 48, 160, (1, 160), IntTile(16, 32, 64, 1, 4, swap=True)),  # tl.dot, row scale after the loop
        (5, 20, 100, (3, 24), IntTile(16, 16, 32, 1, 4)),  # scale per element
        (17, 40, 256, (1, 128), IntTile(32, 32, 128, 1, 4, swap=True)),  # scale per K step
        (9, 40, 320, (1, 320), IntTile(16, 32, 64, 1, 4, swap=True, split_k=3)),  # 128+128+64, row scale
        (9, 40, 320, (1, 64), IntTile(16, 16, 64, 1, 4, split_k=2)),  # split-K, scale per K step
    ],
)
def test_fp8_linear_tiles_and_scale_modes_match_float64(rows, n, k, block, tile):
    gen = torch.Generator().manual_seed(rows * 13 + k)
    weight, scale = _fp8_weights(n, k, block, gen)
    x = torch.randn(rows, k, generator=gen)
    expected = _float64_product(x, quant_fp8.dequantize_fp8(weight, scale, block), None)
    _close(quant_fp8.fp8_linear_triton(x, weight, scale, block, tile=tile), expected, torch.float32)


def test_every_timed_candidate_tile_is_correct():
    from tpfuse.model.linear_choice import QUANT_TILES

    gen = torch.Generator().manual_seed(8)
    n, k = 40, 256
    packed, values, scales, _ = _int_weights(n, k, 4, 128, False, gen)
    weight, scale = _fp8_weights(n, k, (1, 128), gen)
    dequantized = quant_fp8.dequantize_fp8(weight, scale, (1, 128))
    for rows_bucket in (1, 16, 32, 64):
        x = torch.randn(rows_bucket - (rows_bucket > 1), k, generator=gen)  # 15, 31, 63 rows: padded tiles
        expected = _int_expected(x, packed, values, scales, None, 4, 128)
        for tile in QUANT_TILES[rows_bucket]:
            _close(quant_int.int_linear_triton(x, packed, scales, None, 4, 128, tile=tile), expected, x.dtype)
        for tile in quant_fp8.FP8_TILES[rows_bucket]:
            out = quant_fp8.fp8_linear_triton(x, weight, scale, (1, 128), tile=tile)
            _close(out, _float64_product(x, dequantized, None), x.dtype)


def test_fp8_per_channel_expert_slots_match_float64():
    from tpfuse.kernels import quant_moe

    gen = torch.Generator().manual_seed(9)
    experts, hidden, inter, tokens, top_k = 4, 80, 48, 2, 2

    def stack(n, k):
        codes = (torch.randn(experts, n, k, generator=gen) * 2).to(quant_fp8.FP8_DTYPE)
        scales = torch.rand(experts, n, 1, generator=gen) * 0.05 + 1e-3
        return quant_moe.QuantExperts(codes, scales, 0, k, k)

    w13, w2 = stack(2 * inter, hidden), stack(hidden, inter)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen).int()
    weights = torch.rand(tokens, top_k, generator=gen)
    gate_up, down = w13.dequantize().double(), w2.dequantize().double()
    expected = quant_moe.slots_ref(x.double(), gate_up, down, weights.double(), ids)
    out = quant_moe.quant_slots_triton(x, w13, w2, weights, ids, block_n=16)
    _close(out, expected.double(), torch.float32)


@pytest.mark.parametrize("routed", [False, True])
def test_fp8_block_expert_slots_with_rows_sharing_scales_match_float64(routed):
    """128 x 128-style blocks expanded per row (runs of 64 equal rows here): the slot programs read one
    row's scales and put them on x (X_SCALE), over 3 scale groups of 32 columns and a masked K step."""
    from tpfuse.kernels import quant_moe

    gen = torch.Generator().manual_seed(11)
    experts, hidden, inter, tokens, top_k, group, run = 5, 96, 64, 3, 2, 32, 64

    def stack(n, k):
        codes = (torch.randn(experts, n, k, generator=gen) * 2).to(quant_fp8.FP8_DTYPE)
        blocks = torch.rand(experts, -(-n // run), k // group, generator=gen) * 0.05 + 1e-3
        scales = blocks.repeat_interleave(run, 1)[:, :n].contiguous()
        return quant_moe.QuantExperts(codes, scales, 0, group, k, row_block=run)

    w13, w2 = stack(2 * inter, hidden), stack(hidden, inter)
    assert quant_moe._steps(w13, hidden, 16, inter, 512, False)["X_SCALE"]
    assert quant_moe._steps(w2, inter, 16, hidden, 512, False)["X_SCALE"]
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up, down = w13.dequantize().double(), w2.dequantize().double()
    if routed:
        logits = torch.randn(tokens, experts, generator=gen)
        out, weights, ids = quant_moe.quant_routed_slots_triton(x, w13, w2, logits, top_k, True)
    else:
        ids = torch.randint(0, experts, (tokens, top_k), generator=gen).int()
        weights = torch.rand(tokens, top_k, generator=gen)
        out = quant_moe.quant_slots_triton(x, w13, w2, weights, ids, block_n=16)
    expected = quant_moe.slots_ref(x.double(), gate_up, down, weights.double(), ids)
    _close(out, expected.double(), torch.float32)


def test_split_k_sums_in_split_order_and_leaves_its_counters_at_zero():
    from tpfuse.kernels.decode_merge import arrival_counters

    gen = torch.Generator().manual_seed(10)
    weight, scale = _fp8_weights(40, 320, (1, 64), gen)
    x = torch.randn(9, 320, generator=gen)
    tile = IntTile(16, 16, 64, 1, 4, split_k=3)
    first = quant_fp8.fp8_linear_triton(x, weight, scale, (1, 64), tile=tile)
    assert torch.equal(first, quant_fp8.fp8_linear_triton(x, weight, scale, (1, 64), tile=tile))
    assert not arrival_counters(x.device, 1).any()


@pytest.mark.parametrize(
    "rows,n,k,block,split_k,prequantize,dtype",
    [
        (1, 37, 200, (1, 200), 1, False, torch.float32),  # per-channel: steps of 128 then 72
        (5, 150, 300, (128, 128), 1, False, torch.float32),  # block scales over odd N and K
        (5, 150, 300, (128, 128), 1, True, torch.float32),
        (33, 70, 256, (1, 256), 2, True, torch.float32),  # split-K
        (33, 70, 256, (1, 256), 2, False, torch.float32),
        (64, 40, 96, (1, 96), 1, True, torch.bfloat16),  # K shorter than a step: one group a row
        (3, 64, 320, (32, 64), 2, False, torch.float32),  # K blocks of 64: steps of 64
        (3, 64, 320, (32, 64), 1, True, torch.float32),
    ],
)
def test_fp8_w8a8_decode_form_matches_float64_of_its_activation_groups(
    rows, n, k, block, split_k, prequantize, dtype
):
    gen = torch.Generator().manual_seed(rows * 13 + n)
    weight, scale = _fp8_weights(n, k, block, gen)
    tile = quant_fp8_w8a8.W8A8Tile(
        max(16, 1 << (rows - 1).bit_length()),
        64,
        128,
        1,
        4,
        swap=True,
        split_k=split_k,
        prequantize=prequantize,
    )
    group = quant_fp8_w8a8.decode_group(block, k, tile)
    assert group == (min(128, block[1]) if block[1] < k else (k if prequantize else 128))
    x = e4m3_exact_activations(rows, k, group, gen).to(dtype)
    expected = x.double() @ quant_fp8.dequantize_fp8(weight, scale, block).double().T
    out = quant_fp8_w8a8.fp8_w8a8_decode_triton(x, weight, scale, block, tile=tile)
    _close(out, expected, dtype)
    _close(quant_fp8_w8a8.fp8_w8a8_decode_ref(x, weight, scale, block, tile=tile), expected, dtype)


def test_every_w8a8_decode_candidate_on_128x128_blocks_given_as_such_matches_float64():
    """A block-FP8 layer hands its kept 128 x 128 scales to every Triton route (model/quant/fp8.py):
    the W8A8 candidates of each row bucket, with weight tiles of 64 rows (one scale a K step) and of
    128-256 rows (a scale per column), over masked rows and a partial last block."""
    gen = torch.Generator().manual_seed(12)
    n, k, block = 300, 256, (128, 128)
    weight, scale = _fp8_weights(n, k, block, gen)
    dequantized = quant_fp8.dequantize_fp8(weight, scale, block).double()
    for bucket, tiles in quant_fp8_w8a8.W8A8_TILES.items():
        for tile in tiles:
            x = e4m3_exact_activations(bucket, k, quant_fp8_w8a8.decode_group(block, k, tile), gen)
            out = quant_fp8_w8a8.fp8_w8a8_decode_triton(x, weight, scale, block, tile=tile)
            _close(out, x.double() @ dequantized.T, torch.float32)


def test_fp8_w8a8_decode_form_refuses_k_blocks_without_a_step():
    gen = torch.Generator().manual_seed(3)
    weight, scale = _fp8_weights(8, 96, (1, 24), gen)  # 24 = 8 x 3: no power-of-two step >= 16
    with pytest.raises(ValueError, match="power-of-two part >= 16"):
        quant_fp8_w8a8.fp8_w8a8_decode_triton(torch.randn(1, 96), weight, scale, (1, 24))
