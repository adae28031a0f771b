"""benchmarks/roofline.routed_experts counts each MoE layer's distinct experts whether the layer routes
with the top-k kernel or inside its experts (the fused entry): the MoE roofline is built from it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tests.model.harness import PagedSequences, build_hf_checkpoint, load_for_test
from tpfuse import knobs
from tpfuse.kernels import fused_moe_tiles
from tpfuse.model.moe import SparseMoeBlock

sys.path.append(str(Path(__file__).parents[2] / "benchmarks"))
import roofline  # noqa: E402


@pytest.mark.parametrize("fused_entry", [False, True])
def test_every_moe_layer_reports_the_experts_its_step_touched(fused_entry, tmp_path, monkeypatch):
    build_hf_checkpoint(tmp_path, "mixtral")
    model, _ = load_for_test(tmp_path)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    if fused_entry:
        monkeypatch.setenv("TPFUSE_KERNELS", "triton")
        knobs.reload()
        for block in blocks:
            w13 = block.experts.w13
            for bucket in (2, 4, 8):
                key = (tuple(w13.shape), w13.dtype, w13.device, bucket)
                monkeypatch.setitem(
                    fused_moe_tiles._CHOSEN_TILES, key, fused_moe_tiles.MoeTile(1, 16, 32, 1, 4)
                )
    seqs = PagedSequences(model, 1)
    counts = roofline.routed_experts(model, lambda: seqs.step([[3, 9, 27]]), SparseMoeBlock)
    top_k, num_experts = blocks[0].top_k, blocks[0].experts.num_experts
    assert len(counts) == len(blocks)
    assert all(top_k <= c <= min(num_experts, 3 * top_k) for c in counts), counts
    assert "forward" not in vars(blocks[0].experts)  # the wrappers are gone


def test_a_layer_whose_experts_did_not_run_counts_none(tmp_path):
    """A step of one layer (benchmarks/deepseek_decode.py's per-layer table): the other MoE layers
    report 0 experts, not an error."""
    build_hf_checkpoint(tmp_path, "mixtral")
    model, _ = load_for_test(tmp_path)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    x = torch.randn(2, blocks[0].experts.hidden_size)
    counts = roofline.routed_experts(model, lambda: blocks[-1](x), SparseMoeBlock)
    assert counts[:-1] == [0] * (len(blocks) - 1) and blocks[-1].top_k <= counts[-1]
