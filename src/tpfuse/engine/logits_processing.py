"""Per-request logits processing on rank 0's sampling path: penalties, logit_bias, grammar masks
(xgrammar) and logprobs.

The runner asks `for_batch(batch)` at each launch; it returns None unless some sequence's params
need processing (`SamplingParams.needs_logits_processing`; the engine registers those at admission,
so while none is alive plain batches pay one dictionary check per step). Otherwise the step takes
the eager sampling path: `apply(logits)` edits the logits of the sampled rows [N, V] float32 in
place, in this order: raw log-probabilities kept for logprobs, repetition penalty (over prompt
and output, HF's rule: positive logits divided, negative multiplied), presence and frequency
penalties (over output tokens, OpenAI's rule), logit_bias, and the grammar mask (disallowed tokens
to -inf; once the grammar is complete only end-of-sequence ids remain; min_tokens bans do not
apply to grammar rows: the grammar decides where the answer ends); then `record(tokens)` stores
each logprobs row's chosen and top log-probabilities. Logprobs are those of the model (log_softmax
of the raw logits, before any processing or temperature), as vLLM reports them by default.

Grammar matchers follow each sequence's output tokens lazily (they accept the tokens appended since
the last step before the mask is filled), so they need no hook in postprocessing; the engine does
not overlap steps whose batch holds processed sequences, since the mask of step n + 1 depends on
the token of step n. Per-sequence state lives in a WeakKeyDictionary: it goes with the Sequence.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from tpfuse.engine.sampling_params import Grammar

GRAMMAR_CACHE_SIZE = 64


@dataclass(slots=True)
class TokenLogprobs:
    """One generated token's log-probability and the top ones at its position (most likely first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


class _SequenceState:
    def __init__(self, matcher):
        self.matcher = matcher  # xgrammar.GrammarMatcher or None
        self.num_accepted = 0  # output tokens the matcher has consumed
        self.logprobs: list[TokenLogprobs] = []


