"""The race: plain decoding and the current speculation side by side, replayed on one clock.

The worker runs the two one after the other (at once they would share the cores) and records
when each step's text arrived; this window replays both timelines together in real time, so
the user sees the speculative pane finish first, with two clocks, the measured speedup and
whether the texts are identical.
"""

from __future__ import annotations

import time

from PySide6.QtCore import QElapsedTimer, Qt, QTimer, Signal
from PySide6.QtGui import QFont
from PySide6.QtWidgets import (
    QDialog,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.settings import MODE_LABELS
from app.worker.messages import RaceResult, RaceRun


class RacePane(QWidget):
    def __init__(self, title: str, monospace: bool, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.title = QLabel(title)
        font = self.title.font()
        font.setWeight(QFont.Weight.DemiBold)
        self.title.setFont(font)
        self.clock = QLabel("0.00 s")
        clock_font = QFont(self.clock.font())
        clock_font.setPointSizeF(clock_font.pointSizeF() * 1.6)
        clock_font.setStyleHint(QFont.StyleHint.TypeWriter)
        self.clock.setFont(clock_font)
        self.text = QPlainTextEdit()
        self.text.setReadOnly(True)
        if monospace:
            mono = QFont("monospace")
            mono.setStyleHint(QFont.StyleHint.TypeWriter)
            self.text.setFont(mono)
        self.detail = QLabel("waiting…")
        head = QHBoxLayout()
        head.addWidget(self.title, 1)
        head.addWidget(self.clock)
        layout = QVBoxLayout(self)
        layout.addLayout(head)
        layout.addWidget(self.text, 1)
        layout.addWidget(self.detail)
        self.run: RaceRun | None = None
        self._shown = 0

    def start(self, run: RaceRun, prompt: str) -> None:
        self.run = run
        self._shown = 0
        self.text.setPlainText(prompt)
        self.clock.setText("0.00 s")
        self.detail.setText("")

    def advance(self, seconds: float) -> bool:
        """Show what had arrived ``seconds`` into the run; True once everything is shown."""
        assert self.run is not None
        timeline = self.run.timeline
        added = []
        while self._shown < len(timeline) and timeline[self._shown][0] <= seconds:
            added.append(timeline[self._shown][1])
            self._shown += 1
        if added:
            cursor = self.text.textCursor()
            cursor.movePosition(cursor.MoveOperation.End)
            cursor.insertText("".join(added))
            self.text.setTextCursor(cursor)
        total = timeline[-1][0] if timeline else 0.0
        done = self._shown >= len(timeline)
        self.clock.setText(f"{min(seconds, total) if done else seconds:.2f} s")
        if done:
            run = self.run.run
            self.detail.setText(f"{run.tokens} tokens in {run.seconds:.2f} s · "
                                f"{run.tokens_per_second:.1f} tokens/s · tau {run.tau:.2f}")
        return done


class RaceWindow(QDialog):
    replay_finished = Signal()
    leader_finished = Signal()  # one pane is done, the other still writing

    def __init__(self, monospace: bool, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Race: plain decoding vs speculation")
        self.resize(1100, 620)
        self.status = QLabel("Running plain decoding…")
        self.status.setWordWrap(True)
        self.left = RacePane(MODE_LABELS["plain"], monospace)
        self.right = RacePane("Speculation", monospace)
        self.verdict = QLabel("")
        font = self.verdict.font()
        font.setPointSizeF(font.pointSizeF() * 1.3)
        font.setWeight(QFont.Weight.DemiBold)
        self.verdict.setFont(font)
        self.verdict.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.replay = QPushButton("Replay")
        self.replay.setEnabled(False)
        self.replay.clicked.connect(self._start_replay)
        close = QPushButton("Close")
        close.clicked.connect(self.close)
        panes = QGridLayout()
        panes.addWidget(self.left, 0, 0)
        panes.addWidget(self.right, 0, 1)
        buttons = QHBoxLayout()
        buttons.addStretch(1)
        buttons.addWidget(self.replay)
        buttons.addWidget(close)
        layout = QVBoxLayout(self)
        layout.addWidget(self.status)
        layout.addLayout(panes, 1)
        layout.addWidget(self.verdict)
        layout.addLayout(buttons)
        self.result: RaceResult | None = None
        self.prompt = ""
        self._timer = QTimer(self)
        self._timer.setInterval(16)
        self._timer.timeout.connect(self._tick)
        self._clock = QElapsedTimer()
        self._leader = False
        self.replays = 0

    def progress(self, mode: str, tokens: int) -> None:
        what = "plain decoding" if mode == "plain" else MODE_LABELS.get(mode, mode)
        self.status.setText(f"Measuring {what}: {tokens} tokens… (the two runs go one after "
                            f"the other so that neither slows the other down)")

    def failed(self, reason: str) -> None:
        self.status.setText(f"The race could not finish: {reason}")

    def show_result(self, result: RaceResult, prompt: str) -> None:
        self.result, self.prompt = result, prompt
        self.right.title.setText(MODE_LABELS.get(result.speculative.mode,
                                                 result.speculative.mode))
        same = "identical texts" if result.identical else "the texts differ"
        why = result.divergence
        if result.temperature > 0 and not result.identical:
            same += (f": sampled at temperature {result.temperature:g}, each run is its own "
                     f"draw, as two replies would be (speculation keeps every token's "
                     f"distribution the target's; at temperature 0 the texts must match)")
        elif why is not None and why.tie:
            same += (f" from token {why.index}, where the model's two best tokens tie (llama.cpp "
                     f"rounds a batch of tokens a little differently from one token)")
        elif why is not None:
            same += f" from token {why.index}, and NOT at a tie: please report this"
        self.status.setText(f"Measured one after the other with the same seed; replayed on one "
                            f"clock, each from where the reply began. Both wrote {result.tokens} "
                            f"tokens (a race runs to its reply's length: the end-of-text token "
                            f"does not stop it); {same}.")
        self._start_replay()

    def _start_replay(self) -> None:
        assert self.result is not None
        self.left.start(self.result.plain, self.prompt)
        self.right.start(self.result.speculative, self.prompt)
        self.verdict.setText("")
        self.replay.setEnabled(False)
        self._leader = False
        self._clock.start()
        self._timer.start()

    def _tick(self) -> None:
        assert self.result is not None
        seconds = self._clock.elapsed() / 1000
        done = [pane.advance(seconds) for pane in (self.left, self.right)]
        if any(done) and not all(done) and not self._leader:
            self._leader = True
            self.leader_finished.emit()
        if all(done):
            self._timer.stop()
            r = self.result
            same = "identical" if r.identical else (
                "differ (two samples)" if r.temperature > 0
                else "part at a tie" if r.divergence is not None and r.divergence.tie
                else "NOT identical")
            ups = r.round_speedups()
            rounds = (f" (pooled over {len(r.rounds) + 1} rounds, each "
                      f"{min(ups):.2f}-{max(ups):.2f}×)" if r.rounds and ups else "")
            self.verdict.setText(f"{r.speedup:.2f}× plain's speed over {r.tokens} tokens"
                                 f"{rounds} · texts {same}")
            self.replay.setEnabled(True)
            self.replays += 1
            self.replay_finished.emit()

    def finish_now(self) -> None:
        """Jump to the end of the replay (tests, screenshots)."""
        self._clock = _Shifted(self._clock, 1e6)
        self._tick()


class _Shifted:
    """An elapsed-time clock moved forward (to end a replay at once)."""

    def __init__(self, clock: QElapsedTimer, seconds: float) -> None:
        self._t0 = time.perf_counter() - clock.elapsed() / 1000 - seconds

    def elapsed(self) -> int:
        return int((time.perf_counter() - self._t0) * 1000)

    def start(self) -> None:
        self._t0 = time.perf_counter()
