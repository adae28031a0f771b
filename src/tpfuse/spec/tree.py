"""Static draft trees (EAGLE-2 style): shape from per-depth top-k candidates, and tree attention bits.

A sequence's tree has num_draft_tokens nodes: node 0 is the root (the sequence's newest token, at
position L) and nodes 1..N-1 are drafts in topological order (a parent's index is below its child's).
Node i is verified at position L + depth[i] and its K/V is stored at the temporary slot of position
L + i; after verification the accepted path's K/V is moved to positions L + 1 .. L + a (see
engine/spec_decoder.py). Drafting: depth 1 takes the top-k tokens of the root's draft distribution;
each later depth expands the k best nodes of the previous depth (by cumulative draft log-probability)
with their top-k children; the best N-1 of all candidates form the tree. A child's cumulative score
never exceeds its parent's, and ties keep the earlier (shallower) candidate first, so the kept set
always contains every kept node's parent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_TREE_SPAN = 62  # tree attention bits cover 64 relative positions; keep a margin


@dataclass
class DraftTree:
    """token_ids: [B, N] int64 (column 0: the root's token, filled by the caller when known);
    parents: [B, N] int64 node index of each node's parent (-1 for the root);
    depths: [B, N] int64 (0 for the root)."""

    token_ids: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[1]


def check_tree_settings(num_steps: int, eagle_topk: int, num_draft_tokens: int) -> None:
    """Raises ValueError naming the flag to change when a tree of these settings cannot be built."""
    candidates = eagle_topk + (num_steps - 1) * eagle_topk * eagle_topk
    if not 2 <= num_draft_tokens <= min(candidates + 1, MAX_TREE_SPAN):
        raise ValueError(
            f"--speculative-num-draft-tokens {num_draft_tokens} with --speculative-eagle-topk {eagle_topk} "
            f"and --speculative-num-steps {num_steps}: a tree needs 2..{min(candidates + 1, MAX_TREE_SPAN)} "
            "nodes (root included); change --speculative-num-draft-tokens"
        )
    if eagle_topk * num_steps > MAX_TREE_SPAN:
        raise ValueError(
            f"--speculative-eagle-topk {eagle_topk} x --speculative-num-steps {num_steps} exceeds "
            f"{MAX_TREE_SPAN} drafter entries; lower one of them"
        )


def select_tree(
    candidate_tokens: torch.Tensor,
    candidate_scores: torch.Tensor,
    candidate_parents: torch.Tensor,
    candidate_depths: torch.Tensor,
    num_draft_tokens: int,
) -> DraftTree:
    """Keeps the best num_draft_tokens - 1 candidates of each sequence as a tree.

    candidate_*: [B, C] in depth-major order; candidate_parents: the parent's candidate index (-1:
    the root), always below the child's; scores: cumulative draft log-probabilities.
    Returns the DraftTree (root token 0: the caller writes it).
    """
    batch, _ = candidate_tokens.shape
    device = candidate_tokens.device
    keep = num_draft_tokens - 1
    order = torch.sort(candidate_scores, dim=1, descending=True, stable=True).indices[:, :keep]
    chosen = order.sort(dim=1).values  # candidate index order: parents before children
    node_of = torch.zeros_like(candidate_tokens)  # root (-1) and dropped candidates map to node 0
    node_ids = torch.arange(1, keep + 1, device=device).expand(batch, keep)
    node_of.scatter_(1, chosen, node_ids)
    parent_cand = candidate_parents.gather(1, chosen)
    parent_node = torch.where(parent_cand < 0, 0, node_of.gather(1, parent_cand.clamp(min=0)))
    root = torch.full((batch, 1), -1, dtype=torch.int64, device=device)
    zeros = torch.zeros(batch, 1, dtype=torch.int64, device=device)
    return DraftTree(
        token_ids=torch.cat([zeros, candidate_tokens.gather(1, chosen)], 1),
        parents=torch.cat([root, parent_node], 1),
        depths=torch.cat([zeros, candidate_depths.gather(1, chosen)], 1),
    )


def ancestor_matrix(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents: [B, N] int64 (-1 root) -> [B, N, N] bool, [b, i, j]: j is i or an ancestor of i."""
    batch, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(batch, n, n)
    out = eye.clone()
    current = torch.arange(n, device=parents.device).expand(batch, n)
    for _ in range(max_depth):
        current = parents.gather(1, current).clamp(min=0)
        out |= torch.nn.functional.one_hot(current, n).bool()
    return out