class LogitsProcessing:
    """Rank 0's processing state for one engine. tokenizer: the engine's (its vocabulary feeds the
    grammar compiler); eos_token_ids: the tokens that end a grammar's output."""

    def __init__(self, vocab_size: int, tokenizer, eos_token_ids):
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(eos_token_ids)
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._compiler = None
        self._compiled: OrderedDict = OrderedDict()

    def check(self, params) -> None:
        """Raises ValueError naming the problem when params' grammar does not compile."""
        if params.grammar is not None:
            self._compile(params.grammar)

    def _compile(self, grammar: Grammar):
        key = (grammar.kind, grammar.spec)
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        compiler = self._grammar_compiler()
        try:
            if grammar.kind == "json_schema":
                compiled = compiler.compile_json_schema(grammar.spec, any_whitespace=False)
            elif grammar.kind == "ebnf":
                compiled = compiler.compile_grammar(grammar.spec)
            else:
                raise ValueError(f"unknown grammar kind {grammar.kind!r}")
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"the {grammar.kind} grammar does not compile: {exc}") from None
        self._compiled[key] = compiled
        if len(self._compiled) > GRAMMAR_CACHE_SIZE:
            self._compiled.popitem(last=False)
        return compiled

    def _grammar_compiler(self):
        if self._compiler is None:
            import xgrammar

            from tpfuse.engine.grammar_vocab import tokenizer_info

            info = tokenizer_info(self.tokenizer, self.vocab_size, self.eos_token_ids)
            self._compiler = xgrammar.GrammarCompiler(info)
        return self._compiler

    def _state(self, seq) -> _SequenceState:
        state = self._states.get(seq)
        if state is None:
            matcher = None
            if seq.params.grammar is not None:
                import xgrammar

                matcher = xgrammar.GrammarMatcher(self._compile(seq.params.grammar))
            state = self._states[seq] = _SequenceState(matcher)
        return state

    @property
    def active(self) -> bool:
        """Whether any registered sequence is alive (else no batch needs processing)."""
        return bool(self._states)

    def register(self, seq) -> None:
        """Called at admission for a sequence whose params need processing (after check)."""
        self._state(seq)

    def for_batch(self, batch) -> BatchProcessing | None:
        """The processing of batch's sampled rows, or None when none needs any (at once when no
        registered sequence is alive, so plain traffic never walks the batch)."""
        if not self._states or not any(seq.params.needs_logits_processing for seq in batch.seqs):
            return None
        rows = []
        for i, seq in enumerate(batch.seqs):
            if batch.samples(i):
                rows.append(seq)
        return BatchProcessing(self, rows)

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

    @torch.inference_mode()
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Edits logits [N, V] float32 (row j: seqs[j]) in place and returns it."""
        seqs = self.seqs
        self._logprob_rows = [j for j, s in enumerate(seqs) if s.params.logprobs is not None]
        if self._logprob_rows:
            index = torch.tensor(self._logprob_rows, device=logits.device)
            self._logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
            k = max(seqs[j].params.logprobs for j in self._logprob_rows)
            if k:
                self._top = self._logprobs.topk(min(k, logits.shape[-1]), dim=-1)
        for j, seq in enumerate(seqs):
            p = seq.params
            if not p.needs_logits_processing:
                continue
            if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
                _penalize(logits[j], seq, p)
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), device=logits.device)
                bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
                logits[j].index_add_(0, ids, bias)
        if self.grammar_rows:
            self._mask(logits, self.grammar_rows)
        return logits

    def _mask(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Grammar masks of rows, filled on the host into one bitmask, applied in one pass."""
        import xgrammar

        vocab = logits.shape[-1]
        bitmask = xgrammar.allocate_token_bitmask(len(rows), vocab)
        complete = []  # rows whose grammar has accepted its stop token
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
                state.matcher.fill_next_token_bitmask(bitmask, r)
        index = torch.tensor(rows, device=logits.device)
        allowed = _unpack_bitmask(bitmask.to(logits.device, non_blocking=True), vocab)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill(~allowed, float("-inf")))
        if complete:
            # A complete answer admits only an end-of-sequence token (ignore_eos or min_tokens keep
            # such a request sampling): every other logit -inf, the end ids a finite 0.
            done = torch.tensor(complete, device=logits.device)
            ends = torch.tensor(self.owner.eos_token_ids, device=logits.device)
            logits.index_fill_(0, done, float("-inf"))
            logits[done[:, None], ends[None, :]] = 0.0

    @torch.inference_mode()
    def record(self, tokens: torch.Tensor | None) -> None:
        """After sampling: stores each logprobs row's TokenLogprobs (tokens [N] int64, row j: seqs[j])."""
        if not self._logprob_rows or tokens is None:
            return
        index = torch.tensor(self._logprob_rows, device=tokens.device)
        chosen_ids = tokens.index_select(0, index)
        chosen = self._logprobs.gather(1, chosen_ids[:, None])[:, 0].tolist()
        top_values, top_ids = self._top if self._top is not None else (None, None)
        top_values = top_values.tolist() if top_values is not None else None
        top_ids = top_ids.tolist() if top_ids is not None else None
        for r, j in enumerate(self._logprob_rows):
            seq = self.seqs[j]
            k = seq.params.logprobs
            top = list(zip(top_ids[r][:k], top_values[r][:k], strict=True)) if k else []
            state = self.owner._state(seq)
            state.logprobs.append(TokenLogprobs(int(chosen_ids[r]), chosen[r], top))


def _penalize(row: torch.Tensor, seq, p) -> None:
    """row [V] in place: repetition penalty over every token of seq, presence/frequency over its output."""
    device = row.device
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), device=device)
        values = row.index_select(0, seen)
        penalized = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        row.index_copy_(0, seen, penalized)
    outputs = seq.output_token_ids
    if outputs and (p.presence_penalty or p.frequency_penalty):
        counts = torch.bincount(torch.tensor(outputs, device=device), minlength=row.shape[0])[: row.shape[0]]
        counts = counts.to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def _unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """xgrammar's packed bitmask [R, ceil(V/32)] int32 (bit b of word w: token 32 w + b) -> bool [R, V]."""
    bits = torch.arange(32, device=words.device, dtype=torch.int32)
    return ((words[:, :, None] >> bits) & 1).bool().reshape(words.shape[0], -1)[:, :vocab]
