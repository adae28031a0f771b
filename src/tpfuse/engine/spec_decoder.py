"""Rank 0's half of a speculative step: choose k, draft on the host (n-gram), pack, verify, account.

SpeculativeSteps (spec_steps.py) launches each speculative step with `SpecDecoder.launch(batch, ...)`,
and `wait(pending)` returns the tokens each sequence gets from that step: one sampled token for
a prefill row that reached its end, the accepted drafts plus one target token for a decode (verify)
row, None otherwise. Verification is greedy (temperature 0) or rejection sampling, both lossless;
with --speculative-simulate-acceptance-length it is the benchmark-only simulation (spec/simulate.py);
the verification itself is spec_verify.py's (chains) and spec_tree_step.py's (trees). The chosen
tokens reach the other ranks as input ids of the next packed step. With EAGLE-3 chain drafting the
next step is launched before this one is read (spec_chain.py).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

import torch

from tpfuse.config import EngineConfig
from tpfuse.engine.batch import Batch
from tpfuse.engine.cuda_graphs import graph_batch_sizes
from tpfuse.engine.spec_chain import ChainLink, continued_rows, template_batch
from tpfuse.engine.spec_forward import step_executor
from tpfuse.engine.spec_inputs import pack_spec_step
from tpfuse.engine.spec_rows import draft_limit, is_decode_row, lags_after_plain_steps
from tpfuse.engine.spec_stats import SpecStats
from tpfuse.engine.spec_tree_step import TreeKvMoves, verify_tree
from tpfuse.engine.spec_verify import chain_verifier, verify_chain
from tpfuse.engine.spec_worker import worker_of
from tpfuse.engine.step_inputs import row_seed
from tpfuse.engine.token_readback import PendingStep, TokenReadback
from tpfuse.spec.adaptive import AdaptivePolicy
from tpfuse.spec.ngram import propose_ngram
from tpfuse.spec.seeded_random import uniform
from tpfuse.spec.simulate import SIMULATED_ACCEPTANCE_NOTICE
from tpfuse.spec.tree_verify import TreeVerifyResult
from tpfuse.spec.verify import STREAM_SEEDED, VerifyResult, sample_inverse_cdf, target_probs


@dataclass
class SpecPending:
    """A launched speculative step whose results are on their way to the host."""

    batch: Batch
    num_draft_tokens: int  # k of the step
    decode_rows: list[int]  # the batch rows that verify
    sampled: list[int]  # the sampled ids of the prefill rows that reached their end, in row order
    pure_decode: bool
    timed: bool  # its time tells the policy what a decode step of its k costs
    catch_up: bool  # a k = 0 step run so the drafters catch up (not timed as a k = 0 step)
    result: VerifyResult | TreeVerifyResult | None = None  # device result of the verify rows
    readback: PendingStep | None = None  # [accepted, drafts, emitted ids...] per verify row


class SpecDecoder:
    """config: the engine settings; executor: ModelRunner or TensorParallelExecutor (its rank-0
    `runner` built with spec_worker.speculative_hook); max_model_len: the engine's."""

    def __init__(self, config: EngineConfig, executor, max_model_len: int):
        spec = config.speculative
        self.execute_spec = step_executor(executor)  # (packed, link) -> SpecForward, every rank
        self.runner = executor.runner
        self.block_size = config.block_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = max_model_len
        self.max_num_draft_tokens = spec.num_steps
        self.ngram = spec.algorithm == "ngram"
        graphs = self.runner.graphs
        buckets = (
            graphs.sizes
            if graphs is not None
            else graph_batch_sizes(min(config.cuda_graph_max_bs, config.max_running_requests))
        )
        self.policy_buckets = buckets
        window_drafter = worker_of(self.runner).window_drafter
        self.ext_window = window_drafter.window if window_drafter is not None else 0
        self.tree = spec.eagle_topk > 1
        self.num_tree_nodes = spec.num_draft_tokens
        self.kv_moves = TreeKvMoves(config.block_size)  # tree drafting's accepted-path KV moves
        if self.tree and spec.adaptive:
            print(
                "tpfuse: adaptive speculation is off with tree drafting (--speculative-eagle-topk > 1): "
                f"every decode step verifies a tree of {spec.num_draft_tokens} nodes",
                file=sys.stderr,
                flush=True,
            )
        adaptive = spec.adaptive and not self.tree
        self.policy = AdaptivePolicy(spec.num_steps, buckets) if adaptive else None
        if spec.simulate_acceptance_length is not None and self.tree:
            raise ValueError("--speculative-simulate-acceptance-length supports chain drafting only")
        self.verifier = chain_verifier(spec)
        if self.verifier.simulated:
            print(f"tpfuse: WARNING: {SIMULATED_ACCEPTANCE_NOTICE}", file=sys.stderr, flush=True)
        self.stats = SpecStats(spec.num_steps)
        self.readback = TokenReadback(self.runner.device)
        self.current_num_draft_tokens = spec.num_steps
        self._chosen: tuple[int, int] | None = None  # (rows, k) chosen ahead for the coming run()
        self._timed_step: tuple[int, int] | None = None  # (decode rows, k) of the step being timed
        self._timed_catch_up: int | None = None  # decode rows of the catch-up step being timed
        self._last_step_done: float | None = None  # when the last step (plain or speculative) completed
        self._after_catch_up: int | None = None  # k chosen for a step that had to catch up first

    def choose_num_draft_tokens(self, num_decode: int) -> int:
        if num_decode == 0:
            return 0
        if self.tree:
            return self.num_tree_nodes - 1
        if self.policy is None:
            return self.max_num_draft_tokens
        if self._after_catch_up is not None:  # the choice a catch-up step put off (a probe, say)
            k, self._after_catch_up = self._after_catch_up, None
            return k
        return self.policy.choose(num_decode)

    def chooses_plain_decode(self, batch: Batch) -> bool:
        """Adaptive policy only: whether the policy gives this all-decode batch k = 0, so the engine
        runs it as a plain decode (no drafter work; the drafter catches up when drafting resumes).
        Otherwise the chosen k is kept for the launch() of this batch. Asked again before that run (the
        engine asks while the step before runs, to launch this one early, and again when it
        schedules it), it answers from the kept choice: the policy decides once per step (a second
        choose() would tick its clocks twice and undo a refresh it had started). A seeded sampled
        row keeps every step speculative: its tokens come from seeded_sample_verify's stream, not
        the plain sampler's."""
        rows = len(batch.seqs)
        if self.policy is None or self.tree or not all(map(is_decode_row, batch.seqs, batch.num_new_tokens)):
            return False
        if any(s.params.seed is not None and s.params.temperature > 0.0 for s in batch.seqs):
            return False
        if self._kept_choice(rows):
            return False
        self._chosen = None  # taken by the plain step
        self.current_num_draft_tokens = 0
        return True

    def _kept_choice(self, num_decode: int) -> int:
        """The k chosen for the coming step of num_decode rows: the one kept from an earlier question
        about that step, else the policy's choice, kept until a launch (or plain step) takes it."""
        if self._chosen is None or self._chosen[0] != num_decode:
            self._chosen = (num_decode, self.choose_num_draft_tokens(num_decode))
        return self._chosen[1]

    def plain_step_finished(self, num_rows: int, chained: bool, own_seconds: float) -> None:
        """A plain decode step of num_rows rows completed. When it was chained (launched while the
        previous plain step ran) its cost is the time since that one completed: steps overlap, so that
        gap is what one more step costs. An unchained step (the first after speculative steps, or a
        lone k = 0 step the policy runs to re-measure k = 0) costs its own wall time, own_seconds,
        scheduling to completion: the gap since the last plain step would hold the steps between."""
        now = time.perf_counter()
        if self.policy is not None:
            if chained and self._last_step_done is not None:
                self.policy.record_step(num_rows, 0, now - self._last_step_done)
            elif not chained:
                self.policy.record_step(num_rows, 0, own_seconds)
        self._last_step_done = now

    def step_finished(self, seconds: float, chained: bool = False) -> None:
        """A speculative step completed; seconds: the engine's wall time of it, scheduling and
        postprocessing included. A chained step (launched while the one before ran) costs, as a
        chained plain step does, the time since that one completed."""
        now = time.perf_counter()
        if chained and self._last_step_done is not None:
            seconds = now - self._last_step_done
        self._last_step_done = now
        if self.policy is not None:
            if self._timed_step is not None:
                self.policy.record_step(*self._timed_step, seconds)
            elif self._timed_catch_up is not None:
                self.policy.record_catch_up(self._timed_catch_up, seconds)
        self._timed_step = self._timed_catch_up = None

    def chained_num_draft_tokens(self, batch: Batch) -> int | None:
        """The k of a chained launch of batch (the step after one in flight, see spec_chain.py), or
        None when batch cannot be chained: no window drafter, a row that samples (only greedy
        verification or the simulation keeps the template's inputs independent of acceptance), or a
        k of 0 (that step runs plain). The chosen k is kept for whichever launch runs batch."""
        if not self.ext_window or self.tree:
            return None
        if not self.verifier.simulated and any(s.params.temperature > 0.0 for s in batch.seqs):
            return None
        return self._kept_choice(len(batch.seqs)) or None

    def launch(self, batch: Batch, engine_seed: int, previous: SpecPending | None = None) -> SpecPending:
        """Enqueues one speculative step of batch (drafting, the target's forward, verification) and
        the copy of its results to the host; returns without waiting for them (see wait).
        previous: the step in flight before batch; batch is then packed as a template that the
        device shifts by previous's accepted counts (spec_chain.py: the caller checked
        chained_num_draft_tokens and scheduled batch with schedule_next_spec_decode)."""
        decode_rows = [i for i, n in enumerate(batch.num_new_tokens) if is_decode_row(batch.seqs[i], n)]
        k, catch_up = self._take_num_draft_tokens(batch, len(decode_rows), chained=previous is not None)
        host_drafts = None
        if self.ngram:
            host_drafts = {}
            for row in decode_rows:
                seq = batch.seqs[row]
                host_drafts[row] = propose_ngram(seq.token_ids, draft_limit(seq, k, self.max_model_len))
        pure_decode = len(decode_rows) == len(batch.seqs)
        graphs = self.runner.graphs
        pad_to = graphs.bucket(len(batch.seqs)) if graphs is not None and pure_decode else None
        packed = pack_spec_step(
            batch if previous is None else template_batch(batch),
            self.block_size,
            engine_seed,
            k,
            self.max_model_len,
            host_drafts=host_drafts,
            extend_drafter=not self.ngram,
            pad_to=None if self.tree else pad_to,
            tree_depth=self.max_num_draft_tokens if self.tree else None,
            kv_moves=self.kv_moves.take(batch) if self.tree else None,
            ext_window=self.ext_window,
            catch_up_budget=self.max_num_batched_tokens,
        )
        link = None
        if previous is not None:
            rows = continued_rows(previous.batch, batch)
            link = ChainLink(previous.result, previous.num_draft_tokens, rows)
        forward = self.execute_spec(packed, link)
        sampled = []
        if forward.sample_logits is not None:
            sampled = self.runner.sample(forward.step, forward.sample_logits)
            sampled = seeded_prompt_tokens(batch, decode_rows, engine_seed, forward.sample_logits, sampled)
        # With a window drafter, a drafting step outside the window (a row's first decode after its
        # prefill: the drafter extends over the whole prompt, eagerly) says nothing about what the
        # next decode steps cost, so the policy is not told its time.
        one_off = bool(self.ext_window and k and not forward.spec.header.ext_window)
        pending = SpecPending(batch, k, decode_rows, sampled, pure_decode, not one_off, catch_up)
        if decode_rows:
            self._verify_and_start_readback(pending, forward)
        return pending

    def _take_num_draft_tokens(self, batch: Batch, num_decode: int, chained: bool) -> tuple[int, bool]:
        """(k, catch_up) of the step being launched: the k kept for it or the policy's; k = 0 and
        catch_up when the drafters first have to catch up after plain steps (never in a chained
        step: its rows drafted in the step before)."""
        chosen, self._chosen = self._chosen, None
        if chosen is not None and chosen[0] == num_decode:
            k = chosen[1]
        else:
            k = self.choose_num_draft_tokens(num_decode)
        catch_up = (
            not chained and bool(k) and self.ext_window > 0 and lags_after_plain_steps(batch, self.ext_window)
        )
        if catch_up:
            self._after_catch_up, k = k, 0  # drafting resumes next step, inside the window graphs
        if num_decode:
            self.current_num_draft_tokens = k
        return k, catch_up

    def _verify_and_start_readback(self, pending: SpecPending, forward) -> None:
        """Enqueues the verification of pending's decode rows and the copy of [accepted, drafts,
        emitted ids...] per row to the host."""
        batch, rows, k = pending.batch, pending.decode_rows, pending.num_draft_tokens
        seeded = [batch.seqs[row].params.seed is not None for row in rows]
        if self.tree and k:
            pending.result, counts = verify_tree(forward, batch, rows, any(seeded), self.max_num_draft_tokens)
        else:
            pending.result, counts = self._verify(forward, k, any(seeded), all(seeded))
        result = pending.result
        both = torch.cat([result.num_accepted[:, None], counts[:, None].to(torch.int64), result.token_ids], 1)
        pending.readback = self.readback.start(both.view(-1), [], False, 0)

    def wait(self, pending: SpecPending) -> list[list[int] | None]:
        """The tokens each sequence of a launched step gets (None: none): waits for its results and
        accounts for them (acceptance statistics, the policy's step timing)."""
        batch, decode_rows, k = pending.batch, pending.decode_rows, pending.num_draft_tokens
        if not self.ngram:
            for seq in batch.seqs:
                seq.num_drafter_tokens = max(seq.num_drafter_tokens, seq.num_computed_tokens)
        emitted_rows: list[list[int]] = []
        if decode_rows:
            emitted_rows, accepted, num_drafts = self._read_verified(pending)
            if self.tree and k:
                self.kv_moves.record(batch, decode_rows, pending.result.path_nodes, accepted)
            self.stats.record(num_drafts, accepted)
            if self.policy is not None and pending.pure_decode and pending.catch_up:  # no k = 0 step
                self._timed_catch_up = len(decode_rows)
            elif self.policy is not None and pending.pure_decode:
                if pending.timed:
                    self._timed_step = (len(decode_rows), k)
                if k:
                    self.policy.record_acceptance(num_drafts, accepted)
        out: list[list[int] | None] = [None] * len(batch.seqs)
        for row, tokens in zip(decode_rows, emitted_rows, strict=True):
            out[row] = tokens
        decode_set = set(decode_rows)
        sampled_iter = iter(pending.sampled)
        for i in range(len(batch.seqs)):
            if i not in decode_set and batch.samples(i):
                out[i] = [next(sampled_iter)]
        return out

    def drop(self, pending: SpecPending) -> None:
        """Waits for a launched step and discards it (every row finished meanwhile, or shutdown)."""
        if pending.readback is not None:
            self.readback.read(pending.readback)

    def _verify(
        self, forward, k: int, any_seeded: bool, all_seeded: bool
    ) -> tuple[VerifyResult, torch.Tensor]:
        return verify_chain(forward, k, self.verifier, any_seeded, all_seeded)

    def _read_verified(self, pending: SpecPending) -> tuple[list[list[int]], list[int], list[int]]:
        """(emitted tokens, accepted drafts, drafts) per verify row, from the step's one host copy."""
        flat = self.readback.read(pending.readback)
        width = pending.result.token_ids.shape[1] + 2
        rows = [flat[i : i + width] for i in range(0, len(flat), width)]
        return [row[2 : 3 + row[0]] for row in rows], [row[0] for row in rows], [row[1] for row in rows]


