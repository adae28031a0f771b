"""Verification of a speculative step's chain drafts.

`verify_inputs` masks the banned ids and names the drafts; the chain verifier, chosen once at
construction (`chain_verifier`), is greedy verification or the benchmark-only simulation
(spec/simulate.py): neither draws a random number that depends on the rank, so a tensor-parallel
worker computes rank 0's result bit for bit from its own (identical) logits. A chained step
(spec_chain.ChainLink) shifts by that result on every rank. Rows that sample are verified on rank 0
only (`verify_chain`): rejection sampling, or seeded_sample_verify for seeded requests.
"""

from __future__ import annotations

import torch

from tpfuse.config import SpeculativeConfig
from tpfuse.spec.simulate import acceptance_rate_for_length, simulate_acceptance
from tpfuse.spec.verify import VerifyResult, greedy_verify, rejection_sample_verify, seeded_sample_verify


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


@torch.inference_mode()
def verify_chain(
    forward, k: int, verifier: ChainVerifier, any_seeded: bool, all_seeded: bool
) -> tuple[VerifyResult, torch.Tensor]:
    """Rank 0: (result, drafts per row [D]) of a chain step's verify rows: the verifier's result when
    it gives one, else rejection sampling (seeded_sample_verify for the seeded rows)."""
    spec, logits = forward.spec, forward.verify_logits
    drafts, counts, probs = verify_inputs(forward, k)
    result = verifier(forward, drafts, counts)
    if result is not None:  # what every rank computes alike
        return result, counts
    sampling = (spec.temperatures, spec.top_ks, spec.top_ps)
    seeded = None
    if any_seeded:
        seeded = seeded_sample_verify(
            drafts, logits, *sampling, spec.request_seeds, spec.output_index, counts
        )
        if all_seeded:
            return seeded, counts
    result = rejection_sample_verify(drafts, logits, *sampling, spec.seeds, probs, counts)
    if seeded is not None:
        use = spec.seeded.bool()
        result = VerifyResult(
            torch.where(use, seeded.num_accepted, result.num_accepted),
            torch.where(use[:, None], seeded.token_ids, result.token_ids),
        )
    return result, counts
