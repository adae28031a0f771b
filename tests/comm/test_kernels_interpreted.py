"""The peer-memory kernels' reduction and epilogue math, run by the Triton interpreter on CPU.

Ranks are virtual (one process, CPU buffers). The interpreter runs programs one after another, so the
ranks cannot wait for each other: every phase (push, reduce, finish) runs on all ranks before the
next phase starts. Concurrency, spinning and timeouts against live peers are covered by the GPU tests.
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
    poisoned,
    run_ranks_in_phases,
    sum64,
)
from tpfuse.comm import launch
from tpfuse.comm.hybrid import CustomCommunicator
from tpfuse.comm.plan import unmeasured_plan
from tpfuse.comm.sync import PHASE_FINISH, PHASE_PUSH
from tpfuse.comm.workspace import create_virtual_workspaces


def _workspaces(world_size, rows, hidden, dtype=torch.float32, max_programs=4):
    return create_virtual_workspaces(
        world_size, "cpu", rows * hidden * torch.finfo(dtype).bits // 8, max_programs
    )


def _fused(wss, xs, residual, weight, algorithm, fp8_scale=None):
    return fused_in_phases(wss, xs, residual, weight, algorithm, fp8_scale)


def _all_reduce(wss, xs, algorithm):
    return all_reduce_in_phases(wss, xs, algorithm)


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
@pytest.mark.parametrize(
    ("world_size", "rows", "hidden", "dtype"),
    [(2, 3, 37, torch.float32), (3, 5, 24, torch.bfloat16), (4, 1, 70, torch.float16)],
)
def test_all_reduce_matches_float64_reference_at_odd_sizes(algorithm, world_size, rows, hidden, dtype):
    wss = _workspaces(world_size, rows, hidden, dtype)
    xs = [torch.randn(rows, hidden).to(dtype) for _ in range(world_size)]
    for out in _all_reduce(wss, xs, algorithm):
        assert_close_to(out, sum64(xs))


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
@pytest.mark.parametrize(
    ("world_size", "rows", "hidden", "dtype"),
    [(2, 5, 33, torch.float32), (3, 2, 48, torch.bfloat16), (4, 3, 19, torch.float16)],
)
def test_fused_add_rmsnorm_matches_float64_reference_at_odd_sizes(algorithm, world_size, rows, hidden, dtype):
    wss = _workspaces(world_size, rows, hidden, dtype)
    xs = [torch.randn(rows, hidden).to(dtype) for _ in range(world_size)]
    residual, weight = torch.randn(rows, hidden).to(dtype), torch.randn(hidden).to(dtype)
    normed64, residual64 = fused64(xs, residual, weight, EPS)
    for normed, new_residual in _fused(wss, xs, residual, weight, algorithm):
        assert_close_to(new_residual, residual64)
        assert_close_to(normed, normed64, ulps=3)


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_every_rank_gets_bit_identical_outputs(algorithm):
    wss = _workspaces(4, 3, 40, torch.bfloat16)
    xs = [torch.randn(3, 40).bfloat16() for _ in range(4)]
    residual, weight = torch.randn(3, 40).bfloat16(), torch.randn(40).bfloat16()
    outs = _fused(wss, xs, residual, weight, algorithm)
    for normed, new_residual in outs[1:]:
        assert torch.equal(normed, outs[0][0]) and torch.equal(new_residual, outs[0][1])


def test_one_shot_and_two_shot_fused_outputs_are_bit_identical():
    wss = _workspaces(3, 2, 45, torch.bfloat16)
    xs = [torch.randn(2, 45).bfloat16() for _ in range(3)]
    residual, weight = torch.randn(2, 45).bfloat16(), torch.randn(45).bfloat16()
    one = _fused(wss, xs, residual, weight, "one_shot")[0]
    two = _fused(wss, xs, residual, weight, "two_shot")[0]
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_fp8_output_is_the_scaled_norm_rounded_to_e4m3(algorithm):
    wss = _workspaces(2, 3, 40, torch.bfloat16)
    xs = [torch.randn(3, 40).bfloat16() for _ in range(2)]
    residual, weight = torch.randn(3, 40).bfloat16(), torch.randn(40).bfloat16()
    weight[0], weight[1] = 1e3, 1e-4  # column 0 saturates at +-448, column 1 lands in e4m3 subnormals
    residual[:, 0] = 8.0  # keeps column 0 of the sum far from 0, so it saturates on every draw
    scale = torch.tensor([0.01])
    normed64, residual64 = fused64(xs, residual, weight, EPS)
    expected = (normed64 / 0.01).clamp(-FP8_MAX, FP8_MAX)
    for q, new_residual in _fused(wss, xs, residual, weight, algorithm, fp8_scale=scale):
        assert q.dtype == torch.float8_e4m3fn
        assert_close_to(new_residual, residual64)
        # e4m3 keeps 3 mantissa bits: round-to-nearest is within 1/16 of the value (the bf16 residual
        # rounding adds a little); subnormals are multiples of 2^-9
        assert ((q.double() - expected).abs() <= 0.07 * expected.abs() + 2.0**-9).all()
        assert (q[:, 0].double().abs() == FP8_MAX).all()


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
@pytest.mark.parametrize("hidden,group", [(40, 40), (200, 128)])
def test_fp8_rows_are_the_plain_epilogue_quantized_a_scale_a_row_or_group(algorithm, hidden, group):
    """The FP8-rows epilogue (kernels/fp8_rows.py) gives, on every rank, the bits of the plain fused
    output quantized as the W8A8 product would: a scale a row, or a 128-column group (scales of 1 for
    a row of zeros, whose zeros keep their sign)."""
    from tpfuse.kernels.quant_fp8_w8a8 import quantize_fp8_rows_ref

    rows = 5  # more rows than the 4 programs
    wss = _workspaces(2, rows, hidden, torch.bfloat16)
    xs = [torch.randn(rows, hidden).bfloat16() for _ in range(2)]
    residual, weight = torch.randn(rows, hidden).bfloat16(), torch.randn(hidden).bfloat16()
    for x in xs:
        x[2] = 0
    residual[2] = 0
    plain = _fused(wss, xs, residual, weight, algorithm)
    quantized = fused_in_phases(wss, xs, residual, weight, algorithm, fp8_group=group)
    for (fp8, new_residual), (normed, plain_residual) in zip(quantized, plain, strict=True):
        data, scales = quantize_fp8_rows_ref(normed, group)
        assert torch.equal(new_residual, plain_residual) and torch.equal(fp8.scales, scales)
        assert torch.equal(fp8.data.view(torch.uint8), data.view(torch.uint8))
        assert (fp8.scales[2] == 1.0).all() and fp8.dtype == torch.bfloat16


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
@pytest.mark.parametrize("world_size,hidden", [(2, 64), (3, 160)])
def test_half2x_is_the_plain_epilogue_as_the_int4_gemvs_operands(algorithm, world_size, hidden):
    """The Half2X epilogue (kernels/quant_int_half2.py) gives, on every rank, half2_x of the plain
    fused output's row, bit for bit (the vector sums to float32 rounding), and the same residual."""
    from tpfuse.kernels.quant_int_half2 import half2_x

    wss = _workspaces(world_size, 2, hidden, torch.bfloat16)  # room for the refused two rows below
    xs = [torch.randn(1, hidden).bfloat16() for _ in range(world_size)]
    residual, weight = torch.randn(1, hidden).bfloat16(), torch.randn(hidden).bfloat16()
    xs[0][0, :32] = 0
    residual[0, :32] = 0  # a vector of zeros
    plain = _fused(wss, xs, residual, weight, algorithm)
    made = fused_in_phases(wss, xs, residual, weight, algorithm, half2x=True)
    for (operands, new_residual), (normed, plain_residual) in zip(made, plain, strict=True):
        expected = half2_x(normed)
        assert torch.equal(new_residual, plain_residual)
        assert torch.equal(operands.pairs, expected.pairs) and torch.equal(operands.inv_m, expected.inv_m)
        assert torch.allclose(operands.sums, expected.sums, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one bf16 / fp16 row"):
        launch.fused_add_rmsnorm(wss[0], torch.randn(2, hidden).bfloat16(), torch.randn(2, hidden).bfloat16(),
                                 weight, EPS, algorithm, half2x=True)  # fmt: skip


def test_rows_beyond_the_program_count_are_each_reduced_once():
    wss = _workspaces(2, 7, 16, torch.float32, max_programs=3)
    xs = [torch.randn(7, 16) for _ in range(2)]
    for out in _all_reduce(wss, xs, "one_shot"):
        assert_close_to(out, sum64(xs))


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_back_to_back_calls_alternate_buffers_and_stay_correct(algorithm):
    wss = _workspaces(2, 2, 24)
    for call in range(3):
        xs = [torch.randn(2, 24) for _ in range(2)]
        for out in _all_reduce(wss, xs, algorithm):
            assert_close_to(out, sum64(xs))
        assert [int(ws.words[0]) for ws in wss] == [call + 1] * 2, "the epoch advances once per launch"


def _all_gather(wss, xs, dim):
    shape = launch.gathered_shape(xs[0].shape, len(wss), dim)
    outs = [poisoned(shape, xs[0].dtype) for _ in wss]
    run_ranks_in_phases(
        lambda r, ph: launch.all_gather(wss[r], xs[r], out=outs[r], dim=dim, phases=ph), len(wss)
    )
    return outs


@pytest.mark.parametrize("dim", [0, -1])
@pytest.mark.parametrize(
    ("world_size", "rows", "hidden", "dtype"),
    [(2, 3, 37, torch.float32), (3, 5, 13, torch.bfloat16), (4, 1, 70, torch.float16)],
)
def test_all_gather_writes_the_concatenation_along_dim_in_rank_order(world_size, rows, hidden, dtype, dim):
    wss = _workspaces(world_size, rows, hidden, dtype)
    xs = [torch.randn(rows, hidden).to(dtype) for _ in range(world_size)]
    for out in _all_gather(wss, xs, dim):
        assert torch.equal(out, torch.cat(xs, dim=dim))


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_all_gather_of_a_3d_tensor_concatenates_along_any_dim(dim):
    wss = _workspaces(3, 2 * 3, 5)
    xs = [torch.randn(2, 3, 5) for _ in range(3)]
    for out in _all_gather(wss, xs, dim):
        assert torch.equal(out, torch.cat(xs, dim=dim))


def test_all_gather_of_a_vector_concatenates_it():
    wss = _workspaces(2, 1, 11)
    xs = [torch.randn(11) for _ in range(2)]
    for out in _all_gather(wss, xs, 0):
        assert torch.equal(out, torch.cat(xs))


@pytest.mark.parametrize("dim", [0, -1])
def test_all_gather_rows_beyond_the_program_count_each_land_in_their_place(dim):
    wss = _workspaces(2, 7, 9, max_programs=3)
    xs = [torch.randn(7, 9) for _ in range(2)]
    for out in _all_gather(wss, xs, dim):
        assert torch.equal(out, torch.cat(xs, dim=dim))


def test_all_gather_refuses_an_out_of_the_wrong_shape():
    wss = _workspaces(2, 2, 8)
    with pytest.raises(ValueError, match=r"must be a contiguous \(2, 16\)"):
        launch.all_gather(wss[0], torch.randn(2, 8), out=torch.empty(4, 8), dim=-1)


def test_communicator_all_gather_concatenates_along_dim_in_rank_order():
    # the interpreter runs one rank at a time: the peers push first, rank 0 then runs its whole call
    wss = _workspaces(3, 4, 6)
    comm = CustomCommunicator(wss[0], unmeasured_plan("none", 3, 24, 4, "test"), None)
    xs = [torch.randn(4, 6) for _ in range(3)]
    for dim in (0, -1):
        peer_outs = [torch.empty(launch.gathered_shape(xs[0].shape, 3, dim)) for _ in range(3)]
        run_ranks_in_phases(
            lambda r, ph: launch.all_gather(wss[r], xs[r], out=peer_outs[r], dim=dim, phases=ph),  # noqa: B023
            3,
            phases=(PHASE_PUSH.value,),
            ranks=(1, 2),
        )
        out = comm.all_gather(xs[0], dim=dim)
        run_ranks_in_phases(
            lambda r, ph: launch.all_gather(wss[r], xs[r], out=peer_outs[r], dim=dim, phases=ph),  # noqa: B023
            3,
            phases=(PHASE_FINISH.value,),
            ranks=(1, 2),
        )
        assert torch.equal(out, torch.cat(xs, dim=dim))
    comm.check()


def test_a_peer_that_never_pushes_is_named_in_the_error_word_and_check_raises():
    wss = _workspaces(3, 2, 16)
    xs = [torch.randn(2, 16) for _ in range(3)]
    for rank in (0, 1):  # rank 2 has "crashed": it never pushes
        launch.all_reduce(wss[rank], xs[rank], "one_shot", phases=PHASE_PUSH.value)
    launch.all_reduce(wss[0], xs[0], "one_shot", phases=PHASE_FINISH.value)
    assert wss[0].error_mask() == 1 << 2
    with pytest.raises(RuntimeError, match="rank 2 never arrived"):
        wss[0].check()


def test_check_passes_after_a_complete_call():
    wss = _workspaces(2, 1, 8)
    _all_reduce(wss, [torch.randn(1, 8) for _ in range(2)], "two_shot")
    for ws in wss:
        ws.check()


def test_a_message_larger_than_the_workspace_slot_is_refused():
    wss = _workspaces(2, 2, 8)
    with pytest.raises(ValueError, match="exceeds the peer workspace slot"):
        launch.all_reduce(wss[0], torch.randn(64, 64), "one_shot")
