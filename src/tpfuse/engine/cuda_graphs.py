"""Decode steps captured as CUDA graphs, one per batch-size bucket (and per number of extra query rows).

Plain decode graphs (r = 0) read the packed step itself: the runner copies the packed step into the
static buffer `packed` (one host-to-device copy), and the graph takes the input ids, positions and KV
slots as views of it, converts the context lengths and gathers the block table (at the step's width,
read from the packed header on the device) inside the graph, takes the input ids only the device knows
from the token table (step_inputs.py), runs the forward and compute_logits, writes the argmax of every
row to `token_ids` and to the token table. So a greedy decode step is: H2D copy, replay, D2H copy of
the ids. Graphs with r > 0 extra query rows per sequence (a runner hook's, runner_hook.py)
read static input buffers that `run` fills from a step.
All graphs share one memory pool and one logits buffer. Capture happens after the KV cache is
allocated and after the communicator has made its per-size choices, so the fused all-reduce is
captured inside.
"""

from __future__ import annotations

import torch

from tpfuse.engine.runner_hook import RunnerHook
from tpfuse.engine.step_inputs import MAX_BLOCKS_INDEX, StepInputs, decode_capacity, decode_offsets
from tpfuse.model.attention import AttentionMetadata


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, ... up to max_batch_size (which is always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch_size]
    sizes += range(16, max_batch_size, 8)
    return sorted({*sizes, max_batch_size})


