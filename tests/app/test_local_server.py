"""The app's Local server switch: the window's models served to OpenAI's client while the
window chats, both on the one engine (offscreen Qt, the built-in models)."""

from __future__ import annotations

import dataclasses
import socket
import threading
from pathlib import Path
from typing import Any

import openai
import pytest

from app.main import open_window
from app.ui.main_window import MainWindow
from app.ui.settings_dialog import SettingsDialog

PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
LOAD_MS = 120_000
REPLY_MS = 120_000
MODEL = "staged-chat-target"


@pytest.fixture()
def window(qtbot, tmp_path: Path):
    settings = {"temperature": 0.0, "max_tokens": 24, "mode": "staged", "seed": 0,
                "server_port": 0, "server_api_key": "k"}
    w = open_window(tmp_path / "data", settings)
    qtbot.addWidget(w)
    if w.info is None:
        with qtbot.waitSignal(w.models_loaded, timeout=LOAD_MS):
            pass
    yield w
    w.close()


def _in_thread(call: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = call()
        except Exception as exc:  # shown by the test
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_a_chat_in_the_window_and_a_request_to_its_server_both_complete(
        qtbot, window: MainWindow) -> None:
    assert window.server_label.text().strip() == "off"
    window.server_action.setChecked(True)
    url = window.local_server.url
    assert url is not None and url.startswith("http://127.0.0.1:")
    assert url in window.server_label.text() and "0 requests answered" in \
        window.server_label.text()
    client = openai.OpenAI(base_url=url, api_key="k", max_retries=0, timeout=REPLY_MS / 1000)
    assert [m.id for m in client.models.list().data] == [MODEL]

    with qtbot.waitSignal(window.reply_finished, timeout=REPLY_MS):
        assert window.send_text(PROMPT) is not None
        # sent while the window's reply runs: it waits its turn on the engine
        thread, out = _in_thread(lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=24))
    qtbot.waitUntil(lambda: not thread.is_alive(), timeout=REPLY_MS)
    assert "error" not in out, out
    answer = out["result"]
    reply = window.history.messages(window.conversation.id)[-1]
    # the same prompt, the window's greedy settings, the code format's stops: the same text
    assert answer.choices[0].message.content == reply.text
    assert answer.model_extra["speculation"]["mode"] == "staged"  # the window's mode
    qtbot.waitUntil(lambda: "1 request answered" in window.server_label.text(), timeout=5000)

    window.server_action.setChecked(False)
    assert window.local_server.url is None
    assert window.server_label.text().strip() == "off"
    with pytest.raises(openai.APIConnectionError):
        client.models.list()


def test_a_port_in_use_is_reported_and_the_switch_goes_back_off(qtbot, window: MainWindow
                                                                ) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        window.apply_settings(dataclasses.replace(window.settings, server_port=taken))
        window.server_action.setChecked(True)
        assert not window.server_action.isChecked()
        assert f"port {taken}" in window.banner.text()
        assert window.local_server.url is None
        assert window.server_label.text().strip() == "off"


def test_the_port_and_key_are_settings(qtbot, window: MainWindow) -> None:
    dialog = SettingsDialog(window.settings)  # as open_settings makes it, not shown
    qtbot.addWidget(dialog)
    dialog.changed.connect(window.apply_settings)
    assert dialog.server_port.value() == 0
    dialog.server_port.setValue(18080)
    qtbot.keyClicks(dialog.server_api_key, "x")
    assert (window.settings.server_port, window.settings.server_api_key) == (18080, "kx")
    assert window.store.load().server_port == 18080
