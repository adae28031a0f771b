"""Per-request sampling settings, checked when built so a bad request fails before it is queued."""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field

INT64_MAX = (1 << 63) - 1
GREEDY_BELOW = 1e-5  # positive temperatures below this are greedy (dividing by them overflows float32)
MAX_TEMPERATURE = 100.0
MAX_LOGPROBS = 20


def _is_int(value) -> bool:
    """An integer, and not a boolean (True is no token count or seed)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """An int or a float, and not a boolean or a string."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def token_ids(values, must: str) -> list[int]:
    """values as a list of int token ids (numpy integers too); anything else (a bool, a float, which
    int() would turn from 2.7 into 2, a string) raises ValueError(f"{must}, got {value!r}")."""
    ids = []
    for t in values:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise ValueError(f"{must}, got {t!r}")
        ids.append(operator.index(t))
    return ids


def _is_int_like(value) -> bool:
    """An int (numpy's too) or a decimal string (JSON object keys)."""
    if isinstance(value, str):
        return value.strip().lstrip("+-").isdigit()
    return hasattr(value, "__index__")


@dataclass(frozen=True, slots=True)
class Grammar:
    """A constraint on the output: kind "json_schema" (spec: the schema as JSON text) or "ebnf"
    (spec: the grammar in xgrammar's EBNF). source: the request field it came from, named when it
    does not compile."""

    kind: str
    spec: str
    source: str = field(default="response_format", compare=False)


@dataclass(slots=True)
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    temperature 0 is greedy; top_k <= 0 and top_p == 1 switch those filters off. The request stops at
    an end-of-sequence token (unless ignore_eos), at any of stop_token_ids, at a stop string (the text
    is cut before it), or after max_tokens generated tokens. Neither end-of-sequence nor stop_token_ids
    can be sampled before min_tokens tokens exist. seed makes sampling reproducible whatever the batch;
    None draws from the engine's seed. Temperatures in (0, GREEDY_BELOW) are stored as 0 (greedy).
    Every integer fits int64, every float is finite; `checked_for(vocab_size)` adds the checks that
    need the vocabulary.

    Logits processing (engine/logits_processing.py; such requests take the eager sampling path):
    logprobs (None: off; k: the chosen token's log-probability and the k most likely), logit_bias
    {token id: added to its logit}, repetition_penalty (1: off), presence/frequency_penalty
    (0: off), grammar (constrained decoding).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    grammar: Grammar | None = None
    needs_logits_processing: bool = field(init=False, default=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = token_ids(self.stop_token_ids or [], "stop_token_ids must be integer token ids")
        if not (_is_number(self.temperature) and 0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(
                f"temperature must lie in [0, {MAX_TEMPERATURE}] (0: greedy), got {self.temperature!r}"
            )
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        if not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must lie in (0, 1] (1 switches it off), got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k == 0 or not -1 <= self.top_k <= INT64_MAX:
            raise ValueError(f"top_k must be -1 (off) or a positive int64, got {self.top_k!r}")
        for name in ("max_tokens", "min_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or not 0 <= value <= INT64_MAX:
                raise ValueError(f"{name} must be a non-negative int64, got {value!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if any(not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids}")
        self._check_processing()

    def _check_processing(self) -> None:
        if self.logprobs is not None and not (
            _is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}"
            )
        if self.logit_bias:
            bad = [t for t in self.logit_bias if isinstance(t, bool) or not _is_int_like(t)]
            if bad:  # int() would turn 2.5 into 2
                raise ValueError(f"logit_bias keys must be integer token ids, got {bad[0]!r}")
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            if not all(0 <= t <= INT64_MAX and -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()):
                raise ValueError("logit_bias maps token ids to biases in [-100, 100]")
        if not (_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0):
            raise ValueError(
                f"repetition_penalty must lie in (0, 10] (1: off), got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not (_is_number(getattr(self, name)) and -2.0 <= getattr(self, name) <= 2.0):
                raise ValueError(f"{name} must lie in [-2, 2] (0: off), got {getattr(self, name)}")
        if self.grammar is not None and self.grammar.kind not in ("json_schema", "ebnf"):
            raise ValueError(f"grammar kind must be json_schema or ebnf, got {self.grammar.kind!r}")
        self.needs_logits_processing = bool(
            self.logprobs is not None
            or self.logit_bias
            or self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.grammar is not None
        )

    def checked_for(self, vocab_size: int) -> SamplingParams:
        """These params for a model of vocab_size tokens: raises ValueError for a stop token id outside
        the vocabulary; a top_k that keeps the whole vocabulary becomes -1 (off)."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids holds {bad[0]}, outside the vocabulary [0, {vocab_size})")
        bad = [t for t in self.logit_bias or {} if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias names token {bad[0]}, outside the vocabulary [0, {vocab_size})")
        if self.top_k >= vocab_size:
            return dataclasses.replace(self, top_k=-1)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
