"""Piecewise CUDA graphs (engine/piecewise_graphs.py) on one GPU: every step the decode graphs do
not take replays its bucket's pieces with the attention cores between them and gives the eager
forward's hidden states (checked at each step) and plain greedy tokens, for paged attention, a MoE
model and MLA; the engine captures and times its buckets at start-up.
Run on the device machine: pytest -m gpu tests/engine/test_gpu_piecewise_graphs.py"""

from __future__ import annotations

import pytest

from tests.engine.spec_helpers import ENGINE, greedy, run_with_late_arrival
from tests.engine.test_piecewise_graphs import SIZES, _check, _plain
from tpfuse.config import EngineConfig
from tpfuse.engine.engine import LLMEngine

pytestmark = pytest.mark.gpu

GPU = dict(device="cuda", dtype="float32", mem_fraction_static=0.3, max_model_len=256)


def _config(**kw) -> EngineConfig:
    return EngineConfig(**{**ENGINE, **GPU, "num_kv_blocks": 256, **kw})


def _replayed(engine: LLMEngine, plain: list) -> None:
    checked = _check(engine, plain, use_graphs=True, tolerance=1e-4)
    layers = len(engine.executor.runner.model.layers)
    assert all(len(p.pieces) == layers + 1 for p in checked.piecewise.graphs.values())
    assert sorted(checked.piecewise.graphs) == SIZES


def test_paged_attention_steps_replay_their_pieces():
    config = _config()
    _replayed(LLMEngine(config), _plain(_config(enforce_eager=True)))


def test_moe_steps_replay_their_pieces(moe_dir):
    config = _config(model=moe_dir)
    _replayed(LLMEngine(config), _plain(_config(model=moe_dir, enforce_eager=True)))


def test_mla_steps_replay_their_pieces(deepseek_dir):
    config = _config(model=deepseek_dir, block_size=4, num_kv_blocks=96)
    eager = _config(model=deepseek_dir, block_size=4, num_kv_blocks=96, enforce_eager=True)
    _replayed(LLMEngine(config), _plain(eager))


def test_the_engine_times_every_bucket_and_serves_with_the_ones_it_kept():
    engine = LLMEngine(_config())
    piecewise = engine.executor.runner.piecewise
    assert piecewise is not None and sorted(piecewise.timings) == piecewise.sizes
    assert all(r > 0 and e > 0 for r, e in piecewise.timings.values())
    assert sorted(piecewise.graphs) == sorted(piecewise.kept)
    plain = _plain(_config(enforce_eager=True))
    assert run_with_late_arrival(engine, greedy(max_tokens=12)) == plain
