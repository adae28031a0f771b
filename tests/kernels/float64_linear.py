"""The float64 check shared by the linear-layer kernel tests (test_gemv.py, test_skinny_linear.py), and
activations that FP8 quantizes exactly (the W8A8 tests under the interpreter)."""

import torch

from tpfuse.kernels.quant_fp8 import FP8_DTYPE


def float64_reference(x, w, bias=None):
    """(exact x @ w.T (+ bias) in float64, allowed |error| per output).

    Allowed: one rounding to the output dtype (eps * |exact|) plus the fp32 accumulation error,
    sqrt(K) * 2^-24 * sum_k |x_k w_k| (Higham & Mary's probabilistic bound). A lost, stale or
    doubled K tile is off by about the tile's own sum (~sqrt(tile) for unit normal data), far above
    it (test_gemv.py: test_float64_check_catches_one_lost_k_tile_at_decode_sizes)."""
    expected = x.double() @ w.double().T
    if bias is not None:
        expected += bias.double()
    accumulation = x.shape[1] ** 0.5 * 2.0**-24 * (x.double().abs() @ w.double().abs().T)
    rounding = torch.finfo(x.dtype).eps * (expected.abs() + torch.finfo(x.dtype).tiny)  # tiny: subnormals
    return expected, rounding + accumulation


def assert_matches_float64_within_rounding(actual, x, w, bias=None, reference=None):
    """actual [M, N] against float64_reference (or the one given); names the worst output."""
    expected, allowed = reference if reference is not None else float64_reference(x, w, bias)
    assert torch.isfinite(actual).all(), "unwritten output or a read past K"
    error = (actual.double() - expected).abs()
    excess = error - allowed
    row, col = divmod(int(excess.argmax()), excess.shape[1])
    assert (excess <= 0).all(), (
        f"{int((excess > 0).sum())} of {excess.numel()} outputs off; worst [{row}, {col}]: "
        f"got {actual[row, col].item()}, exact {expected[row, col].item()}, "
        f"error {error[row, col].item():.3g} > allowed {allowed[row, col].item():.3g}"
    )


def assert_eager_and_graph_replay_match_float64(linear, rows, num_cols, hidden, with_bias, dtype, seed):
    """GPU: three input sets through the same buffers; each eager linear(x, w, bias, out) is checked
    against float64, and a CUDA graph of it captured once replays each set bit-identically."""
    gen = torch.Generator(device="cuda")
    x = torch.empty(rows, hidden, device="cuda", dtype=dtype)
    w = torch.empty(num_cols, hidden, device="cuda", dtype=dtype)
    bias = torch.empty(num_cols, device="cuda", dtype=dtype) if with_bias else None
    eager = torch.full((rows, num_cols), float("nan"), device="cuda", dtype=dtype)
    replayed = torch.empty_like(eager)
    graph = None
    for input_set in range(3):
        gen.manual_seed(1000 * input_set + seed)
        for t in (x, w) + ((bias,) if with_bias else ()):
            t.copy_(torch.randn(t.shape, device="cuda", generator=gen))
        eager.fill_(float("nan"))
        linear(x, w, bias, eager)
        assert_matches_float64_within_rounding(eager, x, w, bias)
        if graph is None:
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                linear(x, w, bias, replayed)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                linear(x, w, bias, replayed)
        for _ in range(2):
            replayed.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(replayed, eager)


def e4m3_exact_activations(rows, k, group, gen):
    """x [rows, k] whose every (row, group) quantizes exactly: random e4m3 values with one +-448 per
    group, times a power of two per (row, group), so amax / 448 is that power and x / scale is the
    e4m3 value (the interpreter's float -> e4m3 cast mis-rounds some values that need rounding); one
    group of row 0 is all zero (scale 1). Returns x, float32."""
    codes = (torch.randn(rows, k, generator=gen) * 40).clamp(-440, 440).to(FP8_DTYPE).float()
    groups = -(-k // group)
    for g in range(groups):
        codes[:, g * group] = torch.where(torch.rand(rows, generator=gen) < 0.5, -448.0, 448.0)
    powers = 2.0 ** torch.randint(-12, 2, (rows, groups), generator=gen).float()
    x = codes * powers.repeat_interleave(group, 1)[:, :k]
    x[0, :group] = 0
    return x
