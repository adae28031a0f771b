"""Adaptive speculation at TP=1: a decode step the policy gives k = 0 runs as a plain overlapped
decode (no drafter work), and drafting resumes afterwards with the drafter caught up; tokens stay
those of plain greedy decoding throughout."""

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
    launch, run = executor.launch, decoder.run
    executor.launch = lambda *a, **kw: plain_steps.append(1) or launch(*a, **kw)
    decoder.run = lambda *a: spec_steps.append(1) or run(*a)
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


def test_only_plain_steps_launched_behind_another_are_timed(tmp_path):
    """A plain step's cost is the gap since the previous one completed; that gap holds idle time
    (no requests, a speculative step) unless the step was chained behind the previous one."""
    path = write_eagle3_head(str(tmp_path))
    llm = LLM(config=EngineConfig(**ENGINE, speculative=spec_config("eagle3", path, adaptive=True)))
    decoder = llm.engine.spec_decoder
    recorded = []
    decoder.policy.record_step = lambda rows, k, seconds: recorded.append((rows, k))
    decoder.plain_step_finished(4, chained=False)
    decoder.plain_step_finished(4, chained=True)
    decoder.plain_step_finished(4, chained=False)
    assert recorded == [(4, 0)]
