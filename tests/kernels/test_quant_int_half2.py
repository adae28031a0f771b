"""The f16x2 one-row INT4 GEMV (kernels/quant_int_half2.py, Half2Tile) under the interpreter, where it
runs its fp32 stand-in for the PTX, against float64 products of the dequantized weights: odd N (rows
masked), K over several steps and K masked by whole vectors, K split over programs, symmetric
and offset codes, bias, bf16 and fp16 x, into outputs poisoned with NaN; layouts it does not take go
to kernels/quant_int.py's GEMV; the producers that write x as Half2X. The PTX itself is checked on
the GPU (tests/kernels/test_gpu_quant_kernels.py)."""

import pytest
import torch

from tpfuse.kernels import activation, quant_int, quant_int_half2, rmsnorm
from tpfuse.kernels.quant_int_half2 import Half2Tile

TILES = {
    "one-step": Half2Tile(1, 8, 4096, 1, 4),
    "steps": Half2Tile(1, 4, 128, 1, 1),
    "steps-64": Half2Tile(1, 4, 64, 1, 1),
    "split": Half2Tile(1, 4, 64, 1, 1, split_k=2),  # K in two parts, the last to arrive sums them
    "split-3": Half2Tile(1, 8, 128, 1, 1, split_k=3),  # 2-3 parts (no empty one), masked vectors in the last
}

CASES = [  # n, k, group, offsets, bias, x dtype
    (37, 256, 32, False, False, torch.bfloat16),
    (5, 480, 96, True, True, torch.bfloat16),  # K = 3.75 steps of 128: whole vectors masked
    (24, 1024, 1024, False, True, torch.float16),  # one group spanning K
    (3, 2048, 128, True, False, torch.float16),
    (16, 160, 160, True, True, torch.bfloat16),
]


