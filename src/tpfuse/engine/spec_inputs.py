"""A speculative step's inputs: the packed step (step_inputs.py) with a speculative section after it.

Rows of the forward: a *decode row* (a sequence whose only uncomputed token is its newest, at
position L >= 1) carries num_draft_tokens + 1 query tokens: the newest token and k drafts at
positions L..L+k. Drafts come from the host (n-gram: already in input_ids) or from the drafter on
every rank (written into input_ids before the forward). A row may use fewer drafts (num_drafts[d]
< k, near max_model_len or when n-gram finds fewer): its unused query tokens store no KV (slot -1) and
their logits are ignored. Other rows are prefill chunks, sampled as in a plain step.

*Drafter rows* are the rows whose drafter KV lags the target's: positions [d0, computed) with their
tokens, the token after each, and the target slots where their features are stored. Every decode row
is a drafter row (model drafters); prefill chunks catch up one step after they are computed.

A *window* step (ext_window W > 0: pure decode, EAGLE-3 chain drafting, every row at least W
positions long and lagging by at most W) lays the drafter section out as W entries per row, padding
rows included, ending at each row's newest verified position: fixed shapes for the CUDA graphs.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, fields
from itertools import pairwise

import torch

from tpfuse.engine.batch import Batch
from tpfuse.engine.spec_rows import catch_up_limit, draft_limit, is_decode_row, window_step_ok
from tpfuse.engine.step_inputs import StepHeader, encode_rows, encode_step, packed_length, row_seed


@dataclass
class SpecHeader:
    num_draft_tokens: int  # k of this step (0: decode rows verify only their newest token)
    num_decode: int  # D verify rows
    num_drafter_rows: int  # R rows that extend the drafter (0 for host drafters)
    num_extend: int  # E drafter-extend tokens
    num_banned: int  # (verify row, token) pairs masked by min_tokens
    all_greedy: int  # every verify row has temperature 0
    host_drafts: int  # drafts are packed (n-gram); else the drafter proposes them on every rank
    pure_decode: int  # no prefill rows (a CUDA-graph candidate); padding rows may follow
    sampled_drafts: int  # some row samples without a seed: model drafters draw drafts (and keep q)
    ext_max_query_len: int  # longest drafter-extend run
    ext_max_seq_len: int  # largest extended position + 1
    tree: int = 0  # verify rows are draft trees of k + 1 nodes (positions and tree mask set on device)
    num_kv_moves: int = 0  # KV slots to copy before the forward (the last tree step's accepted path)
    ext_window: int = 0  # W > 0: the drafter section is one window of W positions per row (eagle3_window.py)

    def sizes(self) -> list[tuple[str, int]]:
        d, k, r, e = self.num_decode, self.num_draft_tokens, self.num_drafter_rows, self.num_extend
        return [
            ("decode_rows", d),
            ("verify_indices", d * (k + 1)),
            ("num_drafts", d),
            ("drafter_rows", r),
            ("decode_drafter_index", d if r else 0),
            ("ext_input_ids", e),
            ("ext_positions", e),
            ("ext_next_ids", e),
            ("ext_slots", e),
            ("ext_query_start_loc", r + 1 if r else 0),
            ("top_ks", d),
            ("seeds", d),
            ("request_seeds", d),
            ("output_index", d),
            ("seeded", d),
            ("banned_rows", self.num_banned),
            ("banned_ids", self.num_banned),
            ("draft_ids", d * k if self.host_drafts else 0),
            ("temperatures", d),
            ("top_ps", d),
            ("kv_move_src", self.num_kv_moves),
            ("kv_move_dst", self.num_kv_moves),
        ]


SPEC_HEADER_LEN = len(fields(SpecHeader))


@dataclass
class SpecInputs:
    """Device views of the speculative section (int64; temperatures/top_ps float32)."""

    header: SpecHeader
    decode_rows: torch.Tensor  # [D] forward rows of the verify rows
    verify_indices: torch.Tensor  # [D * (k+1)] forward output rows, k+1 per verify row
    num_drafts: torch.Tensor  # [D] drafts each row really uses
    drafter_rows: torch.Tensor  # [R]
    decode_drafter_index: torch.Tensor  # [D] index of each verify row among the drafter rows
    ext_input_ids: torch.Tensor  # [E]
    ext_positions: torch.Tensor  # [E]
    ext_next_ids: torch.Tensor  # [E]
    ext_slots: torch.Tensor  # [E] target KV slots (where their features are stored)
    ext_query_start_loc: torch.Tensor  # [R + 1]
    top_ks: torch.Tensor  # [D]
    seeds: torch.Tensor  # [D] per row and step (rejection sampling)
    request_seeds: torch.Tensor  # [D] per request (seeded_sample_verify)
    output_index: torch.Tensor  # [D] output index of each row's newest-token position's successor
    seeded: torch.Tensor  # [D] 1: the request gave a seed (verified by seeded_sample_verify)
    banned_rows: torch.Tensor  # [K] flat verify rows d * (k+1) + i
    banned_ids: torch.Tensor  # [K]
    draft_ids: torch.Tensor  # [D * k] host drafts, or empty
    temperatures: torch.Tensor  # [D]
    top_ps: torch.Tensor  # [D]
    kv_move_src: torch.Tensor  # [M] slots whose KV (and EAGLE-3 features) move to kv_move_dst
    kv_move_dst: torch.Tensor  # [M]


def pack_spec_step(
    batch: Batch,
    block_size: int,
    engine_seed: int,
    num_draft_tokens: int,
    max_model_len: int,
    host_drafts: dict[int, list[int]] | None = None,
    extend_drafter: bool = True,
    pad_to: int | None = None,
    tree_depth: int | None = None,
    kv_moves: list[tuple[int, int]] | None = None,
    ext_window: int = 0,
    catch_up_budget: int | None = None,
) -> torch.Tensor:
    """Packs a speculative step into a CPU int64 tensor.

    host_drafts: batch row -> drafts (n-gram), already cut to draft_limit; None: the drafter proposes
    num_draft_tokens on every rank (each row then uses draft_limit of them). extend_drafter: list the
    drafter rows (model drafters). pad_to: pad a pure decode batch to this many rows (graph bucket).
    tree_depth: tree drafting (verify rows are trees of num_draft_tokens + 1 nodes, every node stores
    KV, num_drafts is each row's deepest acceptable depth, at most tree_depth; min_tokens bans cover
    every node and the verifier keeps those shallower than the remaining count). kv_moves: (src, dst)
    slot pairs copied on every rank before the forward. ext_window: lay the drafter section out as
    windows of this many positions when the step qualifies (window_step_ok), else as usual.
    catch_up_budget: when the decode rows' drafter lags add up to more than this many positions
    (after a run of plain steps each may lag by hundreds), each row extends only its newest
    budget / rows positions; older entries stay stale, which costs acceptance, never correctness,
    and keeps the drafter pass within the engine's activation budget.
    """
    k, bs = num_draft_tokens, block_size
    window = ext_window if ext_window and window_step_ok(batch, ext_window) else 0
    catch_up_cap = catch_up_limit(batch, catch_up_budget) if extend_drafter else None
    ids, positions, slots, seq_lens, starts, tables = [], [], [], [], [0], array("q")
    sample_idx, s_topk, s_seed, s_temp, s_topp, s_brow, s_bid = [], [], [], [], [], [], []
    decode_rows, verify_idx, num_drafts, drafter_rows, decode_drafter = [], [], [], [], []
    ext_ids, ext_pos, ext_next, ext_slots, ext_starts = [], [], [], [], [0]
    v_topk, v_seed, v_temp, v_topp, v_brow, v_bid, draft_ids = [], [], [], [], [], [], []
    v_request_seed, v_index, v_seeded = [], [], []
    max_blocks = max(len(s.block_table) for s in batch.seqs)
    zeros = array("q", bytes(8 * max_blocks))  # a row's padding columns
    pure_decode = True
    max_query_len = k + 1 if any(map(is_decode_row, batch.seqs, batch.num_new_tokens)) else 1
    for row, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
        table, tokens, begin = seq.block_table, seq.token_ids, seq.num_computed_tokens
        decode = is_decode_row(seq, n)
        if extend_drafter and (seq.num_drafter_tokens < begin or decode):
            d0 = min(seq.num_drafter_tokens, begin - 1) if decode else seq.num_drafter_tokens
            if decode and catch_up_cap is not None:
                d0 = max(d0, begin - catch_up_cap)
            if window:
                d0 = begin - window
            drafter_rows.append(row)
            ext_ids += tokens[d0:begin]
            ext_pos += range(d0, begin)
            ext_next += tokens[d0 + 1 : begin + 1]
            ext_slots += [table[p // bs] * bs + p % bs for p in range(d0, begin)]
            ext_starts.append(len(ext_ids))
        tables += table
        tables += zeros[: max_blocks - len(table)]
        p = seq.params
        if decode:
            d = len(decode_rows)
            decode_rows.append(row)
            if extend_drafter:
                decode_drafter.append(len(drafter_rows) - 1)
            drafts = host_drafts.get(row, []) if host_drafts is not None else []
            used = len(drafts) if host_drafts is not None else draft_limit(seq, k, max_model_len)
            if tree_depth is not None:
                num_drafts.append(draft_limit(seq, tree_depth, max_model_len))
                used = k
            else:
                num_drafts.append(used)
            if host_drafts is not None:
                draft_ids += drafts + [0] * (k - len(drafts))
            ids.append(tokens[begin])
            ids += drafts + [0] * (k - len(drafts))
            positions += range(begin, begin + k + 1)
            slots += [table[q // bs] * bs + q % bs for q in range(begin, begin + used + 1)]
            slots += [-1] * (k - used)
            seq_lens.append(begin + k + 1)
            verify_idx += range(starts[-1], starts[-1] + k + 1)
            starts.append(starts[-1] + k + 1)
            v_temp.append(p.temperature)
            v_topp.append(p.top_p)
            v_topk.append(p.top_k)
            v_seed.append(row_seed(p.seed, engine_seed, seq.seq_id, len(tokens) - seq.num_prompt_tokens))
            v_request_seed.append(row_seed(p.seed, engine_seed, seq.seq_id, -1))
            v_index.append(len(tokens) - seq.num_prompt_tokens)
            v_seeded.append(int(p.seed is not None))
            ban = batch.bans.get(row)
            if ban is not None:
                for i in range(k + 1 if tree_depth is not None else min(k + 1, ban.count)):
                    v_brow += [d * (k + 1) + i] * len(ban.token_ids)
                    v_bid += ban.token_ids
            continue
        pure_decode = False
        end = begin + n
        ids += tokens[begin:end]
        positions += range(begin, end)
        slots += [table[q // bs] * bs + q % bs for q in range(begin, end)]
        seq_lens.append(end)
        starts.append(starts[-1] + n)
        max_query_len = max(max_query_len, n)
        if end == len(tokens):
            sample_row = len(sample_idx)
            sample_idx.append(starts[-1] - 1)
            s_temp.append(p.temperature)
            s_topp.append(p.top_p)
            s_topk.append(p.top_k)
            s_seed.append(row_seed(p.seed, engine_seed, seq.seq_id, end - seq.num_prompt_tokens))
            if row in batch.bans:
                for token in batch.bans[row].token_ids:
                    s_brow.append(sample_row)
                    s_bid.append(token)
    num_real = len(batch.seqs)
    if pure_decode and pad_to is not None and pad_to > num_real:
        for _ in range(pad_to - num_real):
            ids += [0] * (k + 1)
            positions += range(k + 1)
            slots += [-1] * (k + 1)
            seq_lens.append(k + 1)
            starts.append(starts[-1] + k + 1)
            tables += zeros
            if window:  # the padding row's window: positions 0..W-1 that store nothing
                ext_ids += [0] * window
                ext_pos += range(window)
                ext_next += [0] * window
                ext_slots += [-1] * window
    values = encode_rows(
        [ids, positions, slots, seq_lens, starts, [], [], tables, sample_idx, s_topk, s_seed],
        s_temp,
        s_topp,
        [s_brow, s_bid],
        max_blocks=max_blocks,
        is_decode=pure_decode and k == 0,
        max_query_len=max_query_len,
    )
    spec = SpecHeader(
        num_draft_tokens=k,
        num_decode=len(decode_rows),
        num_drafter_rows=len(drafter_rows),
        num_extend=len(ext_ids),
        num_banned=len(v_brow),
        all_greedy=int(all(t == 0.0 for t in v_temp)),
        host_drafts=int(host_drafts is not None),
        pure_decode=int(pure_decode),
        sampled_drafts=int(any(t > 0.0 and not s for t, s in zip(v_temp, v_seeded, strict=True))),
        ext_max_query_len=max((b - a for a, b in pairwise(ext_starts)), default=0),
        ext_max_seq_len=max(ext_pos, default=-1) + 1,
        tree=int(tree_depth is not None),
        num_kv_moves=len(kv_moves or []),
        ext_window=window,
    )
    tail = encode_step(
        spec,
        [decode_rows, verify_idx, num_drafts, drafter_rows, decode_drafter, ext_ids, ext_pos, ext_next]
        + [ext_slots, ext_starts if drafter_rows else [], v_topk, v_seed, v_request_seed, v_index]
        + [v_seeded, v_brow, v_bid, draft_ids],
        v_temp + v_topp,
        [[src for src, _ in kv_moves or []], [dst for _, dst in kv_moves or []]],
    )
    values.extend(tail)
    return torch.frombuffer(values, dtype=torch.int64)


def read_spec_header(packed: torch.Tensor, header: StepHeader) -> SpecHeader:
    """The speculative header of a packed step (packed: the CPU tensor; header: its step header)."""
    start = packed_length(header)
    return SpecHeader(*packed[start : start + SPEC_HEADER_LEN].tolist())


def unpack_spec(header: StepHeader, spec: SpecHeader, packed_device: torch.Tensor) -> SpecInputs:
    """Views of the speculative section of the device copy of a packed step."""
    offset = packed_length(header) + SPEC_HEADER_LEN
    views = {}
    for name, size in spec.sizes():
        views[name] = packed_device[offset : offset + size]
        offset += size
    for name in ("temperatures", "top_ps"):
        views[name] = views[name].view(torch.float64).float()
    return SpecInputs(header=spec, **views)
