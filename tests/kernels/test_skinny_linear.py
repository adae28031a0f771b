"""Few-row linear (kernels/skinny_linear.py): float64 parity at odd row counts and sizes, both product
forms, masked and unmasked tiles, strided rows, bit-identical repeats, clear errors, and on the GPU
the decode shapes replayed in a graph.

On CPU the kernel runs under TRITON_INTERPRET=1, whose tl.dot computes bf16 operands wrongly
(triton 3.9: a plain 16x16 bf16 tl.dot is off by ~1e10 there, fp16 exact), so the CPU cases use
fp16 and bf16 is checked on the GPU, where the model runs it."""

import dataclasses

import pytest
import torch

from tests.kernels.float64_linear import (
    assert_eager_and_graph_replay_match_float64,
    assert_matches_float64_within_rounding,
)
from tpfuse.kernels.skinny_linear import MAX_ROWS, Tile, row_bucket, skinny_linear_ref, skinny_linear_triton

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.bfloat16, torch.float16] if ON_GPU else [torch.float16]
TILES = {  # small enough to leave ragged edges at the sizes below; 16x32 divides 32 x 64 (EVEN)
    "n16k32": Tile(block_n=16, block_k=32, num_stages=2),
    "n32k16-swap": Tile(block_n=32, block_k=16, num_stages=3, swap=True),
    "n16k16-split3": Tile(block_n=16, block_k=16, num_stages=2, split_k=3),  # 200 = 64 + 64 + 72 (ragged)
    "n32k32-swap-split2": Tile(block_n=32, block_k=32, num_stages=2, swap=True, split_k=2),  # 64 = 32 + 32
}


