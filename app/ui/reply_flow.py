"""The life of a request: send, regenerate, continue, race, stop; the engine's answers.

``ReplyController`` turns what the user asks for into ``ChatRequest``s for the engine's thread,
streams the answer into the chat view and the statistics panel, and stores each message in the
history, one transaction per message. The main window owns it and hands it its collaborators;
it knows the window only through the callables it was given.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

from PySide6.QtCore import QObject, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QLabel, QWidget

from app.history import History, HistoryError, Message
from app.prompting import FORMATS
from app.replies import Run, continued, reply_stats, runs_of, stored_run
from app.settings import AppSettings
from app.ui.chat_view import ChatView, shown
from app.ui.race import RaceWindow
from app.ui.stats_panel import StatsPanel
from app.ui.widgets import Banner
from app.worker.messages import (
    ChatRequest,
    ModelInfo,
    RaceResult,
    ReplyDone,
    ReplyFailed,
    ReplyStarted,
    StepEvent,
)
from app.worker.thread import EngineController
from speculative.stats import RunStats


@dataclasses.dataclass(slots=True)
class Pending:
    """The request the engine is working on."""

    request_id: int
    conversation_id: int
    kind: str                        # "reply", "continue" or "race"
    continued: Message | None = None  # the reply being continued
    runs: list[Run] = dataclasses.field(default_factory=list)  # streamed, not drawn yet
    dropped: int = 0                 # oldest messages the prompt left out


class ReplyController(QObject):
    reply_finished = Signal(int)   # request id: a reply was stored (or failed)
    step_shown = Signal(object)    # a StepEvent of the current reply, on the GUI thread
    race_done = Signal()
    busy_changed = Signal(bool)    # a request started (True) or ended (False)
    stored = Signal(int)           # conversation id: a message was stored in it

    def __init__(self, *, history: History, engine: EngineController, chat: ChatView,
                 stats: StatsPanel, banner: Banner, status: QLabel,
                 settings: Callable[[], AppSettings], prompt_format: Callable[[], str],
                 shown_conversation: Callable[[], int | None],
                 models: Callable[[], ModelInfo | None], parent: QWidget) -> None:
        super().__init__(parent)
        self.history, self.engine = history, engine
        self.chat, self.stats, self.banner, self.status = chat, stats, banner, status
        self._settings, self._format = settings, prompt_format
        self._shown, self._models = shown_conversation, models
        self._parent = parent  # the race window's
        self.pending: Pending | None = None
        self.race_window: RaceWindow | None = None
        w = engine.worker
        w.started.connect(self._started)
        w.step.connect(self._step)
        w.finished.connect(self._finished)
        w.failed.connect(self._failed)
        w.race_progress.connect(self._race_progress)
        w.race_finished.connect(self._race_finished)

    # ------------------------------------------------------------------ requests
    def send(self, conversation_id: int, text: str) -> int | None:
        """Store ``text`` as the user's message and ask for a reply; the request id."""
        if self.pending is not None:
            return None
        try:
            message = self.history.add_message(conversation_id, "user", text)
        except HistoryError as exc:
            self.banner.show_message(f"Could not save the message: {exc}")
            return None
        self.chat.add_message(shown(message))
        return self._request(conversation_id, "reply")

    def regenerate(self, conversation_id: int) -> None:
        last = self._last_reply(conversation_id)
        if last is None:
            return
        self.history.delete_message(last.id)
        self.chat.drop_last()
        self.stats.show_conversation(self._replies(conversation_id))
        self._request(conversation_id, "reply")

    def continue_reply(self, conversation_id: int) -> None:
        last = self._last_reply(conversation_id)
        if last is not None:
            self._request(conversation_id, "continue", continued=last)

    def race(self, conversation_id: int) -> None:
        if self.pending is None:
            self._request(conversation_id, "race")

    def stop(self) -> None:
        self.engine.stop()

    def copy_last(self) -> None:
        text = self.chat.last_reply_text()
        if text:
            QGuiApplication.clipboard().setText(text)
            self.status.setText("Copied the last reply")

    def draw(self) -> None:
        """Show what streamed since the last frame (the window's timer paces this)."""
        if self.pending is not None and self.pending.runs:
            self.chat.append_runs(self.pending.runs)
            self.pending.runs = []
        self.stats.refresh()

    def _last_reply(self, conversation_id: int) -> Message | None:
        """The conversation's last message if it is the model's and no reply is running."""
        if self.pending is not None:
            return None
        messages = self.history.messages(conversation_id)
        return messages[-1] if messages and messages[-1].role == "assistant" else None

    def _replies(self, conversation_id: int) -> list[dict]:
        return [m.stats for m in self.history.messages(conversation_id) if m.role == "assistant"]

    def _request(self, conversation_id: int, kind: str,
                 continued: Message | None = None) -> int | None:
        messages = self.history.messages(conversation_id)
        raced = 0  # the length of the reply a race races (0: none, the settings' length)
        if kind == "race":
            while messages and messages[-1].role != "user":
                raced = len(messages.pop().tokens)
        if not messages:
            return None
        settings = self._settings()
        if raced:  # the race measures the reply the meter estimated: its tokens, no more
            settings = dataclasses.replace(settings, max_tokens=raced)
        seed = settings.seed if settings.seed >= 0 else random.randrange(2**31)
        request = ChatRequest(self.engine.new_id(), tuple((m.role, m.text) for m in messages),
                              self._format(), settings, seed, continuing=kind == "continue")
        self.pending = Pending(request.request_id, conversation_id, kind, continued)
        self.busy_changed.emit(True)
        if kind == "race":
            self.race_window = RaceWindow(FORMATS[request.format].monospace, self._parent)
            self.race_window.show()
            self.engine.race(request)
        else:
            self.chat.begin_reply(continuing=kind == "continue")
            self.stats.begin_reply(self._before(settings.mode))
            self.engine.generate(request)
        return request.request_id

    def _before(self, mode: str) -> RunStats:
        """The statistics a streaming reply starts from: the continued reply's steps."""
        assert self.pending is not None
        old = self.pending.continued
        return continued(stored_run(old.stats) if old else None, RunStats(mode=mode))

    def _shows_pending(self) -> bool:
        return self.pending is not None and self._shown() == self.pending.conversation_id

    # ------------------------------------------------------------------ the engine's answers
    def _started(self, ev: ReplyStarted) -> None:
        if self.pending is None or ev.request_id != self.pending.request_id:
            return
        self.pending.dropped = ev.dropped
        if ev.dropped:
            info = self._models()
            self.banner.show_message(
                f"This chat is longer than the model's {info.n_ctx if info else ''}"
                f"-token window: the oldest {ev.dropped} message(s) were left out of the "
                "prompt.", "warning")
        if self.pending.kind != "race" and self._shows_pending():
            self.stats.begin_reply(self._before(ev.mode))

    def _step(self, ev: StepEvent) -> None:
        if self.pending is None or ev.request_id != self.pending.request_id:
            return
        self.pending.runs += ev.pieces
        self.stats.add_step(ev.stats)
        self.step_shown.emit(ev)

    def _finished(self, done: ReplyDone) -> None:
        pending = self.pending
        if pending is None or done.request_id != pending.request_id:
            return
        self.draw()
        shows = self._shows_pending()
        self.pending = None
        message = self._store(pending, done)
        if shows:
            self._show_stored(message, pending.conversation_id)
        if done.finish == "context":
            self.banner.show_message("The reply reached the end of the context window. The "
                                     "next message will leave out the oldest turns.", "warning")
        self.stored.emit(pending.conversation_id)
        # the reply is over: say so now, not when the worker has put away what the engine
        # learned from it (its own status, if it does more between replies, follows this)
        self.status.setText("Ready")
        self.busy_changed.emit(False)
        self.reply_finished.emit(done.request_id)

    def _store(self, pending: Pending, done: ReplyDone, error: str = "") -> Message | None:
        """Store the reply (a continued one replaces the reply it continues); None if the
        history refused it, which the banner says."""
        old = pending.continued
        text, tokens, origins, run = done.text, done.tokens, done.origins, done.run
        runs = [(t, o) for t, o in done.pieces if t]
        if old is not None:
            text, tokens, origins = old.text + text, old.tokens + tokens, old.origins + origins
            runs = runs_of(old.text, old.stats.get("origin_runs", [])) + runs
            run = continued(stored_run(old.stats), run)
        info = self._models()
        stats = reply_stats(run, info.plain_seconds_per_token if info else 0.0, runs,
                            self._format(), error)
        try:
            message = self.history.add_message(pending.conversation_id, "assistant", text,
                                               tokens=tokens, origins=origins,
                                               finish=done.finish, stats=stats, mode=done.mode)
            if old is not None:
                self.history.delete_message(old.id)
        except (HistoryError, ValueError) as exc:
            self.banner.show_message(f"Could not save the reply: {exc}")
            return None
        return message

    def _show_stored(self, message: Message | None, conversation_id: int) -> None:
        """End the streamed reply as it was stored: its text by origin, its footer, and the
        statistics panel as reopening the conversation would show it."""
        if message is None:
            self.chat.end_reply("")
            return
        view = shown(message)
        self.chat.end_reply(view.footer, view.runs, view.created)
        self.stats.show_conversation(self._replies(conversation_id))

    def _failed(self, failure: ReplyFailed) -> None:
        pending = self.pending
        if pending is None or failure.request_id != pending.request_id:
            return
        if pending.kind != "race":
            self.draw()
        shows = self._shows_pending()
        self.pending = None
        if pending.kind == "race":
            if self.race_window is not None:
                self.race_window.failed(failure.reason)
        elif failure.partial is not None and pending.kind == "reply":
            # keep what was written before the failure
            message = self._store(pending, failure.partial, failure.reason)
            if shows:
                self._show_stored(message, pending.conversation_id)
            self.stored.emit(pending.conversation_id)
        elif pending.kind == "reply":
            self.chat.drop_last()
        else:
            self.chat.end_reply("")
        self.banner.show_message(failure.reason)
        self.busy_changed.emit(False)
        self.reply_finished.emit(failure.request_id)

    def _race_progress(self, request_id: int, mode: str, tokens: int) -> None:
        if self.race_window is not None and self.pending and self.pending.request_id == \
                request_id:
            self.race_window.progress(mode, tokens)

    def _race_finished(self, result: RaceResult) -> None:
        pending = self.pending
        if pending is None or result.request_id != pending.request_id:
            return
        self.pending = None
        self.busy_changed.emit(False)
        self.stats.set_race(result.speculative.mode, result.speedup, result.tokens,
                            result.temperature)
        if self.race_window is not None:
            messages = self.history.messages(pending.conversation_id)
            while messages and messages[-1].role != "user":
                messages.pop()
            self.race_window.show_result(result, messages[-1].text if messages else "")
        self.race_done.emit()
