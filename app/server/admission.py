"""The bounded queue in front of the engine, and the counts the app and ``/health`` show.

One engine decodes one request at a time, in arrival order; a request is admitted while fewer
than ``limit`` are waiting or running, and refused otherwise (503 with ``Retry-After``) rather
than left to hang. A request leaves when the engine's thread has finished with it.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable


@dataclasses.dataclass(frozen=True, slots=True)
class Counts:
    in_flight: int = 0   # admitted requests waiting or running
    answered: int = 0    # generated to the end (a stop, the length limit or the window's end)
    cancelled: int = 0   # stopped because the client went away
    failed: int = 0      # refused by the engine's thread (a prompt too long, an error)
    refused: int = 0     # turned away: the queue was full


class Admission:
    """Thread-safe: the HTTP side enters, the engine's thread leaves. ``on_change`` is called
    with the new counts, on whichever thread changed them."""

    # weight of the newest request in the running mean of request seconds
    _DECAY = 0.2

    def __init__(self, limit: int, on_change: Callable[[Counts], None] = lambda c: None) -> None:
        if limit < 1:
            raise ValueError(f"the queue must hold at least one request, got {limit}")
        self.limit = limit
        self.on_change = on_change
        self._lock = threading.Lock()
        self._counts = Counts()
        self._seconds = 1.0  # running mean of a request's time on the engine

    @property
    def counts(self) -> Counts:
        return self._counts

    def enter(self) -> int | None:
        """Admit a request: None, or the seconds to wait before retrying when the queue is
        full (the queue's expected time to drain, at least one)."""
        with self._lock:
            c = self._counts
            if c.in_flight >= self.limit:
                self._counts = dataclasses.replace(c, refused=c.refused + 1)
                wait = max(1, math.ceil(c.in_flight * self._seconds))
            else:
                self._counts = dataclasses.replace(c, in_flight=c.in_flight + 1)
                wait = None
            counts = self._counts
        self.on_change(counts)
        return wait

    def leave(self, outcome: str, seconds: float | None = None) -> None:
        """A request is done with: ``outcome`` is "answered", "cancelled" or "failed";
        ``seconds`` its time on the engine, if it ran."""
        with self._lock:
            c = self._counts
            self._counts = dataclasses.replace(
                c, in_flight=c.in_flight - 1, **{outcome: getattr(c, outcome) + 1})
            if seconds is not None:
                self._seconds += self._DECAY * (seconds - self._seconds)
            counts = self._counts
        self.on_change(counts)
