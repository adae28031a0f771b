"""Adaptive speculation at TP=1: a decode step the policy gives k = 0 runs as a plain overlapped
decode (no drafter work), and drafting resumes afterwards with the drafter caught up; tokens stay
those of plain greedy decoding throughout."""

import time

from tpfuse.config import EngineConfig
from tpfuse.engine.llm import LLM
from tpfuse.engine.sampling_params import SamplingParams

from .spec_helpers import ENGINE, PROMPTS, greedy, spec_config, write_eagle3_head


def test_k_zero_steps_run_plain_and_drafting_resumes_losslessly(tmp_path):
    kw = {**ENGINE, "enable_prefix_caching": False}
    expected = [o.token_ids for o in LLM(**kw).generate(PROMPTS[:3], greedy(40))]
    path = write_eagle3_head(str(tmp_path))
    llm = LLM(config=EngineConfig(**kw, speculative=spec_config("eagle3", path, adaptive=True)))
    engine = llm.engine
    decoder, executor = engine.spec_decoder, engine.executor
    choices = iter([0] * 12 + [3] * 1000)  # twelve choices of no drafts (some in mixed steps), then k = 3
    decoder.policy.choose = lambda num_decode: next(choices)
    plain_steps, spec_steps = [], []
    launch, spec_launch = executor.launch, decoder.launch
    executor.launch = lambda *a, **kw: plain_steps.append(1) or launch(*a, **kw)
    decoder.launch = lambda *a, **kw: spec_steps.append(1) or spec_launch(*a, **kw)
    outputs = [o.token_ids for o in llm.generate(PROMPTS[:3], greedy(40))]
    assert outputs == expected
    assert len(plain_steps) >= 4, "k = 0 decode steps should run as plain (overlapped) decodes"
    assert decoder.stats.num_drafts > 0, "drafting should resume after the plain steps"
    assert spec_steps


def test_a_seeded_sampled_request_never_leaves_the_speculative_path(tmp_path):
    path = write_eagle3_head(str(tmp_path))
    llm = LLM(config=EngineConfig(**ENGINE, speculative=spec_config("eagle3", path, adaptive=True)))
    decoder, executor = llm.engine.spec_decoder, llm.engine.executor
    decoder.policy.choose = lambda num_decode: 0
    plain_steps = []
    launch = executor.launch
    executor.launch = lambda *a, **kw: plain_steps.append(1) or launch(*a, **kw)
    llm.generate(PROMPTS[0], SamplingParams(temperature=0.8, seed=5, max_tokens=8, ignore_eos=True))
    assert plain_steps == []


def test_a_chained_plain_step_costs_the_gap_and_an_unchained_one_its_own_time(tmp_path):
    """A chained plain step's cost is the gap since the previous one completed (steps overlap). An
    unchained one's gap may hold idle time or other steps, so it is timed by its own wall time: this
    is also how a lone k = 0 step, run to re-measure k = 0, gets measured at all."""
    path = write_eagle3_head(str(tmp_path))
    llm = LLM(config=EngineConfig(**ENGINE, speculative=spec_config("eagle3", path, adaptive=True)))
    decoder = llm.engine.spec_decoder
    recorded = []
    decoder.policy.record_step = lambda rows, k, seconds: recorded.append((rows, k, seconds))
    decoder.plain_step_finished(4, chained=False, own_seconds=0.25)
    decoder.plain_step_finished(4, chained=True, own_seconds=0.5)
    time.sleep(0.01)
    decoder.plain_step_finished(4, chained=True, own_seconds=0.5)
    assert recorded[0] == (4, 0, 0.25)
    assert [r[:2] for r in recorded] == [(4, 0)] * 3
    assert all(r[2] < 0.5 for r in recorded[1:]) and recorded[2][2] >= 0.01  # the gaps, not own_seconds


