"""The model gives the same logits on the Triton kernels (interpreted on CPU) as on the torch
references: the strided q/k/v views, paged layouts and qk-norm reshapes it hands them are valid."""

from __future__ import annotations

import pytest

from tests.model.harness import build_hf_checkpoint, load_for_test, relative_error, run_prefill_then_decode
from tpfuse import knobs

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
