"""The MLA kernels on CUDA at DeepSeek-V3 sizes (kv_lora_rank 512, rope 64; 128 heads at TP 1, 16 at
TP 8; 32 at TP 4), bfloat16, against float64, in and out of CUDA graphs (device machine only)."""

import pytest
import torch

from tests.kernels.paged import assert_close_to_float64, random_paged_kv
from tpfuse.kernels.grouped_topk import grouped_topk_ref as grouped_topk
from tpfuse.kernels.grouped_topk import grouped_topk_triton
from tpfuse.kernels.mla_decode import mla_decode_launch, mla_decode_ref, mla_decode_triton
from tpfuse.kernels.mla_prefill import mla_prefill_ref, mla_prefill_triton
from tpfuse.kernels.mla_store import store_latent_ref, store_latent_triton

pytestmark = pytest.mark.gpu

RANK, ROPE, BLOCK, CUDA = 512, 64, 16, "cuda"
SCALE = 192**-0.5
DTYPE = torch.bfloat16


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed):
    return torch.randn(*shape, generator=_gen(seed)).to(CUDA, DTYPE)


def _latent_cache(contexts, seed, spare_columns=2):
    cache, _, tables, lens = random_paged_kv(contexts, BLOCK, 1, RANK + ROPE, DTYPE, _gen(seed), CUDA,
                                             spare_columns=spare_columns)  # fmt: skip
    return cache[:, :, 0].contiguous(), tables, lens


def _decode_expected(q_lat, q_rope, cache, tables, lens):
    return mla_decode_ref(q_lat.double(), q_rope.double(), cache.double(), tables, lens, SCALE)


@pytest.mark.parametrize("heads", [128, 32, 16])
@pytest.mark.parametrize(
    "contexts", [[1, 33, 1024, 4097], [8192], [300] * 64, [0, 32768]], ids=["mixed", "long", "batch64", "32k"]
)
def test_mla_decode_on_cuda_matches_float64(heads, contexts):
    cache, tables, lens = _latent_cache(contexts, seed=len(contexts) + heads)
    q_lat, q_rope = _randn(len(contexts), heads, RANK, seed=1), _randn(len(contexts), heads, ROPE, seed=2)
    out = mla_decode_triton(q_lat, q_rope, cache, tables, lens, SCALE)
    assert_close_to_float64(out, _decode_expected(q_lat, q_rope, cache, tables, lens), DTYPE)


@pytest.mark.parametrize(
    "heads,tile",
    [(16, (16, 64, 4, 3, True)), (16, (16, 32, 4, 2, False)), (16, (16, 32, 4, 3, False)),
     (32, (32, 64, 8, 3, True)), (32, (32, 32, 4, 2, False)), (128, (64, 64, 8, 2, False)),
     (128, (64, 64, 8, 3, False))],
)  # fmt: skip
@pytest.mark.parametrize("num_splits", [3, 130])
def test_mla_decode_tiles_on_cuda_match_float64(heads, tile, num_splits):
    # every tile benchmarks/mla_decode.py compares, split or not, over a mixed batch with an empty row
    contexts = [0, 17, 1000, 4099]
    cache, tables, lens = _latent_cache(contexts, seed=heads + num_splits)
    q_lat, q_rope = _randn(len(contexts), heads, RANK, seed=20), _randn(len(contexts), heads, ROPE, seed=21)
    out = mla_decode_launch(q_lat, q_rope, cache, tables, lens, SCALE, num_splits, tile)
    assert_close_to_float64(out, _decode_expected(q_lat, q_rope, cache, tables, lens), DTYPE)


@pytest.mark.parametrize("heads", [128, 16])
def test_mla_decode_replays_in_a_cuda_graph_with_changed_seq_lens(heads):
    batch = 8
    cache, tables, lens = _latent_cache([4096] * batch, seed=3, spare_columns=0)
    q_lat, q_rope = _randn(batch, heads, RANK, seed=4), _randn(batch, heads, ROPE, seed=5)
    static_lens = lens.clone()
    mla_decode_triton(q_lat, q_rope, cache, tables, static_lens, SCALE)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = mla_decode_triton(q_lat, q_rope, cache, tables, static_lens, SCALE)
    for step, new_lens in enumerate([[1, 17, 4096, 300, 2048, 16, 999, 0], [4096] * batch, [5] * batch]):
        static_lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q_lat.copy_(_randn(batch, heads, RANK, seed=100 + step))
        q_rope.copy_(_randn(batch, heads, ROPE, seed=200 + step))
        graph.replay()
        expected = _decode_expected(q_lat, q_rope, cache, tables, static_lens)
        assert_close_to_float64(static_out.clone(), expected, DTYPE)


@pytest.mark.parametrize("heads", [128, 16])
def test_mla_prefill_on_cuda_matches_float64(heads):
    pairs = [(1024, 1024), (2048, 512), (4096, 4), (300, 0), (777, 777)]  # prefill, chunk, verify, idle, odd
    cache, tables, lens = _latent_cache([c for c, _ in pairs], seed=6)
    q_lens = torch.tensor([q for _, q in pairs])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0)]).to(CUDA, torch.int32)
    tokens, longest = int(q_lens.sum()), int(q_lens.max())
    q_lat, q_rope = _randn(tokens, heads, RANK, seed=7), _randn(tokens, heads, ROPE, seed=8)
    out = mla_prefill_triton(q_lat, q_rope, cache, tables, lens, starts, longest, SCALE)
    expected = mla_prefill_ref(
        q_lat.double(), q_rope.double(), cache.double(), tables, lens, starts, longest, SCALE
    )
    assert_close_to_float64(out, expected, DTYPE)


