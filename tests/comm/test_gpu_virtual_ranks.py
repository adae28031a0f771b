"""Virtual ranks on one GPU: N ranks on N streams of one process, running concurrently with real spins.

Against float64 references on fresh random inputs with poisoned outputs; bit-identical across ranks;
10,000 back-to-back calls; a CUDA graph replayed 1,000 times; a crashed peer times out with its name.
"""

from __future__ import annotations

import pytest
import torch

from tests.comm.reference import FP8_MAX, assert_close_to, fused64, poisoned, sum64
from tests.comm.virtual_ranks import (
    assert_a_missing_peer_is_named,
    calls_on_streams,
    check_fused,
    cuda_randn,
    load_counting_kernels,
    on_streams,
    replays_on_streams,
)
from tpfuse.comm import launch
from tpfuse.comm.hybrid import create_virtual_communicators, programs_per_rank
from tpfuse.comm.workspace import create_virtual_workspaces

pytestmark = pytest.mark.gpu
EPS = 1e-5
DEVICE = "cuda"


def _workspaces(world_size, max_tokens, hidden, timeout_s=10.0):
    # few enough programs per rank that every rank's grid is resident at once (they spin on each other)
    programs = programs_per_rank(torch.device(DEVICE), world_size)
    return create_virtual_workspaces(world_size, DEVICE, max_tokens * hidden * 4, programs, timeout_s)


