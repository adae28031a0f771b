"""Decode steps captured as CUDA graphs, one per batch-size bucket (and per number of draft tokens).

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
    """Captured decode steps for batch sizes up to max_batch_size, per number of draft tokens k.

    k = 0 is a plain decode (one query token per sequence, decode attention); with speculation every
    k in 1..max_num_draft_tokens gets verify graphs where each sequence brings k + 1 query tokens
    (prefill attention over static query offsets (k + 1) * b). kv_caches: the model's per-layer
    caches; max_blocks_per_seq: the block-table width every graph is captured with (a step's
    narrower table fills its left part; columns past a sequence's length are never read).
    write_features(aux, slot_mapping): called inside each graph on the model's aux output (EAGLE-3).
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
        max_num_draft_tokens: int = 0,
        write_features=None,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_batch_size)
        self.max_model_len = max_model_len
        self.max_num_draft_tokens = max_num_draft_tokens
        self.write_features = write_features
        device = kv_caches[0][0].device
        n = self.sizes[-1]
        tokens = n * (max_num_draft_tokens + 1)
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        # Every context must hold its k + 1 queries, also in the warm-up and capture passes.
        self.seq_lens = torch.full((n,), max_num_draft_tokens + 1, dtype=torch.int32, device=device)
        self.query_start_locs = [
            torch.arange(n + 1, dtype=torch.int32, device=device) * (k + 1)
            for k in range(max_num_draft_tokens + 1)
        ]
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graph_logits = graph_logits
        self.logits = (
            torch.empty(tokens, vocab_size, dtype=torch.float32, device=device) if graph_logits else None
        )
        self.hidden: torch.Tensor | None = None
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}

    def bucket(self, batch_size: int) -> int | None:
        """The smallest captured size holding batch_size, None when it is too large for graphs."""
        for size in self.sizes:
            if size >= batch_size:
                return size
        return None

    def has(self, batch_size: int, num_draft_tokens: int = 0) -> bool:
        """Whether a graph for exactly this (padded) batch size and k was captured."""
        return (batch_size, num_draft_tokens) in self.graphs

    def _forward(self, batch_size: int, k: int) -> torch.Tensor:
        """Logits [batch_size * (k+1), vocab] (hidden [.., H] when logits are computed after replay)."""
        tokens = batch_size * (k + 1)
        attn = AttentionMetadata(
            slot_mapping=self.slot_mapping[:tokens],
            block_tables=self.block_tables[:batch_size],
            seq_lens=self.seq_lens[:batch_size],
            query_start_loc=self.query_start_locs[k][: batch_size + 1],
            max_query_len=k + 1,
            max_seq_len=self.max_model_len + k,
            is_decode=k == 0,
        )
        hidden, aux = self.model(self.input_ids[:tokens], self.positions[:tokens], attn, self.kv_caches)
        if self.write_features is not None:
            self.write_features(aux, self.slot_mapping[:tokens])
        return self.model.compute_logits(hidden) if self.graph_logits else hidden

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every (bucket, k), largest first (so the shared pool is sized by the first capture)."""
        pool = None
        for k in reversed(range(self.max_num_draft_tokens + 1)):
            for size in reversed(self.sizes):
                out = self._forward(
                    size, k
                )  # warm-up: autotuning and lazy allocations happen outside capture
                if not self.graph_logits and self.hidden is None:
                    rows = self.input_ids.shape[0]
                    self.hidden = torch.empty(rows, out.shape[-1], dtype=out.dtype, device=out.device)
                target = self.logits if self.graph_logits else self.hidden

                def body(size=size, k=k, target=target):
                    target[: size * (k + 1)].copy_(self._forward(size, k))

                self.graphs[(size, k)], pool = self._capture_graph(body, pool)
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

    def run(self, step: StepInputs, num_draft_tokens: int = 0) -> torch.Tensor:
        """Replays the graph of step's (already padded) batch size and k; returns logits
        [B * (k+1), vocab] (hidden [.., H] without graph_logits), a view of a shared buffer valid
        until the next replay."""
        size = step.header.num_seqs
        tokens = step.header.num_tokens
        width = step.header.max_blocks
        self.input_ids[:tokens].copy_(step.input_ids)
        self.positions[:tokens].copy_(step.positions)
        self.slot_mapping[:tokens].copy_(step.slot_mapping)
        self.seq_lens[:size].copy_(step.seq_lens)
        self.block_tables[:size, :width].copy_(step.block_tables)
        self.graphs[(size, num_draft_tokens)].replay()
        return self.logits[:tokens] if self.graph_logits else self.hidden[:tokens]
