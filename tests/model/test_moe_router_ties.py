"""A router tie on the top-k boundary: in both sparse layers of the tiny Qwen3-MoE (top-2 of 5),
router rows 0 = 2v, 1 = 3 = v give every token bit-identical scores for experts 1 and 3, and on the
tokens where v . x > 0 expert 0 is first and experts 2 and 4 are below the tie, so exactly one of 1
and 3 is chosen (the renormalised weights are the same either way; the expert outputs differ).

The rule: tpfuse gives a tie to the lower expert id (kernels/moe_routing.py, kernel and reference).
transformers takes torch.topk's order, which does not specify ties (on the CPU it varies with where
the other scores lie; on this checkpoint it takes expert 3 for some tokens). So the test checks
tpfuse against transformers with its router made to follow the lower-id rule, and that the other
choice gives logits far from tpfuse's, so the tie is really decided inside the compared tokens.
"""

from __future__ import annotations

import pytest
import torch

from tests.model.harness import PagedSequences, build_hf_checkpoint, load_for_test, relative_error

SPARSE_LAYERS = (0, 2)  # layer 1 is dense (mlp_only_layers)
TIED = (1, 3)
PROMPTS = [[5, 250, 17, 3, 99, 42, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 200, 77, 31]]
NEW_TOKENS = 5
TOLERANCE = 1e-4


def tie_on_the_boundary(hf_model) -> None:
    with torch.no_grad():
        for layer in SPARSE_LAYERS:
            weight = hf_model.model.layers[layer].mlp.gate.weight
            v = weight[1] * 4
            weight[0] = 2 * v
            weight[TIED[0]] = v
            weight[TIED[1]] = v
            hf_model.model.layers[layer].mlp.experts.down_proj[TIED[1]] *= 4  # the choice shows


def boundary_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[T] bool: experts 1 and 3 tie bit for bit, expert 0 is above them, experts 2 and 4 below."""
    a, b = logits[:, TIED[0]], logits[:, TIED[1]]
    below = (logits[:, [2, 4]] < a[:, None]).all(-1)
    return (a == b) & (logits[:, 0] > a) & below


def tie_rule_router(lower: bool):
    """Qwen3MoeTopKRouter.forward with ties to the lower (or the higher) expert id."""

    def forward(self, hidden_states):
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(hidden_states, self.weight)
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        ordered = probs if lower else probs.flip(-1)
        values, ids = torch.sort(ordered, dim=-1, descending=True, stable=True)
        values, ids = values[:, : self.top_k], ids[:, : self.top_k]
        if not lower:
            ids = self.num_experts - 1 - ids
        if self.norm_topk_prob:
            values = values / values.sum(dim=-1, keepdim=True)
        return logits, values.to(logits.dtype), ids

    return forward


def hf_logits_and_tokens(hf_model, monkeypatch, lower: bool):
    """transformers' prompt logits [T, V] (prompts concatenated) and greedy tokens under a tie rule."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    with monkeypatch.context() as patch:
        patch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", tie_rule_router(lower))
        logits, tokens = [], []
        with torch.no_grad():
            for prompt in PROMPTS:
                ids = torch.tensor([prompt])
                logits.append(hf_model(ids).logits[0])
                for _ in range(NEW_TOKENS):
                    ids = torch.cat([ids, hf_model(ids).logits[:, -1:].argmax(-1)], dim=1)
                tokens.append(ids[0, len(prompt) :].tolist())
    return torch.cat(logits), tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_moe_boundary_tie")
    hf_model = build_hf_checkpoint(directory, "qwen3_moe")
    tie_on_the_boundary(hf_model)
    hf_model.save_pretrained(directory)
    return str(directory), hf_model


@pytest.fixture(scope="module")
def tpfuse_run(checkpoint):
    """tpfuse's prompt logits, greedy tokens and, per sparse layer, the prefill's (router logits, ids)."""
    model, _ = load_for_test(checkpoint[0])
    routed = {}
    for layer in SPARSE_LAYERS:
        block = model.layers[layer].mlp

        def route(x, block=block, layer=layer):
            weights, ids = type(block).route(block, x)
            routed.setdefault(layer, (block.gate(x), ids))  # the first call: the prefill
            return weights, ids

        block.route = route
    seqs = PagedSequences(model, len(PROMPTS))
    logits, _ = seqs.step(PROMPTS)
    ends = torch.tensor([len(p) for p in PROMPTS]).cumsum(0) - 1
    tokens = [[t] for t in logits[ends].argmax(-1).tolist()]
    for _ in range(NEW_TOKENS - 1):
        step, _ = seqs.step([[t[-1]] for t in tokens], is_decode=True)
        for row, t in zip(tokens, step.argmax(-1).tolist(), strict=True):
            row.append(t)
    return logits, tokens, routed


def test_the_tie_lands_on_the_top_k_boundary_and_goes_to_the_lower_expert(tpfuse_run):
    _, _, routed = tpfuse_run
    for layer in SPARSE_LAYERS:
        logits, ids = routed[layer]
        assert torch.equal(logits[:, TIED[0]], logits[:, TIED[1]])  # bit-identical on every token
        boundary = boundary_tokens(logits)
        assert boundary.sum() >= 3, (layer, boundary)
        chosen = ids[boundary].long()
        assert (chosen[:, 0] == 0).all() and (chosen[:, 1] == TIED[0]).all(), (layer, chosen)


def test_transformers_scores_the_same_boundary_tie(checkpoint):
    _, hf_model = checkpoint
    seen = {}

    def keep(layer):
        def hook(module, args, out):  # returns None: the output is left as it is
            seen.setdefault(layer, out[0])

        return hook

    hooks = [hf_model.model.layers[i].mlp.gate.register_forward_hook(keep(i)) for i in SPARSE_LAYERS]
    try:
        with torch.no_grad():
            hf_model(torch.tensor([PROMPTS[0]]))
    finally:
        for hook in hooks:
            hook.remove()
    for layer in SPARSE_LAYERS:
        assert boundary_tokens(seen[layer]).sum() >= 3, layer


def test_tpfuse_equals_transformers_under_the_lower_id_rule_and_the_tie_decides(
    checkpoint, tpfuse_run, monkeypatch
):
    _, hf_model = checkpoint
    logits, tokens, _ = tpfuse_run
    lower_logits, lower_tokens = hf_logits_and_tokens(hf_model, monkeypatch, lower=True)
    assert relative_error(logits, lower_logits) <= TOLERANCE
    assert tokens == lower_tokens
    higher_logits, _ = hf_logits_and_tokens(hf_model, monkeypatch, lower=False)
    assert relative_error(logits, higher_logits) > 100 * TOLERANCE
