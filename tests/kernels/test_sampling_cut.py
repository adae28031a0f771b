"""kernels/sampling_cut.py: the per-row cut keeps what a float64 sort-based top-k / top-p keeps, up to
the float32 error of the mass (a band of eps around top_p), with ties at the cut all kept: odd
vocabulary sizes, rows of one and several programs and blocks, greedy rows, rows that filter nothing,
-inf logits, bf16 logits; the same cut run to run and whatever the split of the rows."""

import pytest
import torch

from tpfuse.kernels import sampling_cut
from tpfuse.kernels.sampling_cut import row_cuts

# Under the interpreter exps are float32 (numpy) and sums exact: the float32 mass is within ~1e-7
# of float64. The GPU's approximate exp adds ~1e-6.
INTERPRETER_EPS = 1e-6
GPU_EPS = 1e-5


def _kept_float64(z: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """[V] bool: the sort rule in float64 over float32 z, closed under ties: the tokens >= the k-th
    largest (k <= 0 or >= V: all), then among those the shortest prefix from the top whose
    renormalised mass reaches p (p >= 1: all; at least the top token), then every token equal to
    the smallest kept."""
    values = z.double().sort(descending=True).values
    if 0 < k < len(values):
        values = values[values >= values[k - 1]]
    if p < 1:
        probs = (values - values[0]).exp()
        probs /= probs.sum()
        before = probs.cumsum(0) - probs
        values = values[: max(1, int((before < p).sum()))]
    return z.double() >= values[-1]


def _assert_cut_in_band(z: torch.Tensor, cut: float, k: int, p: float, eps: float, what=""):
    """The kept set z >= cut holds the float64 set at top_p - eps and lies in the one at top_p + eps
    (both tie-closed, so an extra token ties the cut or lies in the band), and cut is one of the z."""
    kept = z >= cut
    assert cut == float("-inf") or bool((z == cut).any()), what
    inner = _kept_float64(z, k, p - eps if p < 1 else p)
    outer = _kept_float64(z, k, p + eps if p < 1 else p)
    assert not (inner & ~kept).any(), f"{what}: dropped {(inner & ~kept).nonzero().flatten().tolist()[:8]}"
    assert not (kept & ~outer).any(), f"{what}: extra {(kept & ~outer).nonzero().flatten().tolist()[:8]}"


def _z(logits, temperatures):
    return logits.float() / temperatures.float().clamp(min=1e-6)[:, None]


def _rows(vocab: int, rows: int, seed: int):
    """Logits of a spread that differs by row, and rules covering greedy, top-k only, top-p only,
    both, p = 1, k >= V, k <= 0, a tiny p and p = 0."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * (torch.rand(rows, 1, generator=gen) * 6 + 0.1)
    rules = [  # temperature, top_k, top_p
        (0.7, 0, 0.9), (1.0, 1, 1.0), (1.3, 3, 0.5), (0.5, 50, 0.3), (2.0, -1, 0.05),
        (0.9, vocab, 0.999), (1.0, vocab + 5, 0.7), (0.6, 2, 1.0), (0.0, 5, 0.5), (1.1, 0, 1.0),
        (0.8, 7, 0.0), (1.0, max(vocab // 3, 1), 0.95),
    ]  # fmt: skip
    rules = [rules[(seed + i) % len(rules)] for i in range(rows)]
    temperatures, top_ks, top_ps = (torch.tensor(column) for column in zip(*rules, strict=True))
    return logits, temperatures, top_ks.long(), top_ps.float()


@pytest.mark.parametrize(
    ("vocab", "rows", "parts"), [(1, 3, None), (7, 6, None), (300, 12, 1), (5000, 6, 2), (40000, 3, 2)]
)
def test_the_cut_keeps_what_the_float64_sort_keeps(vocab, rows, parts):
    logits, temperatures, top_ks, top_ps = _rows(vocab, rows, seed=vocab)
    cuts = row_cuts(logits, temperatures, top_ks, top_ps, parts=parts)
    z = _z(logits, temperatures)
    for b in range(rows):
        if temperatures[b] <= 0:
            assert cuts[b] == float("-inf")
            continue
        k, p = int(top_ks[b]), float(top_ps[b])
        _assert_cut_in_band(z[b], float(cuts[b]), k, p, INTERPRETER_EPS, f"row {b} k {k} p {p}")
        if not 0 < k < vocab and p >= 1:
            assert cuts[b] == float("-inf")


def test_greedy_rows_and_rows_that_filter_nothing_get_minus_infinity():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    cuts = row_cuts(
        logits,
        torch.tensor([0.0, 1.0, 0.8, 1.2, 0.5]),
        torch.tensor([5, 0, 50, -1, 99]),
        torch.tensor([0.5, 1.0, 1.0, 1.0, 1.5]),
    )
    assert cuts.tolist() == [float("-inf")] * 5


def test_ties_at_the_cut_are_all_kept():
    """Values on a coarse grid (as bf16 logits are): every token equal to the crossing value stays."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(5, 200, generator=gen) * 2).round()
    temperatures = torch.ones(5)
    top_ks, top_ps = torch.tensor([0, 10, 0, 3, 40]), torch.tensor([0.6, 1.0, 0.2, 1.0, 0.7])
    cuts = row_cuts(logits, temperatures, top_ks, top_ps)
    for b in range(5):
        _assert_cut_in_band(logits[b], float(cuts[b]), int(top_ks[b]), float(top_ps[b]), INTERPRETER_EPS, b)
        assert int((logits[b] == cuts[b]).sum()) > 1  # the grid makes the cut a tie


def test_minus_infinity_logits_and_k_beyond_the_finite_tokens():
    """Masked tokens (-inf, as grammar masks leave them) weigh nothing; a k past the finite tokens
    keeps them all; top_p = 0 keeps the top token; one finite token keeps only it."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 300, generator=gen) * 3
    logits[:, ::3] = float("-inf")
    logits[3, 1:] = float("-inf")
    temperatures = torch.tensor([1.0, 0.7, 1.0, 1.0])
    top_ks, top_ps = torch.tensor([250, 0, 0, 2]), torch.tensor([0.9, 0.5, 0.0, 0.9])
    cuts = row_cuts(logits, temperatures, top_ks, top_ps)
    z = _z(logits, temperatures)
    for b in range(4):
        _assert_cut_in_band(z[b], float(cuts[b]), int(top_ks[b]), float(top_ps[b]), INTERPRETER_EPS, b)
    assert cuts[2] == z[2].max() and cuts[3] == z[3, 0]


def test_bf16_logits_give_the_cut_of_their_float32_values():
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(3, 300, generator=gen) * 4).to(torch.bfloat16)
    temperatures, top_ks, top_ps = (
        torch.tensor([0.8, 1.2, 1.0]),
        torch.tensor([0, 20, 7]),
        torch.tensor([0.9, 0.8, 1.0]),
    )
    cuts = row_cuts(logits, temperatures, top_ks, top_ps)
    assert torch.equal(cuts, row_cuts(logits.float(), temperatures, top_ks, top_ps))
    z = _z(logits, temperatures)
    for b in range(3):
        _assert_cut_in_band(z[b], float(cuts[b]), int(top_ks[b]), float(top_ps[b]), INTERPRETER_EPS, b)


def test_the_cut_is_the_same_run_to_run_and_whatever_the_split_of_the_rows():
    """Integer sums: the same bits from two calls and from 1, 2 or 3 programs a row."""
    logits, temperatures, top_ks, top_ps = _rows(9000, 3, seed=0)
    first = row_cuts(logits, temperatures, top_ks, top_ps, parts=3).view(torch.int32)
    assert torch.equal(first, row_cuts(logits, temperatures, top_ks, top_ps, parts=3).view(torch.int32))
    assert torch.equal(first, row_cuts(logits, temperatures, top_ks, top_ps, parts=1).view(torch.int32))


@pytest.mark.gpu
def test_on_cuda_the_cut_keeps_the_float64_sort_set_within_float32_error_in_and_out_of_a_cuda_graph():
    """128k bf16 logits: the kept sets lie in the float64 band of GPU_EPS around top_p (ties kept),
    the cut is deterministic, and the sampler's cut path replayed from a CUDA graph gives the eager
    tokens, each kept by its row's cut."""
    from tpfuse.kernels.sampling import sample_triton

    gen = torch.Generator(device="cuda").manual_seed(12)
    vocab = 128256
    logits = (torch.randn(6, vocab, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    temperatures = torch.tensor([0.8, 1.0, 0.6, 0.0, 1.2, 1.0], device="cuda")
    top_ks = torch.tensor([0, 2000, 0, 0, 5000, 40], device="cuda")
    top_ps = torch.tensor([0.95, 0.9, 0.5, 1.0, 1.0, 0.8], device="cuda")
    cuts = row_cuts(logits, temperatures, top_ks, top_ps)
    assert torch.equal(
        cuts.view(torch.int32), row_cuts(logits, temperatures, top_ks, top_ps).view(torch.int32)
    )
    assert cuts[3] == float("-inf")
    z = _z(logits, temperatures).cpu()
    for b in (0, 1, 2, 4, 5):
        k, p = int(top_ks[b]), float(top_ps[b])
        _assert_cut_in_band(z[b], float(cuts[b]), k, p, GPU_EPS, f"row {b} k {k} p {p}")
    seeds = torch.arange(6, device="cuda")
    eager = sample_triton(logits, temperatures, top_ks, top_ps, seeds, (True, 0))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sample_triton(logits, temperatures, top_ks, top_ps, seeds, (True, 0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    assert all(z[b, int(eager[b])] >= cuts[b].cpu() for b in (0, 1, 2, 4, 5))
    assert int(eager[3]) == int(logits[3].float().argmax())


def test_the_passes_compile_once_per_vocabulary_whatever_the_batch(monkeypatch):
    """The PARTS constexpr of the passes is bounded by the vocabulary, not the batch: serving a new
    batch size compiles nothing."""
    bounds = []
    real = sampling_cut.pass_launches

    def recording(bound, *args):
        bounds.append(bound)
        return real(bound, *args)

    monkeypatch.setattr(sampling_cut, "pass_launches", recording)
    for batch in (1, 3, 40):
        logits = torch.randn(batch, 40000)
        row_cuts(logits, torch.ones(batch), torch.zeros(batch, dtype=torch.int64), torch.full((batch,), 0.9))
    assert len(set(bounds)) == 1


def test_the_sampler_warm_up_runs_every_filter_path_off_the_gpu_only_when_asked():
    from tpfuse import kernels
    from tpfuse.kernels import sampling

    assert kernels.warm_up_sampling(300, torch.device("cpu")) == 0  # nothing compiles ahead on a CPU
    assert sampling.warm_up_sampling(300, torch.device("cpu")) == 7  # the launches themselves run


def _compile_key(kernel, args, kwargs):
    """What Triton compiles a launch by: the constexprs and options, each int argument's class (1, a
    multiple of 16, other) and each tensor's dtype and 16-byte alignment, less do_not_specialize."""
    skipped = set(kernel.kwargs.get("do_not_specialize") or ())  # the interpreter's kernel
    key = []
    for index, (name, value) in enumerate(zip(kernel.arg_names, args, strict=False)):
        if index in skipped or name in skipped:
            continue
        if isinstance(value, torch.Tensor):
            key.append((name, value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and not isinstance(value, bool):
            key.append((name, "one" if value == 1 else "16k" if value % 16 == 0 else "int"))
    return tuple(sorted(kwargs.items())), tuple(key)


class _Recording:
    """Stands in for a Triton kernel: records each launch's compile key (into keys), then launches."""

    def __init__(self, kernel, keys: set):
        self.kernel, self.keys = kernel, keys

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.keys.add((self.kernel.fn.__name__, _compile_key(self.kernel, args, kwargs)))
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_sampled_steps_of_any_batch_launch_only_what_the_warm_up_compiled(monkeypatch):
    """After kernels.sampling.warm_up_sampling, no batch size, filter path or unaligned view of a
    packed step (seeds and top_ks are views into it) launches a sampler or cut variant it did not."""
    from tpfuse.kernels import sampling

    keys: set = set()
    kernels = [(sampling, "_sample_kernel"), (sampling, "_merge_kernel"),
               (sampling_cut, "_top_k_pass_kernel"), (sampling_cut, "_top_p_pass_kernel"),
               (sampling_cut, "_finish_kernel")]  # fmt: skip
    for module, name in kernels:
        monkeypatch.setattr(module, name, _Recording(getattr(module, name), keys))
    vocab = 9000  # several parts a row under the interpreter's 4096-token blocks
    sampling.warm_up_sampling(vocab, torch.device("cpu"))
    warmed = set(keys)
    keys.clear()
    for batch in (3, 17):
        packed = torch.zeros(2 * batch + 1, dtype=torch.int64)  # odd offsets: unaligned views
        top_ks, seeds = packed[1 : batch + 1], packed[batch + 1 :]
        seeds.copy_(torch.arange(batch))
        logits = torch.randn(batch, vocab)
        temperatures = torch.full((batch,), 0.7)
        for top_k, top_p in ((0, 1.0), (0, 0.9), (5, 1.0)):
            top_ks.fill_(top_k)
            top_ps = torch.full((batch,), top_p)
            plan = sampling.filter_plan(temperatures.tolist(), top_ks.tolist(), top_ps.tolist())
            sampling.sample_triton(logits, temperatures, top_ks, top_ps, seeds, plan)
    assert keys and keys <= warmed, keys - warmed
