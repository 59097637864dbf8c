"""Reliability of the app: context limits, interruptions, history faults, odd text and
long sessions, driven through the window's own signals with the real built-in models (offscreen
Qt).

What a test does "mid-generation" really happens mid-generation: ``Gate`` holds the engine's
generator after a few steps (on the engine thread) until the test has acted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from app import prompting as prompting_module
from app.diagnostics.soak import run_soak
from app.history import FINISH_REASONS, History, Message
from app.main import open_window
from app.prompting import TRANSCRIPT, Prompt
from app.ui.main_window import MainWindow
from app.worker.messages import StepEvent
from models.catalog import builtin_pair
from speculative.engine import Step
from speculative.errors import LlamaError
from speculative.stats import StepStats

ROOT = Path(__file__).resolve().parents[2]
LOAD_MS = 120_000
REPLY_MS = 120_000
LONG = "class Stack:\n"  # the built-in target writes on and on after a class line


@pytest.fixture()
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


def _open(qtbot: Any, data_dir: Path, **overrides: Any) -> MainWindow:
    settings = {"temperature": 0.0, "max_tokens": 24, "mode": "staged", "seed": 0, **overrides}
    window = open_window(data_dir, settings)
    qtbot.addWidget(window)
    if window.info is None:
        with qtbot.waitSignal(window.models_loaded, timeout=LOAD_MS):
            pass
    return window


def _is(request_id: int | None) -> Callable[[int], bool]:
    return lambda rid: rid == request_id


def _send(qtbot: Any, window: MainWindow, text: str) -> int:
    """Send ``text`` and wait until its reply is stored (or has failed); the request id."""
    with qtbot.waitSignal(window.reply_finished, timeout=REPLY_MS) as blocker:
        request_id = window.send_text(text)
        assert request_id is not None
        blocker.check_params_callback = _is(request_id)
    return request_id


def _messages(window: MainWindow) -> list[Message]:
    assert window.conversation is not None
    return window.history.messages(window.conversation.id)


def _idle(window: MainWindow) -> bool:
    return window.pending is None and window.send_button.text() == "Send"


class Gate:
    """Hold the engine after ``after`` steps of its next reply until ``open()`` (or Stop).

    Installed on the worker's engine for one reply (an instance attribute shadows
    ``Engine.generate``); the wrapper runs on the engine thread and only waits between steps,
    where a real engine would be drafting or verifying."""

    def __init__(self, window: MainWindow, after: int = 2) -> None:
        engine = window.controller.worker._engine
        assert engine is not None, "models not loaded"
        self.engine, self.real = engine, engine.generate
        self.after = after
        self.held = threading.Event()
        self._open = threading.Event()
        engine.generate = self._generate  # type: ignore[method-assign]

    def open(self) -> None:
        self._open.set()

    def _generate(self, *args: Any, cancel: Callable[[], bool] = lambda: False,
                  **kwargs: Any) -> Iterator[Step]:
        del self.engine.generate  # this reply only
        with contextlib.closing(self.real(*args, cancel=cancel, **kwargs)) as steps:
            for i, step in enumerate(steps, 1):
                yield step
                if i == self.after and step.finish is None:
                    self.held.set()
                    while not self._open.wait(0.01) and not cancel():
                        pass


def _hold(qtbot: Any, window: MainWindow, text: str, after: int = 2) -> tuple[Gate, int]:
    """Send ``text`` and return once the engine is held mid-reply."""
    gate = Gate(window, after)
    request_id = window.send_text(text)
    assert request_id is not None
    qtbot.waitUntil(gate.held.is_set, timeout=REPLY_MS)
    return gate, request_id


# ---------------------------------------------------------------- context limits


def test_a_prompt_longer_than_the_window_is_an_error_and_the_app_keeps_working(
        qtbot: Any, data_dir: Path) -> None:
    window = _open(qtbot, data_dir, n_ctx=128)
    assert window.info is not None and window.info.n_ctx == 128
    too_long = "total = total + 1\n" * 60  # ~360 tokens
    _send(qtbot, window, too_long)
    assert window.banner.kind == "error"
    assert "128" in window.banner.text() and "prompt" in window.banner.text()
    assert _idle(window)
    assert [m.role for m in _messages(window)] == ["user"]  # no empty reply stored
    assert [m.role for m in window.chat.messages] == ["user"]
    _send(qtbot, window, "x = 1\n")  # the long message is left out of this prompt
    reply = _messages(window)[-1]
    assert reply.role == "assistant" and reply.finish in ("stop", "length", "context")
    assert window.banner.kind == "warning" and "oldest 1 message" in window.banner.text()
    window.close()


def test_a_conversation_that_outgrows_the_window_drops_the_oldest_turns(
        qtbot: Any, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[tuple[tuple[tuple[str, str], ...], Prompt]] = []
    real = prompting_module.build_prompt

    def recording(fmt: Any, messages: Any, *args: Any, **kwargs: Any) -> Prompt:
        prompt = real(fmt, messages, *args, **kwargs)
        built.append((tuple(messages), prompt))  # on the engine thread: list.append is atomic
        return prompt

    monkeypatch.setattr(prompting_module, "build_prompt", recording)
    window = _open(qtbot, data_dir, n_ctx=128, max_tokens=16)
    _send(qtbot, window, "Hello, this is the first message of a long chat.")
    window.format_combo.setCurrentIndex(window.format_combo.findData(TRANSCRIPT.name))
    assert window.conversation is not None and window.conversation.prompt_format == "transcript"
    for i in range(2, 7):
        _send(qtbot, window, f"Message number {i}: tell me more about stacks and queues.")
        if built[-1][1].dropped:
            break
    messages, prompt = built[-1]
    assert prompt.dropped > 0, "six turns of ~30 tokens should outgrow 128 tokens"
    assert window.banner.kind == "warning"
    assert f"oldest {prompt.dropped} message(s)" in window.banner.text()
    assert "128-token window" in window.banner.text()
    assert window.controller.worker._pair is not None
    text = window.controller.worker._pair.target.vocab.detokenize(prompt.tokens)
    assert text.startswith(TRANSCRIPT.header)  # the format's header stays
    assert "first message" not in text
    assert text.endswith(TRANSCRIPT.user_prefix + messages[-1][1] + TRANSCRIPT.turn_suffix
                         + TRANSCRIPT.assistant_prefix)
    stored = _messages(window)
    assert stored[-1].role == "assistant" and stored[-1].finish in ("stop", "length", "context")
    assert stored[-2].text == messages[-1][1]
    window.close()


def test_a_reply_that_reaches_the_end_of_the_window_stops_with_context(
        qtbot: Any, data_dir: Path) -> None:
    window = _open(qtbot, data_dir, n_ctx=128, max_tokens=400, mode="tree")
    _send(qtbot, window, "x = 1\n" * 30)  # ~120 of the 128 tokens: no room for a stop
    reply = _messages(window)[-1]
    assert reply.role == "assistant" and reply.finish == "context"
    assert 0 < len(reply.tokens) < 16
    assert window.chat.last_reply_text() == reply.text
    assert window.banner.kind == "warning" and "end of the context window" in \
        window.banner.text()
    assert _idle(window)
    _send(qtbot, window, "y = 2\n")  # as the banner promised: the oldest turns go
    assert _messages(window)[-1].role == "assistant"
    assert "oldest" in window.banner.text()
    window.close()


# ---------------------------------------------------------------- interruptions


def test_stop_while_models_load_stops_the_queued_reply(qtbot: Any, data_dir: Path) -> None:
    """Stop pressed before the engine picked the request up (it was loading models) still
    stops that reply: the worker must not clear the stop when it begins the reply."""
    window = _open(qtbot, data_dir, max_tokens=400)
    target, _ = builtin_pair()
    with qtbot.waitSignals([window.models_loaded, window.reply_finished], timeout=REPLY_MS):
        window.apply_settings(dataclasses.replace(window.settings, target_path=str(target),
                                                  draft_path="", mode="ngram"))
        window.send_text(LONG)
        window.stop()
    reply = _messages(window)[-1]
    assert reply.role == "assistant" and reply.finish == "cancelled" and not reply.tokens
    assert _idle(window) and window.info is not None and window.info.draft is None
    _send(qtbot, window, "x = 1\n")  # the flag does not stick to the next reply
    assert _messages(window)[-1].finish in ("stop", "length", "context")


def test_rapid_send_and_stop_ends_idle_with_every_reply_finished(
        qtbot: Any, data_dir: Path) -> None:
    window = _open(qtbot, data_dir, max_tokens=400)
    for cycle in range(10):
        text = f"{LONG}    # cycle {cycle}\n"
        with qtbot.waitSignal(window.reply_finished, timeout=REPLY_MS):
            if cycle % 2:  # Stop mid-reply
                gate, _ = _hold(qtbot, window, text, after=1 + cycle % 3)
                window.stop()
                gate.open()
            else:  # Stop at once, before the engine has begun
                assert window.send_text(text) is not None
                window.stop()
            assert window.send_text("refused while a reply runs") is None
        assert _idle(window)
    replies = [m for m in _messages(window) if m.role == "assistant"]
    assert len(replies) == 10
    assert all(m.finish == "cancelled" for m in replies)
    assert not any(m.tokens for m in replies[::2])
    assert all(0 < len(m.tokens) < 400 for m in replies[1::2])
    assert all(window.chat.plain_text_of(i) == m.text for i, m in
               enumerate(_messages(window)))
    assert window.banner.isHidden()
    window.close()


def test_settings_changed_mid_reply_apply_from_the_next_step(
        qtbot: Any, data_dir: Path) -> None:
    window = _open(qtbot, data_dir, mode="plain", max_tokens=120)
    _send(qtbot, window, LONG)
    plain = _messages(window)[-1]
    window.new_conversation()
    steps: list[StepEvent] = []
    window.step_shown.connect(steps.append)
    gate, request_id = _hold(qtbot, window, LONG, after=2)
    with qtbot.waitSignal(window.reply_finished, timeout=REPLY_MS,
                          check_params_cb=_is(request_id)):
        window.apply_settings(dataclasses.replace(window.settings, mode="tree", max_nodes=8,
                                                  max_depth=4))
        gate.open()
    reply = _messages(window)[-1]
    assert reply.finish in ("stop", "length", "context")
    assert reply.mode == "tree"  # applied mid-reply
    assert sum(ev.stats.drafted for ev in steps[2:]) > 0  # the draft tree, from the next step
    assert all(ev.stats.drafted <= 8 for ev in steps)
    assert reply.tokens == plain.tokens  # greedy: switching modes mid-reply is lossless


def test_sampling_changed_mid_reply_applies_from_the_next_step(
        qtbot: Any, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    window = _open(qtbot, data_dir, max_tokens=120)
    engine = window.controller.worker._engine
    assert engine is not None
    used: list[Any] = []
    real_step = engine._step

    def step(committed: Any, config: Any, params: Any, rng: Any) -> Any:  # engine thread
        used.append(params)
        return real_step(committed, config, params, rng)

    monkeypatch.setattr(engine, "_step", step)
    sent: list[Any] = []
    real = window.controller.generate
    monkeypatch.setattr(window.controller, "generate", lambda r: (sent.append(r), real(r)))
    gate, request_id = _hold(qtbot, window, LONG)
    with qtbot.waitSignal(window.reply_finished, timeout=REPLY_MS,
                          check_params_cb=_is(request_id)):
        window.apply_settings(dataclasses.replace(window.settings, temperature=0.9,
                                                  top_k=20, mode="ngram"))
        gate.open()
    assert _messages(window)[-1].finish in ("stop", "length", "context")
    assert [p.temperature for p in used[:2]] == [0.0, 0.0]
    # the engine was held between steps 2 and 3, where the change arrived: it applies at the
    # next step boundary the worker passes (3 or 4) and stays
    first = next(i for i, p in enumerate(used) if p.temperature == 0.9)
    assert first <= 3 and all(p.temperature == 0.9 and p.top_k == 20 for p in used[first:])
    assert len({p.seed for p in used}) == 1  # the reply's own random stream goes on
    _send(qtbot, window, "x = 1\n")
    assert sent[-1].settings.temperature == 0.9 and sent[-1].settings.top_k == 20
    assert _messages(window)[-1].mode == "ngram"
    window.close()


def test_models_changed_mid_reply_end_it_cleanly_and_load(qtbot: Any, data_dir: Path) -> None:
    window = _open(qtbot, data_dir, max_tokens=400)
    gate, request_id = _hold(qtbot, window, LONG)
    target, _ = builtin_pair()
    with qtbot.waitSignals([window.reply_finished, window.models_loaded], timeout=REPLY_MS,
                           check_params_cbs=[_is(request_id), None]):
        window.apply_settings(dataclasses.replace(window.settings, target_path=str(target),
                                                  draft_path="", mode="ngram"))
        gate.open()
    reply = _messages(window)[-1]
    assert reply.role == "assistant" and reply.finish in ("cancelled", "stop", "length",
                                                          "context")
    assert window.info is not None and window.info.draft is None
    assert _idle(window)
    _send(qtbot, window, "x = 1\n")
    assert _messages(window)[-1].mode == "ngram"
    window.close()


def test_closing_mid_reply_ends_the_thread_and_frees_the_models(
        qtbot: Any, data_dir: Path) -> None:
    threads = threading.active_count()
    window = _open(qtbot, data_dir, max_tokens=400)
    pair = window.controller.worker._pair
    assert pair is not None and pair.draft_ctx is not None
    gate, _ = _hold(qtbot, window, LONG)
    t0 = time.perf_counter()
    window.close()
    assert time.perf_counter() - t0 < 5.0
    gate.open()
    assert window.controller.thread.isFinished()
    assert window.controller.worker._pair is None  # freed on the engine thread, not by GC
    assert pair.target_ctx._ctx is None and pair.draft_ctx._ctx is None
    assert threading.active_count() == threads



def test_a_failure_mid_reply_keeps_what_was_written(qtbot: Any, data_dir: Path) -> None:
    """The engine fails after some steps: the reply it streamed is stored with its tokens and
    statistics, and shown as stored, with the reason, now and when the chat is reopened."""
    window = _open(qtbot, data_dir, mode="plain")
    pair, engine = window.controller.worker._pair, window.controller.worker._engine
    assert pair is not None and engine is not None
    tokens = pair.target.vocab.tokenize("    total = 0\n    for x in")
    streamed = _steps_of(tokens, 2)

    def failing(*args: Any, **kwargs: Any) -> Iterator[Step]:
        steps = streamed(*args, **kwargs)
        for _ in range(3):
            yield next(steps)
        raise LlamaError("llama_decode returned -3")

    engine.generate = failing  # type: ignore[method-assign]
    steps: list[StepEvent] = []
    window.step_shown.connect(steps.append)
    _send(qtbot, window, "def f(xs):\n")
    reply = _messages(window)[-1]
    assert reply.role == "assistant" and reply.finish == "error"
    assert reply.tokens == tokens[:6] and reply.text == "".join(
        t for ev in steps for t, _ in ev.pieces) != ""
    assert reply.stats["error"] == "llama_decode returned -3"
    assert reply.stats["target_passes"] == 3 and reply.stats["tokens"] == 6
    assert window.banner.text() == "llama_decode returned -3" and _idle(window)
    shown = window.chat.messages[-1]
    assert window.chat.last_reply_text() == reply.text
    assert shown.footer.endswith("stopped by an error: llama_decode returned -3")
    assert "6 tokens" in shown.footer
    window.close()
    again = _open(qtbot, data_dir, mode="plain")
    assert again.chat.messages[-1].footer == shown.footer
    assert again.chat.last_reply_text() == reply.text
    again.close()


# ---------------------------------------------------------------- history


def test_sigkill_while_a_reply_streams_loses_at_most_that_reply(data_dir: Path) -> None:
    data_dir.mkdir(parents=True)
    db = data_dir / "history.sqlite3"
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    app = subprocess.Popen(
        [sys.executable, "-m", "app.tools.cli", "app", "--data-dir", str(data_dir), "--prompt",
         LONG, "--max-tokens", "4096", "--temp", "0", "--mode", "tree"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + LOAD_MS / 1000
        while not _has_user_message(db):  # the reply is requested right after it is stored
            assert app.poll() is None, app.stderr.read().decode() if app.stderr else ""
            assert time.monotonic() < deadline, "the app never stored the message"
            time.sleep(0.01)
        app.send_signal(signal.SIGKILL)
        app.wait(30)
    finally:
        if app.poll() is None:
            app.kill()
            app.wait(30)
        if app.stderr is not None:
            app.stderr.close()
    assert app.returncode == -signal.SIGKILL
    with contextlib.closing(sqlite3.connect(db)) as raw:
        assert raw.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    with History(db) as history:
        assert history.recovered_from is None
        [conversation] = history.conversations()
        messages = history.messages(conversation.id)
    assert [m.role for m in messages][:1] == ["user"] and messages[0].text == LONG
    assert len(messages) <= 2  # the reply, if it was stored before the kill, is whole:
    assert all(m.finish in FINISH_REASONS for m in messages[1:])


def _has_user_message(db: Path) -> bool:
    """Whether the app has committed a user message, read through a read-only connection."""
    if not db.exists():
        return False
    try:
        with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True,
                                                timeout=1)) as ro:
            return ro.execute("SELECT 1 FROM messages WHERE role = 'user'").fetchone() \
                is not None
    except sqlite3.OperationalError:  # not created yet, or the schema is being written
        return False


def test_a_corrupt_history_file_is_kept_aside_and_chatting_works(
        qtbot: Any, data_dir: Path) -> None:
    data_dir.mkdir(parents=True)
    damaged = b"SQLite format 3\x00" + bytes(range(256)) * 64
    (data_dir / "history.sqlite3").write_bytes(damaged)
    window = _open(qtbot, data_dir)
    assert window.banner.kind == "warning" and "damaged" in window.banner.text()
    [backup] = data_dir.glob("history.sqlite3.corrupt-*")
    assert backup.name in window.banner.text()
    assert backup.read_bytes() == damaged
    _send(qtbot, window, "x = 1\n")
    assert [m.role for m in _messages(window)] == ["user", "assistant"]
    assert len(window.list_model.items) == 1
    window.close()


# ---------------------------------------------------------------- odd text

ODD_TEXTS = {
    "control characters": "tab\there, bell\x07, escape \x1b[31mred\x1b[0m, feed\x0c, DEL\x7f",
    "NUL": "before\x00after",
    "emoji": "party \U0001f389 family \U0001f468\u200d\U0001f469\u200d\U0001f467 "
             "flag \U0001f1eb\U0001f1f7 thumb \U0001f44d\U0001f3fd",
    "right to left": "\u202eoverride\u202c \u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627",
    "combining and odd spaces": "e\u0301 \ufeff\u200b\u00a0\u3000 Z\u0335\u0321a",
    "20,000-character line": "".join(f"w{i % 997} " for i in range(4000))[:20_000],
}


@pytest.mark.parametrize("text", ODD_TEXTS.values(), ids=ODD_TEXTS.keys())
def test_odd_text_is_shown_and_stored_exactly_as_sent(
        qtbot: Any, data_dir: Path, text: str) -> None:
    window = _open(qtbot, data_dir, max_tokens=8)
    _send(qtbot, window, text)
    sent = text + "\n"  # code completion: Enter ends the line
    [user, *reply] = _messages(window)
    assert user.role == "user" and user.text == sent
    assert window.chat.messages[0].role == "user" and window.chat.plain_text_of(0) == sent
    assert sent.rstrip("\n") in _drawn(window)
    assert _idle(window)
    if len(text) > 10_000:  # thousands of tokens: more than the 512-token window
        assert window.banner.kind == "error" and "the context holds" in window.banner.text() \
            and not reply
    else:
        assert [m.role for m in reply] == ["assistant"]
        assert window.chat.last_reply_text() == reply[0].text
    window.close()
    again = _open(qtbot, data_dir)
    assert again.chat.plain_text_of(0) == sent
    again.close()


@pytest.mark.parametrize("text", ["", "   ", "\n\t \n", "\u3000\u2028"])
def test_an_empty_or_blank_prompt_is_not_sent(qtbot: Any, data_dir: Path, text: str) -> None:
    window = _open(qtbot, data_dir)
    assert window.send_text(text) is None
    assert window.pending is None and window.conversation is None
    assert window.history.conversations() == [] and window.chat.messages == []
    window.close()


def _drawn(window: MainWindow) -> str:
    """The chat view's document as drawn (raw: toPlainText() would turn no-break spaces into
    spaces), blocks joined by newlines."""
    return window.chat.document().toRawText().replace("\u2029", "\n")


def _steps_of(tokens: list[int], size: int) -> Callable[..., Iterator[Step]]:
    """A stand-in for ``Engine.generate`` that emits ``tokens``, ``size`` per step."""

    def generate(*_args: Any, run: Any = None, **_kwargs: Any) -> Iterator[Step]:
        for i in range(0, len(tokens), size):
            chunk = tokens[i:i + size]
            stats = StepStats(0, 0, 0, len(chunk), {"draft": 0, "ngram": 0,
                                                    "target": len(chunk)},
                              0, 0, 0, 0.0, 0.0, 0.001, 0.0)
            if run is not None:
                run.add(stats)
            last = i + size >= len(tokens)
            yield Step(chunk, stats, "length" if last else None, ["target"] * len(chunk))

    return generate


def test_a_reply_split_inside_characters_is_shown_as_stored(
        qtbot: Any, data_dir: Path) -> None:
    """GPT-2 writes a character of several UTF-8 bytes as several byte tokens. The engine's
    steps are replaced by real token ids whose pieces split characters, hold a stray
    continuation byte, and end in the middle of an emoji."""
    window = _open(qtbot, data_dir, mode="plain")
    pair, engine = window.controller.worker._pair, window.controller.worker._engine
    assert pair is not None and engine is not None
    vocab = pair.target.vocab
    stray = next(t for t in range(256) if vocab.piece(t) == b"\x80")
    tokens = [*vocab.tokenize(" caf\u00e9 \u65e5\u672c\u8a9e \U0001f389!"), stray,
              *vocab.tokenize(" ok"), *vocab.tokenize("\U0001f40d")[:1]]
    pieces = [vocab.piece(t) for t in tokens]
    assert sum(not _utf8(p) for p in pieces) >= 3  # characters really are split
    engine.generate = _steps_of(tokens, 3)  # type: ignore[method-assign]
    steps: list[StepEvent] = []
    window.step_shown.connect(steps.append)
    _send(qtbot, window, "s = '")
    reply = _messages(window)[-1]
    expected = b"".join(pieces).decode("utf-8", "replace")
    assert reply.text == expected and expected.endswith("!\ufffd ok\ufffd")
    assert reply.text.encode("utf-8")  # a valid str: no lone surrogates
    assert "".join(t for ev in steps for t, _ in ev.pieces) == reply.text
    assert window.chat.last_reply_text() == reply.text and reply.text in _drawn(window)
    assert reply.tokens == tokens
    assert sum(n for n, _ in reply.stats["origin_runs"]) == len(reply.text)
    window.close()


def _utf8(piece: bytes) -> bool:
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True

# ---------------------------------------------------------------- long sessions

_LEAKY_CALLS = """
import sys
from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QLabel
from app.main import create_app

