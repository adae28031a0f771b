"""A small stand-in for LLMEngine with the same interface, for server tests that must not depend on
the model: deterministic tokens, a step delay, a block-counted KV usage and a toy prefix cache.

Faults on request, for the robustness tests: a running prompt that contains FAIL_STEP makes step()
raise, DIE_IN_STEP ends the engine process, HANG_IN_STEP blocks step() for good."""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

from tpfuse.model.tokenizer import ByteTokenizer

BLOCK_SIZE = 16
NUM_BLOCKS = 256
FAIL_STEP = "<fail-step>"
DIE_IN_STEP = "<die-in-step>"
HANG_IN_STEP = "<hang-in-step>"


@dataclass
class FakeStepOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int


class _Request:
    def __init__(self, request_id, prompt, params, cached):
        self.request_id = request_id
        self.tokens = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.params = params
        self.cached = cached
        self.rng = random.Random(params.seed)
        self.text = bytes(t for t in prompt if t < 256).decode("utf-8", "replace")

    @property
    def num_blocks(self) -> int:
        return (len(self.tokens) + BLOCK_SIZE - 1) // BLOCK_SIZE

    def next_token(self) -> int:
        if self.params.temperature == 0:
            return ord("a") + (sum(self.tokens[-3:]) * 31 + len(self.tokens)) % 26
        return ord("a") + self.rng.randrange(26)


class FakeEngine:
    """Decodes one token per running request per step; at most max_running run, the rest wait."""

    def __init__(self, config, step_delay_s: float = 0.002, max_running: int = 8):
        self.config = config
        self.tokenizer = ByteTokenizer()
        self.max_model_len = 256
        self.vocab_size = 300
        self.step_delay_s = step_delay_s
        self.max_running = max_running
        self.requests: dict[str, _Request] = {}
        self.seen_prompts: list[list[int]] = []
        self.generated = 0

    def add_request(self, request_id, prompt_token_ids, params):
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt + max_tokens exceeds max_model_len {self.max_model_len}")
        cached = 0
        for seen in self.seen_prompts:
            common = 0
            for a, b in zip(seen, prompt_token_ids, strict=False):
                if a != b:
                    break
                common += 1
            cached = max(cached, common // BLOCK_SIZE * BLOCK_SIZE)
        self.seen_prompts.append(list(prompt_token_ids))
        self.requests[request_id] = _Request(request_id, prompt_token_ids, params, cached)

    def abort_request(self, request_id):
        self.requests.pop(request_id, None)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _faults(self, running) -> None:
        for req in running:
            if FAIL_STEP in req.text:
                raise RuntimeError("a step failed on purpose (fake engine)")
            if DIE_IN_STEP in req.text:
                os._exit(3)
            if HANG_IN_STEP in req.text:
                time.sleep(3600)

    def abort_failed_step(self):
        running = list(self.requests)[: self.max_running]
        for request_id in running:
            del self.requests[request_id]
        return running

    def step(self):
        time.sleep(self.step_delay_s)
        outputs = []
        running = list(self.requests.values())[: self.max_running]
        self._faults(running)
        for req in running:
            token = req.next_token()
            req.tokens.append(token)
            self.generated += 1
            done = len(req.tokens) - req.num_prompt_tokens >= req.params.max_tokens
            if done:
                del self.requests[req.request_id]
            outputs.append(
                FakeStepOutput(
                    req.request_id,
                    [token],
                    done,
                    "length" if done else None,
                    req.num_prompt_tokens,
                    req.cached,
                )
            )
        return outputs

    def stats(self) -> dict:
        running = min(len(self.requests), self.max_running)
        blocks = sum(r.num_blocks for r in list(self.requests.values())[: self.max_running])
        return {
            "num_running": running,
            "num_waiting": len(self.requests) - running,
            "kv_usage": blocks / NUM_BLOCKS,
            "prefix_cache_hit_rate": 0.0,
            "num_generated_tokens": self.generated,
            "spec": {"acceptance_length": 1.0, "acceptance_rate_per_position": [0.5, 0.25]},
        }

    def shutdown(self):
        pass


def make_fake_engine(config):
    return FakeEngine(config)


def make_slow_engine(config):
    time.sleep(2.0)
    return FakeEngine(config)


def make_failing_engine(config):
    raise ValueError("no such model: checkpoint missing (this engine always fails to start)")
