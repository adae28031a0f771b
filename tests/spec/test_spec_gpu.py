"""GPU checks of speculative decoding (device machine): the Triton kernels under the EAGLE-3 head
and the draft model, verification at a real vocabulary, and lossless greedy speculation on CUDA."""

import pytest
import torch

from tpfuse.spec.draft_model import DraftModelDrafter
from tpfuse.spec.eagle3_checkpoint import load_eagle3_head, save_random_eagle3_head
from tpfuse.spec.eagle3_drafter import Eagle3Drafter, target_embedding
from tpfuse.spec.ngram import NgramDrafter
from tpfuse.spec.seeded_random import uniform
from tpfuse.spec.verify import greedy_verify, rejection_sample_verify

from .eagle3_reference import PagedSequences, dense_chain_draft
from .fixtures import model_kv_caches, random_model, tiny_target_config
from .spec_loop import greedy_decode, speculative_greedy_decode

pytestmark = pytest.mark.gpu

PROMPTS = [[3, 14, 15, 9, 2, 6, 5, 3, 5], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8], [1, 4]]


def test_seeded_uniforms_are_bit_identical_on_gpu_and_cpu():
    seeds = torch.tensor([0, 1, -7, 2**40 + 3, -(2**62)])
    counters = torch.arange(1000)
    assert torch.equal(uniform(seeds, 2, counters), uniform(seeds.cuda(), 2, counters.cuda()).cpu())


def test_verification_on_gpu_matches_cpu_at_the_llama3_vocabulary():
    batch, k, vocab = 16, 4, 128256
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, k + 1, vocab, generator=gen) * 4
    drafts = logits[:, :k].argmax(-1)
    drafts[::3, 1] = 7  # some rows reject at position 1
    params = dict(
        temperatures=torch.tensor([0.0, 0.7, 1.0, 1.3] * 4),
        top_ks=torch.tensor([-1, 50, -1, 20] * 4),
        top_ps=torch.tensor([1.0, 1.0, 0.9, 0.8] * 4),
        seeds=torch.arange(batch) * 31,
    )
    cpu = rejection_sample_verify(drafts, logits, **params)
    gpu = rejection_sample_verify(drafts.cuda(), logits.cuda(), **{n: v.cuda() for n, v in params.items()})
    assert torch.equal(cpu.token_ids, gpu.token_ids.cpu())
    assert torch.equal(
        greedy_verify(drafts, logits).token_ids, greedy_verify(drafts.cuda(), logits.cuda()).token_ids.cpu()
    )


def test_eagle3_chain_drafts_through_triton_kernels_equal_the_dense_reference(tmp_path):
    config = tiny_target_config()
    save_random_eagle3_head(str(tmp_path), config, draft_vocab_size=20, std=0.3, seed=1)
    head = load_eagle3_head(str(tmp_path), config, device="cuda")
    embedding = torch.randn(config.vocab_size, config.hidden_size, generator=torch.Generator().manual_seed(2))
    gen = torch.Generator().manual_seed(3)
    lengths = [5, 9, 1, 17]
    features = [torch.randn(n, 3 * config.hidden_size, generator=gen) for n in lengths]
    tokens = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in lengths]
    paged = PagedSequences(len(lengths), 40, block_size=16, device="cuda")
    gpu_embedding = embedding.cuda()
    drafter = Eagle3Drafter(head, lambda ids: gpu_embedding[ids], paged.kv_cache(head.kv_cache_shape), 50)
    proposal = drafter.propose(paged.inputs([0] * len(lengths), features, tokens), 4)
    cpu_head = load_eagle3_head(str(tmp_path), config)
    expected = [
        dense_chain_draft(cpu_head, embedding, f, t, 4) for f, t in zip(features, tokens, strict=True)
    ]
    assert proposal.token_ids.cpu().tolist() == expected


@pytest.mark.parametrize("drafter_kind", ["ngram", "draft_model", "eagle3"])
def test_speculative_greedy_on_gpu_is_lossless(drafter_kind, tmp_path):
    config = tiny_target_config()
    target = random_model(config, seed=0).cuda()
    expected = greedy_decode(target, PROMPTS, 16)
    if drafter_kind == "ngram":
        make = lambda paged: NgramDrafter(3)
    elif drafter_kind == "draft_model":
        draft = random_model(config, seed=0).cuda()
        make = lambda paged: DraftModelDrafter(
            draft, model_kv_caches(draft, paged.num_blocks, paged.block_size), 50
        )
    else:
        save_random_eagle3_head(str(tmp_path), config, draft_vocab_size=30, std=0.3)
        head = load_eagle3_head(str(tmp_path), config, device="cuda")
        target.aux_hidden_state_layers = head.config.capture_layers(config.num_layers)
        make = lambda paged: Eagle3Drafter(
            head, target_embedding(target), paged.kv_cache(head.kv_cache_shape), 50
        )
    outputs, _, _ = speculative_greedy_decode(target, PROMPTS, 16, make, 3)
    assert outputs == expected
