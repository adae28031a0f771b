"""Tensor parallelism on CUDA: ranks sharing one GPU (gpu mark) and ranks on separate GPUs (multigpu).
Greedy tokens must equal TP=1 in float32; bf16 real-size presets must run end to end; a rank killed
mid-generation ends every process with a clear error.

Ranks sharing one GPU are separate processes that the driver time-slices (~2-7 ms per all-reduce),
so these tests are slow by nature: the module allows each one 240 s."""

import textwrap

import pytest

from tests.engine.spec_helpers import spec_config, write_eagle3_head
from tests.engine.tp_processes import kill_worker_and_read_the_engine_error, start_engine_script
from tpfuse.engine.llm import LLM
from tpfuse.engine.sampling_params import SamplingParams

PROMPTS = ["The quick brown fox", "hi", "a longer prompt that spans several KV blocks"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
TINY = dict(device="cuda", dtype="float32", max_model_len=256, mem_fraction_static=0.2, cuda_graph_max_bs=4)
# "thread": a hang inside a C call (a collective, a CUDA wait) never returns to the interpreter, so the
# signal method cannot interrupt it; the thread method dumps every thread's stack and ends the run.
pytestmark = pytest.mark.timeout(240, method="thread")


@pytest.fixture(scope="module")
def single_rank_tokens():
    llm = LLM("tiny", **TINY)
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()


def _tokens(tp_size, devices, allreduce="auto", **extra):
    llm = LLM("tiny", tp_size=tp_size, devices=devices, allreduce=allreduce, **{**TINY, **extra})
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()


@pytest.mark.gpu
def test_two_ranks_sharing_one_gpu_give_the_single_rank_tokens(single_rank_tokens):
    assert _tokens(2, [0, 0]) == single_rank_tokens


@pytest.mark.gpu
def test_two_ranks_sharing_one_gpu_eager_give_the_single_rank_tokens(single_rank_tokens):
    assert _tokens(2, [0, 0], enforce_eager=True) == single_rank_tokens


@pytest.mark.gpu
def test_rows_with_logits_processing_at_two_ranks_sharing_one_gpu_give_the_single_rank_tokens():
    """Rank 0 chooses penalised and biased rows alone (on CUDA graph steps) and broadcasts the ids
    over the group (gloo here, ranks sharing the GPU), so the steps launched after them agree."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=10.0),
        SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logit_bias={7: 3.0}),
    ]
    results = []
    for tp_size, devices in ((1, None), (2, [0, 0])):
        llm = LLM("tiny", tp_size=tp_size, devices=devices, **TINY)
        try:
            results.append([o.token_ids for o in llm.generate(PROMPTS, params)])
        finally:
            llm.shutdown()
    assert results[1] == results[0]


@pytest.mark.gpu
def test_four_ranks_sharing_one_gpu_with_the_fused_path_forced_give_the_single_rank_tokens(
    single_rank_tokens,
):
    assert _tokens(4, [0, 0, 0, 0], allreduce="fused", mem_fraction_static=0.1) == single_rank_tokens


@pytest.mark.gpu
@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "fixed-k"])
@pytest.mark.parametrize("drafter", ["ngram", "eagle3"])
def test_speculation_with_two_ranks_sharing_one_gpu_captures_verify_graphs_and_keeps_the_tokens(
    single_rank_tokens, tmp_path, drafter, adaptive
):
    """Verify graphs carry batch x (k + 1) rows: the shared GPU's all-reduce workspace must hold them,
    or the capture would fall back to gloo's CPU copies (rank 1 died there)."""
    path = write_eagle3_head(str(tmp_path)) if drafter == "eagle3" else None
    spec = spec_config(drafter, path, adaptive=adaptive)
    llm = LLM("tiny", tp_size=2, devices=[0, 0], speculative=spec, **TINY)
    try:
        assert all(llm.engine.executor.runner.graphs.has(size, 3) for size in (1, 2, 4))
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == single_rank_tokens
        assert llm.engine.stats().spec_num_drafts_total > 0
    finally:
        llm.shutdown()


@pytest.mark.gpu
@pytest.mark.parametrize("tp_size,tree", [(2, True), (4, False)], ids=["tp2-eagle3-tree", "tp4-eagle3-chain"])
def test_eagle3_tree_at_tp2_and_chain_at_tp4_sharing_one_gpu_keep_the_tokens(
    single_rank_tokens, tmp_path, tp_size, tree
):
    """Tree steps run eagerly and move the accepted path's KV on every rank; chain steps at TP 4 are
    launched ahead through the workers' own verify results. Both must give the TP=1 tokens."""
    extra = dict(eagle_topk=2, num_draft_tokens=6) if tree else {}
    spec = spec_config("eagle3", write_eagle3_head(str(tmp_path)), adaptive=False, **extra)
    memory = dict(mem_fraction_static=0.2 if tp_size == 2 else 0.1)
    llm = LLM("tiny", tp_size=tp_size, devices=[0] * tp_size, speculative=spec, **{**TINY, **memory})
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == single_rank_tokens
        assert llm.engine.stats().spec_num_drafts_total > 0
    finally:
        llm.shutdown()


KILL_SCRIPT = textwrap.dedent(
    """
    from tpfuse.engine.llm import LLM
    from tpfuse.engine.sampling_params import SamplingParams
    if __name__ == "__main__":
        llm = LLM("tiny", device="cuda", tp_size=2, devices=[0, 0], allreduce="fused",
                  mem_fraction_static=0.2, max_model_len=256, cuda_graph_max_bs=4)
        print(" ".join(str(p.pid) for p in llm.engine.executor.workers), flush=True)
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        while True:
            llm.generate("keep going", params)
    """
)


@pytest.mark.gpu
def test_killing_a_rank_sharing_the_gpu_ends_every_process_with_a_clear_error(tmp_path):
    proc, [worker] = start_engine_script(tmp_path, KILL_SCRIPT)
    stderr = kill_worker_and_read_the_engine_error(proc, worker)
    assert "tensor-parallel rank 1" in stderr and "died" in stderr


@pytest.mark.gpu
def test_llama_8b_two_ranks_on_one_gpu_generate_in_bf16():
    llm = LLM("llama-3.1-8b", tp_size=2, devices=[0, 0], max_model_len=512, cuda_graph_max_bs=8)
    try:
        outs = llm.generate(["hello", "world"], GREEDY)
        assert [len(o.token_ids) for o in outs] == [16, 16]
    finally:
        llm.shutdown()


@pytest.mark.multigpu
@pytest.mark.parametrize("allreduce", ["fused", "nccl"])
def test_two_gpus_give_the_single_rank_tokens(single_rank_tokens, allreduce):
    assert _tokens(2, [0, 1], allreduce=allreduce) == single_rank_tokens
