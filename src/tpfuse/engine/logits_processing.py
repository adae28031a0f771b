"""Per-request logits processing on rank 0's sampling path: penalties, logit_bias, grammar masks
(xgrammar) and logprobs.

The runner asks `needed(batch)` at each launch; it is False unless a sampled row's params need
processing (`SamplingParams.needs_logits_processing`; the engine registers those at admission, so
while none is alive plain batches pay one dictionary check per step). Otherwise the step's forward
is launched alone, and its token choice is enqueued once the step before it has been read
(runner.ProcessedStep): `apply(logits)` edits the logits of the sampled rows [N, V] float32 in
place, in this order: raw log-probabilities kept for logprobs, repetition penalty (over prompt
and output, HF's rule: positive logits divided, negative multiplied), presence and frequency
penalties (over output tokens, OpenAI's rule), logit_bias (these three for the whole batch at once,
engine/penalties.py), and the grammar mask (filled on xgrammar's thread pool; disallowed tokens
to -inf; once the grammar is complete, or allows no token at all (an unsatisfiable schema), only
end-of-sequence ids remain; the scheduler gives grammar rows no min_tokens bans: the grammar
decides where the answer ends); then `record(tokens)` keeps
each logprobs row's chosen and top log-probabilities on the device and `settle()` stores them
once the step is read. Logprobs are those of the model (log_softmax of the raw logits, before any
processing or temperature), as vLLM reports them by default.

Grammar matchers follow each sequence's output tokens lazily (they accept the tokens appended since
the last step before the mask is filled), so they need no hook in postprocessing: the mask of step
n + 1 is filled on the host while its forward runs, after step n's tokens are read. Per-sequence
state lives in a WeakKeyDictionary: it goes with the Sequence.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from tpfuse.engine.grammar_compiler import GrammarCompiler
from tpfuse.engine.grammar_vocab import SURROGATE_WORD
from tpfuse.engine.penalties import TokenHistory, apply_penalties, needs_penalties
from tpfuse.engine.step_upload import upload


@dataclass(slots=True)
class TokenLogprobs:
    """One generated token's log-probability and the top ones at its position (most likely first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class _SequenceState:
    def __init__(self, matcher, history):
        self.matcher = matcher  # xgrammar.GrammarMatcher or None
        self.num_accepted = 0  # output tokens the matcher has consumed
        self.history = history  # TokenHistory when the params ask for a penalty, else None
        self.logprobs: list[TokenLogprobs] = []


class LogitsProcessing:
    """Rank 0's processing state for one engine. tokenizer: the engine's (its vocabulary feeds the
    grammar compiler); eos_token_ids: the tokens that end a grammar's output."""

    def __init__(self, vocab_size: int, tokenizer, eos_token_ids):
        from tpfuse.engine.grammar_vocab import grammar_vocab_size, surrogate_lead

        self.vocab_size = vocab_size
        self.grammar_vocab_size = grammar_vocab_size(tokenizer, vocab_size)  # ids past it: never allowed
        self.surrogate_lead = surrogate_lead(tokenizer)
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.grammars = GrammarCompiler(self._xgrammar_compiler)
        self._batch_matcher = None  # xgrammar.BatchGrammarMatcher: fills a batch's masks on threads

    def check(self, params) -> None:
        """Raises GrammarError (a ValueError) naming the problem when params' grammar does not compile."""
        if params.grammar is not None:
            self.grammars.compile(params.grammar)

    def _xgrammar_compiler(self):
        import xgrammar

        from tpfuse.engine.grammar_vocab import tokenizer_info

        info = tokenizer_info(self.tokenizer, self.grammar_vocab_size, self.eos_token_ids)
        return xgrammar.GrammarCompiler(info)

    def _state(self, seq) -> _SequenceState:
        state = self._states.get(seq)
        if state is None:
            matcher = None
            if seq.params.grammar is not None:
                import xgrammar

                matcher = xgrammar.GrammarMatcher(self.grammars.compile(seq.params.grammar))
            history = TokenHistory() if needs_penalties(seq.params) else None
            state = self._states[seq] = _SequenceState(matcher, history)
        return state

    def batch_matcher(self):
        if self._batch_matcher is None:
            import xgrammar

            self._batch_matcher = xgrammar.BatchGrammarMatcher()
        return self._batch_matcher

    @property
    def active(self) -> bool:
        """Whether any registered sequence is alive (else no batch needs processing)."""
        return bool(self._states)

    def register(self, seq) -> None:
        """Called at admission for a sequence whose params need processing (after check)."""
        self._state(seq)

    def needed(self, batch) -> bool:
        """Whether a sampled row of batch needs processing (at once False when no registered
        sequence is alive, so plain traffic never walks the batch)."""
        return bool(self._states) and any(
            seq.params.needs_logits_processing and batch.samples(i) for i, seq in enumerate(batch.seqs)
        )

    def for_batch(self, batch) -> BatchProcessing | None:
        """The processing of batch's sampled rows, or None when none needs any (see needed)."""
        if not self.needed(batch):
            return None
        return BatchProcessing(self, [seq for i, seq in enumerate(batch.seqs) if batch.samples(i)])

    def pop_logprobs(self, seq) -> list[TokenLogprobs]:
        """The logprobs recorded for seq since the last call (oldest first)."""
        state = self._states.get(seq)
        if state is None:
            return []
        taken, state.logprobs = state.logprobs, []
        return taken


