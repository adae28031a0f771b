"""Repetition, presence and frequency penalties and logit_bias for a whole batch in a few device ops.

Each processed sequence keeps a `TokenHistory` that follows its tokens incrementally (the tokens
appended since the last step, usually one), so a step costs O(new tokens) on the host per row, not
O(context). `apply_penalties` concatenates the rows' histories into flat (row, token) lists, copies
them to the device once (pinned: no wait for the queued forward), and edits every row of the logits
with one gather/scatter per rule:

- repetition penalty over every distinct token of prompt and output (HF's rule: a positive logit is
  divided by the penalty, a negative one multiplied);
- presence and frequency penalties over the output tokens (OpenAI's rule:
  logit -= frequency * count + presence);
- logit_bias added last.
"""

from __future__ import annotations

import numpy as np
import torch

from tpfuse.engine.step_upload import upload


class _GrowingArray:
    """An append-only int64 or float32 array with amortised O(1) appends."""

    def __init__(self, dtype):
        self._data = np.empty(16, dtype=dtype)
        self.size = 0

    def append(self, value) -> None:
        if self.size == len(self._data):
            self._data = np.concatenate([self._data, np.empty_like(self._data)])
        self._data[self.size] = value
        self.size += 1

    def view(self) -> np.ndarray:
        return self._data[: self.size]


class TokenHistory:
    """What the penalties of one sequence read: its distinct tokens (prompt and output) and the count
    of each distinct output token. `update(seq)` consumes the tokens appended since the last call."""

    def __init__(self):
        self._num_seen = 0  # tokens of seq.token_ids consumed
        self._seen: set[int] = set()
        self.distinct = _GrowingArray(np.int64)  # every distinct token, first appearance order
        self._output_slot: dict[int, int] = {}
        self.output_ids = _GrowingArray(np.int64)  # distinct output tokens
        self.output_counts = _GrowingArray(np.float32)  # their counts

    def update(self, seq) -> None:
        tokens = seq.token_ids
        num_prompt = seq.num_prompt_tokens
        for position in range(self._num_seen, len(tokens)):
            token = tokens[position]
            if token not in self._seen:
                self._seen.add(token)
                self.distinct.append(token)
            if position >= num_prompt:
                slot = self._output_slot.get(token)
                if slot is None:
                    self._output_slot[token] = self.output_ids.size
                    self.output_ids.append(token)
                    self.output_counts.append(1.0)
                else:
                    self.output_counts.view()[slot] += 1.0
        self._num_seen = len(tokens)


def needs_penalties(params) -> bool:
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty) or bool(params.frequency_penalty)


def apply_penalties(logits: torch.Tensor, rows: list[tuple[int, object, TokenHistory]]) -> None:
    """logits [N, V] float32 in place. rows: (row j, its sequence, its updated TokenHistory) for the
    rows whose params ask for a penalty or a bias; the history may be None for a bias alone)."""
    rep_rows, rep_ids, out_rows, out_ids, out_sub, bias_rows, bias_ids, bias_add = ([] for _ in range(8))
    for j, seq, history in rows:
        p = seq.params
        if p.repetition_penalty != 1.0:
            ids = history.distinct.view()
            rep_rows.append(np.full(len(ids), j, dtype=np.int64))
            rep_ids.append(ids)
        if p.presence_penalty or p.frequency_penalty:
            ids = history.output_ids.view()
            out_rows.append(np.full(len(ids), j, dtype=np.int64))
            out_ids.append(ids)
            counts = history.output_counts.view()
            out_sub.append(counts * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty))
        if p.logit_bias:
            bias_rows.append(np.full(len(p.logit_bias), j, dtype=np.int64))
            bias_ids.append(np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias)))
            bias_add.append(np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias)))
    pieces = [rep_rows, rep_ids, out_rows, out_ids, bias_rows, bias_ids]
    sizes = [sum(len(a) for a in piece) for piece in pieces]
    if not any(sizes):
        return
    # One host-to-device copy for the indices, one for the values.
    flat = upload(np.concatenate([a for piece in pieces for a in piece]), logits.device)
    rep_rows_d, rep_ids_d, out_rows_d, out_ids_d, bias_rows_d, bias_ids_d = flat.split(sizes)
    factors = np.zeros(logits.shape[0], dtype=np.float32)
    for j, seq, _ in rows:
        factors[j] = seq.params.repetition_penalty
    values = np.concatenate([factors, *out_sub, *bias_add]).astype(np.float32, copy=False)
    values_d = upload(values, logits.device, torch.float32)
    factors_d, out_sub_d, bias_add_d = values_d.split([len(factors), sizes[2], sizes[4]])
    if sizes[0]:
        picked = logits[rep_rows_d, rep_ids_d]
        penalty = factors_d[rep_rows_d]
        logits[rep_rows_d, rep_ids_d] = torch.where(picked > 0, picked / penalty, picked * penalty)
    if sizes[2]:
        logits.index_put_((out_rows_d, out_ids_d), -out_sub_d, accumulate=True)
    if sizes[4]:
        logits.index_put_((bias_rows_d, bias_ids_d), bias_add_d, accumulate=True)
