"""The PCIe-class schedules (staged, hierarchical over islands, pull) under the interpreter vs float64.

Virtual ranks on CPU buffers; every step of a schedule runs on all ranks before the next step (see
test_kernels_interpreted.py). 2-8 ranks, odd sizes, islands of unequal size, all three epilogues.
"""

from __future__ import annotations

import pytest
import torch

from tests.comm.reference import (
    EPS,
    FP8_MAX,
    all_reduce_in_phases,
    assert_close_to,
    fused64,
    fused_in_phases,
    sum64,
)
from tpfuse.comm import launch, schedules
from tpfuse.comm.sync import ALL_PHASES
from tpfuse.comm.workspace import create_virtual_workspaces

NEW = ("staged", "ordered_push", "hierarchical", "pull")


def _workspaces(world_size, rows, hidden, islands=None, max_programs=3):
    # room for the hierarchical schedule's float32 partials
    wss = create_virtual_workspaces(world_size, "cpu", rows * hidden * 4, max_programs)
    islands = islands or (tuple(range(world_size // 2)), tuple(range(world_size // 2, world_size)))
    for ws in wss:
        ws.set_islands(islands)
    return wss


def _steps(algorithm, world_size):
    return tuple(1 << i for i in range(schedules.get(algorithm).steps(world_size)))


def _fused(wss, xs, residual, weight, algorithm, fp8_scale=None, fp8_group=None, half2x=False):
    phases = _steps(algorithm, len(wss))
    outs = fused_in_phases(wss, xs, residual, weight, algorithm, fp8_scale, phases, fp8_group, half2x)
    for ws in wss:
        ws.check()
    return outs


def _all_reduce(wss, xs, algorithm):
    outs = all_reduce_in_phases(wss, xs, algorithm, phases=_steps(algorithm, len(wss)))
    for ws in wss:
        ws.check()
    return outs


CASES = [
    (2, 3, 37, torch.float32, ((0,), (1,))),
    (3, 2, 24, torch.bfloat16, ((0, 2), (1,))),
    (5, 1, 45, torch.float16, ((0, 1, 2), (3, 4))),
    (8, 2, 33, torch.bfloat16, ((0, 1, 2, 3, 4), (5, 6, 7))),
]


@pytest.mark.parametrize("algorithm", NEW)
@pytest.mark.parametrize(("world_size", "rows", "hidden", "dtype", "islands"), CASES)
def test_all_reduce_matches_float64_at_odd_sizes(algorithm, world_size, rows, hidden, dtype, islands):
    wss = _workspaces(world_size, rows, hidden, islands)
    xs = [torch.randn(rows, hidden).to(dtype) for _ in range(world_size)]
    outs = _all_reduce(wss, xs, algorithm)
    for out in outs:
        assert_close_to(out, sum64(xs))
        assert torch.equal(out, outs[0]), "ranks disagree"


@pytest.mark.parametrize("algorithm", NEW)
@pytest.mark.parametrize(("world_size", "rows", "hidden", "dtype", "islands"), CASES[1:3])
def test_fused_matches_float64_and_is_bit_identical_on_every_rank(algorithm, world_size, rows, hidden, dtype,
                                                                  islands):  # fmt: skip
    wss = _workspaces(world_size, rows, hidden, islands)
    xs = [torch.randn(rows, hidden).to(dtype) for _ in range(world_size)]
    residual, weight = torch.randn(rows, hidden).to(dtype), torch.randn(hidden).to(dtype)
    normed64, residual64 = fused64(xs, residual, weight, EPS)
    outs = _fused(wss, xs, residual, weight, algorithm)
    for normed, new_residual in outs:
        assert_close_to(new_residual, residual64)
        assert_close_to(normed, normed64, ulps=3)
        assert torch.equal(normed, outs[0][0]) and torch.equal(new_residual, outs[0][1]), "ranks disagree"


@pytest.mark.parametrize("islands", [((0,), (1, 2, 3)), ((0, 3), (1,), (2,)), ((1, 3), (0, 2))])
def test_hierarchical_over_unequal_and_interleaved_islands(islands):
    wss = _workspaces(4, 5, 19, islands)
    xs = [torch.randn(5, 19) for _ in range(4)]
    for out in _all_reduce(wss, xs, "hierarchical"):
        assert_close_to(out, sum64(xs))


@pytest.mark.parametrize("algorithm", NEW)
def test_fp8_output_is_the_scaled_norm_rounded_to_e4m3(algorithm):
    wss = _workspaces(4, 3, 40)
    xs = [torch.randn(3, 40).bfloat16() for _ in range(4)]
    residual, weight = torch.randn(3, 40).bfloat16(), torch.randn(40).bfloat16()
    weight[0] = 1e3
    residual[:, 0] = 8.0  # column 0 saturates at +-448
    normed64, residual64 = fused64(xs, residual, weight, EPS)
    expected = (normed64 / 0.01).clamp(-FP8_MAX, FP8_MAX)
    for q, new_residual in _fused(wss, xs, residual, weight, algorithm, fp8_scale=torch.tensor([0.01])):
        assert q.dtype == torch.float8_e4m3fn
        assert_close_to(new_residual, residual64)
        assert ((q.double() - expected).abs() <= 0.07 * expected.abs() + 2.0**-9).all()
        assert (q[:, 0].double().abs() == FP8_MAX).all()


@pytest.mark.parametrize("algorithm", NEW)
def test_back_to_back_calls_alternate_buffers_and_advance_the_epoch_once(algorithm):
    wss = _workspaces(3, 4, 16, ((0,), (1, 2)), max_programs=2)  # rows beyond the program count too
    for call in range(3):
        xs = [torch.randn(4, 16) for _ in range(3)]
        for out in _all_reduce(wss, xs, algorithm):
            assert_close_to(out, sum64(xs))
        assert [int(ws.words[0]) for ws in wss] == [call + 1] * 3


def test_staged_ordered_push_and_pull_give_the_one_shot_bits():
    # all three sum the ranks in rank order in float32
    wss = _workspaces(4, 2, 45)
    xs = [torch.randn(2, 45).bfloat16() for _ in range(4)]
    residual, weight = torch.randn(2, 45).bfloat16(), torch.randn(45).bfloat16()
    runs = {}
    for algorithm in ("one_shot", "staged", "ordered_push", "pull"):
        runs[algorithm] = _fused(wss, xs, residual, weight, algorithm)[0]
    for algorithm in ("staged", "ordered_push", "pull"):
        assert torch.equal(runs[algorithm][0], runs["one_shot"][0])
        assert torch.equal(runs[algorithm][1], runs["one_shot"][1])


@pytest.mark.parametrize("algorithm", NEW)
def test_a_peer_that_never_sends_is_named_in_the_error_word(algorithm):
    wss = _workspaces(4, 2, 16, ((0, 1), (2, 3)))
    xs = [torch.randn(2, 16) for _ in range(4)]
    steps = _steps(algorithm, 4)
    for step in steps:
        for rank in (0, 1, 2):  # rank 3 has crashed
            launch.all_reduce(wss[rank], xs[rank], algorithm, phases=step)
    # who hears from rank 3 directly: staged/pull everyone; hierarchical its island and the ranks it sends to
    assert wss[2].error_mask() == 1 << 3
    with pytest.raises(RuntimeError, match="rank 3 never arrived"):
        wss[2].check()


def test_hierarchical_without_islands_is_refused_with_the_fix():
    wss = create_virtual_workspaces(2, "cpu", 256, 2)
    with pytest.raises(ValueError, match="needs two or more islands"):
        launch.all_reduce(wss[0], torch.randn(1, 8), "hierarchical", phases=ALL_PHASES)
    assert schedules.available(wss[0]) == ["one_shot", "two_shot", "staged", "ordered_push", "pull"]


def test_a_message_whose_float32_partials_do_not_fit_is_refused_for_hierarchical_only():
    wss = create_virtual_workspaces(2, "cpu", 256, 2)
    wss[0].set_islands(((0,), (1,)))
    x = torch.randn(2, 64).bfloat16()  # 256 bytes: fits the slot, its float32 partial does not
    assert launch.fits(wss[0], x, "one_shot") and not launch.fits(wss[0], x, "hierarchical")
    with pytest.raises(ValueError, match="exceeds the peer workspace slot"):
        launch.all_reduce(wss[0], x, "hierarchical")


@pytest.mark.parametrize("algorithm", NEW)
@pytest.mark.parametrize("hidden,group", [(40, 40), (160, 128)])
def test_fp8_rows_are_the_plain_epilogue_quantized_a_scale_a_row_or_group(algorithm, hidden, group):
    """Each PCIe schedule's FP8-rows epilogue: the bits of its plain fused output quantized a scale a
    row or a 128-column group."""
    from tpfuse.kernels.quant_fp8_w8a8 import quantize_fp8_rows_ref

    wss = _workspaces(4, 3, hidden)
    xs = [torch.randn(3, hidden).bfloat16() for _ in range(4)]
    residual, weight = torch.randn(3, hidden).bfloat16(), torch.randn(hidden).bfloat16()
    plain = _fused(wss, xs, residual, weight, algorithm)
    for (fp8, new_residual), (normed, plain_residual) in zip(
        _fused(wss, xs, residual, weight, algorithm, fp8_group=group), plain, strict=True
    ):
        data, scales = quantize_fp8_rows_ref(normed, group)
        assert torch.equal(new_residual, plain_residual) and torch.equal(fp8.scales, scales)
        assert torch.equal(fp8.data.view(torch.uint8), data.view(torch.uint8))


@pytest.mark.parametrize("algorithm", NEW)
def test_half2x_is_the_plain_epilogue_as_the_int4_gemvs_operands(algorithm):
    """Each PCIe schedule's Half2X epilogue: half2_x of its plain fused output's row."""
    from tpfuse.kernels.quant_int_half2 import half2_x

    wss = _workspaces(4, 1, 96)
    xs = [torch.randn(1, 96).bfloat16() for _ in range(4)]
    residual, weight = torch.randn(1, 96).bfloat16(), torch.randn(96).bfloat16()
    plain = _fused(wss, xs, residual, weight, algorithm)
    for (operands, new_residual), (normed, plain_residual) in zip(
        _fused(wss, xs, residual, weight, algorithm, half2x=True), plain, strict=True
    ):
        expected = half2_x(normed)
        assert torch.equal(new_residual, plain_residual)
        assert torch.equal(operands.pairs, expected.pairs) and torch.equal(operands.inv_m, expected.inv_m)
        assert torch.allclose(operands.sums, expected.sums, rtol=1e-5, atol=1e-5)

