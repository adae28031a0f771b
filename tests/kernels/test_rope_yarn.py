"""YaRN rope scaling (DeepSeek-V3's rope_scaling) against transformers' rotary embedding."""

import pytest
import torch

from tpfuse.kernels.rope import rope_cos_sin_cache, yarn_inv_freq, yarn_mscale


@pytest.mark.parametrize(
    "mscale,mscale_all_dim,factor",
    [(1.0, 1.0, 40.0), (0.707, 1.0, 16.0), (None, None, 4.0)],
    ids=["deepseek-v3", "unequal-mscales", "plain-yarn"],
)
def test_yarn_cos_sin_cache_matches_transformers(mscale, mscale_all_dim, factor):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    rope_dim, theta = 16, 10000.0
    scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": 64,
               "beta_fast": 32, "beta_slow": 1}  # fmt: skip
    if mscale is not None:
        scaling.update(mscale=mscale, mscale_all_dim=mscale_all_dim)
    config = DeepseekV3Config(
        hidden_size=64, num_attention_heads=4, qk_rope_head_dim=rope_dim,
        max_position_embeddings=64 * int(factor), rope_parameters={"rope_theta": theta, **scaling},
    )  # fmt: skip
    rotary = DeepseekV3RotaryEmbedding(config)
    inv_freq, attention_factor = yarn_inv_freq(rope_dim, theta, scaling)
    torch.testing.assert_close(inv_freq.float(), rotary.inv_freq, rtol=1e-6, atol=0)
    assert attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)
    positions = torch.tensor([0, 1, 7, 30, 63])
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    cache = rope_cos_sin_cache(rope_dim, 64 * int(factor), theta, scaling)[positions]
    half = rope_dim // 2
    torch.testing.assert_close(cache[:, :half], cos[0, :, :half], rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(cache[:, half:], sin[0, :, :half], rtol=2e-6, atol=2e-6)


def test_yarn_mscale_is_one_without_extension():
    assert yarn_mscale(1.0, 1.0) == 1.0
    assert yarn_mscale(40.0, 1.0) == pytest.approx(1.0 + 0.1 * torch.tensor(40.0).log().item())
