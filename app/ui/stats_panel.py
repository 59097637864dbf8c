"""Live statistics: meters, acceptance by depth, each stage's share, the time split, a chart.

Every figure comes from ``speculative.stats.RunStats``: while a reply streams, the panel keeps
one fed with each step's ``StepStats``; for a stored reply it shows the figures stored with it
(``app.replies``). The chart has one point per step, over the conversation's stored steps and
the streaming reply's, so a conversation reopened from the history shows the chart it showed
when it was written. The panel only displays. Redraws are paced by the main window's timer, not
by the steps, which can come thousands of times per second.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from PySide6.QtCharts import QChart, QChartView, QLineSeries, QValueAxis
from PySide6.QtCore import QMargins, QPointF, QRectF, Qt, Signal
from PySide6.QtGui import QColor, QFont, QPainter, QPalette, QPen
from PySide6.QtWidgets import (
    QCheckBox,
    QFrame,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from app.replies import figures, stored_run
from app.ui.theme import ORIGIN_LABELS, ORIGIN_SOLID, TIME_COLOURS
from speculative.stats import ORIGINS, RunStats, StepStats

ROLLING = 16        # steps in the chart's rolling tokens/s and tau
MAX_POINTS = 1500   # chart points kept per series


class Meter(QFrame):
    """A big number with a caption."""

    def __init__(self, caption: str, tooltip: str = "", parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.value = QLabel("–")
        font = QFont(self.value.font())
        font.setPointSizeF(font.pointSizeF() * 1.9)
        font.setWeight(QFont.Weight.DemiBold)
        self.value.setFont(font)
        self.value.setAlignment(Qt.AlignmentFlag.AlignCenter)
        label = QLabel(caption)
        label.setAlignment(Qt.AlignmentFlag.AlignCenter)
        label.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 4)
        layout.setSpacing(0)
        layout.addWidget(self.value)
        layout.addWidget(label)
        self.setToolTip(tooltip)

    def set(self, text: str) -> None:
        self.value.setText(text)


class StackBar(QWidget):
    """A horizontal bar split into coloured shares, with a legend line under it."""

    def __init__(self, colours: dict[str, QColor], labels: dict[str, str],
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.colours, self.labels = colours, labels
        self.values: dict[str, float] = {}
        self.setMinimumHeight(34)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)

    def set_values(self, values: dict[str, float]) -> None:
        self.values = values
        self.update()

    def paintEvent(self, _event: object) -> None:
        p = QPainter(self)
        p.setRenderHint(QPainter.RenderHint.Antialiasing)
        bar = QRectF(0, 0, self.width(), 14)
        total = sum(self.values.values())
        p.setPen(Qt.PenStyle.NoPen)
        p.setBrush(self.palette().color(QPalette.ColorRole.AlternateBase))
        p.drawRoundedRect(bar, 3, 3)
        x = 0.0
        for key, colour in self.colours.items():
            share = self.values.get(key, 0.0) / total if total > 0 else 0.0
            if share > 0:
                p.setBrush(colour)
                p.drawRect(QRectF(x, 0, share * self.width(), 14))
                x += share * self.width()
        p.setPen(self.palette().color(QPalette.ColorRole.Text))
        font = p.font()
        font.setPointSizeF(font.pointSizeF() * 0.85)
        p.setFont(font)
        x = 0.0
        for key, colour in self.colours.items():
            share = self.values.get(key, 0.0) / total if total > 0 else 0.0
            p.fillRect(QRectF(x, 20, 9, 9), colour)
            text = f"{self.labels[key]} {share:.0%}"
            p.drawText(QRectF(x + 12, 16, 200, 16), Qt.AlignmentFlag.AlignLeft, text)
            x += 12 + p.fontMetrics().horizontalAdvance(text) + 10


class DepthBars(QWidget):
    """Acceptance rate at each tree depth, as vertical bars labelled with the depth."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.rates: list[float] = []
        self.setMinimumHeight(70)
        self.setToolTip("P(a token is accepted at depth d | the target was offered a candidate "
                        "at depth d), over this reply")

    def set_rates(self, rates: list[float]) -> None:
        self.rates = rates[:12]
        self.update()

    def paintEvent(self, _event: object) -> None:
        p = QPainter(self)
        text = self.palette().color(QPalette.ColorRole.Text)
        if not self.rates:
            p.setPen(self.palette().color(QPalette.ColorRole.PlaceholderText))
            p.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter, "no drafted tokens yet")
            return
        n = len(self.rates)
        w = self.width() / n
        h = self.height() - 16
        for i, r in enumerate(self.rates):
            bar = QRectF(i * w + 3, 2 + h * (1 - r), w - 6, h * r)
            p.fillRect(bar, ORIGIN_SOLID["draft"])
            p.setPen(text)
            p.drawText(QRectF(i * w, h + 2, w, 14), Qt.AlignmentFlag.AlignCenter, str(i + 1))
            if w > 26:
                p.setPen(QColor(255, 255, 255) if r > 0.25 else text)
                label = QRectF(i * w, 2 + h * (1 - r) if r > 0.25 else h - 14, w, 14)
                p.drawText(label, Qt.AlignmentFlag.AlignCenter, f"{r:.0%}")


