"""The step seam LLMEngine's one loop drives: launch a scheduled batch, launch the step that follows
it when that step is already known, wait for a launched step's tokens, account for it.

`PlainSteps` runs every step on the executor: one sampled token per row. `SpeculativeSteps`
(spec_steps.py) wraps it with the same contract: it runs a step as a plain decode when the adaptive
policy gives it k = 0, otherwise as a speculative step, and chains speculative steps; the engine
never knows which kind a step was. Every strategy returns, per batch row, the tokens the row gets
(None: none), so the engine postprocesses all steps alike (Scheduler.postprocess_multi).

Launches are in order: `launch_following(step)` launches the step after `step` before `step` is
read (the ids `step` samples reach it through the device's token table), and the engine then waits
for `step` first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tpfuse.engine.batch import Batch
    from tpfuse.engine.executor import Executor
    from tpfuse.engine.scheduler import Scheduler


@dataclass(slots=True)
class LaunchedStep:
    """A step on its way: its batch and the handle its strategy waits on (the executor's
    PendingStep, or the speculative decoder's SpecPending when speculative)."""

    batch: Batch
    handle: object
    speculative: bool = False


class StepStrategy(Protocol):
    def launch(self, batch: Batch) -> LaunchedStep:
        """Enqueues the step of batch (a batch Scheduler.schedule returned) and returns at once."""

    def launch_following(self, step: LaunchedStep) -> LaunchedStep | None:
        """Schedules and launches the step after step, which is in flight and not yet read, when the
        batch after it can be planned now (Scheduler.schedule_following / schedule_next_spec_decode
        reserve its KV); None when it cannot."""

    def wait(self, step: LaunchedStep) -> list[list[int] | None]:
        """Per batch row, the tokens the row gets from step (None: none)."""

    def finished(self, step: LaunchedStep, seconds: float, chained: bool) -> None:
        """Accounts for a completed step. seconds: the engine's wall time of it, scheduling and
        postprocessing included; chained: it was launched while the step before it ran."""

    def drop(self, step: LaunchedStep) -> None:
        """Lets a launched step complete and discards it (its rows all finished, or shutdown)."""

    def stats(self) -> dict:
        """EngineStats fields this strategy fills (the speculative counters), by name."""


class PlainSteps:
    """Every step on the executor. executor: ModelRunner or TensorParallelExecutor; scheduler: the
    engine's; engine_seed: --seed. without_lookahead: the engine is speculative, and the step after a plain
    one is asked for as a plain decode (schedule_following's `plain`)."""

    def __init__(
        self,
        executor: Executor,
        scheduler: Scheduler,
        engine_seed: int,
        without_lookahead: bool = False,
    ):
        self.executor = executor
        self.scheduler = scheduler
        self.engine_seed = engine_seed
        self.without_lookahead = without_lookahead

    def launch(self, batch: Batch) -> LaunchedStep:
        executor = self.executor
        return LaunchedStep(batch, executor.launch(batch, executor.pack(batch, self.engine_seed)))

    def schedule_following(self, step: LaunchedStep) -> Batch | None:
        """The batch after step when it can be planned now."""
        return self.scheduler.schedule_following(step.batch, plain=self.without_lookahead)

    def launch_following(self, step: LaunchedStep) -> LaunchedStep | None:
        """Completes step first (a processed step chooses its tokens once the step before it is
        read: that is now), then launches the step after it."""
        self.executor.complete(step.handle)
        following = self.schedule_following(step)
        return None if following is None else self.launch(following)

    def wait(self, step: LaunchedStep) -> list[list[int] | None]:
        return [None if token is None else [token] for token in self.executor.wait(step.handle)]

    def finished(self, step: LaunchedStep, seconds: float, chained: bool) -> None:
        pass

    def drop(self, step: LaunchedStep) -> None:
        self.executor.wait(step.handle)

    def stats(self) -> dict:
        return {}
