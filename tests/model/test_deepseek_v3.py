"""DeepseekV3ForCausalLM checkpoints written by transformers' save_pretrained give transformers' float32
logits and greedy tokens at TP 1 and the same greedy tokens at TP 2 over gloo: with and without the
q LoRA, with YaRN rope (mscale attention factor), a dense first layer, shared experts, and
group-limited routing whose groups tie on every token."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.model.harness import (
    PagedSequences,
    copy_without_tensor,
    greedy,
    greedy_on_rank,
    hf_greedy_tokens,
    hf_logits,
    load_for_test,
    relative_error,
)
from tpfuse.model.kv_layout import LatentCacheLayout

TOLERANCE = 1e-4
PROMPTS = [[5, 250, 17, 3, 99, 42, 7, 7, 100, 31], [1, 2, 200]]
NEW_TOKENS = 6
SHAPE = dict(
    vocab_size=253, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8,
    v_head_dim=10, n_routed_experts=8, num_experts_per_tok=3, first_k_dense_replace=1,
    max_position_embeddings=512, rms_norm_eps=1e-6,
)  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
VARIANTS = {
    # q LoRA, YaRN, 4 groups of 2 experts of which 2 are kept, groups 0 and 1 tie on every token
    "q_lora_yarn_tied_groups": dict(q_lora_rank=20, n_group=4, topk_group=2, n_shared_experts=1,
                                    routed_scaling_factor=2.5, norm_topk_prob=True, rope_parameters=YARN),
    # one q projection, no group limit, two shared experts, weights not renormalised, neox rope
    "no_q_lora": dict(q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2,
                      routed_scaling_factor=1.5, norm_topk_prob=False, rope_interleave=False),
}  # fmt: skip


def build_deepseek_checkpoint(
    directory, kind: str, seed: int = 0, tie_groups: bool | None = None, **overrides
):
    """A random float32 transformers DeepseekV3ForCausalLM of VARIANTS[kind], saved sharded to directory.
    Every norm, bias and router weight is drawn so that it matters; in the tied variant the router rows
    and biases of group 1 equal group 0's in every MoE layer (tie_groups overrides that)."""
    import transformers

    config = transformers.DeepseekV3Config(**{**SHAPE, **VARIANTS[kind], **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("gate.weight"):
                param.copy_(torch.randn_like(param) * 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
        if ("tied" in kind) if tie_groups is None else tie_groups:
            for layer in model.model.layers[config.first_k_dense_replace :]:
                layer.mlp.gate.weight[2:4] = layer.mlp.gate.weight[0:2]
                layer.mlp.gate.e_score_correction_bias[2:4] = layer.mlp.gate.e_score_correction_bias[0:2]
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="100KB")
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, list[list[int]], torch.Tensor]]:
    """kind -> (directory, transformers' greedy tokens, transformers' prompt logits)."""
    found = {}
    for kind in VARIANTS:
        directory = tmp_path_factory.mktemp(kind)
        hf_model = build_deepseek_checkpoint(directory, kind)
        logits = torch.cat(hf_logits(hf_model, PROMPTS))
        found[kind] = (str(directory), hf_greedy_tokens(hf_model, PROMPTS, NEW_TOKENS), logits)
    return found


@pytest.mark.parametrize("kind", list(VARIANTS))
def test_single_rank_logits_and_greedy_tokens_match_transformers(checkpoints, kind):
    directory, want_tokens, want_logits = checkpoints[kind]
    model, config = load_for_test(directory)
    assert config.architecture == "DeepseekV3ForCausalLM" and config.mla is not None
    assert [type(layer.mlp).__name__ for layer in model.layers] == [
        "GatedMLP",
        "DeepseekV3MoE",
        "DeepseekV3MoE",
    ]
    tokens, prefill = greedy(model, PROMPTS, NEW_TOKENS)
    assert relative_error(prefill, want_logits) <= TOLERANCE
    assert tokens == want_tokens


def test_chunked_prefill_over_the_latent_cache_matches_one_pass(checkpoints):
    directory, _, want_logits = checkpoints["q_lora_yarn_tied_groups"]
    model, _ = load_for_test(directory)
    seqs = PagedSequences(model, 1)
    first, _ = seqs.step([PROMPTS[0][:4]])
    rest, _ = seqs.step([PROMPTS[0][4:]])
    assert relative_error(torch.cat([first, rest]), want_logits[: len(PROMPTS[0])]) <= TOLERANCE


