"""Speculative decoding in the engine on one CUDA GPU (device machine: pytest -m gpu tests/engine):
lossless greedy with per-(bucket, k) verify graphs for every drafter, adaptive on and off, and the
graphs replay exactly what the eager path computes."""

import pytest

from tpfuse.config import EngineConfig
from tpfuse.engine.engine import LLMEngine

from .spec_helpers import greedy, run_with_late_arrival, spec_config, write_eagle3_head

pytestmark = pytest.mark.gpu

CUDA = dict(
    model="tiny", device="cuda", dtype="float32", max_model_len=512, num_kv_blocks=1024,
    cuda_graph_max_bs=8, max_num_batched_tokens=20,
)  # fmt: skip


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory):
    return write_eagle3_head(str(tmp_path_factory.mktemp("eagle3")))


@pytest.fixture(scope="module")
def plain_tokens():
    engine = LLMEngine(EngineConfig(**CUDA))
    return run_with_late_arrival(engine, greedy(32))


def spec_engine(drafter, head_dir, adaptive=True, **kw):
    path = {"eagle3": head_dir, "draft": "tiny", "ngram": None}[drafter]
    config = spec_config(drafter, path, adaptive=adaptive)
    return LLMEngine(EngineConfig(**{**CUDA, **kw}, speculative=config))


def record_replays(engine) -> list:
    graphs = engine.executor.graphs
    replayed, run = [], graphs.run

    def recording_run(step, num_draft_tokens=0):
        replayed.append((step.header.num_seqs, num_draft_tokens))
        return run(step, num_draft_tokens)

    graphs.run = recording_run
    return replayed


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "fixed-k"])
@pytest.mark.parametrize("drafter", ["ngram", "draft", "eagle3"])
def test_speculative_greedy_on_cuda_with_verify_graphs_equals_plain_greedy(
    plain_tokens, head_dir, drafter, adaptive
):
    engine = spec_engine(drafter, head_dir, adaptive)
    assert all(engine.executor.graphs.has(size, k) for size in (1, 2, 4, 8) for k in range(4))
    replayed = record_replays(engine)
    assert run_with_late_arrival(engine, greedy(32)) == plain_tokens
    assert any(k > 0 for _, k in replayed)


@pytest.mark.parametrize("drafter", ["draft", "eagle3"])
def test_per_k_verify_graphs_replay_what_the_eager_path_computes(head_dir, drafter):
    graphed = spec_engine(drafter, head_dir, adaptive=False)
    eager = spec_engine(drafter, head_dir, adaptive=False, enforce_eager=True)
    replayed = record_replays(graphed)
    a = run_with_late_arrival(graphed, greedy(32))
    b = run_with_late_arrival(eager, greedy(32))
    assert a == b
    assert {k for _, k in replayed} == {3}
    stats_a, stats_b = graphed.stats(), eager.stats()
    assert stats_a.spec_num_accepted_tokens_total == stats_b.spec_num_accepted_tokens_total


def test_no_prefill_attention_variant_compiles_after_start_up(head_dir):
    """The runner compiles every prefill-attention variant before it serves, so no chunked prefill,
    verify or drafter catch-up stops to compile one (a 0.6-0.8 s stall on the H200 before): Triton's
    post-compile hook sees none of them compile during a run of plain steps, catch-ups and drafting."""
    import triton

    engine = spec_engine("eagle3", head_dir)
    choices = iter([0] * 12 + [3] * 6 + [0] * 9 + [1] * 1000)
    engine.spec_decoder.policy.choose = lambda num_decode: next(choices)
    compiled = []
    triton.knobs.runtime.jit_post_compile_hook = lambda *args, **kwargs: compiled.append(
        kwargs.get("repr", "")
    )
    try:
        run_with_late_arrival(engine, greedy(40))
    finally:
        triton.knobs.runtime.jit_post_compile_hook = None
    assert engine.spec_decoder.stats.num_drafts > 0
    late = [name for name in compiled if "_prefill_kernel" in name or "_decode_merge_kernel" in name]
    assert not late, f"compiled while serving: {late} (all compiles while serving: {compiled})"
