"""OpenAI's response and chunk shapes for completions and chat completions, and the
``speculation`` object each answer carries (extension fields a plain OpenAI client ignores).

The statistics are ``speculative.stats``'s, as the app shows them: ``RunStats.summary()`` and
the estimated speedup over plain decoding of the same target.
"""

from __future__ import annotations

import json
import time
import uuid
from itertools import groupby
from typing import Any

from app.server.jobs import Finished
from speculative.stats import RunStats

# the engine's ways of ending, in OpenAI's words: the window's end is a length limit too
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length"}


def speculation(run: RunStats) -> dict[str, Any]:
    """What the speculation did for one request: ``RunStats.summary()`` (mode, tau, acceptance
    by depth, tokens by origin, draft calls per target pass, the time split, tokens/s) and
    ``estimated_speedup`` over plain decoding (``RunStats.estimated_speedup``; null when no
    step could be priced)."""
    speedup = run.estimated_speedup()
    return {**run.summary(), "estimated_speedup": speedup if speedup > 0 else None}


def usage(done: Finished) -> dict[str, int]:
    """Tokens of the prompt and tokens the engine generated (those a stop string cut from the
    text included: they were decoded, and the speculation's origins count them)."""
    completion = done.run.tokens
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": completion,
            "total_tokens": done.prompt_tokens + completion}


class Answer:
    """One request's answer: its id and time, and every shape it is sent in."""

    def __init__(self, endpoint: str, model: str) -> None:
        self.chat = endpoint == "chat"
        prefix = "chatcmpl" if self.chat else "cmpl"
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def _head(self, streamed: bool) -> dict[str, Any]:
        if self.chat:
            kind = "chat.completion.chunk" if streamed else "chat.completion"
        else:
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, done: Finished) -> dict[str, Any]:
        """The non-streamed response."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH_REASONS[done.finish],
                                  "logprobs": None}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": done.text}
        else:
            choice["text"] = done.text
        return {**self._head(False), "choices": [choice], "usage": usage(done),
                "speculation": speculation(done.run)}

    def _chunk(self, text: str | None, finish: str | None = None,
               origin: str | None = None, role: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        if origin is not None:
            choice["origin"] = origin
        return {**self._head(True), "choices": [choice]}

    def opening(self) -> list[dict[str, Any]]:
        """A chat stream starts with the assistant's role, as OpenAI's does."""
        return [self._chunk("", role=True)] if self.chat else []

    def pieces(self, pieces: list[tuple[str, str]], with_origin: bool) -> list[dict[str, Any]]:
        """Chunks for one step's (text, origin) pieces: one chunk, or with ``with_origin`` one
        per run of tokens from the same stage, each saying which."""
        if not with_origin:
            text = "".join(t for t, _ in pieces)
            return [self._chunk(text)] if text else []
        runs = [(origin, "".join(t for t, _ in group))
                for origin, group in groupby(pieces, key=lambda p: p[1])]
        return [self._chunk(text, origin=origin) for origin, text in runs if text]

    def closing(self, done: Finished, include_usage: bool) -> list[dict[str, Any]]:
        """The chunk with the finish reason, and with ``include_usage`` one more with the
        usage and no choices (as OpenAI sends it); the last carries ``speculation``."""
        chunks = [self._chunk(None if self.chat else "", FINISH_REASONS[done.finish])]
        if include_usage:
            chunks.append({**self._head(True), "choices": [], "usage": usage(done)})
        chunks[-1]["speculation"] = speculation(done.run)
        return chunks


def sse(data: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


DONE = sse("[DONE]")
