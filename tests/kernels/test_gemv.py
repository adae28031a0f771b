"""Small-batch GEMV (kernels/gemv.py): float64 parity at odd sizes, deterministic split-K, counters
that reset, the split rule, and the opt-in dispatch."""

import pytest
import torch

import tpfuse.kernels as kernels
from tpfuse.kernels import gemv
from tpfuse.kernels.gemv import gemv_launch, gemv_ref, gemv_triton, split_k_for

DTYPES = [torch.bfloat16, torch.float16]
# (use_dot, block_n, block_k): both inner products at tiles small enough to leave ragged edges.
PATHS = {"sum": (False, 16, 32), "dot": (True, 16, 16)}


def _case(num_rows, num_cols, hidden, dtype, seed, pad=3):
    """x [M, K] and weight [N, K] as views of NaN-padded rows: a read past K poisons the result."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.full((num_rows, hidden + pad), float("nan"), dtype=dtype)
    w = torch.full((num_cols, hidden + pad), float("nan"), dtype=dtype)
    x[:, :hidden] = torch.randn(num_rows, hidden, generator=gen).to(dtype)
    w[:, :hidden] = torch.randn(num_cols, hidden, generator=gen).to(dtype)
    return x[:, :hidden], w[:, :hidden]


def _poisoned_out(num_rows, num_cols, dtype):
    return torch.full((num_rows, num_cols), float("nan"), dtype=dtype)


def _launch(x, w, out, path, split_k):
    use_dot, block_n, block_k = PATHS[path]
    return gemv_launch(x, w, out, split_k=split_k, block_n=block_n, block_k=block_k, use_dot=use_dot)


def assert_within_one_ulp_of_float64(actual, x, w):
    """fp32 accumulation then one rounding: at most one ulp of the dtype from the exact product."""
    expected = x.double() @ w.double().T
    assert torch.isfinite(actual).all(), "unwritten output or a read past K"
    tol = torch.finfo(actual.dtype).eps * expected.abs() + 1e-4
    assert ((actual.double() - expected).abs() <= tol).all(), (actual.double() - expected).abs().max()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_rows", [1, 3, 8])
@pytest.mark.parametrize("num_cols", [1, 37, 96])
@pytest.mark.parametrize("hidden", [16, 40, 200])
def test_gemv_matches_float64_reference_at_odd_sizes(hidden, num_cols, num_rows, dtype, path):
    x, w = _case(num_rows, num_cols, hidden, dtype, seed=hidden * num_cols + num_rows)
    out = _launch(x, w, _poisoned_out(num_rows, num_cols, dtype), path, split_k=3)
    assert_within_one_ulp_of_float64(out, x, w)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("split_k", [1, 2, 3, 5, 13])
def test_every_split_count_matches_float64_reference(split_k, path):
    x, w = _case(3, 37, 200, torch.bfloat16, seed=split_k)
    out = _launch(x, w, _poisoned_out(3, 37, torch.bfloat16), path, split_k)
    assert_within_one_ulp_of_float64(out, x, w)


def test_split_and_unsplit_results_differ_at_most_by_one_rounding():
    # The partial sums associate differently, so bit equality across split counts is not promised;
    # both round the same fp32 value up to fp32 error, so they differ by at most one ulp.
    x, w = _case(8, 96, 200, torch.bfloat16, seed=7)
    unsplit = _launch(x, w, None, "sum", split_k=1).double()
    split = _launch(x, w, None, "sum", split_k=4).double()
    ulp = torch.finfo(torch.bfloat16).eps * torch.maximum(unsplit.abs(), split.abs())
    assert ((unsplit - split).abs() <= ulp + 1e-6).all()


@pytest.mark.parametrize("path", PATHS)
def test_repeated_split_launches_are_bit_identical_and_leave_counters_at_zero(path):
    x, w = _case(3, 96, 200, torch.float16, seed=11)
    first = _launch(x, w, None, path, split_k=4)
    for _ in range(2):
        assert torch.equal(_launch(x, w, _poisoned_out(3, 96, torch.float16), path, split_k=4), first)
    assert not gemv._column_counters(x.device, 1).any()


def test_counters_reset_for_a_following_launch_of_another_shape():
    x, w = _case(1, 96, 200, torch.bfloat16, seed=3)
    _launch(x, w, None, "sum", split_k=5)
    x2, w2 = _case(8, 37, 40, torch.bfloat16, seed=4)
    out = _launch(x2, w2, _poisoned_out(8, 37, torch.bfloat16), "sum", split_k=2)
    assert_within_one_ulp_of_float64(out, x2, w2)


def test_sixteen_rows_take_the_dot_path_correctly():
    x, w = _case(16, 37, 40, torch.bfloat16, seed=5)
    assert_within_one_ulp_of_float64(_launch(x, w, None, "dot", split_k=2), x, w)


def test_gemv_triton_writes_the_given_out_and_agrees_with_the_reference():
    x, w = _case(3, 37, 200, torch.bfloat16, seed=9)
    out = _poisoned_out(3, 37, torch.bfloat16)
    assert gemv_triton(x, w, out) is out
    assert_within_one_ulp_of_float64(out, x, w)
    ref = gemv_ref(x, w)
    assert torch.equal(ref, (x.float() @ w.float().T).to(torch.bfloat16))


def test_split_count_fills_the_gpu_from_shapes_within_its_caps():
    # 132 SMs, 4 programs each: o_proj (4096 columns / 64) gets 8 splits, gate_up needs none.
    assert split_k_for(4096, 4096, 64, 128, 132) == 8
    assert split_k_for(28672, 4096, 64, 128, 132) == 1
    assert split_k_for(16, 4096, 16, 128, 132) == gemv.GEMV_MAX_SPLITS
    assert split_k_for(16, 256, 16, 128, 132) == 2  # never more splits than K tiles


@pytest.mark.parametrize(
    "x_shape,w_shape,dtype,match",
    [
        ((17, 16), (8, 16), torch.bfloat16, "at most 16 rows"),
        ((2, 16), (8, 24), torch.bfloat16, "x \\[M, K\\] and weight \\[N, K\\]"),
        ((2, 16), (8, 16), torch.float32, "bf16 or both fp16"),
    ],
)
def test_gemv_rejects_what_it_cannot_compute_with_the_fix(x_shape, w_shape, dtype, match):
    with pytest.raises(ValueError, match=match):
        gemv_triton(torch.zeros(x_shape, dtype=dtype), torch.zeros(w_shape, dtype=dtype))


def test_linear_small_batch_is_matmul_unless_gemv_is_opted_in(monkeypatch):
    x, w = _case(3, 37, 40, torch.bfloat16, seed=1)
    monkeypatch.delenv("TPFUSE_GEMV", raising=False)
    monkeypatch.setenv("TPFUSE_KERNELS", "triton")
    assert torch.equal(kernels.linear_small_batch(x, w), torch.matmul(x, w.t()))


def test_linear_small_batch_runs_the_triton_gemv_when_opted_in(monkeypatch):
    x, w = _case(3, 37, 40, torch.bfloat16, seed=2)
    monkeypatch.setenv("TPFUSE_GEMV", "triton")
    monkeypatch.setenv("TPFUSE_KERNELS", "triton")
    calls = []
    monkeypatch.setattr(gemv, "gemv_triton", lambda *a: calls.append(a) or gemv_ref(*a))
    kernels.linear_small_batch(x, w)
    assert len(calls) == 1
    kernels.linear_small_batch(torch.zeros(17, 40, dtype=torch.bfloat16), w)  # too many rows: matmul
    assert len(calls) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [1, 4, 8, 16])
@pytest.mark.parametrize("num_cols,hidden", [(6144, 4096), (4096, 4096), (4096, 14336), (1000, 4000)])
def test_gemv_on_gpu_matches_float64_and_replays_in_a_graph_bit_identically(num_rows, num_cols, hidden):
    gen = torch.Generator(device="cuda").manual_seed(num_rows)
    x = torch.randn(num_rows, hidden, device="cuda", generator=gen).bfloat16()
    w = torch.randn(num_cols, hidden, device="cuda", generator=gen).bfloat16()
    eager = gemv_triton(x, w)
    assert_within_one_ulp_of_float64(eager, x, w)
    out = torch.full_like(eager, float("nan"))
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        gemv_triton(x, w, out)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        gemv_triton(x, w, out)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


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
    monkeypatch.setattr(bench, "L2_DEFEAT_BYTES", 1)
    monkeypatch.setattr(bench, "graph_us", lambda calls, *a: [call() for call in calls] and 1.0)
    for rows in (1, 8):
        result = bench.bench_shape("qkv", rows, copy_bw=1.0, num_sms=8, sweep=True)
        assert result["best"]["us"] == 1.0
    checked = [row for row in bench.ROWS if "bit_identical" in row]
    assert checked and all(row["bit_identical"] and row["max_ulps"] <= 1.0 for row in checked)
