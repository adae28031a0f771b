"""SpeculativeSteps: the step strategy of a speculative engine, wrapping the plain one.

The engine drives it exactly like PlainSteps (step_strategy.py). Inside, each step is one of:
- a plain decode, when adaptive speculation gives the batch k = 0 (no drafter work; the drafters
  catch up when drafting resumes), launched ahead of the step before like any plain decode;
- a speculative step (SpecDecoder: draft, verify, the tokens each row gets), with EAGLE-3 chain
  drafting chained: the next window step launched as a template while this one runs (spec_chain.py).
The policy's clocks (plain_step_finished / step_finished) hear of each completed step here.
"""

from __future__ import annotations

from tpfuse.config import EngineConfig
from tpfuse.engine.batch import Batch
from tpfuse.engine.scheduler import Scheduler
from tpfuse.engine.spec_decoder import SpecDecoder
from tpfuse.engine.step_strategy import LaunchedStep, PlainSteps


class SpeculativeSteps:
    """config: the engine settings; plain: the PlainSteps over the engine's executor (built with
    without_lookahead); max_model_len: the engine's."""

    def __init__(self, config: EngineConfig, plain: PlainSteps, scheduler: Scheduler, max_model_len: int):
        spec = config.speculative
        self.plain = plain
        self.scheduler = scheduler
        self.engine_seed = config.seed
        self.decoder = SpecDecoder(config, plain.executor, max_model_len)
        # Adaptive speculation: a decode step the policy gives k = 0 runs as a plain, overlapped decode.
        self.plain_when_k_is_zero = spec.adaptive and not config.disable_overlap_schedule
        # Chained speculative steps (spec_chain.py): EAGLE-3 chain drafting in windows, any TP size.
        self.chains = self.decoder.ext_window > 0 and not config.disable_overlap_schedule

    def _runs_plain(self, batch: Batch) -> bool:
        return self.plain_when_k_is_zero and self.decoder.chooses_plain_decode(batch)

    def launch(self, batch: Batch) -> LaunchedStep:
        if self._runs_plain(batch):
            return self.plain.launch(batch)
        return LaunchedStep(batch, self.decoder.launch(batch, self.engine_seed), speculative=True)

    def launch_following(self, step: LaunchedStep) -> LaunchedStep | None:
        if not step.speculative:  # a plain step is followed ahead only by a plain one
            following = self.plain.schedule_following(step)
            if following is None or not self._runs_plain(following):
                return None  # a step that speculates is scheduled (and packed) when this one is read
            return self.plain.launch(following)
        pending = step.handle
        if not (self.chains and pending.pure_decode and pending.decode_rows):
            return None
        following = self.scheduler.schedule_next_spec_decode(step.batch)
        if following is None or self.decoder.chained_num_draft_tokens(following) is None:
            return None
        launched = self.decoder.launch(following, self.engine_seed, previous=pending)
        return LaunchedStep(following, launched, speculative=True)

    def wait(self, step: LaunchedStep) -> list[list[int] | None]:
        return self.decoder.wait(step.handle) if step.speculative else self.plain.wait(step)

    def finished(self, step: LaunchedStep, seconds: float, chained: bool) -> None:
        if step.speculative:
            self.decoder.step_finished(seconds, chained)
        else:
            self.decoder.plain_step_finished(len(step.batch.seqs), chained, seconds)

    def drop(self, step: LaunchedStep) -> None:
        if step.speculative:
            self.decoder.drop(step.handle)
        else:
            self.plain.drop(step)

    def stats(self) -> dict:
        d = self.decoder
        return dict(
            spec_num_draft_tokens=d.current_num_draft_tokens,
            spec_acceptance_length=d.stats.acceptance_length,
            spec_num_drafts_total=d.stats.num_drafts,
            spec_num_draft_tokens_total=d.stats.num_draft_tokens,
            spec_num_accepted_tokens_total=d.stats.num_accepted_tokens,
            spec_acceptance_rate_per_position=d.stats.acceptance_rate_per_position(),
            simulated_acceptance=int(d.verifier.simulated),
        )
