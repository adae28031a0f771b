"""Triton qk_norm_rope_store_kv (per-head RMSNorm of q and k + rope + KV store in one launch) against a
float64 reference of the math and, bit for bit, against the unfused rmsnorm -> rope_store_kv path."""

import pytest
import torch

from tests.kernels.paged import assert_close_to_float64
from tpfuse.kernels.qk_norm_rope_store_kv import qk_norm_rope_store_kv_ref, qk_norm_rope_store_kv_triton
from tpfuse.kernels.rmsnorm import rmsnorm_triton
from tpfuse.kernels.rope import rope_cos_sin_cache
from tpfuse.kernels.rope_store_kv import rope_store_kv_triton

EPS = 1e-6
BLOCK_SIZE, NUM_BLOCKS = 4, 10


def _case(tokens, num_q_heads, num_kv_heads, head_dim, dtype, seed, cache_dtype=None):
    """Views of one fused qkv row per token (as the model hands them), norm weights near 1, NaN caches,
    distinct random slots (every third one negative) and positions."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(tokens, width, generator=gen) * 3 + 0.5).to(dtype)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(tokens, num_q_heads, head_dim)
    k, v = k.view(tokens, num_kv_heads, head_dim), v.view(tokens, num_kv_heads, head_dim)
    q_w = (1 + 0.5 * torch.randn(head_dim, generator=gen)).to(dtype)
    k_w = (1 + 0.5 * torch.randn(head_dim, generator=gen)).to(dtype)
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=cache_dtype or dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:tokens]
    slots[1::3] = -1
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    return positions, q, k, v, q_w, k_w, k_cache, v_cache, slots


def float64_expected(positions, q, k, v, q_w, k_w, cos_sin, k_cache, v_cache, slots, eps=EPS):
    """The math in float64 with no intermediate rounding: (q [T, Hq, D], k_cache, v_cache)."""
    half = q.shape[-1] // 2
    cs = cos_sin.double()[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def norm_rotate(x, w):
        x = x.double()
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()
        n1, n2 = n[..., :half], n[..., half:]
        return torch.cat([n1 * cos - n2 * sin, n2 * cos + n1 * sin], dim=-1)

    k_expected, v_expected = k_cache.double(), v_cache.double()
    kept = slots >= 0
    flat_k = k_expected.view(-1, *k_cache.shape[2:])
    flat_v = v_expected.view(-1, *v_cache.shape[2:])
    flat_k[slots[kept].long()] = norm_rotate(k, k_w)[kept]
    flat_v[slots[kept].long()] = v.double()[kept]
    return norm_rotate(q, q_w), k_expected, v_expected


def _unfused(positions, q, k, v, q_w, k_w, cos_sin, k_cache, v_cache, slots):
    """The three launches the fused kernel replaces, on copies: (q, k_cache, v_cache)."""
    d = q.shape[-1]
    q_normed = rmsnorm_triton(q.reshape(-1, d), q_w, EPS).view(q.shape)
    k_normed = rmsnorm_triton(k.reshape(-1, d), k_w, EPS).view(k.shape)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    rope_store_kv_triton(positions, q_normed, k_normed, v, cos_sin, k_cache, v_cache, slots)
    return q_normed, k_cache, v_cache


def _assert_cache_close(actual, expected_float64, dtype):
    assert torch.equal(torch.isnan(actual), torch.isnan(expected_float64)), (
        "a slot was written that should not be"
    )
    written = ~torch.isnan(expected_float64)
    assert_close_to_float64(actual[written], expected_float64[written], dtype)


def _same_bits(a, b):
    return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(a.isnan(), b.isnan())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens,head_dim,num_q_heads,num_kv_heads",
    [(1, 128, 8, 2), (5, 64, 3, 1), (5, 128, 4, 2), (33, 64, 1, 1), (33, 128, 4, 1), (5, 96, 3, 2)],
)
def test_fused_matches_float64_and_gives_the_bits_of_the_unfused_path(
    tokens, head_dim, num_q_heads, num_kv_heads, dtype
):
    case = _case(tokens, num_q_heads, num_kv_heads, head_dim, dtype, seed=tokens * 100 + head_dim)
    positions, q, k, v, q_w, k_w, k_cache, v_cache, slots = case
    cos_sin = rope_cos_sin_cache(head_dim, 512, 1000000.0)
    q_expected, k_expected, v_expected = float64_expected(*case[:6], cos_sin, k_cache, v_cache, slots)
    q_two, k_cache_two, v_cache_two = _unfused(*case[:6], cos_sin, k_cache, v_cache, slots)
    k_before, v_before = k.clone(), v.clone()
    returned = qk_norm_rope_store_kv_triton(
        positions, q, k, v, q_w, k_w, EPS, cos_sin, k_cache, v_cache, slots
    )
    assert returned.data_ptr() == q.data_ptr()
    assert torch.equal(k, k_before) and torch.equal(v, v_before), "k or v was modified"
    assert_close_to_float64(q, q_expected, dtype)
    _assert_cache_close(k_cache, k_expected, dtype)
    _assert_cache_close(v_cache, v_expected, dtype)
    assert torch.equal(q, q_two)
    assert _same_bits(k_cache, k_cache_two) and _same_bits(v_cache, v_cache_two)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_negative_slots_store_nothing_but_q_is_still_normed_and_rotated(index_dtype):
    positions, q, k, v, q_w, k_w, k_cache, v_cache, _ = _case(5, 3, 2, 64, torch.float32, seed=4)
    positions, slots = positions.to(index_dtype), torch.tensor([-1, 9, -5, 0, -1], dtype=index_dtype)
    cos_sin = rope_cos_sin_cache(64, 512, 10000.0)
    q_expected, k_expected, v_expected = float64_expected(
        positions, q, k, v, q_w, k_w, cos_sin, k_cache, v_cache, slots
    )
    qk_norm_rope_store_kv_triton(positions, q, k, v, q_w, k_w, EPS, cos_sin, k_cache, v_cache, slots)
    assert_close_to_float64(q, q_expected, torch.float32)
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[[0, 9]] = False
    assert k_cache.view(NUM_BLOCKS * BLOCK_SIZE, -1)[untouched].isnan().all()
    assert v_cache.view(NUM_BLOCKS * BLOCK_SIZE, -1)[untouched].isnan().all()
    _assert_cache_close(k_cache, k_expected, torch.float32)
    _assert_cache_close(v_cache, v_expected, torch.float32)


def test_bf16_activations_round_normed_and_rotated_k_to_bf16_before_a_float32_cache():
    case = _case(5, 4, 2, 64, torch.bfloat16, seed=6, cache_dtype=torch.float32)
    positions, q, k, v, q_w, k_w, k_cache, v_cache, slots = case
    cos_sin = rope_cos_sin_cache(64, 512, 10000.0)
    _, k_cache_two, v_cache_two = _unfused(*case[:6], cos_sin, k_cache, v_cache, slots)
    qk_norm_rope_store_kv_triton(positions, q, k, v, q_w, k_w, EPS, cos_sin, k_cache, v_cache, slots)
    stored = k_cache[~k_cache.isnan()]
    assert stored.numel() and torch.equal(stored, stored.bfloat16().float()), "k was not rounded to bf16"
    assert _same_bits(k_cache, k_cache_two) and _same_bits(v_cache, v_cache_two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_float64(dtype):
    case = _case(5, 3, 1, 64, dtype, seed=8)
    positions, q, k, v, q_w, k_w, k_cache, v_cache, slots = case
    cos_sin = rope_cos_sin_cache(64, 512, 10000.0)
    q_expected, k_expected, v_expected = float64_expected(*case[:6], cos_sin, k_cache, v_cache, slots)
    qk_norm_rope_store_kv_ref(positions, q, k, v, q_w, k_w, EPS, cos_sin, k_cache, v_cache, slots)
    assert_close_to_float64(q, q_expected, dtype)
    _assert_cache_close(k_cache, k_expected, dtype)
    _assert_cache_close(v_cache, v_expected, dtype)


def test_a_norm_weight_of_the_wrong_size_is_rejected_by_name():
    positions, q, k, v, q_w, k_w, k_cache, v_cache, slots = _case(2, 2, 1, 64, torch.float32, seed=1)
    cos_sin = rope_cos_sin_cache(64, 512, 10000.0)
    with pytest.raises(ValueError, match=r"k_norm_weight of shape \(64,\)"):
        qk_norm_rope_store_kv_triton(positions, q, k, v, q_w, k_w[:32], EPS, cos_sin, k_cache, v_cache, slots)
