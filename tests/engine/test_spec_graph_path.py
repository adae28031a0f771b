"""The per-(batch bucket, k) verify graphs on CPU: graphs are stood in for by replaying the captured
body eagerly, so static query offsets, padding rows, in-graph feature writes, in-graph EAGLE-3
window drafting and logits extraction are checked without a GPU."""

import pytest

from tpfuse.config import EngineConfig
from tpfuse.engine.cuda_graphs import DecodeGraphs
from tpfuse.engine.llm import LLM

from .spec_helpers import ENGINE, PROMPTS, greedy, spec_config, write_eagle3_head

MAX_LEN = 128


class RecordingGraphs(DecodeGraphs):
    """Captures nothing: replay runs the body eagerly and records which (bucket, k) it was."""

    def _capture_graph(self, body, pool):
        graphs = self

        class Replay:
            def replay(self):
                graphs.replayed.append(graphs.last_key)
                body()

        return Replay(), pool

    def run(self, step, extra_rows=0):
        self.last_key = (step.header.num_seqs, extra_rows)
        return super().run(step, extra_rows)


@pytest.mark.parametrize("graph_logits", [True, False])
@pytest.mark.parametrize("drafter", ["eagle3", "ngram"])
def test_verify_graphs_per_bucket_and_k_give_the_eager_greedy_tokens(tmp_path, drafter, graph_logits):
    kw = {**ENGINE, "max_model_len": MAX_LEN, "enable_prefix_caching": False}
    expected = [o.token_ids for o in LLM(**kw).generate(PROMPTS[:3], greedy(16))]
    path = write_eagle3_head(str(tmp_path)) if drafter == "eagle3" else None
    llm = LLM(config=EngineConfig(**kw, speculative=spec_config(drafter, path, adaptive=False)))
    runner = llm.engine.executor
    hook = runner.hook  # the SpecWorker: verify graphs for k = 1..3, window drafting inside (eagle3)
    assert hook.max_extra_query_rows == 3 and hook.fills_extra_rows == (drafter == "eagle3")
    width = -(-(runner.max_model_len + hook.position_margin) // runner.block_size)
    graphs = RecordingGraphs(
        runner.model, runner.kv_caches, 4, width, runner.max_model_len, runner.vocab_size, graph_logits,
        hook=hook, token_table=runner.token_table,
    )  # fmt: skip
    graphs.replayed = []
    graphs.capture()
    runner.graphs = graphs
    outputs = [o.token_ids for o in llm.generate(PROMPTS[:3], greedy(16))]
    assert outputs == expected
    assert (4, 3) in graphs.replayed  # 3 decoding sequences padded to bucket 4, k = 3


def _drafts_per_step(llm, prompts, params):
    """Every verify step's drafts that rows use (each cut to its count), in step order."""
    decoder = llm.engine.spec_decoder
    seen, verify = [], decoder._verify

    def recording_verify(forward, k, *args):
        if forward.proposal is not None and k:
            counts = forward.proposal.num_draft_tokens.tolist()
            seen.append([row[:n] for row, n in zip(forward.proposal.token_ids.tolist(), counts, strict=True)])
        return verify(forward, k, *args)

    decoder._verify = recording_verify
    outputs = [o.token_ids for o in llm.generate(prompts, params)]
    return outputs, seen


def test_window_drafting_proposes_what_extending_only_the_lagging_positions_proposes(tmp_path):
    """The window re-extends positions the head already holds; it must not change any draft."""
    path = write_eagle3_head(str(tmp_path))
    kw = {**ENGINE, "dtype": "float32", "max_model_len": MAX_LEN, "enable_prefix_caching": False}
    spec = spec_config("eagle3", path, adaptive=False)
    prompts = [PROMPTS[0], PROMPTS[2]]
    window = LLM(config=EngineConfig(**kw, speculative=spec))
    window_steps = []
    original = window.engine.spec_decoder.execute_spec

    def counting(packed, *shift):  # shift: a chained step's (spec_chain.py)
        forward = original(packed, *shift)
        window_steps.append(forward.spec.header.ext_window)
        return forward

    window.engine.spec_decoder.execute_spec = counting
    lagged = LLM(config=EngineConfig(**kw, speculative=spec))
    lagged.engine.spec_decoder.ext_window = 0  # every step extends exactly the lagging positions
    window_out, window_drafts = _drafts_per_step(window, prompts, greedy(24))
    lagged_out, lagged_drafts = _drafts_per_step(lagged, prompts, greedy(24))
    assert window_out == lagged_out
    assert window_drafts == lagged_drafts
    assert window_steps.count(4) >= len(window_steps) // 2, "most decode steps should be window steps"
