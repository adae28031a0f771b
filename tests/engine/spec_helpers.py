"""Shared builders for the speculative engine tests: drafter settings on the embedded tiny model and a
driver that lets one request arrive while others are already decoding."""

from __future__ import annotations

from collections import defaultdict

from tpfuse.config import EngineConfig, SpeculativeConfig
from tpfuse.engine.engine import LLMEngine
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.model.loader import load_model_config
from tpfuse.spec.eagle3_checkpoint import save_random_eagle3_head

PROMPTS = [
    "The quick brown fox",
    "hi",
    "a somewhat longer prompt that spans several KV blocks, abc abc abc abc",
    "abcabcabcabcabc",
]
LATE_PROMPT = "arriving later: abab abab abab"
# Small budget: long prompts are prefilled in chunks next to speculative decodes (mixed steps).
ENGINE = dict(model="tiny", device="cpu", num_kv_blocks=256, max_num_batched_tokens=20)


def greedy(max_tokens: int = 20, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def write_eagle3_head(directory: str) -> str:
    """A random EAGLE-3 head for the tiny preset in the public format (4 layers: reads layers 0, 1, 2)."""
    target = load_model_config(EngineConfig(model="tiny"))
    save_random_eagle3_head(directory, target, draft_vocab_size=100, aux_layer_ids=(0, 1, 2), std=0.3)
    return directory


def spec_config(algorithm: str, path: str | None = None, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(algorithm=algorithm, draft_model_path=path, num_steps=3, **kw)


def run_with_late_arrival(engine: LLMEngine, params: SamplingParams, steps_before_late: int = 4) -> list:
    """PROMPTS start together; LATE_PROMPT is added after a few steps. Returns token ids per prompt
    (PROMPTS order, then the late one)."""
    tokens = defaultdict(list)
    ids = [engine.tokenizer.encode(p) for p in [*PROMPTS, LATE_PROMPT]]
    for i, prompt in enumerate(ids[:-1]):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(steps_before_late):
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    engine.add_request("late", ids[-1], params)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[f"r{i}"] for i in range(len(PROMPTS))] + [tokens["late"]]


def rig_drafter(monkeypatch, full: list[int]) -> None:
    """Every tree: root, decoy, t1, decoy, t2, t3 with parents -1, 0, 0, 2, 2, 4: the true path is
    nodes 0, 2, 4, 5, so accepting 3 drafts moves slots L+2, L+4, L+5 to L+1, L+2, L+3."""
    import torch

    from tpfuse.spec.eagle3_drafter import Eagle3Drafter
    from tpfuse.spec.tree import DraftTree

    real = Eagle3Drafter.propose_tree

    def rigged(self, inputs, num_steps, topk, num_nodes):
        real(self, inputs, num_steps, topk, num_nodes)  # keeps the head's KV and shapes real
        root = int(inputs.positions[inputs.last_index()][0]) + 1
        t1, t2, t3 = full[root + 1], full[root + 2], full[root + 3]
        tokens = [full[root], (t1 + 1) % 256, t1, (t2 + 1) % 256, t2, t3]
        return DraftTree(
            torch.tensor([tokens]), torch.tensor([[-1, 0, 0, 2, 2, 4]]), torch.tensor([[0, 1, 1, 2, 2, 3]])
        )

    monkeypatch.setattr(Eagle3Drafter, "propose_tree", rigged)
