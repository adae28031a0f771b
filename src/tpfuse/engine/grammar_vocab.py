"""The engine tokenizer's vocabulary as xgrammar sees it (xgrammar.TokenizerInfo), for grammar masks.

Byte tokenizer: ids 0x20..0xFF are their bytes; its special tokens (and any id past them, which
preset models with larger vocabularies have) are empty strings, which xgrammar treats as special:
never allowed inside a grammar, only as a stop token. So are the control bytes 0x00..0x1F: JSON
forbids them raw inside strings, yet xgrammar 0.2's length-bounded string rule admits them (and
compact JSON needs no whitespace outside strings; escapes such as \n remain). Hugging Face
tokenizers go through xgrammar's own reader. vocab_size is the model's (its logits' width), which
may exceed the tokenizer's.

`grammar_vocab_size` is the width grammars are compiled and masked over: xgrammar's mask fill costs
time in proportion to it, even for empty entries, so the byte tokenizer's grammars cover its own
ids (bytes and specials) and the model's ids past them are masked without asking xgrammar.
"""

from __future__ import annotations


def grammar_vocab_size(tokenizer, vocab_size: int) -> int:
    """The leading ids a grammar can allow (the rest are never allowed): the byte tokenizer's own
    ids, else the model's whole vocabulary."""
    from tpfuse.model.tokenizer import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return min(vocab_size, tokenizer.vocab_size)
    return vocab_size


def surrogate_lead(tokenizer) -> int | None:
    """The id of byte 0xED where ids are bytes (the byte tokenizer), else None. xgrammar 0.2 lets a
    JSON string go on from 0xED with 0xA0..0xBF, which starts the UTF-8 form of a UTF-16 surrogate:
    not UTF-8 (it decodes to three U+FFFD and breaks maxLength). The mask forbids those bytes after
    it: ids 0xA0..0xBF, word 5 of a packed bitmask row (SURROGATE_WORD)."""
    from tpfuse.model.tokenizer import ByteTokenizer

    return 0xED if isinstance(tokenizer, ByteTokenizer) else None


SURROGATE_WORD = 0xA0 // 32  # ids 0xA0..0xBF, all of it


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]):
    import xgrammar

    from tpfuse.model.tokenizer import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        encoded = [b""] * 0x20 + [bytes([i]) for i in range(0x20, 256)] + [b""] * (vocab_size - 256)
        return xgrammar.TokenizerInfo(
            encoded, xgrammar.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
    hf = getattr(tokenizer, "_tok", None)
    if hf is None:
        raise ValueError(
            f"grammar-constrained decoding does not know the tokenizer {type(tokenizer).__name__}"
        )
    return xgrammar.TokenizerInfo.from_huggingface(
        hf, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
    )