class Flag(QObject):
    changed = Signal(bool)

calls = max(sys.getrefcount(x) for x in (None, True, False)) + 20_000
app = create_app()
label, flag = QLabel(), Flag()
for _ in range(calls):  # each one took a reference to None, True or False
    label.setText("x")
    flag.changed.emit(True)
    flag.changed.emit(False)
print("alive")
"""


def test_void_calls_and_bool_signals_never_deallocate_singletons() -> None:
    """PySide6 6.12.0 on Python 3.11 drops a reference to None per void method call and to
    True/False per ``Signal(bool)`` emission: without ``keep_singletons_alive`` a long session
    aborts ("none_dealloc", "bool_dealloc"); in a child process here."""
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    done = subprocess.run([sys.executable, "-c", _LEAKY_CALLS], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "alive"


def test_a_short_soak_stays_identical_to_plain_and_frees_its_contexts(qtbot: Any) -> None:
    """``python -m app.diagnostics.soak`` in brief: 600 tokens, modes toggled, the models
    switched. A reply may part from plain only where the target's own logits tie under
    llama.cpp's batch shapes (``speculative.divergence``); anywhere else it is an error."""
    report = run_soak(600, ["plain", "tree", "staged", "ngram"], switch_every=3, max_tokens=40)
    assert report.tokens >= 600 and report.mode_toggles >= 3 and report.switches >= 1
    assert report.compared > 0 and report.errors == 0, report.mismatches
    # after each load: two contexts with the pair, one with the target alone; none once closed
    alive = [(a, e) for _, a, e in report.contexts]
    assert len(alive) == report.switches + 1 and [e for _, e in alive][:2] == [2, 1]
    assert all(a == e for a, e in alive) and report.contexts_after_close == 0
    assert report.rss_peak_kib - report.rss_warm_kib < 150 * 1024  # generous: a short run


def test_a_stop_string_split_over_tokens_is_never_shown_nor_stored(
        qtbot: Any, data_dir: Path) -> None:
    """In code completion a reply ends where "\\ndef " starts a new function. The model writes
    it as several tokens, one per step here: the window must not show "\\nde" and then take
    it back, and the stored reply must end before the stop."""
    window = _open(qtbot, data_dir, mode="plain")
    pair, engine = window.controller.worker._pair, window.controller.worker._engine
    assert pair is not None and engine is not None
    vocab = pair.target.vocab
    body = vocab.tokenize("    return 1\n")
    tokens = [*body, *vocab.tokenize("\ndef"), *vocab.tokenize(" g():\n")]
    engine.generate = _steps_of(tokens, 1)  # type: ignore[method-assign]
    steps: list[StepEvent] = []
    window.step_shown.connect(steps.append)
    _send(qtbot, window, "def f():")
    reply = _messages(window)[-1]
    assert reply.text == "    return 1\n" and reply.finish == "stop"
    assert reply.tokens == body
    shown = "".join(t for ev in steps for t, _ in ev.pieces)
    assert shown == reply.text  # nothing of "\ndef" ever reached the window
    assert window.chat.last_reply_text() == reply.text
    window.close()
