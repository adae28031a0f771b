"""Lossless verification of a draft tree (spec/tree.py) against the target's logits at every node.

Every mode walks from the root: at the current node the target's token is decided, the child holding
that token (siblings hold distinct tokens) is accepted and becomes the current node, and the walk
stops where no child matches (or at the row's depth limit); the target's token there is emitted too
(the correction, or the bonus token at a leaf). So a step emits accepted depth + 1 tokens.
- greedy: the target's token is its argmax;
- seeded: drawn by inverting the target's CDF at uniform(seed, output index) as in
  seeded_sample_verify, so a seeded request's tokens do not depend on the tree;
- rejection (multi-candidate, for top-k drafts treated as one-hot q): the children are tried in
  order, each accepted with probability p(x) under the target's renormalised distribution p, and a
  rejected child's probability is removed from p; if all are rejected the token is drawn from what
  is left. The emitted token then follows p exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpfuse.spec.seeded_random import uniform
from tpfuse.spec.tree import DraftTree
from tpfuse.spec.verify import STREAM_SEEDED, sample_inverse_cdf, target_probs

_STREAM_TREE_ACCEPT = 6
_STREAM_TREE_SAMPLE = 7


@dataclass
class TreeVerifyResult:
    """num_accepted: [B] int64 accepted depth; token_ids: [B, S + 1] int64 emitted tokens (accepted
    drafts, then the target's token at index num_accepted, -1 after); path_nodes: [B, S + 1] int64
    node index of the accepted node at each depth (0: the root; -1 past num_accepted)."""

    num_accepted: torch.Tensor
    token_ids: torch.Tensor
    path_nodes: torch.Tensor


def match_tree_verify(
    tree: DraftTree, target_token_ids: torch.Tensor, depth_limit: torch.Tensor, max_depth: int
) -> TreeVerifyResult:
    """target_token_ids: [B, N] the target's token at each node; depth_limit: [B] deepest node a row
    may accept; max_depth: the deepest node of any tree (host-known)."""
    parents, depths = tree.parents, tree.depths
    parent_index = parents.clamp(min=0)
    matches = tree.token_ids == target_token_ids.gather(1, parent_index)
    ok = matches & (depths <= depth_limit[:, None])
    ok[:, 0] = True
    for _ in range(max_depth):
        ok = ok & ok.gather(1, parent_index)
    last = torch.where(ok, depths, -1).argmax(dim=1)  # the accepted nodes form one path
    return _result_from_path(tree, target_token_ids, last, max_depth)


def _result_from_path(
    tree: DraftTree, target_token_ids: torch.Tensor, last: torch.Tensor, max_depth: int
) -> TreeVerifyResult:
    batch = last.shape[0]
    device = last.device
    num_accepted = tree.depths.gather(1, last[:, None])[:, 0]
    path = torch.full((batch, max_depth + 1), -1, dtype=torch.int64, device=device)
    node = last
    for _ in range(max_depth + 1):
        depth = tree.depths.gather(1, node[:, None])[:, 0]
        path.scatter_(1, depth[:, None], node[:, None])
        node = tree.parents.gather(1, node[:, None])[:, 0].clamp(min=0)
    steps = torch.arange(max_depth + 1, device=device)[None, :]
    path = torch.where(steps <= num_accepted[:, None], path, -1)
    tokens = tree.token_ids.gather(1, path.clamp(min=0))
    # Shift by one: token_ids[d - 1] is the token of the accepted node at depth d.
    tokens = torch.cat([tokens[:, 1:], tokens.new_full((batch, 1), -1)], 1)
    tokens = torch.where(steps < num_accepted[:, None], tokens, -1)
    bonus = target_token_ids.gather(1, last[:, None])
    tokens = tokens.scatter(1, num_accepted[:, None], bonus)
    return TreeVerifyResult(num_accepted, tokens, path)


def greedy_tree_verify(
    tree: DraftTree, target_logits: torch.Tensor, depth_limit: torch.Tensor, max_depth: int
) -> TreeVerifyResult:
    """target_logits: [B, N, V]: the longest path whose tokens equal the target's argmax, plus the
    argmax at its end."""
    return match_tree_verify(tree, target_logits.argmax(dim=-1), depth_limit, max_depth)


def seeded_tree_verify(
    tree: DraftTree,
    target_logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    request_seeds: torch.Tensor,
    first_output_index: torch.Tensor,
    depth_limit: torch.Tensor,
    max_depth: int,
) -> TreeVerifyResult:
    """The token at output index j is drawn with uniform(request seed, j) from the target's sampling
    distribution at the node (argmax for temperature <= 0 rows); a child is accepted when it equals
    the draw. first_output_index: [B], the output index of the root's successor."""
    batch, n, _ = target_logits.shape
    p = target_probs(target_logits, temperatures.clamp(min=1e-6), top_ks, top_ps)
    counters = first_output_index[:, None] + tree.depths
    u = uniform(request_seeds, STREAM_SEEDED, counters)
    drawn = sample_inverse_cdf(p.reshape(batch * n, -1), u.reshape(-1)).view(batch, n)
    target = torch.where((temperatures <= 0)[:, None], target_logits.argmax(dim=-1), drawn)
    return match_tree_verify(tree, target, depth_limit, max_depth)


def rejection_tree_verify(
    tree: DraftTree,
    target_logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    seeds: torch.Tensor,
    depth_limit: torch.Tensor,
    max_depth: int,
) -> TreeVerifyResult:
    """Multi-candidate rejection sampling (module docstring); rows with temperature <= 0 greedy.
    seeds: [B] per row and step. Walks each row on the host (eager)."""
    batch, n, _ = target_logits.shape
    device = target_logits.device
    p_all = target_probs(target_logits, temperatures.clamp(min=1e-6), top_ks, top_ps)
    u_accept = uniform(seeds, _STREAM_TREE_ACCEPT, torch.arange(n, device=device))  # per child node
    u_sample = uniform(seeds, _STREAM_TREE_SAMPLE, torch.arange(max_depth + 1, device=device))
    parents, tokens, depths = tree.parents.tolist(), tree.token_ids.tolist(), tree.depths.tolist()
    limits, accept_draws = depth_limit.tolist(), u_accept.tolist()
    target = torch.empty(batch, n, dtype=torch.int64, device=device)
    last = torch.empty(batch, dtype=torch.int64, device=device)
    for b in range(batch):
        node = 0
        while True:
            p = p_all[b, node].double().clone()
            children = [c for c in range(1, n) if parents[b][c] == node and depths[b][c] <= limits[b]]
            accepted = None
            for c in children:
                x = tokens[b][c]
                mass = float(p.sum())
                if mass > 0 and accept_draws[b][c] * mass < float(p[x]):
                    accepted = c
                    break
                p[x] = 0.0
            if accepted is None:
                if float(p.sum()) <= 0:  # rounding left nothing: fall back to the full distribution
                    p = p_all[b, node].double()
                target[b, node] = sample_inverse_cdf(p[None], u_sample[b, depths[b][node]][None])[0]
                last[b] = node
                break
            target[b, node] = tokens[b][accepted]
            node = accepted
    sampled = _result_from_path(tree, target, last, max_depth)
    greedy = greedy_tree_verify(tree, target_logits, depth_limit, max_depth)
    rows = (temperatures <= 0)[:, None]
    return TreeVerifyResult(
        torch.where(rows[:, 0], greedy.num_accepted, sampled.num_accepted),
        torch.where(rows, greedy.token_ids, sampled.token_ids),
        torch.where(rows, greedy.path_nodes, sampled.path_nodes),
    )
