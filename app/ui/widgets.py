"""Small widgets: the prompt box (Enter sends, Shift+Enter adds a line) and the message banner."""

from __future__ import annotations

from typing import ClassVar

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPlainTextEdit, QToolButton, QWidget


class PromptEdit(QPlainTextEdit):
    submitted = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setTabChangesFocus(False)
        self.setMaximumHeight(140)
        self.setMinimumHeight(60)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        enter = event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
        if enter and not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.submitted.emit()
            return
        if enter:  # Shift+Enter: a new line (Qt would insert a line separator instead)
            self.insertPlainText("\n")
            return
        if event.key() == Qt.Key.Key_Tab:  # code: a tab key indents with spaces
            self.insertPlainText("    ")
            return
        super().keyPressEvent(event)


class Banner(QFrame):
    """A dismissable line at the top of the chat: errors in red, notices in amber."""

    STYLES: ClassVar[dict[str, tuple[str, str, str]]] = {"error": ("#fde8e8", "#8a1c1c", "#e8a0a0"),
              "warning": ("#fff4d6", "#6b4e00", "#e6c877"),
              "info": ("#e6f0ff", "#1d3f73", "#a9c4ef")}

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.label = QLabel()
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        close = QToolButton()
        close.setText("✕")
        close.setAutoRaise(True)
        close.setToolTip("Dismiss")
        close.clicked.connect(self.hide)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(10, 6, 6, 6)
        layout.addWidget(self.label, 1)
        layout.addWidget(close)
        self.kind = ""
        self.hide()

    def show_message(self, text: str, kind: str = "error") -> None:
        back, fore, border = self.STYLES.get(kind, self.STYLES["info"])
        self.kind = kind
        self.setStyleSheet(f"Banner {{ background: {back}; border: 1px solid {border}; "
                           f"border-radius: 4px; }} QLabel {{ color: {fore}; }} "
                           f"QToolButton {{ color: {fore}; }}")
        self.label.setText(text)
        self.show()

    def text(self) -> str:
        return self.label.text() if not self.isHidden() else ""
