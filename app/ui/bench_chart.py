"""The benchmark's chart: each mode's median speedup over plain decoding, with its spread and
the oracle's ceiling, one group per (sampling, prompt set). Drawn with QtCharts offscreen, so
``staged-chat bench`` needs Qt only when ``--chart`` is asked for."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCharts import (
    QBarCategoryAxis,
    QBarSet,
    QChart,
    QChartView,
    QHorizontalBarSeries,
    QValueAxis,
)
from PySide6.QtCore import QMargins, Qt
from PySide6.QtGui import QPainter
from PySide6.QtWidgets import QApplication


def save_chart(report: dict[str, Any], path: Path, width: int = 1000) -> Path:
    app = QApplication.instance() or QApplication([])
    series = QHorizontalBarSeries()
    modes = list(report["cells"][0]["modes"]) if report["cells"] else []
    for cell in report["cells"]:
        bars = QBarSet(f"{cell['sampling']}, {cell['prompts']} prompts")
        for mode in modes:
            bars.append(cell["modes"].get(mode, {}).get("speedup", 0.0))
        series.append(bars)
    series.setLabelsVisible(True)
    series.setLabelsFormat("@valuex")
    chart = QChart()
    chart.addSeries(series)
    chart.setTitle(f"Speedup over plain decoding ({report['target']}, {report['host']['cpu']},"
                   f" {report['host']['threads']} threads)")
    chart.setMargins(QMargins(8, 8, 8, 8))
    axis_y = QBarCategoryAxis()
    axis_y.append(modes)
    axis_x = QValueAxis()
    top = max([s.get("speedup_range", [0, 0])[1] for c in report["cells"]
               for s in c["modes"].values()] + [1.0])
    axis_x.setRange(0.0, top * 1.1)
    axis_x.setTitleText("x plain (median of repeats; the oracle is the ceiling)")
    chart.addAxis(axis_y, Qt.AlignmentFlag.AlignLeft)
    chart.addAxis(axis_x, Qt.AlignmentFlag.AlignBottom)
    series.attachAxis(axis_y)
    series.attachAxis(axis_x)
    view = QChartView(chart)
    view.setRenderHint(QPainter.RenderHint.Antialiasing)
    view.resize(width, 120 + 40 * len(modes) * max(1, len(report["cells"])))
    path.parent.mkdir(parents=True, exist_ok=True)
    view.grab().save(str(path))
    app.processEvents()
    return path
