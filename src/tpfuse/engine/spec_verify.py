"""Verification of a speculative step's chain drafts, in the parts every rank can compute alike.

`verify_inputs` masks the banned ids and names the drafts; the chain verifier, chosen once at
construction (`chain_verifier`), is greedy verification or the benchmark-only simulation
(spec/simulate.py): neither draws a random number that depends on the rank, so a tensor-parallel
worker computes rank 0's result bit for bit from its own (identical) logits. A chained step
(spec_chain.ChainLink) shifts by that result on every rank.
"""

from __future__ import annotations

import torch

from tpfuse.config import SpeculativeConfig
from tpfuse.spec.simulate import acceptance_rate_for_length, simulate_acceptance
from tpfuse.spec.verify import VerifyResult, greedy_verify


def verify_inputs(forward, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(drafts [D, k], drafts per row [D], draft probabilities or None) of a chain step's verify
    rows; the banned (row, token) pairs are set to -inf in forward.verify_logits first."""
    spec, logits = forward.spec, forward.verify_logits
    if spec.header.num_banned:
        flat = logits.view(spec.header.num_decode * (k + 1), -1)
        flat[spec.banned_rows, spec.banned_ids] = float("-inf")
    if forward.proposal is not None:
        proposal = forward.proposal
        return proposal.token_ids, proposal.num_draft_tokens, proposal.probs
    return spec.draft_ids.view(spec.header.num_decode, k), spec.num_drafts, None


class GreedyChainVerifier:
    """Production: greedy verification of a step whose rows are all greedy; None when rows sample
    (rank 0's rejection sampling decides those)."""

    simulated = False

    def __call__(self, forward, drafts: torch.Tensor, counts: torch.Tensor) -> VerifyResult | None:
        if forward.spec.header.all_greedy:
            return greedy_verify(drafts, forward.verify_logits, counts)
        return None


class SimulatedChainVerifier:
    """Benchmark only (--speculative-simulate-acceptance-length): each draft position is accepted with
    probability acceptance_rate, seeded per request and output index, whatever the target says."""

    simulated = True

    def __init__(self, acceptance_rate: float):
        self.acceptance_rate = acceptance_rate

    def __call__(self, forward, drafts: torch.Tensor, counts: torch.Tensor) -> VerifyResult:
        spec, target = forward.spec, forward.verify_logits.argmax(dim=-1)
        return simulate_acceptance(
            drafts, target, self.acceptance_rate, spec.request_seeds, spec.output_index, counts
        )


ChainVerifier = GreedyChainVerifier | SimulatedChainVerifier


def chain_verifier(spec: SpeculativeConfig) -> ChainVerifier:
    """The verifier every rank builds from the same settings, so all compute the same results."""
    if spec.simulate_acceptance_length is None:
        return GreedyChainVerifier()
    return SimulatedChainVerifier(acceptance_rate_for_length(spec.simulate_acceptance_length, spec.num_steps))


def worker_chain_result(forward, verifier: ChainVerifier) -> VerifyResult | None:
    """Ranks 1..N-1: the result a chained step after this one shifts by (rank 0 verifies the same
    way), or None when no chained step can follow it (not a pure decode chain step, or rows sample)."""
    h = forward.spec.header
    if not (h.pure_decode and h.num_decode and not h.tree) or forward.verify_logits is None:
        return None
    drafts, counts, _ = verify_inputs(forward, h.num_draft_tokens)
    return verifier(forward, drafts, counts)
