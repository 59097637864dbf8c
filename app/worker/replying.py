"""One reply: its prompt from the conversation, the engine's steps with the settings the user
changed mid-reply applied between them, and its text streamed through ``TextStream``.

Plain Python, run on the engine's thread by ``EngineWorker``; what it yields becomes signals
there.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

from app.prompting import FORMATS, Prompt, PromptFormat, chat_prompt
from app.settings import AppSettings
from app.worker.messages import ChatRequest, ReplyDone, StepEvent
from speculative.engine import Engine, Step
from speculative.loading import ModelPair
from speculative.stats import RunStats
from speculative.text import TextStream

log = logging.getLogger(__name__)


class LiveSettings:
    """Settings the GUI thread hands over while a reply runs; the engine's thread takes them
    between steps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next: AppSettings | None = None

    def offer(self, settings: AppSettings) -> None:
        with self._lock:
            self._next = settings

    def take(self) -> AppSettings | None:
        with self._lock:
            settings, self._next = self._next, None
        return settings


def prompt_for(pair: ModelPair, engine: Engine, request: ChatRequest) -> Prompt:
    """The request's conversation as tokens, fitted into the engine's window."""
    return chat_prompt(request.format, request.messages, pair.target.vocab.tokenize,
                       engine.target.ctx.n_ctx, request.settings.max_tokens, request.continuing)


def steps(engine: Engine, pair: ModelPair, request: ChatRequest, prompt: Prompt,
          live: LiveSettings, cancelled: Callable[[], bool], run: RunStats,
          stop_at_end_of_text: bool = True) -> Iterator[Step]:
    """The engine's steps for ``request``; settings offered to ``live`` apply from the next
    step (sampling keeps the reply's seed, so its random stream goes on). Without
    ``stop_at_end_of_text`` the reply runs on past the model's end-of-text token, to its
    length limit or the end of the window."""
    fmt = FORMATS[request.format]
    params = request.settings.sampling(request.seed, fmt)
    engine.sampling = None
    stop = {pair.target.vocab.eos} if stop_at_end_of_text else set()
    generated = engine.generate(prompt.tokens, request.settings.max_tokens, params,
                                stop=stop, cancel=cancelled, run=run)
    try:
        with contextlib.closing(generated):
            for step in generated:
                yield step
                changed = live.take()
                if changed is not None:
                    _apply(engine, changed, request.seed, fmt)
    finally:
        engine.sampling = None  # mid-reply changes are in the settings of the next reply


def _apply(engine: Engine, settings: AppSettings, seed: int, fmt: PromptFormat) -> None:
    engine.sampling = settings.sampling(seed, fmt)  # the sampler's settings: next step
    spec = settings.spec()
    try:
        engine.check(spec)
    except ValueError as exc:  # needs bigger contexts: applies when the next reply reloads
        log.info("settings wait for the next reply: %s", exc)
        return
    engine.config = spec


class Reply:
    """A reply as it streams: its text (shown once it cannot be the start of a stop string;
    the reply ends before the stop), the statistics of its steps, and how it ended."""

    def __init__(self, request: ChatRequest, pair: ModelPair, engine: Engine) -> None:
        self.request_id = request.request_id
        self.engine = engine
        self.text = TextStream(pair.target.vocab.piece, FORMATS[request.format].stops)
        self.run = RunStats()
        self.finish = "length"

    def stream(self, steps: Iterator[Step]) -> Iterator[StepEvent]:
        """One event per step, until the engine finishes or a stop string ends the text."""
        for step in steps:
            pieces = self.text.feed(step.tokens, step.origins, final=step.finish is not None)
            # a cancel before a step began is no step (the run does not count it)
            if pieces or step.tokens or step.finish != "cancelled":
                yield StepEvent(self.request_id, pieces, step.tokens, step.stats)
            if step.finish is not None or self.text.stopped:
                self.finish = "stop" if self.text.stopped else step.finish
                return

    def done(self) -> ReplyDone:
        """The reply so far, with the mode the engine ended it in (a setting changed mid-reply
        applies from the next step)."""
        kept = self.text.kept()
        return ReplyDone(self.request_id, self.text.text, [t for t, _ in kept],
                         [o for _, o in kept], self.finish, self.run,
                         self.engine.config.mode.value, self.text.pieces())

    def partial(self) -> ReplyDone | None:
        """What streamed before a failure (text held back for a stop string included: no stop
        came), or None when nothing did."""
        self.text.feed([], final=True)
        if not self.text.text:
            return None
        self.finish = "error"
        return self.done()
