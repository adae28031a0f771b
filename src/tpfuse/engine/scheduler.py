"""Continuous batching with chunked prefill and preemption by recompute.

Each step is one batch under a token budget (--max-num-batched-tokens), a cap on running requests
(--max-running-requests) and a prefill budget (--max-prefill-tokens-per-step). Decodes never stall
behind a prompt: every decoding request takes its token first, and prompt tokens (chunks of requests
still in prefill, in admission order, then waiting requests admitted first come, first served) fill
what is left, at most the prefill budget per step, so a step's length (and every stream's gap
between tokens) is bounded by a decode step plus that many prompt tokens. A prompt longer than what
is left is prefilled in chunks over several steps, alongside the decodes.
When a running request needs a KV block and none is free, the newest running request is preempted:
its blocks are freed and it goes back to the front of the queue, to be recomputed (its full blocks
usually come back from the prefix cache).

Admission keeps room for growth (GrowthReserve), so that a full queue does not turn into a cycle of
admissions and preemptions: a waiting request is admitted only while the free blocks also cover
every running request's (and its own) next `ratio` x remaining output tokens.
"""

from __future__ import annotations

import math
from collections import deque

from tpfuse.engine.batch import Ban, Batch
from tpfuse.engine.block_manager import BlockManager
from tpfuse.engine.sequence import Sequence, SequenceStatus


