"""Triton rope_store_kv (rotary embedding fused with the KV-cache store) against its references."""

import pytest
import torch

from tests.kernels.paged import assert_close_to_float64
from tpfuse.kernels.kv_store import store_kv_triton
from tpfuse.kernels.rope import rope_cos_sin_cache, rope_triton
from tpfuse.kernels.rope_store_kv import rope_store_kv_ref, rope_store_kv_triton

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _case(tokens, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks, dtype, seed):
    """q, k, v of dtype, NaN-poisoned caches, distinct random slots and positions."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    return positions, q, k, v, k_cache, v_cache, slots


def _float64_expected(positions, q, k, v, cos_sin, k_cache, v_cache, slots):
    q64, k64, v64 = q.double(), k.double(), v.double()
    kc64, vc64 = k_cache.double(), v_cache.double()
    rope_store_kv_ref(positions, q64, k64, v64, cos_sin.double(), kc64, vc64, slots)
    return q64, kc64, vc64


def _assert_cache_close(actual, expected_float64, dtype):
    assert torch.equal(torch.isnan(actual), torch.isnan(expected_float64)), (
        "a slot was written that should not be"
    )
    written = ~torch.isnan(expected_float64)
    assert_close_to_float64(actual[written], expected_float64[written], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads", [(16, 3, 1), (24, 5, 5), (32, 8, 2)])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_rope_store_kv_matches_float64_reference_at_odd_sizes(
    head_dim, num_q_heads, num_kv_heads, dtype, index_dtype
):
    positions, q, k, v, k_cache, v_cache, slots = _case(
        7, num_q_heads, num_kv_heads, head_dim, 4, 5, dtype, 3
    )
    positions, slots = positions.to(index_dtype), slots.to(index_dtype)
    cos_sin = rope_cos_sin_cache(head_dim, 512, 10000.0, LLAMA3_SCALING)
    q_expected, k_expected, v_expected = _float64_expected(
        positions, q, k, v, cos_sin, k_cache, v_cache, slots
    )
    returned = rope_store_kv_triton(positions, q, k, v, cos_sin, k_cache, v_cache, slots)
    assert returned.data_ptr() == q.data_ptr()
    assert_close_to_float64(q, q_expected, dtype)
    _assert_cache_close(k_cache, k_expected, dtype)
    _assert_cache_close(v_cache, v_expected, dtype)


def test_rope_store_kv_skips_the_cache_for_negative_slots_but_still_rotates_q():
    positions, q, k, v, k_cache, v_cache, _ = _case(5, 4, 2, 16, 4, 3, torch.float32, 5)
    slots = torch.tensor([-1, 5, -7, 0, -1])
    cos_sin = rope_cos_sin_cache(16, 512, 10000.0)
    q_expected, k_expected, v_expected = _float64_expected(
        positions, q, k, v, cos_sin, k_cache, v_cache, slots
    )
    rope_store_kv_triton(positions, q, k, v, cos_sin, k_cache, v_cache, slots)
    assert_close_to_float64(q, q_expected, torch.float32)
    written = torch.zeros(12, dtype=torch.bool)
    written[[0, 5]] = True
    assert (
        torch.isnan(k_cache.view(12, -1)[~written]).all()
        and torch.isnan(v_cache.view(12, -1)[~written]).all()
    )
    _assert_cache_close(k_cache, k_expected, torch.float32)
    _assert_cache_close(v_cache, v_expected, torch.float32)


def test_rope_store_kv_reads_views_of_a_fused_qkv_tensor_and_leaves_k_and_v_unchanged():
    gen = torch.Generator().manual_seed(8)
    tokens, heads, kv_heads, head_dim = 5, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    k_before, v_before = k.clone(), v.clone()
    k_cache = torch.full((3, 4, kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    positions, slots = torch.arange(9, 9 + tokens), torch.tensor([3, 0, 11, 6, 7])
    cos_sin = rope_cos_sin_cache(head_dim, 64, 500000.0)
    q_expected, k_expected, v_expected = _float64_expected(
        positions, q, k, v, cos_sin, k_cache, v_cache, slots
    )
    rope_store_kv_triton(positions, q, k, v, cos_sin, k_cache, v_cache, slots)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)
    assert_close_to_float64(q, q_expected, torch.float32)
    _assert_cache_close(k_cache, k_expected, torch.float32)
    _assert_cache_close(v_cache, v_expected, torch.float32)


def test_rope_store_kv_gives_the_bits_of_rope_then_store_kv():
    positions, q, k, v, k_cache, v_cache, slots = _case(6, 8, 2, 32, 4, 4, torch.float16, 21)
    cos_sin = rope_cos_sin_cache(32, 512, 500000.0, LLAMA3_SCALING)
    q_two, k_two, k_cache_two, v_cache_two = q.clone(), k.clone(), k_cache.clone(), v_cache.clone()
    rope_triton(positions, q_two, k_two, cos_sin)
    store_kv_triton(k_two, v, k_cache_two, v_cache_two, slots)
    rope_store_kv_triton(positions, q, k, v, cos_sin, k_cache, v_cache, slots)
    assert torch.equal(q, q_two)
    assert torch.equal(k_cache.nan_to_num(7.0), k_cache_two.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_cache_two.nan_to_num(7.0))


def test_rope_store_kv_rounds_k_to_its_dtype_before_a_cache_of_another_dtype():
    positions, q, k, v, _, _, slots = _case(4, 2, 2, 16, 4, 2, torch.float16, 13)
    k_cache = torch.full((2, 4, 2, 16), float("nan"), dtype=torch.float32)
    v_cache = torch.full_like(k_cache, float("nan"))
    cos_sin = rope_cos_sin_cache(16, 512, 10000.0)
    k_expected_cache, v_expected_cache = k_cache.clone(), v_cache.clone()
    rope_store_kv_ref(positions, q.clone(), k, v, cos_sin, k_expected_cache, v_expected_cache, slots)
    rope_store_kv_triton(positions, q, k, v, cos_sin, k_cache, v_cache, slots)
    written = ~torch.isnan(k_expected_cache)
    stored_k = k_cache[written]
    assert torch.equal(stored_k, stored_k.half().float()), "rotated k was not rounded to float16 first"
    torch.testing.assert_close(stored_k, k_expected_cache[written], atol=2e-3, rtol=2e-3)
    assert torch.equal(v_cache.nan_to_num(7.0), v_expected_cache.nan_to_num(7.0))


def test_rope_store_kv_rejects_k_with_a_head_count_other_than_the_cache():
    positions, q, k, v, k_cache, v_cache, slots = _case(3, 4, 2, 16, 4, 2, torch.float32, 1)
    cos_sin = rope_cos_sin_cache(16, 512, 10000.0)
    with pytest.raises(ValueError, match="as many heads as the cache"):
        rope_store_kv_triton(positions, q, k[:, :1], v[:, :1], cos_sin, k_cache, v_cache, slots)
