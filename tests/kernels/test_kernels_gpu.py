"""The Triton kernels on CUDA at llama-3.1-8b sizes, in bfloat16 and float16 (device machine only)."""

import pytest
import torch

from tests.kernels.paged import assert_close_to_float64, random_paged_kv
from tpfuse.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from tpfuse.kernels.decode_attention import decode_attention_ref, decode_attention_triton
from tpfuse.kernels.kv_store import store_kv_ref, store_kv_triton
from tpfuse.kernels.prefill_attention import prefill_attention_ref, prefill_attention_triton
from tpfuse.kernels.rmsnorm import fused_add_rmsnorm_triton, rmsnorm_ref, rmsnorm_triton
from tpfuse.kernels.rope import rope_cos_sin_cache, rope_ref, rope_triton
from tpfuse.kernels.sampling import sample_triton

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4096, 32, 8, 128, 16
SCALE = HEAD_DIM**-0.5
CUDA = "cuda"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, dtype, seed, scale=1.0):
    return (torch.randn(*shape, generator=_gen(seed)) * scale).to(CUDA, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_on_cuda_matches_float64(dtype):
    x, w = _randn(257, HIDDEN, dtype=dtype, seed=1, scale=3), _randn(HIDDEN, dtype=dtype, seed=2)
    assert_close_to_float64(rmsnorm_triton(x, w, 1e-5), rmsnorm_ref(x.double(), w.double(), 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rmsnorm_on_cuda_rounds_the_residual_once_and_normalizes_it(dtype):
    x, r = _randn(257, HIDDEN, dtype=dtype, seed=3, scale=3), _randn(257, HIDDEN, dtype=dtype, seed=4)
    w = _randn(HIDDEN, dtype=dtype, seed=5)
    normed, new_residual = fused_add_rmsnorm_triton(x, r, w, 1e-5)
    assert torch.equal(new_residual, (x.float() + r.float()).to(dtype))
    assert_close_to_float64(normed, rmsnorm_ref(new_residual.double(), w.double(), 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_on_cuda_matches_float64(dtype):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    cache = rope_cos_sin_cache(HEAD_DIM, 131072, 500000.0, scaling).to(CUDA)
    positions = torch.randint(0, 131072, (257,), generator=_gen(6)).to(CUDA)
    q, k = (
        _randn(257, HEADS, HEAD_DIM, dtype=dtype, seed=7),
        _randn(257, KV_HEADS, HEAD_DIM, dtype=dtype, seed=8),
    )
    q_expected, k_expected = rope_ref(positions, q.double(), k.double(), cache.double())
    rope_triton(positions, q, k, cache)
    assert_close_to_float64(q, q_expected, dtype)
    assert_close_to_float64(k, k_expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_on_cuda_matches_float64(dtype):
    x = _randn(64, 2 * 14336, dtype=dtype, seed=9, scale=3)
    assert_close_to_float64(silu_and_mul_triton(x), silu_and_mul_ref(x.double()), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_on_cuda_writes_the_same_cache_as_the_reference(dtype):
    k, v = (
        _randn(300, KV_HEADS, HEAD_DIM, dtype=dtype, seed=10),
        _randn(300, KV_HEADS, HEAD_DIM, dtype=dtype, seed=11),
    )
    slots = torch.randperm(64 * BLOCK, generator=_gen(12))[:300].to(CUDA)
    slots[::7] = -1
    k_cache = torch.full((64, BLOCK, KV_HEADS, HEAD_DIM), float("nan"), dtype=dtype, device=CUDA)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, k_expected, v_expected, slots)
    store_kv_triton(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.nan_to_num(9.0), k_expected.nan_to_num(9.0))
    assert torch.equal(v_cache.nan_to_num(9.0), v_expected.nan_to_num(9.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,max_context", [(64, 4096), (1, 4096), (8, 700)])
def test_decode_attention_on_cuda_matches_float64(dtype, batch, max_context):
    lens = torch.randint(1, max_context + 1, (batch,), generator=_gen(batch)).tolist()
    lens[0] = max_context
    k_cache, v_cache, tables, seq_lens = random_paged_kv(
        lens, BLOCK, KV_HEADS, HEAD_DIM, dtype, _gen(13), CUDA
    )
    q = _randn(batch, HEADS, HEAD_DIM, dtype=dtype, seed=14)
    out = decode_attention_triton(q, k_cache, v_cache, tables, seq_lens, SCALE)
    expected = decode_attention_ref(q.double(), k_cache.double(), v_cache.double(), tables, seq_lens, SCALE)
    assert_close_to_float64(out, expected, dtype)


def test_decode_attention_replays_in_a_cuda_graph_with_changed_seq_lens():
    dtype, batch, width = torch.bfloat16, 8, 4096 // BLOCK
    k_cache, v_cache, tables, seq_lens = random_paged_kv([4096] * batch, BLOCK, KV_HEADS, HEAD_DIM, dtype,
                                                         _gen(15), CUDA, spare_columns=0)  # fmt: skip
    assert tables.shape[1] == width
    q = _randn(batch, HEADS, HEAD_DIM, dtype=dtype, seed=16)
    static_lens = seq_lens.clone()
    decode_attention_triton(q, k_cache, v_cache, tables, static_lens, SCALE)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = decode_attention_triton(q, k_cache, v_cache, tables, static_lens, SCALE)
    for step, lens in enumerate([[1, 17, 4096, 300, 2048, 16, 999, 0], [4096] * batch, [5] * batch]):
        static_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(_randn(batch, HEADS, HEAD_DIM, dtype=dtype, seed=100 + step))
        graph.replay()
        expected = decode_attention_ref(
            q.double(), k_cache.double(), v_cache.double(), tables, static_lens, SCALE
        )
        assert_close_to_float64(static_out.clone(), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_on_cuda_matches_float64(dtype):
    pairs = [(1024, 1024), (2048, 512), (4096, 5), (300, 0), (777, 777)]  # prefill, chunk, verify, idle, odd
    contexts = [c for c, _ in pairs]
    k_cache, v_cache, tables, seq_lens = random_paged_kv(
        contexts, BLOCK, KV_HEADS, HEAD_DIM, dtype, _gen(17), CUDA
    )
    q_lens = torch.tensor([q for _, q in pairs])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(CUDA, torch.int32)
    q = _randn(int(q_lens.sum()), HEADS, HEAD_DIM, dtype=dtype, seed=18)
    out = prefill_attention_triton(q, k_cache, v_cache, tables, seq_lens, starts, int(q_lens.max()), SCALE)
    expected = prefill_attention_ref(q.double(), k_cache.double(), v_cache.double(), tables, seq_lens, starts,
                                     int(q_lens.max()), SCALE)  # fmt: skip
    assert_close_to_float64(out, expected, dtype)


def _sampling_params(batch, temperature, top_k=0, top_p=1.0):
    return (torch.full((batch,), float(temperature), device=CUDA), torch.full((batch,), top_k, device=CUDA),
            torch.full((batch,), float(top_p), device=CUDA), torch.arange(batch, device=CUDA))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_sampling_on_cuda_is_exactly_argmax_at_full_vocabulary(dtype):
    logits = _randn(64, 128256, dtype=dtype, seed=19, scale=4)
    logits[0, [5, 128000]] = 100.0
    tokens = sample_triton(logits, *_sampling_params(64, 0.0))
    assert torch.equal(tokens, logits.float().argmax(-1))
    assert int(tokens[0]) == 5


def test_sampling_on_cuda_is_deterministic_and_respects_top_k():
    logits = _randn(64, 128256, dtype=torch.bfloat16, seed=20, scale=2)
    params = _sampling_params(64, 1.0, top_k=20, top_p=0.95)
    first, second = sample_triton(logits, *params), sample_triton(logits, *params)
    assert torch.equal(first, second)
    top20 = logits.float().topk(20, dim=-1).indices
    assert (top20 == first[:, None]).any(-1).all()


def test_temperature_sampling_on_cuda_follows_the_softmax():
    row = torch.linspace(-2.0, 2.0, 10, device=CUDA)
    samples = 200_000
    tokens = sample_triton(row.expand(samples, 10).contiguous(), *_sampling_params(samples, 0.8))
    freq = torch.bincount(tokens, minlength=10).double() / samples
    expected = (row / 0.8).softmax(-1).double()
    wrong = row.softmax(-1).double()
    assert (freq - expected).abs().max() < 0.005
    assert (freq - wrong).abs().max() > 0.02
