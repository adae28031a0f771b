"""The Triton counter-based uniform draws are bit-identical to the int64 torch reference."""

import pytest
import torch

from tpfuse.kernels.counter_random import uniform_ref, uniform_triton

SEEDS = torch.tensor([0, 1, -7, 2**40 + 3, -(2**62), 2**63 - 1, -(2**63)])


@pytest.mark.parametrize("stream", [0, 3, 2**33 + 5])
def test_broadcast_counters_match_the_reference_bit_for_bit(stream):
    counters = torch.cat([torch.arange(300), torch.tensor([2**32 - 1, 2**32, 2**40 + 9])])
    out = uniform_triton(SEEDS, stream, counters)
    assert out.dtype == torch.float64 and out.shape == (len(SEEDS), len(counters))
    assert torch.equal(out, uniform_ref(SEEDS, stream, counters))


def test_per_row_counters_and_a_strided_view_match_the_reference():
    gen = torch.Generator().manual_seed(5)
    counters = torch.randint(0, 2**45, (len(SEEDS), 2 * 37), generator=gen)[:, ::2]  # non-contiguous rows
    assert torch.equal(uniform_triton(SEEDS, 1, counters), uniform_ref(SEEDS, 1, counters))


def test_draws_look_uniform_and_streams_differ():
    seeds = torch.arange(64) * 7919
    u = uniform_triton(seeds, 2, torch.arange(256))
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert not torch.equal(u, uniform_triton(seeds, 3, torch.arange(256)))


def test_empty_inputs_give_empty_draws():
    assert uniform_triton(SEEDS[:0], 0, torch.arange(4)).shape == (0, 4)
    assert uniform_triton(SEEDS, 0, torch.arange(0)).shape == (len(SEEDS), 0)
