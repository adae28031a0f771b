"""The overlap schedule at TP > 1 (gloo on CPU): rank 0 publishes and launches step n+1 before it reads
step n, the workers take step n's ids from their own token table, and every request gets
the TP=1 tokens (greedy and seeded sampling); a worker that is alive but stuck ends the run with an
error naming it within the step timeout."""

import contextlib
import textwrap
import time

import pytest

from tests.engine.checkpoints import build_checkpoint
from tests.engine.tp_processes import start_engine_script
from tpfuse.engine import engine as engine_module
from tpfuse.engine.llm import LLM
from tpfuse.engine.sampling_params import SamplingParams
from tpfuse.engine.worker import TensorParallelExecutor

# Prompts prefilled in chunks of 8 beside the decodes: the steps launched ahead mix continuing
# chunks with decodes whose ids only the device knows.
ENGINE = dict(
    device="cpu", num_kv_blocks=96, block_size=4, max_num_batched_tokens=32, max_prefill_tokens_per_step=8
)
PROMPTS = [[5, 17, 33, 100, 2, 9, 81], [200, 3], list(range(40, 61))]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=7, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True),
]


class RecordingExecutor:
    """Wraps an executor and records ("launch", n, chained) and ("wait", n) in call order."""

    def __init__(self, inner):
        self.inner = inner
        self.events: list[tuple] = []
        self._launched: list = []
        self._read: set[int] = set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def launch(self, batch, packed):
        ahead = len(self._read) < len(self._launched)  # an earlier launch is still unread
        pending = self.inner.launch(batch, packed)
        self.events.append(("launch", len(self._launched), ahead))
        self._launched.append(pending)
        return pending

    def wait(self, pending):
        n = next(i for i, p in enumerate(self._launched) if p is pending)
        self._read.add(n)
        self.events.append(("wait", n))
        return self.inner.wait(pending)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tp-overlap"))
    build_checkpoint(directory, "llama")
    llm = LLM(directory, **ENGINE)
    expected = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    llm.shutdown()
    return directory, expected


def _generate_at_tp2_recorded(directory, params, monkeypatch) -> tuple[list, RecordingExecutor]:
    """(each prompt's tokens, the executor's recorded launches and waits) of a TP = 2 run."""
    make = engine_module._make_executor
    recorders = []

    def recording(config):
        recorders.append(RecordingExecutor(make(config)))
        return recorders[-1]

    monkeypatch.setattr(engine_module, "_make_executor", recording)
    llm = LLM(directory, tp_size=2, **ENGINE)
    try:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.shutdown()
    [recorder] = recorders
    return tokens, recorder


def test_at_tp2_step_n_plus_1_is_launched_before_step_n_is_read(checkpoint, monkeypatch):
    directory, expected = checkpoint
    tokens, recorder = _generate_at_tp2_recorded(directory, PARAMS, monkeypatch)
    assert tokens == expected
    assert isinstance(recorder.inner, TensorParallelExecutor)
    order = {event: i for i, event in enumerate(recorder.events)}
    chained = [n for kind, n, *rest in recorder.events if kind == "launch" and rest[0]]
    assert len(chained) >= 5  # most decode steps of the run
    for n in chained:  # launched (step n-1's ids on the device) before step n-1 was read
        assert order[("launch", n, True)] < order[("wait", n - 1)]


PROCESSED = [
    SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, repetition_penalty=10.0, logprobs=2),
    SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=7, ignore_eos=True, logit_bias={3: 6.0}),
    SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True),
]


def test_at_tp2_rows_with_logits_processing_get_rank0s_ids_and_are_launched_ahead(checkpoint, monkeypatch):
    """Rank 0 chooses processed rows' ids alone and broadcasts them, so the workers' token tables hold
    the processed ids and steps after them can be launched ahead: the TP = 1 tokens."""
    directory, _ = checkpoint
    llm = LLM(directory, **ENGINE)
    expected = [o.token_ids for o in llm.generate(PROMPTS, PROCESSED)]
    llm.shutdown()
    tokens, recorder = _generate_at_tp2_recorded(directory, PROCESSED, monkeypatch)
    assert tokens == expected
    assert sum(1 for kind, _, *rest in recorder.events if kind == "launch" and rest[0]) >= 5


STUCK_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["TPFUSE_STEP_TIMEOUT_S"] = "3"
    from tpfuse.engine.llm import LLM
    from tpfuse.engine.sampling_params import SamplingParams
    if __name__ == "__main__":
        llm = LLM("tiny", device="cpu", tp_size=2, num_kv_blocks=64)
        print(" ".join(str(p.pid) for p in llm.engine.executor.workers), flush=True)
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        while True:
            llm.generate("keep going", params)
    """
)


def test_a_worker_alive_but_stuck_ends_the_run_with_an_error_naming_it(tmp_path):
    import os
    import signal

    proc, [worker] = start_engine_script(tmp_path, STUCK_SCRIPT)
    try:
        time.sleep(0.5)
        os.kill(worker, signal.SIGSTOP)
        stopped = time.monotonic()
        _, stderr = proc.communicate(timeout=30)
        took = time.monotonic() - stopped
    finally:
        proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)
    assert proc.returncode != 0
    assert "tensor-parallel rank 1" in stderr and "stuck" in stderr, stderr[-2000:]
    assert took < 3 + 10
