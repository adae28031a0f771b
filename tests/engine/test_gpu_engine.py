"""The engine on one CUDA GPU: CUDA-graph decode equals eager, padding rows are inert, KV sizing
works, and a real-size preset runs end to end. Run on the device machine: pytest -m gpu tests/engine."""

import pytest
import torch

from tpfuse.engine.llm import LLM
from tpfuse.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["The quick brown fox", "hi", "a longer prompt that spans several KV blocks", "xyz", "12345"]


def greedy(n=24):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def graphs_and_eager():
    kw = dict(device="cuda", dtype="float32", max_model_len=512, mem_fraction_static=0.3, cuda_graph_max_bs=8)
    with_graphs = LLM("tiny", **kw)  # KV capacity measured
    eager = LLM("tiny", enforce_eager=True, num_kv_blocks=2048, **kw)
    yield with_graphs, eager
    with_graphs.shutdown()
    eager.shutdown()


def test_cuda_graph_decode_gives_the_same_greedy_tokens_as_eager(graphs_and_eager):
    with_graphs, eager = graphs_and_eager
    assert with_graphs.engine.executor.graphs is not None and eager.engine.executor.graphs is None
    a = [o.token_ids for o in with_graphs.generate(PROMPTS, greedy())]
    b = [o.token_ids for o in eager.generate(PROMPTS, greedy())]
    assert a == b


def test_padded_graph_batch_gives_each_sequence_its_tokens_alone(graphs_and_eager):
    with_graphs, _ = graphs_and_eager
    batch = [o.token_ids for o in with_graphs.generate(PROMPTS[:3], greedy())]  # 3 rows replay bucket 4
    alone = [with_graphs.generate(p, greedy())[0].token_ids for p in PROMPTS[:3]]
    assert batch == alone


def test_seeded_sampling_on_gpu_does_not_depend_on_the_batch(graphs_and_eager):
    with_graphs, _ = graphs_and_eager
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=11, max_tokens=16, ignore_eos=True)
    alone = with_graphs.generate("seeded", params)[0].token_ids
    batch = with_graphs.generate(["x", "seeded", "yy"], [greedy(), params, greedy()])
    assert batch[1].token_ids == alone


def test_kv_capacity_is_measured_from_free_memory(graphs_and_eager):
    with_graphs, _ = graphs_and_eager
    runner = with_graphs.engine.executor
    total = torch.cuda.get_device_properties(0).total_memory
    kv_bytes = sum(k.numel() * k.element_size() * 2 for k, _ in runner.kv_caches)
    assert runner.num_kv_blocks > 1000
    assert kv_bytes < 0.3 * total


def test_llama_8b_preset_runs_batch_1_and_batch_64_with_graphs():
    kw = dict(max_model_len=1024, cuda_graph_max_bs=64, max_running_requests=64)
    llm = LLM("llama-3.1-8b", device="cuda", **kw)
    try:
        one = llm.generate("hello", greedy(16))[0]
        many = llm.generate([f"prompt {i}" for i in range(64)], greedy(16))
        assert len(one.token_ids) == 16 and all(len(o.token_ids) == 16 for o in many)
    finally:
        llm.shutdown()
