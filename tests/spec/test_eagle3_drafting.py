"""EAGLE-3 chain drafting over a paged KV cache equals a dense float64 recompute of the head."""

import pytest
import torch

from tpfuse.spec.eagle3_checkpoint import load_eagle3_head, save_random_eagle3_head
from tpfuse.spec.eagle3_drafter import Eagle3Drafter
from tpfuse.spec.paged import metadata_for_positions

from .eagle3_reference import PagedSequences, dense_chain_draft, dense_head_forward

K = 3


@pytest.fixture
def head(tmp_path, target_config):
    save_random_eagle3_head(str(tmp_path), target_config, draft_vocab_size=20, std=0.3, seed=1)
    return load_eagle3_head(str(tmp_path), target_config)


@pytest.fixture
def embedding(target_config):
    return torch.randn(
        target_config.vocab_size, target_config.hidden_size, generator=torch.Generator().manual_seed(2)
    )


def random_sequences(lengths, target_config, seed=3):
    gen = torch.Generator().manual_seed(seed)
    width = 3 * target_config.hidden_size
    features = [torch.randn(n, width, generator=gen) for n in lengths]
    tokens = [torch.randint(0, target_config.vocab_size, (n,), generator=gen) for n in lengths]
    return features, tokens


def make_drafter(head, embedding, paged):
    return Eagle3Drafter(head, lambda ids: embedding[ids], paged.kv_cache(head.kv_cache_shape), 50)


def test_head_forward_over_the_paged_cache_matches_the_dense_reference(head, embedding, target_config):
    paged = PagedSequences(1, 32)
    (features,), (tokens,) = random_sequences([7], target_config)
    inputs = paged.inputs([0], [features], [tokens])
    attn = metadata_for_positions(
        paged.block_tables, paged.block_size, inputs.positions, inputs.query_start_loc
    )
    kv = paged.kv_cache(head.kv_cache_shape)
    normed, prenorm = head(embedding[tokens], head.combine_features(features), inputs.positions, attn, kv)
    ref_normed, ref_prenorm = dense_head_forward(
        head, embedding[tokens], features.double() @ head.fc.weight.double().T, inputs.positions
    )
    torch.testing.assert_close(normed.double(), ref_normed, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(prenorm.double(), ref_prenorm, rtol=1e-4, atol=1e-4)


def test_chain_drafts_of_a_batch_equal_the_dense_reference(head, embedding, target_config):
    lengths = [5, 9, 1]
    paged = PagedSequences(len(lengths), 32)
    features, tokens = random_sequences(lengths, target_config)
    proposal = make_drafter(head, embedding, paged).propose(paged.inputs([0, 0, 0], features, tokens), K)
    expected = [dense_chain_draft(head, embedding, f, t, K) for f, t in zip(features, tokens, strict=True)]
    assert proposal.token_ids.tolist() == expected
    assert proposal.num_draft_tokens.tolist() == [K] * len(lengths)
    assert proposal.probs is None


def test_drafts_after_a_partly_accepted_step_equal_the_dense_reference(head, embedding, target_config):
    # Step 1 extends positions 0..5 and drafts (writing speculative entries at 6 and 7); the target
    # then verifies positions 6..7 (one draft accepted): the next extend overwrites those entries.
    paged = PagedSequences(1, 32)
    (f1, f2), (t1, t2) = random_sequences([6, 2], target_config)
    drafter = make_drafter(head, embedding, paged)
    drafter.propose(paged.inputs([0], [f1], [t1]), K)
    proposal = drafter.propose(paged.inputs([6], [f2], [t2]), K)
    expected = dense_chain_draft(head, embedding, torch.cat([f1, f2]), torch.cat([t1, t2]), K)
    assert proposal.token_ids[0].tolist() == expected


def test_zero_draft_tokens_still_extends_the_heads_cache(head, embedding, target_config):
    paged = PagedSequences(1, 32)
    (f1, f2), (t1, t2) = random_sequences([4, 3], target_config)
    drafter = make_drafter(head, embedding, paged)
    assert drafter.propose(paged.inputs([0], [f1], [t1]), 0).token_ids.shape == (1, 0)
    proposal = drafter.propose(paged.inputs([4], [f2], [t2]), K)
    expected = dense_chain_draft(head, embedding, torch.cat([f1, f2]), torch.cat([t1, t2]), K)
    assert proposal.token_ids[0].tolist() == expected


def test_drafts_are_target_ids_from_the_draft_vocabulary(head, embedding, target_config):
    paged = PagedSequences(4, 32)
    features, tokens = random_sequences([3, 4, 5, 6], target_config, seed=9)
    proposal = make_drafter(head, embedding, paged).propose(paged.inputs([0] * 4, features, tokens), K)
    hot = set(head.target_ids_of_draft_vocab().tolist())
    assert set(proposal.token_ids.flatten().tolist()) <= hot


def test_sampled_drafts_come_with_their_distribution_over_the_target_vocabulary(
    head, embedding, target_config
):
    paged = PagedSequences(3, 32)
    features, tokens = random_sequences([3, 4, 5], target_config)
    extra = dict(temperatures=torch.tensor([1.0, 0.0, 0.7]), seeds=torch.tensor([5, 6, 7]))
    proposal = make_drafter(head, embedding, paged).propose(
        paged.inputs([0] * 3, features, tokens, **extra), K
    )
    probs = proposal.probs
    assert probs.shape == (3, K, target_config.vocab_size)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, K))
    cold = torch.ones(target_config.vocab_size, dtype=torch.bool)
    cold[head.target_ids_of_draft_vocab()] = False
    assert probs[..., cold].abs().sum() == 0
    assert (probs.gather(2, proposal.token_ids[..., None]) > 0).all()
    assert (probs[1].max(-1).values == 1.0).all()  # temperature 0: argmax, one-hot


def test_missing_target_features_raise_an_error_naming_the_field(head, embedding, target_config):
    paged = PagedSequences(1, 32)
    (features,), (tokens,) = random_sequences([3], target_config)
    inputs = paged.inputs([0], [features], [tokens])
    inputs.target_features = None
    with pytest.raises(ValueError, match="target_features"):
        make_drafter(head, embedding, paged).propose(inputs, K)
