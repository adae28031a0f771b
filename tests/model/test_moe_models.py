"""Qwen3-MoE and Mixtral checkpoints written by transformers' save_pretrained (sharded, per-expert
tensor names as the Hub stores them) give transformers' float32 logits and greedy tokens at TP 1,
and the same greedy tokens at TP 2 and 4 over gloo. The variants cover mlp_only_layers,
decoder_sparse_step, top-k equal to the expert count (every token takes every expert) and a router
whose two experts tie on every token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.model.harness import (
    MOE_VARIANTS,
    build_hf_checkpoint,
    copy_without_tensor,
    greedy,
    greedy_on_rank,
    hf_greedy_tokens,
    hf_logits,
    load_for_test,
    relative_error,
)
from tpfuse.model.loader import CheckpointError

TOLERANCE = 1e-4
PROMPTS = [[5, 250, 17, 3, 99, 42, 7], [1, 2, 200]]
NEW_TOKENS = 6
TIED_ROUTER = "model.layers.2.mlp.gate.weight"  # qwen3_moe: experts 1 and 3 tie for every token


def tie_two_experts(hf_model) -> None:
    """Router rows 1 and 3 equal and large: they score the same for every token, and are both in the
    top 2 or both out of it."""
    with torch.no_grad():
        weight = hf_model.get_parameter(TIED_ROUTER)
        weight[1] = weight[1] * 6
        weight[3] = weight[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, list[list[int]], torch.Tensor]]:
    """kind -> (directory, transformers' greedy tokens, transformers' prompt logits)."""
    found = {}
    for kind in sorted(MOE_VARIANTS):
        directory = tmp_path_factory.mktemp(kind)
        hf_model = build_hf_checkpoint(directory, kind, max_shard_size="60KB")
        if kind == "qwen3_moe":
            tie_two_experts(hf_model)
            hf_model.save_pretrained(directory, max_shard_size="60KB")
        logits = torch.cat(hf_logits(hf_model, PROMPTS))
        found[kind] = (str(directory), hf_greedy_tokens(hf_model, PROMPTS, NEW_TOKENS), logits)
    return found


def test_checkpoints_are_sharded_with_per_expert_tensors(checkpoints):
    directory = checkpoints["mixtral"][0]
    index = json.loads(Path(directory, "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 2
    assert "model.layers.1.block_sparse_moe.experts.2.w3.weight" in index


@pytest.mark.parametrize("kind", sorted(MOE_VARIANTS))
def test_single_rank_logits_and_greedy_tokens_match_transformers(checkpoints, kind):
    directory, want_tokens, want_logits = checkpoints[kind]
    model, config = load_for_test(directory)
    assert config.num_experts == MOE_VARIANTS[kind].get(
        "num_experts", MOE_VARIANTS[kind].get("num_local_experts")
    )
    tokens, prefill = greedy(model, PROMPTS, NEW_TOKENS)
    assert relative_error(prefill, want_logits) <= TOLERANCE
    assert tokens == want_tokens


def test_plain_finalize_path_gives_the_same_tokens(checkpoints, monkeypatch):
    """At TP = 1 the combine runs fused into the residual add + RMSNorm unless measured slower; the
    plain path (combine, then the communicator's fused add + RMSNorm) gives transformers' tokens too."""
    from tpfuse.model import moe_choice

    monkeypatch.setattr(moe_choice, "fuse_finalize", lambda x, num_slots: False)
    directory, want_tokens, want_logits = checkpoints["qwen3_moe"]
    tokens, prefill = greedy(load_for_test(directory)[0], PROMPTS, NEW_TOKENS)
    assert relative_error(prefill, want_logits) <= TOLERANCE
    assert tokens == want_tokens


def test_layer_kinds_follow_mlp_only_layers_and_decoder_sparse_step(checkpoints):
    kinds = {}
    for kind in ("qwen3_moe", "qwen3_moe_step"):
        model, _ = load_for_test(checkpoints[kind][0])
        kinds[kind] = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds["qwen3_moe"] == ["SparseMoeBlock", "GatedMLP", "SparseMoeBlock"]
    assert kinds["qwen3_moe_step"] == ["GatedMLP", "SparseMoeBlock"]


def test_tied_router_rows_score_the_two_experts_equally(checkpoints):
    model, _ = load_for_test(checkpoints["qwen3_moe"][0])
    weight = model.layers[2].mlp.gate.weight
    assert torch.equal(weight[1], weight[3])


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_experts_give_transformers_greedy_tokens(checkpoints, tp_size):
    directories = {kind: entry[0] for kind, entry in checkpoints.items()}
    ranks = run_distributed(greedy_on_rank, tp_size, directories, PROMPTS, NEW_TOKENS, timeout=300)
    for kind, (_, want_tokens, want_logits) in checkpoints.items():
        for rank in ranks:
            tokens, prefill = rank[kind]
            assert tokens == want_tokens, (kind, tp_size)
            assert relative_error(torch.from_numpy(prefill), want_logits) <= TOLERANCE


def test_missing_expert_tensor_is_named(checkpoints, tmp_path):
    missing = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    copy_without_tensor(checkpoints["mixtral"][0], tmp_path, missing)
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        load_for_test(tmp_path)


def test_dummy_load_format_fills_every_expert(checkpoints, tmp_path):
    (tmp_path / "config.json").write_text(Path(checkpoints["qwen3_moe"][0], "config.json").read_text())
    model, _ = load_for_test(tmp_path, load_format="dummy")
    w13 = model.layers[0].mlp.experts.w13
    assert torch.isfinite(w13).all() and (w13.abs().sum(dim=(1, 2)) > 0).all()
