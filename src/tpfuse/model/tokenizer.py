"""Tokenizers: a byte-level one for presets (the embedded model), Hugging Face tokenizers for checkpoints.

Both answer the same interface: `encode(text) -> list[int]`, `decode(ids) -> str`, `eos_token_ids`,
`bos_token_id`, `apply_chat_template(messages) -> str`. `decode` never raises on a cut-off UTF-8
sequence: an incomplete trailing character comes out as U+FFFD, which an incremental detokenizer
holds back until the next token completes it.
"""

from __future__ import annotations

import os
import re

from tpfuse.model.presets import BYTE_SPECIAL_TOKENS, is_preset

_PLACEHOLDER_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def _plain_chat_template(messages: list[dict], role_prefix: dict[str, str], end: str, reply: str) -> str:
    parts = [f"{role_prefix.get(m['role'], m['role'] + ': ')}{m['content']}{end}" for m in messages]
    return "".join(parts) + reply


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; the specials of presets.BYTE_SPECIAL_TOKENS follow.

    Ids past the specials (preset models have real, larger vocabularies with random weights) decode
    to a placeholder letter, so their output stays visible text.
    """

    def __init__(self):
        self.special_ids = {tok: 256 + i for i, tok in enumerate(BYTE_SPECIAL_TOKENS)}
        self.vocab_size = 256 + len(BYTE_SPECIAL_TOKENS)
        self.bos_token_id = self.special_ids["<|bos|>"]
        self.eos_token_ids = {self.special_ids["<|eos|>"], self.special_ids["<|end|>"]}
        self._special_pattern = re.compile("|".join(re.escape(t) for t in BYTE_SPECIAL_TOKENS))

    def encode(self, text: str) -> list[int]:
        """Bytes of text, special-token strings as their ids, with bos first (unless text starts with it)."""
        ids: list[int] = []
        pos = 0
        for match in self._special_pattern.finditer(text):
            ids.extend(text[pos : match.start()].encode("utf-8"))
            ids.append(self.special_ids[match.group()])
            pos = match.end()
        ids.extend(text[pos:].encode("utf-8"))
        if not ids or ids[0] != self.bos_token_id:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of ids with specials dropped; an incomplete UTF-8 sequence decodes to U+FFFD."""
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                out.append(i)
            elif i >= self.vocab_size:
                out.extend(_PLACEHOLDER_LETTERS[i % 26].encode())
        return out.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> str:
        """messages: [{"role": "system"|"user"|"assistant", "content": str}] -> prompt text ending
        with the assistant marker."""
        prefix = {r: f"<|{r}|>" for r in ("system", "user", "assistant")}
        return _plain_chat_template(messages, prefix, "<|end|>", "<|assistant|>")


class HFTokenizer:
    """A Hugging Face tokenizer from a local checkpoint directory (never downloads)."""

    def __init__(self, path: str):
        from huggingface_hub import errors as hub_errors
        from transformers import AutoTokenizer

        from tpfuse.model.config import eos_ids
        from tpfuse.model.loader import read_json

        if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
            raise ValueError(
                f"no tokenizer files ({', '.join(_TOKENIZER_FILES)}) in {path}; copy them from the "
                "original checkpoint"
            )
        # Read first: a config.json that is not a JSON object is named here, not deep in transformers.
        config_path = os.path.join(path, "config.json")
        config, generation = read_json(config_path), read_json(os.path.join(path, "generation_config.json"))
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as e:
            reason = " ".join(str(e).split())
            raise ValueError(f"could not load the tokenizer in {path}: {reason}") from e
        except getattr(hub_errors, "StrictDataclassError", ()) as e:  # transformers 5 types configs strictly
            raise ValueError(_config_type_error(config_path, e)) from e
        except (KeyError, IndexError, TypeError, AttributeError) as e:  # e.g. a config.json field it misreads
            reason = f"{type(e).__name__}: {' '.join(str(e).split())}"
            raise ValueError(
                f"could not load the tokenizer in {path}: transformers failed reading config.json or the "
                f"tokenizer files ({reason}); compare config.json with the original checkpoint's"
            ) from e
        self.bos_token_id = self._tok.bos_token_id
        self.vocab_size = len(self._tok)
        eos = {self._tok.eos_token_id} if self._tok.eos_token_id is not None else set()
        self.eos_token_ids = eos | set(eos_ids(config or {}, generation, config_path))

    def encode(self, text: str) -> list[int]:
        """Token ids; the tokenizer's bos is added unless text already starts with it (chat templates do)."""
        bos = self._tok.bos_token
        add_special = not (bos and text.startswith(bos))
        return self._tok.encode(text, add_special_tokens=add_special)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if getattr(self._tok, "chat_template", None):
            return self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prefix = {r: f"{r.capitalize()}: " for r in ("system", "user", "assistant")}
        return _plain_chat_template(messages, prefix, "\n", "Assistant:")