def _fused(wss, xs, residual, weight, algorithm, fp8_scale=None):
    dtype = torch.float8_e4m3fn if fp8_scale is not None else xs[0].dtype
    outputs = [(poisoned(xs[0].shape, dtype).cuda(), poisoned(xs[0].shape, xs[0].dtype).cuda()) for _ in wss]
    return on_streams(
        len(wss),
        lambda r: launch.fused_add_rmsnorm(
            wss[r], xs[r], residual, weight, EPS, algorithm, fp8_scale=fp8_scale, outputs=outputs[r]
        ),
    )


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("world_size", [2, 4])
def test_fused_matches_float64_and_is_bit_identical_for_1_to_max_tokens(world_size, dtype, algorithm):
    hidden, max_tokens = 4096, 256
    wss = _workspaces(world_size, max_tokens, hidden)
    weight = cuda_randn(hidden, dtype=dtype)
    for tokens in (1, 2, 3, 8, 31, 64, 255, 256):
        xs = [cuda_randn(tokens, hidden, dtype=dtype) for _ in range(world_size)]
        residual = cuda_randn(tokens, hidden, dtype=dtype)
        check_fused(_fused(wss, xs, residual, weight, algorithm), xs, residual, weight)
    for ws in wss:
        ws.check()


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
@pytest.mark.parametrize("hidden", [127, 4097, 5120, 7168, 8192])
@pytest.mark.parametrize("world_size", [2, 4])
def test_fused_is_correct_at_odd_and_model_hidden_sizes(world_size, hidden, algorithm):
    wss = _workspaces(world_size, 64, hidden)
    weight = cuda_randn(hidden, dtype=torch.bfloat16)
    for tokens in (1, 5, 64):
        xs = [cuda_randn(tokens, hidden, dtype=torch.bfloat16) for _ in range(world_size)]
        residual = cuda_randn(tokens, hidden, dtype=torch.bfloat16)
        check_fused(_fused(wss, xs, residual, weight, algorithm), xs, residual, weight)


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_all_reduce_matches_float64_reference(world_size, algorithm):
    wss = _workspaces(world_size, 128, 4096)
    for tokens in (1, 7, 128):
        xs = [cuda_randn(tokens, 4096, dtype=torch.bfloat16) for _ in range(world_size)]
        outs = [poisoned(xs[0].shape, torch.bfloat16).cuda() for _ in wss]
        on_streams(world_size, lambda r: launch.all_reduce(wss[r], xs[r], algorithm, out=outs[r]))  # noqa: B023
        for out in outs:
            assert_close_to(out, sum64(xs))
            assert torch.equal(out, outs[0])


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_fp8_output_is_the_scaled_norm_rounded_to_e4m3(algorithm):
    wss = _workspaces(2, 16, 4096)
    xs = [cuda_randn(16, 4096, dtype=torch.bfloat16) for _ in range(2)]
    residual, weight = cuda_randn(16, 4096, dtype=torch.bfloat16), cuda_randn(4096, dtype=torch.bfloat16)
    scale = torch.tensor([0.02], device=DEVICE)
    normed64, residual64 = fused64(xs, residual, weight, EPS)
    expected = (normed64 / 0.02).clamp(-FP8_MAX, FP8_MAX)
    for q, new_residual in _fused(wss, xs, residual, weight, algorithm, fp8_scale=scale):
        assert q.dtype == torch.float8_e4m3fn
        assert_close_to(new_residual, residual64)
        assert ((q.double() - expected).abs() <= 0.07 * expected.abs() + 2.0**-9).all()


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
@pytest.mark.parametrize("group", [4096, 128])
def test_fp8_rows_are_the_plain_output_quantized_a_scale_a_row_or_group(algorithm, group):
    """The FP8-rows epilogue with concurrent ranks: on every rank, the bits of the plain fused output
    quantized by quantize_fp8_rows_triton (what the W8A8 product would do with it)."""
    from tpfuse.kernels.quant_fp8_w8a8 import quantize_fp8_rows_triton

    wss = _workspaces(2, 64, 4096)
    xs = [cuda_randn(64, 4096, dtype=torch.bfloat16) for _ in range(2)]
    residual, weight = cuda_randn(64, 4096, dtype=torch.bfloat16), cuda_randn(4096, dtype=torch.bfloat16)
    plain = _fused(wss, xs, residual, weight, algorithm)
    rows = on_streams(
        2,
        lambda r: launch.fused_add_rmsnorm(wss[r], xs[r], residual, weight, EPS, algorithm, fp8_group=group),
    )
    for (fp8, new_residual), (normed, plain_residual) in zip(rows, plain, strict=True):
        data, scales = quantize_fp8_rows_triton(normed, group)
        assert torch.equal(new_residual, plain_residual) and torch.equal(fp8.scales, scales)
        assert torch.equal(fp8.data.view(torch.uint8), data.view(torch.uint8))


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_half2x_is_the_plain_output_as_the_int4_gemvs_operands(algorithm):
    """The Half2X epilogue with concurrent ranks: on every rank, half2_x of the plain fused output's row
    (the f16x2 INT4 GEMV's operands), bit for bit."""
    from tpfuse.kernels.quant_int_half2 import half2_x

    wss = _workspaces(2, 1, 4096)
    xs = [cuda_randn(1, 4096, dtype=torch.bfloat16) for _ in range(2)]
    residual, weight = cuda_randn(1, 4096, dtype=torch.bfloat16), cuda_randn(4096, dtype=torch.bfloat16)
    plain = _fused(wss, xs, residual, weight, algorithm)
    made = on_streams(
        2, lambda r: launch.fused_add_rmsnorm(wss[r], xs[r], residual, weight, EPS, algorithm, half2x=True)
    )
    for (operands, new_residual), (normed, plain_residual) in zip(made, plain, strict=True):
        expected = half2_x(normed)
        assert torch.equal(new_residual, plain_residual)
        assert torch.equal(operands.pairs, expected.pairs) and torch.equal(operands.inv_m, expected.inv_m)


def test_all_gather_through_the_communicator_concatenates_in_rank_order():
    comms = create_virtual_communicators(4, DEVICE, 8, 1000, torch.float32)
    xs = [torch.randn(3, 250, device=DEVICE) for _ in range(4)]
    outs = on_streams(4, lambda r: comms[r].all_gather(xs[r], dim=-1))
    for out in outs:
        assert torch.equal(out, torch.cat(xs, dim=-1))


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_gather_along_dim_0_at_odd_sizes_is_in_rank_order(world_size):
    comms = create_virtual_communicators(world_size, DEVICE, 8, 1001, torch.bfloat16)
    for rows in (1, 5):
        xs = [cuda_randn(rows, 1001, dtype=torch.bfloat16) for _ in range(world_size)]
        outs = on_streams(world_size, lambda r: comms[r].all_gather(xs[r], dim=0))  # noqa: B023
        for out in outs:
            assert torch.equal(out, torch.cat(xs, dim=0))
    for comm in comms:
        comm.check()


