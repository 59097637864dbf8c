"""``staged-chat app --throughput-check``: does streaming into the window cost speed?

llama.cpp's threads spin at barriers; when the GUI thread (drawing text and the chart) wants a
core that one of them holds, decoding can slow down many times over. This measures, on the same
prompt, models and settings, generation tokens/s (prefill excluded, as ``RunStats`` counts it):

1. as the command line runs it (no window, every core);
2. in the window, streaming and charting, with the app's thread policy (``app_threads``: each
   model's count measured among all cores and one fewer);
3. in the window with every core given to llama.cpp (the naive policy), for comparison.

Each figure is the median of ``--repeats`` replies; the runs alternate so drifts hit all alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

from PySide6.QtCore import QEventLoop, QTimer
from PySide6.QtWidgets import QApplication

from app.main import create_app, open_window
from app.settings import AppSettings
from app.ui.main_window import MainWindow
from app.worker.loading import open_models
from speculative.backend import default_threads
from speculative.stats import RunStats

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'


def cli_speed(settings: AppSettings, prompt: str, threads: int) -> float:
    """Tokens/s of one generation the way ``staged-chat generate`` runs it."""
    with open_models(settings, threads) as pair:
        engine = pair.engine(settings.spec())
        run = RunStats()
        tokens = pair.target.vocab.tokenize(prompt)
        for _ in engine.generate(tokens, settings.max_tokens, settings.sampling(0),
                                 stop={pair.target.vocab.eos}, run=run):
            pass
    return run.tokens_per_second


def app_speed(window: MainWindow, prompt: str) -> float:
    """Tokens/s of one reply streamed into ``window`` (its stored statistics)."""
    loop = QEventLoop()
    window.reply_finished.connect(loop.quit)
    QTimer.singleShot(0, lambda: window.send_text(prompt))
    loop.exec()
    window.reply_finished.disconnect(loop.quit)
    assert window.conversation is not None
    reply = window.history.messages(window.conversation.id)[-1]
    return float(reply.stats.get("tokens_per_second", 0.0))


def _window(data: Path, settings: AppSettings, threads: int) -> MainWindow:
    overrides = {f.name: getattr(settings, f.name) for f in dataclasses.fields(AppSettings)}
    overrides["threads"] = threads
    window = open_window(data, overrides)
    window.show()
    if window.info is None:
        loop = QEventLoop()
        window.models_loaded.connect(loop.quit)
        window.load_failed.connect(loop.quit)
        loop.exec()
    return window


def run(args: argparse.Namespace) -> int:
    create_app()
    models = {"target_path": str(args.check_target or ""),
              "draft_path": str(args.check_draft or "")}
    settings = AppSettings(mode=args.mode or "staged", temperature=args.temp or 0.0,
                           max_tokens=args.max_tokens or 200, seed=0, **models)
    cores = default_threads()
    policies = {"window, app policy": 0, "window, every core": cores}  # 0: the app's choice
    speeds: dict[str, list[float]] = {"command line": [], **{k: [] for k in policies}}
    with tempfile.TemporaryDirectory() as tmp:
        windows = {name: _window(Path(tmp) / str(i), settings, threads)
                   for i, (name, threads) in enumerate(policies.items())}
        for _ in range(args.repeats):
            speeds["command line"].append(cli_speed(settings, args.prompt or PROMPT, cores))
            for name, window in windows.items():
                window.new_conversation()
                speeds[name].append(app_speed(window, args.prompt or PROMPT))
                time.sleep(0.2)
        info = windows["window, app policy"].info
        chosen = info.threads_text() if info is not None else "?"
        for window in windows.values():
            window.close()
    base = statistics.median(speeds["command line"])
    print(f"mode {settings.mode}, temperature {settings.temperature}, {settings.max_tokens} "
          f"tokens, {cores} cores, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '-')}, "
          f"{args.repeats} repeats (median, min-max)")
    threads = {"command line": f"{cores} threads", "window, every core": f"{cores} threads",
               "window, app policy": chosen}
    for name, values in speeds.items():
        med = statistics.median(values)
        print(f"{name:<22} {threads[name]:<20} {med:8.1f} tok/s "
              f"({min(values):.1f}-{max(values):.1f})  {med / base:6.1%} of the command line")
    QApplication.processEvents()
    return 0
