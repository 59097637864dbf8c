"""Live statistics: meters, acceptance by depth, each stage's share, the time split, a chart.

Every figure comes from ``speculative.stats.RunStats`` (the panel keeps one for the reply being
written, fed with each step's ``StepStats``); the panel only displays. Redraws are paced by the
main window's timer, not by the steps, which can come thousands of times per second.
"""

from __future__ import annotations

from PySide6.QtCharts import QChart, QChartView, QLineSeries, QValueAxis
from PySide6.QtCore import QMargins, QRectF, Qt, Signal
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


class StatsPanel(QWidget):
    show_origins_changed = Signal(bool)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.run = RunStats()
        self.plain_seconds_per_token = 0.0
        self._conversation_tokens = 0
        self._dirty = False
        self.speed = Meter("tokens/s")
        self.speedup = Meter("speedup (est.)", "This reply's tokens/s times the seconds per "
                             "token of plain decoding of the same target, measured on this "
                             "machine when the models loaded. Use Race to measure it.")
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
        layout.addWidget(self.estimate_note)
        layout.addLayout(grid)
        layout.addWidget(self.detail)
        layout.addWidget(_caption("This conversation: tokens/s and tau"))
        layout.addWidget(self.chart_view, 1)

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
        chart.addAxis(self.x_axis, Qt.AlignmentFlag.AlignBottom)
        chart.addAxis(self.speed_axis, Qt.AlignmentFlag.AlignLeft)
        chart.addAxis(self.tau_axis, Qt.AlignmentFlag.AlignRight)
        for series, axis in ((self.speed_series, self.speed_axis),
                             (self.tau_series, self.tau_axis)):
            series.attachAxis(self.x_axis)
            series.attachAxis(axis)
        self._max_speed, self._max_tau = 1.0, 1.0
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

    def new_conversation(self, tokens_so_far: int = 0) -> None:
        self.speed_series.clear()
        self.tau_series.clear()
        self._max_speed, self._max_tau = 1.0, 1.0
        self._conversation_tokens = tokens_so_far
        self.x_axis.setRange(0, max(100, tokens_so_far))

    def begin_reply(self, mode: str) -> None:
        self.run = RunStats(mode=mode)
        self._dirty = True

    def add_step(self, stats: StepStats) -> None:
        self.run.add(stats)
        self._conversation_tokens += stats.emitted
        self._dirty = True

    def show_run(self, run: RunStats) -> None:
        """Show a finished reply's statistics (e.g. when a conversation is opened)."""
        self.run = run
        self._dirty = True
        self.refresh(add_point=False)

    # --- display ---
    def refresh(self, add_point: bool = True) -> None:
        if not self._dirty:
            return
        self._dirty = False
        run = self.run
        if not run.steps:
            for m in (self.speed, self.speedup, self.tau):
                m.set("–")
            self.depth.set_rates([])
            self.origins.set_values({})
            self.time.set_values({})
            self.detail.setText("")
            return
        self.speed.set(f"{run.tokens_per_second:.0f}")
        if self.plain_seconds_per_token > 0:
            self.speedup.set(f"{run.estimated_speedup(self.plain_seconds_per_token):.2f}×")
        self.tau.set(f"{run.tau:.2f}")
        self.depth.set_rates(run.depth_acceptance())
        origins = run.origins()
        self.origins.set_values({o: float(origins[o]) for o in ORIGINS})
        self.time.set_values(run.time_split())
        split = run.time_split()
        self.detail.setText(
            f"{run.mode}: {run.tokens} tokens in {len(run.steps)} target passes; "
            f"{run.mean_drafted:.1f} drafted, {run.mean_accepted:.2f} accepted per pass; "
            f"draft calls per pass {run.draft_calls_per_step:.2f}; stage-2 hit rate "
            f"{run.stage2_hit_rate:.0%}. Time: draft {split['draft'] * 1000:.0f} ms, stage 2 "
            f"{split['stage2'] * 1000:.0f} ms, verify {split['verify'] * 1000:.0f} ms, other "
            f"{split['other'] * 1000:.0f} ms.")
        if add_point:
            self._add_point(run)

    def _add_point(self, run: RunStats) -> None:
        recent = RunStats(steps=run.steps[-ROLLING:])
        x = float(self._conversation_tokens)
        speed, tau = recent.tokens_per_second, recent.tau
        for series, y in ((self.speed_series, speed), (self.tau_series, tau)):
            series.append(x, y)
            if series.count() > MAX_POINTS:
                series.removePoints(0, series.count() - MAX_POINTS)
        self._max_speed = max(self._max_speed, speed * 1.15)
        self._max_tau = max(self._max_tau, tau * 1.15)
        first = self.speed_series.at(0).x() if self.speed_series.count() else 0.0
        self.x_axis.setRange(first, max(x, first + 50))
        self.speed_axis.setRange(0, self._max_speed)
        self.tau_axis.setRange(0, self._max_tau)


def _caption(text: str) -> QLabel:
    label = QLabel(text)
    font = label.font()
    font.setWeight(QFont.Weight.DemiBold)
    label.setFont(font)
    return label
