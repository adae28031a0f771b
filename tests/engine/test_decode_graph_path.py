"""The CUDA-graph decode path on CPU: graphs are stood in for by replaying the captured body eagerly,
so bucket choice, padding, static buffers and logits extraction are checked without a GPU."""

import pytest

from tpfuse.engine.cuda_graphs import DecodeGraphs, graph_batch_sizes
from tpfuse.engine.llm import LLM
from tpfuse.engine.sampling_params import SamplingParams

PROMPTS = ["The quick brown fox", "hi", "a prompt that spans several KV blocks", "xyz", "five"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
MAX_LEN = 128


class EagerReplay:
    def __init__(self, body, counter):
        self.body, self.counter = body, counter

    def replay(self):
        self.counter[0] += 1
        self.body()


class ReplayingGraphs(DecodeGraphs):
    replays = [0]

    def _capture_graph(self, body, pool):
        return EagerReplay(body, self.replays), pool


def test_graph_batch_sizes_are_powers_of_two_then_steps_of_eight_up_to_the_maximum():
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(1) == [1]


@pytest.fixture(scope="module")
def llm_and_eager_tokens():
    llm = LLM("tiny", device="cpu", num_kv_blocks=256, max_model_len=MAX_LEN, enable_prefix_caching=False)
    return llm, [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("graph_logits", [True, False])
def test_graph_decode_path_gives_the_eager_tokens(llm_and_eager_tokens, graph_logits):
    llm, expected = llm_and_eager_tokens
    runner = llm.engine.executor
    runner.graphs = ReplayingGraphs(
        runner.model, runner.kv_caches, 4, MAX_LEN // 16, MAX_LEN, runner.vocab_size, graph_logits
    )
    runner.graphs.capture()
    ReplayingGraphs.replays[0] = 0
    try:
        # 5 prompts: decode steps of 5 run eagerly (past the largest graph), then 3 pad to bucket 4.
        by_three = [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY)]
        all_five = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        runner.graphs = None
    assert by_three == expected[:3]
    assert all_five == expected
    assert ReplayingGraphs.replays[0] >= 9
