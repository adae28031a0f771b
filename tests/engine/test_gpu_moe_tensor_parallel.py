"""The tiny Qwen3-MoE checkpoint on CUDA in float32: greedy tokens at TP 2 equal TP 1, with ranks on two
GPUs (multigpu: symmetric memory, where the MoE finalize fuses the combine into the one-shot all-reduce)
and with two ranks sharing one GPU (gpu: CUDA IPC, the plain combine then the fused all-reduce)."""

import pytest

from tests.engine.checkpoints import build_checkpoint
from tpfuse.engine.llm import LLM
from tpfuse.engine.sampling_params import SamplingParams

PROMPTS = [[5, 17, 33, 100, 2, 9, 81], [200, 1], list(range(40, 75))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
ENGINE = dict(device="cuda", dtype="float32", max_model_len=256, mem_fraction_static=0.2, cuda_graph_max_bs=4)
pytestmark = pytest.mark.timeout(240, method="thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen3_moe_gpu_tp")
    build_checkpoint(directory, "qwen3_moe")
    return str(directory)


def _tokens(directory, **kw):
    llm = LLM(directory, **{**ENGINE, **kw})
    try:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def single_rank_tokens(checkpoint):
    return _tokens(checkpoint)


@pytest.mark.gpu
def test_two_moe_ranks_sharing_one_gpu_give_the_single_rank_tokens(checkpoint, single_rank_tokens):
    assert _tokens(checkpoint, tp_size=2, devices=[0, 0]) == single_rank_tokens


@pytest.mark.multigpu
def test_two_moe_ranks_on_two_gpus_give_the_single_rank_tokens(checkpoint, single_rank_tokens):
    assert _tokens(checkpoint, tp_size=2, devices=[0, 1]) == single_rank_tokens
