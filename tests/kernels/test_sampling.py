"""Triton sampling: exact greedy, seeded determinism, top-k / top-p support, and the distribution."""

import pytest
import torch

from tpfuse.kernels.sampling import (
    apply_top_k_top_p,
    filter_plan,
    filter_top_k_top_p,
    sample_ref,
    sample_triton,
)

# Chi-square critical value for 5 degrees of freedom at p = 0.001.
CHI2_CRITICAL_DF5 = 20.52


def _params(batch, temperature, top_k=0, top_p=1.0, first_seed=0):
    return (
        torch.full((batch,), float(temperature)),
        torch.full((batch,), top_k, dtype=torch.int64),
        torch.full((batch,), float(top_p)),
        torch.arange(first_seed, first_seed + batch, dtype=torch.int64),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_greedy_rows_are_exactly_argmax_with_ties_to_the_lowest_index(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5000, generator=gen).to(dtype)
    logits[0, [7, 9]] = 20.0  # tie inside one chunk
    logits[1, [100, 4500]] = 20.0  # tie across chunks of the vocabulary
    logits[2, 4999] = 20.0  # the last token
    temperatures, top_ks, top_ps, seeds = _params(4, 0.0)
    temperatures[3] = 1.0  # a sampled row in the same batch changes nothing for the greedy rows
    tokens = sample_triton(logits, temperatures, top_ks, top_ps, seeds)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens[:3], logits[:3].float().argmax(-1))
    assert tokens[:3].tolist() == [7, 100, 4999]


def test_the_tokens_do_not_depend_on_how_many_programs_share_a_row():
    """Greedy, plain, cut and top-k-selected rows; ties and masked (-inf) tokens across the chunks;
    a row of -inf only gives token 0, as one program streaming the row does."""
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(6, 9000, generator=gen) * 3
    logits[0, [10, 8500]] = 30.0  # a greedy tie across chunks
    logits[2, :4096] = float("-inf")
    logits[5] = float("-inf")
    temperatures = torch.tensor([0.0, 1.0, 0.8, 1.3, 0.0, 1.0])
    seeds = torch.arange(6) + 100
    none, cut = torch.zeros(6, dtype=torch.int64), torch.tensor([0, 0, 0, 40, 0, 0])
    small_k = torch.tensor([5, 40, 30, 40, 5, 10])
    top_ps = torch.tensor([1.0, 1.0, 0.9, 0.8, 1.0, 1.0])
    # no filter; the cut; torch.topk then the sort (plans as filter_plan gives them)
    for top_ks, plan in ((none, (False, 0)), (cut, (True, 0)), (small_k, (True, 40))):
        ps = top_ps if plan[0] else torch.ones(6)
        one = sample_triton(logits, temperatures, top_ks, ps, seeds, plan, parts=1)
        three = sample_triton(logits, temperatures, top_ks, ps, seeds, plan, parts=3)
        assert torch.equal(one, three), plan
        assert plan == filter_plan(temperatures.tolist(), top_ks.tolist(), ps.tolist())
        assert one[0] == 10 and one[4] == logits[4].argmax() and one[5] == 0
        assert one[2] >= 4096


def test_greedy_matches_the_reference_on_random_logits():
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(1))
    args = _params(16, 0.0)
    assert torch.equal(sample_triton(logits, *args), sample_ref(logits, *args))


def test_same_seed_gives_the_same_tokens():
    logits = torch.randn(12, 64, generator=torch.Generator().manual_seed(2))
    args = _params(12, 1.0, top_k=20, top_p=0.9)
    assert torch.equal(sample_triton(logits, *args), sample_triton(logits, *args))


def test_a_row_samples_the_same_token_whatever_else_is_in_the_batch():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 64, generator=gen)
    temperatures, top_ks, top_ps, seeds = _params(8, 1.0, first_seed=1000)
    top_ks[::2] = 10
    batch_tokens = sample_triton(logits, temperatures, top_ks, top_ps, seeds)
    for row in (1, 4, 7):
        alone = sample_triton(logits[row : row + 1], temperatures[row : row + 1], top_ks[row : row + 1],
                              top_ps[row : row + 1], seeds[row : row + 1])  # fmt: skip
        assert int(alone) == int(batch_tokens[row])


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(40, 64)  # uniform
    tokens = sample_triton(logits, *_params(40, 1.0))
    assert len(set(tokens.tolist())) > 15


def test_top_k_never_returns_a_token_outside_the_top_k():
    row = torch.randn(50, generator=torch.Generator().manual_seed(4))
    logits = row.expand(80, 50).contiguous()
    tokens = sample_triton(logits, *_params(80, 1.5, top_k=5))
    allowed = set(row.topk(5).indices.tolist())
    assert set(tokens.tolist()) <= allowed
    assert len(set(tokens.tolist())) > 1


def test_top_p_never_returns_a_token_outside_the_nucleus():
    row = torch.randn(40, generator=torch.Generator().manual_seed(5))
    temperature, top_p = 1.0, 0.6
    logits = row.expand(16, 40).contiguous()
    tokens = sample_triton(logits, *_params(16, temperature, top_p=top_p))
    probs, order = (row / temperature).softmax(-1).sort(descending=True)
    mass_before = probs.cumsum(0) - probs
    nucleus = set(order[mass_before < top_p].tolist())
    assert 1 < len(nucleus) < 40
    assert set(tokens.tolist()) <= nucleus
    assert len(set(tokens.tolist())) > 1


def _chi_square(tokens, probs):
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


