"""The client-side tokenizer used to count tokens beside the server's `usage` (never downloads)."""

from __future__ import annotations

from pathlib import Path


class ClientTokenizer:
    """encode(text) -> ids without special tokens, decode(ids) -> text, vocab_size."""

    def __init__(self, name: str, encode, decode, vocab_size: int | None):
        self.name = name
        self._encode = encode
        self._decode = decode
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._decode(ids)


def load_client_tokenizer(name_or_path: str | None) -> tuple[ClientTokenizer | None, str]:
    """A tokenizer for `name_or_path` and a note saying where it came from or why there is none.

    "none" turns it off. Tries a local Hugging Face directory (transformers, local files only), then
    tpfuse's own tokenizers (the embedded model's byte-level one, presets). Never raises: without a
    tokenizer the bench still runs on the server's usage counts.
    """
    if not name_or_path:
        return None, "no client tokenizer (pass --tokenizer): client token counts skipped"
    if name_or_path == "none":
        return None, "client tokenizer off (--tokenizer none): client token counts skipped"
    errors = []
    if Path(name_or_path).is_dir():
        try:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
            return (
                ClientTokenizer(
                    name_or_path,
                    lambda text: hf.encode(text, add_special_tokens=False),
                    lambda ids: hf.decode(ids),
                    len(hf),
                ),
                f"client tokenizer: {name_or_path} (transformers)",
            )
        except Exception as e:  # any loader failure leaves the bench on server counts
            errors.append(f"transformers: {type(e).__name__}: {e}")
    try:
        from tpfuse.model.tokenizer import load_tokenizer

        tok = load_tokenizer(name_or_path)
        vocab = getattr(tok, "vocab_size", None)
        return (
            ClientTokenizer(name_or_path, tok.encode, tok.decode, vocab),
            f"client tokenizer: {name_or_path} (tpfuse)",
        )
    except Exception as e:  # the engine's tokenizer module may be absent or reject the name
        errors.append(f"tpfuse: {type(e).__name__}: {e}")
    return (
        None,
        f"no client tokenizer for {name_or_path!r} ({'; '.join(errors)[:200]}): client counts skipped",
    )
