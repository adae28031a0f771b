"""Benchmark prompts: random token ids of a given length, the shipped prompt set, or a ShareGPT file.

Every source is deterministic for a seed, so repeats and paired A/B runs send the same prompts in the
same order.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from tpfuse.bench.prompt_set import BUILTIN_PROMPTS

DATASETS = ("builtin", "random", "sharegpt")
# Plain words for text prompts of roughly a given length when no tokenizer is at hand.
_WORDS = ("time", "model", "token", "cache", "river", "stone", "light", "signal", "market", "garden")


@dataclass(slots=True)
class PromptConfig:
    dataset: str = "builtin"  # builtin | random | sharegpt
    input_len: int = 128  # random: prompt length in tokens
    dataset_path: str | None = None  # sharegpt: a local JSON file
    seed: int = 0

    def __post_init__(self):
        if self.dataset not in DATASETS:
            raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if self.input_len < 1:
            raise ValueError(f"--input-len must be >= 1, got {self.input_len}")
        if self.dataset == "sharegpt" and not self.dataset_path:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE.json (ShareGPT format)")


def load_prompts(
    config: PromptConfig, count: int, token_ids_ok: bool = True, tokenizer=None
) -> list[str | list[int]]:
    """`count` prompts (cycling through the source when it is shorter), in a seeded order.

    random: token-id lists of `input_len` when `token_ids_ok` (completions endpoint), else text:
    the ids decoded by `tokenizer`, or plain words without one. Ids are drawn below the tokenizer's
    vocabulary size (256 without a tokenizer, valid for byte-level and BPE vocabularies alike).
    Raises ValueError when a ShareGPT file is missing, unreadable or holds no human turn.
    """
    rng = random.Random(config.seed)
    if config.dataset == "random":
        vocab = getattr(tokenizer, "vocab_size", None) or 256
        prompts: list = []
        for _ in range(count):
            ids = [rng.randrange(min(10, vocab - 1), vocab) for _ in range(config.input_len)]
            if token_ids_ok:
                prompts.append(ids)
            elif tokenizer is not None:
                prompts.append(tokenizer.decode(ids))
            else:
                prompts.append(" ".join(rng.choice(_WORDS) for _ in range(config.input_len)))
        return prompts
    source = list(BUILTIN_PROMPTS) if config.dataset == "builtin" else read_sharegpt(config.dataset_path)
    rng.shuffle(source)
    return [source[i % len(source)] for i in range(count)]


def read_sharegpt(path: str | Path) -> list[str]:
    """The first human turn of each conversation in a ShareGPT-format JSON file.

    Format: [{"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", ...}]}, ...].
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"ShareGPT file {path} does not exist: pass an existing --dataset-path") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"ShareGPT file {path} is not valid JSON ({e})") from None
    prompts = []
    for entry in data if isinstance(data, list) else []:
        if not isinstance(entry, dict):
            continue
        turns = entry.get("conversations") or entry.get("conversation") or []
        for turn in turns:
            if turn.get("from") in ("human", "user") and str(turn.get("value", "")).strip():
                prompts.append(str(turn["value"]))
                break
    if not prompts:
        raise ValueError(
            f"ShareGPT file {path} has no conversation with a human turn; expected "
            '[{"conversations": [{"from": "human", "value": "..."}]}]'
        )
    return prompts
