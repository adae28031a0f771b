"""Decode steps captured as CUDA graphs, one per batch-size bucket.

Each graph runs the model's forward and compute_logits on static input buffers; a step copies its
(padded) inputs into them and replays the graph of its bucket. All graphs share one memory pool and
one logits buffer. Capture happens after the KV cache is allocated and after the communicator has
made its per-size choices, so the fused all-reduce is captured inside.
"""

from __future__ import annotations

import torch

from tpfuse.engine.step_inputs import StepInputs
from tpfuse.model.attention import AttentionMetadata


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, ... up to max_batch_size (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size]
    sizes += range(16, max_batch_size, 8)
    return sorted({*sizes, max_batch_size})


class DecodeGraphs:
    """Captured decode steps for batch sizes up to max_batch_size.

    kv_caches: the model's per-layer caches; max_blocks_per_seq: the block-table width every graph is
    captured with (a step's narrower table fills its left part; columns past a sequence's length are
    never read).
    """

    def __init__(
        self,
        model,
        kv_caches,
        max_batch_size: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        vocab_size: int,
        graph_logits: bool = True,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_batch_size)
        self.max_model_len = max_model_len
        device = kv_caches[0][0].device
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graph_logits = graph_logits
        self.logits = torch.empty(n, vocab_size, dtype=torch.float32, device=device) if graph_logits else None
        self.hidden: torch.Tensor | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def bucket(self, batch_size: int) -> int | None:
        """The smallest captured size holding batch_size, None when it is too large for graphs."""
        for size in self.sizes:
            if size >= batch_size:
                return size
        return None

    def _forward(self, batch_size: int) -> torch.Tensor:
        """Logits [batch_size, vocab] (hidden [batch_size, H] when logits are computed after replay)."""
        attn = AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            block_tables=self.block_tables[:batch_size],
            seq_lens=self.seq_lens[:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            is_decode=True,
        )
        hidden, _ = self.model(self.input_ids[:batch_size], self.positions[:batch_size], attn, self.kv_caches)
        return self.model.compute_logits(hidden) if self.graph_logits else hidden

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every bucket, largest first (so the shared pool is sized by the first capture)."""
        pool = None
        for size in reversed(self.sizes):
            out = self._forward(size)  # warm-up: autotuning and lazy allocations happen outside capture
            if not self.graph_logits and self.hidden is None:
                self.hidden = torch.empty(self.sizes[-1], out.shape[-1], dtype=out.dtype, device=out.device)
            target = self.logits if self.graph_logits else self.hidden

            def body(size=size, target=target):
                target[:size].copy_(self._forward(size))

            self.graphs[size], pool = self._capture_graph(body, pool)
        self._synchronize()

    def _capture_graph(self, body, pool):
        """Records body() as a CUDA graph in the shared pool; returns (graph, pool)."""
        self._synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            body()
        return graph, graph.pool()

    def _synchronize(self) -> None:
        if self.input_ids.is_cuda:
            torch.cuda.synchronize(self.input_ids.device)

    def run(self, step: StepInputs) -> torch.Tensor:
        """Replays the graph of step's (already padded) batch size; returns logits [B, vocab] (hidden
        [B, H] without graph_logits), a view of a shared buffer valid until the next replay."""
        size = step.header.num_seqs
        width = step.header.max_blocks
        self.input_ids[:size].copy_(step.input_ids)
        self.positions[:size].copy_(step.positions)
        self.slot_mapping[:size].copy_(step.slot_mapping)
        self.seq_lens[:size].copy_(step.seq_lens)
        self.block_tables[:size, :width].copy_(step.block_tables)
        self.graphs[size].replay()
        return self.logits[:size] if self.graph_logits else self.hidden[:size]
