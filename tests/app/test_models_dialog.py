"""Models in the app: a catalog model downloaded from a local server that answers the hub's file
routes (progress, cancel, resume), checked for tokenizer compatibility on the engine thread,
then used for a reply."""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from huggingface_hub import constants

from app.main import open_window
from models.catalog import Catalog, ModelEntry, ModelPair
from models.download import cached_path

REPO, FILENAME = "test-org/tiny-gpt2-GGUF", "tiny.Q8_0.gguf"
COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


class Hub:
    """One file on ``/{REPO}/resolve/{rev}/{FILENAME}``; ranged GETs; can stall mid-file."""

    def __init__(self, body: bytes) -> None:
        self.body, self.sha = body, hashlib.sha256(body).hexdigest()
        self.hold = threading.Event()  # set: serve everything; clear: stop at half
        self.hold.set()
        self.ranges: list[str | None] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._head(200, len(hub.body))

            def do_GET(self) -> None:
                if "/resolve/" not in self.path:
                    self.send_response(404)
                    self.end_headers()
                    return
                match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
                hub.ranges.append(self.headers.get("Range"))
                start = int(match.group(1)) if match else 0
                self._head(206 if match else 200, len(hub.body) - start, start)
                half = len(hub.body) // 2
                try:
                    if not hub.hold.is_set() and start < half:
                        self.wfile.write(hub.body[start:half])
                        self.wfile.flush()
                        hub.hold.wait(20)
                        return  # the client cancelled meanwhile: hang up
                    self.wfile.write(hub.body[start:])
                except OSError:
                    pass

            def _head(self, status: int, length: int, start: int = 0) -> None:
                self.send_response(status)
                for k, v in (("X-Repo-Commit", COMMIT), ("ETag", f'"{hub.sha}"'),
                             ("X-Linked-Etag", f'"{hub.sha}"'),
                             ("X-Linked-Size", str(len(hub.body))), ("Accept-Ranges", "bytes"),
                             ("Content-Length", str(length))):
                    self.send_header(k, v)
                if status == 206:
                    self.send_header("Content-Range",
                                     f"bytes {start}-{len(hub.body) - 1}/{len(hub.body)}")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def hub(tiny_models, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Hub]:
    server = Hub(Path(tiny_models["q8_0-target"]).read_bytes())
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    yield server
    server.hold.set()
    server.server.shutdown()
    server.server.server_close()


def _catalog(sha: str) -> Catalog:
    entry = ModelEntry(id="tiny-gpt2", description="a tiny GPT-2 for tests", quantization="Q8_0",
                       parameters=None, approx_size_bytes=None, sha256=sha, repo_id=REPO,
                       filename=FILENAME, revision="main")
    return Catalog(models=(entry,), pairs=(ModelPair("p", "tiny-gpt2", "tiny-gpt2", ""),),
                   default_pair="p")


def test_download_cancel_resume_check_and_use_a_catalog_model(qtbot, hub: Hub, tmp_path: Path,
                                                               tiny_models) -> None:
    window = open_window(tmp_path / "data", {"temperature": 0.0, "max_tokens": 8,
                                             "mode": "auto"})
    qtbot.addWidget(window)
    with qtbot.waitSignal(window.models_loaded, timeout=120_000):
        pass
    window.catalog = _catalog(hub.sha)
    window.open_models()
    dialog = window.models_dialog
    assert dialog is not None and dialog.table.rowCount() == 1
    entry = dialog.hub[0]
    worker = window.downloads  # its signals come on the GUI thread
    button = dialog.table.cellWidget(0, 3)
    assert button.text() == "Download"
    # start, stall half-way, cancel: a clear state, no file taken for complete
    hub.hold.clear()
    with qtbot.waitSignal(worker.progress, timeout=30_000,
                          check_params_cb=lambda _id, done, total: 0 < done < total):
        button.click()
    assert button.text() == "Cancel"
    with qtbot.waitSignal(worker.failed, timeout=30_000) as failed:
        button.click()
    assert "cancelled" in failed.args[1]
    assert cached_path(entry) is None
    # again: the part already fetched is resumed, checked and linked
    hub.hold.set()
    with qtbot.waitSignal(worker.done, timeout=60_000):
        dialog.table.cellWidget(0, 3).click()
    local = cached_path(entry)
    assert local is not None and local.read_bytes() == hub.body
    assert hub.ranges[0] is None and hub.ranges[-1] is not None  # resumed with a Range
    assert dialog._bars["tiny-gpt2"].format() == "downloaded"
    # use it as the target: the engine thread says which drafts fit (same GPT-2 tokenizer)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(300))
    dialog.extra_files += [str(tiny_models["q8_0-draft"]), str(broken)]
    dialog.table.selectRow(0)
    dialog._selected_as_target()
    qtbot.waitUntil(lambda: dialog.draft_combo.findData(str(tiny_models["q8_0-draft"])) >= 0,
                    timeout=60_000)
    assert dialog.draft_combo.findData(str(broken)) < 0
    assert any("broken.gguf" in why for why in dialog.refused)
    dialog.draft_combo.setCurrentIndex(dialog.draft_combo.findData(str(tiny_models["q8_0-draft"])))
    with qtbot.waitSignal(window.models_loaded, timeout=120_000):
        dialog._apply()
    assert window.settings.target_path == str(local)
    assert window.settings.draft_path == str(tiny_models["q8_0-draft"])
    assert window.info is not None and window.info.target_path == str(local)
    assert window.info.draft_path == str(tiny_models["q8_0-draft"])
    with qtbot.waitSignal(window.reply_finished, timeout=120_000):
        window.send_text("Hello")
    reply = window.history.messages(window.conversation.id)[-1]
    assert reply.role == "assistant" and len(reply.tokens) > 0
    window.close()
