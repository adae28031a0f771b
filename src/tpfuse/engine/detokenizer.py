"""Incremental detokenization of one request's output, with stop strings.

Text is released only once it is final: a token that ends inside a UTF-8 character (decoding to
U+FFFD) waits for the next one, and the last len(longest stop string) - 1 characters wait until
they cannot begin a stop string. When a stop string appears, the text is cut before it and
`stopped` turns true; the caller then aborts the request and reports finish_reason "stop".
"""

from __future__ import annotations

from collections.abc import Iterable

REPLACEMENT_CHAR = "\ufffd"


class Detokenizer:
    """Turns one request's output token ids into text, piece by piece.

    tokenizer: anything with decode(ids) -> str (tpfuse.model.tokenizer). stop: stop strings.
    Use: `delta = detok.add(new_ids)` after every step; when the request finishes for another
    reason, `detok.flush()` returns the text still held back. `text` is everything released so far.
    """

    def __init__(self, tokenizer, stop: Iterable[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # ids before it are fully turned into _decoded
        self._read_offset = 0  # ids before it are in _decoded
        self._decoded = ""  # text of token_ids[:_read_offset], not yet cut at a stop string
        self.text = ""  # released text
        self.stopped = False

    def add(self, new_token_ids: Iterable[int]) -> str:
        """Appends ids; returns the newly released text ("" while a character or a possible stop
        string is incomplete, and always "" once stopped)."""
        if self.stopped:
            return ""
        self.token_ids.extend(int(t) for t in new_token_ids)
        self._decode_new()
        return self._release(final=False)

    def flush(self) -> str:
        """Releases what is held back (an unfinished character comes out as U+FFFD). Call once at the end."""
        if self.stopped:
            return ""
        if self._read_offset < len(self.token_ids):
            prefix = self.tokenizer.decode(self.token_ids[self._prefix_offset : self._read_offset])
            full = self.tokenizer.decode(self.token_ids[self._prefix_offset :])
            self._decoded += full[len(prefix) :]
            self._read_offset = len(self.token_ids)
        return self._release(final=True)

    def _decode_new(self) -> None:
        # Decoding a window that starts a little before the new ids keeps tokenizers that merge
        # across token boundaries (leading spaces, byte fallback) correct.
        prefix = self.tokenizer.decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self.tokenizer.decode(self.token_ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return
        self._decoded += full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)

    def _release(self, final: bool) -> str:
        start = max(0, len(self.text) - self._hold)  # a stop string may straddle released text
        cut = None
        for s in self.stop:
            i = self._decoded.find(s, start)
            if i != -1 and (cut is None or i < cut):
                cut = i
        if cut is not None:
            self.stopped = True
            end = cut
        elif final:
            end = len(self._decoded)
        else:
            end = max(len(self.text), len(self._decoded) - self._hold)
        delta = self._decoded[len(self.text) : end]
        self.text += delta
        return delta
