"""Speculative greedy decoding at TP=2 over gloo: every rank drafts, accepts and emits exactly what
a TP=1 run does (the EAGLE-3 head reads the all-reduced embedding and the replicated features)."""

import pytest
import torch

from tests.helpers.dist import run_distributed
from tpfuse.comm.communicator import SingleRankCommunicator
from tpfuse.model.layers import ParallelContext
from tpfuse.spec.draft_model import DraftModelDrafter
from tpfuse.spec.eagle3_checkpoint import load_eagle3_head, save_random_eagle3_head
from tpfuse.spec.eagle3_drafter import Eagle3Drafter, target_embedding
from tpfuse.spec.ngram import NgramDrafter

from .fixtures import model_kv_caches, random_model, sharded_copy, tiny_target_config
from .spec_loop import greedy_decode, speculative_greedy_decode

PROMPTS = [[3, 14, 15, 9, 2, 6, 5, 3, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8], [1, 4]]
NUM_TOKENS, K = 10, 3


def run_every_drafter(parallel: ParallelContext, head_dir: str) -> dict[str, tuple]:
    """(outputs, drafts accepted, proposals) per drafter, on this rank's shard of the target."""
    config = tiny_target_config()
    target = sharded_copy(random_model(config, seed=0), parallel)
    draft = sharded_copy(random_model(config, seed=5), parallel)
    head = load_eagle3_head(head_dir, config)
    makers = {
        "ngram": lambda paged: NgramDrafter(3),
        "draft_model": lambda paged: DraftModelDrafter(
            draft, model_kv_caches(draft, paged.num_blocks, paged.block_size), config.vocab_size
        ),
        "eagle3": lambda paged: Eagle3Drafter(
            head, target_embedding(target), paged.kv_cache(head.kv_cache_shape), config.vocab_size
        ),
    }
    runs = {}
    for name, make in makers.items():
        target.aux_hidden_state_layers = (
            head.config.capture_layers(config.num_layers) if name == "eagle3" else ()
        )
        runs[name] = speculative_greedy_decode(target, PROMPTS, NUM_TOKENS, make, K)
    return runs


def _run_on_rank(rank: int, world_size: int, head_dir: str) -> dict[str, tuple]:
    from tpfuse.comm.communicator import TorchDistributedCommunicator

    torch.set_num_threads(1)
    return run_every_drafter(ParallelContext(rank, world_size, TorchDistributedCommunicator()), head_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    head_dir = str(tmp_path_factory.mktemp("eagle3"))
    save_random_eagle3_head(head_dir, tiny_target_config(), draft_vocab_size=30, std=0.3)
    single = run_every_drafter(ParallelContext(0, 1, SingleRankCommunicator()), head_dir)
    return single, run_distributed(_run_on_rank, 2, head_dir, timeout=300)


def test_every_drafter_at_tp2_emits_the_tp1_greedy_tokens_on_every_rank(runs):
    _, ranks = runs
    expected = greedy_decode(random_model(tiny_target_config(), seed=0), PROMPTS, NUM_TOKENS)
    for rank_runs in ranks:
        assert {name: run[0] for name, run in rank_runs.items()} == dict.fromkeys(rank_runs, expected)


def test_drafters_at_tp2_propose_and_accept_what_they_do_at_tp1_on_every_rank(runs):
    single, ranks = runs
    for rank_runs in ranks:
        for name, (_, accepted, proposals) in rank_runs.items():
            assert (accepted, proposals) == single[name][1:], name
