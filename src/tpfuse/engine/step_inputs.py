"""A step's inputs as one flat int64 tensor: built on the host by rank 0, copied to the device once,
and sent unchanged to the other tensor-parallel ranks.

Layout: a header of HEADER_LEN ints, then the arrays in the order of StepHeader.sizes (floats travel
as the bits of float64). Decode batches may be padded up to a CUDA-graph bucket: padding rows have
token 0, position 0, slot -1 (nothing stored), context length 1 and a block-table row of zeros (a
dummy read).

The token table: every rank keeps a device int64 table of each running request's newest token,
indexed by its Sequence.slot (the last entry, the sink, takes writes that nobody reads). A step that
uses it (header.uses_table) carries two arrays per token: id_slots (the entry its input id comes
from, for an id only the device knows yet, in a step planned while the step before it ran; -1: the
packed id) and write_slots (the entry the token sampled from its logits goes to; the sink for tokens
that are not sampled). Decode graphs run both inside the graph. Steps run in launch order on one
device stream, so a read sees every earlier step's writes.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from tpfuse.engine.batch import Batch
from tpfuse.kernels.sampling import filter_plan
from tpfuse.model.attention import AttentionMetadata

HEADER_LEN = 12
_MASK63 = (1 << 63) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def row_seed(request_seed: int | None, engine_seed: int, seq_id: int, output_index: int) -> int:
    """Sampling seed of one token: a seeded request depends only on (seed, output_index), so it is
    reproducible whatever the batch; an unseeded one mixes the engine seed with the sequence id."""
    if request_seed is None:
        request_seed = engine_seed ^ (seq_id << 20) ^ (1 << 62)
    return _splitmix64(_splitmix64(request_seed & 0xFFFFFFFFFFFFFFFF) ^ output_index) & _MASK63


@dataclass
class StepHeader:
    num_seqs: int  # B, padding rows included
    num_tokens: int  # T
    num_samples: int  # N rows of logits to sample
    max_blocks: int  # M, block-table width
    is_decode: int
    max_query_len: int
    max_seq_len: int
    num_banned: int  # K (row, token) pairs masked to -inf before sampling
    all_greedy: int  # every sampled row has temperature 0: argmax, no sampler
    uses_table: int  # 1: id_slots and write_slots follow (the token table)
    num_gathered: int  # input ids taken from the token table (id_slots >= 0)
    decode_rows: int  # leading rows with one query token (B for a decode step)

    def sizes(self) -> list[tuple[str, int]]:
        b, t, n, k = self.num_seqs, self.num_tokens, self.num_samples, self.num_banned
        table = t if self.uses_table else 0
        return [
            ("input_ids", t),
            ("positions", t),
            ("slot_mapping", t),
            ("seq_lens", b),
            ("query_start_loc", b + 1),
            ("id_slots", table),
            ("write_slots", table),
            ("block_tables", b * self.max_blocks),
            ("sample_indices", n),
            ("top_ks", n),
            ("seeds", n),
            ("temperatures", n),
            ("top_ps", n),
            ("banned_rows", k),
            ("banned_ids", k),
        ]


@dataclass
class StepInputs:
    """Device views of a packed step, all int64 except the float32 sampling fields."""

    header: StepHeader
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    seq_lens: torch.Tensor  # [B]
    query_start_loc: torch.Tensor  # [B + 1]
    id_slots: torch.Tensor  # [T] token-table entry of each input id, -1: the packed id ([0]: no table)
    write_slots: torch.Tensor  # [T] token-table entry of each token's sampled id ([0]: no table)
    block_tables: torch.Tensor  # [B, M]
    sample_indices: torch.Tensor  # [N] rows of the forward's output to sample
    top_ks: torch.Tensor  # [N]
    seeds: torch.Tensor  # [N]
    temperatures: torch.Tensor  # [N] float32 (float64 when header.all_greedy: unused)
    top_ps: torch.Tensor  # [N] float32 (float64 when header.all_greedy: unused)
    banned_rows: torch.Tensor  # [K]
    banned_ids: torch.Tensor  # [K]
    filter_plan: tuple[bool, int] | None = None  # kernels.sampling.filter_plan, when read on the host

    def attention_metadata(self) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            block_tables=self.block_tables.to(torch.int32),
            seq_lens=self.seq_lens.to(torch.int32),
            query_start_loc=self.query_start_loc.to(torch.int32),
            max_query_len=self.header.max_query_len,
            max_seq_len=self.header.max_seq_len,
            is_decode=bool(self.header.is_decode),
            num_decode_rows=self.header.decode_rows,
        )


def pack_step(
    batch: Batch,
    block_size: int,
    engine_seed: int,
    pad_to: int | None = None,
    table_sink: int | None = None,
) -> torch.Tensor:
    """Packs batch (its bans included) into a CPU int64 tensor. pad_to: pad a decode batch to this
    many rows (a CUDA-graph bucket). table_sink: the token table's sink entry; None: the step does
    not use the table, and no row may start at a token only the device knows yet (Batch.begins)."""
    input_ids, positions, slots, seq_lens, starts, tables = [], [], [], [], [0], array("q")
    sample_idx, top_ks, seeds, temps, top_ps, banned_rows, banned_ids = [], [], [], [], [], [], []
    id_slots, write_slots, num_gathered = [], [], 0
    sink = table_sink
    max_blocks = max(len(s.block_table) for s in batch.seqs)
    zeros = array("q", bytes(8 * max_blocks))  # a row's padding columns
    bs = block_size
    # The hot loop of every step (once per sequence): plain list operations only.
    bans = batch.bans
    begins = batch.begins
    for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
        begin = seq.num_computed_tokens if begins is None else begins[i]
        end = begin + n
        table = seq.block_table
        tokens = seq.token_ids
        if n == 1:
            if begin < len(tokens):
                input_ids.append(tokens[begin])
                id_slots.append(-1)
            else:  # the token the step before is sampling
                if seq.slot is None or sink is None:
                    raise ValueError(
                        f"{seq} starts at a token only the device knows, but no token table is given"
                    )
                input_ids.append(0)
                id_slots.append(seq.slot)
                num_gathered += 1
            positions.append(begin)
            slots.append(table[begin // bs] * bs + begin % bs)
        else:
            input_ids += tokens[begin:end]
            id_slots += [-1] * n
            positions += range(begin, end)
            slots += [table[p // bs] * bs + p % bs for p in range(begin, end)]
        seq_lens.append(end)
        starts.append(starts[-1] + n)
        tables += table
        if len(table) < max_blocks:
            tables += zeros[: max_blocks - len(table)]
        samples = end >= len(tokens)
        if n > 1:
            write_slots += [sink] * (n - 1)
        write_slots.append(seq.slot if samples and seq.slot is not None else sink)
        if samples:
            row = len(sample_idx)
            sample_idx.append(starts[-1] - 1)
            p = seq.params
            temps.append(p.temperature)
            top_ps.append(p.top_p)
            top_ks.append(p.top_k)
            if p.temperature > 0.0:
                seeds.append(row_seed(p.seed, engine_seed, seq.seq_id, end - seq.num_prompt_tokens))
            else:
                seeds.append(0)  # greedy rows draw nothing
            if bans and i in bans:
                for token in bans[i].token_ids:
                    banned_rows.append(row)
                    banned_ids.append(token)
    num_real = len(batch.seqs)
    if pad_to is not None and pad_to > num_real:
        pad = pad_to - num_real
        input_ids += [0] * pad
        id_slots += [-1] * pad
        write_slots += [sink] * pad
        positions += [0] * pad
        slots += [-1] * pad
        seq_lens += [1] * pad
        starts += range(starts[-1] + 1, starts[-1] + 1 + pad)
        tables.frombytes(bytes(8 * pad * max_blocks))
    table = [id_slots, write_slots] if sink is not None else [[], []]
    values = encode_rows(
        [input_ids, positions, slots, seq_lens, starts, *table, tables, sample_idx, top_ks, seeds],
        temps,
        top_ps,
        [banned_rows, banned_ids],
        max_blocks=max_blocks,
        is_decode=batch.is_decode,
        max_query_len=max(batch.num_new_tokens),
        num_gathered=num_gathered,
    )
    return torch.frombuffer(values, dtype=torch.int64)


def encode_rows(
    int_parts: list[list[int]],
    temperatures: list[float],
    top_ps: list[float],
    bans: list[list[int]],
    *,
    max_blocks: int,
    is_decode: bool,
    max_query_len: int,
    num_gathered: int = 0,
) -> array:
    """encode_step of a step given as its arrays, the header's counts taken from their lengths.

    int_parts: input_ids, positions, slot_mapping, seq_lens, query_start_loc, id_slots, write_slots
    (both empty: the step leaves the token table alone), block_tables, sample_indices, top_ks, seeds
    (the order of StepHeader.sizes); bans: [banned_rows, banned_ids]; num_gathered: id_slots >= 0."""
    input_ids, _, _, seq_lens, starts, id_slots, _, _, sample_indices, _, _ = int_parts
    decode_rows = len(seq_lens)
    if not is_decode:
        decode_rows = next((b for b in range(len(seq_lens)) if starts[b + 1] - starts[b] != 1), decode_rows)
    header = StepHeader(
        num_seqs=len(seq_lens),
        num_tokens=len(input_ids),
        num_samples=len(sample_indices),
        max_blocks=max_blocks,
        is_decode=int(is_decode),
        max_query_len=max_query_len,
        max_seq_len=max(seq_lens),
        num_banned=len(bans[0]),
        all_greedy=int(all(t == 0.0 for t in temperatures)),
        uses_table=int(bool(id_slots)),
        num_gathered=num_gathered,
        decode_rows=decode_rows,
    )
    return encode_step(header, int_parts, temperatures + top_ps, bans)


def encode_step(header: StepHeader, int_parts: list, floats: list[float], tail_parts: list) -> array:
    """The packed values: header, int_parts, floats (as float64 bits), tail_parts, in that order
    (the order of StepHeader.sizes). Callers may append more sections to the returned array."""
    values = array("q", list(vars(header).values()))
    for part in int_parts:
        values.extend(part)
    values.frombytes(array("d", floats).tobytes())  # floats travel as their bits
    for part in tail_parts:
        values.extend(part)
    return values


def packed_length(header: StepHeader) -> int:
    """Values of the step proper (header included); a speculative section follows it."""
    return HEADER_LEN + sum(size for _, size in header.sizes())


MAX_BLOCKS_INDEX = list(StepHeader.__dataclass_fields__).index("max_blocks")  # header slot of M


def decode_offsets(num_seqs: int) -> dict[str, int]:
    """Where input_ids, positions, slot_mapping, seq_lens, id_slots, write_slots and block_tables
    start in a packed decode step of num_seqs rows that uses the token table (one token per row,
    padding included). The offsets do not depend on the
    block-table width M (header slot MAX_BLOCKS_INDEX), which comes last among them, so a CUDA graph
    can read a step of any width from one static buffer."""
    offsets, offset = {}, HEADER_LEN
    probe = StepHeader(num_seqs, num_seqs, 0, 0, 1, 1, 1, 0, 1, 1, 0, num_seqs)  # uses the token table
    for name, size in probe.sizes():
        offsets[name] = offset
        if name == "block_tables":
            return offsets
        offset += size
    raise AssertionError("block_tables is missing from StepHeader.sizes")


def decode_capacity(max_num_seqs: int, max_blocks: int, max_banned: int) -> int:
    """Values a packed decode step of at most max_num_seqs rows, block-table width max_blocks and
    max_banned banned (row, token) pairs can take (the step proper: no speculative section), its
    token-table writes and gathers included."""
    n = max_num_seqs
    return HEADER_LEN + 5 * n + 1 + 2 * n + n * max_blocks + 5 * n + 2 * max_banned


def read_header(packed: torch.Tensor) -> StepHeader:
    """The header of a packed step (packed: the CPU tensor)."""
    return StepHeader(*packed[:HEADER_LEN].tolist())


def unpack_step(
    header: StepHeader, packed_device: torch.Tensor, packed: torch.Tensor | None = None
) -> StepInputs:
    """Views of the device copy of a packed step (the float fields are converted to float32).
    packed: the CPU packed step, from which the sampler's filter plan is read (no device sync)."""
    views, offsets = {}, {}
    offset = HEADER_LEN
    for name, size in header.sizes():
        views[name] = packed_device[offset : offset + size]
        offsets[name] = offset
        offset += size
    views["block_tables"] = views["block_tables"].view(header.num_seqs, header.max_blocks)
    for name in ("temperatures", "top_ps"):
        views[name] = views[name].view(torch.float64)
        if not header.all_greedy:  # greedy steps never read them: skip the conversion kernels
            views[name] = views[name].float()
    plan = None
    if packed is not None and not header.all_greedy and header.num_samples:
        n = header.num_samples
        host = {
            name: packed[offsets[name] : offsets[name] + n] for name in ("temperatures", "top_ks", "top_ps")
        }
        plan = filter_plan(
            host["temperatures"].view(torch.float64).numpy(), host["top_ks"].numpy(),
            host["top_ps"].view(torch.float64).numpy(),
        )  # fmt: skip
    return StepInputs(header=header, **views, filter_plan=plan)
