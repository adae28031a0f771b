"""Tensor parallelism, one process per rank: the engine process is rank 0, ranks 1..N-1 are workers.

Rank 0 schedules, packs each step (step_inputs.py), publishes it on a StepChannel with a kind word,
runs its own share of the forward and samples; workers (tp_rank.py) take each step from the channel
and run it as rank 0 does, so the all-reduces inside the model pair up.

Failure handling: every worker watches its parent and exits within a second when the engine process
is gone; rank 0 watches its workers, and when one dies it raises on the next step, or, when it is
stuck inside a collective with the dead rank, prints the reason and exits after GRACE_S. A worker
alive but stuck (no progress on the newest step within the step timeout while rank 0 waits) ends the
process the same way, naming the rank.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch

from tpfuse import knobs
from tpfuse.config import EngineConfig
from tpfuse.engine.spin_errors import SpinErrorWatch
from tpfuse.engine.tp_rank import (
    CHAINED_SPEC_STEP,
    PLAIN_STEP,
    PROCESS_GROUP_TIMEOUT,
    PROCESSED_STEP,
    SPEC_STEP,
    WATCH_INTERVAL_S,
    build_rank,
    worker_main,
)

GRACE_S = 10.0
STEP_TIMEOUT_S = 120.0  # a worker slower than this on one step is taken as stuck


def step_timeout_s() -> float:
    """$TPFUSE_STEP_TIMEOUT_S, else STEP_TIMEOUT_S; raises ValueError for a value that is not a
    positive number."""
    value = knobs.current.step_timeout_s
    if value is None:
        return STEP_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise ValueError(f"{knobs.STEP_TIMEOUT}={value!r} must be a positive number of seconds; unset it")
    return seconds


def check_device_layout(indices: list[int]) -> None:
    """Raises ValueError unless every rank has its own GPU or all ranks share one: with some ranks
    sharing and others not, the group's backend and peer-memory choices differ by rank."""
    if 1 < len(set(indices)) < len(indices):
        n = len(indices)
        raise ValueError(
            f"--devices {','.join(map(str, indices))}: some ranks share a GPU and others do not; "
            "tensor parallelism supports one rank per GPU or every rank on one GPU. Use distinct GPUs "
            f"(e.g. --devices {','.join(map(str, range(n)))}) or one GPU for all "
            f"(--devices {','.join(['0'] * n)})"
        )


def rank_devices(config: EngineConfig) -> list[torch.device]:
    """The device of every rank. Raises ValueError when --devices names a missing GPU or there are
    fewer GPUs than ranks without --devices."""
    if config.resolved_device() == "cpu":
        return [torch.device("cpu")] * config.tp_size
    count = torch.cuda.device_count()
    indices = config.devices if config.devices is not None else list(range(config.tp_size))
    if config.devices is None and config.tp_size > count:
        raise ValueError(
            f"--tp-size {config.tp_size} needs {config.tp_size} GPUs but {count} are visible; "
            f"let ranks share GPUs with --devices (e.g. --devices {','.join(['0'] * config.tp_size)})"
        )
    for index in indices:
        if not 0 <= index < count:
            raise ValueError(f"--devices names GPU {index} but only GPUs 0..{count - 1} are visible")
    check_device_layout(indices)
    return [torch.device("cuda", i) for i in indices]


