"""Start-up errors that used to cost minutes or leave processes behind: a --tp-size the model cannot
split is refused before any worker starts, and a worker whose parent is gone exits even when its
stderr is a pipe nobody reads any more."""

import time

import pytest

from tpfuse.config import EngineConfig
from tpfuse.engine import tp_rank
from tpfuse.engine.worker import TensorParallelExecutor


def test_a_tp_size_that_does_not_divide_the_heads_fails_before_any_worker_starts(monkeypatch):
    spawned = []
    monkeypatch.setattr("multiprocessing.context.SpawnProcess.start", lambda self: spawned.append(self))
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not divisible by --tp-size 3"):
        TensorParallelExecutor(EngineConfig(model="tiny", device="cpu", tp_size=3))
    assert not spawned and time.monotonic() - start < 10


class _Exited(Exception):
    pass


class _BrokenPipe:
    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_worker_exits_when_its_parent_is_gone_even_if_stderr_is_a_broken_pipe(monkeypatch):
    def exit_(code):
        raise _Exited(code)

    monkeypatch.setattr(tp_rank.time, "sleep", lambda s: None)
    monkeypatch.setattr(tp_rank.os, "getppid", lambda: 1)
    monkeypatch.setattr(tp_rank.os, "_exit", exit_)
    monkeypatch.setattr(tp_rank.sys, "stderr", _BrokenPipe())
    with pytest.raises(_Exited) as exited:
        tp_rank._watch_parent(rank=1, parent_pid=4321)
    assert exited.value.args == (1,)


def test_device_cuda_without_a_visible_gpu_is_a_message_naming_the_fix(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"--device cuda, but .*; run with --device cpu"):
        EngineConfig(model="tiny", device="cuda").resolved_device()
    assert EngineConfig(model="tiny", device="auto").resolved_device() == "cpu"


def test_the_offline_api_refuses_bytes_odd_params_and_use_after_shutdown():
    from tpfuse.engine.llm import LLM
    from tpfuse.engine.sampling_params import SamplingParams

    llm = LLM("tiny", device="cpu")
    with pytest.raises(TypeError, match="got bytes; decode it first"):
        llm.generate(b"hi")
    with pytest.raises(TypeError, match=r"token ids must be integers, got 1\.5"):
        llm.generate([[1.5, 2]])
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        llm.generate(["hi"], [{"max_tokens": 2}])
    assert llm.generate("hi", SamplingParams(max_tokens=2, temperature=0))[0].token_ids
    llm.shutdown()
    assert llm.engine.stats().num_kv_blocks > 0  # readable after shutdown
    with pytest.raises(RuntimeError, match="shut down; make a new one"):
        llm.generate("hi")


def test_ctrl_c_while_rank_0_loads_stays_a_keyboard_interrupt(monkeypatch):
    """The workers, which Ctrl-C also reaches, may look dead by then; rank 0 still reports an interrupt
    (exit 130, "interrupted"), not a RuntimeError naming a dead rank."""
    from tpfuse.engine import worker

    def interrupted(*args, **kwargs):
        time.sleep(3 * tp_rank.WATCH_INTERVAL_S)  # the worker watch finds rank 1 dead meanwhile
        raise KeyboardInterrupt

    monkeypatch.setattr("multiprocessing.context.SpawnProcess.start", lambda self: None)
    monkeypatch.setattr("multiprocessing.process.BaseProcess.exitcode", property(lambda self: -2))  # SIGINT
    monkeypatch.setattr(worker, "build_rank", interrupted)
    monkeypatch.setattr(worker.TensorParallelExecutor, "shutdown", lambda self: None)  # nothing started
    with pytest.raises(KeyboardInterrupt):
        TensorParallelExecutor(EngineConfig(model="tiny", device="cpu", tp_size=2))


IGNORED_FLAGS = [  # flags whose value the other flags would make a silent no-op
    (
        ["--speculative-num-steps", "5"],
        r"--speculative-num-steps 5: no effect without --speculative-algorithm; "
        r"add --speculative-algorithm \(eagle3, ngram, draft, mtp\) or drop it$",
    ),  # fmt: skip
    (
        ["--speculative-simulate-acceptance-length", "2"],
        r"--speculative-simulate-acceptance-length 2\.0: no effect",
    ),
    (["--speculative-draft-model-path", "tiny"], r"--speculative-draft-model-path tiny: no effect without"),
    (["--no-speculative-adaptive"], r"--no-speculative-adaptive: no effect without --speculative-algorithm"),
    (
        ["--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6"],
        r"--speculative-eagle-topk 2, --speculative-num-draft-tokens 6: no effect .* or drop them$",
    ),
    (
        ["--speculative-algorithm", "ngram", "--speculative-draft-model-path", "tiny"],
        r"--speculative-draft-model-path tiny: --speculative-algorithm ngram reads no draft model .*drop it",
    ),
    (
        ["--tp-size", "2", "--devices", "0,0"],
        r"--devices 0,0 places ranks on CUDA GPUs, but --device cpu runs them all on the CPU; drop --devices",
    ),
]


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("flags, message", IGNORED_FLAGS)
def test_a_flag_the_others_would_ignore_exits_2_naming_both_flags(
    command, flags, message, monkeypatch, capsys
):
    import re

    from tpfuse import cli

    monkeypatch.setattr("tpfuse.engine.cli._generate", lambda *args: 0)  # were the flags accepted
    monkeypatch.setattr("tpfuse.server.cli.run_server", lambda *args: 0)
    prompt = ["--prompt", "hi"] if command == "generate" else []
    assert cli.main([command, "--model", "tiny", "--device", "cpu", *flags, *prompt]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"tpfuse {command}: ") and re.search(message, line), line


def test_speculative_settings_with_an_algorithm_or_at_their_defaults_are_accepted():
    from tpfuse.config import SpeculativeConfig

    assert SpeculativeConfig().num_draft_tokens == 4
    assert SpeculativeConfig(num_draft_tokens=4).num_draft_tokens == 4  # what num_steps 3 derives anyway
    assert SpeculativeConfig(algorithm="ngram", num_steps=5, adaptive=False).num_draft_tokens == 6


def test_devices_where_auto_finds_no_gpu_is_a_message_naming_the_fix(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"--devices 1 places ranks on CUDA GPUs, but none is visible"):
        EngineConfig(model="tiny", devices=[1]).resolved_device()


def test_devices_at_tp_size_1_picks_the_gpu(monkeypatch):
    """--tp-size 1 --devices 1 ran on GPU 0 (the flag was read only by tensor-parallel ranks)."""
    import torch

    from tpfuse.engine import engine, runner

    built = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(
        runner, "ModelRunner", lambda config, hook, device: built.setdefault("device", device)
    )
    engine._make_executor(EngineConfig(model="tiny", device="cuda", devices=[1]))
    assert built["device"] == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"--devices names GPU 2 but only GPUs 0\.\.1 are visible"):
        engine._make_executor(EngineConfig(model="tiny", device="cuda", devices=[2]))


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_num_kv_blocks_below_1_is_refused_naming_the_flag(command, monkeypatch, capsys):
    from tpfuse import cli

    monkeypatch.setattr("tpfuse.engine.cli._generate", lambda *args: 0)
    monkeypatch.setattr("tpfuse.server.cli.run_server", lambda *args: 0)
    prompt = ["--prompt", "hi"] if command == "generate" else []
    assert cli.main([command, "--model", "tiny", "--device", "cpu", "--num-kv-blocks", "0", *prompt]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "--num-kv-blocks must be >= 1 (or left out: the KV capacity is measured), got 0" in line, line
