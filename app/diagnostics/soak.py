"""``python -m app.diagnostics.soak``: a long session in the real window (offscreen), then a report.

Many turns at temperature 0, new conversations once the window fills, the speculation mode
toggled between turns and the models switched now and then (the built-in pair, then the
built-in target alone, and back). It reports:

- tokens generated (every reply, the plain references included) and the turns it took;
- resident memory (VmRSS) at the start, its peak during the warm-up (the first third of the
  tokens), its peak since and at the end: flat means no new high beyond a small margin;
- how many replies equal plain decoding of the same prompt (the same conversation so far):
  each distinct prompt is answered once in plain mode, then re-asked in the turn's mode; a
  reply that differs is explained (``speculative.divergence``): where the target's own logits
  tie under llama.cpp's batch shapes, or NOT (an error: the soak fails);
- llama.cpp contexts alive after each model switch and after closing the window, counted by
  instrumenting ``LlamaContext`` from outside (a weak set of every instance created).

    python -m app.diagnostics.soak [--tokens 20000] [--modes auto,plain,staged,tree,chain,ngram]
                       [--switch-every 3] [--max-tokens 160] [--data-dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from PySide6.QtCore import QEventLoop, QTimer, SignalInstance

from app.main import create_app, open_window
from app.prompting import FORMATS, chat_prompt
from app.settings import AppSettings
from app.ui.main_window import MainWindow
from app.worker.loading import app_threads, window_handicap
from models.catalog import builtin_pair
from speculative import backend
from speculative.backend import LlamaContext, LlamaModel
from speculative.divergence import explain
from speculative.loading import resolve_flash_attn, threads_choice
from speculative.penalties import penalizer_for
from speculative.policies import Mode

log = logging.getLogger(__name__)

# Openings of the conversations and the user's later turns: code the built-in pair continues.
OPENINGS = (
    "class Stack:\n",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\n\n\ndef walk(root):\n",
    "def parse(text):\n    result = []\n    for line in text.splitlines():\n",
)
FOLLOW_UPS = ("\n\ndef main():\n", "\n\nclass Config:\n", "\n\nif __name__ == '__main__':\n")
NO_DRAFT = (Mode.PLAIN.value, Mode.NGRAM.value, Mode.AUTO.value)  # modes the target alone runs
RSS_MARGIN_KIB = 32 * 1024  # "flat": within this of the warm-up figure
WAIT_S = 600.0              # a reply or a model load that takes longer is a hang
# of the tokens: the resident memory after a model load climbs over the first loads while the
# allocator settles (no Engine, n-gram model or LlamaModel outlives its load), then stays level;
# the warm-up is long enough to hold those first loads at the default switching pace
WARM_UP = 1 / 3


@dataclasses.dataclass(slots=True)
class SoakReport:
    tokens: int = 0                 # generated, plain references included
    turns: int = 0                  # replies, plain references included
    conversations: int = 0
    mode_toggles: int = 0           # turns whose mode differed from the previous turn's
    switches: int = 0               # model loads after the first
    compared: int = 0               # replies checked against plain decoding of the same prompt
    identical: int = 0
    mismatches: list[str] = dataclasses.field(default_factory=list)  # turn, mode, where, why
    ties: int = 0                   # mismatches at a batch-shape tie of the target's logits
    rss_start_kib: int = 0          # before the window opened
    rss_warm_kib: int = 0           # the highest after a turn of the warm-up (WARM_UP of tokens)
    rss_peak_kib: int = 0           # the highest after a turn since, the end included
    rss_end_kib: int = 0            # after the last turn (on the pair), before closing
    contexts: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)
    # (models, contexts alive, expected) after each load
    contexts_after_close: int = 0
    seconds: float = 0.0

    @property
    def rss_flat(self) -> bool:
        """No new high after the warm-up: where each load's buffers land varies from load to
        load (the pair holds more than the target alone), a leak climbs past that."""
        return self.rss_peak_kib - self.rss_warm_kib <= RSS_MARGIN_KIB

    @property
    def errors(self) -> int:
        """Replies that differ from plain where the target's logits do not tie."""
        return self.compared - self.identical - self.ties

    @property
    def context_leak(self) -> bool:
        return self.contexts_after_close > 0 or any(a > e for _, a, e in self.contexts)


