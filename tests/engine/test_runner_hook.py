"""The runner's one extension seam (engine/runner_hook.py): a plain runner has no hook and knows nothing
of speculation; a hook is called at fixed points (sizing, allocate, every forward); SpecWorker
implements every member of it."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import tpfuse.engine.engine as engine_module
from tpfuse.config import EngineConfig
from tpfuse.engine.llm import LLM
from tpfuse.engine.runner import ModelRunner
from tpfuse.engine.runner_hook import RunnerHook
from tpfuse.engine.spec_worker import SpecWorker, speculative_hook, worker_of

from .spec_helpers import ENGINE, PROMPTS, greedy, spec_config, write_eagle3_head

ENGINE_DIR = pathlib.Path(__file__).parents[2] / "src" / "tpfuse" / "engine"


def _hook_members() -> list[str]:
    methods = [n for n, v in vars(RunnerHook).items() if callable(v) and not n.startswith("_")]
    return sorted({*RunnerHook.__annotations__, *methods})


def test_runner_and_graphs_import_nothing_speculative():
    for name in ("runner.py", "cuda_graphs.py"):
        tree = ast.parse((ENGINE_DIR / name).read_text())
        imported = [
            node.module if isinstance(node, ast.ImportFrom) else alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        ]
        assert not [m for m in imported if "spec" in m], (name, imported)


def test_a_plain_runner_has_no_hook_and_no_speculative_worker():
    config = EngineConfig(**ENGINE)
    assert speculative_hook(config) is None
    runner = ModelRunner(config, hook=speculative_hook(config))
    assert runner.hook is None and not hasattr(runner, "spec")
    with pytest.raises(ValueError, match="no speculative worker"):
        worker_of(runner)


class RecordingHook:
    """A RunnerHook that changes nothing the model computes and records what the runner asks of it."""

    max_positions = 40
    position_margin = 4
    max_extra_query_rows = 2
    fills_extra_rows = False
    tree_attention = False

    def __init__(self, model, model_config, parallel, device):
        self.calls: list[tuple] = []

    def models(self):
        return []

    def bytes_per_block(self, tp_size, block_size):
        self.calls.append(("bytes_per_block", tp_size, block_size))
        return 0

    def allocate(self, num_blocks, block_size, tp_size, max_rows, max_seq_len):
        self.calls.append(("allocate", num_blocks, block_size, tp_size, max_rows, max_seq_len))

    def fill_extra_rows(self, batch_size, extra_rows, block_tables):
        raise AssertionError("an eager runner never fills extra rows")

    def after_forward(self, aux, slot_mapping):
        self.calls.append(("after_forward", aux, slot_mapping.numel()))


def test_the_runner_calls_its_hook_at_fixed_points_and_keeps_its_tokens(monkeypatch):
    expected = [o.token_ids for o in LLM(**ENGINE).generate(PROMPTS[:2], greedy(6))]
    runners = []

    def with_hook(config):
        runners.append(ModelRunner(config, hook=RecordingHook))
        return runners[-1]

    monkeypatch.setattr(engine_module, "_make_executor", with_hook)
    llm = LLM(**ENGINE)
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], greedy(6))] == expected
    [runner] = runners
    calls = runner.hook.calls
    assert set(RecordingHook.__dict__) >= set(_hook_members())
    # max_model_len keeps the margin inside the hook's positions; allocate gets that bound back
    assert runner.max_model_len == RecordingHook.max_positions - RecordingHook.position_margin
    config = llm.engine.config
    assert calls[:2] == [
        ("bytes_per_block", 1, config.block_size),
        ("allocate", 256, config.block_size, 1, config.max_running_requests, RecordingHook.max_positions),
    ]
    forwards = [c for c in calls[2:] if c[0] == "after_forward"]
    assert len(forwards) == len(calls) - 2 >= 6  # every forward, nothing else
    assert all(aux is None for _, aux, _ in forwards)  # the plain model has no aux layers


def test_spec_worker_implements_every_runner_hook_member(tmp_path):
    config = EngineConfig(**ENGINE, speculative=spec_config("eagle3", write_eagle3_head(str(tmp_path))))
    runner = ModelRunner(config, hook=speculative_hook(config))
    worker = worker_of(runner)
    assert isinstance(worker, SpecWorker)
    members = _hook_members()
    assert {"after_forward", "allocate", "bytes_per_block", "fill_extra_rows", "models"} <= set(members)
    for name in members:
        assert getattr(type(worker), name) is not getattr(RunnerHook, name, None), name
        getattr(worker, name)
    assert worker.models() == [worker.head]
    assert worker.bytes_per_block(1, config.block_size) > 0
    assert worker.position_margin == 4 and worker.max_extra_query_rows == 3
    assert worker.fills_extra_rows and not worker.tree_attention
    assert worker.max_positions >= runner.max_model_len + worker.position_margin
    # after_forward stores fc(aux) at the step's slots; padding (slot -1) goes to the spare last row
    hidden = runner.model_config.hidden_size
    aux = torch.randn(3, 3 * hidden, generator=torch.Generator().manual_seed(0)).to(runner.model_config.dtype)
    slots = torch.tensor([5, 17, -1])
    worker.after_forward(aux, slots)
    stored = worker.features[torch.tensor([5, 17, worker.features.shape[0] - 1])]
    torch.testing.assert_close(stored, worker.head.combine_features(aux), rtol=0, atol=0)
    tables = torch.zeros(2, 4, dtype=torch.int32)
    drafts = worker.fill_extra_rows(2, 3, tables)
    assert drafts.shape == (2, 3) and drafts.dtype == torch.int64
    assert ((drafts >= 0) & (drafts < runner.vocab_size)).all()