class GrowthReserve:
    """The share of each request's remaining output tokens that admission keeps KV room for. It
    adapts: it starts at `init`, decays by `decay` a step towards `minimum` (requests usually end
    before max_tokens), and each preemption (the reserve was too small) moves it half way to 1."""

    def __init__(self, init: float = 0.7, minimum: float = 0.1, decay: float = 0.001):
        self.ratio, self.minimum, self.decay = init, minimum, decay

    def step(self) -> None:
        self.ratio = max(self.minimum, self.ratio - self.decay)

    def preempted(self) -> None:
        self.ratio = (1.0 + self.ratio) / 2

    def tokens(self, remaining: int) -> int:
        return math.ceil(self.ratio * max(remaining, 0))


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_running_requests: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: set[int],
        num_lookahead_tokens: int = 0,
        max_prefill_tokens_per_step: int | None = None,
        growth_reserve: GrowthReserve | None = None,
    ):
        """num_lookahead_tokens: speculative decoding's draft tokens; a decode reserves KV blocks for
        that many positions past its newest token and takes 1 + that many tokens of the budget.
        max_prefill_tokens_per_step: prompt tokens one step may carry (None: the whole budget).
        growth_reserve: admission's room for growth (None: admit whatever prompt fits)."""
        self.block_manager = block_manager
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_running_requests = max_running_requests
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens_per_step = max_prefill_tokens_per_step or max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.growth_reserve = growth_reserve
        # Free token-table entries (a running request's newest token on the device), the last freed on top.
        self._free_slots = list(range(max_running_requests - 1, -1, -1))

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch | None:
        """The next step's batch, or None when nothing can run."""
        budget = self.max_num_batched_tokens
        ahead = self.num_lookahead_tokens
        decode_tokens = sum(1 + ahead for seq in self.running if seq.num_uncomputed_tokens == 1)
        prefill = min(self.max_prefill_tokens_per_step, max(budget - decode_tokens, 0))
        seqs: list[Sequence] = []
        counts: list[int] = []
        pending = deque(self.running)
        kept: list[Sequence] = []
        block_size = self.block_manager.block_size
        while pending and budget > 0:
            seq = pending.popleft()
            length = len(seq.token_ids)
            uncomputed = length - seq.num_computed_tokens
            if uncomputed > 1 and prefill == 0:  # a prompt chunk: none fits this step
                kept.append(seq)
                continue
            lookahead = ahead if uncomputed == 1 else 0  # decodes draft
            n = min(uncomputed, budget) if uncomputed == 1 else min(uncomputed, budget, prefill)
            if length + lookahead > len(seq.block_table) * block_size:  # it needs a new block
                while not self.block_manager.may_append(seq, lookahead):
                    victim = pending.pop() if pending else seq
                    self._preempt(victim)
                    if victim is seq:
                        break
                else:
                    self.block_manager.append_slot(seq, lookahead)
                if seq.status != SequenceStatus.RUNNING:
                    continue
            if uncomputed > 1:
                prefill -= n
            seqs.append(seq)
            counts.append(n)
            kept.append(seq)
            budget -= n + lookahead
        # Requests past the budget keep their place and run next step.
        self.running = kept + list(pending)
        for seq, n in self._admit(budget, prefill):
            seqs.append(seq)
            counts.append(n)
        if not seqs:
            return None
        return Batch(seqs, counts, self._bans(seqs, [seq.num_output_tokens for seq in seqs])).decodes_first()

    def _admit(self, budget: int, prefill: int) -> list[tuple[Sequence, int]]:
        """Admits waiting requests first come, first served while the token and prefill budgets,
        the running cap and the KV blocks allow; returns (sequence, prompt tokens this step)."""
        admitted = []
        reserve = None  # blocks the running requests' growth is expected to take
        while self.waiting and min(budget, prefill) > 0 and len(self.running) < self.max_running_requests:
            seq = self.waiting[0]
            if reserve is None:
                reserve = sum(self._growth_blocks(s) for s in self.running) if self.growth_reserve else 0
            own = self._growth_blocks(seq)
            alone = not self.running  # then its prompt fitting is enough
            if not self.block_manager.can_allocate(seq, keep_free=0 if alone else reserve + own):
                break
            reserve += own
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            seq.slot = self._free_slots.pop()
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget, prefill)
            admitted.append((seq, n))
            budget -= n
            prefill -= n
        return admitted

    def _growth_blocks(self, seq: Sequence) -> int:
        """KV blocks beyond seq's table that growth_reserve keeps for its remaining output tokens
        (a waiting sequence: beyond the blocks of its tokens so far)."""
        if self.growth_reserve is None:
            return 0
        length = len(seq.token_ids)
        remaining = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - length)
        expected = length + self.growth_reserve.tokens(remaining)
        return max(0, seq.num_blocks_for(expected) - max(len(seq.block_table), seq.num_blocks_for(length)))

    def _bans(self, seqs: list[Sequence], num_outputs: list[int]) -> dict[int, Ban]:
        """row -> its Ban while min_tokens is not reached (num_outputs: each row's output tokens
        before this step)."""
        bans = {}
        for row, (seq, num_output) in enumerate(zip(seqs, num_outputs, strict=True)):
            if seq.params.min_tokens and (ids := self.banned_token_ids(seq, num_output)):
                bans[row] = Ban(ids, seq.params.min_tokens - num_output)
        return bans

    def schedule_following(self, batch: Batch, plain: bool = False) -> Batch | None:
        """Overlap schedule: the batch schedule() would return once batch (launched, not yet
        postprocessed) is, taking every row of batch to go on (a row that batch's token finishes
        by a stop id or EOS rides along, its token discarded). Rows are planned from where batch
        leaves them (Batch.begins): a row batch samples decodes next from that token, which only the
        device knows yet; a prompt chunk continues; a row batch's token finishes by length is left
        out; waiting requests are admitted as schedule() would. Reserves the KV blocks it plans for.
        None when that batch cannot be planned now: decodes draft (speculative decoding, unless
        `plain`: the caller runs it as a plain decode), or a KV block would have to be freed
        (preemption runs in schedule())."""
        if self.num_lookahead_tokens and not plain:
            return None
        ends = {}  # row of batch -> the position after its chunk
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            if not seq.is_finished:
                ends[seq] = batch.begin(i) + n
        planned = []  # (seq, its first position next step, its length once batch's token is in)
        for seq in self.running:
            begin, length = seq.num_computed_tokens, len(seq.token_ids)
            if seq in ends:
                begin = ends[seq]
                if begin >= length:  # batch samples it
                    length += 1
                    num_output = length - seq.num_prompt_tokens
                    if num_output >= seq.params.max_tokens or length >= self.max_model_len:
                        continue  # batch's token finishes it
            planned.append((seq, begin, length))
        budget = self.max_num_batched_tokens
        decode_tokens = sum(1 for _, begin, length in planned if length - begin == 1)
        prefill = min(self.max_prefill_tokens_per_step, max(budget - decode_tokens, 0))
        rows, growing, new_blocks = [], [], 0  # growing: (seq, length) of rows that need a block
        for seq, begin, length in planned:
            if budget <= 0:
                break
            uncomputed = length - begin
            if uncomputed > 1 and prefill == 0:
                continue
            n = 1 if uncomputed == 1 else min(uncomputed, budget, prefill)
            if uncomputed > 1:
                prefill -= n
            budget -= n
            needed = seq.num_blocks_for(length) - len(seq.block_table)
            if needed > 0:
                new_blocks += needed
                growing.append((seq, length))
            rows.append((seq, begin, length, n))  # n: its tokens next step
        bm = self.block_manager
        if new_blocks > bm.num_free_blocks:
            return None
        for seq, length in growing:
            bm.append_slot(seq, length - len(seq.token_ids))
        seqs = [seq for seq, *_ in rows]
        counts = [n for *_, n in rows]
        begins = [begin for _, begin, _, _ in rows]
        outputs = [length - seq.num_prompt_tokens for seq, _, length, _ in rows]  # before this step's token
        for seq, n in self._admit(budget, prefill):
            seqs.append(seq)
            counts.append(n)
            begins.append(seq.num_computed_tokens)
            outputs.append(seq.num_output_tokens)
        if not seqs:
            return None
        return Batch(seqs, counts, self._bans(seqs, outputs), begins).decodes_first()

    def schedule_next_spec_decode(self, batch: Batch) -> Batch | None:
        """Chained speculative steps: the batch schedule() will return after batch, a speculative
        decode of every running request still in flight, when nothing arrives meanwhile, whatever
        number of drafts batch accepts. Its rows are batch's rows, in order, less those that finished
        while batch ran (they ride along in batch, their tokens discarded) and those that batch's
        token will finish (max_tokens). Reserves KV blocks for the largest case (batch emits
        1 + lookahead tokens, then the next step verifies 1 + lookahead positions). None when that
        batch cannot be known now: a request waits, a row is not a decode, a row could reach
        max_model_len within the two steps (its draft count would depend on what batch accepts), a
        row still bans ids (min_tokens), or blocks would have to be freed; and when no row is sure
        to outlive batch."""
        ahead = self.num_lookahead_tokens

        def tokens_left(seq: Sequence) -> int:  # before batch's tokens: batch emits 1 to 1 + ahead
            return seq.params.max_tokens - seq.num_output_tokens

        rows = [
            (s, n)
            for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
            if not s.is_finished and tokens_left(s) > 1
        ]
        running = [seq for seq in self.running if tokens_left(seq) > 1]  # none finished
        if self.waiting or not ahead or len(rows) != len(running):
            return None
        if all(tokens_left(s) <= 1 + ahead for s, _ in rows):
            return None  # every row may finish in batch: the step after would likely serve nobody
        if len(rows) * (1 + ahead) > self.max_num_batched_tokens:
            return None
        bm = self.block_manager
        new_blocks = 0
        reserve = 2 * ahead + 1  # positions past the newest: batch's emitted tokens, then k + 1 more
        for (seq, n), same in zip(rows, running, strict=True):
            length = len(seq.token_ids)
            if seq is not same or n != 1 or seq.num_computed_tokens + 1 != length:
                return None
            if self.max_model_len - length < 2 * (ahead + 1):
                return None
            if self._bans_before(seq, seq.num_output_tokens + 1):
                return None
            new_blocks += max(0, seq.num_blocks_for(length + reserve) - len(seq.block_table))
        if new_blocks > bm.num_free_blocks:
            return None
        seqs = [seq for seq, _ in rows]
        for seq in seqs:
            bm.append_slot(seq, reserve)
        return Batch(seqs, [1] * len(seqs))

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self._release_slot(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        if self.growth_reserve is not None:
            self.growth_reserve.preempted()

    def _bans_before(self, seq: Sequence, num_output: int) -> bool:
        """Whether seq still bans ids once it has num_output tokens: min_tokens not reached and some
        id to ban (min_tokens with ignore_eos and no stop ids bans nothing, so it chains; nor does a
        grammar's, see banned_token_ids)."""
        p = seq.params
        if num_output >= p.min_tokens or p.grammar is not None:
            return False
        return bool(p.stop_token_ids) or (not p.ignore_eos and bool(self.eos_token_ids))

    def banned_token_ids(self, seq: Sequence, num_output: int | None = None) -> list[int]:
        """Tokens that must not be sampled next: end-of-sequence and stop ids before min_tokens.
        num_output: seq's output tokens before that token (default: those it has now). None for a
        grammar-constrained request: its grammar alone decides where the answer ends."""
        p = seq.params
        if (
            p.grammar is not None
            or (seq.num_output_tokens if num_output is None else num_output) >= p.min_tokens
        ):
            return []
        banned = set(p.stop_token_ids)
        if not p.ignore_eos:
            banned |= self.eos_token_ids
        return sorted(banned)

    def postprocess(self, batch: Batch, sampled: list[int | None]) -> list[Sequence]:
        """postprocess_multi for one sampled token per row (None where the row did not sample);
        returns the sequences that got a token."""
        emitted = [None if token is None else [token] for token in sampled]
        return [seq for seq, _ in self.postprocess_multi(batch, emitted)]

    def postprocess_multi(
        self, batch: Batch, emitted: list[list[int] | None]
    ) -> list[tuple[Sequence, list[int]]]:
        """Every step: emitted[i] are the tokens seqs[i] gets this step (None: none; a plain step or
        a prefill row: one). Each sequence advances by its chunk, and a decode that emits a + 1
        tokens had a drafts accepted, whose KV is valid too, so it advances by a + 1. Tokens are
        appended one at a time and the first that finishes the sequence (stop token, EOS,
        max_tokens, max_model_len) ends the run. Newly full computed blocks join the prefix cache
        (with one token or none before it is appended, so also when it finishes the sequence; with
        accepted drafts after they are appended). Returns (sequence, tokens it got) pairs; a sequence
        that finished (or was aborted) after batch was launched ahead gets nothing."""
        if self.growth_reserve is not None:
            self.growth_reserve.step()  # once per step run, whichever schedule planned it
        updated = []
        bm = self.block_manager
        sealing, block_size = bm.enable_prefix_caching, bm.block_size
        for seq, n, tokens in zip(batch.seqs, batch.num_new_tokens, emitted, strict=True):
            if seq.is_finished:
                continue
            if not tokens or len(tokens) == 1:  # no drafts accepted: every plain step's rows
                seq.num_computed_tokens += n
                if sealing and seq.num_computed_tokens // block_size > len(seq.block_hashes):
                    bm.seal_computed_blocks(seq)
                if tokens:
                    token = tokens[0]
                    seq.token_ids.append(token)
                    updated.append((seq, tokens))
                    reason = self._finish_reason(seq, token)
                    if reason is not None:
                        self.finish(seq, reason)
                continue
            seq.num_computed_tokens += n + len(tokens) - 1
            taken = []
            for token in tokens:
                seq.token_ids.append(token)
                taken.append(token)
                reason = self._finish_reason(seq, token)
                if reason is not None:
                    self.finish(seq, reason)
                    break
            # Accepted drafts' positions are computed, but their ids were appended only now.
            if sealing and seq.num_computed_tokens // block_size > len(seq.block_hashes):
                bm.seal_computed_blocks(seq)
            updated.append((seq, taken))
        return updated

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        length = len(seq.token_ids)
        num_output = length - seq.num_prompt_tokens
        if num_output >= p.min_tokens and (
            token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)
        ):
            return "stop"
        if num_output >= p.max_tokens or length >= self.max_model_len:
            return "length"
        return None

    def _release_slot(self, seq: Sequence) -> None:
        """Returns seq's token-table entry. A step launched before may still write it: steps run in
        launch order on the device, so a request given the entry next writes it later."""
        self._free_slots.append(seq.slot)
        seq.slot = None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Ends seq (any queue) and frees its blocks."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release_slot(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
