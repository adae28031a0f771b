"""LLMEngine.step is one loop over a StepStrategy (engine/step_strategy.py) for every kind of step:
take the step in flight or launch one, launch the following step when it is known, then wait for
this one. A recording wrapper around the engine's strategy shows the order (step n+1 launched before
step n is read), that the synchronous loop never launches ahead, and that a speculative engine (its
SpeculativeSteps wrapping the plain strategy) goes through the same calls with per-row token lists."""

from tpfuse.config import EngineConfig
from tpfuse.engine.engine import LLMEngine
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.engine.step_strategy import PlainSteps

from .spec_helpers import spec_config

ENGINE = dict(model="tiny", device="cpu", num_kv_blocks=64)
PROMPTS = [[51, 52, 53, 54, 55], [60, 61, 62, 63, 64, 65, 66, 67, 68]]


class Recording:
    """Delegates to the engine's strategy and logs (call, id of the launched step)."""

    def __init__(self, inner):
        self.inner, self.log = inner, []

    def launch(self, batch):
        step = self.inner.launch(batch)
        self.log.append(("launch", id(step)))
        return step

    def launch_following(self, step):
        following = self.inner.launch_following(step)
        if following is not None:
            self.log.append(("launch", id(following)))
        return following

    def wait(self, step):
        tokens = self.inner.wait(step)
        assert len(tokens) == len(step.batch.seqs)
        assert all(t is None or (isinstance(t, list) and t) for t in tokens)
        self.log.append(("wait", id(step)))
        return tokens

    def finished(self, step, seconds, chained):
        self.inner.finished(step, seconds, chained)

    def drop(self, step):
        self.log.append(("drop", id(step)))
        self.inner.drop(step)

    def stats(self):
        return self.inner.stats()


def _run(overlap: bool, speculative=None) -> tuple[list, list]:
    config = EngineConfig(**ENGINE, disable_overlap_schedule=not overlap)
    if speculative is not None:
        config = EngineConfig(**ENGINE, disable_overlap_schedule=not overlap, speculative=speculative)
    engine = LLMEngine(config)
    recording = engine.steps = Recording(engine.steps)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    tokens = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    engine.shutdown()
    return list(tokens.values()), recording.log


def _launched_before_read(log) -> int:
    """Steps launched while an earlier launched step was still unread."""
    unread, ahead = set(), 0
    for call, step in log:
        if call == "launch":
            ahead += bool(unread)
            unread.add(step)
        else:
            unread.discard(step)
    return ahead


def test_the_overlapped_loop_launches_the_next_step_before_reading_this_one():
    sync_tokens, sync_log = _run(overlap=False)
    tokens, log = _run(overlap=True)
    assert tokens == sync_tokens
    assert _launched_before_read(sync_log) == 0
    assert _launched_before_read(log) >= 8  # every decode step after the first, for 12 tokens
    waits = [step for call, step in log if call == "wait"]
    launches = [step for call, step in log if call == "launch"]
    assert waits == [s for s in launches if s in set(waits)], "steps are read in launch order"


def test_a_speculative_engine_runs_the_same_loop_with_token_lists():
    plain_tokens, _ = _run(overlap=True)
    tokens, log = _run(overlap=True, speculative=spec_config("ngram", adaptive=False))
    assert tokens == plain_tokens
    assert log and {call for call, _ in log} <= {"launch", "wait", "drop"}


def test_the_plain_strategy_is_what_a_plain_engine_drives():
    engine = LLMEngine(EngineConfig(**ENGINE))
    assert type(engine.steps) is PlainSteps and engine.spec_decoder is None
    engine.shutdown()
