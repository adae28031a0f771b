"""Lossless verification of draft tokens against the target's logits: greedy and rejection sampling.

A verify pass runs the target over each sequence's last token followed by its k draft tokens and
yields target_logits [B, k+1, V]: row i predicts the token after draft i (row 0: after the last
verified token). Verification accepts a prefix of the drafts and emits one more token from the
target (the correction at the first rejection, or the bonus token when all drafts were accepted),
so every step emits between 1 and k+1 tokens and the output follows the target's distribution
exactly. Rank 0 decides; the engine broadcasts the result so TP ranks never diverge.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpfuse.kernels.sampling import apply_top_k_top_p
from tpfuse.spec.seeded_random import uniform

_STREAM_ACCEPT = 1
_STREAM_SAMPLE = 2
# The stream seeded rows draw from: one token per (seed, output index), whichever step emits it (a
# verify, a tree verify or a prompt step: engine/spec_decoder.py seeded_prompt_tokens).
STREAM_SEEDED = 5


@dataclass
class VerifyResult:
    """num_accepted: [B] int64, drafts accepted per row (0..k).
    token_ids: [B, k+1] int64, the emitted tokens: the accepted drafts, then the correction or
    bonus token at index num_accepted; entries after it are -1."""

    num_accepted: torch.Tensor
    token_ids: torch.Tensor

    @property
    def num_emitted(self) -> torch.Tensor:
        return self.num_accepted + 1

    def emitted_token_ids(self) -> list[list[int]]:
        """The emitted tokens of each row as Python lists (one host copy)."""
        counts = self.num_emitted.tolist()
        return [row[:n] for row, n in zip(self.token_ids.tolist(), counts, strict=True)]


def _check_shapes(draft_token_ids: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    if draft_token_ids.dim() != 2 or target_logits.dim() != 3:
        raise ValueError(
            f"expected draft_token_ids [B, k] and target_logits [B, k+1, V], got "
            f"{tuple(draft_token_ids.shape)} and {tuple(target_logits.shape)}"
        )
    batch, k = draft_token_ids.shape
    if target_logits.shape[:2] != (batch, k + 1):
        raise ValueError(
            f"target_logits must have one more position than there are drafts: [B, k+1] = "
            f"[{batch}, {k + 1}], got {tuple(target_logits.shape[:2])}"
        )
    return batch, k


def draft_mask(num_draft_tokens: torch.Tensor | None, batch: int, k: int, device) -> torch.Tensor:
    """[B, k] bool: True where a row has a real draft (rows may carry fewer than k, the rest padding).
    num_draft_tokens: [B] int or None (every row has k)."""
    positions = torch.arange(k, device=device)[None, :].expand(batch, k)
    if num_draft_tokens is None:
        return torch.ones(batch, k, dtype=torch.bool, device=device)
    return positions < num_draft_tokens.to(device)[:, None]


def accepted_prefix_length(accept: torch.Tensor) -> torch.Tensor:
    """accept: [B, k] bool -> [B] int64 length of the leading run of True."""
    return accept.to(torch.int64).cumprod(dim=-1).sum(dim=-1)


def emitted_tokens(
    draft_token_ids: torch.Tensor, num_accepted: torch.Tensor, last_token: torch.Tensor
) -> torch.Tensor:
    """draft_token_ids [B, k], num_accepted [B], last_token [B] -> new [B, k+1] int64: the accepted
    drafts, then last_token at index num_accepted, then -1."""
    batch, k = draft_token_ids.shape
    positions = torch.arange(k + 1, device=draft_token_ids.device)[None, :]
    padded = torch.cat([draft_token_ids, draft_token_ids.new_full((batch, 1), -1)], dim=1)
    out = torch.where(positions < num_accepted[:, None], padded, -1)
    return out.scatter(1, num_accepted[:, None], last_token[:, None].to(out.dtype))


def match_verify(
    draft_token_ids: torch.Tensor,
    target_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor | None = None,
) -> VerifyResult:
    """Accepts the longest prefix of drafts equal to target_token_ids [B, k+1] (the token the target
    emits at each verify position), then emits the target's token at the first mismatch."""
    batch, k = draft_token_ids.shape
    accept = (draft_token_ids == target_token_ids[:, :k]) & draft_mask(
        num_draft_tokens, batch, k, target_token_ids.device
    )
    num_accepted = accepted_prefix_length(accept)
    last = target_token_ids.gather(1, num_accepted[:, None])[:, 0]
    return VerifyResult(num_accepted, emitted_tokens(draft_token_ids, num_accepted, last))


