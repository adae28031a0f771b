"""Forward passes of the steps the decode graphs do not take (prompt chunks, mixed prefill + decode
steps, decode batches past the decode graphs), up to a few hundred tokens, captured as CUDA graphs
per token bucket and split at each layer's attention ("piecewise" graphs).

Everything in a forward but attention depends only on the token count, so it is captured once per
bucket and replayed on the step's tokens padded to the bucket. Padding tokens keep KV slot -1 (they
store nothing); their ids and positions are whatever earlier steps left, all valid. Attention
depends on the step's sequences (how many, their query lengths and contexts), so it runs eagerly
between the pieces on the step's own metadata: during capture, AttentionMetadata.graph_break
(model/attention.py) ends the piece at each layer's attention core, with the core's inputs copied
into static buffers, and the next piece starts from the core's static output. A step of T tokens
then costs the host three copies, one fill, L + 1 replays and the launches of L attention cores,
in place of every launch of the eager forward.

The static buffers are shared by every layer and bucket (a layer's core reads its inputs before the
next piece overwrites them, and writes its output before the next piece reads it). All pieces share
one memory pool and are replayed in the order they were captured. Which buckets keep their graphs
is measured at start-up (`choose`): a bucket whose replay is not faster than the eager forward at
the fewest tokens the bucket takes is dropped, and steps of those token counts stay eager, so the
padding never makes a step slower than the eager path it replaces.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tpfuse.gpu_timing import stream_us
from tpfuse.model.attention import AttentionMetadata

log = logging.getLogger(__name__)

SMALL_SIZES = (8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256)  # then every 64 tokens
ROUNDS = 3  # start-up timing: alternating rounds per bucket ...
REPEATS = 3  # ... of this many forwards each


def piecewise_sizes(max_tokens: int) -> list[int]:
    """The token buckets up to max_tokens: SMALL_SIZES, then multiples of 64, then max_tokens itself
    (none when max_tokens < 1). Past 256 tokens a bucket pads at most 63 tokens (under 25 %)."""
    if max_tokens < 1:
        return []
    sizes = [s for s in SMALL_SIZES if s < max_tokens]
    sizes += range(SMALL_SIZES[-1] + 64, max_tokens, 64)
    return sorted({*sizes, max_tokens})


@dataclass
class _Core:
    """One layer's attention core between two pieces: run(step_attn, *inputs[:T], out[:T])."""

    run: Callable[..., None]
    inputs: tuple[torch.Tensor, ...]  # static, [bucket, ...] views
    out: torch.Tensor  # static, [bucket, ...] view

    def __call__(self, attn: AttentionMetadata, rows: int) -> None:
        self.run(attn, *(x[:rows] for x in self.inputs), self.out[:rows])


class _Buffers:
    """The static attention inputs and outputs every layer and bucket shares, [rows, ...] each, by
    (role, trailing shape, dtype). Allocated by the warm-up passes, before any capture."""

    def __init__(self, rows: int):
        self.rows = rows
        self.tensors: dict[tuple, torch.Tensor] = {}

    def get(self, role: str | int, like: torch.Tensor, size: int) -> torch.Tensor:
        key = (role, tuple(like.shape[1:]), like.dtype)
        buffer = self.tensors.get(key)
        if buffer is None:
            if like.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"piecewise graphs: static buffer {key} first met during a capture")
            buffer = self.tensors[key] = torch.empty(
                (self.rows, *like.shape[1:]), dtype=like.dtype, device=like.device
            )
        return buffer[:size]

    def core(self, run: Callable[..., None], inputs: tuple[torch.Tensor, ...], like: torch.Tensor) -> _Core:
        """A core whose inputs are copied (by the caller's stream, now) into the static buffers."""
        size = like.shape[0]
        static = tuple(self.get(i, x, size) for i, x in enumerate(inputs))
        for buffer, x in zip(static, inputs, strict=True):
            buffer.copy_(x)
        return _Core(run, static, self.get("out", like, size))


