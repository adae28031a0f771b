"""Triton rmsnorm and fused residual add + rmsnorm against their float64 references."""

import pytest
import torch

from tests.kernels.paged import assert_close_to_float64
from tpfuse.kernels.rmsnorm import (
    fused_add_rmsnorm_launch,
    fused_add_rmsnorm_ref,
    fused_add_rmsnorm_triton,
    rmsnorm_ref,
    rmsnorm_triton,
)

EPS = 1e-5


def _inputs(rows, hidden, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 40), (5, 96), (3, 33)])
def test_rmsnorm_matches_float64_reference_at_odd_sizes(rows, hidden, dtype):
    x, _, weight = _inputs(rows, hidden, dtype, seed=rows * hidden)
    out = rmsnorm_triton(x, weight, EPS)
    assert_close_to_float64(out, rmsnorm_ref(x.double(), weight.double(), EPS), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(1, 40), (7, 96)])
def test_fused_add_rmsnorm_new_residual_is_the_sum_rounded_once(rows, hidden, dtype):
    x, residual, weight = _inputs(rows, hidden, dtype, seed=7 + hidden)
    _, new_residual = fused_add_rmsnorm_triton(x, residual, weight, EPS)
    assert torch.equal(new_residual, (x.float() + residual.float()).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,hidden", [(2, 40), (5, 96), (3, 33)])
def test_fused_add_rmsnorm_normalizes_the_rounded_residual(rows, hidden, dtype):
    x, residual, weight = _inputs(rows, hidden, dtype, seed=hidden)
    normed, _ = fused_add_rmsnorm_triton(x, residual, weight, EPS)
    rounded_sum = (x.float() + residual.float()).to(dtype)
    assert_close_to_float64(normed, rmsnorm_ref(rounded_sum.double(), weight.double(), EPS), dtype)


def test_fused_add_rmsnorm_leaves_its_inputs_unchanged():
    x, residual, weight = _inputs(3, 40, torch.float32, seed=1)
    x_before, residual_before = x.clone(), residual.clone()
    fused_add_rmsnorm_triton(x, residual, weight, EPS)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rmsnorm_reads_rows_of_a_strided_view():
    x, _, weight = _inputs(4, 80, torch.float32, seed=3)
    view = x[:, :40]
    assert_close_to_float64(
        rmsnorm_triton(view, weight[:40], EPS),
        rmsnorm_ref(view.double(), weight[:40].double(), EPS),
        torch.float32,
    )


def test_fused_add_rmsnorm_reference_and_triton_agree_within_one_rounding():
    x, residual, weight = _inputs(4, 96, torch.float16, seed=5)
    normed, new_residual = fused_add_rmsnorm_triton(x, residual, weight, EPS)
    normed_ref, new_residual_ref = fused_add_rmsnorm_ref(x, residual, weight, EPS)
    assert torch.equal(new_residual, new_residual_ref)
    torch.testing.assert_close(normed, normed_ref, atol=2e-3, rtol=2e-3)


def test_rmsnorm_rejects_a_weight_of_the_wrong_size():
    x, _, weight = _inputs(2, 40, torch.float32, seed=0)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm_triton(x, weight[:39], EPS)


@pytest.mark.parametrize("num_warps", [1, 4, 16])
def test_fused_add_rmsnorm_gives_the_same_result_at_any_warp_count(num_warps):
    x, residual, weight = _inputs(1, 200, torch.float16, seed=num_warps)
    expected_normed, expected_residual = fused_add_rmsnorm_triton(x, residual, weight, EPS)
    normed, new_residual = fused_add_rmsnorm_launch(x, residual, weight, EPS, num_warps=num_warps)
    assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(normed, expected_normed, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "rows,hidden,group", [(1, 40, 40), (5, 96, 96), (3, 33, 33), (4, 200, 128), (2, 256, 128)]
)
def test_fused_add_rmsnorm_as_fp8_rows_quantizes_the_rows_the_plain_kernel_writes(rows, hidden, group, dtype):
    """One launch gives the bits of the plain kernel's normed rows quantized afterwards
    (quantize_fp8_rows, a scale a row or a 128-column group: what the W8A8 product would do), the
    same new residual, and rows within e4m3's rounding of the float64 norm; a row of zeros gets
    scales of 1 (with a negative weight, so its zeros are -0)."""
    from tpfuse.kernels.quant_fp8_w8a8 import quantize_fp8_rows_ref
    from tpfuse.kernels.rmsnorm import fused_add_rmsnorm_fp8_rows_ref, fused_add_rmsnorm_fp8_rows_triton

    x, residual, weight = _inputs(rows, hidden, dtype, seed=hidden + rows)
    x[-1], residual[-1], weight[0] = 0, 0, -1
    fp8, new_residual = fused_add_rmsnorm_fp8_rows_triton(x, residual, weight, EPS, group)
    normed, plain_residual = fused_add_rmsnorm_triton(x, residual, weight, EPS)
    data, scales = quantize_fp8_rows_ref(normed, group)
    assert fp8.data.dtype == torch.float8_e4m3fn and fp8.scales.shape == (rows, -(-hidden // group))
    assert fp8.group == group and fp8.dtype == dtype
    assert torch.equal(fp8.data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(fp8.scales, scales) and (fp8.scales[-1] == 1.0).all()
    assert torch.equal(new_residual, plain_residual)
    expected = rmsnorm_ref((x.float() + residual.float()).to(dtype).double(), weight.double(), EPS)
    err = (fp8.dequantize().double() - expected).abs().max().item()
    assert err <= 2**-3 * expected.abs().max().item(), err
    ref, _ = fused_add_rmsnorm_fp8_rows_ref(x, residual, weight, EPS, group)
    assert (ref.dequantize() - fp8.dequantize()).abs().max() <= 2**-3 * expected.abs().max()


def test_fp8_rows_refuse_a_group_that_is_neither_a_row_nor_a_power_of_two():
    from tpfuse.kernels.rmsnorm import fused_add_rmsnorm_fp8_rows_triton

    x, residual, weight = _inputs(2, 200, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="power-of-two group"):
        fused_add_rmsnorm_fp8_rows_triton(x, residual, weight, EPS, 96)
