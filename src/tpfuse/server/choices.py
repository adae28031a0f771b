"""A request's n choices: one Generation each, collected into a full response or interleaved into one
SSE stream. Choice i of a seeded request samples with seed + i, so the n answers differ and each is
reproducible. With tools, a choice's text becomes `tool_calls` when it parses as calls (tool_calls.py);
its stream then holds the text back and sends the calls (or the text) in one delta at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

from tpfuse.server import responses, tool_calls
from tpfuse.server.generation import Generation
from tpfuse.server.protocol import GenerateRequest

# JSON leaves these raw, and clients that split lines on them (NEL, LINE/PARAGRAPH SEPARATOR) break.
_SSE_ESCAPES = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})
_encode = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode  # built once, not per event


def sse(obj) -> str:
    """One SSE event whose data is obj as JSON on one line, whatever the text holds."""
    data = _encode(obj)
    if "\u0085" in data or "\u2028" in data or "\u2029" in data:
        data = data.translate(_SSE_ESCAPES)
    return "data: " + data + "\n\n"


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice index: seed + index, wrapped into int64."""
    if seed is None:
        return None
    return (seed + index + (1 << 63)) % (1 << 64) - (1 << 63)


class Choices:
    """The n Generations of one request (gens[i] is choice i) and the tokenizer of their logprobs."""

    def __init__(self, gens: list[Generation], req: GenerateRequest, tokenizer):
        self.gens = gens
        self.req = req
        self.tokenizer = tokenizer

    async def start(self) -> None:
        """Starts every choice; if one fails (a rejection), aborts the others and raises its error."""
        results = await asyncio.gather(*(g.start() for g in self.gens), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for g in self.gens:
                g._abort()
            raise errors[0]

    def usage(self) -> dict:
        first = self.gens[0]
        completion = sum(g.num_completion_tokens for g in self.gens)
        return responses.usage(first.num_prompt_tokens, completion, first.num_cached_tokens)

    def _logprobs(self, entries, text_offset: int = 0):
        if self.req.logprobs is None:
            return None
        if self.req.kind == "chat":
            return responses.chat_logprobs(entries, self.tokenizer)
        return responses.completion_logprobs(entries, self.tokenizer, text_offset)

    def _message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The chat message of a finished choice (tool_calls when its text parses as calls)."""
        calls = tool_calls.parse(text, self.req.tools) if self.req.tools is not None else None
        if calls is None:
            return {"role": "assistant", "content": text}, finish_reason
        return {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"

    async def complete(self) -> dict:
        """The full response body once every choice has finished."""

        async def collect(gen: Generation):
            texts, entries = [], []
            async for piece in gen.pieces():
                texts.append(piece.text)
                entries += piece.logprobs
            return "".join(texts), entries

        results = await asyncio.gather(*(collect(g) for g in self.gens))
        choices = []
        for index, (gen, (text, entries)) in enumerate(zip(self.gens, results, strict=True)):
            choice = {"index": index}
            reason = gen.finish_reason
            if self.req.kind == "chat":
                choice["message"], reason = self._message(text, reason)
            else:
                choice["text"] = text
            choice.update(logprobs=self._logprobs(entries), finish_reason=reason)
            choices.append(choice)
        req = self.req
        obj = "chat.completion" if req.kind == "chat" else "text_completion"
        first = self.gens[0]
        return {"id": first.request_id.rsplit("-", 1)[0], "object": obj, "created": responses.now(),
                "model": req.model, "choices": choices, "usage": self.usage()}  # fmt: skip

    async def stream(self, response_id: str):
        """SSE events: chunks of every choice as their text arrives (choice index in each), the usage
        chunk when asked for, then [DONE]. The caller turns an EngineDied into an error event."""
        req = self.req
        created = responses.now()
        held = ["" for _ in self.gens]
        first = [True for _ in self.gens]
        offsets = [0 for _ in self.gens]
        pieces = self._pieces()
        try:
            async for index, piece in pieces:
                text, reason = piece.text, piece.finish_reason
                if req.tools is not None:  # calls are known only at the end
                    held[index] += text
                    text = ""
                    if reason is not None:
                        delta, reason = self._message(held[index], reason)
                        delta.pop("role")
                        if delta.get("tool_calls"):
                            delta["tool_calls"] = [
                                {"index": k, **c} for k, c in enumerate(delta["tool_calls"])
                            ]
                        yield sse(self._chunk(response_id, created, index, delta, reason, first[index]))
                        first[index] = False
                        continue
                if not text and reason is None and not req.continuous_usage and not piece.logprobs:
                    continue
                logprobs = self._logprobs(piece.logprobs, offsets[index])
                offsets[index] += len(text)
                delta = {"content": text} if req.kind == "chat" else text
                chunk = self._chunk(response_id, created, index, delta, reason, first[index], logprobs)
                if req.continuous_usage:
                    chunk["usage"] = self.usage()
                first[index] = False
                yield sse(chunk)
            if req.include_usage:
                yield sse(responses.usage_chunk(req.kind, response_id, created, req.model, self.usage()))
        finally:
            await pieces.aclose()
            for gen in self.gens:
                gen._abort()

    async def _pieces(self):
        """(choice index, Piece) as each choice's pieces arrive. One choice is read directly (no
        task or queue between the engine's outputs and the stream); n choices are pumped by one task
        each into a shared queue. An EngineDied of any choice ends the whole stream."""
        if len(self.gens) == 1:
            async for piece in self.gens[0].pieces():
                yield 0, piece
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, gen: Generation):
            try:
                async for piece in gen.pieces():
                    await queue.put((index, piece, None))
            except Exception as exc:  # EngineDied
                await queue.put((index, None, exc))
                return
            await queue.put((index, None, None))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(self.gens)]
        running = len(tasks)
        try:
            while running:
                index, piece, error = await queue.get()
                if error is not None:
                    raise error
                if piece is None:
                    running -= 1
                    continue
                yield index, piece
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    def _chunk(self, response_id, created, index, delta, reason, first, logprobs=None) -> dict:
        req = self.req
        if req.kind == "chat":
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": index, "delta": delta}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": index, "text": delta}
            obj = "text_completion"
        choice.update(logprobs=logprobs, finish_reason=reason)
        return {"id": response_id, "object": obj, "created": created, "model": req.model, "choices": [choice]}
