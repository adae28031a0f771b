"""The fused rope + KV store + decode attention on CUDA at qwen3-30b-a3b and llama shapes, bf16, against
float64, eagerly and as CUDA-graph replays (device machine only)."""

import pytest
import torch

from tests.kernels.paged import assert_close_to_float64
from tests.kernels.test_rope_decode_attention import EPS, SCALE, decode_step_case, float64_expected
from tpfuse.kernels.rope_decode_attention import rope_decode_attention_triton

pytestmark = pytest.mark.gpu


def _cache_close(actual, expected_float64):
    assert torch.equal(actual.isnan(), expected_float64.isnan()), (
        "a cache slot was written that should not be"
    )
    written = ~expected_float64.isnan()
    assert_close_to_float64(actual[written], expected_float64[written], actual.dtype)


@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3_qk_norm", "llama_rope"])
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("in_graph", [False, True], ids=["eager", "graph"])
def test_rope_decode_attention_matches_float64_on_cuda(qk_norm, batch, in_graph):
    gen = torch.Generator().manual_seed(batch)
    contexts = [1, 2048, *torch.randint(1, 3000, (batch,), generator=gen).tolist()][:batch]
    kv_heads, group = (4, 8) if qk_norm else (8, 4)
    args, norms = decode_step_case(contexts, kv_heads, group, 128, torch.bfloat16, seed=batch, block_size=16,
                                   device="cuda")  # fmt: skip
    norms = (*norms, EPS) if qk_norm else None
    expected, k_expected, v_expected = float64_expected(
        args, None if norms is None else norms[:2], round_rotated=True
    )
    out = torch.full_like(args["q"], float("nan"))
    if in_graph:
        # captured with the case's tensors, replayed after q and the caches were reset (the unfused path
        # rotates q in place, as a step's qkv projection rewrites it)
        q_before, k_before, v_before = args["q"].clone(), args["k_cache"].clone(), args["v_cache"].clone()
        rope_decode_attention_triton(**args, scale=SCALE, qk_norm=norms, out=out)  # compile, warm
        args["q"].copy_(q_before)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            rope_decode_attention_triton(**args, scale=SCALE, qk_norm=norms, out=out)
        for tensor, before in (
            (args["q"], q_before),
            (args["k_cache"], k_before),
            (args["v_cache"], v_before),
        ):
            tensor.copy_(before)
        out.fill_(float("nan"))
        graph.replay()
    else:
        rope_decode_attention_triton(**args, scale=SCALE, qk_norm=norms, out=out)
    torch.cuda.synchronize()
    assert_close_to_float64(out, expected, torch.bfloat16)
    _cache_close(args["k_cache"], k_expected)
    _cache_close(args["v_cache"], v_expected)