class _RunNow:
    """GraphBreak that runs each core at once on `attn`'s first `rows` tokens: the replay's
    arithmetic without graphs (warm-up passes; every pass on devices without CUDA graphs)."""

    def __init__(self, buffers: _Buffers, attn: AttentionMetadata, rows: int):
        self.buffers, self.attn, self.rows = buffers, attn, rows

    def attend(self, core, inputs, like):
        bound = self.buffers.core(core, inputs, like)
        bound(self.attn, self.rows)
        return bound.out


class _Capture:
    """GraphBreak of one bucket's capture: ends the piece being captured at each attention core and
    begins the next. begin() before the forward, end() after it."""

    def __init__(self, buffers: _Buffers, pool):
        self.buffers, self.pool = buffers, pool
        self.pieces: list[torch.cuda.CUDAGraph] = []
        self.cores: list[_Core] = []

    def begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        self.pieces.append(graph)

    def end(self) -> None:
        self.pieces[-1].capture_end()
        self.pool = self.pieces[-1].pool()

    def attend(self, core, inputs, like):
        bound = self.buffers.core(core, inputs, like)  # the copies end this piece
        self.end()
        self.cores.append(bound)
        self.begin()
        return bound.out


@dataclass
class _Pieces:
    """A bucket's graphs: replay pieces[i], run cores[i], ..., replay pieces[-1]; then hidden and aux
    (static, [bucket, ...]) hold the forward's outputs."""

    pieces: list[torch.cuda.CUDAGraph]
    cores: list[_Core]
    hidden: torch.Tensor
    aux: torch.Tensor | None


