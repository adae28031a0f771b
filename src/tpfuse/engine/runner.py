"""ModelRunner: one rank's model, KV cache and forward pass; rank 0 also samples.

Every rank runs `execute(packed)` on the same packed step (step_inputs.py), so tensor-parallel ranks
stay in lock step without any per-sequence state of their own. Rank 0 builds the packed step from a
scheduler Batch (`pack`) and samples from the logits (`sample`). On CUDA the packed step reaches the
device in one copy from a pinned buffer, and decode steps replay CUDA graphs (cuda_graphs.py): the
copy lands in the graphs' static packed buffer, which the graph reads itself, and for an all-greedy
step without banned tokens the graph also takes the argmax, so the host issues one H2D copy, one
replay and one D2H copy of the token ids (into pinned memory, then an event wait). Every rank keeps
the token table (step_inputs.py) and runs the same writes and gathers, so the tables agree.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
import torch.distributed

from tpfuse.comm.communicator import Communicator, SingleRankCommunicator
from tpfuse.config import EngineConfig
from tpfuse.engine import kv_cache
from tpfuse.engine.batch import Batch
from tpfuse.engine.cuda_graphs import DecodeGraphs
from tpfuse.engine.launch_choice import choose_pdl
from tpfuse.engine.logits_processing import BatchProcessing
from tpfuse.engine.piecewise_graphs import PiecewiseGraphs, piecewise_sizes
from tpfuse.engine.runner_hook import HookFactory, RunnerHook
from tpfuse.engine.step_inputs import (
    StepHeader,
    StepInputs,
    pack_step,
    read_header,
    unpack_step,
)
from tpfuse.engine.step_limits import max_step_rows, resolve_max_model_len
from tpfuse.engine.step_upload import StepUpload
from tpfuse.engine.token_readback import PendingStep, TokenReadback
from tpfuse.kernels import pdl, sample, warm_up_sampling
from tpfuse.model import linear_choice, moe_choice
from tpfuse.model.layers import ParallelContext, projections
from tpfuse.model.loader import load_model


@dataclass
class ProcessedStep:
    """A launched step with sampled rows that need rank 0's logits processing: the forward is
    enqueued, the token choice waits for ModelRunner.complete, because the processing reads the
    tokens of the step before (grammar state, penalties), which the engine appends only once it has
    read that step. pending: the ids' copy to the host, once complete has run."""

    step: StepInputs
    logits: torch.Tensor  # [N, V] float32 of the sampled rows
    processing: BatchProcessing
    rows: list[int]  # the batch rows that sample
    num_rows: int
    pending: PendingStep | None = None


