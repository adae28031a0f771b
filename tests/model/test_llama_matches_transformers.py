"""The model's logits equal transformers' (float32, CPU) for every supported architecture."""

from __future__ import annotations

import pytest
import torch

from tests.model.harness import (
    ARCHITECTURE_VARIANTS,
    PagedSequences,
    build_hf_checkpoint,
    hf_logits,
    load_for_test,
    relative_error,
    run_prefill_then_decode,
)

TOLERANCE = 1e-4
PROMPT_LENGTHS = (7, 13, 2)
NUM_DECODE_STEPS = 3


def random_tokens(generator: torch.Generator, vocab_size: int, length: int) -> list[int]:
    return torch.randint(0, vocab_size, (length,), generator=generator).tolist()


@pytest.fixture(scope="module", params=sorted(ARCHITECTURE_VARIANTS))
def checkpoint(request, tmp_path_factory):
    """(kind, directory, hf_model, prompts, decode_tokens, hf logits of prompt + decode tokens)."""
    kind = request.param
    directory = tmp_path_factory.mktemp(kind)
    hf_model = build_hf_checkpoint(directory, kind)
    g = torch.Generator().manual_seed(1)
    vocab = hf_model.config.vocab_size
    prompts = [random_tokens(g, vocab, n) for n in PROMPT_LENGTHS]
    decode_tokens = [random_tokens(g, vocab, len(prompts)) for _ in range(NUM_DECODE_STEPS)]
    full = [p + [step[i] for step in decode_tokens] for i, p in enumerate(prompts)]
    return kind, directory, hf_model, prompts, decode_tokens, hf_logits(hf_model, full)


def test_prefill_logits_match_transformers_for_prompts_of_different_lengths(checkpoint):
    _, directory, _, prompts, decode_tokens, expected = checkpoint
    model, _ = load_for_test(directory)
    prefill, _ = run_prefill_then_decode(model, prompts, [])
    rows = prefill.split([len(p) for p in prompts])
    for prompt, got, want in zip(prompts, rows, expected, strict=True):
        assert relative_error(got, want[: len(prompt)]) <= TOLERANCE


def test_each_decode_step_logits_match_transformers(checkpoint):
    _, directory, _, prompts, decode_tokens, expected = checkpoint
    model, _ = load_for_test(directory)
    _, decodes = run_prefill_then_decode(model, prompts, decode_tokens)
    for step, got in enumerate(decodes):
        want = torch.stack([e[len(p) + step] for p, e in zip(prompts, expected, strict=True)])
        assert relative_error(got, want) <= TOLERANCE


def test_chunked_prefill_after_cached_prefix_matches_transformers(checkpoint):
    _, directory, _, prompts, _, expected = checkpoint
    model, _ = load_for_test(directory)
    seqs = PagedSequences(model, len(prompts))
    first = [p[:1] for p in prompts]
    seqs.step(first)
    rest, _ = seqs.step([p[1:] for p in prompts])
    rows = rest.split([len(p) - 1 for p in prompts])
    for prompt, got, want in zip(prompts, rows, expected, strict=True):
        assert relative_error(got, want[1 : len(prompt)]) <= TOLERANCE


def test_sharded_checkpoint_with_index_loads_to_the_same_logits(tmp_path):
    hf_model = build_hf_checkpoint(tmp_path, "qwen3", max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    prompts = [[5, 17, 99, 3], [250, 1]]
    model, _ = load_for_test(tmp_path)
    prefill, _ = run_prefill_then_decode(model, prompts, [])
    want = torch.cat(hf_logits(hf_model, prompts))
    assert relative_error(prefill, want) <= TOLERANCE


def test_aux_hidden_states_are_the_inputs_of_the_chosen_layers(tmp_path):
    hf_model = build_hf_checkpoint(tmp_path, "llama", num_hidden_layers=4)
    prompts = [[3, 1, 4, 1, 5], [9, 2]]
    model, _ = load_for_test(tmp_path)
    model.aux_hidden_state_layers = (0, 2, 3)
    seqs = PagedSequences(model, len(prompts))
    _, aux = seqs.step(prompts)
    with torch.no_grad():
        states = [hf_model(torch.tensor([p]), output_hidden_states=True).hidden_states for p in prompts]
    want = torch.cat([torch.cat([s[i][0] for i in (0, 2, 3)], dim=-1) for s in states])
    assert aux.shape == (sum(map(len, prompts)), 3 * hf_model.config.hidden_size)
    assert relative_error(aux, want) <= TOLERANCE


def test_forward_without_aux_layers_returns_none_for_aux(tmp_path):
    build_hf_checkpoint(tmp_path, "mistral")
    model, _ = load_for_test(tmp_path)
    _, aux = PagedSequences(model, 1).step([[1, 2, 3]])
    assert aux is None
