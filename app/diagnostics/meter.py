"""Does the window's estimated speedup agree with the race?

    python -m app.diagnostics.meter [--target T.gguf --draft D.gguf] [--mode auto]
                                    [--temp 0] [-n 64] [--prompts FILE] [--busy SECONDS]

For each prompt, in the real window (offscreen): one reply, whose estimated speedup the
statistics panel shows, then a race of plain decoding against the mode on the same prompt
(measured side by side). Prints both and their ratio, per prompt and pooled; and the estimate
of the race's own speculative run (its first round) against the race: ``auto`` learns from
the reply and may run the race otherwise (drafting where the reply ran the target alone),
so that ratio is the meter's error alone. Where the two part, ``reply_time`` (the reply's
time for the race's tokens over the race's speculative run's, first round) and ``reply_plain``
/ ``race_plain`` (each run's counterfactual plain time per token over plain's in the race's
first round) say which side moved. ``--busy N``
starts a process that keeps one core busy for the first N seconds of each reply, as another
program on a shared desktop would: the estimate must follow the load of the moment.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # a measurement: no window to show

from PySide6.QtCore import QEventLoop, QTimer

from app.main import create_app, open_window
from app.replies import stored_run
from app.tools.bench import PROMPT_SETS, load_prompts
from app.ui.main_window import MainWindow
from speculative.stats import RunStats

BUSY = "import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"


def _wait(window: MainWindow, signal: object, start: object) -> None:
    loop = QEventLoop()
    signal.connect(loop.quit)
    QTimer.singleShot(0, start)
    loop.exec()
    signal.disconnect(loop.quit)


def one(window: MainWindow, prompt: str, busy: float) -> dict[str, float]:
    """A reply's estimate, then the race's measurement, on ``prompt``."""
    window.new_conversation()
    load = (subprocess.Popen([sys.executable, "-c", BUSY.format(seconds=busy)])
            if busy > 0 else None)
    try:
        _wait(window, window.reply_finished, lambda: window.send_text(prompt))
    finally:
        if load is not None:
            load.wait()
    assert window.conversation is not None
    stats = window.history.messages(window.conversation.id)[-1].stats
    _wait(window, window.race_done, window.race)
    race = window.race_window
    assert race is not None and race.result is not None
    result = race.result
    race.close()
    reply = stored_run(stats)
    n = result.tokens
    plain, spec = result.plain.run, result.speculative.run
    return {"estimate": float(stats.get("estimated_speedup", 0.0)), "race": result.speedup,
            "tokens": n, "tau": float(stats.get("tau", 0.0)),
            "race_estimate": spec.estimated_speedup(), "race_tau": spec.tau,
            # where a reply and its race part: the reply's own time for the race's tokens over
            # the race's speculative run's (first round), and the reply's counterfactual plain
            # time per token over what plain took in the race's first round
            "reply_time": (reply.seconds_until(n) / spec.seconds_until(n)
                           if reply is not None and spec.seconds_until(n) else 0.0),
            "reply_plain": (_counterfactual(reply) / (plain.seconds / plain.tokens)
                            if reply is not None and plain.tokens else 0.0),
            "race_plain": (_counterfactual(spec) / (plain.seconds / plain.tokens)
                           if plain.tokens else 0.0),
            "reply_tokens": reply.tokens if reply is not None else 0}


def _counterfactual(run: RunStats) -> float:
    """Plain decoding's seconds per token as ``run``'s steps estimated it."""
    return run.plain_seconds() / run.tokens if run.tokens else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m app.diagnostics.meter",
                                description=__doc__.split("\n")[0])
    p.add_argument("--target", default="")
    p.add_argument("--draft", default="")
    p.add_argument("--mode", default="auto")
    p.add_argument("--temp", type=float, default=0.0)
    p.add_argument("-n", "--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=Path, default=PROMPT_SETS["code"])
    p.add_argument("--count", type=int, default=4, help="prompts of the file to use")
    p.add_argument("--busy", type=float, default=0.0,
                   help="seconds one core is kept busy at the start of each reply")
    a = p.parse_args(argv)
    app = create_app()
    with tempfile.TemporaryDirectory() as data:
        window = open_window(Path(data), {"target_path": a.target, "draft_path": a.draft,
                                          "mode": a.mode, "temperature": a.temp,
                                          "max_tokens": a.max_tokens, "seed": 0})
        if window.info is None:
            _wait(window, window.models_loaded, lambda: None)
        rows = [one(window, prompt, a.busy) for prompt in load_prompts(a.prompts)[:a.count]]
        window.close()
    app.processEvents()
    for row in rows:
        row["ratio"] = row["estimate"] / row["race"] if row["race"] else 0.0
        row["race_ratio"] = row["race_estimate"] / row["race"] if row["race"] else 0.0
        print(json.dumps({k: round(v, 3) for k, v in row.items()}))
    for key, what in (("ratio", "the reply's estimate"), ("race_ratio", "the race run's estimate")):
        ratios = [r[key] for r in rows]
        print(f"{what} / race: median {statistics.median(ratios):.3f}, "
              f"range {min(ratios):.3f}-{max(ratios):.3f} over {len(rows)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