class BatchProcessing:
    """One step's processing; seqs[j] owns row j of the sampled logits."""

    def __init__(self, owner: LogitsProcessing, seqs: list):
        self.owner = owner
        self.seqs = seqs
        self.grammar_rows = [j for j, s in enumerate(seqs) if s.params.grammar is not None]
        self._logprob_rows: list[int] = []
        self._logprobs: torch.Tensor | None = None
        self._top: tuple[torch.Tensor, torch.Tensor] | None = None
        self._table: torch.Tensor | None = None  # record's logprobs, on their way to the host

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Edits logits [N, V] float32 (row j: seqs[j]) in place and returns it."""
        seqs = self.seqs
        self._logprob_rows = [j for j, s in enumerate(seqs) if s.params.logprobs is not None]
        if self._logprob_rows:
            index = upload(self._logprob_rows, logits.device)
            self._logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
            k = max(seqs[j].params.logprobs for j in self._logprob_rows)
            if k:
                self._top = self._logprobs.topk(min(k, logits.shape[-1]), dim=-1)
        penalized = []
        for j, seq in enumerate(seqs):
            p = seq.params
            if p.logit_bias or needs_penalties(p):
                state = self.owner._state(seq)
                if state.history is not None:
                    state.history.update(seq)
                penalized.append((j, seq, state.history))
        if penalized:
            apply_penalties(logits, penalized)
        if self.grammar_rows:
            self._mask(logits, self.grammar_rows)
        return logits

    def _mask(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Grammar masks of rows, filled on the host into one bitmask (xgrammar's threads), applied in
        one pass."""
        import xgrammar

        vocab = self.owner.grammar_vocab_size  # the ids past it are never allowed
        bitmask = xgrammar.allocate_token_bitmask(len(rows), vocab)  # all allowed
        complete = []  # rows whose grammar has accepted its stop token
        live, live_rows = [], []  # the other rows' matchers and bitmask rows
        for r, j in enumerate(rows):
            seq = self.seqs[j]
            state = self.owner._state(seq)
            outputs = seq.output_token_ids
            for token in outputs[state.num_accepted :]:
                if not state.matcher.is_terminated():
                    state.matcher.accept_token(token)
            state.num_accepted = len(outputs)
            if state.matcher.is_terminated():
                complete.append(j)  # xgrammar fills no mask once terminated
            else:
                live.append(state.matcher)
                live_rows.append(r)
        if live:
            self.owner.batch_matcher().batch_fill_next_token_bitmask(live, bitmask, live_rows)
            lead = self.owner.surrogate_lead
            for r in live_rows if lead is not None else ():
                outputs = self.seqs[rows[r]].output_token_ids
                if outputs and outputs[-1] == lead:
                    bitmask[r, SURROGATE_WORD] = 0  # grammar_vocab.surrogate_lead
            stuck = ~_allows_any(bitmask[live_rows], vocab)  # an unsatisfiable schema: nothing fits
            complete += [rows[live_rows[i]] for i in stuck.nonzero().flatten().tolist()]
        index = upload(rows, logits.device)
        allowed = _unpack_bitmask(upload(bitmask, logits.device, torch.int32), vocab)
        masked = logits.index_select(0, index)
        masked[:, :vocab].masked_fill_(~allowed, float("-inf"))
        masked[:, vocab:] = float("-inf")
        logits.index_copy_(0, index, masked)
        if complete:
            # A complete answer admits only an end-of-sequence token (ignore_eos or min_tokens keep
            # such a request sampling): every other logit -inf, the end ids a finite 0. So does an
            # answer no token can continue: it ends where it stands.
            done = upload(complete, logits.device)
            ends = upload(self.owner.eos_token_ids, logits.device)
            logits.index_fill_(0, done, float("-inf"))
            logits[done[:, None], ends[None, :]] = 0.0

    @torch.inference_mode()
    def record(self, tokens: torch.Tensor) -> None:
        """After sampling: each logprobs row's chosen id and log-probability and its top ones (tokens
        [N] int64, row j: seqs[j]) as one float64 table [R, 2 + 2k] (ids are exact in float64),
        copied to the host behind the step's ids; `settle` stores them once the step is read."""
        if not self._logprob_rows:
            return
        index = upload(self._logprob_rows, tokens.device)
        chosen_ids = tokens.index_select(0, index)
        columns = [chosen_ids[:, None], self._logprobs.gather(1, chosen_ids[:, None])]
        if self._top is not None:
            columns += [self._top.values, self._top.indices]
        table = torch.cat([c.double() for c in columns], dim=1)
        if table.is_cuda:
            host = torch.empty(table.shape, dtype=table.dtype, pin_memory=True)
            table = host.copy_(table, non_blocking=True)
        self._table = table

    def settle(self) -> None:
        """After the step's tokens are read (so record's copy has landed too): appends each logprobs
        row's TokenLogprobs to its sequence."""
        if not self._logprob_rows or self._table is None:
            return
        rows, self._table = self._table.tolist(), None
        for row, j in zip(rows, self._logprob_rows, strict=True):
            seq = self.seqs[j]
            k = seq.params.logprobs
            width = (len(row) - 2) // 2
            top = [(int(row[2 + width + i]), row[2 + i]) for i in range(k)] if k else []
            self.owner._state(seq).logprobs.append(TokenLogprobs(int(row[0]), row[1], top))


def _allows_any(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """Whether each row of xgrammar's packed bitmask [R, ceil(V/32)] int32 allows one of ids < vocab."""
    full, rest = divmod(vocab, 32)
    allowed = (words[:, :full] != 0).any(dim=1)
    if rest:
        allowed |= (words[:, full] & ((1 << rest) - 1)) != 0
    return allowed


def _unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """xgrammar's packed bitmask [R, ceil(V/32)] int32 (bit b of word w: token 32 w + b) -> bool [R, V]."""
    bits = torch.arange(32, device=words.device, dtype=torch.int32)
    return ((words[:, :, None] >> bits) & 1).bool().reshape(words.shape[0], -1)[:, :vocab]