class ModelRunner:
    """Loads this rank's shard of the model and owns its KV cache.

    config: the engine settings; rank/comm: this process's tensor-parallel rank and communicator
    (SingleRankCommunicator for TP=1); device: where to run (default config.resolved_device());
    agree_num_blocks: for TP, a function turning this rank's KV capacity into the group's (the minimum);
    agree_routes: for TP, a function giving every rank rank 0's projection routes (linear_choice);
    ranks_on_device: ranks sharing this GPU (they split its memory); graph_logits: capture
    compute_logits in the decode graphs (off when its all-gather cannot be captured); hook: builds
    this runner's extension (runner_hook.py) from the loaded model, None for a plain runner.
    """

    def __init__(
        self,
        config: EngineConfig,
        rank: int = 0,
        comm: Communicator | None = None,
        device: torch.device | str | None = None,
        agree_num_blocks=None,
        agree_routes=None,
        ranks_on_device: int = 1,
        graph_logits: bool = True,
        hook: HookFactory | None = None,
    ):
        self.config = config
        self.rank = rank
        self.device = torch.device(device or config.resolved_device())
        if self.device.type == "cuda":
            if self.device.index is None:  # torch 2.11 refuses set_device on a bare "cuda"
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        parallel = ParallelContext(rank, config.tp_size, comm or SingleRankCommunicator())
        self.comm = parallel.comm
        self.model, self.model_config = load_model(config, parallel, self.device)
        self.hook: RunnerHook | None = None
        if hook is not None:
            self.hook = hook(self.model, self.model_config, parallel, self.device)
        if self.device.type == "cuda":  # projection routes, timed before any graph is captured
            # with plain launches: PDL slows the large GEMVs (engine/launch_choice.py may turn it on)
            pdl.choose(self.device, False)
            models = [self.model] + (self.hook.models() if self.hook is not None else [])
            linear_choice.choose(
                (p for m in models for p in projections(m)),
                max_rows=max_step_rows(config),
                agree=agree_routes,
            )
            linear_choice.choose_quantized(
                models,
                max_rows=max_step_rows(config),
                agree=agree_routes,
                prefill_rows=min(config.max_prefill_tokens_per_step, config.max_num_batched_tokens),
            )
            moe_choice.choose(
                self.model, max_step_rows(config), config.max_num_batched_tokens, config.tp_size, agree_routes
            )
        self.block_size = config.block_size
        self.max_model_len = resolve_max_model_len(config, self.model_config.max_position_embeddings)
        # A step may reach `margin` positions past the newest token (the hook's extra query rows).
        margin = self.hook.position_margin if self.hook is not None else 0
        if margin:
            limit = min(self.model_config.max_position_embeddings, self.hook.max_positions) - margin
            self.max_model_len = min(self.max_model_len, limit)
        self.kv_layout = kv_cache.cache_layout(self.model, self.model_config, config.tp_size)
        block_bytes = self.kv_layout.bytes_per_block(self.block_size)
        if self.hook is not None:
            block_bytes += self.hook.bytes_per_block(config.tp_size, self.block_size)
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        elif self.device.type == "cuda":
            kv_cache.warm_up_at_peak_load(self.model, self.kv_layout, config, self.max_model_len, self.device)
            num_blocks = kv_cache.cuda_kv_blocks(
                self.device, block_bytes, config.mem_fraction_static, ranks_on_device
            )
        else:
            longest = -(-(self.max_model_len + margin) // self.block_size)
            num_blocks = kv_cache.cpu_kv_blocks(block_bytes, longest)
        if agree_num_blocks is not None:
            num_blocks = agree_num_blocks(num_blocks)
        self.num_kv_blocks = num_blocks
        self.max_model_len = min(self.max_model_len, num_blocks * self.block_size - margin)
        self.kv_caches = self.kv_layout.allocate(num_blocks, self.block_size, self.device)
        if self.hook is not None:
            self.hook.allocate(
                num_blocks, self.block_size, config.tp_size, config.max_running_requests,
                self.max_model_len + margin,
            )  # fmt: skip
        tree = self.hook is not None and self.hook.tree_attention
        num_heads = self.model.layers[0].self_attn.num_heads
        self.kv_layout.warm_up(self.kv_caches[0], num_heads, config.max_num_batched_tokens, tree)
        warm_up_sampling(self.model_config.vocab_size, self.device)
        self.logits_processing = None  # rank 0: per-request processing (engine/logits_processing.py)
        # The token table (step_inputs.py): entry s holds the newest token of the request in slot s;
        # the last entry takes the tokens of rows without a slot.
        self.token_table = torch.zeros(config.max_running_requests + 1, dtype=torch.int64, device=self.device)
        self.table_sink = config.max_running_requests
        self.upload = StepUpload(self.device)
        self.readback = TokenReadback(self.device)
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            max_bs = min(config.cuda_graph_max_bs, config.max_running_requests)
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                max_bs,
                -(-(self.max_model_len + margin) // self.block_size),
                self.max_model_len,
                self.model_config.vocab_size,
                graph_logits,
                hook=self.hook,
                token_table=self.token_table,
            )
        # Launches with or without PDL, measured on the decode graph before the graphs are captured.
        self.pdl_choice = (
            choose_pdl(self.graphs, self.device, config.tp_size) if self.device.type == "cuda" else None
        )
        if self.graphs is not None:
            self.graphs.capture()
        # Other steps of up to piecewise_graph_max_tokens tokens: graphs split at attention, per bucket
        # where start-up timing finds them faster than the eager forward (piecewise_graphs.py).
        self.piecewise: PiecewiseGraphs | None = None
        sizes = piecewise_sizes(min(config.piecewise_graph_max_tokens, config.max_num_batched_tokens))
        if self.device.type == "cuda" and not config.enforce_eager and sizes:
            self.piecewise = PiecewiseGraphs(self.model, self.kv_caches, sizes)
            self.piecewise.capture()
            self.piecewise.choose(agree_routes)

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's runner (this one), as TensorParallelExecutor.runner is for the group."""
        return self

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def pack(self, batch: Batch, engine_seed: int) -> torch.Tensor:
        """Rank 0: the CPU packed step of batch, padded to its CUDA-graph bucket when it is a decode."""
        pad_to = None
        if self.graphs is not None and batch.is_decode:
            pad_to = self.graphs.bucket(len(batch.seqs))
        return pack_step(batch, self.block_size, engine_seed, pad_to, self.table_sink)

    def _uses_decode_graph(self, header: StepHeader) -> bool:
        graphs = self.graphs
        return (
            graphs is not None
            and bool(header.is_decode)
            and graphs.has(header.num_seqs)
            and header.num_tokens == header.num_seqs
            and header.max_blocks <= graphs.max_blocks_per_seq
        )

    @torch.inference_mode()
    def _forward(
        self, packed: torch.Tensor, need_logits: bool = False
    ) -> tuple[StepInputs, torch.Tensor | None, bool]:
        """(step, logits of the sampled rows or None, whether the graph chose every row's token:
        an all-greedy decode graph step without banned tokens; its ids are in graphs.token_ids).
        The input ids only the device knows are taken from the token table first. need_logits:
        return the logits even when the graph chose the tokens (for logits processing)."""
        header = read_header(packed)
        if self._uses_decode_graph(header):
            graphs = self.graphs
            # A step without token-table entries (not packed by pack()) has another layout.
            device_packed = self.upload.into(packed, graphs.packed) if header.uses_table else None
            if device_packed is None:  # too many banned pairs for the static buffer, or no table
                step = unpack_step(header, self.upload.to_device(packed), packed)
                out = graphs.run(step)  # the graph takes the ids from the token table itself
            else:
                step = unpack_step(header, device_packed, packed)
                out = graphs.replay_packed(header.num_seqs)
            if not header.num_samples:
                return step, None, False
            if graphs.graph_logits and header.all_greedy and not header.num_banned and not need_logits:
                return step, None, True
            rows = out.index_select(0, step.sample_indices)
            return step, rows if graphs.graph_logits else self.model.compute_logits(rows), False
        step = unpack_step(header, self.upload.to_device(packed), packed)
        self._gather_input_ids(step)
        hidden, aux = self.forward_tokens(step, step.attention_metadata())
        if self.hook is not None:
            self.hook.after_forward(aux, step.slot_mapping)
        if not header.num_samples:
            return step, None, False
        return step, self.model.compute_logits(hidden.index_select(0, step.sample_indices)), False

    def forward_tokens(self, step: StepInputs, attn) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's forward of a step the decode graphs do not take, described by attn: the
        piecewise graphs of its token bucket where start-up timing kept one (never with a tree mask),
        else eagerly. Returns (hidden [T, H], aux or None), valid until the next forward."""
        piecewise = self.piecewise
        if piecewise is not None and attn.tree_mask is None and piecewise.bucket(step.header.num_tokens):
            return piecewise.run(step.input_ids, step.positions, step.slot_mapping, attn)
        return self.model(step.input_ids, step.positions, attn, self.kv_caches)

    @torch.inference_mode()
    def _choose_tokens(self, step: StepInputs, logits: torch.Tensor) -> torch.Tensor:
        """Device ids [N] of the sampled rows: the min_tokens bans masked, then argmax or the sampler."""
        if step.header.num_banned:
            logits[step.banned_rows, step.banned_ids] = float("-inf")
        if step.header.all_greedy:
            return logits.argmax(dim=-1)
        return sample(logits, step.temperatures, step.top_ks, step.top_ps, step.seeds, step.filter_plan)

    def sample(self, step: StepInputs, logits: torch.Tensor) -> list[int]:
        """Rank 0: the next token of each sampled row, as Python ints."""
        return self.readback.to_list(self._choose_tokens(step, logits))

    def _gather_input_ids(self, step: StepInputs) -> None:
        """Eager steps: the input ids only the device knows, from the token table."""
        if step.header.num_gathered:
            slots = step.id_slots
            step.input_ids.copy_(
                torch.where(slots >= 0, self.token_table[slots.clamp(min=0)], step.input_ids)
            )

    def _write_table(self, step: StepInputs, tokens: torch.Tensor) -> None:
        """tokens [N] of the sampled rows, in their order, into the token table."""
        if step.header.uses_table:
            self.token_table[step.write_slots[step.sample_indices]] = tokens

    def _forward_and_choose(self, packed: torch.Tensor) -> tuple[StepInputs, torch.Tensor | None, bool]:
        """(step, device ids of the sampled rows or None, whether they are by batch row: the graph's
        argmax buffer, padding rows last; else in the order of the sampling rows), the ids written to
        the token table."""
        step, logits, chosen_in_graph = self._forward(packed)
        if chosen_in_graph:  # the graph wrote the token table too
            return step, self.graphs.token_ids[: step.header.num_seqs], True
        if logits is None:
            return step, None, False
        tokens = self._choose_tokens(step, logits)
        self._write_table(step, tokens)
        return step, tokens, False

    def chooses_alone(self, batch: Batch) -> bool:
        """Rank 0: whether rank 0 alone chooses batch's tokens (a sampled row needs its logits
        processing); the other ranks then take its ids (`follow(..., from_rank0=True)`)."""
        return self.logits_processing is not None and self.logits_processing.needed(batch)

    def launch(self, batch: Batch, packed: torch.Tensor) -> PendingStep | ProcessedStep:
        """Rank 0: enqueues the forward and sampling of packed (a step of batch) and the copy of its
        ids to the host; returns without waiting (see wait). A batch with rows that need logits
        processing gets its forward only: `complete` chooses its tokens."""
        rows = [i for i in range(len(batch.seqs)) if batch.samples(i)]
        processing = self.logits_processing.for_batch(batch) if self.logits_processing is not None else None
        if processing is not None:
            step, logits, _ = self._forward(packed, need_logits=True)
            return ProcessedStep(step, logits, processing, rows, len(batch.seqs))
        _, tokens, by_row = self._forward_and_choose(packed)
        return self.readback.start(tokens, rows, by_row, len(batch.seqs))

    def complete(self, handle: PendingStep | ProcessedStep) -> None:
        """Rank 0: enqueues the token choice of a ProcessedStep (its logits processing, the min_tokens
        bans except on grammar rows, the sampler, the token-table writes, the ids' copy to the host;
        at TP > 1 the ids' broadcast to the other ranks). Call it once the tokens of the step before
        are appended to the sequences and before the next step is launched. A no-op for other
        steps and for a step already completed."""
        if not isinstance(handle, ProcessedStep) or handle.pending is not None:
            return
        processing = handle.processing
        with torch.inference_mode():  # not the readback's pinned buffers, which outlive this step
            tokens = self._choose_tokens(handle.step, processing.apply(handle.logits))
            processing.record(tokens)
            if self.config.tp_size > 1:
                torch.distributed.broadcast(tokens, src=0)
        self._write_table(handle.step, tokens)
        handle.pending = self.readback.start(tokens, handle.rows, False, handle.num_rows)

    def follow(self, packed: torch.Tensor, from_rank0: bool = False) -> None:
        """Ranks 1..N-1: runs a plain packed step exactly as rank 0 runs it (the same forward, token
        choice and token-table writes, so the ranks' ids and tables agree bit for bit). from_rank0:
        rank 0 chose the ids alone (its logits processing), and they arrive by broadcast."""
        if not from_rank0:
            self._forward_and_choose(packed)
            return
        step, _, _ = self._forward(packed, need_logits=True)
        tokens = torch.empty(step.header.num_samples, dtype=torch.int64, device=self.device)
        torch.distributed.broadcast(tokens, src=0)
        self._write_table(step, tokens)

    def wait(self, handle: PendingStep | ProcessedStep) -> list[int | None]:
        """Rank 0: the ids of a launched step, one entry per batch row (None: the row did not sample)."""
        if not isinstance(handle, ProcessedStep):
            return self.readback.wait(handle)
        self.complete(handle)
        ids = self.readback.wait(handle.pending)
        handle.processing.settle()
        return ids

    def shutdown(self) -> None:
        self.release()

    def release(self) -> None:
        """Drops what this runner holds on its device (CUDA graphs and their pool, the KV cache, the
        hook, the weights) and returns the memory to the device. The runner is unusable afterwards."""
        self.graphs = None
        self.piecewise = None
        self.kv_caches = []
        self.hook = None
        self.model = None
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