def test_mla_verify_replays_in_a_cuda_graph():
    batch, q_len, heads = 4, 4, 16
    cache, tables, lens = _latent_cache([2048] * batch, seed=9, spare_columns=0)
    starts = (torch.arange(batch + 1, dtype=torch.int32) * q_len).to(CUDA)
    q_lat, q_rope = _randn(batch * q_len, heads, RANK, seed=10), _randn(batch * q_len, heads, ROPE, seed=11)
    mla_prefill_triton(q_lat, q_rope, cache, tables, lens, starts, q_len, SCALE)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = mla_prefill_triton(q_lat, q_rope, cache, tables, lens, starts, q_len, SCALE)
    for new_lens in ([4, 100, 2048, 1500], [2048] * batch):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        graph.replay()
        expected = mla_prefill_ref(
            q_lat.double(), q_rope.double(), cache.double(), tables, lens, starts, q_len, SCALE
        )
        assert_close_to_float64(static_out.clone(), expected, DTYPE)


def test_store_latent_on_cuda_matches_reference():
    latent, k_pe = _randn(37, RANK, seed=12), _randn(37, ROPE, seed=13)
    slots = torch.randperm(64 * BLOCK, generator=_gen(14))[:37].to(CUDA)
    slots[5] = -1
    cache = torch.zeros(64, BLOCK, RANK + ROPE, dtype=DTYPE, device=CUDA)
    expected = store_latent_ref(latent, k_pe, cache.clone(), slots)
    assert torch.equal(store_latent_triton(latent, k_pe, cache, slots), expected)


def test_grouped_topk_triton_on_cuda_in_a_graph_matches_the_reference():
    logits = torch.randn(64, 256, generator=_gen(15)).to(CUDA)
    bias = (torch.randn(256, generator=_gen(16)) * 0.01).to(CUDA)
    want_w, want_ids = grouped_topk(logits, bias, 8, 8, 4, True, 2.5)
    grouped_topk_triton(logits, bias, 8, 8, 4, True, 2.5)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids = grouped_topk_triton(logits, bias, 8, 8, 4, True, 2.5)
    graph.replay()
    order, want_order = ids.long().argsort(-1), want_ids.long().argsort(-1)
    assert torch.equal(ids.long().gather(1, order), want_ids.long().gather(1, want_order))
    torch.testing.assert_close(w.gather(1, order), want_w.gather(1, want_order), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_grouped_route_on_cuda_in_a_graph_matches_float64(tokens):
    """The one-launch router + grouped top-k at DeepSeek-V3's shape (hidden 7168, 256 experts in 8
    groups, 4 kept, top 8), every launch tile, replayed twice (the arrival counters reset)."""
    from tpfuse.kernels.moe_grouped_router import grouped_route_ref, grouped_route_triton
    from tpfuse.kernels.moe_router import ROUTE_TILES

    x = _randn(tokens, 7168, seed=40)
    gate = (torch.randn(256, 7168, generator=_gen(41)) / 7168**0.5).to(CUDA)
    bias = (torch.randn(256, generator=_gen(42)) * 0.01).to(CUDA)
    want_w, want_ids = grouped_route_ref(x.double(), gate.double(), bias, 8, 8, 4, True, 2.5)
    want_order = want_ids.long().argsort(-1)
    for tile in ROUTE_TILES:
        grouped_route_triton(x, gate, bias, 8, 8, 4, True, 2.5, tile)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            w, ids = grouped_route_triton(x, gate, bias, 8, 8, 4, True, 2.5, tile)
        for _ in range(2):
            w.fill_(float("nan"))
            ids.fill_(-1)
            graph.replay()
            order = ids.long().argsort(-1)
            assert torch.equal(ids.long().gather(1, order), want_ids.long().gather(1, want_order)), tile
            torch.testing.assert_close(w.gather(1, order).double(), want_w.gather(1, want_order), rtol=1e-5,
                                       atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("heads", [128, 16])
def test_mla_rope_norm_store_on_cuda_matches_reference(heads):
    from tpfuse.kernels.mla_rope_store import mla_rope_norm_store_ref, mla_rope_norm_store_triton
    from tpfuse.kernels.rope import rope_cos_sin_cache

    tokens = 37
    q = _randn(tokens, heads, 128 + ROPE, seed=17)
    a = _randn(tokens, 1536 + RANK + ROPE, seed=18)  # the fused q_a / kv_a projection's output
    latent, k_pe = a[:, 1536 : 1536 + RANK], a[:, 1536 + RANK :]
    weight = _randn(RANK, seed=19)
    scaling = {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
               "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
    cos_sin = rope_cos_sin_cache(ROPE, 163840, 10000.0, scaling).to(CUDA)
    positions = torch.randint(0, 163840, (tokens,), generator=_gen(20)).to(CUDA)
    slots = torch.randperm(64 * BLOCK, generator=_gen(21))[:tokens].to(CUDA)
    slots[3] = -1
    caches = [torch.zeros(64, BLOCK, RANK + ROPE, dtype=DTYPE, device=CUDA) for _ in range(2)]
    args = (positions, q[..., 128:], latent, k_pe, weight, 1e-6, cos_sin)
    want = mla_rope_norm_store_ref(*args, caches[0], slots, True)
    got = mla_rope_norm_store_triton(*args, caches[1], slots, True)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(caches[1], caches[0], rtol=1e-2, atol=1e-2)
