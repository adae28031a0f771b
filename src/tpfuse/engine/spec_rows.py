"""Which rows of a speculative step verify, how many drafts they may carry, and whether the step can
run as a window step (spec_inputs.py packs by these rules; spec_decoder.py chooses k by them)."""

from __future__ import annotations

from tpfuse.engine.batch import Batch
from tpfuse.engine.sequence import Sequence


def draft_limit(seq: Sequence, num_draft_tokens: int, max_model_len: int) -> int:
    """Drafts seq can verify: a step emits at most drafts + 1 tokens, whose positions must lie within
    max_model_len. max_tokens does not limit them: postprocessing cuts a row's tokens at max_tokens,
    and a limit that depends on how many tokens the row has would make a chained step's draft counts
    depend on what the step before it accepts (spec_chain.py)."""
    return max(0, min(num_draft_tokens, max_model_len - len(seq) - 1))


def is_decode_row(seq: Sequence, num_new_tokens: int) -> bool:
    """The step computes only seq's newest token, which has at least one position before it."""
    computed = seq.num_computed_tokens
    return num_new_tokens == 1 and computed + 1 == len(seq.token_ids) and computed >= 1


def window_step_ok(batch: Batch, window: int) -> bool:
    """Whether batch can be a window step: only decode rows, each at least `window` positions long,
    whose drafter lags by at most `window` positions, none drawing sampled drafts (temperature > 0
    without a seed: the window drafter drafts by argmax only)."""
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        begin = seq.num_computed_tokens
        if not is_decode_row(seq, n) or begin < window or seq.num_drafter_tokens < begin - window:
            return False
        if seq.params.temperature > 0.0 and seq.params.seed is None:
            return False
    return True


def lags_after_plain_steps(batch: Batch, window: int) -> bool:
    """Whether batch would be a window step but for drafters that fell more than `window` positions
    behind during plain decode steps (adaptive k = 0). A k = 0 step catches them up (the drafter
    extends eagerly, the target replays its plain decode graph), so the steps after it draft inside
    the window graphs instead of verifying eagerly. (A row's first decode step after its prefill
    lags by the prompt and still drafts as it does with a fixed k: output tokens > 1 tell them apart.)"""
    lagging = False
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        begin = seq.num_computed_tokens
        if not is_decode_row(seq, n) or begin < window:
            return False
        if seq.params.temperature > 0.0 and seq.params.seed is None:
            return False
        lagging |= seq.num_drafter_tokens < begin - window and seq.num_output_tokens > 1
    return lagging


def catch_up_limit(batch: Batch, budget: int | None) -> int | None:
    """Positions each decode row may catch up on, None when every lag fits the budget."""
    if budget is None:
        return None
    lags = [
        seq.num_computed_tokens - min(seq.num_drafter_tokens, seq.num_computed_tokens - 1)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
        if is_decode_row(seq, n)
    ]
    if sum(lags) <= budget:
        return None
    return max(1, budget // len(lags))
