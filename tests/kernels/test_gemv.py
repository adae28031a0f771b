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


def float64_reference(x, w):
    """(exact x @ w.T in float64, allowed |error| per output) for x [M, K] and w [N, K].

    Allowed: one rounding to the output dtype (eps * |exact|) plus the fp32 accumulation error.
    Tensor cores accumulate by truncation, so that error drifts one way and grows with K: near an
    exact 0 it exceeds a fixed 1e-4 slack (~1e-3 at K = 14336 with 8 splits, emulated). The allowance
    sqrt(K) * 2^-24 * sum_k |x_k w_k| is Higham & Mary's probabilistic bound; at K = 14336 the
    emulated error reaches 2% of it with 8 splits, 15% truncating after each 16-wide tensor-core
    step, 90% truncating after every single add. A lost, stale or doubled K tile is off by about
    the tile's own sum (~sqrt(tile) for unit normal data), far above it: still caught."""
    expected = x.double() @ w.double().T
    accumulation = x.shape[1] ** 0.5 * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    rounding = torch.finfo(x.dtype).eps * (expected.abs() + torch.finfo(x.dtype).tiny)  # tiny: subnormals
    return expected, rounding + accumulation


def assert_matches_float64_within_rounding(actual, x, w, reference=None):
    """actual [M, N] against float64_reference(x, w) (or the one given); names the worst output."""
    expected, allowed = reference if reference is not None else float64_reference(x, w)
    assert torch.isfinite(actual).all(), "unwritten output or a read past K"
    error = (actual.double() - expected).abs()
    excess = error - allowed
    worst = int(excess.argmax())
    row, col = divmod(worst, expected.shape[1])
    assert (excess <= 0).all(), (
        f"{int((excess > 0).sum())} of {excess.numel()} outputs off; worst [{row}, {col}]: "
        f"got {actual[row, col].item()}, exact {expected[row, col].item()}, "
        f"error {error[row, col].item():.3g} > allowed {allowed[row, col].item():.3g}"
    )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_rows", [1, 3, 8])
@pytest.mark.parametrize("num_cols", [1, 37, 96])
@pytest.mark.parametrize("hidden", [16, 40, 200])
def test_gemv_matches_float64_reference_at_odd_sizes(hidden, num_cols, num_rows, dtype, path):
    x, w = _case(num_rows, num_cols, hidden, dtype, seed=hidden * num_cols + num_rows)
    out = _launch(x, w, _poisoned_out(num_rows, num_cols, dtype), path, split_k=3)
    assert_matches_float64_within_rounding(out, x, w)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("split_k", [1, 2, 3, 5, 13])
def test_every_split_count_matches_float64_reference(split_k, path):
    x, w = _case(3, 37, 200, torch.bfloat16, seed=split_k)
    out = _launch(x, w, _poisoned_out(3, 37, torch.bfloat16), path, split_k)
    assert_matches_float64_within_rounding(out, x, w)


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
    assert_matches_float64_within_rounding(out, x2, w2)


def test_sixteen_rows_take_the_dot_path_correctly():
    x, w = _case(16, 37, 40, torch.bfloat16, seed=5)
    assert_matches_float64_within_rounding(_launch(x, w, None, "dot", split_k=2), x, w)


def test_gemv_triton_writes_the_given_out_and_agrees_with_the_reference():
    x, w = _case(3, 37, 200, torch.bfloat16, seed=9)
    out = _poisoned_out(3, 37, torch.bfloat16)
    assert gemv_triton(x, w, out) is out
    assert_matches_float64_within_rounding(out, x, w)
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


def test_float64_check_catches_one_lost_k_tile_at_decode_sizes():
    # The allowance grows with K; it must stay far below what a lost, stale or doubled tile does.
    x, w = _case(16, 64, 4096, torch.bfloat16, seed=13)
    exact = (x.double() @ w.double().T).to(torch.bfloat16)
    assert_matches_float64_within_rounding(exact, x, w)
    tile = slice(1024, 1152)
    lost_tile = exact.double() - x[:, tile].double() @ w[:, tile].double().T
    with pytest.raises(AssertionError, match="outputs off"):
        assert_matches_float64_within_rounding(lost_tile.to(torch.bfloat16), x, w)


def _fill_random_(tensors, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for t in tensors:
        t.copy_(torch.randn(t.shape, device="cuda", generator=gen))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("num_rows", [1, 4, 8, 16])
@pytest.mark.parametrize("num_cols,hidden", [(6144, 4096), (4096, 4096), (4096, 14336), (1000, 4000)])
def test_gemv_on_gpu_matches_float64_and_replays_in_a_graph_bit_identically(
    num_cols, hidden, num_rows, dtype
):
    # Three input sets through the same x, w, outputs, partials (the allocator's reused block for
    # eager calls, the graph's own for replays) and counters: a partial read before its store was
    # visible would be the previous set's, off by a whole split.
    x = torch.empty(num_rows, hidden, device="cuda", dtype=dtype)
    w = torch.empty(num_cols, hidden, device="cuda", dtype=dtype)
    eager = torch.empty(num_rows, num_cols, device="cuda", dtype=dtype)
    replayed = torch.empty_like(eager)
    graph = None
    for input_set in range(3):
        _fill_random_((x, w), seed=1000 * input_set + num_rows)
        eager.fill_(float("nan"))
        gemv_triton(x, w, eager)
        assert_matches_float64_within_rounding(eager, x, w)
        if graph is None:
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                gemv_triton(x, w, replayed)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                gemv_triton(x, w, replayed)
        for _ in range(2):
            replayed.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(replayed, eager)
    assert not gemv._column_counters(x.device, 1).any()


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["sum", "dot"])
def test_back_to_back_split_launches_never_sum_another_launchs_partials(path):
    # 16 splits of the down projection's K and many column blocks, 40 launches with no sync,
    # alternating two input sets: every launch reuses the last one's partial buffer, so a partial
    # read before its store became visible would belong to the other input set.
    use_dot, block_n = (True, 64) if path == "dot" else (False, 16)
    num_rows, num_cols, hidden = (16 if use_dot else 2), 4096, 14336
    inputs = []
    for input_set in range(2):
        x = torch.empty(num_rows, hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(num_cols, hidden, device="cuda", dtype=torch.bfloat16)
        _fill_random_((x, w), seed=77 + input_set)
        inputs.append((x, w, float64_reference(x, w)))
    outs = [torch.full((num_rows, num_cols), float("nan"), device="cuda", dtype=torch.bfloat16)
            for _ in range(40)]  # fmt: skip
    for i, out in enumerate(outs):
        x, w, _ = inputs[i % 2]
        gemv_launch(x, w, out, split_k=16, block_n=block_n, block_k=128, use_dot=use_dot, num_stages=3)
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        x, w, reference = inputs[i % 2]
        assert_matches_float64_within_rounding(out, x, w, reference)
    assert not gemv._column_counters(outs[0].device, 1).any()


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
    assert checked and all(row["bit_identical"] and row["err_of_allowed"] <= 1.0 for row in checked)