def _expected_sets(comms, sets, residual, weight):
    """Each input set's outputs, checked against float64 once; later calls must reproduce them exactly."""
    expected = []
    for xs in sets:
        outs = on_streams(
            len(comms), lambda r, xs=xs: comms[r].fused_add_rmsnorm_all_reduce(xs[r], residual, weight, EPS)
        )
        check_fused(outs, xs, residual, weight)
        expected.append(outs[0])
    return expected


@pytest.mark.parametrize("world_size", [2, 4])
def test_ten_thousand_back_to_back_calls_stay_exact(world_size):
    tokens, hidden = 4, 4096
    comms = create_virtual_communicators(world_size, DEVICE, 64, hidden, torch.bfloat16)
    sets = [[cuda_randn(tokens, hidden, dtype=torch.bfloat16) for _ in range(world_size)] for _ in range(4)]
    residual, weight = (
        cuda_randn(tokens, hidden, dtype=torch.bfloat16),
        cuda_randn(hidden, dtype=torch.bfloat16),
    )
    expected = _expected_sets(comms, sets, residual, weight)
    mismatches = torch.zeros(world_size, dtype=torch.int64, device=DEVICE)
    # load the loop's kernels now: lazy module loading blocks the host while a peer's kernel spins
    load_counting_kernels(mismatches, expected)  # every rank's slice: rank 1's needs its own kernel
    main = torch.cuda.current_stream()
    streams = [torch.cuda.Stream() for _ in range(world_size)]
    for s in streams:
        s.wait_stream(main)
    calls_on_streams(comms, streams, sets, residual, weight, expected, mismatches)
    for comm in comms:
        comm.check()
    assert mismatches.tolist() == [0] * world_size


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_a_captured_graph_replayed_a_thousand_times_stays_exact(world_size, algorithm):
    tokens, hidden = 8, 4096
    wss = _workspaces(world_size, 64, hidden)
    sets = [[cuda_randn(tokens, hidden, dtype=torch.bfloat16) for _ in range(world_size)] for _ in range(4)]
    residual, weight = (
        cuda_randn(tokens, hidden, dtype=torch.bfloat16),
        cuda_randn(hidden, dtype=torch.bfloat16),
    )
    expected = []
    for xs in sets:
        outs = _fused(wss, xs, residual, weight, algorithm)
        check_fused(outs, xs, residual, weight)
        expected.append(outs[0])
    static_x = [sets[0][r].clone() for r in range(world_size)]
    streams = [torch.cuda.Stream() for _ in range(world_size)]
    graphs, graph_outs = [], []
    torch.cuda.synchronize()
    for r in range(world_size):  # capture launches nothing, so ranks are captured one after another
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=streams[r]):
            graph_outs.append(launch.fused_add_rmsnorm(wss[r], static_x[r], residual, weight, EPS, algorithm))
        graphs.append(graph)
    epoch_before = [int(ws.words[0]) for ws in wss]
    mismatches = torch.zeros(world_size, dtype=torch.int64, device=DEVICE)
    # load the loop's kernels now: lazy module loading blocks the host while a peer's kernel spins
    static_x[0].copy_(sets[0][0])
    load_counting_kernels(mismatches, expected)  # every rank's slice: rank 1's needs its own kernel
    torch.cuda.synchronize()  # the rank streams below do not wait for the current stream
    replays_on_streams(graphs, streams, static_x, graph_outs, sets, expected, mismatches)
    for ws in wss:
        ws.check()
    assert mismatches.tolist() == [0] * world_size
    assert [int(ws.words[0]) - e for ws, e in zip(wss, epoch_before, strict=True)] == [1000] * world_size, (
        "every replay advances the device epoch once"
    )


@pytest.mark.parametrize("algorithm", ["one_shot", "two_shot"])
def test_a_peer_that_never_arrives_times_out_and_is_named(algorithm):
    assert_a_missing_peer_is_named(_workspaces(3, 4, 256, timeout_s=0.5), algorithm)