Point = tuple[float, float, float]  # (tokens in the conversation, tokens/s, tau)


def chart_points(steps: Sequence[StepStats], x0: float, first: int = 0) -> list[Point]:
    """A point after each of ``steps[first:]``: the conversation's tokens so far (``x0`` before
    ``steps[0]``), and tokens/s and tau over the ``ROLLING`` steps up to it."""
    x = x0 + sum(s.emitted for s in steps[:first])
    points = []
    for i in range(first, len(steps)):
        x += steps[i].emitted
        recent = RunStats(steps=list(steps[max(0, i + 1 - ROLLING):i + 1]))
        points.append((x, recent.tokens_per_second, recent.tau))
    return points


class StatsPanel(QWidget):
    show_origins_changed = Signal(bool)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.run: RunStats | None = None  # the reply shown (None: stored without its steps)
        self.figures: dict[str, Any] = {}  # ... and what the meters show of it
        self.streaming = False  # ``run`` is a reply being written, fed step by step
        self.plain_seconds_per_token = 0.0
        self._x0 = 0.0      # the conversation's tokens before the streaming reply's first step
        self._charted = 0   # the streaming reply's steps already on the chart
        self._tokens = 0.0  # the conversation's tokens, where the chart ends
        self._max_speed, self._max_tau = 1.0, 1.0  # the highest points yet, with headroom
        # each axis's range as last applied: setting a range re-lays the chart out, and the
        # vertical axes' nice numbers cost as much again, most of a streaming frame's time
        self._applied: dict[QValueAxis, tuple[float, float]] = {}
        self._dirty = False
        self.speed = Meter("tokens/s")
        self.speedup = Meter("speedup (est.)", "What plain decoding of the same target would "
                             "have taken for this reply, over what it took: each step's target "
                             "pass, scaled by the measured cost curve to one token, gives plain "
                             "decoding's cost at that moment. Race measures it side by side.")
        self.race_note = QLabel()  # the last race's measured speedup, beside the estimate
        self.race_note.setWordWrap(True)
        self.tau = Meter("tokens / target pass", "tau: emitted tokens per target forward pass "
                         "(plain decoding: 1)")
        meters = QHBoxLayout()
        for m in (self.speed, self.speedup, self.tau):
            meters.addWidget(m)
        self.depth = DepthBars()
        self.origins = StackBar(ORIGIN_SOLID, ORIGIN_LABELS)
        self.time = StackBar(TIME_COLOURS, {"draft": "draft", "stage2": "stage 2",
                                            "verify": "verify", "other": "other"})
        self.colour_tokens = QCheckBox("Colour tokens by origin")
        self.colour_tokens.setChecked(True)
        self.colour_tokens.toggled.connect(self.show_origins_changed)
        self.estimate_note = QLabel()
        self.estimate_note.setWordWrap(True)
        self.estimate_note.setForegroundRole(QPalette.ColorRole.PlaceholderText)
        self.detail = QLabel()
        self.detail.setWordWrap(True)
        self.chart_view = self._make_chart()
        grid = QGridLayout()
        grid.addWidget(_caption("Acceptance by tree depth"), 0, 0)
        grid.addWidget(self.depth, 1, 0)
        grid.addWidget(_caption("Where the tokens came from"), 2, 0)
        grid.addWidget(self.origins, 3, 0)
        grid.addWidget(self.colour_tokens, 4, 0)
        grid.addWidget(_caption("Time per reply"), 5, 0)
        grid.addWidget(self.time, 6, 0)
        layout = QVBoxLayout(self)
        layout.addLayout(meters)
        layout.addWidget(self.race_note)
        layout.addWidget(self.estimate_note)
        layout.addLayout(grid)
        layout.addWidget(self.detail)
        layout.addWidget(_caption("This conversation: tokens/s and tau"))
        layout.addWidget(self.chart_view, 1)
        self.show_conversation([])

    def _make_chart(self) -> QChartView:
        chart = QChart()
        chart.legend().setAlignment(Qt.AlignmentFlag.AlignBottom)
        chart.setMargins(QMargins(0, 0, 0, 0))
        chart.setBackgroundVisible(False)
        self.speed_series, self.tau_series = QLineSeries(), QLineSeries()
        self.speed_series.setName("tokens/s")
        self.tau_series.setName("tau")
        self.speed_series.setPen(QPen(TIME_COLOURS["verify"], 2))
        self.tau_series.setPen(QPen(ORIGIN_SOLID["draft"], 2))
        chart.addSeries(self.speed_series)
        chart.addSeries(self.tau_series)
        self.x_axis, self.speed_axis, self.tau_axis = QValueAxis(), QValueAxis(), QValueAxis()
        self.x_axis.setTitleText("tokens in this conversation")
        self.x_axis.setLabelFormat("%d")
        self.speed_axis.setLabelFormat("%.0f")
        self.tau_axis.setLabelFormat("%.1f")
        for axis in (self.x_axis, self.speed_axis, self.tau_axis):
            # the plot area is laid out before the labels grow with the ranges (tokens/s in
            # the hundreds): truncated, they read "..."
            axis.setTruncateLabels(False)
        chart.addAxis(self.x_axis, Qt.AlignmentFlag.AlignBottom)
        chart.addAxis(self.speed_axis, Qt.AlignmentFlag.AlignLeft)
        chart.addAxis(self.tau_axis, Qt.AlignmentFlag.AlignRight)
        for series, axis in ((self.speed_series, self.speed_axis),
                             (self.tau_series, self.tau_axis)):
            series.attachAxis(self.x_axis)
            series.attachAxis(axis)
        view = QChartView(chart)
        view.setRenderHint(QPainter.RenderHint.Antialiasing)
        view.setMinimumHeight(170)
        return view

    def apply_palette(self) -> None:
        text = self.palette().color(QPalette.ColorRole.Text)
        chart = self.chart_view.chart()
        chart.legend().setLabelColor(text)
        for axis in (self.x_axis, self.speed_axis, self.tau_axis):
            axis.setLabelsColor(text)
            axis.setTitleBrush(text)

    # --- data in ---
    def set_plain_speed(self, seconds_per_token: float, note: str) -> None:
        self.plain_seconds_per_token = seconds_per_token
        self.estimate_note.setText(note)

    def set_race(self, mode: str, speedup: float, tokens: int, temperature: float) -> None:
        """The last race's figure, measured side by side, shown beside the estimate."""
        draws = " (two draws at this temperature)" if temperature > 0 else ""
        self.race_note.setText(f"Race: {mode} {speedup:.2f}× plain, measured over {tokens} "
                               f"tokens each{draws}")

    def show_conversation(self, replies: list[dict[str, Any]]) -> None:
        """A conversation's stored replies (each one's ``stats``, oldest first): the chart of
        all their steps, and the figures of the last."""
        self.speed_series.clear()
        self.tau_series.clear()
        self._max_speed, self._max_tau = 1.0, 1.0
        x = 0.0
        for stats in replies:
            run = stored_run(stats)
            if run is None:  # stored without its steps: its tokens only move the chart on
                x += float(stats.get("tokens", 0))
                continue
            self._plot(chart_points(run.steps, x))
            x += run.tokens
        self._tokens = x
        last = replies[-1] if replies else {}
        self.run, self.figures, self.streaming = stored_run(last) if last else None, last, False
        self._set_ranges()
        self._dirty = True
        self.refresh()

    def begin_reply(self, run: RunStats) -> None:
        """A reply starts streaming; ``run`` holds the steps of the reply it continues, the last
        on the chart, if any."""
        self.run, self.streaming = run, True
        self._charted = len(run.steps)
        self._x0 = self._tokens - run.tokens
        self._dirty = True

    def add_step(self, stats: StepStats) -> None:
        if self.streaming and self.run is not None:
            self.run.add(stats)
            self._dirty = True

    # --- display ---
    def refresh(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        if self.streaming and self.run is not None:
            self.figures = figures(self.run, self.plain_seconds_per_token)
            points = chart_points(self.run.steps, self._x0, self._charted)
            self._charted = len(self.run.steps)
            if points:
                self._plot(points)
                self._tokens = points[-1][0]
                self._set_ranges()
        self._show(self.figures)

    def _show(self, f: dict[str, Any]) -> None:
        if not f.get("target_passes"):
            for m in (self.speed, self.speedup, self.tau):
                m.set("–")
            self.depth.set_rates([])
            self.origins.set_values({})
            self.time.set_values({})
            self.detail.setText("")
            return
        self.speed.set(f"{f.get('tokens_per_second', 0.0):.0f}")
        speedup = f.get("estimated_speedup")
        self.speedup.set(f"{speedup:.2f}×" if speedup is not None else "–")
        self.tau.set(f"{f.get('tau', 0.0):.2f}")
        self.depth.set_rates(list(f.get("depth_acceptance", [])))
        origins = f.get("origins", {})
        self.origins.set_values({o: float(origins.get(o, 0)) for o in ORIGINS})
        split = {k: float(f.get("time", {}).get(k, 0.0)) for k in TIME_COLOURS}
        self.time.set_values(split)
        self.detail.setText(
            f"{f.get('mode', '')}: {f.get('tokens', 0)} tokens in {f['target_passes']} target "
            f"passes; {f.get('mean_drafted', 0.0):.1f} drafted, "
            f"{f.get('mean_accepted', 0.0):.2f} accepted per pass; draft calls per pass "
            f"{f.get('draft_calls_per_step', 0.0):.2f}; stage-2 hit rate "
            f"{f.get('stage2_hit_rate', 0.0):.0%}. Time: draft {split['draft'] * 1000:.0f} ms, "
            f"stage 2 {split['stage2'] * 1000:.0f} ms, verify {split['verify'] * 1000:.0f} ms, "
            f"other {split['other'] * 1000:.0f} ms.{_penalties(f)}")

    def _plot(self, points: list[Point]) -> None:
        self.speed_series.append([QPointF(x, s) for x, s, _ in points])
        self.tau_series.append([QPointF(x, t) for x, _, t in points])
        for series in (self.speed_series, self.tau_series):
            if series.count() > MAX_POINTS:
                series.removePoints(0, series.count() - MAX_POINTS)
        self._max_speed = max([self._max_speed, *(s * 1.15 for _, s, _ in points)])
        self._max_tau = max([self._max_tau, *(t * 1.15 for _, _, t in points)])

    def _set_ranges(self) -> None:
        if self.speed_series.count():
            first = self.speed_series.at(0).x()
            self._set_range(self.x_axis, first, max(self._tokens, first + 50))
        else:
            self._set_range(self.x_axis, 0.0, max(100.0, self._tokens))
        for axis, top in ((self.speed_axis, max(10.0, self._max_speed)),
                          (self.tau_axis, max(2.0, self._max_tau))):
            if self._set_range(axis, 0.0, top):  # (unchanged, its nice numbers would be too)
                axis.setTickCount(5)  # nice numbers start from it and change it
                axis.applyNiceNumbers()

    def _set_range(self, axis: QValueAxis, low: float, high: float) -> bool:
        """Set ``axis``'s range unless it was last set to this one; whether it was set."""
        if self._applied.get(axis) == (low, high):
            return False
        axis.setRange(low, high)
        self._applied[axis] = (low, high)
        return True


def _penalties(f: dict[str, Any]) -> str:
    """What repetition control did to the reply, if it ran."""
    pen = f.get("penalties", {})
    if not pen.get("seconds") and not pen.get("steered"):
        return ""
    return (f" Penalties changed the target's top token at {pen.get('steered', 0)} of "
            f"{f.get('tokens', 0)} tokens ({pen.get('seconds', 0.0) * 1000:.0f} ms).")


def _caption(text: str) -> QLabel:
    label = QLabel(text)
    font = label.font()
    font.setWeight(QFont.Weight.DemiBold)
    label.setFont(font)
    return label
