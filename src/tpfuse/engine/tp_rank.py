"""One tensor-parallel rank: joining the process group and building its ModelRunner (every rank), and
the loop of ranks 1..N-1 that runs each step rank 0 publishes on the StepChannel as rank 0 runs it.

A worker holds no sequence state: a step carries its input ids or the token-table entries to take
them from (its own table, written by its own copy of each step's token choice: step_inputs.py), and a
chained speculative step (kind CHAINED_SPEC_STEP: k' and the rows it continues ahead of the packed
step) is shifted by the worker's own copy of the step before's greedy/simulated verification.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback

import torch

from tpfuse.config import EngineConfig
from tpfuse.engine.spin_errors import SpinErrorWatch

# Step kinds on the channel: how a worker runs the packed step that follows.
# Step kinds on the channel. PROCESSED_STEP: a plain step whose ids rank 0 chooses alone (logits
# processing) and broadcasts.
PLAIN_STEP, SPEC_STEP, CHAINED_SPEC_STEP, PROCESSED_STEP = 0, 1, 2, 3
WATCH_INTERVAL_S = 0.5  # how often a worker checks its parent (and rank 0 its workers)
PROCESS_GROUP_TIMEOUT = datetime.timedelta(seconds=300)


def rank0_decides(group=None):
    """value -> rank 0's value (any picklable object), over the CPU process group; every rank calls
    it in step. Start-up decisions that every rank must share go through it."""
    import torch.distributed as dist

    def agree(value):
        box = [value]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    return agree


def build_rank(rank: int, config: EngineConfig, port: int, devices: list[torch.device], store=None):
    """Joins the process group (through rank 0's TCPStore on port; rank 0 passes the store itself) and
    builds this rank's ModelRunner. Every rank runs this in step."""
    import torch.distributed as dist

    from tpfuse.comm.factory import create_communicator
    from tpfuse.engine.runner import ModelRunner
    from tpfuse.engine.spec_worker import speculative_hook
    from tpfuse.engine.step_limits import max_step_rows
    from tpfuse.model.loader import load_model_config

    device = devices[rank]
    sharing = devices.count(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif rank > 0:  # CPU ranks share the cores; more threads than cores makes every collective wait
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // config.tp_size))
    backend = "nccl" if device.type == "cuda" and len(set(devices)) == len(devices) else "gloo"
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, config.tp_size, False, timeout=PROCESS_GROUP_TIMEOUT)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=config.tp_size, timeout=PROCESS_GROUP_TIMEOUT
    )
    cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else None

    agree_routes = rank0_decides(cpu_group)

    def agree_num_blocks(num_blocks: int) -> int:
        value = torch.tensor([num_blocks], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=cpu_group)
        return int(value.item())

    model_config = load_model_config(config)
    comm = create_communicator(
        group=None,
        device=device,
        mode=config.allreduce,
        islands=config.allreduce_islands,
        max_tokens=max_step_rows(config),  # verify steps: batch x (k + 1) rows, all captured
        hidden_size=model_config.hidden_size,
        dtype=model_config.dtype,
    )
    return ModelRunner(
        config,
        rank=rank,
        comm=comm,
        device=device,
        agree_num_blocks=agree_num_blocks,
        agree_routes=agree_routes,
        ranks_on_device=sharing,
        graph_logits=sharing == 1,
        hook=speculative_hook(config),
    )


def _watch_parent(rank: int, parent_pid: int) -> None:
    while True:
        time.sleep(WATCH_INTERVAL_S)
        if os.getppid() != parent_pid:
            with contextlib.suppress(Exception):  # stderr may be a pipe nobody reads any more
                gone = f"tpfuse worker rank {rank}: the engine process {parent_pid} is gone; exiting"
                print(gone, file=sys.stderr)
            os._exit(1)


def follow_steps(rank: int, config: EngineConfig, runner, channel) -> None:
    """A worker's loop: runs each step rank 0 publishes, as rank 0 runs it, until shutdown. Keeps
    what a chained speculative step needs of the step before: its verify result."""
    from tpfuse.engine.spec_chain import ChainLink
    from tpfuse.engine.spec_forward import execute_spec
    from tpfuse.engine.spec_verify import chain_verifier, worker_chain_result
    from tpfuse.engine.spec_worker import worker_of

    verifier = chain_verifier(config.speculative)
    chains = (
        not config.disable_overlap_schedule
        and config.speculative.enabled
        and worker_of(runner).window_drafter is not None
    )
    last, verified = 0, None
    spin_errors = SpinErrorWatch(runner.comm, rank)
    while True:
        last, kind, packed = channel.receive(rank, last)
        if packed is None:
            return
        if kind in (SPEC_STEP, CHAINED_SPEC_STEP):
            link = None
            if kind == CHAINED_SPEC_STEP:
                k, n = int(packed[0]), int(packed[1])
                if verified is None:
                    raise RuntimeError("a chained step follows a step whose verify result this rank lacks")
                link = ChainLink(verified, k, packed[2 : 2 + n].tolist() if n >= 0 else None)
                packed = packed[2 + max(n, 0) :]
            forward = execute_spec(runner, packed, link)
            verified = worker_chain_result(forward, verifier) if chains else None
        else:
            runner.follow(packed, from_rank0=kind == PROCESSED_STEP)
            verified = None
        channel.mark_done(rank, last)
        spin_errors.poll()


def worker_main(
    rank: int, config: EngineConfig, port: int, devices, channel, parent_pid: int, errors
) -> None:
    """Process target of ranks 1..N-1. `kill -USR1 <pid>` prints every thread's stack (a hang's where)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: rank 0 acts on it
    threading.Thread(target=_watch_parent, args=(rank, parent_pid), daemon=True).start()
    try:
        runner = build_rank(rank, config, port, devices)
        follow_steps(rank, config, runner, channel)
        if devices[rank].type == "cuda":
            torch.cuda.synchronize()
    except BaseException as exc:
        message = f"{type(exc).__name__}: {exc}"
        errors.put((rank, message))
        if not isinstance(exc, ValueError | KeyboardInterrupt):  # a bad input or Ctrl-C: rank 0 says it
            with contextlib.suppress(Exception):
                print(f"tpfuse worker rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr)
        os._exit(1)
    os._exit(0)  # skip interpreter teardown: the process group may still reference dead peers