def tree_attention_bits(visible: torch.Tensor) -> torch.Tensor:
    """visible: [B, N, N] bool among a sequence's last N query rows ([b, i, j]: row i sees row j,
    only j <= i counts). Returns [B * N] int64 relative bits for prefill attention's tree_mask:
    bit d of row i set when row i - d is visible, and every bit past i set (the context)."""
    batch, n, _ = visible.shape
    if n > MAX_TREE_SPAN:
        raise ValueError(f"a tree of {n} rows exceeds the {MAX_TREE_SPAN} rows tree attention covers")
    device = visible.device
    i = torch.arange(n, device=device)
    distance = (i[:, None] - i[None, :]).clamp(min=0)  # [N, N]
    causal = i[None, :] <= i[:, None]
    powers = torch.ones((), dtype=torch.int64, device=device) << distance
    bits = torch.where(visible & causal, powers, 0).sum(dim=-1)  # distinct powers: the sum is the OR
    context = ~((torch.ones((), dtype=torch.int64, device=device) << (i + 1)) - 1)
    return (bits | context).reshape(batch * n)


class TreeCandidates:
    """Collects a batch's draft candidates depth by depth (depth-major candidate order).

    add_depth(logprobs) takes the draft log-probabilities after each frontier node ([B, F, V]; F = 1
    at depth 1, the root) and adds each frontier node's top-k children; it returns the indices
    ([B, k] into the F * k new candidates) of the next frontier: the k best by cumulative score.
    """

    def __init__(self, topk: int):
        self.topk = topk
        self.tokens: list[torch.Tensor] = []
        self.scores: list[torch.Tensor] = []
        self.parents: list[torch.Tensor] = []
        self.depths: list[torch.Tensor] = []
        self.frontier_scores: torch.Tensor | None = None  # [B, F]
        self.frontier_candidates: torch.Tensor | None = None  # [B, F] candidate index, None: the root
        self.num_candidates = 0

    def add_depth(self, logprobs: torch.Tensor, draft_to_target=None) -> torch.Tensor:
        """logprobs: [B, F, V] float; draft_to_target maps draft ids to target ids (or None).
        Returns [B, k] int64: positions among this depth's F * k candidates of the next frontier."""
        batch, frontier, _ = logprobs.shape
        top = logprobs.topk(self.topk, dim=-1)  # [B, F, k]
        base = 0.0 if self.frontier_scores is None else self.frontier_scores[:, :, None]
        scores = (top.values.double() + base).reshape(batch, frontier * self.topk)
        ids = top.indices.reshape(batch, frontier * self.topk)
        if draft_to_target is not None:
            ids = draft_to_target(ids)
        if self.frontier_candidates is None:
            parents = torch.full_like(ids, -1)
        else:
            parents = self.frontier_candidates.repeat_interleave(self.topk, dim=1)
        depth = len(self.tokens) + 1
        self.tokens.append(ids)
        self.scores.append(scores)
        self.parents.append(parents)
        self.depths.append(torch.full_like(ids, depth))
        chosen = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, : self.topk]
        self.frontier_scores = scores.gather(1, chosen)
        self.frontier_candidates = chosen + self.num_candidates
        self.num_candidates += frontier * self.topk
        return chosen

    def frontier_tokens(self) -> torch.Tensor:
        """[B, k] target ids of the current frontier."""
        return torch.cat(self.tokens, 1).gather(1, self.frontier_candidates)

    def select(self, num_draft_tokens: int) -> DraftTree:
        """The best num_draft_tokens - 1 candidates as a DraftTree (select_tree)."""
        cat = [torch.cat(x, 1) for x in (self.tokens, self.scores, self.parents, self.depths)]
        return select_tree(*cat, num_draft_tokens)


def num_lookahead_tokens(spec) -> int:
    """Positions past a decode's newest token that one speculative step writes (KV blocks the
    scheduler reserves): chain num_steps; a tree its num_draft_tokens - 1 verify nodes or its
    drafter entries (eagle_topk per depth past the first), whichever reaches further."""
    if spec.eagle_topk <= 1:
        return spec.num_steps
    return max(spec.num_steps, spec.num_draft_tokens - 1, spec.eagle_topk * (spec.num_steps - 1))