def seeded_prompt_tokens(
    batch: Batch, decode_rows: list[int], engine_seed: int, logits: torch.Tensor, sampled: list[int]
) -> list[int]:
    """sampled (the tokens of batch's rows that sample outside verification, in row order) with the
    token of each seeded sampled row drawn as seeded_sample_verify draws a decode row's: from the
    uniform keyed by (seed, output index). A seeded request's tokens then do not depend on which kind
    of row samples them: a one-token last prompt chunk (a small budget, a prefix-cache hit) is a
    verify row, and a recompute after preemption samples at a prefill. logits: [len(sampled), V],
    the min_tokens bans already applied."""
    decode_set = set(decode_rows)
    rows = [i for i in range(len(batch.seqs)) if i not in decode_set and batch.samples(i)]
    picks = [
        (j, batch.seqs[i])
        for j, i in enumerate(rows)
        if batch.seqs[i].params.seed is not None and batch.seqs[i].params.temperature > 0.0
    ]
    if not picks:
        return sampled
    seqs = [seq for _, seq in picks]
    device = logits.device
    params = [seq.params for seq in seqs]
    probs = target_probs(
        logits[torch.tensor([j for j, _ in picks], device=device)][:, None, :],
        torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
        torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
        torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
    )[:, 0]
    seeds = [row_seed(seq.params.seed, engine_seed, seq.seq_id, -1) for seq in seqs]
    seeds = torch.tensor(seeds, device=device)
    counters = torch.tensor([[len(seq) - seq.num_prompt_tokens] for seq in seqs], device=device)
    drawn = sample_inverse_cdf(probs, uniform(seeds, STREAM_SEEDED, counters).reshape(-1)).tolist()
    out = list(sampled)
    for (j, _), token in zip(picks, drawn, strict=True):
        out[j] = token
    return out
