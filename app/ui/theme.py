"""Light and dark palettes (Fusion style), following the system's colour scheme by default,
and the colours that mark where each token came from."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QGuiApplication, QPalette
from PySide6.QtWidgets import QApplication

# Origin colours: translucent so that text stays readable on both themes.
ORIGIN_COLOURS = {
    "draft": QColor(66, 133, 244, 70),    # accepted from the draft model's tree
    "ngram": QColor(52, 168, 83, 80),     # accepted from the stage-2 n-gram model
    "target": QColor(0, 0, 0, 0),         # the target's own token: no mark
}
ORIGIN_SOLID = {  # the same hues, opaque, for bars and the legend
    "draft": QColor(66, 133, 244),
    "ngram": QColor(52, 168, 83),
    "target": QColor(150, 150, 150),
}
ORIGIN_LABELS = {"draft": "draft tree", "ngram": "n-gram (stage 2)", "target": "target"}
TIME_COLOURS = {"draft": QColor(66, 133, 244), "stage2": QColor(52, 168, 83),
                "verify": QColor(234, 67, 53), "other": QColor(150, 150, 150)}


def is_dark(theme: str) -> bool:
    if theme in ("light", "dark"):
        return theme == "dark"
    hints = QGuiApplication.styleHints()
    return hints.colorScheme() == Qt.ColorScheme.Dark


def apply_theme(app: QApplication, theme: str) -> None:
    """``theme``: "system", "light" or "dark"."""
    app.setStyle("Fusion")
    app.setPalette(_dark() if is_dark(theme) else _light())


def _light() -> QPalette:
    p = QPalette()
    base, window, text = QColor(255, 255, 255), QColor(245, 246, 248), QColor(28, 30, 33)
    for role, colour in ((QPalette.ColorRole.Window, window), (QPalette.ColorRole.Base, base),
                         (QPalette.ColorRole.AlternateBase, QColor(238, 240, 243)),
                         (QPalette.ColorRole.WindowText, text), (QPalette.ColorRole.Text, text),
                         (QPalette.ColorRole.Button, QColor(236, 238, 241)),
                         (QPalette.ColorRole.ButtonText, text),
                         (QPalette.ColorRole.Highlight, QColor(48, 112, 220)),
                         (QPalette.ColorRole.HighlightedText, QColor(255, 255, 255)),
                         (QPalette.ColorRole.ToolTipBase, QColor(255, 255, 225)),
                         (QPalette.ColorRole.ToolTipText, text),
                         (QPalette.ColorRole.PlaceholderText, QColor(128, 132, 140)),
                         (QPalette.ColorRole.Link, QColor(30, 100, 210))):
        p.setColor(role, colour)
    return p


def _dark() -> QPalette:
    p = QPalette()
    base, window, text = QColor(30, 31, 34), QColor(40, 42, 46), QColor(222, 224, 228)
    for role, colour in ((QPalette.ColorRole.Window, window), (QPalette.ColorRole.Base, base),
                         (QPalette.ColorRole.AlternateBase, QColor(48, 50, 55)),
                         (QPalette.ColorRole.WindowText, text), (QPalette.ColorRole.Text, text),
                         (QPalette.ColorRole.Button, QColor(52, 54, 59)),
                         (QPalette.ColorRole.ButtonText, text),
                         (QPalette.ColorRole.Highlight, QColor(66, 133, 244)),
                         (QPalette.ColorRole.HighlightedText, QColor(255, 255, 255)),
                         (QPalette.ColorRole.ToolTipBase, QColor(50, 52, 57)),
                         (QPalette.ColorRole.ToolTipText, text),
                         (QPalette.ColorRole.PlaceholderText, QColor(130, 134, 142)),
                         (QPalette.ColorRole.Link, QColor(110, 165, 255))):
        p.setColor(role, colour)
    for role in (QPalette.ColorRole.WindowText, QPalette.ColorRole.Text,
                 QPalette.ColorRole.ButtonText):
        p.setColor(QPalette.ColorGroup.Disabled, role, QColor(120, 122, 128))
    return p
