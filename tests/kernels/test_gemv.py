"""One-row GEMV (kernels/gemv.py): float64 parity at odd sizes with and without bias, masked and
unmasked tiles, bit-identical repeats, clear errors, and on the GPU the decode shapes in graphs."""

import pytest
import torch

from tests.kernels.float64_linear import (
    assert_eager_and_graph_replay_match_float64,
    assert_matches_float64_within_rounding,
)
from tpfuse.kernels.gemv import gemv_ref, gemv_triton

DTYPES = [torch.bfloat16, torch.float16]
# (block_n, block_k): tiles small enough to leave ragged edges at the sizes below, and one that
# divides 8 x 64 exactly (the unmasked EVEN path).
TILES = {"4x32": (4, 32), "2x64": (2, 64), "8x16": (8, 16)}


def _case(num_cols, hidden, dtype, seed, with_bias=False, pad=3):
    """x [1, K], weight [N, K] a view of NaN-padded rows (a read past K poisons the result), bias."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, hidden, generator=gen).to(dtype)
    w = torch.full((num_cols, hidden + pad), float("nan"), dtype=dtype)
    w[:, :hidden] = torch.randn(num_cols, hidden, generator=gen).to(dtype)
    bias = torch.randn(num_cols, generator=gen).to(dtype) if with_bias else None
    return x, w[:, :hidden], bias


def _poisoned_out(num_cols, dtype, device="cpu"):
    return torch.full((1, num_cols), float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("num_cols", [1, 8, 37])
@pytest.mark.parametrize("hidden", [16, 40, 64, 200])
def test_gemv_matches_float64_reference_at_odd_sizes(hidden, num_cols, with_bias, dtype, tile):
    x, w, bias = _case(num_cols, hidden, dtype, seed=hidden * num_cols + with_bias, with_bias=with_bias)
    block_n, block_k = TILES[tile]
    out = _poisoned_out(num_cols, dtype)
    assert gemv_triton(x, w, bias, out, block_n=block_n, block_k=block_k) is out
    assert_matches_float64_within_rounding(out, x, w, bias)


def test_the_default_tile_caps_k_per_step_at_a_short_k_and_equals_the_reference_rounding():
    x, w, bias = _case(37, 40, torch.bfloat16, seed=9, with_bias=True)
    out = gemv_triton(x, w, bias)  # BLOCK_K 2048 capped to 64 for K = 40
    assert_matches_float64_within_rounding(out, x, w, bias)
    assert torch.equal(gemv_ref(x, w, bias), ((x.float() @ w.float().T) + bias.float()).to(torch.bfloat16))


def test_repeated_calls_are_bit_identical():
    x, w, bias = _case(37, 200, torch.float16, seed=11, with_bias=True)
    first = gemv_triton(x, w, bias, block_n=4, block_k=32)
    for _ in range(2):
        again = gemv_triton(x, w, bias, _poisoned_out(37, torch.float16), block_n=4, block_k=32)
        assert torch.equal(again, first)


def test_empty_k_gives_the_bias_or_zeros_and_empty_n_gives_an_empty_row():
    x = torch.zeros(1, 0, dtype=torch.bfloat16)
    w = torch.zeros(5, 0, dtype=torch.bfloat16)
    bias = torch.arange(5, dtype=torch.bfloat16)
    assert torch.equal(
        gemv_triton(x, w, None, _poisoned_out(5, torch.bfloat16)), torch.zeros(1, 5).bfloat16()
    )
    assert torch.equal(gemv_triton(x, w, bias, _poisoned_out(5, torch.bfloat16)), bias[None])
    assert gemv_triton(torch.zeros(1, 8).bfloat16(), torch.zeros(0, 8).bfloat16()).shape == (1, 0)


def _bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "x,w,bias,match",
    [
        (_bf16(2, 16), _bf16(8, 16), None, "one row; got 2"),
        (_bf16(1, 16), _bf16(8, 24), None, "x \\[1, K\\] and weight \\[N, K\\]"),
        (torch.zeros(1, 16), torch.zeros(8, 16), None, "bf16 or both fp16"),
        (_bf16(1, 32)[:, ::2], _bf16(8, 16), None, "contiguous"),
        (_bf16(1, 16), _bf16(8, 16), _bf16(7), "bias must be \\[8\\]"),
    ],
)
def test_gemv_rejects_what_it_cannot_compute_with_the_fix(x, w, bias, match):
    with pytest.raises(ValueError, match=match):
        gemv_triton(x, w, bias)


def test_float64_check_catches_one_lost_k_tile_at_decode_sizes():
    # The allowance grows with K; it must stay far below what a lost, stale or doubled tile does.
    x, w, _ = _case(64, 4096, torch.bfloat16, seed=13)
    exact = (x.double() @ w.double().T).to(torch.bfloat16)
    assert_matches_float64_within_rounding(exact, x, w)
    tile = slice(1024, 1152)
    lost_tile = exact.double() - x[:, tile].double() @ w[:, tile].double().T
    with pytest.raises(AssertionError, match="outputs off"):
        assert_matches_float64_within_rounding(lost_tile.to(torch.bfloat16), x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "num_cols,hidden,with_bias",
    [
        (6144, 4096, True),
        (4096, 4096, False),
        (4096, 14336, False),
        (1000, 4000, True),
        (128256, 4096, False),
    ],
)
def test_gemv_on_gpu_matches_float64_and_replays_in_a_graph_bit_identically(
    num_cols, hidden, with_bias, dtype
):
    assert_eager_and_graph_replay_match_float64(
        gemv_triton, 1, num_cols, hidden, with_bias, dtype, seed=hidden
    )


def test_gemv_benchmark_runs_end_to_end_at_tiny_shapes(monkeypatch):
    """benchmarks/gemv.py on CPU (timing replaced by one call), so its short GPU run is not lost."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "gemv_benchmark", Path(__file__).parents[2] / "benchmarks/gemv.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "SHAPES", {"qkv": (48, 40)})
    monkeypatch.setattr(bench, "TILES", [(4, 32, 4)])
    monkeypatch.setattr(bench, "L2_DEFEAT_BYTES", 1)
    monkeypatch.setattr(bench, "graph_us", lambda calls, *a: [call() for call in calls] and 1.0)
    result = bench.bench_shape("qkv", copy_bw=1.0, sweep_until=float("inf"))
    assert result == {"cublas_us": 1.0, "gemv_us": 1.0, "best": {"label": "default", "us": 1.0}}
    checked = [row for row in bench.ROWS if "bit_identical" in row]
    assert checked and all(row["bit_identical"] and row["err_of_allowed"] <= 1.0 for row in checked)
    assert any(row["impl"] == "gemv_triton n=4 k=32 w=4" for row in bench.ROWS)