def test_the_model_declares_a_latent_cache_replicated_over_ranks(checkpoints):
    model, config = load_for_test(checkpoints["no_q_lora"][0])
    layout = model.kv_cache_layout(2)
    assert layout == LatentCacheLayout(3, 24, 8, torch.float32) == model.kv_cache_layout(8)
    assert layout.bytes_per_block(16) == 3 * 16 * (24 + 8) * 4


def test_two_ranks_split_heads_and_experts_and_give_transformers_greedy_tokens(checkpoints):
    directories = {kind: entry[0] for kind, entry in checkpoints.items()}
    ranks = run_distributed(greedy_on_rank, 2, directories, PROMPTS, NEW_TOKENS, timeout=300)
    for kind, (_, want_tokens, want_logits) in checkpoints.items():
        for rank in ranks:
            tokens, prefill = rank[kind]
            assert tokens == want_tokens, kind
            assert relative_error(torch.from_numpy(prefill), want_logits) <= TOLERANCE


def test_triton_kernels_match_torch_references_inside_the_model(tmp_path, monkeypatch):
    """The strided q_latent / q_rope views, latent rows and split views MLA hands the Triton kernels
    (interpreted on CPU) are valid: same logits as the torch references, prefill and decode. Groups do
    not tie here: the Triton router breaks ties to the lower id, torch.topk its own way."""
    from tests.model.harness import run_prefill_then_decode
    from tpfuse import knobs

    build_deepseek_checkpoint(tmp_path, "q_lora_yarn_tied_groups", tie_groups=False)
    model, _ = load_for_test(tmp_path)
    runs = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv("TPFUSE_KERNELS", mode)
        knobs.reload()
        runs[mode] = run_prefill_then_decode(model, [PROMPTS[0][:5], PROMPTS[1]], [[7, 8]])
    assert relative_error(runs["triton"][0], runs["torch"][0]) <= 1e-4
    assert relative_error(runs["triton"][1][0], runs["torch"][1][0]) <= 1e-4


def test_the_one_launch_router_routes_as_the_router_linear_and_grouped_topk(checkpoints, monkeypatch):
    """Each MoE layer's two routes (model/moe_choice.py picks per token bucket) give the same experts,
    tied groups included, and weights equal to float32 rounding (interpreted Triton kernels)."""
    from tpfuse import knobs
    from tpfuse.kernels.moe_router import ROUTE_TILES

    model, _ = load_for_test(checkpoints["q_lora_yarn_tied_groups"][0])
    monkeypatch.setenv("TPFUSE_KERNELS", "triton")
    knobs.reload()
    x = torch.randn(5, SHAPE["hidden_size"], generator=torch.Generator().manual_seed(0))
    for layer in model.layers[SHAPE["first_k_dense_replace"] :]:
        want_weights, want_ids = layer.mlp.route_with(x, None)
        for tile in ROUTE_TILES:
            weights, ids = layer.mlp.route_with(x, tile)
            assert torch.equal(ids, want_ids), tile
            torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)


def test_unsupported_routing_and_a_missing_latent_projection_are_named(checkpoints, tmp_path):
    import json
    from pathlib import Path

    from tpfuse.model.config import ModelConfig
    from tpfuse.model.loader import CheckpointError

    directory = checkpoints["no_q_lora"][0]
    hf = json.loads(Path(directory, "config.json").read_text())
    with pytest.raises(ValueError, match="scoring_func 'sigmoid'"):
        ModelConfig.from_hf_dict({**hf, "scoring_func": "softmax"})
    with pytest.raises(ValueError, match=r"n_routed_experts \(8\) must split into n_group \(3\)"):
        ModelConfig.from_hf_dict({**hf, "n_group": 3})
    missing = "model.layers.1.self_attn.kv_b_proj.weight"
    copy_without_tensor(directory, tmp_path, missing)
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        load_for_test(tmp_path)


def test_a_missing_shared_expert_tensor_is_named(checkpoints, tmp_path):
    from tpfuse.model.loader import CheckpointError

    missing = "model.layers.2.mlp.shared_experts.up_proj.weight"
    copy_without_tensor(checkpoints["q_lora_yarn_tied_groups"][0], tmp_path, missing)
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        load_for_test(tmp_path)
