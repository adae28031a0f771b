"""KV-cache layouts the model declares: sizes, allocation, and the engine's choice of layout."""

import torch

from tpfuse.engine import kv_cache
from tpfuse.model.kv_layout import GQACacheLayout, LatentCacheLayout
from tpfuse.model.presets import preset_config


def test_gqa_layout_is_the_default_and_sizes_k_and_v_of_every_layer():
    config = preset_config("tiny")
    layout = kv_cache.cache_layout(object(), config, 1)
    assert isinstance(layout, GQACacheLayout)
    heads = kv_cache.num_kv_heads_local(config, 1)
    caches = layout.allocate(3, 4, torch.device("cpu"))
    assert len(caches) == config.num_layers
    assert all(len(c) == 2 and c[0].shape == (3, 4, heads, config.head_dim) for c in caches)
    per_block = sum(t.numel() * t.element_size() for c in caches for t in c) // 3
    assert layout.bytes_per_block(4) == per_block == kv_cache.bytes_per_block(config, 1, 4)


def test_latent_layout_holds_one_row_of_latent_and_rope_per_token_and_layer():
    layout = LatentCacheLayout(num_layers=3, kv_lora_rank=40, rope_dim=8, dtype=torch.bfloat16)
    caches = layout.allocate(5, 16, torch.device("cpu"))
    assert [tuple(c[0].shape) for c in caches] == [(5, 16, 48)] * 3 and all(len(c) == 1 for c in caches)
    assert all((c[0] == 0).all() for c in caches)
    assert layout.bytes_per_block(16) == 3 * 16 * 48 * 2


def test_the_engine_takes_the_layout_a_model_declares():
    declared = LatentCacheLayout(2, 16, 4, torch.float32)

    class Model:
        def kv_cache_layout(self, tp_size):
            return declared

    assert kv_cache.cache_layout(Model(), preset_config("tiny"), 2) is declared
