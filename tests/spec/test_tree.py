"""Draft tree shapes (spec/tree.py) and tree verification (spec/tree_verify.py)."""

import pytest
import torch

from tpfuse.spec.tree import (
    DraftTree,
    TreeCandidates,
    ancestor_matrix,
    check_tree_settings,
    tree_attention_bits,
)
from tpfuse.spec.tree_verify import greedy_tree_verify, rejection_tree_verify, seeded_tree_verify


def _random_tree(depth, topk, total, batch=3, vocab=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cands = TreeCandidates(topk)
    frontier = 1
    for _ in range(depth):
        logits = torch.randn(batch, frontier, vocab, generator=gen) * 3
        cands.add_depth(logits.log_softmax(-1))
        frontier = topk
    return cands, cands.select(total)


@pytest.mark.parametrize("depth,topk,total", [(3, 2, 6), (3, 4, 10), (2, 3, 12), (4, 1, 5), (1, 4, 3)])
def test_tree_has_the_requested_nodes_with_parents_before_children_and_depths_one_below(depth, topk, total):
    cands, tree = _random_tree(depth, topk, total)
    assert tree.parents.shape == (3, total)
    assert (tree.parents[:, 0] == -1).all() and (tree.depths[:, 0] == 0).all()
    index = torch.arange(total)
    assert (tree.parents[:, 1:] >= 0).all() and (tree.parents[:, 1:] < index[1:]).all()
    parent_depth = tree.depths.gather(1, tree.parents[:, 1:])
    assert torch.equal(tree.depths[:, 1:], parent_depth + 1)
    assert int(tree.depths.max()) <= depth


@pytest.mark.parametrize("depth,topk,total", [(3, 2, 6), (3, 3, 9)])
def test_tree_keeps_the_best_scoring_candidates_and_siblings_differ(depth, topk, total):
    cands, tree = _random_tree(depth, topk, total, seed=5)
    scores = torch.cat(cands.scores, 1)
    kept_scores = scores.sort(dim=1, descending=True).values[:, : total - 1]
    for b in range(3):
        siblings = {}
        for i in range(1, total):
            key = int(tree.parents[b, i])
            assert int(tree.token_ids[b, i]) not in siblings.setdefault(key, set())
            siblings[key].add(int(tree.token_ids[b, i]))
        assert kept_scores[b, -1] >= scores[b].sort(descending=True).values[total - 1]


def test_chain_tree_with_top1_is_the_argmax_chain():
    cands, tree = _random_tree(4, 1, 5, batch=1)
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 3]]
    assert tree.depths.tolist() == [[0, 1, 2, 3, 4]]


def test_tree_settings_refuse_more_nodes_than_candidates():
    check_tree_settings(3, 2, 10)  # 2 + 2 * 4 = 10 candidates + root = 11
    with pytest.raises(ValueError, match="--speculative-num-draft-tokens"):
        check_tree_settings(2, 2, 8)


def test_tree_attention_bits_see_self_ancestors_and_context_only():
    parents = torch.tensor([[-1, 0, 0, 1, 2]])
    bits = tree_attention_bits(ancestor_matrix(parents, 2))
    # row 3 (parent 1, grandparent 0): distances 0, 2, 3 and everything past the root (>= 4)
    visible_3 = [d for d in range(8) if (int(bits[3]) >> d) & 1]
    assert visible_3 == [0, 2, 3, 4, 5, 6, 7]
    visible_4 = [d for d in range(8) if (int(bits[4]) >> d) & 1]  # parent 2 (d=2), root (d=4)
    assert visible_4 == [0, 2, 4, 5, 6, 7]
    assert int(bits[0]) == -1


# Hand tree: root 0 -> children 1 (token 5) and 2 (token 7); 1 -> 3 (token 9); 2 -> 4 (token 8).
HAND = DraftTree(
    token_ids=torch.tensor([[3, 5, 7, 9, 8]]),
    parents=torch.tensor([[-1, 0, 0, 1, 2]]),
    depths=torch.tensor([[0, 1, 1, 2, 2]]),
)


def _logits_with_argmax(argmax_per_node, vocab=12):
    logits = torch.randn(1, len(argmax_per_node), vocab)
    for i, t in enumerate(argmax_per_node):
        logits[0, i, t] = 20.0
    return logits


def test_greedy_tree_accepts_along_a_branch_that_is_not_the_first_child():
    logits = _logits_with_argmax([7, 1, 8, 2, 11])  # root -> 7 (node 2) -> 8 (node 4) -> bonus 11
    out = greedy_tree_verify(HAND, logits, torch.tensor([2]), 2)
    assert out.num_accepted.tolist() == [2]
    assert out.token_ids.tolist() == [[7, 8, 11]]
    assert out.path_nodes.tolist() == [[0, 2, 4]]


def test_greedy_tree_rejects_at_the_root_and_emits_the_correction():
    logits = _logits_with_argmax([4, 9, 8, 2, 11])
    out = greedy_tree_verify(HAND, logits, torch.tensor([2]), 2)
    assert out.num_accepted.tolist() == [0]
    assert out.token_ids.tolist() == [[4, -1, -1]]
    assert out.path_nodes.tolist() == [[0, -1, -1]]


def test_greedy_tree_stops_at_the_row_depth_limit():
    logits = _logits_with_argmax([7, 1, 8, 2, 11])
    out = greedy_tree_verify(HAND, logits, torch.tensor([1]), 2)
    assert out.token_ids.tolist() == [[7, 8, -1]]


def test_seeded_tree_verify_emits_the_seeded_draws_whatever_the_tree():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 5, 12, generator=gen)
    args = (
        torch.tensor([0.8]),
        torch.tensor([-1]),
        torch.tensor([1.0]),
        torch.tensor([77]),
        torch.tensor([4]),
    )
    first = seeded_tree_verify(HAND, logits, *args, torch.tensor([2]), 2)
    bonus_only = DraftTree(HAND.token_ids[:, :1], HAND.parents[:, :1], HAND.depths[:, :1])
    alone = seeded_tree_verify(bonus_only, logits[:, :1], *args, torch.tensor([2]), 0)
    assert first.token_ids[0, 0] == alone.token_ids[0, 0]


def test_rejection_tree_verify_first_token_follows_the_target_distribution():
    torch.manual_seed(0)
    vocab, trials = 6, 4000
    logits = torch.randn(1, 5, vocab).expand(trials, 5, vocab).contiguous()
    tree = DraftTree(
        torch.tensor([[0, 2, 4, 1, 3]]).expand(trials, 5),
        HAND.parents.expand(trials, 5),
        HAND.depths.expand(trials, 5),
    )
    ones = torch.ones(trials)
    out = rejection_tree_verify(
        tree, logits, ones, torch.full((trials,), -1), ones, torch.arange(trials), torch.full((trials,), 2), 2
    )
    counts = torch.bincount(out.token_ids[:, 0], minlength=vocab).double() / trials
    expected = logits[0, 0].softmax(-1).double()
    assert (counts - expected).abs().max() < 0.03