def _case(rows, num_cols, hidden, dtype, seed, with_bias=False, pad=3):
    """x [M, K] and weight [N, K], each a view of NaN-padded rows (a read past K poisons the
    result), and bias."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.full((rows, hidden + pad), float("nan"), dtype=dtype)
    x[:, :hidden] = torch.randn(rows, hidden, generator=gen).to(dtype)
    w = torch.full((num_cols, hidden + pad), float("nan"), dtype=dtype)
    w[:, :hidden] = torch.randn(num_cols, hidden, generator=gen).to(dtype)
    bias = torch.randn(num_cols, generator=gen).to(dtype) if with_bias else None
    to = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return to(x)[:, :hidden], to(w)[:, :hidden], to(bias)


def _poisoned_out(rows, num_cols, dtype):
    return torch.full((rows, num_cols), float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("num_cols,hidden", [(37, 40), (32, 64), (8, 200)])
@pytest.mark.parametrize("rows", [2, 5, 16, 17, 33])
def test_skinny_linear_matches_float64_reference_at_odd_sizes(rows, num_cols, hidden, with_bias, dtype, tile):
    seed = rows * num_cols + hidden + with_bias
    x, w, bias = _case(rows, num_cols, hidden, dtype, seed=seed, with_bias=with_bias)
    tile = TILES[tile]
    tile = dataclasses.replace(tile, block_m=row_bucket(rows))
    out = _poisoned_out(rows, num_cols, dtype)
    assert skinny_linear_triton(x, w, bias, out, tile=tile) is out
    assert_matches_float64_within_rounding(out, x, w, bias)


def test_default_tile_takes_the_row_bucket_and_writes_into_a_strided_output():
    # out is every other row of a taller poisoned buffer; the rows between stay untouched.
    x, w, bias = _case(3, 37, 40, DTYPES[-1], seed=5, with_bias=True)
    buffer = _poisoned_out(6, 37, x.dtype)
    out = skinny_linear_triton(x, w, bias, buffer[::2])
    assert out.data_ptr() == buffer.data_ptr()
    assert_matches_float64_within_rounding(out, x, w, bias)
    assert buffer[1::2].isnan().all()


@pytest.mark.parametrize("tile", ["n16k32", "n16k16-split3"])
def test_the_reference_rounds_once_and_repeated_calls_are_bit_identical(tile):
    # Split-K sums its partials in split order, whichever split arrives last.
    x, w, bias = _case(5, 37, 200, DTYPES[-1], seed=11, with_bias=True)
    expected = ((x.float() @ w.float().T) + bias.float()).to(x.dtype)
    assert torch.equal(skinny_linear_ref(x, w, bias), expected)
    first = skinny_linear_triton(x, w, bias, tile=TILES[tile])
    for _ in range(2):
        again = skinny_linear_triton(x, w, bias, _poisoned_out(5, 37, x.dtype), tile=TILES[tile])
        assert torch.equal(again, first)


def test_split_k_leaves_its_arrival_counters_at_zero():
    from tpfuse.kernels.decode_merge import arrival_counters

    x, w, bias = _case(3, 37, 200, DTYPES[-1], seed=12, with_bias=True)
    skinny_linear_triton(x, w, bias, tile=TILES["n16k16-split3"])
    assert int(arrival_counters(x.device, 3)[:3].abs().sum()) == 0


def test_empty_k_gives_the_bias_or_zeros_and_empty_n_gives_empty_rows():
    dtype = DTYPES[-1]
    x = torch.zeros(3, 0, dtype=dtype, device=DEVICE)
    w = torch.zeros(5, 0, dtype=dtype, device=DEVICE)
    bias = torch.arange(5, dtype=dtype, device=DEVICE)
    zeros = torch.zeros(3, 5, dtype=dtype, device=DEVICE)
    assert torch.equal(skinny_linear_triton(x, w, None, _poisoned_out(3, 5, dtype)), zeros)
    assert torch.equal(skinny_linear_triton(x, w, bias, _poisoned_out(3, 5, dtype)), bias.expand(3, 5))
    no_cols = skinny_linear_triton(torch.zeros(2, 8, dtype=dtype), torch.zeros(0, 8, dtype=dtype))
    assert no_cols.shape == (2, 0)


def test_row_buckets_are_the_padded_mma_rows():
    assert [row_bucket(m) for m in (1, 2, 16, 17, 32, 33, 64)] == [16, 16, 16, 32, 32, 64, 64]
    for bad in (0, MAX_ROWS + 1):
        with pytest.raises(ValueError, match="1..64 rows"):
            row_bucket(bad)


def _half(*shape):
    return torch.zeros(*shape, dtype=torch.float16)


@pytest.mark.parametrize(
    "x,w,bias,out,tile,match",
    [
        (_half(65, 16), _half(8, 16), None, None, None, "1..64 rows; got 65: use F.linear"),
        (_half(2, 16), _half(8, 24), None, None, None, "x \\[M, K\\] and weight \\[N, K\\]"),
        (torch.zeros(2, 16), torch.zeros(8, 16), None, None, None, "bf16 or both fp16"),
        (_half(2, 32)[:, ::2], _half(8, 16), None, None, None, "contiguous along K"),
        (_half(2, 16), _half(8, 16), _half(7), None, None, "bias must be \\[8\\]"),
        (_half(2, 16), _half(8, 16), None, _half(2, 7), None, "out must be \\[2, 8\\]"),
        (_half(17, 16), _half(8, 16), None, None, Tile(block_m=16), "block_m=16 is smaller than the 17 rows"),
    ],
)
def test_skinny_linear_rejects_what_it_cannot_compute_with_the_fix(x, w, bias, out, tile, match):
    with pytest.raises(ValueError, match=match):
        skinny_linear_triton(x, w, bias, out, tile=tile)


@pytest.mark.gpu
@pytest.mark.parametrize("swap,split_k", [(False, 1), (True, 1), (False, 4), (True, 2)], ids=str)
@pytest.mark.parametrize("rows", [2, 16, 31, 64])
@pytest.mark.parametrize(
    "num_cols,hidden,with_bias", [(6144, 4096, True), (4096, 14336, False), (1000, 4000, True)]
)
def test_skinny_linear_on_gpu_matches_float64_and_replays_in_a_graph_bit_identically(
    num_cols, hidden, with_bias, rows, swap, split_k
):
    tile = Tile(row_bucket(rows), 64 if swap else 32, 128, 3, 4, swap, split_k)
    assert_eager_and_graph_replay_match_float64(
        lambda x, w, bias, out: skinny_linear_triton(x, w, bias, out, tile=tile),
        rows, num_cols, hidden, with_bias, torch.bfloat16, seed=hidden + rows,
    )  # fmt: skip


def test_skinny_linear_benchmark_runs_end_to_end_at_tiny_shapes(monkeypatch):
    """benchmarks/skinny_linear.py on CPU (timing replaced by one call), so its GPU run is not lost."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks/skinny_linear.py"
    spec = importlib.util.spec_from_file_location("skinny_linear_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    gemv_bench = bench.gemv_bench
    monkeypatch.setattr(gemv_bench, "DEVICE", "cpu")
    monkeypatch.setattr(gemv_bench, "DTYPE", torch.float16)  # bf16 tl.dot is wrong under the interpreter
    monkeypatch.setattr(gemv_bench, "SHAPES", {"qkv": (48, 40)})
    monkeypatch.setattr(gemv_bench, "L2_DEFEAT_BYTES", 1)
    monkeypatch.setattr(gemv_bench, "graph_us", lambda calls, *a: [call() for call in calls] and 1.0)
    rows: list[dict] = []
    tiles = [Tile(16, 16, 32, 2), Tile(16, 32, 16, 2, swap=True, split_k=2)]
    result = bench.bench("qkv", 5, tiles, copy_bw=1.0, rows_out=rows)
    assert result["cublas_us"] == result["best_us"] == 1.0 and result["err_of_allowed"] <= 1.0
    assert [row["impl"] for row in rows][2:] == [tile.label() for tile in tiles]
    assert len(bench.wide_tiles(16)) == 11 and len(bench.wide_tiles(64)) == 15
