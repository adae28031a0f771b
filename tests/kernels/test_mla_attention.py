"""Triton MLA attention (absorbed latent, paged) against the float64 references, at odd sizes."""

import pytest
import torch

from tests.kernels.paged import assert_close_to_float64, random_paged_kv
from tpfuse.kernels.mla_attention import mla_attention_launch
from tpfuse.kernels.mla_decode import mla_decode_launch, mla_decode_ref, mla_decode_triton
from tpfuse.kernels.mla_prefill import mla_prefill_ref, mla_prefill_triton
from tpfuse.kernels.mla_store import store_latent_ref, store_latent_triton

RANK, ROPE = 40, 8  # neither a power of two nor equal


def _latent_case(context_lens, block_size, heads, q_tokens, dtype, seed, rank=RANK, rope=ROPE):
    """(q_latent [T, H, R], q_rope [T, H, P], cache [nb, bs, R + P] NaN in unused slots, tables, lens)."""
    gen = torch.Generator().manual_seed(seed)
    cache, _, tables, lens = random_paged_kv(context_lens, block_size, 1, rank + rope, dtype, gen)
    cache = cache[:, :, 0].contiguous()
    q_latent = torch.randn(q_tokens, heads, rank, generator=gen).to(dtype)
    q_rope = torch.randn(q_tokens, heads, rope, generator=gen).to(dtype)
    return q_latent, q_rope, cache, tables, lens


def _decode_expected(q_latent, q_rope, cache, tables, lens, scale):
    return mla_decode_ref(q_latent.double(), q_rope.double(), cache.double(), tables, lens, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [3, 20])
def test_mla_decode_matches_float64_reference_at_odd_sizes(heads, dtype):
    q_lat, q_rope, cache, tables, lens = _latent_case([1, 13, 37], 4, heads, 3, dtype, seed=heads)
    out = mla_decode_triton(q_lat, q_rope, cache, tables, lens, 0.21)
    assert_close_to_float64(out, _decode_expected(q_lat, q_rope, cache, tables, lens, 0.21), dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 70])
def test_mla_decode_merges_any_number_of_splits(num_splits):
    # 70: more splits than key tiles and than one merge chunk (64) reads
    q_lat, q_rope, cache, tables, lens = _latent_case([5, 70, 33, 2], 8, 5, 4, torch.float32, seed=num_splits)
    out = mla_decode_launch(q_lat, q_rope, cache, tables, lens, 0.3, num_splits, tile=(16, 16, 4, 2, False))
    assert_close_to_float64(out, _decode_expected(q_lat, q_rope, cache, tables, lens, 0.3), torch.float32)


