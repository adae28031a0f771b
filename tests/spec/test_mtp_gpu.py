"""The MTP drafter on one CUDA GPU (device machine: pytest -m gpu tests/spec/test_mtp_gpu.py): the tiny
DeepSeek-V3 checkpoint with an MTP layer (tests/spec/test_mtp.py) under the Triton MLA kernels and the
per-(bucket, k) verify graphs: speculative greedy equals plain greedy with and without adaptive k,
verify graphs with k > 0 replay, and every draft chain equals the float64 reference chain."""

from __future__ import annotations

import shutil

import pytest

from tests.engine.checkpoints import save_byte_tokenizer
from tests.model.test_deepseek_v3 import build_deepseek_checkpoint
from tests.spec.test_mtp import KIND, PROMPTS, MtpReference, _check_chains, _record_proposals, add_mtp_layer
from tpfuse.config import SpeculativeConfig
from tpfuse.engine.llm import LLM
from tpfuse.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu

CUDA = dict(
    device="cuda", dtype="float32", max_model_len=256, num_kv_blocks=256, block_size=16,
    cuda_graph_max_bs=4, max_num_batched_tokens=16,
)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    plain = str(tmp_path_factory.mktemp("deepseek_plain"))
    # Groups do not tie here: the Triton router breaks ties to the lower id, torch.topk (the float64
    # reference chain's router) its own way, so a tied checkpoint routes them to different experts.
    hf_model = build_deepseek_checkpoint(plain, KIND, tie_groups=False)
    save_byte_tokenizer(plain)
    directory = str(tmp_path_factory.mktemp("deepseek_mtp")) + "/ckpt"
    shutil.copytree(plain, directory)
    add_mtp_layer(directory)
    return directory, hf_model


def _generate(directory, speculative=None):
    llm = LLM(directory, **CUDA, **({"speculative": speculative} if speculative else {}))
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)], llm


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive"])
def test_mtp_on_cuda_with_verify_graphs_is_lossless_and_drafts_the_reference_chains(
    checkpoint, tmp_path, monkeypatch, adaptive
):
    directory, hf_model = checkpoint
    want, _ = _generate(directory)
    records = _record_proposals(monkeypatch)
    got, llm = _generate(directory, SpeculativeConfig(algorithm="mtp", num_steps=3, adaptive=adaptive))
    assert got == want
    assert llm.engine.stats().spec_num_draft_tokens_total > 0
    graphs = llm.engine.executor.graphs
    assert graphs is not None and graphs.has(1, 3)
    sequences = [prompt + out for prompt, out in zip(PROMPTS, got, strict=True)]
    assert _check_chains(records, sequences, MtpReference(directory, hf_model, str(tmp_path))) >= 6