def seeded_sample_verify(
    draft_token_ids: torch.Tensor,
    target_logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    seeds: torch.Tensor,
    first_output_index: torch.Tensor,
    num_draft_tokens: torch.Tensor | None = None,
) -> VerifyResult:
    """Lossless sampling that does not depend on the drafts: the token at output index j is drawn from
    the target's distribution by inverting its CDF at a uniform keyed by (seed, j); a draft is accepted
    when it equals that draw. So a seeded request emits the same tokens whatever k, the drafts or the
    batch were. For argmax drafts it accepts with probability p(draft), as rejection sampling does.

    seeds: [B] int64 per request (not per step); first_output_index: [B] int64, the output index of
    each row's first verify position; other arguments as rejection_sample_verify. Rows with
    temperature <= 0 take the argmax.
    """
    batch, k = _check_shapes(draft_token_ids, target_logits)
    device = target_logits.device
    p = target_probs(target_logits, temperatures.to(device), top_ks.to(device), top_ps.to(device))
    counters = first_output_index.to(device)[:, None] + torch.arange(k + 1, device=device)[None, :]
    u = uniform(seeds.to(device), STREAM_SEEDED, counters)
    drawn = sample_inverse_cdf(p.reshape(batch * (k + 1), -1), u.reshape(-1)).view(batch, k + 1)
    greedy_rows = (temperatures.to(device) <= 0)[:, None]
    target = torch.where(greedy_rows, target_logits.argmax(dim=-1), drawn)
    return match_verify(draft_token_ids, target, num_draft_tokens)


def greedy_verify(
    draft_token_ids: torch.Tensor,
    target_logits: torch.Tensor,
    num_draft_tokens: torch.Tensor | None = None,
) -> VerifyResult:
    """Accepts the longest prefix of drafts equal to the target's argmax, then emits the argmax at
    the first mismatch (or after the last draft: the bonus token).

    draft_token_ids: [B, k] int64 target-vocabulary ids; target_logits: [B, k+1, V] any float dtype;
    num_draft_tokens: [B] int, real drafts per row (the rest is padding), default k for every row.
    Raises ValueError on mismatched shapes.
    """
    _check_shapes(draft_token_ids, target_logits)
    return match_verify(draft_token_ids, target_logits.argmax(dim=-1), num_draft_tokens)


