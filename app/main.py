"""Start-up: the application object, settings, history, the window; scripted runs.

``staged-chat`` (no subcommand) opens the app on the built-in models. ``staged-chat app
--prompt TEXT --screenshot PATH`` opens the window, sends the prompt, waits for the reply (or
``--at-tokens N`` tokens of it, for a picture mid-generation; ``--race`` then races it) and
saves a picture of the window; the README's screenshots are made this way.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QObject, QTimer, Signal
from PySide6.QtWidgets import QApplication, QWidget

from app import display
from app.history import History, HistoryError, default_path
from app.settings import SettingsStore
from app.ui.main_window import MainWindow
from app.ui.theme import apply_theme

log = logging.getLogger(__name__)


class _Probe(QObject):
    flag = Signal(bool)


def keep_singletons_alive() -> list[str]:
    """Give None, True and False references to spare where this PySide6 drops them; the names
    of those it does.

    PySide6 6.12.0 on Python 3.11 steals a reference to ``None`` on every call of a Qt method
    that returns void (``label.setText(...)`` lowers ``sys.getrefcount(None)`` by one), and one
    to ``True`` or ``False`` on every emission of a ``Signal(bool)``. After some thousands of
    calls, minutes of streaming, the interpreter "deallocates" the singleton and aborts (Fatal
    Python error: none_dealloc, bool_dealloc). From Python 3.12 on they are immortal and the
    stray decrefs are harmless; before it, a huge reference count has the same effect.
    Measured rather than keyed to versions, so a fixed PySide6 is left alone."""
    if sys.version_info >= (3, 12):
        return []
    probe = _Probe()
    leaks = ((None, lambda: probe.setObjectName("probe")),
             (True, lambda: probe.flag.emit(True)), (False, lambda: probe.flag.emit(False)))
    given = []
    for singleton, call in leaks:
        if sys.getrefcount(singleton) > 1 << 39:  # given by an earlier call
            given.append(repr(singleton))
        elif _drops(singleton, call):
            # ob_refcnt is the first field of every object in CPython's release builds
            ctypes.c_ssize_t.from_address(id(singleton)).value += 1 << 40
            log.info("this PySide6 drops references to %s: gave it 2**40", singleton)
            given.append(repr(singleton))
    return given


def _drops(singleton: object, call: Callable[[], object]) -> bool:
    """Whether ``call`` lowers the singleton's reference count (64 calls, most of 64 lost)."""
    before = sys.getrefcount(singleton)
    for _ in range(64):
        call()
    return sys.getrefcount(singleton) <= before - 32


def create_app() -> QApplication:
    """The application object. Where Qt could not open a window (missing X11 libraries), exit
    with a hint that names them instead of Qt's abort."""
    keep_singletons_alive()
    app = QApplication.instance()
    if app is None:
        trouble = display.problem()
        if trouble is not None:
            raise SystemExit(trouble)  # printed on stderr; exit status 1
        app = QApplication(sys.argv[:1])
    app.setOrganizationName("Staged Chat")
    app.setApplicationName("Staged Chat")
    return app  # type: ignore[return-value]


def open_window(data_dir: Path | None, overrides: dict | None = None) -> MainWindow:
    """The main window with its settings and history (under ``data_dir`` if given)."""
    app = create_app()
    store = SettingsStore(data_dir / "settings.ini" if data_dir else None)
    settings = store.load()
    if overrides:
        settings = dataclasses.replace(settings, **overrides).validated()
        store.save(settings)
    apply_theme(app, settings.theme)
    path = data_dir / "history.sqlite3" if data_dir else default_path()
    history = History(path, create_parent=True)
    window = MainWindow(store, history)
    window.stats.apply_palette()
    window.destroyed.connect(history.close)
    return window


def run(args: argparse.Namespace) -> int:
    overrides = {k: v for k, v in (("theme", args.theme), ("mode", args.mode),
                                   ("temperature", args.temp),
                                   ("max_tokens", args.max_tokens)) if v is not None}
    app = create_app()
    try:
        window = open_window(args.data_dir, overrides)
    except HistoryError as exc:
        print(f"staged-chat: error: {exc}", file=sys.stderr)
        return 2
    window.show()
    if args.prompt:
        Script(window, args).start()
    code = app.exec()
    window.history.close()
    return code


class Script(QObject):
    """Drives the window for ``--prompt`` / ``--screenshot`` runs (a QObject, so that the
    window's signals reach it on the GUI thread)."""

    def __init__(self, window: MainWindow, args: argparse.Namespace) -> None:
        super().__init__(window)
        self.window, self.args = window, args
        self.tokens = 0
        self.shot = False

    def start(self) -> None:
        w = self.window
        if w.info is not None:
            self._send()
        else:
            w.models_loaded.connect(self._send)
        w.load_failed.connect(self._load_failed)

    def _load_failed(self, _reason: str) -> None:
        self._finish(1)

    def _send(self) -> None:
        w = self.window
        with contextlib.suppress(RuntimeError, TypeError):
            w.models_loaded.disconnect(self._send)
        w.new_conversation()
        w.reply_finished.connect(self._replied)
        if self.args.at_tokens:
            w.step_shown.connect(self._counted)
        w.send_text(self.args.prompt)

    def _counted(self, ev: object) -> None:
        self.tokens += len(getattr(ev, "tokens", []))
        if not self.shot and self.tokens >= self.args.at_tokens:
            self.shot = True
            QTimer.singleShot(0, self._shoot_mid)

    def _shoot_mid(self) -> None:
        self.window.replies.draw()
        self._save(self.window)

    def _replied(self, _request_id: int) -> None:
        if self.args.race:
            self.window.race_done.connect(self._raced)
            self.window.race()
            return
        if not self.shot:
            self._save(self.window)
        self._finish(0)

    def _raced(self) -> None:
        race = self.window.race_window
        if race is None:
            self._finish(1)
            return
        # the picture: the speculative side done, plain decoding still writing
        race.leader_finished.connect(self._save_race)
        race.replay_finished.connect(self._finish_ok)

    def _save_race(self) -> None:
        if self.window.race_window is not None:
            self._save(self.window.race_window)

    def _finish_ok(self) -> None:
        self._finish(0)

    def _save(self, widget: QWidget) -> None:
        if self.args.screenshot is None:
            return
        QApplication.processEvents()
        self.args.screenshot.parent.mkdir(parents=True, exist_ok=True)
        widget.grab().save(str(self.args.screenshot))
        print(self.args.screenshot)

    def _finish(self, code: int) -> None:
        if self.args.screenshot is not None:
            QTimer.singleShot(50, lambda: (self.window.close(), QApplication.exit(code)))
