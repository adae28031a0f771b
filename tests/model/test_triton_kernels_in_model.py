"""The model gives the same logits on the Triton kernels (interpreted on CPU) as on the torch
references: the strided q/k/v views, paged layouts and qk-norm reshapes it hands them are valid."""

from __future__ import annotations

import pytest

from tests.model.harness import build_hf_checkpoint, load_for_test, relative_error, run_prefill_then_decode
from tpfuse import knobs
from tpfuse.model import attention, layers

PROMPTS = [[5, 17, 99, 3, 42], [1, 2]]
DECODE_TOKENS = [[7, 8]]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mixtral"])
def test_triton_kernels_match_torch_references_inside_the_model(kind, tmp_path, monkeypatch):
    build_hf_checkpoint(tmp_path, kind, num_hidden_layers=1)  # mixtral: routing, grouping, finalize
    model, _ = load_for_test(tmp_path)
    monkeypatch.setenv("TPFUSE_KERNELS", "torch")
    knobs.reload()
    reference = run_prefill_then_decode(model, PROMPTS, DECODE_TOKENS)
    monkeypatch.setenv("TPFUSE_KERNELS", "triton")
    knobs.reload()
    triton = run_prefill_then_decode(model, PROMPTS, DECODE_TOKENS)
    assert relative_error(triton[0], reference[0]) <= 1e-4
    for got, want in zip(triton[1], reference[1], strict=True):
        assert relative_error(got, want) <= 1e-4


def test_a_qk_norm_layer_norms_rotates_and_stores_in_one_op(tmp_path, monkeypatch):
    """Prefill: one op norms, rotates and stores; decode: the attention op does all of it."""
    build_hf_checkpoint(tmp_path, "qwen3_moe")
    model, _ = load_for_test(tmp_path)
    fused_calls, decode_norms, normed_widths = [], [], []
    real_fused, real_decode = attention.qk_norm_rope_store_kv_op, attention.rope_decode_attention_op
    real_rmsnorm = layers.rmsnorm_op

    def fused(*args):
        fused_calls.append(args[1].shape)
        return real_fused(*args)

    def decode(*args):
        decode_norms.append(args[-1])
        return real_decode(*args)

    def rmsnorm(x, weight, eps):
        normed_widths.append(x.shape[-1])
        return real_rmsnorm(x, weight, eps)

    monkeypatch.setattr(attention, "qk_norm_rope_store_kv_op", fused)
    monkeypatch.setattr(attention, "rope_decode_attention_op", decode)
    monkeypatch.setattr(layers, "rmsnorm_op", rmsnorm)
    prefill, decoded = run_prefill_then_decode(model, PROMPTS, DECODE_TOKENS)
    assert prefill.isfinite().all() and all(d.isfinite().all() for d in decoded)
    layer_count = model.config.num_layers
    assert len(fused_calls) == layer_count  # the prefill pass
    assert len(decode_norms) == layer_count and all(norm is not None for norm in decode_norms)
    assert model.config.head_dim not in normed_widths, "q or k was normed by a separate RMSNorm launch"


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_the_fused_moe_entry_matches_the_references_inside_the_model(kind, tmp_path, monkeypatch):
    """With a per-slot tile recorded for the experts (as start-up timing records it on a GPU), every MoE
    layer of a step takes the fused entry: add + RMSNorm inside the router product, top-k inside the
    experts' first kernel; the logits stay the references'."""
    from tpfuse.kernels import fused_moe_tiles
    from tpfuse.model import moe

    build_hf_checkpoint(tmp_path, kind)
    model, _ = load_for_test(tmp_path)
    monkeypatch.setenv("TPFUSE_KERNELS", "torch")
    knobs.reload()
    reference = run_prefill_then_decode(model, PROMPTS, DECODE_TOKENS)
    blocks = [m for m in model.modules() if isinstance(m, moe.SparseMoeBlock)]
    slot_tile = fused_moe_tiles.MoeTile(1, 16, 32, 1, 4)
    for block in blocks:
        for bucket in (1, 2, 4, 8, 16, 32):
            key = (tuple(block.experts.w13.shape), block.experts.w13.dtype, block.experts.w13.device, bucket)
            monkeypatch.setitem(fused_moe_tiles._CHOSEN_TILES, key, slot_tile)
    entries = []
    real_entry = moe.moe_norm_route

    def counted(*args):
        entries.append(args[0].shape[0])
        return real_entry(*args)

    monkeypatch.setattr(moe, "moe_norm_route", counted)
    monkeypatch.setenv("TPFUSE_KERNELS", "triton")
    knobs.reload()
    triton = run_prefill_then_decode(model, PROMPTS, DECODE_TOKENS)
    assert entries == [7] * len(blocks) + [2] * len(blocks)  # the prefill pass, then the decode step
    assert relative_error(triton[0], reference[0]) <= 1e-4
    for got, want in zip(triton[1], reference[1], strict=True):
        assert relative_error(got, want) <= 1e-4
