"""The life of a request: send, regenerate, continue, race, stop; the engine's answers.

A mixin of ``MainWindow`` (it uses the window's widgets, history and controller): the part of the
window that turns what the user asks for into ``ChatRequest``s for the engine thread, streams the
answer into the chat view and the statistics panel, and stores each message in the history, one
transaction per message.
"""

from __future__ import annotations

import dataclasses
import random
from typing import TYPE_CHECKING

from PySide6.QtGui import QGuiApplication

from app.history import HistoryError, Message
from app.prompting import FORMATS
from app.ui.chat_view import origin_runs, runs_of
from app.ui.race import RaceWindow
from app.ui.replies import footer, run_of, shown, streamed_runs
from app.worker.messages import (
    ChatRequest,
    ModelInfo,
    RaceResult,
    ReplyDone,
    ReplyFailed,
    ReplyStarted,
    StepEvent,
)
from speculative.stats import RunStats

if TYPE_CHECKING:
    pass


@dataclasses.dataclass(slots=True)
class Pending:
    """The request the engine is working on."""

    request_id: int
    conversation_id: int
    kind: str                        # "reply", "continue" or "race"
    continued: Message | None = None  # the reply being continued
    runs: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # not drawn yet
    dropped: int = 0



class ReplyFlow:
    """Requests and replies (mixed into ``MainWindow``)."""

    def _send_or_stop(self) -> None:
        if self.pending is not None:
            self.stop()
        else:
            self.send()

    def send_text(self, text: str) -> int | None:
        """Send ``text`` as the user (what pressing Enter does); returns the request id."""
        self.input.setPlainText(text)
        return self.send()

    def send(self) -> int | None:
        if self.pending is not None:
            return None
        # the raw text: toPlainText() turns no-break spaces into spaces, changing what was typed
        # (a string literal, say); blocks are joined by U+2029 in it, lines by "\n" in ours
        text = self.input.document().toRawText().replace("\u2029", "\n")
        if not text.strip():
            return None
        fmt = FORMATS[self._format()]
        if fmt.name == "code" and not text.endswith("\n"):
            text += "\n"  # Enter ends the line: the model writes the next one
        try:
            conv = self._ensure_conversation(text)
            message = self.history.add_message(conv.id, "user", text)
        except HistoryError as exc:
            self.banner.show_message(f"Could not save the message: {exc}")
            return None
        self.input.clear()
        self.chat.add_message(shown(message))
        return self._request("reply")

    def _last_reply(self) -> Message | None:
        """The conversation's last message if it is the model's and no reply is running."""
        if self.pending is not None or self.conversation is None:
            return None
        messages = self.history.messages(self.conversation.id)
        return messages[-1] if messages and messages[-1].role == "assistant" else None

    def regenerate(self) -> None:
        last = self._last_reply()
        if last is None:
            return
        self.history.delete_message(last.id)
        self.chat.drop_last()
        self._request("reply")

    def continue_reply(self) -> None:
        last = self._last_reply()
        if last is not None:
            self._request("continue", continued=last)

    def _request(self, kind: str, continued: Message | None = None) -> int | None:
        assert self.conversation is not None
        messages = self.history.messages(self.conversation.id)
        if kind == "race":
            while messages and messages[-1].role != "user":
                messages.pop()
        if not messages:
            return None
        seed = self.settings.seed if self.settings.seed >= 0 else random.randrange(2**31)
        request = ChatRequest(self.controller.new_id(),
                              tuple((m.role, m.text) for m in messages), self._format(),
                              self.settings, seed, continuing=kind == "continue")
        self.pending = Pending(request.request_id, self.conversation.id, kind, continued)
        self._set_idle(False)
        if kind == "race":
            self.race_window = RaceWindow(FORMATS[self._format()].monospace, self)
            self.race_window.show()
            self.controller.race(request)
        else:
            self.chat.begin_reply(continuing=kind == "continue")
            self.stats.begin_reply(self.settings.mode)
            self.controller.generate(request)
        return request.request_id

    def stop(self) -> None:
        self.controller.stop()

    def race(self) -> None:
        if self.pending is None and self.conversation is not None:
            self._request("race")

    def copy_last(self) -> None:
        text = self.chat.last_reply_text()
        if text:
            QGuiApplication.clipboard().setText(text)
            self.status.setText("Copied the last reply")

    # ------------------------------------------------------------------ worker signals
    def _status(self, text: str) -> None:
        self.status.setText(text)

    def _loaded(self, info: ModelInfo) -> None:
        self.info = info
        draft = info.draft or "none"
        self.model_label.setText(f" target: {info.target} · draft: {draft} · "
                                 f"{info.n_ctx}-token window · {info.threads} "
                                 f"thread{'s' if info.threads != 1 else ''} ")
        one = info.verify_ms.get(1)
        note = (f"Speedup is estimated against plain decoding of the same target, timed on "
                f"this machine when the models loaded ({1 / info.plain_seconds_per_token:.0f} "
                f"tokens/s" + (f"; one target pass {one:.1f} ms" if one else "") + "). "
                "Race measures it side by side.")
        self.stats.set_plain_speed(info.plain_seconds_per_token, note)
        if self.conversation is None:
            self._sync_format_widgets()
        if self.banner.kind == "error" and "load" in self.banner.text().lower():
            self.banner.hide()
        self.models_loaded.emit()

    def _load_failed(self, reason: str) -> None:
        self.banner.show_message(f"Could not load the models: {reason}")
        if self.info is None:
            self.model_label.setText(" no model loaded ")
        self.load_failed.emit(reason)

    def _started(self, ev: ReplyStarted) -> None:
        if self.pending is None or ev.request_id != self.pending.request_id:
            return
        self.pending.dropped = ev.dropped
        if ev.dropped:
            self.banner.show_message(
                f"This chat is longer than the model's {self.info.n_ctx if self.info else ''}"
                f"-token window: the oldest {ev.dropped} message(s) were left out of the "
                "prompt.", "warning")
        if self.pending.kind != "race":
            self.stats.begin_reply(ev.mode)

    def _step(self, ev: StepEvent) -> None:
        if self.pending is None or ev.request_id != self.pending.request_id:
            return
        self.pending.runs += ev.pieces
        self.stats.add_step(ev.stats)
        self.step_shown.emit(ev)

    def _draw(self) -> None:
        if self.pending is not None and self.pending.runs:
            self.chat.append_runs(self.pending.runs)
            self.pending.runs = []
        self.stats.refresh()

    def _finished(self, done: ReplyDone) -> None:
        pending = self.pending
        if pending is None or done.request_id != pending.request_id:
            return
        self._draw()
        self.pending = None
        if pending.kind == "continue" and pending.continued is not None:
            old = pending.continued
            text = old.text + done.text
            runs = runs_of(old.text, old.stats.get("origin_runs", [])) + streamed_runs(done)
            tokens, origins = old.tokens + done.tokens, old.origins + done.origins
            run = RunStats(mode=done.mode, steps=run_of(old).steps + done.run.steps)
        else:
            text, runs, tokens, origins, run = (done.text, streamed_runs(done), done.tokens,
                                                done.origins, done.run)
        stats = {**run.summary(), "origin_runs": origin_runs(runs),
                 "format": self._format()}
        if self.info is not None and run.steps:
            stats["estimated_speedup"] = run.estimated_speedup(self.info.plain_seconds_per_token)
        try:
            message = self.history.add_message(pending.conversation_id, "assistant", text,
                                               tokens=tokens, origins=origins,
                                               finish=done.finish, stats=stats, mode=done.mode)
            if pending.continued is not None:
                self.history.delete_message(pending.continued.id)
        except (HistoryError, ValueError) as exc:
            self.banner.show_message(f"Could not save the reply: {exc}")
            message = None
        if self.conversation is not None and self.conversation.id == pending.conversation_id:
            self.chat.end_reply(footer(stats, done.mode, done.finish))
            if message is not None:
                self.chat.messages[-1].created = message.created
        if done.finish == "context":
            self.banner.show_message("The reply reached the end of the context window. The "
                                     "next message will leave out the oldest turns.", "warning")
        self._reload_list()
        self._set_idle(True)
        self.reply_finished.emit(done.request_id)

    def _failed(self, failure: ReplyFailed) -> None:
        pending = self.pending
        request_id, reason, partial = failure.request_id, failure.reason, failure.partial
        if pending is None or request_id != pending.request_id:
            return
        self.pending = None
        if pending.kind == "race":
            if self.race_window is not None:
                self.race_window.failed(reason)
        else:
            self._draw()
            if partial and pending.kind == "reply":  # keep what was written before the failure
                self.history.add_message(pending.conversation_id, "assistant", partial.text,
                                         finish="error", stats={"error": reason})
                self.chat.end_reply(f"stopped by an error: {reason}")
            elif pending.kind == "reply":
                self.chat.drop_last()
            else:
                self.chat.end_reply("")
        self.banner.show_message(reason)
        self._set_idle(True)
        self.reply_finished.emit(request_id)

    def _race_progress(self, request_id: int, mode: str, tokens: int) -> None:
        if self.race_window is not None and self.pending and self.pending.request_id == \
                request_id:
            self.race_window.progress(mode, tokens)

    def _race_finished(self, result: RaceResult) -> None:
        if self.pending is None or result.request_id != self.pending.request_id:
            return
        self.pending = None
        self._set_idle(True)
        if self.race_window is not None and self.conversation is not None:
            messages = self.history.messages(self.conversation.id)
            while messages and messages[-1].role != "user":
                messages.pop()
            prompt = messages[-1].text if messages else ""
            self.race_window.show_result(result, prompt)
        self.race_done.emit()