class DecodeGraphs:
    """Captured decode steps for batch sizes up to max_batch_size, per number of extra query rows r.

    r = 0 is a plain decode (one query token per sequence, decode attention); with a hook every r in
    1..hook.max_extra_query_rows gets graphs where each sequence brings r + 1 query tokens (prefill
    attention over static query offsets (r + 1) * b). kv_caches: the model's per-layer caches;
    max_blocks_per_seq: the block-table width every graph is captured with (a step's narrower table
    fills its left part; columns past a sequence's length are never read).
    hook (runner_hook.py): hook.after_forward(aux, slot_mapping) runs inside every graph on the
    model's aux output; with hook.fills_extra_rows, hook.fill_extra_rows runs inside every graph of
    r > 0 before the forward and its ids go into query rows 1..r of each sequence (whatever it reads
    must be in place before each replay); r = 0 graphs stay plain decodes. Without fills_extra_rows
    the caller writes those rows' ids before `run`.
    max_banned: room in `packed` for a step's banned (row, token) pairs (min_tokens); a step that
    does not fit goes through `run`. token_table: the runner's (step_inputs.py), read and written by
    r = 0 graphs (a step chosen outside the graph, by the sampler, writes it again after the replay).
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
        hook: RunnerHook | None = None,
        max_banned: int = 4096,
        token_table: torch.Tensor | None = None,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = graph_batch_sizes(max_batch_size)
        self.max_model_len = max_model_len
        self.hook = hook
        self.token_table = token_table
        self.max_extra_rows = hook.max_extra_query_rows if hook is not None else 0
        self.fills_extra_rows = hook is not None and hook.fills_extra_rows
        max_extra_rows = self.max_extra_rows
        device = kv_caches[0][0].device
        n = self.sizes[-1]
        tokens = n * (max_extra_rows + 1)
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        # Every context must hold its r + 1 queries, also in the warm-up and capture passes.
        self.seq_lens = torch.full((n,), max_extra_rows + 1, dtype=torch.int32, device=device)
        self.query_start_locs = [
            torch.arange(n + 1, dtype=torch.int32, device=device) * (r + 1) for r in range(max_extra_rows + 1)
        ]
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.max_blocks_per_seq = max_blocks_per_seq
        # The packed step of a plain decode (r = 0) graph; its rows never outgrow the static address.
        self.packed = torch.zeros(
            decode_capacity(n, max_blocks_per_seq, max_banned), dtype=torch.int64, device=device
        )
        self.token_ids = torch.zeros(n, dtype=torch.int64, device=device)  # argmax of each row (r = 0)
        self._table_index: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
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

    def has(self, batch_size: int, extra_rows: int = 0) -> bool:
        """Whether a graph for exactly this (padded) batch size and r was captured."""
        return (batch_size, extra_rows) in self.graphs

    def _packed_views(self, batch_size: int) -> dict[str, torch.Tensor]:
        """Views of `packed` laid out as a decode step of batch_size rows."""
        at = decode_offsets(batch_size)
        names = ("input_ids", "positions", "slot_mapping", "seq_lens", "id_slots", "write_slots")
        return {name: self.packed[at[name] : at[name] + batch_size] for name in names}

    def _load_from_packed(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inside an r = 0 graph: context lengths and block table from `packed` into the static
        int32 buffers; returns (input_ids, positions, slot_mapping): the ids with those only the
        device knows taken from the token table, the others views of `packed`."""
        views = self._packed_views(batch_size)
        self.seq_lens[:batch_size].copy_(views["seq_lens"])
        if batch_size not in self._table_index:
            device = self.packed.device
            start = decode_offsets(batch_size)["block_tables"]
            columns = start + torch.arange(self.max_blocks_per_seq, device=device).view(1, -1)
            rows = torch.arange(batch_size, device=device).view(-1, 1)
            self._table_index[batch_size] = (columns, rows)
        columns, rows = self._table_index[batch_size]
        # Row b of a width-M table starts at start + b * M. Columns >= M read other values: attention
        # never reads past a context's own blocks, and `packed` is sized so every index stays inside.
        index = columns + rows * self.packed[MAX_BLOCKS_INDEX]
        self.block_tables[:batch_size].copy_(self.packed.take(index))
        input_ids = views["input_ids"]
        if self.token_table is not None:
            slots = views["id_slots"]
            input_ids = torch.where(slots >= 0, self.token_table[slots.clamp(min=0)], input_ids)
        return input_ids, views["positions"], views["slot_mapping"]

    def _forward(self, batch_size: int, r: int, logits: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch_size * (r+1), vocab] of r extra query rows per sequence, written into `logits`
        when given (hidden [.., H] when logits are computed after replay)."""
        tokens = batch_size * (r + 1)
        if r == 0:
            input_ids, positions, slot_mapping = self._load_from_packed(batch_size)
        else:
            input_ids = self.input_ids[:tokens]
            positions = self.positions[:tokens]
            slot_mapping = self.slot_mapping[:tokens]
        if self.fills_extra_rows and r:
            ids = self.hook.fill_extra_rows(batch_size, r, self.block_tables[:batch_size])
            input_ids.view(batch_size, r + 1)[:, 1:].copy_(ids)
        attn = AttentionMetadata(
            slot_mapping=slot_mapping,
            block_tables=self.block_tables[:batch_size],
            seq_lens=self.seq_lens[:batch_size],
            query_start_loc=self.query_start_locs[r][: batch_size + 1],
            max_query_len=r + 1,
            max_seq_len=self.max_model_len + r,
            is_decode=r == 0,
        )
        hidden, aux = self.model(input_ids, positions, attn, self.kv_caches)
        if self.hook is not None:
            self.hook.after_forward(aux, slot_mapping)
        return self.model.compute_logits(hidden, logits) if self.graph_logits else hidden

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures every (bucket, r), largest first (so the shared pool is sized by the first capture)."""
        pool = None
        for r in reversed(range(self.max_extra_rows + 1)):
            for size in reversed(self.sizes):
                self.graphs[(size, r)], pool = self.capture_one(size, r, pool)
        self._synchronize()

    @torch.inference_mode()
    def capture_one(self, size: int, r: int, pool=None):
        """Warms up and captures the graph of (size, r) in pool (None: a new one); returns (graph,
        pool). capture() keeps them; a caller may capture one more to time it and drop it."""
        if r == 0:  # warm-up and capture: one-token contexts in block 0 that store no KV
            views = self._packed_views(size)
            self.packed.zero_()
            views["seq_lens"].fill_(1)
            views["slot_mapping"].fill_(-1)
            views["id_slots"].fill_(-1)
            views["write_slots"].fill_(self._table_sink())
        out = self._forward(size, r)  # warm-up: autotuning and lazy allocations happen outside capture
        if not self.graph_logits and self.hidden is None:
            rows = self.input_ids.shape[0]
            self.hidden = torch.empty(rows, out.shape[-1], dtype=out.dtype, device=out.device)
        target = self.logits if self.graph_logits else self.hidden

        def body():
            out = target[: size * (r + 1)]
            if not self.graph_logits:
                out.copy_(self._forward(size, r))
                return
            self._forward(size, r, logits=out)  # the logits land in the shared buffer
            if r == 0:
                torch.argmax(out, dim=-1, out=self.token_ids[:size])
                if self.token_table is not None:
                    slots = self._packed_views(size)["write_slots"]
                    self.token_table[slots] = self.token_ids[:size]

        return self._capture_graph(body, pool)

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

    def replay_packed(self, batch_size: int) -> torch.Tensor:
        """Replays the r = 0 graph of batch_size rows on the decode step already in `packed` (its
        first values, as pack_step laid them out). Returns logits [B, vocab] (hidden [B, H] without
        graph_logits), a view of a shared buffer valid until the next replay; with graph_logits,
        token_ids[:B] holds each row's argmax."""
        self.graphs[(batch_size, 0)].replay()
        return self.logits[:batch_size] if self.graph_logits else self.hidden[:batch_size]

    def _table_sink(self) -> int:
        return self.token_table.numel() - 1 if self.token_table is not None else 0

    def _copy_to_packed(self, step: StepInputs) -> None:
        """Writes a decode step held elsewhere into `packed` at its layout (7 copies and a fill); a
        step without token-table entries reads its packed ids and writes the sink."""
        size, width = step.header.num_seqs, step.header.max_blocks
        if step.input_ids.data_ptr() == self.packed[decode_offsets(size)["input_ids"]].data_ptr():
            return  # step is a view of packed already
        for name, view in self._packed_views(size).items():
            if step.header.uses_table or name not in ("id_slots", "write_slots"):
                view.copy_(getattr(step, name))
            else:
                view.fill_(-1 if name == "id_slots" else self._table_sink())
        start = decode_offsets(size)["block_tables"]
        self.packed[start : start + size * width].copy_(step.block_tables.reshape(-1))
        self.packed[MAX_BLOCKS_INDEX].fill_(width)

    def run(self, step: StepInputs, extra_rows: int = 0) -> torch.Tensor:
        """Replays the graph of step's (already padded) batch size and r = extra_rows; returns logits
        [B * (r+1), vocab] (hidden [.., H] without graph_logits), a view of a shared buffer valid
        until the next replay. Raises ValueError when an r = 0 step's block table is wider than the
        graphs'."""
        size = step.header.num_seqs
        tokens = step.header.num_tokens
        width = step.header.max_blocks
        if extra_rows == 0:
            if width > self.max_blocks_per_seq or tokens != size:
                raise ValueError(
                    f"decode step of {size} rows, {tokens} tokens and {width} block-table columns does "
                    f"not fit the graphs ({self.max_blocks_per_seq} columns, one token per row)"
                )
            self._copy_to_packed(step)
            return self.replay_packed(size)
        self.input_ids[:tokens].copy_(step.input_ids)
        self.positions[:tokens].copy_(step.positions)
        self.slot_mapping[:tokens].copy_(step.slot_mapping)
        self.seq_lens[:size].copy_(step.seq_lens)
        self.block_tables[:size, :width].copy_(step.block_tables)
        self.graphs[(size, extra_rows)].replay()
        return self.logits[:tokens] if self.graph_logits else self.hidden[:tokens]
