"""Tensor parallelism, one process per rank over gloo on CPU: the same greedy tokens as TP=1 for every
architecture (kv heads fewer than ranks, vocabulary not divisible by the TP size), and no orphans or
hangs when a rank dies."""

import textwrap
import time

import pytest

from tests.engine.checkpoints import ARCHITECTURES, build_checkpoint
from tests.engine.tp_processes import kill_worker_and_read_the_engine_error, start_engine_script
from tpfuse.engine.llm import LLM
from tpfuse.engine.sampling_params import SamplingParams

PROMPTS = [[5, 17, 33, 100, 2, 9, 81], [200], list(range(40, 70))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = dict(device="cpu", num_kv_blocks=128, block_size=4, max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def single_rank_tokens(tmp_path_factory):
    """Checkpoint directory and TP=1 greedy tokens per architecture."""
    result = {}
    for kind in ARCHITECTURES:
        directory = str(tmp_path_factory.mktemp(f"tp-{kind}"))
        build_checkpoint(directory, kind)
        llm = LLM(directory, **ENGINE)
        result[kind] = (directory, [o.token_ids for o in llm.generate(PROMPTS, GREEDY)])
    return result


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_tensor_parallel_greedy_tokens_equal_single_rank(single_rank_tokens, kind, tp_size):
    directory, expected = single_rank_tokens[kind]
    llm = LLM(directory, tp_size=tp_size, **ENGINE)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
    finally:
        llm.shutdown()
    assert all(not p.is_alive() for p in llm.engine.executor.workers)


SCRIPT = textwrap.dedent(
    """
    import sys, time
    from tpfuse.engine.llm import LLM
    from tpfuse.engine.sampling_params import SamplingParams
    if __name__ == "__main__":
        llm = LLM("tiny", device="cpu", tp_size=2, num_kv_blocks=64)
        print(" ".join(str(p.pid) for p in llm.engine.executor.workers), flush=True)
        mode = sys.argv[1]
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        while True:
            if mode == "busy":
                llm.generate("keep going", params)
            else:
                time.sleep(0.1)
    """
)


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line for line in f)
    except FileNotFoundError:
        return True


def test_engine_exits_with_a_clear_error_when_a_worker_dies(tmp_path):
    proc, [worker] = start_engine_script(tmp_path, SCRIPT, "busy")
    stderr = kill_worker_and_read_the_engine_error(proc, worker)
    assert "tensor-parallel rank 1" in stderr and "died" in stderr


def test_workers_exit_when_the_engine_process_dies(tmp_path):
    proc, workers = start_engine_script(tmp_path, SCRIPT, "idle")
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 30
    while not all(_gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(_gone(pid) for pid in workers)
