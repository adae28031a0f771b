"""LLMEngine: requests in, tokens out, one scheduler step at a time.

The engine owns the scheduler and block manager and drives an Executor (executor.py): a ModelRunner
in this process for TP=1, or the tensor-parallel group (worker.py) for TP > 1, through a step
strategy (step_strategy.py): PlainSteps, or SpeculativeSteps (spec_steps.py) wrapping it. It deals
in token ids only; text (and stop strings) belongs to whoever holds a Detokenizer.

One loop for every kind of step (`step`): take the step launched ahead, or schedule and launch one;
launch the step after it when that step can be planned now (the overlap schedule, unless
--disable-overlap-schedule); then read this step's tokens, postprocess them and return the outputs.
A step launched ahead is planned from where the step before leaves each row (Scheduler.
schedule_following): requests may arrive and join it, prompt chunks continue, and the ids the step
before samples reach it through the device's token table, so the GPU runs the two back to back
while the host postprocesses. If a request then finishes (a stop id, EOS) or is aborted, the
launched step still runs and that row's tokens are discarded. Every request gets the tokens the
synchronous loop gives it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tpfuse.config import EngineConfig
from tpfuse.engine.block_manager import BlockManager
from tpfuse.engine.executor import Executor
from tpfuse.engine.logits_processing import LogitsProcessing, TokenLogprobs
from tpfuse.engine.sampling_params import SamplingParams, token_ids
from tpfuse.engine.scheduler import GrowthReserve, Scheduler
from tpfuse.engine.sequence import Sequence
from tpfuse.engine.step_strategy import LaunchedStep, PlainSteps, StepStrategy


@dataclass(slots=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" when finished
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprobs] | None = None  # one per new token when the request asked for them


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks in use
    prefix_cache_hit_rate: float  # prompt tokens served from the cache / prompt tokens looked up
    num_prompt_tokens: int  # prompt tokens of all accepted requests
    num_generated_tokens: int
    num_preemptions: int
    num_kv_blocks: int
    max_model_len: int
    # Speculative decoding (zeros when off). *_total are cumulative counts since start-up.
    spec_num_draft_tokens: int = 0  # k of the latest decode step
    spec_acceptance_length: float = 0.0  # mean tokens per verify row with drafts (1 + accepted)
    spec_num_drafts_total: int = 0  # verify rows that carried drafts
    spec_num_draft_tokens_total: int = 0
    spec_num_accepted_tokens_total: int = 0
    spec_acceptance_rate_per_position: list[float] = field(default_factory=list)
    simulated_acceptance: int = 0  # 1: benchmark-only simulated acceptance, outputs are not the model's


def _make_executor(config: EngineConfig) -> Executor:
    if config.tp_size == 1:
        from tpfuse.engine.runner import ModelRunner
        from tpfuse.engine.spec_worker import speculative_hook

        device = None
        if config.devices is not None:  # --tp-size 1 --devices N: run on GPU N
            from tpfuse.engine.worker import rank_devices

            device = rank_devices(config)[0]
        return ModelRunner(config, hook=speculative_hook(config), device=device)
    from tpfuse.engine.worker import TensorParallelExecutor

    return TensorParallelExecutor(config)


def _prompt_ids(prompt) -> list[int]:
    """prompt as a list of ints (numpy integers too); raises ValueError for anything else, which a
    step would fail on (every later step too, as the request stays queued)."""
    if isinstance(prompt, str | bytes | bytearray):
        raise ValueError("the prompt must be a list of token ids, got a string; tokenize it first")
    return token_ids(prompt, "prompt token ids must be integers")


class LLMEngine:
    """Continuous-batching engine over one model.

    Use: add_request(...) any time, then call step() until has_unfinished() is false. Raises
    ValueError at construction for bad settings or checkpoints (the message names the fix).
    """

    def __init__(self, config: EngineConfig):
        from tpfuse.model.loader import load_model_config
        from tpfuse.model.tokenizer import load_tokenizer
        from tpfuse.spec.tree import num_lookahead_tokens

        self.config = config
        load_model_config(config)  # tpfuse's checks of config.json before transformers reads it
        self.tokenizer = load_tokenizer(config.model)
        self.executor = _make_executor(config)
        self.max_model_len: int = self.executor.max_model_len
        self.vocab_size: int = self.executor.vocab_size
        eos = set(self.tokenizer.eos_token_ids) | set(self.executor.model_config.eos_token_ids)
        self.block_manager = BlockManager(
            self.executor.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        spec = config.speculative
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_running_requests,
            config.max_num_batched_tokens,
            self.max_model_len,
            eos,
            num_lookahead_tokens=num_lookahead_tokens(spec) if spec.enabled else 0,
            max_prefill_tokens_per_step=config.max_prefill_tokens_per_step,
            growth_reserve=GrowthReserve(),
        )
        # Rank 0's per-request logits processing (penalties, bias, grammar, logprobs), used by the
        # runner for batches that need it.
        self.logits_processing = LogitsProcessing(self.vocab_size, self.tokenizer, eos)
        self.executor.runner.logits_processing = self.logits_processing
        plain = PlainSteps(self.executor, self.scheduler, config.seed, without_lookahead=spec.enabled)
        self.steps: StepStrategy = plain
        self.spec_decoder = None  # rank 0's drafting and verification when speculative
        if spec.enabled:
            from tpfuse.engine.spec_steps import SpeculativeSteps

            self.steps = SpeculativeSteps(config, plain, self.scheduler, self.max_model_len)
            self.spec_decoder = self.steps.decoder
        self.overlap = not config.disable_overlap_schedule  # launch the following step ahead
        self._in_flight: LaunchedStep | None = None  # launched ahead, not yet read
        self._serving_nobody: LaunchedStep | None = None  # launched ahead, its rows all finished
        self.requests: dict[str, Sequence] = {}
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None
    ) -> None:
        """Queues a request. Raises ValueError for a duplicate id, an empty prompt, a token id (of the
        prompt or stop_token_ids) outside the vocabulary, a prompt plus max_tokens longer than
        max_model_len, a prompt that is not integer token ids, or min_tokens with every token banned
        (TypeError for params that are not a SamplingParams)."""
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams or None, got {type(params).__name__}")
        params = (params or SamplingParams()).checked_for(self.vocab_size)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt_token_ids = _prompt_ids(prompt_token_ids)
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty; give at least one token")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens but max_model_len is {self.max_model_len}, which must also "
                "leave room for one generated token; shorten the prompt or raise --max-model-len"
            )
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"max_tokens {params.max_tokens} plus the prompt's {n} tokens exceeds max_model_len "
                f"{self.max_model_len}; ask for at most {self.max_model_len - n} tokens"
            )
        if params.min_tokens and params.grammar is None:
            eos = set() if params.ignore_eos else self.scheduler.eos_token_ids
            banned = set(params.stop_token_ids) | eos
            if len(banned) >= self.vocab_size:
                raise ValueError(
                    f"stop_token_ids and the end-of-sequence ids cover all {self.vocab_size} tokens, so "
                    f"min_tokens {params.min_tokens} leaves no token to emit; drop stop ids or min_tokens"
                )
        if params.needs_logits_processing:
            if self.config.speculative.enabled:
                raise ValueError(
                    "logprobs, logit_bias, penalties and grammars are not supported with speculative "
                    "decoding; leave them out or serve without --speculative-algorithm"
                )
            self.logits_processing.check(params)
        seq = Sequence(request_id, list(prompt_token_ids), params, self.config.block_size)
        if params.needs_logits_processing:
            self.logits_processing.register(seq)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self.num_prompt_tokens += n

    def abort_request(self, request_id: str) -> None:
        """Drops a request wherever it is and frees its KV blocks. Unknown ids are ignored; no
        StepOutput follows for an aborted request."""
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[StepOutput]:
        """Runs one batch; returns an output for every request that got a token (finished ones last
        time they appear). Returns [] when there is nothing to do.

        A step launched ahead is kept whatever happened since its launch: the tokens of a row that
        finished or was aborted meanwhile are discarded (postprocess skips finished sequences; the
        step's KV writes land past their computed positions, in blocks that no later step can reuse
        before this one has run), and requests that arrived meanwhile join the step after it."""
        started = time.perf_counter()
        if self._serving_nobody is not None:  # done by now unless this step follows at once
            self.steps.drop(self._serving_nobody)
            self._serving_nobody = None
        step, self._in_flight = self._in_flight, None
        chained = step is not None
        if step is None:
            batch = self.scheduler.schedule()
            if batch is None:
                if self.scheduler.waiting and not self.scheduler.running:
                    raise RuntimeError("a waiting request cannot get KV blocks although nothing runs")
                return []
            step = self.steps.launch(batch)
        if self.overlap:
            self._in_flight = self.steps.launch_following(step)
        updates = self.scheduler.postprocess_multi(step.batch, self.steps.wait(step))
        self.steps.finished(step, time.perf_counter() - started, chained)
        self._drop_in_flight_if_it_serves_nobody()
        return self._outputs(updates)

    def _drop_in_flight_if_it_serves_nobody(self) -> None:
        """A step launched ahead whose rows have all finished is set aside, to be read and discarded
        at the start of the next step: never completed as a step (which would time an idle gap as
        one), and not waited for now (the last outputs would wait for a step that serves nobody)."""
        if self._in_flight is not None and all(seq.is_finished for seq in self._in_flight.batch.seqs):
            self._serving_nobody, self._in_flight = self._in_flight, None

    def _outputs(self, updates) -> list[StepOutput]:
        outputs = []
        for seq, tokens in updates:
            self.num_generated_tokens += len(tokens)
            if seq.is_finished:
                del self.requests[seq.request_id]
            outputs.append(
                StepOutput(
                    request_id=seq.request_id,
                    new_token_ids=tokens,
                    finished=seq.is_finished,
                    finish_reason=seq.finish_reason,
                    num_prompt_tokens=seq.num_prompt_tokens,
                    num_cached_tokens=seq.num_cached_tokens,
                    logprobs=self.logits_processing.pop_logprobs(seq)
                    if seq.params.logprobs is not None
                    else None,
                )
            )
        return outputs

    def abort_failed_step(self) -> list[str]:
        """After step() raised: forgets the steps launched ahead (unread) and aborts every running
        request, whose step it was; returns their ids. Waiting requests stay queued, so the engine
        serves on if the fault was one request's (a broken device fails the next step too)."""
        self._in_flight = self._serving_nobody = None
        request_ids = [seq.request_id for seq in self.scheduler.running]
        for request_id in request_ids:
            self.abort_request(request_id)
        return request_ids

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=self.block_manager.usage(),
            prefix_cache_hit_rate=self.block_manager.hit_rate(),
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=self.num_generated_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_kv_blocks=self.block_manager.num_blocks,
            max_model_len=self.max_model_len,
            **self.steps.stats(),
        )

    def shutdown(self) -> None:
        """Releases the executor (worker processes for TP > 1) and the device memory of this process's
        runner (weights, KV cache, CUDA graphs). Safe to call twice; the engine is unusable afterwards."""
        for step in (self._serving_nobody, self._in_flight):
            if step is not None:
                self.steps.drop(step)
        self._serving_nobody = self._in_flight = None
        self.executor.shutdown()
