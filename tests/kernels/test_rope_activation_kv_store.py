"""Triton rope, silu_and_mul and store_kv against their float64 references."""

import pytest
import torch

from tests.kernels.paged import assert_close_to_float64
from tpfuse.kernels.activation import silu_and_mul_launch, silu_and_mul_ref, silu_and_mul_triton
from tpfuse.kernels.kv_store import store_kv_ref, store_kv_triton
from tpfuse.kernels.rope import rope_cos_sin_cache, rope_ref, rope_triton

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim,num_q_heads,num_kv_heads", [(16, 3, 1), (32, 4, 2), (24, 5, 5)])
@pytest.mark.parametrize("position_dtype", [torch.int32, torch.int64])
def test_rope_rotates_q_and_k_in_place_like_float64_reference(
    head_dim, num_q_heads, num_kv_heads, dtype, position_dtype
):
    gen = torch.Generator().manual_seed(head_dim * num_q_heads)
    tokens = 7
    cache = rope_cos_sin_cache(head_dim, 512, 10000.0, LLAMA3_SCALING)
    positions = torch.randint(0, 512, (tokens,), generator=gen).to(position_dtype)
    q = torch.randn(tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    q_expected, k_expected = rope_ref(positions, q.double(), k.double(), cache.double())
    q_out, k_out = rope_triton(positions, q, k, cache)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    assert_close_to_float64(q, q_expected, dtype)
    assert_close_to_float64(k, k_expected, dtype)


def test_rope_rotates_q_and_k_that_are_views_of_a_fused_qkv_tensor():
    gen = torch.Generator().manual_seed(11)
    tokens, heads, kv_heads, head_dim = 5, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    cache = rope_cos_sin_cache(head_dim, 64, 500000.0)
    positions = torch.arange(3, 3 + tokens)
    q_expected, k_expected = rope_ref(positions, q.double(), k.double(), cache.double())
    rope_triton(positions, q, k, cache)
    assert_close_to_float64(q, q_expected, torch.float32)
    assert_close_to_float64(k, k_expected, torch.float32)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,intermediate", [(1, 40), (5, 96), (3, 1100)])
def test_silu_and_mul_matches_float64_reference(tokens, intermediate, dtype):
    gen = torch.Generator().manual_seed(intermediate)
    x = (torch.randn(tokens, 2 * intermediate, generator=gen) * 4).to(dtype)
    assert_close_to_float64(silu_and_mul_triton(x), silu_and_mul_ref(x.double()), dtype)


@pytest.mark.parametrize("block,num_warps", [(16, 1), (128, 2), (2048, 8)])
def test_silu_and_mul_tiles_cover_every_column_at_any_tile_size(block, num_warps):
    x = torch.randn(3, 2 * 1100, generator=torch.Generator().manual_seed(block)).to(torch.float16)
    out = silu_and_mul_launch(x, block=block, num_warps=num_warps)
    assert_close_to_float64(out, silu_and_mul_ref(x.double()), torch.float16)


def _kv_and_cache(tokens, num_blocks, block_size, heads, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype)
    shape = (num_blocks, block_size, heads, head_dim)
    return k, v, torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)


@pytest.mark.parametrize("block_size,heads,head_dim", [(4, 1, 16), (16, 3, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_writes_each_token_to_its_slot_and_nothing_else(block_size, heads, head_dim, dtype):
    k, v, k_cache, v_cache = _kv_and_cache(6, 5, block_size, heads, head_dim, dtype, seed=block_size)
    slots = torch.randperm(5 * block_size, generator=torch.Generator().manual_seed(1))[:6]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, expected_k, expected_v, slots)
    store_kv_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.nan_to_num(7.0), expected_k.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), expected_v.nan_to_num(7.0))
    assert int(torch.isnan(k_cache).any(-1).any(-1).sum()) == 5 * block_size - 6


def test_store_kv_skips_tokens_with_negative_slots():
    k, v, k_cache, v_cache = _kv_and_cache(5, 3, 4, 2, 16, torch.float32, seed=3)
    slots = torch.tensor([-1, 5, -7, 0, -1], dtype=torch.int64)
    store_kv_triton(k, v, k_cache, v_cache, slots)
    flat_k, flat_v = k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16)
    assert torch.equal(flat_k[5], k[1]) and torch.equal(flat_k[0], k[3])
    assert torch.equal(flat_v[5], v[1]) and torch.equal(flat_v[0], v[3])
    written = torch.zeros(12, dtype=torch.bool)
    written[[0, 5]] = True
    assert torch.isnan(flat_k[~written]).all() and torch.isnan(flat_v[~written]).all()


def test_store_kv_reads_k_and_v_from_views_of_a_fused_qkv_tensor():
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(4, 3, 2, 16, generator=gen)  # [T, q|k|v, Hk, D]
    k, v = qkv[:, 1], qkv[:, 2]
    k_cache = torch.zeros(2, 4, 2, 16)
    v_cache = torch.zeros_like(k_cache)
    store_kv_triton(k, v, k_cache, v_cache, torch.tensor([7, 2, 3, 4], dtype=torch.int32))
    assert torch.equal(k_cache.view(-1, 2, 16)[[7, 2, 3, 4]], k)
    assert torch.equal(v_cache.view(-1, 2, 16)[[7, 2, 3, 4]], v)
