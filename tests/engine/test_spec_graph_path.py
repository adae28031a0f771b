"""The per-(batch bucket, k) verify graphs on CPU: graphs are stood in for by replaying the captured
body eagerly, so static query offsets, padding rows, in-graph feature writes and logits extraction
are checked without a GPU."""

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

    def run(self, step, num_draft_tokens=0):
        self.last_key = (step.header.num_seqs, num_draft_tokens)
        return super().run(step, num_draft_tokens)


@pytest.mark.parametrize("graph_logits", [True, False])
@pytest.mark.parametrize("drafter", ["eagle3", "ngram"])
def test_verify_graphs_per_bucket_and_k_give_the_eager_greedy_tokens(tmp_path, drafter, graph_logits):
    kw = {**ENGINE, "max_model_len": MAX_LEN, "enable_prefix_caching": False}
    expected = [o.token_ids for o in LLM(**kw).generate(PROMPTS[:3], greedy(16))]
    path = write_eagle3_head(str(tmp_path)) if drafter == "eagle3" else None
    llm = LLM(config=EngineConfig(**kw, speculative=spec_config(drafter, path, adaptive=False)))
    runner = llm.engine.executor
    spec = runner.spec
    width = -(-(runner.max_model_len + spec.position_margin) // runner.block_size)
    graphs = RecordingGraphs(
        runner.model, runner.kv_caches, 4, width, runner.max_model_len, runner.vocab_size, graph_logits,
        max_num_draft_tokens=3, write_features=spec.write_features,
    )  # fmt: skip
    graphs.replayed = []
    graphs.capture()
    runner.graphs = graphs
    outputs = [o.token_ids for o in llm.generate(PROMPTS[:3], greedy(16))]
    assert outputs == expected
    assert (4, 3) in graphs.replayed  # 3 decoding sequences padded to bucket 4, k = 3
