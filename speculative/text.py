"""Tokens in, text out, as a reply streams: the one incremental decoder every stream uses.

A token is a run of bytes, and a UTF-8 character may be split between tokens: each token's text
is what the decoder can say once that token's bytes arrived (a split character appears with the
token that completes it). The reply ends at the earliest stop string; text that could still
become the start of one (a ``"\\ndef "`` arriving over several tokens) is held back until it
cannot.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index in ``text`` where the reply ends (the earliest stop string), or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of ``text`` could be the start of a stop string: they are
    shown only once it is clear they are not one."""
    keep = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                keep = max(keep, n)
                break
    return keep


class TextStream:
    """A reply's text as its tokens arrive (see the module docstring)."""

    def __init__(self, piece: Callable[[int], bytes], stops: Sequence[str] = ()) -> None:
        self._piece = piece
        self._stops = tuple(stops)
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._decoded: list[tuple[str, str, int]] = []  # (text, origin, token) of each token
        self.text = ""  # the reply so far, cut at a stop string
        self.stopped = False  # a stop string ended it
        self._shown = 0  # characters of ``text`` handed out by ``feed``

    def feed(self, tokens: Sequence[int], origins: Sequence[str] | None = None,
             final: bool = False) -> list[tuple[str, str]]:
        """Add a step's tokens (who proposed each: ``stats.ORIGINS``); the new (text, origin)
        pieces that are now safe to show. ``final``: the reply ends with these tokens (a
        character cut by its end becomes U+FFFD, and nothing is held back any more)."""
        if self.stopped:
            return []
        origins = origins if origins is not None else ["target"] * len(tokens)
        for token, origin in zip(tokens, origins, strict=True):
            self._decoded.append((self._decoder.decode(self._piece(token)), origin, token))
        if final:
            tail = self._decoder.decode(b"", final=True)
            if tail:
                self._decoded.append((tail, self._decoded[-1][1] if self._decoded
                                      else "target", -1))
        text = "".join(t for t, _, _ in self._decoded)
        stop_at = find_stop(text, self._stops)
        if stop_at is not None:
            text, self.stopped = text[:stop_at], True
        self.text = text
        end = len(text) if final or self.stopped else len(text) - held_back(text, self._stops)
        pieces = self._slice(self._shown, max(end, self._shown))
        self._shown = max(end, self._shown)
        return pieces

    def pieces(self) -> list[tuple[str, str]]:
        """The whole reply as (text, origin) pieces."""
        return self._slice(0, len(self.text))

    def kept(self) -> list[tuple[int, str]]:
        """(token, origin) of the tokens whose text lies within the reply (a token cut by a
        stop string is not among them)."""
        out, at = [], 0
        for text, origin, token in self._decoded:
            at += len(text)
            if at > len(self.text):
                break
            if token >= 0:
                out.append((token, origin))
        return out

    def _slice(self, start: int, end: int) -> list[tuple[str, str]]:
        """The (text, origin) pieces covering characters [start, end) of the decoded tokens."""
        out, at = [], 0
        for text, origin, _ in self._decoded:
            lo, hi = max(start, at), min(end, at + len(text))
            if lo < hi:
                out.append((text[lo - at:hi - at], origin))
            at += len(text)
        return out
