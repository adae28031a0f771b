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
    copied_steps = [0]  # steps that went through run (copied into the static buffers)

    def run(self, step, extra_rows=0):
        self.copied_steps[0] += 1
        return super().run(step, extra_rows)

    def _capture_graph(self, body, pool):
        return EagerReplay(body, self.replays), pool


def _install_graphs(runner, graph_logits=True, max_batch_size=4, max_banned=4096):
    runner.graphs = ReplayingGraphs(
        runner.model, runner.kv_caches, max_batch_size, MAX_LEN // 16, MAX_LEN, runner.vocab_size,
        graph_logits, max_banned=max_banned, token_table=runner.token_table,
    )  # fmt: skip
    runner.graphs.capture()
    ReplayingGraphs.replays[0] = 0
    ReplayingGraphs.copied_steps[0] = 0


def test_graph_batch_sizes_are_powers_of_two_then_steps_of_eight_up_to_the_maximum():
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(1) == [1]


@pytest.fixture(scope="module")
def llm_and_eager_tokens():
    llm = LLM("tiny", device="cpu", num_kv_blocks=256, max_model_len=MAX_LEN, enable_prefix_caching=False)
    llm.engine.overlap = False  # the reference: eager and synchronous
    expected = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    llm.engine.overlap = True  # graph steps below also take their input ids from the token table
    return llm, expected


@pytest.mark.parametrize("graph_logits", [True, False])
def test_graph_decode_path_gives_the_eager_tokens(llm_and_eager_tokens, graph_logits):
    llm, expected = llm_and_eager_tokens
    runner = llm.engine.executor
    _install_graphs(runner, graph_logits)
    try:
        # 5 prompts: decode steps of 5 run eagerly (past the largest graph), then 3 pad to bucket 4.
        by_three = [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY)]
        all_five = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        runner.graphs = None
    assert by_three == expected[:3]
    assert all_five == expected
    assert ReplayingGraphs.replays[0] >= 9


def test_greedy_graph_steps_take_the_argmax_inside_the_graph_without_the_sampler(llm_and_eager_tokens):
    llm, expected = llm_and_eager_tokens
    runner = llm.engine.executor
    _install_graphs(runner)
    sampled_rows = []
    original = runner._choose_tokens
    runner._choose_tokens = lambda step, logits: sampled_rows.append(len(logits)) or original(step, logits)
    try:
        tokens = [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY)]
    finally:
        runner.graphs = None
        del runner._choose_tokens
    assert tokens == expected[:3]
    assert ReplayingGraphs.replays[0] >= 9
    assert sampled_rows == [3]  # the prefill step only; every decode step took the graph's argmax


def test_seeded_sampling_and_min_tokens_through_decode_graphs_match_eager(llm_and_eager_tokens):
    llm, _ = llm_and_eager_tokens
    seeded = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True)
    banned = list(range(200, 240))
    held_back = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=6, stop_token_ids=banned)
    params = [seeded, GREEDY, held_back]
    eager = [o.token_ids for o in llm.generate(PROMPTS[:3], params)]
    # max_banned=0: a step with banned ids outgrows the static buffer and goes through graphs.run.
    for max_banned in (4096, 0):
        _install_graphs(llm.engine.executor, max_banned=max_banned)
        try:
            graphed = [o.token_ids for o in llm.generate(PROMPTS[:3], params)]
        finally:
            llm.engine.executor.graphs = None
        assert graphed == eager
        assert ReplayingGraphs.replays[0] >= 7
        assert (ReplayingGraphs.copied_steps[0] > 0) == (max_banned == 0)
