"""The Communicator on CPU ranks over gloo (2 and 4 processes) against float64 references."""

from __future__ import annotations

import pytest
import torch

from tests.comm.reference import FP8_MAX, assert_close_to, fused64, sum64
from tests.helpers.dist import free_port, from_bytes, run_distributed, to_bytes
from tpfuse.kernels.rmsnorm import fused_add_rmsnorm_ref

ROWS, HIDDEN, EPS = 3, 37, 1e-5


def _inputs(world_size, dtype):
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(ROWS, HIDDEN, generator=g).to(dtype) for _ in range(world_size)]
    residual = torch.randn(ROWS, HIDDEN, generator=g).to(dtype)
    weight = torch.randn(HIDDEN, generator=g).to(dtype)
    return xs, residual, weight


def _run_collectives(rank, world_size):
    from tpfuse.comm.communicator import GlooCpuCopyCommunicator
    from tpfuse.comm.factory import create_communicator

    comm = create_communicator(device="cpu", mode="auto", max_tokens=ROWS, hidden_size=HIDDEN)
    out = {"type": type(comm).__name__, "rank": comm.rank, "world_size": comm.world_size}
    for dtype in (torch.float32, torch.bfloat16):
        xs, residual, weight = _inputs(world_size, dtype)
        x = xs[rank]
        out[f"all_reduce_{dtype}"] = comm.all_reduce(x)
        out[f"fused_{dtype}"] = comm.fused_add_rmsnorm_all_reduce(x, residual, weight, EPS)
        out[f"unchanged_{dtype}"] = torch.equal(x, xs[rank])
    xs, residual, weight = _inputs(world_size, torch.bfloat16)
    out["fp8"] = comm.fused_add_rmsnorm_all_reduce_fp8(xs[rank], residual, weight, EPS, torch.tensor([0.05]))
    rows, rows_residual = comm.fused_add_rmsnorm_all_reduce_fp8_rows(xs[rank], residual, weight, EPS, HIDDEN)
    out["fp8_rows"] = (rows.data, rows.scales, rows.dtype, rows_residual)
    out["gather_last"] = comm.all_gather(xs[rank], dim=-1)
    out["gather_first"] = comm.all_gather(xs[rank], dim=0)
    out["cpu_copy_all_reduce"] = GlooCpuCopyCommunicator().all_reduce(xs[rank])
    try:
        create_communicator(device="cpu", mode="fused")
        out["fused_refusal"] = None
    except ValueError as exc:
        out["fused_refusal"] = str(exc)
    return to_bytes(out)


@pytest.fixture(scope="module", params=[2, 4], ids=["tp2", "tp4"])
def gloo_run(request):
    world_size = request.param
    return world_size, from_bytes(run_distributed(_run_collectives, world_size))


def test_create_communicator_on_cpu_gives_the_gloo_communicator(gloo_run):
    world_size, results = gloo_run
    assert [(r["type"], r["rank"], r["world_size"]) for r in results] == [
        ("TorchDistributedCommunicator", rank, world_size) for rank in range(world_size)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_reduce_matches_float64_sum_and_leaves_input_unchanged(gloo_run, dtype):
    world_size, results = gloo_run
    xs, _, _ = _inputs(world_size, dtype)
    for r in results:
        # gloo sums in the activation dtype, pairwise: allow one rounding per rank
        assert_close_to(r[f"all_reduce_{dtype}"], sum64(xs), ulps=world_size)
        assert r[f"unchanged_{dtype}"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_float64_reference(gloo_run, dtype):
    world_size, results = gloo_run
    xs, residual, weight = _inputs(world_size, dtype)
    normed64, residual64 = fused64(xs, residual, weight, EPS)
    for r in results:
        normed, new_residual = r[f"fused_{dtype}"]
        assert_close_to(new_residual, residual64, ulps=world_size + 1)
        assert_close_to(normed, normed64, ulps=world_size + 2)


def test_fused_epilogue_follows_the_kernels_rmsnorm_numerics(gloo_run):
    _, results = gloo_run
    for r in results:
        normed, new_residual = r[f"fused_{torch.bfloat16}"]
        world_size = r["world_size"]
        xs, residual, weight = _inputs(world_size, torch.bfloat16)
        expected = fused_add_rmsnorm_ref(r[f"all_reduce_{torch.bfloat16}"], residual, weight, EPS)
        assert torch.equal(normed, expected[0]) and torch.equal(new_residual, expected[1])


def test_every_rank_gets_bit_identical_fused_outputs(gloo_run):
    _, results = gloo_run
    for r in results[1:]:
        for a, b in zip(r[f"fused_{torch.bfloat16}"], results[0][f"fused_{torch.bfloat16}"], strict=True):
            assert torch.equal(a, b)


def test_fp8_fused_output_is_the_scaled_norm_of_the_new_residual_in_e4m3(gloo_run):
    world_size, results = gloo_run
    _, _, weight = _inputs(world_size, torch.bfloat16)
    for r in results:
        q, new_residual = r["fp8"]
        normed64, _ = fused64([new_residual], torch.zeros_like(new_residual), weight, EPS)
        expected = (normed64 / 0.05).clamp(-FP8_MAX, FP8_MAX)
        assert q.dtype == torch.float8_e4m3fn
        assert ((q.double() - expected).abs() <= 0.07 * expected.abs() + 2.0**-9).all()


def test_fp8_rows_are_the_fused_output_quantized_per_row(gloo_run):
    """The normed rows as FP8 rows (kernels/fp8_rows.py): the bits of the plain fused output quantized
    one scale a row, as the W8A8 product would quantize it, with the same new residual."""
    from tpfuse.kernels.quant_fp8_w8a8 import quantize_fp8_rows_ref

    _, results = gloo_run
    for r in results:
        data, scales, dtype, new_residual = r["fp8_rows"]
        normed, plain_residual = r[f"fused_{torch.bfloat16}"]
        expected_data, expected_scales = quantize_fp8_rows_ref(normed, HIDDEN)
        assert dtype == torch.bfloat16 and torch.equal(new_residual, plain_residual)
        assert torch.equal(data.view(torch.uint8), expected_data.view(torch.uint8))
        assert torch.equal(scales, expected_scales)


def test_all_gather_concatenates_in_rank_order_along_dim(gloo_run):
    world_size, results = gloo_run
    xs, _, _ = _inputs(world_size, torch.bfloat16)
    for r in results:
        assert torch.equal(r["gather_last"], torch.cat(xs, dim=-1))
        assert torch.equal(r["gather_first"], torch.cat(xs, dim=0))


def test_cpu_copy_fallback_sums_in_float32_and_returns_the_input_dtype(gloo_run):
    world_size, results = gloo_run
    xs, _, _ = _inputs(world_size, torch.bfloat16)
    expected = sum(x.float() for x in xs).bfloat16()
    for r in results:
        assert torch.equal(r["cpu_copy_all_reduce"], expected)


def test_world_size_one_gives_the_identity_communicator():
    import torch.distributed as dist

    from tpfuse.comm.factory import create_communicator

    group = dist.new_group(backend="gloo") if dist.is_initialized() else None
    if group is None:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        comm = create_communicator(group, device="cpu")
        x = torch.randn(2, 5)
        assert type(comm).__name__ == "SingleRankCommunicator" and comm.all_reduce(x) is x
    finally:
        if group is None:
            dist.destroy_process_group()


def test_forcing_fused_on_cpu_is_refused_with_the_fix(gloo_run):
    _, results = gloo_run
    assert all(r["fused_refusal"] and "use auto" in r["fused_refusal"] for r in results)