def test_drafting_resumes_after_a_catch_up_step_so_it_stays_inside_the_window_graphs(tmp_path, monkeypatch):
    """After plain steps the drafters lag by more than the window: the step the policy gives k > 0
    runs at k = 0 while the drafter catches up (target in its plain graph, not an eager verify),
    is not timed as a k = 0 step, and the very next step drafts that k as a window step."""
    from tpfuse.engine import spec_decoder as spec_decoder_module
    from tpfuse.engine.spec_inputs import read_spec_header
    from tpfuse.engine.step_inputs import read_header

    kw = {**ENGINE, "enable_prefix_caching": False}
    expected = [o.token_ids for o in LLM(**kw).generate(PROMPTS[:2], greedy(40))]
    path = write_eagle3_head(str(tmp_path))
    llm = LLM(config=EngineConfig(**kw, speculative=spec_config("eagle3", path, adaptive=True)))
    decoder = llm.engine.spec_decoder
    assert decoder.ext_window > 0
    choices = iter([0] * 16 + [3] * 1000)
    decoder.policy.choose = lambda num_decode: next(choices)
    timed = []  # k of each speculative step timed for the policy (plain steps' timing left out)
    decoder.policy.record_step = lambda rows, k, seconds: timed.append(k)
    caught_up = []  # rows of each catch-up step timed for the policy
    decoder.policy.record_catch_up = lambda rows, seconds: caught_up.append(rows)
    decoder.plain_step_finished = lambda num_rows, chained, own_seconds: None
    packed_steps = []  # (k, window step) of every speculative step with decode rows
    pack = spec_decoder_module.pack_spec_step

    def recording_pack(batch, *args, **kwargs):
        packed = pack(batch, *args, **kwargs)
        spec = read_spec_header(packed, read_header(packed))
        if spec.num_decode:
            packed_steps.append((spec.num_draft_tokens, bool(spec.ext_window)))
        return packed

    monkeypatch.setattr(spec_decoder_module, "pack_spec_step", recording_pack)
    outputs = [o.token_ids for o in llm.generate(PROMPTS[:2], greedy(40))]
    assert outputs == expected
    resumed = [i for i, (k, _) in enumerate(packed_steps) if k == 3]
    assert resumed, "drafting should resume"
    first = resumed[0]
    assert packed_steps[first - 1] == (0, False), "a catch-up step at k = 0 comes first"
    assert all(window for _, window in packed_steps[first:]), "then every step is a window step"
    assert timed and set(timed) == {3}, "the catch-up step is not timed as a k = 0 step"
    assert caught_up == [2], "the catch-up step's time goes to the policy as the cost of leaving k = 0"


def test_the_policy_decides_once_per_step_when_the_engine_asks_ahead(tmp_path, monkeypatch):
    """While a plain step runs the engine asks whether the next one runs plain too (to launch it
    early); told no, it asks again when it schedules that step. The second question must get the
    first answer, not a second choose(): the k > 0 the policy chose (a refresh run, say) is run."""
    from tpfuse.engine import spec_decoder as spec_decoder_module
    from tpfuse.engine.spec_inputs import read_spec_header
    from tpfuse.engine.step_inputs import read_header

    kw = {**ENGINE, "enable_prefix_caching": False}
    expected = [o.token_ids for o in LLM(**kw).generate(PROMPTS[:2], greedy(40))]
    path = write_eagle3_head(str(tmp_path))
    llm = LLM(config=EngineConfig(**kw, speculative=spec_config("eagle3", path, adaptive=True)))
    decoder = llm.engine.spec_decoder
    choices = iter([0] * 8 + [2] + [0] * 6 + [3] * 1000)
    decoder.policy.choose = lambda num_decode: next(choices)
    drafted = []  # k of every speculative step with decode rows
    pack = spec_decoder_module.pack_spec_step

    def recording_pack(batch, *args, **kwargs):
        packed = pack(batch, *args, **kwargs)
        spec = read_spec_header(packed, read_header(packed))
        if spec.num_decode:
            drafted.append(spec.num_draft_tokens)
        return packed

    monkeypatch.setattr(spec_decoder_module, "pack_spec_step", recording_pack)
    outputs = [o.token_ids for o in llm.generate(PROMPTS[:2], greedy(40))]
    assert outputs == expected
    assert 2 in drafted, "the k = 2 chosen while the engine looked ahead never ran"
    assert drafted.index(2) < drafted.index(3)


def test_a_first_decode_step_outside_the_window_is_not_timed_for_the_policy(tmp_path):
    """A row's first decode after its prefill drafts outside the window (the drafter extends over the
    whole prompt, eagerly): a one-off that costs many decode steps, so the policy is not told its
    time; every window step's is."""
    path = write_eagle3_head(str(tmp_path))
    llm = LLM(config=EngineConfig(**ENGINE, speculative=spec_config("eagle3", path, adaptive=True)))
    decoder = llm.engine.spec_decoder
    decoder.policy.choose = lambda num_decode: 3
    told = []
    decoder.policy.record_step = lambda rows, k, seconds: told.append(k)
    windows = []  # ext_window of every speculative step with decode rows
    execute = decoder.execute_spec

    def recording(packed, *shift):
        forward = execute(packed, *shift)
        if forward.spec.header.num_decode:
            windows.append(forward.spec.header.ext_window)
        return forward

    decoder.execute_spec = recording
    llm.generate(PROMPTS[0], greedy(30))
    assert windows[0] == 0 and all(windows[1:]), windows
    assert told == [3] * (len(windows) - 1)