def _config_type_error(config_path: str, error: Exception) -> str:
    """transformers' strict config typing refusing a field ("Validation error for field 'x': TypeError:
    Field 'x' expected float, got int (value: 0)") as a message naming the file, the field and the fix."""
    text = " ".join(str(error).split())
    field = re.search(r"field '([^']+)'", text)
    name = field.group(1) if field else "a field"
    reason = text.split("TypeError: ", 1)[-1].split(". Errors:")[0]
    reason = re.sub(r"<class '(?:[\w.]*\.)?(\w+)'>", r"\1", re.sub(r"^Field '[^']+' ", "", reason))
    int_for_float = re.search(r"expected float, got int \(value: (-?\d+)\)", text)
    float_for_int = re.search(r"expected int, got float \(value: (-?\d+)\.0\)", text)
    quoted_number = re.search(r"expected (?:int|float), got str \(value: '(-?[\d.eE+-]+)'\)", text)
    if int_for_float:
        fix = f"write it as {int_for_float.group(1)}.0 (a float)"
    elif float_for_int:
        fix = f"write it as {float_for_int.group(1)} (an integer)"
    elif quoted_number:
        fix = f"write it as {quoted_number.group(1)} (a number, no quotes)"
    else:
        fix = "give it the type transformers expects"
    return f"{config_path}: transformers refuses field {name} ({reason}); {fix} in config.json"


class GgufTokenizer(HFTokenizer):
    """The tokenizer a .gguf file describes (tokenizer.ggml.* metadata, converted by transformers),
    with the file's chat template (tokenizer.chat_template) and eos id."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        from tpfuse.model.gguf import open_gguf

        file = open_gguf(path)  # first: a truncated or damaged file is named as such
        directory, name = os.path.split(os.path.abspath(path))
        try:
            self._tok = AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
        except (OSError, ValueError) as e:
            reason = " ".join(str(e).split())
            raise ValueError(f"could not build the tokenizer of {path} from its metadata: {reason}") from e
        template = file.field("tokenizer.chat_template")
        if template:
            self._tok.chat_template = template
        self.bos_token_id = self._tok.bos_token_id
        self.vocab_size = len(self._tok)
        eos = {self._tok.eos_token_id, file.field("tokenizer.ggml.eos_token_id")}
        self.eos_token_ids = {int(i) for i in eos if i is not None}


def load_tokenizer(model: str) -> ByteTokenizer | HFTokenizer:
    """The tokenizer of a preset name (byte-level), a local Hugging Face directory or a .gguf file.

    Raises ValueError when model is none of these, or the directory has no tokenizer.
    """
    if is_preset(model):
        return ByteTokenizer()
    if model.endswith(".gguf") and os.path.isfile(model):
        return GgufTokenizer(model)
    if os.path.isdir(model):
        return HFTokenizer(model)
    from tpfuse.model.presets import PRESETS

    raise ValueError(f"model {model!r} is neither a local directory nor a preset ({', '.join(PRESETS)})")
