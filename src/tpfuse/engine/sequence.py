"""One request inside the engine: its tokens, where its KV lives, and how far it has been computed."""

from __future__ import annotations

import enum
import itertools
from array import array

from tpfuse.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_next_seq_id = itertools.count()


class Sequence:
    """Token ids of one request (prompt then output) and its paged-KV bookkeeping.

    Invariant: KV of token_ids[:num_computed_tokens] is in the cache blocks listed in block_table.
    A step computes token_ids[num_computed_tokens : num_computed_tokens + chunk]; when the chunk
    reaches the last token, the step samples the next one. A decode is the case of a one-token chunk.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, block_size: int):
        self.seq_id = next(_next_seq_id)
        self.request_id = request_id
        self.params = params
        self.block_size = block_size
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        # int64 block ids: the packers copy it into a step with one memcpy instead of a loop over ints
        self.block_table = array("q")
        self.block_hashes: list[int] = []  # chained hashes of the full, computed blocks, in order
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at the last admission
        self.num_drafter_tokens = 0  # speculative drafter's KV is current for positions below this
        self.finish_reason: str | None = None
        self.slot: int | None = None  # its entry in the device token table while running (Scheduler)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def block_token_ids(self, index: int) -> list[int]:
        return self.token_ids[index * self.block_size : (index + 1) * self.block_size]

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={len(self)}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)}, {self.status.value})"
        )