def rss_kib() -> int:
    """This process's resident memory, in KiB (Linux: /proc/self/status)."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class ContextCensus:
    """Every ``LlamaContext`` created while installed, held weakly; ``alive()`` counts those
    whose llama.cpp context has not been freed."""

    def __init__(self) -> None:
        self._seen: weakref.WeakSet[backend.LlamaContext] = weakref.WeakSet()

    @contextlib.contextmanager
    def installed(self) -> Iterator[ContextCensus]:
        cls = backend.LlamaContext
        original = cls.__init__

        def counted(ctx: backend.LlamaContext, *args: Any, **kwargs: Any) -> None:
            original(ctx, *args, **kwargs)
            self._seen.add(ctx)

        cls.__init__ = counted  # type: ignore[method-assign]
        try:
            yield self
        finally:
            cls.__init__ = original  # type: ignore[method-assign]

    def alive(self) -> int:
        return sum(1 for ctx in list(self._seen) if ctx._ctx is not None)


def wait_for(signal: SignalInstance, action: Callable[[], Any], seconds: float = WAIT_S,
             accept: Callable[..., bool] = lambda *_: True) -> tuple[Any, ...]:
    """Run ``action``, then the event loop until ``signal`` fires with accepted arguments."""
    loop = QEventLoop()
    got: list[tuple[Any, ...]] = []

    def on(*args: Any) -> None:  # the window's signals are emitted on this (the GUI) thread
        if not got and accept(*args):
            got.append(args)
            loop.quit()

    timer = QTimer()
    timer.setSingleShot(True)
    timer.timeout.connect(loop.quit)
    signal.connect(on)
    try:
        action()
        if not got:
            timer.start(int(seconds * 1000))
            loop.exec()
    finally:
        signal.disconnect(on)
        timer.stop()
    if not got:
        raise TimeoutError(f"no {signal} within {seconds:.0f} s")
    return got[0]


class Soak:
    """Drives one window through the session; ``run()`` fills the report."""

    def __init__(self, window: MainWindow, census: ContextCensus, modes: Sequence[str],
                 switch_every: int, report: SoakReport, referee: LlamaContext) -> None:
        self.window, self.census, self.modes = window, census, list(modes)
        self.referee = referee  # the target, for explaining replies that differ from plain
        self.switch_every, self.report = switch_every, report
        self.references: dict[tuple[tuple[str, str], ...], list[int]] = {}
        self.with_draft = True
        self.dropped = 0       # the most messages any step of this turn's reply left out
        self.last_mode = ""
        window.step_shown.connect(self._note_dropped)

    def _note_dropped(self, _event: object) -> None:
        pending = self.window.pending
        if pending is not None:
            self.dropped = max(self.dropped, pending.dropped)

    def run(self, tokens: int) -> None:
        self._count_contexts()
        turn, conversation = 0, 0
        while self.report.tokens < tokens:
            full = self._conversation_turn(conversation, turn)
            turn += 1
            if full:
                conversation += 1
                self._new_conversation()
            if self.switch_every and turn % self.switch_every == 0:
                self._switch_models()
            self._note_rss(tokens, turn)
        if not self.with_draft:
            self._switch_models()  # end on the pair, the larger of the two
        self.report.rss_end_kib = rss_kib()
        self.report.rss_peak_kib = max(self.report.rss_peak_kib, self.report.rss_end_kib)

    def _note_rss(self, goal: int, turn: int) -> None:
        rss = rss_kib()
        if self.report.tokens <= goal * WARM_UP or not self.report.rss_warm_kib:
            self.report.rss_warm_kib = max(self.report.rss_warm_kib, rss)
        else:
            self.report.rss_peak_kib = max(self.report.rss_peak_kib, rss)
        log.info("turn %d: %d tokens, %d MiB resident, %d contexts", turn, self.report.tokens,
                 rss // 1024, self.census.alive())

    def _conversation_turn(self, conversation: int, turn: int) -> bool:
        """One user message and its reply; True when the conversation has filled the window."""
        window = self.window
        messages = (window.history.messages(window.conversation.id)
                    if window.conversation is not None else [])
        users = sum(m.role == "user" for m in messages)
        text = (OPENINGS[conversation % len(OPENINGS)] if users == 0
                else FOLLOW_UPS[(users - 1) % len(FOLLOW_UPS)])
        # the prompt: the format (a new chat's follows the models loaded) and the messages
        fmt = (window.conversation.prompt_format if window.conversation is not None
               else window.format_combo.currentData())
        key = (("format", fmt), *((m.role, m.text) for m in messages), ("user", text))
        mode = self._mode(turn)
        self.dropped = 0
        if key not in self.references:
            self._set_mode(Mode.PLAIN.value)
            reply = self._ask(lambda: window.send_text(text))
            self.references[key] = reply.tokens
            self._set_mode(mode)
            reply = self._ask(window.regenerate)
        else:
            self._set_mode(mode)
            reply = self._ask(lambda: window.send_text(text))
        self._compare(reply.tokens, self.references[key], turn, mode, key)
        return reply.finish == "context" or self.dropped > 0 or users + 1 >= 4

    def _mode(self, turn: int) -> str:
        usable = [m for m in self.modes if self.with_draft or m in NO_DRAFT]
        mode = (usable or [Mode.PLAIN.value])[turn % max(1, len(usable))]
        if self.last_mode and mode != self.last_mode:
            self.report.mode_toggles += 1
        self.last_mode = mode
        return mode

    def _set_mode(self, mode: str) -> None:
        if self.window.settings.mode != mode:
            self.window.apply_settings(dataclasses.replace(self.window.settings, mode=mode))

    def _ask(self, action: Callable[[], Any]) -> Any:
        """Run ``action`` (send or regenerate) and return the stored reply."""
        window = self.window
        wait_for(window.reply_finished, action)
        assert window.conversation is not None
        reply = window.history.messages(window.conversation.id)[-1]
        if reply.role != "assistant" or reply.finish == "error":
            raise RuntimeError(f"no reply: {window.banner.text()}")
        self.report.tokens += len(reply.tokens)
        self.report.turns += 1
        return reply

    def _compare(self, tokens: list[int], plain: list[int], turn: int, mode: str,
                 key: tuple[tuple[str, str], ...]) -> None:
        self.report.compared += 1
        if tokens == plain:
            self.report.identical += 1
            return
        models = "pair" if self.with_draft else "target alone"
        (_, fmt), *_ = key
        vocab = self.referee.model.vocab
        params = self.window.chat_settings().sampling(0, FORMATS[fmt])
        why = explain(self.referee, self._prompt(key), plain, tokens,
                      penalizer_for(params, vocab.n_vocab, vocab.tokens_containing))
        if why is None:  # one is a prefix of the other: a stop string cut it elsewhere
            at, tie, text = min(len(tokens), len(plain)), False, "one reply ends early"
        else:
            at, tie, text = why.index, why.tie, why.describe()
        self.report.ties += tie
        self.report.mismatches.append(
            f"turn {turn} ({mode}, {models}, token {at}: {'a tie' if tie else 'NOT a tie'})")
        log.warning("turn %d (%s, %s) differs from plain decoding at %s", turn, mode, models,
                    text)

    def _prompt(self, key: tuple[tuple[str, str], ...]) -> list[int]:
        """The tokens the worker decoded for the conversation ``key``
        (``app.worker.replying.prompt_for``)."""
        (_, fmt), *messages = key
        ctx = self.referee
        return chat_prompt(fmt, messages, ctx.model.vocab.tokenize, ctx.n_ctx,
                           self.window.settings.max_tokens).tokens

    def _new_conversation(self) -> None:
        self.window.new_conversation()
        self.report.conversations += 1

    def _switch_models(self) -> None:
        """The built-in pair <-> the built-in target alone (an explicit path, no draft)."""
        window = self.window
        self.with_draft = not self.with_draft
        target = "" if self.with_draft else str(builtin_pair()[0])
        mode = window.settings.mode if self.with_draft or window.settings.mode in NO_DRAFT \
            else Mode.PLAIN.value
        settings = dataclasses.replace(window.settings, target_path=target, draft_path="",
                                       mode=mode)
        wait_for(window.models_loaded, lambda: window.apply_settings(settings))
        self.report.switches += 1
        self._count_contexts()

    def _count_contexts(self) -> None:
        expected = 2 if self.with_draft else 1
        name = "pair" if self.with_draft else "target alone"
        self.report.contexts.append((name, self.census.alive(), expected))


def run_soak(tokens: int, modes: Sequence[str], switch_every: int = 3, max_tokens: int = 160,
             data_dir: Path | None = None) -> SoakReport:
    """The session, in a window of its own (settings and history under ``data_dir``, or a
    temporary folder)."""
    report = SoakReport(rss_start_kib=rss_kib())
    t0 = time.perf_counter()
    create_app()
    census = ContextCensus()
    with contextlib.ExitStack() as stack:
        # the referee: the built-in target in a context like the worker's, flash attention as
        # the worker's is (measured once and remembered), one thread (before the census, which
        # counts the window's contexts only)
        model = stack.enter_context(LlamaModel(builtin_pair()[0]))
        config = AppSettings(max_tokens=max_tokens).context(threads=max(app_threads()))
        counts = app_threads()
        threads = threads_choice(model, config, counts, window_handicap(counts)).threads
        like_worker = resolve_flash_attn(model, dataclasses.replace(config, n_threads=threads))
        referee = stack.enter_context(LlamaContext(
            model, dataclasses.replace(like_worker, n_threads=1)))
        folder = data_dir or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        stack.enter_context(census.installed())
        settings = {"temperature": 0.0, "seed": 0, "max_tokens": max_tokens,
                    "mode": modes[0], "target_path": "", "draft_path": ""}
        window = _loaded(folder, settings)
        try:
            report.conversations = 1
            Soak(window, census, modes, switch_every, report, referee).run(tokens)
        finally:
            window.close()
            window.history.close()
            window.deleteLater()
        report.contexts_after_close = census.alive()
    report.seconds = time.perf_counter() - t0
    return report


def _loaded(folder: Path, settings: dict[str, Any]) -> MainWindow:
    """The window, once its models have loaded (the signal is queued to this thread, so it
    cannot fire before the event loop runs)."""
    window = open_window(folder, settings)
    if window.info is None:
        wait_for(window.models_loaded, lambda: None)
    return window


def format_report(r: SoakReport) -> str:
    mib = 1024
    contexts = ", ".join(f"{name} {alive}/{expected}" for name, alive, expected in r.contexts)
    return "\n".join([
        f"soak: {r.tokens} tokens in {r.turns} replies, {r.conversations} conversations, "
        f"{r.mode_toggles} mode toggles, {r.switches} model switches, {r.seconds:.0f} s",
        f"identical to plain: {r.identical} of {r.compared}; {r.ties} part from plain at a "
        f"batch-shape tie of the target's logits, {r.errors} where it does not tie"
        + (f" (differ: {', '.join(r.mismatches)})" if r.mismatches else ""),
        f"resident memory: start {r.rss_start_kib / mib:.0f} MiB, warm-up peak "
        f"{r.rss_warm_kib / mib:.0f} MiB, peak since {r.rss_peak_kib / mib:.0f} MiB, end "
        f"{r.rss_end_kib / mib:.0f} MiB ({'flat' if r.rss_flat else 'GROWING'}: "
        f"{(r.rss_peak_kib - r.rss_warm_kib) / mib:+.1f} MiB over the warm-up, margin "
        f"{RSS_MARGIN_KIB / mib:.0f})",
        f"llama.cpp contexts alive (alive/expected) after each load: {contexts}; "
        f"after closing: {r.contexts_after_close}"
        + (" (LEAK)" if r.context_leak else ""),
    ])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.diagnostics.soak", description=__doc__)
    parser.add_argument("--tokens", type=int, default=20_000, help="stop after this many")
    parser.add_argument("--modes", default=",".join(m.value for m in Mode.selectable()),
                        help="modes toggled between turns, in order")
    parser.add_argument("--switch-every", type=int, default=3,
                        help="switch models every N turns (0: never)")
    parser.add_argument("--max-tokens", type=int, default=160, help="tokens per reply at most")
    parser.add_argument("--data-dir", type=Path, help="keep settings and history here")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every turn")
    args = parser.parse_args(argv)
    modes = [Mode(m.strip()).value for m in args.modes.split(",") if m.strip()]
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    report = run_soak(args.tokens, modes, args.switch_every, args.max_tokens, args.data_dir)
    if args.json:
        print(json.dumps({**dataclasses.asdict(report), "rss_flat": report.rss_flat,
                          "errors": report.errors, "context_leak": report.context_leak},
                         indent=2))
    else:
        print(format_report(report))
    ok = report.errors == 0 and report.rss_flat and not report.context_leak
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
