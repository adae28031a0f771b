"""Tensor parallelism over gloo: TP=2 and TP=4 logits equal TP=1 for every architecture, including
fewer kv heads than ranks and a vocabulary not divisible by the tp size."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.model.harness import (
    ARCHITECTURE_VARIANTS,
    build_hf_checkpoint,
    load_for_test,
    relative_error,
    run_prefill_then_decode,
)

TOLERANCE = 1e-4
PROMPTS = [[5, 250, 17, 3, 99, 42, 7], [1, 2], [200, 100, 50, 25]]
DECODE_TOKENS = [[252, 0, 11], [64, 128, 196]]
MODELS = [*sorted(ARCHITECTURE_VARIANTS), "tiny"]  # "tiny": the preset, dummy weights


def _logits_on_rank(rank: int, world_size: int, sources: dict[str, str]) -> dict[str, list]:
    """Runs on each spawned rank; returns numpy arrays (tensors would travel as shared memory that
    vanishes when the rank exits)."""
    from tpfuse.comm.communicator import TorchDistributedCommunicator

    torch.set_num_threads(1)  # up to 4 ranks share CI's 2 cores
    comm = TorchDistributedCommunicator()
    results = {}
    for name, source in sources.items():
        model, _ = load_for_test(source, tp_rank=rank, tp_size=world_size, comm=comm)
        prefill, decodes = run_prefill_then_decode(model, PROMPTS, DECODE_TOKENS)
        results[name] = [t.numpy() for t in (prefill, *decodes)]
    return results


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    found = {"tiny": "tiny"}
    for kind in sorted(ARCHITECTURE_VARIANTS):
        directory = tmp_path_factory.mktemp(f"tp-{kind}")
        build_hf_checkpoint(directory, kind)
        found[kind] = str(directory)
    return found


@pytest.fixture(scope="module")
def single_rank_logits(sources) -> dict[str, list[torch.Tensor]]:
    results = {}
    for name, source in sources.items():
        model, _ = load_for_test(source)
        prefill, decodes = run_prefill_then_decode(model, PROMPTS, DECODE_TOKENS)
        results[name] = [prefill, *decodes]
    return results


@pytest.fixture(scope="module")
def tp_logits(sources) -> dict[int, list[dict[str, list[torch.Tensor]]]]:
    """Per tp size, per rank: the logits of every model."""
    results = {tp: run_distributed(_logits_on_rank, tp, sources, timeout=300) for tp in (2, 4)}
    return {
        tp: [{name: [torch.from_numpy(a) for a in arrays] for name, arrays in rank.items()} for rank in ranks]
        for tp, ranks in results.items()
    }


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("model_name", MODELS)
def test_tensor_parallel_logits_equal_single_rank(tp_logits, single_rank_logits, tp_size, model_name):
    for got, want in zip(tp_logits[tp_size][0][model_name], single_rank_logits[model_name], strict=True):
        assert got.shape == want.shape
        assert relative_error(got, want) <= TOLERANCE


@pytest.mark.parametrize("tp_size", [2, 4])
def test_every_rank_computes_identical_logits(tp_logits, tp_size):
    first = tp_logits[tp_size][0]
    for other in tp_logits[tp_size][1:]:
        for name in MODELS:
            for a, b in zip(first[name], other[name], strict=True):
                assert torch.equal(a, b)