def _case(n, k, group, offsets, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (n, k), generator=gen)
    groups = -(-k // group)
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
    shift = (torch.randn(n, groups, generator=gen) * 0.05) if offsets else None
    x = torch.randn(1, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return quant_int.pack_int(values, 4), scales, shift, x, bias


def _expected(x, packed, scales, offsets, group, bias):
    weight = quant_int.dequantize_int(packed, scales, offsets, 4, group, x.shape[1]).double()
    out = x.double() @ weight.T
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("tile", list(TILES))
@pytest.mark.parametrize("n,k,group,offsets,with_bias,dtype", CASES)
def test_half2_gemv_matches_float64(tile, n, k, group, offsets, with_bias, dtype):
    packed, scales, shift, x, bias = _case(n, k, group, offsets, dtype, seed=n * 7 + k)
    bias = bias if with_bias else None
    expected = _expected(x, packed, scales, shift, group, bias)
    for out in (
        quant_int.int_linear_triton(x, packed, scales, shift, 4, group, bias, tile=TILES[tile]),
        quant_int_half2.half2_int4_gemv(
            x,
            packed,
            scales,
            shift,
            group,
            bias,
            tile=TILES[tile],
            out=torch.full((1, n), float("nan"), dtype=dtype),
        ),
    ):
        assert out.dtype == dtype and out.shape == (1, n)
        assert torch.isfinite(out).all(), "an output left unwritten (NaN poison)"
        err = (out.double() - expected).abs().max().item()
        assert err <= 2e-2 * expected.abs().max().item(), err


def test_layouts_it_does_not_take_run_the_default_gemv():
    # 8 bits, fp32 x, K not a multiple of 32, groups splitting a vector: quant_int's GEMV, same product
    for bits, dtype, k, group in ((8, torch.bfloat16, 256, 64), (4, torch.float32, 256, 64),
                                  (4, torch.bfloat16, 264, 264), (4, torch.bfloat16, 256, 16)):  # fmt: skip
        x = torch.randn(1, k).to(dtype)
        assert not quant_int_half2.fits(x, bits, group)
        gen = torch.Generator().manual_seed(k + bits)
        packed = quant_int.pack_int(torch.randint(0, 2**bits, (6, k), generator=gen), bits)
        scales = torch.rand(6, -(-k // group), generator=gen) * 0.01
        out = quant_int.int_linear_triton(x, packed, scales, None, bits, group, tile=TILES["steps"])
        ref = x.double() @ quant_int.dequantize_int(packed, scales, None, bits, group, k).double().T
        assert (out.double() - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_an_empty_k_gives_the_bias():
    x = torch.empty(1, 0, dtype=torch.bfloat16)
    packed, scales = torch.empty(5, 0, dtype=torch.int32), torch.empty(5, 0, dtype=torch.bfloat16)
    bias = torch.arange(5, dtype=torch.bfloat16)
    out = quant_int_half2.half2_int4_gemv(x, packed, scales, None, 128, bias, tile=TILES["steps"])
    assert torch.equal(out, bias[None])


def test_a_vector_of_subnormal_x_keeps_its_values():
    """bf16 x below 2^-126 (subnormal): each 32-value vector's power-of-two scale stays a normal float,
    so the product keeps those values (large scales put the output in bf16's normal range)."""
    packed, scales, _, x, _ = _case(6, 96, 32, False, torch.bfloat16, seed=11)
    x = (x.float() * 1e-39).bfloat16()
    scales = (scales.float() * 1e6).bfloat16()
    expected = _expected(x, packed, scales, None, 32, None)
    assert expected.abs().max() > 1e-35
    out = quant_int_half2.half2_int4_gemv(x, packed, scales, None, 32, tile=TILES["steps"])
    assert (out.double() - expected).abs().max() <= 2e-2 * expected.abs().max()


@pytest.mark.parametrize("n,k,group,offsets,with_bias,dtype", CASES)
def test_half2_gemv_on_x_made_once_matches_float64(n, k, group, offsets, with_bias, dtype):
    # x converted once for every product (Half2X) instead of once a program: the same products
    packed, scales, shift, x, bias = _case(n, k, group, offsets, dtype, seed=n * 11 + k)
    bias = bias if with_bias else None
    expected = _expected(x, packed, scales, shift, group, bias)
    ready = quant_int_half2.half2_x(x)
    for tile in TILES.values():
        poison = torch.full((1, n), float("nan"), dtype=dtype)
        out = quant_int_half2.half2_int4_gemv(
            ready, packed, scales, shift, group, bias, tile=tile, out=poison
        )
        assert out.dtype == dtype and out.shape == (1, n)
        assert torch.isfinite(out).all(), "an output left unwritten (NaN poison)"
        err = (out.double() - expected).abs().max().item()
        assert err <= 2e-2 * expected.abs().max().item(), err


def test_half2_x_holds_each_vectors_x_in_block_floating_point():
    # a vector of large values, one of tiny ones, one of zeros: every lane is x m (or x m / 16) in f16
    x = torch.cat([torch.randn(32) * 3e4, torch.randn(32) * 1e-6, torch.zeros(32), torch.randn(32)])
    x = x.to(torch.bfloat16)[None]
    made = quant_int_half2.half2_x(x)
    lanes = torch.stack([made.pairs & 0xFFFF, (made.pairs >> 16) & 0xFFFF], dim=-1)  # [vector, 16, 2]
    values = lanes.to(torch.int16).view(torch.float16).double().reshape(-1, 4, 4, 2)  # vector, word, j, lane
    values = values * torch.tensor([1.0, 16.0, 1.0, 16.0], dtype=torch.float64)[None, None, :, None]
    values = values.permute(0, 1, 3, 2).reshape(-1, 32) * made.inv_m.double()[:, None]  # back to x order
    assert torch.allclose(values, x.double().reshape(-1, 32), rtol=1e-3, atol=0)
    assert torch.equal(made.values().double().reshape(-1, 32), values)
    assert made.inv_m[2] > 0
    assert made.sums.tolist() == pytest.approx(x.double().reshape(-1, 32).sum(1).tolist())
    largest = values.reshape(-1, 32).abs().amax(dim=1) / made.inv_m.double()
    assert ((largest[[0, 1, 3]] >= 1) & (largest[[0, 1, 3]] < 2)).all()  # largest |x m| in [1, 2)


def test_half2_x_refuses_what_the_kernel_does_not_take():
    for x in (torch.randn(1, 40).bfloat16(), torch.randn(2, 64).bfloat16(), torch.randn(1, 64)):
        with pytest.raises(ValueError, match="one bf16 / fp16 row of a multiple of 32"):
            quant_int_half2.half2_x(x)
    packed = quant_int.pack_int(torch.randint(0, 16, (4, 64)), 4)
    with pytest.raises(ValueError, match="whole 32-value vectors"):
        made = quant_int_half2.half2_x(torch.randn(1, 64).bfloat16())
        quant_int_half2.half2_int4_gemv(made, packed, torch.ones(4, 4), None, 16, tile=TILES["steps"])


@pytest.mark.parametrize("hidden", [4096, 96, 160])
def test_the_fused_norm_writes_half2x_of_its_normed_row(hidden):
    # the producer's Half2X (model/input_forms.py) is half2_x of the row it would have written, bit
    # for bit, and the new residual is unchanged
    gen = torch.Generator().manual_seed(hidden)
    x, residual = (torch.randn(1, hidden, generator=gen).bfloat16() for _ in range(2))
    weight = torch.rand(hidden, generator=gen).bfloat16() * torch.logspace(-4, 1, hidden).bfloat16()
    made, new_residual = rmsnorm.fused_add_rmsnorm_half2x_triton(x, residual, weight, 1e-5)
    normed, expected_residual = rmsnorm.fused_add_rmsnorm_triton(x, residual, weight, 1e-5)
    expected = quant_int_half2.half2_x(normed)
    assert torch.equal(new_residual, expected_residual)
    assert torch.equal(made.pairs, expected.pairs) and torch.equal(made.inv_m, expected.inv_m)
    assert torch.allclose(made.sums, expected.sums, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("inter,block", [(14336, None), (96, None), (160, 64)])
def test_silu_and_mul_writes_half2x_of_its_row(inter, block):
    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn(1, 2 * inter, generator=gen) * 3).bfloat16()
    made = activation.silu_and_mul_launch(x, block=block, half2x=True)
    expected = quant_int_half2.half2_x(activation.silu_and_mul_triton(x))
    assert torch.equal(made.pairs, expected.pairs) and torch.equal(made.inv_m, expected.inv_m)
    assert torch.allclose(made.sums, expected.sums, rtol=1e-5, atol=1e-6)


def test_producers_refuse_what_half2x_does_not_hold():
    with pytest.raises(ValueError, match="one bf16 / fp16 row of a multiple of 32"):
        rmsnorm.fused_add_rmsnorm_half2x_triton(*(torch.randn(2, 64).bfloat16() for _ in range(2)),
                                                torch.ones(64).bfloat16(), 1e-5)  # fmt: skip
    with pytest.raises(ValueError, match="one bf16 / fp16 row of a multiple of 32"):
        activation.silu_and_mul_half2x_triton(torch.randn(1, 80).bfloat16())


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_int_linear_op_takes_half2x(kernels, monkeypatch):
    # the method's entry point: the f16x2 GEMV on the interpreter, the reference on the values Half2X
    # stands for; 8-bit weights are refused
    from tpfuse import knobs
    from tpfuse.kernels import int_linear_op

    monkeypatch.setenv("TPFUSE_KERNELS", kernels)
    knobs.reload()
    packed, scales, shift, x, bias = _case(37, 256, 32, True, torch.bfloat16, seed=3)
    made = quant_int_half2.half2_x(x)
    out = int_linear_op(made, packed, scales, shift, 4, 32, bias, tile=TILES["steps"])
    expected = _expected(x, packed, scales, shift, 32, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 37)
    assert (out.double() - expected).abs().max() <= 2e-2 * expected.abs().max()
    if kernels == "triton":
        with pytest.raises(ValueError, match="4-bit f16x2 GEMV"):
            eight = quant_int.pack_int(torch.randint(0, 256, (4, 256)), 8)
            int_linear_op(made, eight, torch.ones(4, 8), None, 8, 32)
