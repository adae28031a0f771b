"""LLM: offline generation over LLMEngine, results in input order."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

from tpfuse.config import EngineConfig
from tpfuse.engine.detokenizer import Detokenizer
from tpfuse.engine.engine import LLMEngine
from tpfuse.engine.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class RequestOutput:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int = 0
    request_id: str = field(default="", repr=False)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, bytes | bytearray):
        raise TypeError("a prompt must be a string or a list of token ids, got bytes; decode it first")
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    for p in prompts:
        if not isinstance(p, str | SequenceABC):
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(p).__name__}")
        if not isinstance(p, str) and (bad := [t for t in p if not isinstance(t, int)]):
            raise TypeError(f"a prompt's token ids must be integers, got {bad[0]!r}")
    return [p if isinstance(p, str) else list(p) for p in prompts]


class LLM:
    """Offline generation: `LLM(model="tiny", **EngineConfig fields).generate(prompts, params)`.

    Raises ValueError for bad settings (see EngineConfig) or a checkpoint that cannot be loaded.
    """

    def __init__(self, model: str = "tiny", *, config: EngineConfig | None = None, **engine_config):
        self.engine = LLMEngine(config if config is not None else EngineConfig(model=model, **engine_config))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        self._shut_down = False

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        return cls(config=config)

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Completes every prompt (text is tokenized; token-id lists are used as given).

        params: one SamplingParams for all prompts or one per prompt. Returns one RequestOutput per
        prompt, in input order. Raises ValueError (nothing is left queued) when a prompt is rejected.
        """
        if self._shut_down:
            raise RuntimeError("this LLM was shut down; make a new one to generate again")
        prompt_list = _as_prompt_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompt_list)
        if not all(isinstance(p, SamplingParams) for p in params):
            raise TypeError("params must be a SamplingParams or a list of them, one per prompt")
        if len(params) != len(prompt_list):
            raise ValueError(
                f"{len(params)} SamplingParams for {len(prompt_list)} prompts; give one or one each"
            )
        outputs: dict[str, RequestOutput] = {}
        detoks: dict[str, Detokenizer] = {}
        order = []
        try:
            for prompt, p in zip(prompt_list, params, strict=True):
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
                request_id = f"generate-{next(self._ids)}"
                self.engine.add_request(request_id, ids, p)
                order.append(request_id)
                outputs[request_id] = RequestOutput("", [], list(ids), None, request_id=request_id)
                detoks[request_id] = Detokenizer(self.tokenizer, p.stop)
            while self.engine.has_unfinished():
                for step in self.engine.step():
                    self._absorb(step, outputs[step.request_id], detoks[step.request_id])
        except BaseException:
            for request_id in order:
                self.engine.abort_request(request_id)
            raise
        return [outputs[r] for r in order]

    def _absorb(self, step, out: RequestOutput, detok: Detokenizer) -> None:
        out.token_ids += step.new_token_ids
        out.num_cached_tokens = step.num_cached_tokens
        detok.add(step.new_token_ids)
        if detok.stopped and out.finish_reason is None:
            self.engine.abort_request(step.request_id)
            out.finish_reason = "stop"
        elif step.finished and out.finish_reason is None:
            detok.flush()
            out.finish_reason = step.finish_reason
        out.text = detok.text

    def shutdown(self) -> None:
        """Frees the engine's resources and worker processes (its stats stay readable); generate()
        refuses afterwards."""
        if not self._shut_down:
            self._shut_down = True
            self.engine.shutdown()
