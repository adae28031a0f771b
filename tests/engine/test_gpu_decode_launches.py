"""On a GPU, a greedy decode step that replays a graph issues one H2D copy, one graph launch and one
D2H copy of the ids: no kernel launches outside the graph. Run: pytest -m gpu tests/engine."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tpfuse.engine.llm import LLM
from tpfuse.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


def _runtime_calls(llm, steps):
    engine = llm.engine
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.name.startswith("cuda") and "Launch" in e.name]


@pytest.mark.parametrize("batch_size", [1, 3])
def test_greedy_graph_decode_step_launches_only_the_graph(batch_size):
    llm = LLM(
        "tiny", device="cuda", dtype="float32", max_model_len=256, num_kv_blocks=256, cuda_graph_max_bs=4
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        for i in range(batch_size):
            llm.engine.add_request(f"r{i}", [100 + i, 101, 102], params)
        for _ in range(3):  # prefill, then decode warm-up
            llm.engine.step()
        launches = _runtime_calls(llm, 5)
    finally:
        llm.shutdown()
    assert launches.count("cudaGraphLaunch") == 5
    assert [name for name in launches if name != "cudaGraphLaunch"] == []


def test_overlap_schedule_gives_the_synchronous_tokens_with_cuda_graphs():
    kw = dict(device="cuda", dtype="float32", max_model_len=256, num_kv_blocks=256, cuda_graph_max_bs=4)
    prompts = ["The quick brown fox", "hi", "a longer prompt that spans several KV blocks"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=3, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=25, min_tokens=5),
    ]
    outputs = []
    for disable in (True, False):
        llm = LLM("tiny", disable_overlap_schedule=disable, **kw)
        try:
            outputs.append([(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)])
        finally:
            llm.shutdown()
    assert outputs[1] == outputs[0]
