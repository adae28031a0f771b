"""The L2 prefetch kernel reads every byte it is given: its per-program checksums equal the reference's."""

import pytest
import torch

from tpfuse.kernels.l2_prefetch import (
    WORDS_PER_PROGRAM_STEP,
    as_words,
    l2_prefetch_ref,
    l2_prefetch_triton,
    prefetch_plan,
)


@pytest.mark.parametrize(
    "numel,dtype,programs",
    [
        (5, torch.int32, 4),  # less than one block
        (WORDS_PER_PROGRAM_STEP * 3 + 17, torch.int32, 2),  # programs take several steps, ragged tail
        (2 * WORDS_PER_PROGRAM_STEP * 5 + 3, torch.bfloat16, 3),  # odd bf16 count: last half-word dropped
        (WORDS_PER_PROGRAM_STEP, torch.float32, 7),  # more programs than blocks
    ],
)
def test_checksums_cover_every_word_and_match_the_reference(numel, dtype, programs):
    gen = torch.Generator().manual_seed(numel)
    if dtype == torch.int32:  # words that overflow an int32 sum: the checksums must wrap alike
        x = torch.randint(-(2**31), 2**31 - 1, (numel,), generator=gen, dtype=torch.int64).to(dtype)
    else:
        x = (torch.randn(numel, generator=gen) * 1000).to(dtype)
    got = l2_prefetch_triton(x, torch.full((programs + 1,), -7, dtype=torch.int32), programs)
    expected = l2_prefetch_ref(x, torch.full((programs + 1,), -7, dtype=torch.int32), programs)
    used, _ = prefetch_plan(as_words(x).numel(), programs)
    assert torch.equal(got, expected)
    assert got[used:].eq(-7).all()  # programs beyond the plan write nothing
    # The checksums together are the wrapped int32 sum of every word: nothing skipped, nothing twice.
    total = int(as_words(x).long().sum()) % 2**32
    assert int(got[:used].long().sum()) % 2**32 == total


def test_prefetch_leaves_its_input_unchanged_and_rejects_a_bad_sink():
    x = torch.randn(3, 1000)
    before = x.clone()
    l2_prefetch_triton(x, torch.zeros(4, dtype=torch.int32), 4)
    assert torch.equal(x, before)
    with pytest.raises(ValueError, match="int32"):
        l2_prefetch_triton(x, torch.zeros(4, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch_triton(x.t(), torch.zeros(4, dtype=torch.int32), 4)


@pytest.mark.gpu
def test_on_the_gpu_checksums_match_the_reference_at_a_real_weight_size():
    gen = torch.Generator(device="cuda").manual_seed(3)
    weight = torch.randn(4096, 4097, generator=gen, device="cuda").to(torch.bfloat16)
    got = l2_prefetch_triton(weight, torch.full((133,), -7, dtype=torch.int32, device="cuda"), 132)
    expected = l2_prefetch_ref(weight, torch.full((133,), -7, dtype=torch.int32, device="cuda"), 132)
    assert torch.equal(got, expected)