def test_mla_decode_with_several_head_groups_matches_float64():
    # 70 heads: two programs of 64 head rows per (sequence, split), the second mostly masked
    q_lat, q_rope, cache, tables, lens = _latent_case([45, 3], 8, 70, 2, torch.float32, seed=70)
    out = mla_decode_launch(q_lat, q_rope, cache, tables, lens, 0.2, 3, tile=(64, 16, 4, 2, False))
    assert_close_to_float64(out, _decode_expected(q_lat, q_rope, cache, tables, lens, 0.2), torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_decode_with_keys_on_the_mma_rows_matches_float64(num_splits):
    # swap_ab: scores as [keys, heads] and the accumulator as [rank, heads]
    q_lat, q_rope, cache, tables, lens = _latent_case([40, 9, 0], 8, 6, 3, torch.float32, seed=num_splits)
    out = mla_decode_launch(q_lat, q_rope, cache, tables, lens, 0.3, num_splits, tile=(16, 16, 4, 2, True))
    assert_close_to_float64(out, _decode_expected(q_lat, q_rope, cache, tables, lens, 0.3), torch.float32)


def test_mla_decode_splits_are_deterministic_and_give_zeros_without_keys():
    q_lat, q_rope, cache, tables, lens = _latent_case([6, 50], 4, 4, 2, torch.float32, seed=11)
    lens[0] = 0  # a padding row of a CUDA-graph batch
    first = mla_decode_launch(q_lat, q_rope, cache, tables, lens, 0.25, 4, tile=(16, 16, 4, 2, False))
    again = mla_decode_launch(q_lat, q_rope, cache, tables, lens, 0.25, 4, tile=(16, 16, 4, 2, False))
    assert torch.equal(first, again)
    assert torch.equal(first[0], torch.zeros_like(first[0]))
    assert_close_to_float64(
        first[1:], _decode_expected(q_lat, q_rope, cache, tables, lens, 0.25)[1:], torch.float32
    )


def _prefill_case(context_lens, query_lens, heads, dtype, seed):
    q_lat, q_rope, cache, tables, lens = _latent_case(context_lens, 4, heads, sum(query_lens), dtype, seed)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q_lat, q_rope, cache, tables, lens, starts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mla_prefill_is_causal_over_the_paged_context_at_odd_sizes(dtype):
    # a whole prompt, a chunk after 9 cached tokens, a one-token row, a verify of 4 after 20
    contexts, queries = [11, 17, 1, 24], [11, 8, 1, 4]
    q_lat, q_rope, cache, tables, lens, starts = _prefill_case(contexts, queries, 3, dtype, seed=7)
    out = mla_prefill_triton(q_lat, q_rope, cache, tables, lens, starts, max(queries), 0.19)
    expected = mla_prefill_ref(
        q_lat.double(), q_rope.double(), cache.double(), tables, lens, starts, 11, 0.19
    )
    assert_close_to_float64(out, expected, dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_mla_verify_rows_with_split_keys_match_float64(num_splits):
    contexts, queries = [30, 9], [3, 3]
    q_lat, q_rope, cache, tables, lens, starts = _prefill_case(contexts, queries, 5, torch.float32, seed=3)
    out = mla_attention_launch(q_lat, q_rope, cache, tables, lens, starts, 3, 0.4, num_splits, 16, 16)
    expected = mla_prefill_ref(q_lat.double(), q_rope.double(), cache.double(), tables, lens, starts, 3, 0.4)
    assert_close_to_float64(out, expected, torch.float32)


def test_mla_prefill_reference_at_one_token_is_the_decode_reference():
    """Two float64 formulas of one attention: equal to float64 rounding (torch may order their sums
    differently from release to release)."""
    q_lat, q_rope, cache, tables, lens, starts = _prefill_case([7, 19], [1, 1], 2, torch.float64, seed=5)
    torch.testing.assert_close(
        mla_prefill_ref(q_lat, q_rope, cache, tables, lens, starts, 1, 0.3),
        mla_decode_ref(q_lat, q_rope, cache, tables, lens, 0.3),
        rtol=1e-12,
        atol=1e-12,
    )


def test_mla_rejects_a_cache_row_that_does_not_hold_latent_and_rope():
    q_lat, q_rope, cache, tables, lens = _latent_case([4], 4, 2, 1, torch.float32, seed=1)
    with pytest.raises(ValueError, match="kv_lora_rank \\+ rope_dim"):
        mla_decode_triton(q_lat, q_rope, cache[..., :-1], tables, lens, 0.3)


def test_store_latent_writes_rows_and_skips_negative_slots():
    gen = torch.Generator().manual_seed(2)
    latent_rows = torch.randn(5, RANK + 3, generator=gen)[:, :RANK]  # strided rows, as a split view gives
    k_pe = torch.randn(5, ROPE, generator=gen)
    slots = torch.tensor([3, -1, 0, 9, 14])
    cache = torch.full((4, 4, RANK + ROPE), float("nan"))
    expected = store_latent_ref(latent_rows, k_pe, cache.clone(), slots)
    out = store_latent_triton(latent_rows, k_pe, cache, slots)
    torch.testing.assert_close(out, expected, equal_nan=True, rtol=0, atol=0)
    assert torch.isnan(out.view(-1, RANK + ROPE)[1]).all()  # no token was stored at slot 1
    assert torch.equal(out.view(-1, RANK + ROPE)[9], torch.cat([latent_rows[3], k_pe[3]]))


def test_compile_ahead_launches_every_mla_variant_without_writing_the_cache():
    from tpfuse.kernels.mla_prefill import compile_mla_variants

    cache = torch.randn(3, 4, RANK + ROPE)
    before = cache.clone()
    # decode (unsplit, split) + prefill tiles of 16, 32 and 64 rows at 5 heads, each first met by a
    # query short enough to fit one tile, so each also launches with split keys
    assert compile_mla_variants(cache, ROPE, 5, 20) == 2 + 3 * 2
    assert torch.equal(cache, before)


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_rope_norm_store_matches_the_reference_on_views_of_one_projection(interleaved, dtype):
    from tpfuse.kernels.mla_rope_store import mla_rope_norm_store_ref, mla_rope_norm_store_triton
    from tpfuse.kernels.rope import rope_cos_sin_cache

    gen = torch.Generator().manual_seed(4)
    tokens, heads, nope = 6, 3, 5
    q = torch.randn(tokens, heads, nope + ROPE, generator=gen).to(dtype)  # q_pe: a strided view
    a = torch.randn(tokens, RANK + ROPE + 7, generator=gen).to(dtype)  # latent and k_pe: views of one row
    latent, k_pe = a[:, :RANK], a[:, RANK : RANK + ROPE]
    weight = (1 + 0.1 * torch.randn(RANK, generator=gen)).to(dtype)
    cos_sin = rope_cos_sin_cache(ROPE, 64, 10000.0)
    positions = torch.tensor([0, 3, 9, 63, 1, 17])
    slots = torch.tensor([5, -1, 0, 11, 2, 7])
    caches = [torch.full((3, 4, RANK + ROPE), float("nan"), dtype=dtype) for _ in range(2)]
    args = (positions, q[..., nope:], latent, k_pe, weight, 1e-6, cos_sin)
    want = mla_rope_norm_store_ref(*args, caches[0], slots, interleaved)
    got = mla_rope_norm_store_triton(*args, caches[1], slots, interleaved)
    tol = 0 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol + 1e-6)
    torch.testing.assert_close(caches[1], caches[0], rtol=tol, atol=tol + 1e-6, equal_nan=True)
    assert torch.isnan(caches[1].view(-1, RANK + ROPE)[1]).all()  # slot 1 was nobody's


def test_mla_decode_with_more_heads_than_one_program_holds():
    # 37 heads over 16-row programs: three head tiles per sequence, the last one partial
    q_lat, q_rope, cache, tables, lens = _latent_case([9, 30], 4, 37, 2, torch.float32, seed=8)
    out = mla_decode_launch(q_lat, q_rope, cache, tables, lens, 0.2, 2, tile=(16, 16, 4, 2, False))
    assert_close_to_float64(out, _decode_expected(q_lat, q_rope, cache, tables, lens, 0.2), torch.float32)