def test_temperature_sampling_follows_the_softmax_and_a_wrong_distribution_is_rejected():
    row = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 2.5])
    temperature, samples = 0.7, 600
    tokens = sample_triton(row.expand(samples, 6).contiguous(), *_params(samples, temperature, first_seed=77))
    assert _chi_square(tokens, (row / temperature).softmax(-1)) < CHI2_CRITICAL_DF5
    # Control: the same samples against the untempered softmax must fail the test.
    assert _chi_square(tokens, row.softmax(-1)) > CHI2_CRITICAL_DF5


def test_top_k_selection_shortcut_filters_exactly_like_the_full_sort():
    gen = torch.Generator().manual_seed(6)
    scaled = torch.randn(9, 300, generator=gen) * 3
    top_ks = torch.randint(1, 40, (9,), generator=gen)
    top_ps = torch.rand(9, generator=gen) * 0.9 + 0.1
    top_ps[0] = 1.0
    shortcut = filter_top_k_top_p(scaled, top_ks, top_ps, k_bound=int(top_ks.max()))
    assert torch.equal(shortcut, apply_top_k_top_p(scaled, top_ks, top_ps))


def test_top_k_and_top_p_together_keep_tokens_in_both_sets():
    row = torch.randn(30, generator=torch.Generator().manual_seed(8))
    logits = row.expand(80, 30).contiguous()
    tokens = sample_triton(logits, *_params(80, 1.0, top_k=6, top_p=0.5))
    probs, order = row[row.topk(6).indices].softmax(-1), row.topk(6).indices
    allowed = set(order[(probs.cumsum(0) - probs) < 0.5].tolist())
    assert set(tokens.tolist()) <= allowed


def test_the_host_filter_plan_equals_the_plan_read_from_the_device():
    """The runner reads the plan from the CPU packed step (no device sync); it must be what the
    device tensors give: greedy rows ignored, top_k off (-1 or 0), top_p compared as float32 (a
    float64 just below 1 rounds to 1), a k above the selection bound, mixed rows."""
    from tpfuse.kernels.sampling import TOP_K_SELECT_MAX, _filter_plan, filter_plan

    cases = [
        ([0.0, 0.0], [5, -1], [0.5, 1.0]),
        ([0.7, 0.0], [-1, 3], [1.0, 0.2]),
        ([0.7], [0], [1 - 1e-12]),
        ([0.7], [0], [0.999]),
        ([1.0, 0.5], [20, 40], [1.0, 0.9]),
        ([1.0, 0.5], [20, -1], [1.0, 1.0]),
        ([1.0], [TOP_K_SELECT_MAX + 1], [1.0]),
        ([1.0, 0.0, 0.3], [7, -1, 7], [0.95, 1.0, 1.0]),
    ]
    generator = torch.Generator().manual_seed(5)
    for _ in range(20):
        n = int(torch.randint(1, 6, (1,), generator=generator))
        temps = (torch.rand(n, generator=generator) * 2 - 0.5).clamp(min=0).tolist()
        ks = torch.randint(-1, 60, (n,), generator=generator).tolist()
        ps = torch.where(
            torch.rand(n, generator=generator) < 0.5, 1.0, torch.rand(n, generator=generator)
        ).tolist()
        cases.append((temps, ks, ps))
    for temps, ks, ps in cases:
        device = _filter_plan(
            torch.tensor(temps, dtype=torch.float64).float(), torch.tensor(ks), torch.tensor(ps).float()
        )
        if not any(t > 0 for t in temps):
            assert filter_plan(temps, ks, ps) == (False, 0)
            continue
        assert filter_plan(temps, ks, ps) == device, (temps, ks, ps)


def test_given_a_plan_the_sampler_never_reads_one_back_from_the_device(monkeypatch):
    from tpfuse.kernels import sampling

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    temps, ks, ps, seeds = _params(3, 0.8, top_k=5)
    expected = sample_triton(logits, temps, ks, ps, seeds)

    def device_read(*args):
        raise AssertionError("the sampler read its plan back from the device")

    monkeypatch.setattr(sampling, "_filter_plan", device_read)
    plan = sampling.filter_plan(temps.tolist(), ks.tolist(), ps.tolist())
    assert torch.equal(sample_triton(logits, temps, ks, ps, seeds, plan), expected)


def test_the_runner_passes_the_host_plan_of_every_sampled_step(monkeypatch):
    """Sampled steps (decodes and prefills, greedy and sampled rows mixed) carry the plan read from
    the CPU packed step, equal to the one the device tensors give, so launching them needs no sync."""
    from tpfuse.engine import runner as runner_module
    from tpfuse.engine.llm import LLM
    from tpfuse.engine.sampling_params import SamplingParams
    from tpfuse.kernels.sampling import _filter_plan

    plans = []
    real = runner_module.sample

    def recording(logits, temperatures, top_ks, top_ps, seeds, plan=None):
        plans.append((plan, _filter_plan(temperatures, top_ks, top_ps)))
        return real(logits, temperatures, top_ks, top_ps, seeds, plan)

    monkeypatch.setattr(runner_module, "sample", recording)
    llm = LLM("tiny", device="cpu", num_kv_blocks=64)
    try:
        params = [
            SamplingParams(temperature=0.8, top_k=5, seed=1, max_tokens=4, ignore_eos=True),
            SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
            SamplingParams(temperature=1.1, top_p=0.9, seed=2, max_tokens=4, ignore_eos=True),
        ]
        outputs = llm.generate(["one", "two", "three"], params)
    finally:
        llm.shutdown()
    assert all(len(o.token_ids) == 4 for o in outputs)
    assert len(plans) >= 4
    assert all(plan is not None and plan == device for plan, device in plans)
