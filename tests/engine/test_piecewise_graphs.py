"""Piecewise graphs' passes without the graphs (engine/piecewise_graphs.py, use_graphs=False): what a
replay computes, on the CPU. Every step the decode graphs do not take, padded to its token bucket
with each layer's attention run on the step's own metadata through the static buffers, gives the
eager forward's hidden states, and the engine the same greedy tokens, for paged attention (the tiny
Llama), a MoE model and MLA (DeepSeek-V3); a step past the largest bucket or in a dropped one is
refused (the runner runs it eagerly)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.spec_helpers import ENGINE, greedy, run_with_late_arrival, spec_config, write_eagle3_head
from tpfuse.config import EngineConfig
from tpfuse.engine.engine import LLMEngine
from tpfuse.engine.piecewise_graphs import PiecewiseGraphs, piecewise_sizes
from tpfuse.model.attention import AttentionMetadata

SIZES = [4, 12, 20]  # max_num_batched_tokens is 20


def test_buckets_grow_by_at_most_64_tokens_past_256_and_end_at_the_limit():
    assert piecewise_sizes(0) == []
    assert piecewise_sizes(5) == [5]
    assert piecewise_sizes(20) == [8, 16, 20]
    sizes = piecewise_sizes(512)
    assert sizes[0] == 8 and sizes[-1] == 512 and sizes == sorted(set(sizes))
    assert all(b - a <= 64 for a, b in zip(sizes, sizes[1:], strict=False) if a >= 256)
    assert piecewise_sizes(300)[-2:] == [256, 300]


class _Checked:
    """Runs the piecewise pass of every step it takes, then the plain eager forward of the same step
    (its KV writes are the same values to the same slots), and keeps the largest difference."""

    def __init__(self, runner, sizes, use_graphs: bool = False):
        self.piecewise = PiecewiseGraphs(runner.model, runner.kv_caches, sizes, use_graphs=use_graphs)
        self.piecewise.capture()
        self.model, self.kv_caches = runner.model, runner.kv_caches
        self.kept, self.sizes, self.bucket = self.piecewise.kept, self.piecewise.sizes, self.piecewise.bucket
        self.token_counts: list[int] = []
        self.mixed_steps = 0
        self.worst = 0.0

    def run(self, input_ids, positions, slot_mapping, attn: AttentionMetadata):
        hidden, aux = self.piecewise.run(input_ids, positions, slot_mapping, attn)
        hidden = hidden.clone()
        want, _ = self.model(input_ids, positions, attn, self.kv_caches)
        assert hidden.shape == want.shape
        scale = want.abs().max().item()
        self.worst = max(self.worst, (hidden - want).abs().max().item() / scale)
        self.token_counts.append(input_ids.shape[0])
        # several sequences, not all of one token: decodes (or verify rows) beside prompt chunks
        self.mixed_steps += not attn.is_decode and attn.block_tables.shape[0] > 1
        return hidden, aux


def _check(engine: LLMEngine, plain: list, use_graphs: bool = False, tolerance: float = 1e-5) -> _Checked:
    """Runs the late-arrival traffic through the pieces of engine's runner (checked against the eager
    forward at every step); asserts plain's greedy tokens, padding, the largest bucket, a mixed step."""
    checked = _Checked(engine.executor.runner, SIZES, use_graphs)
    engine.executor.runner.piecewise = checked
    assert run_with_late_arrival(engine, greedy(max_tokens=12)) == plain
    assert checked.worst < tolerance
    counts = checked.token_counts
    assert any(c not in SIZES for c in counts), "no step was padded to its bucket"
    assert any(c > SIZES[1] for c in counts), "no step took the largest bucket"
    assert checked.mixed_steps > 0, "no mixed prefill + decode step went through the pieces"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return checked


def _plain(config: EngineConfig) -> list:
    return run_with_late_arrival(LLMEngine(config), greedy(max_tokens=12))


def test_paged_attention_steps_through_the_pieces_equal_the_eager_forward():
    config = EngineConfig(**ENGINE)
    _check(LLMEngine(config), _plain(config))


def test_moe_steps_through_the_pieces_equal_the_eager_forward(moe_dir):
    config = EngineConfig(model=moe_dir, device="cpu", num_kv_blocks=256, max_num_batched_tokens=20)
    _check(LLMEngine(config), _plain(config))


def test_mla_steps_through_the_pieces_equal_the_eager_forward(deepseek_dir):
    config = EngineConfig(
        model=deepseek_dir, device="cpu", num_kv_blocks=96, block_size=4, max_num_batched_tokens=20
    )
    _check(LLMEngine(config), _plain(config))


def test_a_step_past_the_largest_bucket_or_in_a_dropped_one_is_refused():
    engine = LLMEngine(EngineConfig(**ENGINE))
    runner = engine.executor.runner
    piecewise = PiecewiseGraphs(runner.model, runner.kv_caches, SIZES, use_graphs=False)
    assert [piecewise.bucket(t) for t in (1, 4, 5, 12, 13, 20, 21)] == [4, 4, 12, 12, 20, 20, None]
    piecewise.kept = {12, 20}  # as choose() leaves it when bucket 4 loses to the eager forward
    assert [piecewise.bucket(t) for t in (3, 5)] == [None, 12]
    ids = torch.zeros(3, dtype=torch.int64)
    attn = piecewise._metadata(3)
    with pytest.raises(ValueError, match="no piecewise graph takes a step of 3 tokens"):
        piecewise.run(ids, ids, torch.full((3,), -1), attn)
    with pytest.raises(ValueError, match="at least one token bucket"):
        PiecewiseGraphs(runner.model, runner.kv_caches, [])


def test_eagle3_speculation_with_its_plain_steps_through_the_pieces_equals_plain_greedy(tmp_path):
    """A speculative engine's eager steps (prompt chunks beside verify rows) go through the pieces too
    (spec_forward: runner.forward_tokens); the EAGLE-3 hook reads its aux features from the static
    aux rows of the step."""
    head = write_eagle3_head(str(tmp_path))
    config = EngineConfig(**ENGINE, speculative=spec_config("eagle3", head, adaptive=False))
    _check(LLMEngine(config), _plain(EngineConfig(**ENGINE)))
