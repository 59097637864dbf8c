"""The conversation: messages one after another, the reply streaming in at the end.

A read-only rich-text document. Each reply's tokens are painted by origin (draft tree, n-gram,
target) when the switch is on; the spans are kept per message as (text, origin) runs so that
switching recolours the whole conversation without asking the engine again.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import ClassVar

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QFont, QPalette, QTextBlockFormat, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import QTextBrowser, QWidget

from app.history import Message
from app.replies import Run, footer, runs_of
from app.ui.theme import ORIGIN_COLOURS


@dataclasses.dataclass(slots=True)
class ShownMessage:
    role: str
    runs: list[Run]
    footer: str = ""
    created: float = 0.0


def shown(m: Message) -> ShownMessage:
    """A stored message as the view shows it: a reply's text split by origin, its footer."""
    if m.role == "assistant":
        runs = runs_of(m.text, m.stats.get("origin_runs", []))
        return ShownMessage(m.role, runs, footer(m.stats, m.mode, m.finish or ""), m.created)
    return ShownMessage(m.role, [(m.text, "target")], "", m.created)


class ChatView(QTextBrowser):
    ROLE_NAMES: ClassVar[dict[str, str]] = {"user": "You", "assistant": "Model", "system": "System"}

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setOpenLinks(False)
        self.setUndoRedoEnabled(False)
        self.document().setDocumentMargin(14)
        self.messages: list[ShownMessage] = []
        self.monospace = False
        self.show_origins = True
        self._streaming: ShownMessage | None = None
        self._mono = QFont("monospace")
        self._mono.setStyleHint(QFont.StyleHint.TypeWriter)

    # --- whole conversation ---
    def show_messages(self, messages: list[ShownMessage], monospace: bool) -> None:
        self.messages = list(messages)
        self.monospace = monospace
        self._streaming = None
        self._render()

    def set_show_origins(self, on: bool) -> None:
        self.show_origins = on
        self._render()

    def plain_text_of(self, index: int) -> str:
        return "".join(t for t, _ in self.messages[index].runs)

    def last_reply_text(self) -> str | None:
        for m in reversed(self.messages):
            if m.role == "assistant":
                return "".join(t for t, _ in m.runs)
        return None

    # --- streaming ---
    def add_message(self, message: ShownMessage) -> None:
        self.messages.append(message)
        self._insert(message)
        self._scroll_to_end()

    def begin_reply(self, continuing: bool = False) -> None:
        """Start streaming into a new reply (or onto the end of the last one)."""
        if continuing and self.messages and self.messages[-1].role == "assistant":
            self._streaming = self.messages[-1]
            self._streaming.footer = ""
            self._render()
            self._cursor_to_reply_end()
        else:
            self._streaming = ShownMessage("assistant", [], created=_now())
            self.messages.append(self._streaming)
            self._insert_header(self._streaming)
            self._start_body()
        self._scroll_to_end()

    def append_runs(self, runs: list[Run]) -> None:
        if self._streaming is None or not runs:
            return
        follow = self._at_end()
        cursor = self._end_cursor()
        for text, origin in runs:
            if text:
                self._streaming.runs.append((text, origin))
                cursor.insertText(text, self._char_format(origin))
        if follow:
            self._scroll_to_end()

    def end_reply(self, footer: str, runs: list[Run] | None = None,
                  created: float | None = None) -> None:
        """The streamed reply is over: its footer, and the reply as stored (``runs``: its
        whole text by origin; ``created``: when it was stored), where they are known."""
        if self._streaming is None:
            return
        self._streaming.footer = footer
        if runs is not None:
            self._streaming.runs = [r for r in runs if r[0]]
        if created is not None:
            self._streaming.created = created
        self._streaming = None
        self._render()
        self._scroll_to_end()

    def drop_last(self) -> None:
        """Remove the last message (Regenerate replaces a reply)."""
        if self.messages:
            self.messages.pop()
        self._streaming = None
        self._render()

    # --- rendering ---
    def _render(self) -> None:
        bar = self.verticalScrollBar()
        was_at_end = self._at_end()
        position = bar.value()
        self.clear()
        for m in self.messages:
            if m is self._streaming:
                self._insert_header(m)
                self._start_body()
                cursor = self._end_cursor()
                for text, origin in m.runs:
                    cursor.insertText(text, self._char_format(origin))
            else:
                self._insert(m)
        if was_at_end:
            self._scroll_to_end()
        else:
            bar.setValue(position)

    def _insert(self, m: ShownMessage) -> None:
        self._insert_header(m)
        self._start_body(code=self.monospace)
        cursor = self._end_cursor()
        for text, origin in m.runs:
            cursor.insertText(text, self._char_format(origin if m.role == "assistant"
                                                      else "target"))
        if m.footer:
            block = QTextBlockFormat()
            block.setTopMargin(4)
            cursor.insertBlock(block)
            fmt = QTextCharFormat()
            fmt.setForeground(self.palette().color(QPalette.ColorRole.PlaceholderText))
            fmt.setFontPointSize(max(7.0, self.font().pointSizeF() - 1.5))
            cursor.insertText(m.footer, fmt)

    def _insert_header(self, m: ShownMessage) -> None:
        cursor = self._end_cursor()
        block = QTextBlockFormat()
        block.setTopMargin(14 if not self.document().isEmpty() else 0)
        block.setBottomMargin(2)
        if self.document().isEmpty():
            cursor.setBlockFormat(block)
        else:
            cursor.insertBlock(block)
        fmt = QTextCharFormat()
        fmt.setFontWeight(QFont.Weight.Bold)
        colour = QColor(48, 112, 220) if m.role == "user" else self.palette().color(
            QPalette.ColorRole.Text)
        fmt.setForeground(colour)
        when = datetime.datetime.fromtimestamp(m.created).strftime("%H:%M") if m.created else ""
        cursor.insertText(self.ROLE_NAMES.get(m.role, m.role), fmt)
        if when:
            small = QTextCharFormat()
            small.setForeground(self.palette().color(QPalette.ColorRole.PlaceholderText))
            cursor.insertText(f"  {when}", small)

    def _start_body(self, code: bool | None = None) -> None:
        code = self.monospace if code is None else code
        cursor = self._end_cursor()
        block = QTextBlockFormat()
        if code:
            block.setBackground(self.palette().color(QPalette.ColorRole.AlternateBase))
            block.setLeftMargin(6)
        cursor.insertBlock(block, self._char_format("target"))

    def _char_format(self, origin: str) -> QTextCharFormat:
        fmt = QTextCharFormat()
        if self.monospace:
            fmt.setFont(self._mono)
        fmt.setForeground(self.palette().color(QPalette.ColorRole.Text))
        if self.show_origins and origin in ORIGIN_COLOURS and origin != "target":
            fmt.setBackground(ORIGIN_COLOURS[origin])
        return fmt

    def _end_cursor(self) -> QTextCursor:
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        return cursor

    def _cursor_to_reply_end(self) -> None:
        self.setTextCursor(self._end_cursor())

    def _at_end(self) -> bool:
        bar = self.verticalScrollBar()
        return bar.value() >= bar.maximum() - 4

    def _scroll_to_end(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

    def keyPressEvent(self, event) -> None:
        if event.key() == Qt.Key.Key_End:
            self._scroll_to_end()
            return
        super().keyPressEvent(event)


def _now() -> float:
    return datetime.datetime.now().timestamp()
