"""What crosses between the GUI thread and the engine's thread: requests in, answers out.

Frozen dataclasses, handed over through queued signals; the engine's thread never touches a
widget and the GUI thread never touches the engine.
"""

from __future__ import annotations

import dataclasses

from app.settings import AppSettings
from speculative.divergence import Divergence
from speculative.stats import RunStats, StepStats


@dataclasses.dataclass(frozen=True, slots=True)
class ModelInfo:
    target: str                     # display names
    draft: str | None
    target_path: str
    draft_path: str | None
    builtin: bool                   # the built-in pair (code models)
    n_ctx: int
    threads: tuple[int, int | None]  # llama.cpp threads of the target's and the draft's contexts
    has_ngram: bool
    plain_seconds_per_token: float  # measured plain decoding, for the estimated speedup
    verify_ms: dict[int, float]     # the target's measured cost of verifying n tokens
    load_seconds: float
    system: str = ""                # llama.cpp's build and CPU features
    # flash attention in the target's and the draft's contexts (measured faster here)
    flash_attn: tuple[bool, bool | None] = (True, None)

    def threads_text(self) -> str:
        """The thread counts as the window says them ("2 threads", "2 threads, draft 1")."""
        target, draft = self.threads
        text = f"{target} thread{'s' if target != 1 else ''}"
        return text if draft is None or draft == target else f"{text}, draft {draft}"


@dataclasses.dataclass(frozen=True, slots=True)
class ChatRequest:
    request_id: int
    messages: tuple[tuple[str, str], ...]  # (role, text), oldest first
    format: str                             # a key of app.prompting.FORMATS
    settings: AppSettings
    seed: int
    continuing: bool = False                # continue the last (assistant) message


@dataclasses.dataclass(frozen=True, slots=True)
class ReplyStarted:
    request_id: int
    prompt_tokens: int
    dropped: int          # oldest messages left out of the prompt to fit the window
    mode: str


@dataclasses.dataclass(frozen=True, slots=True)
class StepEvent:
    request_id: int
    pieces: list[tuple[str, str]]   # (text, origin) per emitted token; text may be "" while a
    tokens: list[int]               # multi-byte character is incomplete
    stats: StepStats


@dataclasses.dataclass(frozen=True, slots=True)
class ReplyDone:
    request_id: int
    text: str
    tokens: list[int]
    origins: list[str]
    finish: str           # "stop", "length", "context", "cancelled"; "error" for a partial reply
    run: RunStats
    mode: str
    pieces: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (text, origin)


@dataclasses.dataclass(frozen=True, slots=True)
class ReplyFailed:
    request_id: int
    reason: str                      # for the user
    partial: ReplyDone | None = None  # what the reply had streamed before it failed, if any


@dataclasses.dataclass(frozen=True, slots=True)
class RaceRun:
    mode: str
    text: str
    tokens: list[int]
    timeline: list[tuple[float, str]]  # (seconds since the run's first step began, text added)
    run: RunStats


@dataclasses.dataclass(frozen=True, slots=True)
class RaceResult:
    request_id: int
    plain: RaceRun
    speculative: RaceRun
    # greedy texts that differ: where, and whether the target's own logits tie there
    divergence: Divergence | None = None
    temperature: float = 0.0  # above 0 the two runs are two draws: their texts may differ
    # further rounds of the same race, timed only: (plain's, speculation's) seconds for the
    # ``tokens`` both runs of the first round wrote
    rounds: tuple[tuple[float, float], ...] = ()

    @property
    def identical(self) -> bool:
        return self.plain.tokens == self.speculative.tokens

    @property
    def tokens(self) -> int:
        """The tokens both runs wrote: what the verdict compares."""
        return min(len(self.plain.tokens), len(self.speculative.tokens))

    @property
    def speedup(self) -> float:
        """Plain decoding's seconds over speculation's for the same number of tokens, pooled
        over every round."""
        times = self.round_seconds()
        spec = sum(s for _, s in times)
        return sum(p for p, _ in times) / spec if spec > 0 else 0.0

    def round_speedups(self) -> list[float]:
        """Each round's own speedup, the first round's first: how far apart runs of the same
        work came out on this machine, which the pooled verdict does not show."""
        return [p / s for p, s in self.round_seconds() if s > 0]

    def round_seconds(self) -> list[tuple[float, float]]:
        """(plain's, speculation's) seconds for the ``tokens`` both runs wrote, each round, the
        first round's first; none when they wrote nothing alike."""
        n = self.tokens
        if not n:
            return []
        first = (self.plain.run.seconds_until(n), self.speculative.run.seconds_until(n))
        return [first, *self.rounds]
