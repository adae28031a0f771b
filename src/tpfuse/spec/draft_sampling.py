"""How model drafters pick each draft token: argmax, or a seeded draw whose distribution is kept
for rejection sampling (tpfuse.spec.verify needs q, the distribution each draft was drawn from)."""

from __future__ import annotations

import torch

from tpfuse.spec.seeded_random import uniform
from tpfuse.spec.verify import sample_inverse_cdf

_STREAM_DRAFT = 4


def choose_draft_tokens(
    logits: torch.Tensor, temperatures: torch.Tensor | None, seeds: torch.Tensor | None, step: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits: [B, V] float32. Without temperatures: argmax, probs None. With temperatures [B] and
    seeds [B]: rows > 0 sample softmax(logits / T) (seeded per row and step), rows <= 0 take the
    argmax with a one-hot distribution. Returns (ids [B] int64, probs [B, V] float32 or None)."""
    greedy = logits.argmax(dim=-1)
    if temperatures is None:
        return greedy, None
    temps = temperatures.to(logits.device).float()
    probs = (logits / temps.clamp(min=1e-6)[:, None]).softmax(dim=-1)
    u = uniform(seeds.to(logits.device), _STREAM_DRAFT, torch.tensor([step], device=logits.device))[:, 0]
    ids = torch.where(temps > 0, sample_inverse_cdf(probs, u), greedy)
    one_hot = torch.zeros_like(probs).scatter_(1, greedy[:, None], 1.0)
    return ids, torch.where((temps > 0)[:, None], probs, one_hot)
