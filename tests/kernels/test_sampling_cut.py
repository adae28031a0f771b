"""kernels/sampling_cut.py: the per-row cut keeps exactly the tokens a float64 sort-based top-k /
top-p keeps (ties at the cut all kept), for odd vocabulary sizes, one and several blocks a row,
greedy rows, rows that filter nothing, and bf16 logits."""

import pytest
import torch

from tpfuse.kernels.sampling_cut import row_cuts


def _kept_float64(z: torch.Tensor, k: int, p: float) -> set[int]:
    """The sort rule in float64: the k largest, then the shortest prefix whose renormalised mass
    reaches p (the top token always kept)."""
    values, order = z.double().sort(descending=True)
    if 0 < k < len(values):
        values, order = values[:k], order[:k]
    probs = (values - values[0]).exp()
    probs /= probs.sum()
    before = probs.cumsum(0) - probs
    keep = before < p if p < 1 else torch.ones_like(before, dtype=torch.bool)
    keep[0] = True
    return set(order[keep].tolist())


def _z(logits, temperatures):
    return logits.float() / temperatures.float()[:, None]


@pytest.mark.parametrize("vocab", [1, 7, 333, 4097])
def test_the_cut_keeps_what_the_float64_sort_keeps(vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = 8
    logits = torch.randn(rows, vocab, generator=gen) * torch.rand(rows, 1, generator=gen) * 6
    temperatures = torch.tensor([0.7, 1.0, 1.3, 0.5, 2.0, 0.9, 1.0, 0.6])
    top_ks = torch.tensor([0, 1, 3, 50, -1, vocab, vocab + 5, 2])
    top_ps = torch.tensor([0.9, 1.0, 0.5, 0.3, 0.05, 0.999, 0.7, 1.0])
    cuts = row_cuts(logits, temperatures, top_ks, top_ps)
    z = _z(logits, temperatures)
    for b in range(rows):
        kept = set((z[b] >= cuts[b]).nonzero().flatten().tolist())
        assert kept == _kept_float64(z[b], int(top_ks[b]), float(top_ps[b])), b


def test_greedy_rows_and_rows_that_filter_nothing():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    cuts = row_cuts(
        logits, torch.tensor([0.0, 1.0, 0.8]), torch.tensor([5, 0, 50]), torch.tensor([0.5, 1.0, 1.0])
    )
    assert cuts[0] == float("-inf")
    z = _z(logits, torch.tensor([1.0, 1.0, 0.8]))
    assert cuts[1] == z[1].min() and cuts[2] == z[2].min()


def test_ties_at_the_cut_are_all_kept():
    """Values on a coarse grid (as bf16 logits are): every token equal to the crossing value stays."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(4, 200, generator=gen) * 2).round()
    temperatures, top_ks, top_ps = (
        torch.ones(4),
        torch.tensor([0, 10, 0, 3]),
        torch.tensor([0.6, 1.0, 0.2, 1.0]),
    )
    cuts = row_cuts(logits, temperatures, top_ks, top_ps)
    for b in range(4):
        kept = set((logits[b] >= cuts[b]).nonzero().flatten().tolist())
        by_sort = _kept_float64(logits[b], int(top_ks[b]), float(top_ps[b]))
        assert by_sort <= kept
        assert all(logits[b, t] == cuts[b] for t in kept - by_sort)
        assert logits[b][sorted(by_sort)].min() == cuts[b]


def test_bf16_logits_give_the_cut_of_their_float32_values():
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(2, 300, generator=gen) * 4).to(torch.bfloat16)
    temperatures, top_ks, top_ps = torch.tensor([0.8, 1.2]), torch.tensor([0, 20]), torch.tensor([0.9, 0.8])
    assert torch.equal(
        row_cuts(logits, temperatures, top_ks, top_ps), row_cuts(logits.float(), temperatures, top_ks, top_ps)
    )


@pytest.mark.gpu
def test_on_cuda_the_cut_keeps_the_float64_sort_set_in_and_out_of_a_cuda_graph():
    """128k bf16 logits (ties at the cut are kept too), the sampler's cut path in a CUDA graph
    replay giving the eager tokens."""
    from tpfuse.kernels.sampling import sample_triton

    gen = torch.Generator(device="cuda").manual_seed(12)
    vocab = 128256
    logits = (torch.randn(5, vocab, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    temperatures = torch.tensor([0.8, 1.0, 0.6, 0.0, 1.2], device="cuda")
    top_ks = torch.tensor([0, 2000, 0, 0, 5000], device="cuda")
    top_ps = torch.tensor([0.95, 0.9, 0.5, 1.0, 1.0], device="cuda")
    cuts = row_cuts(logits, temperatures, top_ks, top_ps)
    z = (logits.float() / temperatures.clamp(min=1e-6)[:, None]).cpu()
    for b in (0, 1, 2, 4):
        kept = set((z[b] >= cuts[b].cpu()).nonzero().flatten().tolist())
        by_sort = _kept_float64(z[b], int(top_ks[b]), float(top_ps[b]))
        assert by_sort <= kept and all(z[b, t] == cuts[b].cpu() for t in kept - by_sort), b
    seeds = torch.arange(5, device="cuda")
    eager = sample_triton(logits, temperatures, top_ks, top_ps, seeds, (True, 0))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sample_triton(logits, temperatures, top_ks, top_ps, seeds, (True, 0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    assert all(z[b, int(eager[b])] >= cuts[b].cpu() for b in (0, 1, 2, 4))