def channel_capacity(config: EngineConfig, max_model_len: int) -> int:
    """Upper bound of a packed step's length (int64 values), with room for min_tokens bans."""
    tokens, seqs = config.max_num_batched_tokens, max(config.max_running_requests, config.cuda_graph_max_bs)
    max_blocks = -(-max_model_len // config.block_size)
    plain = 64 + 3 * tokens + seqs * (max_blocks + 2) + 1 + 7 * seqs + (1 << 20)
    if not config.speculative.enabled:
        return plain
    # Verify rows (k + 1 tokens each, or a tree's nodes; padding included), drafter catch-up of the
    # last step's tokens, and a tree step's KV moves (src, dst pairs of the accepted path).
    from tpfuse.spec.tree import num_lookahead_tokens

    k = num_lookahead_tokens(config.speculative)
    extend = 4 * (tokens + seqs * (k + 1))
    kv_moves = 2 * seqs * (k + 1)
    return plain + 3 * seqs * (k + 1) * 2 + seqs * (max_blocks + 2) + extend + kv_moves + 16 * seqs


class TensorParallelExecutor:
    """Rank 0 of a tensor-parallel group, plus the worker processes of ranks 1..N-1: the Executor
    (executor.py) for TP > 1. launch() publishes the step to the workers, then enqueues rank 0's
    share; each rank fills input ids only the device knows from its own token table. Raises
    ValueError for bad device settings and RuntimeError naming the rank when a worker fails; a
    worker alive but stuck longer than the step timeout
    ($TPFUSE_STEP_TIMEOUT_S) stops the process with a message naming it.
    """

    def __init__(self, config: EngineConfig):
        import torch.distributed as dist
        import torch.multiprocessing as mp

        from tpfuse.engine.step_channel import StepChannel
        from tpfuse.engine.step_limits import resolve_max_model_len
        from tpfuse.model.layers import divide
        from tpfuse.model.loader import load_model_config

        if dist.is_initialized():
            raise RuntimeError(
                "this process already holds a torch.distributed process group; shut down the other "
                "tensor-parallel engine before starting one"
            )
        devices = rank_devices(config)
        model_config = load_model_config(config)
        # before any worker starts, the check every layer would make (instead of N processes failing it)
        divide(model_config.num_heads, config.tp_size, "num_attention_heads")
        max_len = resolve_max_model_len(config, model_config.max_position_embeddings)
        spin_s = 0.5 if devices[0].type == "cuda" else 0.0
        self.channel = StepChannel(config.tp_size, channel_capacity(config, max_len), spin_s)
        ctx = mp.get_context("spawn")
        self._errors = ctx.Queue()
        # Rank 0 binds the rendezvous port itself (port 0: the OS picks a free one), so no other
        # process can take it between choosing and binding.
        self._store = dist.TCPStore(
            "127.0.0.1", 0, config.tp_size, True, timeout=PROCESS_GROUP_TIMEOUT, wait_for_workers=False
        )
        port = self._store.port
        self.workers = [
            ctx.Process(
                target=worker_main,
                args=(rank, config, port, devices, self.channel, os.getpid(), self._errors),
                daemon=True,
                name=f"tpfuse-rank{rank}",
            )
            for rank in range(1, config.tp_size)
        ]
        for process in self.workers:
            process.start()
        self.failure: str | None = None
        self._failed_at = 0.0
        self.step_timeout_s = step_timeout_s()
        self._sent_at = time.monotonic()
        self._busy = True
        self._closing = False
        threading.Thread(target=self._watch_workers, daemon=True).start()
        try:
            self.runner = build_rank(0, config, port, devices, store=self._store)
        except BaseException as exc:
            self._busy = False
            time.sleep(2 * WATCH_INTERVAL_S if self.failure is None else 0)
            failure = self.failure
            self.shutdown()
            if failure is not None and not isinstance(exc, KeyboardInterrupt):  # Ctrl-C stays Ctrl-C
                raise RuntimeError(failure) from exc
            raise
        finally:
            self._busy = False
        self.spin_errors = SpinErrorWatch(self.runner.comm, 0)
        self.model_config = self.runner.model_config
        self.vocab_size = self.runner.vocab_size
        self.max_model_len = self.runner.max_model_len
        self.num_kv_blocks = self.runner.num_kv_blocks

    def pack(self, batch, engine_seed: int) -> torch.Tensor:
        return self.runner.pack(batch, engine_seed)

    def launch(self, batch, packed: torch.Tensor):
        kind = PROCESSED_STEP if self.runner.chooses_alone(batch) else PLAIN_STEP
        return self._in_lock_step(lambda: self.runner.launch(batch, packed), packed, kind)

    def complete(self, pending) -> None:
        self._in_lock_step(lambda: self.runner.complete(pending))

    def wait(self, pending) -> list[int | None]:
        ids = self._in_lock_step(lambda: self.runner.wait(pending))
        self.spin_errors.poll()
        return ids

    def execute_spec(self, packed: torch.Tensor, link=None):
        """Sends a speculative packed step to the workers and runs rank 0's share (SpecForward). With
        link (a chained template) the workers get its k and rows; each shifts by its own result."""
        from tpfuse.engine.spec_forward import execute_spec

        run = lambda: execute_spec(self.runner, packed, link)  # noqa: E731
        if link is None:
            return self._in_lock_step(run, packed, SPEC_STEP)
        rows = link.rows or []
        prefix = [link.num_draft_tokens, len(rows) if link.rows is not None else -1, *rows]
        return self._in_lock_step(run, packed, CHAINED_SPEC_STEP, prefix)

    def _in_lock_step(self, run_rank0, packed: torch.Tensor | None = None, kind: int = PLAIN_STEP, prefix=()):
        """Publishes prefix + packed (if any) to the workers, then run_rank0(); names a dead rank on
        failure."""
        if self.failure is not None:
            raise RuntimeError(self.failure)
        self._busy = True
        try:
            if packed is not None:
                self.channel.send(packed, kind, is_alive=lambda: self.failure is None, prefix=prefix)
                self._sent_at = time.monotonic()
            return run_rank0()
        except Exception as exc:
            # A collective with a dead rank fails fast; give the watchdog a moment to name the rank.
            deadline = time.monotonic() + 3 * WATCH_INTERVAL_S
            while self.failure is None and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.failure is not None:
                raise RuntimeError(self.failure) from exc
            raise
        finally:
            self._busy = False

    def _watch_workers(self) -> None:
        while not self._closing:
            time.sleep(WATCH_INTERVAL_S)
            if self.failure is None:
                for rank, process in enumerate(self.workers, start=1):
                    if process.exitcode is not None and not self._closing:
                        self.failure = (
                            f"tensor-parallel rank {rank} (pid {process.pid}) died: {self._reason(process)}"
                        )
                        self._failed_at = time.monotonic()
                        break
                if self.failure is None:
                    self._check_progress()
            elif self._busy and time.monotonic() - self._failed_at > GRACE_S:
                print(f"tpfuse: {self.failure}; rank 0 is stuck waiting for it, exiting", file=sys.stderr)
                for process in self.workers:
                    if process.is_alive():
                        process.kill()
                os._exit(1)

    def _check_progress(self) -> None:
        """A worker that has not run the newest step within the step timeout while rank 0 waits on
        the group is stuck (alive, but not answering): rank 0 cannot leave the collective it is in,
        so the process stops with a message that names the rank."""
        if not self._busy or time.monotonic() - self._sent_at < self.step_timeout_s:
            return
        lagging = self.channel.lagging()
        if not lagging or self._closing:
            return
        rank = lagging[0]
        message = (
            f"tensor-parallel rank {rank} (pid {self.workers[rank - 1].pid}) has not run step "
            f"{self.channel.sent} within {self.step_timeout_s:g} s: it is alive but stuck (stopped, or "
            f"spinning in a collective); rank 0 is waiting for it, exiting (raise {knobs.STEP_TIMEOUT} "
            "if steps are legitimately this slow)"
        )
        print(f"tpfuse: {message}", file=sys.stderr, flush=True)
        for process in self.workers:
            if process.is_alive():
                process.kill()
        os._exit(1)

    def _reason(self, process) -> str:
        try:
            while True:
                _, message = self._errors.get(timeout=1.0)
                return message
        except Exception:
            return f"exit code {process.exitcode}"

    def shutdown(self) -> None:
        """Stops the workers (killing any that do not exit within 10 s), leaves the process group
        and releases rank 0's device memory."""
        if self._closing:
            return
        self._closing = True
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.release()
        if all(p.is_alive() for p in self.workers) and self.failure is None:
            self.channel.send_shutdown()
        for process in self.workers:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