class PiecewiseGraphs:
    """The model's forward for steps of up to sizes[-1] tokens as per-bucket piecewise CUDA graphs.

    model(input_ids, positions, attn, kv_caches) -> (hidden, aux) is the decoder's forward (its
    attention layers honour attn.graph_break); sizes: the token buckets (piecewise_sizes).
    use_graphs False (the default off CUDA) runs the same passes without graphs: each run is an
    eager forward on the padded static inputs, its attention cores through the static buffers
    (what the tests on the CPU check against the plain forward).
    """

    def __init__(self, model, kv_caches, sizes: list[int], use_graphs: bool | None = None):
        if not sizes:
            raise ValueError("PiecewiseGraphs needs at least one token bucket")
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.kept = set(self.sizes)
        device = kv_caches[0][0].device
        self.device = device
        self.use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        # The warm-up, capture and timing passes: one-token contexts over block 0 that store nothing.
        self._tables = torch.zeros(n, 1, dtype=torch.int32, device=device)
        self._seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self._starts = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.buffers = _Buffers(n)
        self.graphs: dict[int, _Pieces] = {}
        self.timings: dict[int, tuple[float, float]] = {}  # size -> (replay us, eager us), by choose
        self.startup_s = 0.0  # seconds spent in capture and choose

    def bucket(self, num_tokens: int) -> int | None:
        """The bucket a step of num_tokens tokens replays, None: it runs eagerly (too many tokens, or
        its bucket was dropped at start-up)."""
        for size in self.sizes:
            if size >= num_tokens:
                return size if size in self.kept else None
        return None

    def _metadata(self, rows: int, graph_break=None) -> AttentionMetadata:
        """rows one-token contexts over block 0 at the static slots (no stores while they are -1)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:rows],
            block_tables=self._tables[:rows],
            seq_lens=self._seq_lens[:rows],
            query_start_loc=self._starts[: rows + 1],
            max_query_len=1,
            max_seq_len=1,
            is_decode=True,
            graph_break=graph_break,
        )

    def _forward(self, size: int, graph_break) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn = self._metadata(size, graph_break)
        return self.model(self.input_ids[:size], self.positions[:size], attn, self.kv_caches)

    @torch.inference_mode()
    def capture(self, pool=None):
        """Warms up and captures every bucket, largest first, in pool (None: a new one); returns the
        pool. A no-op without graphs."""
        if not self.use_graphs:
            return pool
        began = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        for size in reversed(self.sizes):
            # Warm-up: compiles and autotunes at this size and allocates the static buffers.
            self._forward(size, _RunNow(self.buffers, self._metadata(size), size))
            torch.cuda.synchronize(self.device)
            capture = _Capture(self.buffers, pool)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                capture.begin()
                hidden, aux = self._forward(size, capture)
                capture.end()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            pool = capture.pool
            self.graphs[size] = _Pieces(capture.pieces, capture.cores, hidden, aux)
        torch.cuda.synchronize(self.device)
        self.startup_s += time.perf_counter() - began
        return pool

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        attn: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward of T = input_ids.shape[0] tokens (bucket(T) not None) described by attn:
        (hidden [T, H], aux [T, ...] or None), views of static tensors valid until the next run."""
        rows = input_ids.shape[0]
        size = self.bucket(rows)
        if size is None:
            raise ValueError(f"no piecewise graph takes a step of {rows} tokens (kept: {sorted(self.kept)})")
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(positions)
        self.slot_mapping[:rows].copy_(slot_mapping)
        self.slot_mapping[rows:size].fill_(-1)
        if not self.use_graphs:
            hidden, aux = self._forward(size, _RunNow(self.buffers, attn, rows))
        else:
            pieces = self.graphs[size]
            for graph, core in zip(pieces.pieces[:-1], pieces.cores, strict=True):
                graph.replay()
                core(attn, rows)
            pieces.pieces[-1].replay()
            hidden, aux = pieces.hidden, pieces.aux
        return hidden[:rows], (aux[:rows] if aux is not None else None)

    @torch.inference_mode()
    def choose(self, agree=None) -> dict[int, tuple[float, float]]:
        """Times each bucket's replay against the eager forward, both at the fewest tokens the bucket
        takes (one more than the bucket below), in alternating rounds; keeps the buckets where replay
        is faster. agree(kept) -> kept: tensor-parallel ranks take rank 0's list. Returns
        {size: (replay us, eager us)} (also in self.timings). A no-op without graphs."""
        if not self.use_graphs:
            return {}
        began = time.perf_counter()
        self.slot_mapping.fill_(-1)
        low = 1
        for size in self.sizes:
            rows, low = low, size + 1
            attn = self._metadata(rows)
            ids, positions, slots = self.input_ids[:rows], self.positions[:rows], self.slot_mapping[:rows]

            def replay(attn=attn, ids=ids, positions=positions, slots=slots):
                self.run(ids, positions, slots, attn)

            def eager(attn=attn, ids=ids, positions=positions):
                self.model(ids, positions, attn, self.kv_caches)

            replay_us, eager_us = [], []
            for round_ in range(ROUNDS):  # alternate, first side flipped every round
                for fn, out in ((replay, replay_us), (eager, eager_us))[:: 1 if round_ % 2 == 0 else -1]:
                    out.append(stream_us(fn, REPEATS))
            self.timings[size] = (statistics.median(replay_us), statistics.median(eager_us))
        kept = [size for size, (replay_us, eager_us) in self.timings.items() if replay_us < eager_us]
        if agree is not None:
            kept = agree(kept)
        self.kept = set(kept)
        for size in self.sizes:
            if size not in self.kept:
                self.graphs.pop(size, None)
        self.startup_s += time.perf_counter() - began
        log.info(
            "piecewise CUDA graphs kept for %s of %s tokens (captured and timed in %.1f s; replay / eager "
            "us: %s)",
            sorted(self.kept), self.sizes, self.startup_s,
            ", ".join(f"{s}: {r:.0f}/{e:.0f}" for s, (r, e) in self.timings.items()),
        )  # fmt: skip
        return self.timings
