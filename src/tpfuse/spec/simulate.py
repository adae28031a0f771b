"""Benchmark-only simulated acceptance (--speculative-simulate-acceptance-length L).

With random weights a draft is almost never accepted, so the cost of drafting and verifying k tokens
cannot be measured at a realistic acceptance. This mode forces acceptance instead: each draft
position is accepted with a fixed probability a, chained (a draft counts only if every earlier one
did), with a chosen so that the mean acceptance length (accepted drafts + the one target token) is L
at the configured maximum number of drafts. The emitted tokens are then NOT the model's output:
accepted drafts are emitted whatever the target said. Never on by default; every output produced
with it must carry SIMULATED_ACCEPTANCE_NOTICE.
"""

from __future__ import annotations

import torch

from tpfuse.spec.seeded_random import uniform
from tpfuse.spec.verify import VerifyResult, accepted_prefix_length, draft_mask, emitted_tokens

SIMULATED_ACCEPTANCE_NOTICE = (
    "speculative acceptance is SIMULATED (--speculative-simulate-acceptance-length): "
    "timings are real, the generated tokens are not the model's output"
)
_STREAM_SIMULATE = 3
_MAX_DRAFTS = 64  # counters of one step: output_index * _MAX_DRAFTS + draft position


def expected_acceptance_length(acceptance_rate: float, num_draft_tokens: int) -> float:
    """1 + sum_{j=1..k} a^j: mean tokens per step when each draft is accepted with probability a
    given that all earlier ones were."""
    return 1.0 + sum(acceptance_rate**j for j in range(1, num_draft_tokens + 1))


def acceptance_rate_for_length(acceptance_length: float, max_num_draft_tokens: int) -> float:
    """The per-position acceptance probability a with expected_acceptance_length(a, k) == L.

    Raises ValueError unless 1 <= L <= k + 1 (a step emits between 1 and k + 1 tokens).
    """
    if not 1.0 <= acceptance_length <= max_num_draft_tokens + 1:
        raise ValueError(
            f"simulated acceptance length must lie in [1, num_draft_tokens + 1] = "
            f"[1, {max_num_draft_tokens + 1}], got {acceptance_length}"
        )
    low, high = 0.0, 1.0
    for _ in range(60):  # the length is increasing in a: bisection to double precision
        mid = (low + high) / 2
        if expected_acceptance_length(mid, max_num_draft_tokens) < acceptance_length:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def simulate_acceptance(
    draft_token_ids: torch.Tensor,
    target_token_ids: torch.Tensor,
    acceptance_rate: float,
    request_seeds: torch.Tensor,
    output_index: torch.Tensor,
    num_draft_tokens: torch.Tensor | None = None,
) -> VerifyResult:
    """Accepts a random prefix of the drafts (each position with probability acceptance_rate, chained)
    and emits the accepted drafts followed by the target's token at the first unaccepted position.

    draft_token_ids: [B, k] int64; target_token_ids: [B, k+1] int64, what the target would emit at
    each verify position (its greedy or sampled token); request_seeds: [B] int64, one per request;
    output_index: [B] int64, the output index each row's step starts at (the draws of a row depend
    on these two only, so a step packed ahead and shifted on the device draws what it would have
    drawn packed synchronously); num_draft_tokens: [B] real drafts per row. The result is NOT
    lossless: it exists to time speculation, see the module doc.
    """
    batch, k = draft_token_ids.shape
    if target_token_ids.shape != (batch, k + 1):
        raise ValueError(
            f"target_token_ids must be [B, k+1] = {(batch, k + 1)}, got {tuple(target_token_ids.shape)}"
        )
    if k > _MAX_DRAFTS:
        raise ValueError(f"the simulation draws for at most {_MAX_DRAFTS} drafts per step, got {k}")
    device = draft_token_ids.device
    counters = output_index.to(device)[:, None] * _MAX_DRAFTS + torch.arange(k, device=device)
    u = uniform(request_seeds.to(device), _STREAM_SIMULATE, counters)
    accept = (u < acceptance_rate) & draft_mask(num_draft_tokens, batch, k, device)
    num_accepted = accepted_prefix_length(accept)
    last = target_token_ids.gather(1, num_accepted[:, None])[:, 0]
    return VerifyResult(num_accepted, emitted_tokens(draft_token_ids, num_accepted, last))