def target_probs(
    target_logits: torch.Tensor, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """The distribution tpfuse.kernels.sampling samples from, at every verify position.

    target_logits: [B, P, V]; temperatures (> 0), top_ks, top_ps: [B]. Returns new [B, P, V] float32.
    """
    batch, positions, vocab = target_logits.shape
    temps = temperatures.float().clamp(min=1e-6).repeat_interleave(positions)[:, None]
    flat = target_logits.reshape(batch * positions, vocab).float() / temps
    # The filters sort the vocabulary; skip them when no row asks for one (one host sync).
    if bool(((top_ks > 0) & (top_ks < vocab)).any() | (top_ps < 1.0).any()):
        flat = apply_top_k_top_p(
            flat, top_ks.repeat_interleave(positions), top_ps.float().repeat_interleave(positions)
        )
    return flat.softmax(dim=-1).reshape(batch, positions, vocab)


def sample_inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draws one id per row by inverting the cumulative weights.

    weights: [B, V] >= 0, not all zero; u: [B] uniform in [0, 1). Returns [B] int64 ids, P(i) ∝ weights[i]."""
    cdf = weights.double().cumsum(dim=-1)
    threshold = (u.double() * cdf[:, -1])[:, None].contiguous()
    # The first index whose cdf exceeds the threshold: zero-weight ids are never chosen.
    return torch.searchsorted(cdf, threshold, right=True)[:, 0].clamp(max=weights.shape[-1] - 1)


def rejection_sample_verify(
    draft_token_ids: torch.Tensor,
    target_logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    seeds: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    num_draft_tokens: torch.Tensor | None = None,
) -> VerifyResult:
    """Speculative sampling: the emitted tokens follow the target's sampling distribution exactly.

    Draft i (drawn from q_i) is accepted with probability min(1, p_i(x) / q_i(x)); at the first
    rejection the token is drawn from norm(max(p_i - q_i, 0)); if all are accepted the bonus token is
    drawn from p_k. p is softmax(top-k/top-p filtered logits / temperature), the same distribution
    tpfuse.kernels.sample draws from (same filters, but not the same random numbers).

    draft_token_ids: [B, k] int64; target_logits: [B, k+1, V]; temperatures [B] float (rows with
    temperature <= 0 are verified greedily); top_ks [B] int (<= 0: off); top_ps [B] float (>= 1: off);
    seeds [B] int64, one per row: the draws depend only on the row's seed, not on the batch.
    draft_probs: [B, k, V] float, the distribution each draft was drawn from, in the target
    vocabulary; None for a deterministic (argmax) drafter, treated as q = one-hot(draft): accept with
    probability p(x), recover from p with x removed. num_draft_tokens: [B] real drafts per row.
    Raises ValueError on mismatched shapes.
    """
    batch, k = _check_shapes(draft_token_ids, target_logits)
    device = target_logits.device
    if draft_probs is not None and draft_probs.shape != (batch, k, target_logits.shape[-1]):
        raise ValueError(
            f"draft_probs must be [B, k, V] = {(batch, k, target_logits.shape[-1])}, "
            f"got {tuple(draft_probs.shape)}"
        )
    p = target_probs(target_logits, temperatures.to(device), top_ks.to(device), top_ps.to(device))
    p_of_draft = p[:, :k].gather(2, draft_token_ids[..., None])[..., 0].double()
    if draft_probs is None:
        q_of_draft = torch.ones_like(p_of_draft)
    else:
        q_of_draft = draft_probs.gather(2, draft_token_ids[..., None])[..., 0].double()
    u_accept = uniform(seeds.to(device), _STREAM_ACCEPT, torch.arange(k, device=device))
    accept = (u_accept * q_of_draft < p_of_draft) & draft_mask(num_draft_tokens, batch, k, device)
    num_accepted = accepted_prefix_length(accept)

    rows = torch.arange(batch, device=device)
    p_next = p[rows, num_accepted]  # [B, V]: target distribution where the last token is drawn
    # A row that rejected draft i recovers from max(p_i - q_i, 0); a row that accepted all its
    # drafts draws the bonus token from p itself.
    if k > 0:
        limit = k if num_draft_tokens is None else num_draft_tokens.to(device)
        rejected = num_accepted < limit
        at = num_accepted.clamp(max=k - 1)
        if draft_probs is None:
            q_next = torch.zeros_like(p_next).scatter_(1, draft_token_ids[rows, at][:, None], 1.0)
        else:
            q_next = draft_probs[rows, at].float()
        residual = (p_next - q_next).clamp(min=0.0)
        # p == q makes rejection impossible; the guard only catches rounding leftovers.
        usable = rejected & (residual.sum(dim=-1) > 0)
        p_next = torch.where(usable[:, None], residual, p_next)
    u_sample = uniform(seeds.to(device), _STREAM_SAMPLE, torch.arange(k + 1, device=device))
    last = sample_inverse_cdf(p_next, u_sample[rows, num_accepted])
    sampled = VerifyResult(num_accepted, emitted_tokens(draft_token_ids, num_accepted, last))

    greedy_rows = temperatures.to(device) <= 0
    greedy = greedy_verify(draft_token_ids, target_logits, num_draft_tokens)
    return VerifyResult(
        torch.where(greedy_rows, greedy.num_accepted, sampled.num_accepted),
        torch.where(greedy_rows[:, None], greedy.token_ids, sampled.token_ids),
    )
