"""The benchmark's chart, drawn like a figure in a paper: one panel per sampling (greedy and
sampled side by side) and prompt set, each mode's median speedup over plain decoding as a bar
with its spread over the repeats (llama.cpp's own ``llama-speculative``, where the bench ran
it, in another colour), a line at 1.00x (plain), the oracle's ceiling marked, round axis ticks,
figures to two decimals. Painted with QPainter offscreen, so ``staged-chat bench``
needs Qt only when ``--chart`` is asked for."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QFont, QImage, QPainter, QPen
from PySide6.QtWidgets import QApplication

BAR = QColor("#4c72b0")
SPREAD = QColor("#222222")
PLAIN = QColor("#888888")
CEILING = QColor("#c44e52")
NATIVE = QColor("#8c8c8c")
ROW, PANEL_W, LABEL_W, MARGIN = 26, 380, 70, 16


def nice_ticks(top: float) -> list[float]:
    """Round ticks from 0 to at least ``top``: steps of 1, 2 or 5 times a power of ten, four
    to eight of them."""
    top = max(top, 1.0)
    raw = top / 5
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    n = math.ceil(top / step - 1e-9)
    return [round(i * step, 10) for i in range(n + 1)]


def column_order(samplings: list[str]) -> list[str]:
    """The panels' columns: greedy first, whatever follows its name (``greedy+penalties``)."""
    return sorted(dict.fromkeys(samplings), key=lambda s: not s.startswith("greedy"))


def bars(cell: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A cell's bars by label: our modes but plain and the oracle (plain is the line at 1.00x,
    the oracle the ceiling), then llama-speculative by draft length."""
    out = {m: s for m, s in cell["modes"].items() if m not in ("plain", "oracle")}
    out.update({f"native {s['draft_max']}": s for s in (cell.get("native") or {}).values()})
    return out


def speedup_label(x: float) -> str:
    return f"{x:.2f}\u00d7"


def save_chart(report: dict[str, Any], path: Path) -> Path:
    """Write the chart of ``report`` (``app.tools.bench``'s) to ``path`` (PNG)."""
    app = QApplication.instance() or QApplication([])  # noqa: F841 (fonts need an app)
    cells = report["cells"]
    columns = column_order([c["sampling"] for c in cells])
    rows = list(dict.fromkeys(c["prompts"] for c in cells))
    modes = list(dict.fromkeys(m for c in cells for m in bars(c)))
    top = max([s["speedup_range"][1] for c in cells for s in c["modes"].values()]
              + [s["speedup_range"][1] for c in cells for s in bars(c).values()] + [1.0])
    ticks = nice_ticks(top)
    panel_h = ROW * len(modes) + 66
    title_h = 88
    width = MARGIN * 2 + len(columns) * (LABEL_W + PANEL_W + MARGIN)
    height = title_h + len(rows) * (panel_h + MARGIN) + MARGIN
    image = QImage(width, height, QImage.Format.Format_ARGB32)
    image.fill(QColor("white"))
    p = QPainter(image)
    p.setRenderHint(QPainter.RenderHint.Antialiasing)
    font = QFont()
    font.setPointSize(9)
    p.setFont(font)
    t = report.get("cost_ms", {}).get("target", {})
    curve = ", ".join(f"{n}: {ms / t['1']:.2f}" for n, ms in t.items() if n != "1") if t else ""
    p.setPen(QColor("black"))
    p.drawText(QRectF(MARGIN, 6, width - 2 * MARGIN, 22), Qt.AlignmentFlag.AlignLeft,
               f"Speedup over plain decoding: target {report['target']}, draft "
               f"{report.get('draft') or 'none'}")
    # the host and its curve may be longer than the figure is wide: wrapped, never clipped
    native = any(c.get("native") for c in cells)
    p.drawText(QRectF(MARGIN, 26, width - 2 * MARGIN, 56),
               Qt.AlignmentFlag.AlignLeft | Qt.TextFlag.TextWordWrap,
               f"{report['host']['cpu']}, {report['host']['threads']} threads, flash attention "
               f"{'on' if report['host'].get('flash_attn') else 'off'}; target "
               f"cost(n)/cost(1) {curve}; median of the repeats, whiskers: min-max"
               + ("; grey: llama.cpp's llama-speculative, chains of at most n draft tokens"
                  if native else "")
               + (f"; EMULATED: every target pass {report['emulated_pass_ms']:g} ms longer, "
                  "not this host's figures" if report.get("emulated_pass_ms") else ""))
    for r, prompts in enumerate(rows):
        for c, sampling in enumerate(columns):
            cell = next((x for x in cells if x["sampling"] == sampling
                         and x["prompts"] == prompts), None)
            if cell is None:
                continue
            left = MARGIN + c * (LABEL_W + PANEL_W + MARGIN) + LABEL_W
            panel = QRectF(left, title_h + r * (panel_h + MARGIN), PANEL_W, panel_h)
            _panel(p, panel, cell, modes, ticks, f"{sampling}, {prompts} prompts")
    p.end()
    path.parent.mkdir(parents=True, exist_ok=True)
    if not image.save(str(path)):
        raise OSError(f"could not write {path}")
    return path


def _panel(p: QPainter, box: QRectF, cell: dict[str, Any], modes: list[str],
           ticks: list[float], title: str) -> None:
    plot = QRectF(box.left(), box.top() + 20, box.width() - 10, ROW * len(modes) + 8)

    def x_of(v: float) -> float:
        return plot.left() + plot.width() * v / ticks[-1]

    p.setPen(QColor("black"))
    title_at = QRectF(box.left(), box.top(), box.width(), 18)
    title_box = p.boundingRect(title_at, Qt.AlignmentFlag.AlignLeft, title)
    p.drawText(title_at, Qt.AlignmentFlag.AlignLeft, title)
    grid = QPen(QColor("#dddddd"))
    for v in ticks:  # the grid and the axis labels
        p.setPen(grid)
        p.drawLine(QPointF(x_of(v), plot.top()), QPointF(x_of(v), plot.bottom()))
        p.setPen(QColor("black"))
        p.drawText(QRectF(x_of(v) - 20, plot.bottom() + 2, 40, 16),
                   Qt.AlignmentFlag.AlignHCenter, f"{v:g}")
    p.setPen(QPen(PLAIN, 1.5))  # the line at plain decoding's speed, under bars and figures
    p.drawLine(QPointF(x_of(1.0), plot.top() - 2), QPointF(x_of(1.0), plot.bottom()))
    shown = bars(cell)
    for i, mode in enumerate(modes):
        s = shown.get(mode)
        y = plot.top() + 4 + i * ROW
        p.setPen(QColor("black"))
        p.drawText(QRectF(box.left() - LABEL_W, y, LABEL_W - 6, ROW - 6),
                   Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter, mode)
        if s is None:  # the row stays, level with the other panels' (llama-speculative
            # runs greedy only: sampled, its output does not follow the target's distribution)
            p.setPen(SPREAD)
            p.drawText(QRectF(plot.left() + 4, y, plot.width(), ROW - 6),
                       Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                       "greedy only" if mode.startswith("native") else "not run")
            continue
        p.fillRect(QRectF(plot.left(), y + 3, x_of(s["speedup"]) - plot.left(), ROW - 12),
                   NATIVE if "draft_max" in s else BAR)
        lo, hi = s["speedup_range"]
        mid = y + (ROW - 6) / 2
        p.setPen(QPen(SPREAD, 1.2))
        p.drawLine(QPointF(x_of(lo), mid), QPointF(x_of(hi), mid))
        for v in (lo, hi):
            p.drawLine(QPointF(x_of(v), mid - 4), QPointF(x_of(v), mid + 4))
        label = speedup_label(s["speedup"])
        box_of = QRectF(x_of(max(hi, s["speedup"])) + 4, y, 60, ROW - 6)
        flags = Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter
        p.fillRect(p.boundingRect(box_of, flags, label).adjusted(-1, 0, 1, 0),
                   QColor("white"))  # legible where a grid line or plain's line passes
        p.drawText(box_of, flags, label)
    oracle = cell["modes"].get("oracle")
    if oracle is not None:  # the ceiling: a free drafter that knows the answer
        pen = QPen(CEILING, 1.5)
        pen.setStyle(Qt.PenStyle.DashLine)
        p.setPen(pen)
        x = x_of(oracle["speedup"])
        p.drawLine(QPointF(x, plot.top() - 2), QPointF(x, plot.bottom()))
        text = f"ceiling {speedup_label(oracle['speedup'])}"
        left = QRectF(x - 150, plot.top() - 18, 146, 16)  # left of the line, unless the
        if p.boundingRect(left, Qt.AlignmentFlag.AlignRight, text).intersects(title_box):
            # panel's title is there: then right of the line and of the title
            start = max(x + 4, title_box.right() + 8)
            p.drawText(QRectF(start, plot.top() - 18, 146, 16), Qt.AlignmentFlag.AlignLeft,
                       text)
        else:
            p.drawText(left, Qt.AlignmentFlag.AlignRight, text)
    p.setPen(QColor("black"))
    p.drawText(QRectF(plot.left(), plot.bottom() + 18, plot.width(), 16),
               Qt.AlignmentFlag.AlignHCenter, "speedup (\u00d7 plain decoding)")
