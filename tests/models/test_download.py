"""models/download.py and models/catalog.py against a local server that answers the hub's file
routes the way huggingface_hub 2.x reads them (HEAD for metadata, ranged GET for bytes)."""

from __future__ import annotations

import collections
import errno
import hashlib
import itertools
import json
import os
import random
import re
import shutil
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest
from huggingface_hub import constants, hf_hub_download

from models import download as dl
from models.catalog import (
    CATALOG_PATH,
    CatalogError,
    ModelEntry,
    ModelNotAvailableError,
    load_catalog,
)

REPO = "test-org/tiny-GGUF"
FILENAME = "tiny.Q8_0.gguf"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
PAYLOAD = random.Random(0).randbytes(3 * 1024 * 1024 + 123)
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()


class FakeHub:
    """Serves one LFS file at ``/{REPO}/resolve/{revision}/{FILENAME}`` and records requests."""

    def __init__(self) -> None:
        self.body = PAYLOAD          # what GET sends; HEAD always describes PAYLOAD
        self.drop_at: int | None = None   # close the connection at this offset, once
        self.ignore_range = False  # answer ranged GETs with the whole file (200), as some do
        self.pause_at: int | None = None  # stop at this offset until `release` is set
        self.release = threading.Event()
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # method, path, headers
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.requests.append(("HEAD", self.path, dict(self.headers)))
                if self._found():
                    self._headers(200, len(PAYLOAD))

            def do_GET(self) -> None:
                hub.requests.append(("GET", self.path, dict(self.headers)))
                if not self._found():
                    return
                start = 0
                match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
                if match and not hub.ignore_range:
                    start = int(match.group(1))
                    self._headers(206, len(PAYLOAD) - start, start)
                else:
                    self._headers(200, len(PAYLOAD))
                hub.serve_body(self.wfile, start)

            def _found(self) -> bool:
                repo, _, rest = self.path.partition("/resolve/")
                revision, _, filename = rest.partition("/")
                if repo.lstrip("/") == REPO and unquote(filename) == FILENAME and revision:
                    return True
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return False

            def _headers(self, status: int, length: int, start: int = 0) -> None:
                self.send_response(status)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{PAYLOAD_SHA}"')
                self.send_header("X-Linked-Etag", f'"{PAYLOAD_SHA}"')
                self.send_header("X-Linked-Size", str(len(PAYLOAD)))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(length))
                if status == 206:
                    last = len(PAYLOAD) - 1
                    self.send_header("Content-Range", f"bytes {start}-{last}/{len(PAYLOAD)}")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def serve_body(self, wfile, start: int) -> None:
        end = len(self.body)
        if self.drop_at is not None and start < self.drop_at:
            end, self.drop_at = self.drop_at, None
        try:
            if self.pause_at is not None and start < self.pause_at < end:
                wfile.write(self.body[start:self.pause_at])
                wfile.flush()
                self.release.wait(10)
                start = self.pause_at
            wfile.write(self.body[start:end])
            wfile.flush()
        except OSError:
            pass  # the client hung up (cancelled)

    def file_requests(self) -> list[tuple[str, dict[str, str]]]:
        # huggingface_hub also asks the endpoint for other things (its telemetry's
        # /api/agent-harnesses); only the file route matters here
        return [(m, h) for m, path, h in self.requests if "/resolve/" in path]

    def ranges(self) -> list[str | None]:
        """The Range header of every GET of the file, in order (None: a full GET)."""
        return [h.get("Range") for m, h in self.file_requests() if m == "GET"]


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    server = FakeHub()
    server.thread.start()
    cache = tmp_path / "hf-cache"
    # huggingface_hub reads these at import time into `constants`; patch both
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    template = server.url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    yield server
    server.release.set()
    server.server.shutdown()
    server.server.server_close()


def tiny(sha256: str | None = None, revision: str = "main") -> ModelEntry:
    return ModelEntry(
        id="tiny", description="test file", quantization="Q8_0", parameters=None,
        approx_size_bytes=None, sha256=sha256, repo_id=REPO, filename=FILENAME, revision=revision,
    )


def blobs(cache: Path) -> list[str]:
    folder = cache / "models--test-org--tiny-GGUF" / "blobs"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_full_download_reports_progress_and_lands_in_the_hub_cache(hub: FakeHub) -> None:
    seen: list[tuple[int, int | None]] = []
    path = dl.download(tiny(sha256=PAYLOAD_SHA), progress=lambda d, t: seen.append((d, t)))

    assert path.read_bytes() == PAYLOAD
    cache = Path(constants.HF_HUB_CACHE)
    assert path == cache / "models--test-org--tiny-GGUF" / "snapshots" / COMMIT / FILENAME
    assert seen[0] == (0, len(PAYLOAD)) and seen[-1] == (len(PAYLOAD), len(PAYLOAD))
    assert len(seen) > 2 and all(a[0] <= b[0] for a, b in itertools.pairwise(seen))
    assert hub.ranges() == [None]
    assert blobs(cache) == [PAYLOAD_SHA]
    # the hub's own client finds it offline: same cache layout
    assert hf_hub_download(REPO, FILENAME, local_files_only=True) == str(path)
    # a second call is served from the cache without a request
    count = len(hub.file_requests())
    assert dl.download(tiny(sha256=PAYLOAD_SHA)) == path
    assert len(hub.file_requests()) == count


def test_dropped_connection_resumes_with_a_range_request(hub: FakeHub, tmp_path: Path) -> None:
    half = len(PAYLOAD) // 2
    hub.drop_at = half
    with pytest.raises(dl.DownloadInterrupted, match="run again to resume"):
        dl.download(tiny(), cache_dir=tmp_path)
    assert blobs(tmp_path) == [f"{PAYLOAD_SHA}.incomplete"]

    seen: list[tuple[int, int | None]] = []
    path = dl.download(tiny(), cache_dir=tmp_path, progress=lambda d, t: seen.append((d, t)))

    assert hub.ranges() == [None, f"bytes={half}-"]
    assert seen[0] == (half, len(PAYLOAD))
    assert path.read_bytes() == PAYLOAD  # verified against the hub's LFS etag
    assert blobs(tmp_path) == [PAYLOAD_SHA]


def test_cancel_from_another_thread_keeps_the_partial_file_for_resume(
    hub: FakeHub, tmp_path: Path
) -> None:
    hub.pause_at = len(PAYLOAD) // 3
    cancel = threading.Event()
    failure: list[BaseException] = []

    def cancel_once_bytes_arrive(done: int, total: int | None) -> None:
        if done > 0:
            cancel.set()

    def worker() -> None:
        try:
            dl.download(tiny(), cache_dir=tmp_path, progress=cancel_once_bytes_arrive,
                        cancel=cancel)
        except BaseException as e:
            failure.append(e)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(20)
    hub.release.set()
    assert not thread.is_alive()
    assert len(failure) == 1 and isinstance(failure[0], dl.DownloadCancelled)
    partial = tmp_path / "models--test-org--tiny-GGUF" / "blobs" / f"{PAYLOAD_SHA}.incomplete"
    kept = partial.stat().st_size
    assert 0 < kept <= hub.pause_at

    assert dl.cached_path(tiny(), tmp_path) is None  # the partial file is not the model

    path = dl.download(tiny(), cache_dir=tmp_path)
    assert hub.ranges()[-1] == f"bytes={kept}-"
    assert path.read_bytes() == PAYLOAD


def test_corrupt_bytes_raise_and_leave_nothing_that_looks_valid(
    hub: FakeHub, tmp_path: Path
) -> None:
    hub.body = bytes(b ^ 0xFF for b in PAYLOAD[:1000]) + PAYLOAD[1000:]
    with pytest.raises(dl.ChecksumError, match=r"corrupt.*deleted"):
        dl.download(tiny(sha256=PAYLOAD_SHA), cache_dir=tmp_path)
    assert blobs(tmp_path) == []
    assert dl.cached_path(tiny(), tmp_path) is None
    assert not (tmp_path / "models--test-org--tiny-GGUF" / "snapshots" / COMMIT).exists()

    hub.body = PAYLOAD  # the next attempt starts afresh and succeeds
    assert dl.download(tiny(sha256=PAYLOAD_SHA), cache_dir=tmp_path).read_bytes() == PAYLOAD
    assert hub.ranges() == [None, None]


def test_catalog_checksum_that_disagrees_with_the_hub_stops_before_downloading(
    hub: FakeHub, tmp_path: Path
) -> None:
    with pytest.raises(dl.ChecksumError, match="out of date"):
        dl.download(tiny(sha256="0" * 64), cache_dir=tmp_path)
    assert hub.ranges() == []


def test_missing_file_on_the_hub_is_a_clear_error(hub: FakeHub, tmp_path: Path) -> None:
    entry = ModelEntry(
        id="gone", description="", quantization="Q8_0", parameters=None, approx_size_bytes=None,
        sha256=None, repo_id=REPO, filename="gone.gguf", revision="main",
    )
    with pytest.raises(dl.DownloadError, match="not on the hub"):
        dl.download(entry, cache_dir=tmp_path)


def test_unreachable_hub_raises_offline_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(dl.OfflineError) as caught:
        dl.download(tiny(), cache_dir=tmp_path, endpoint=f"http://127.0.0.1:{port}")
    message = str(caught.value)
    assert message.startswith(f"cannot reach 127.0.0.1:{port}: ")
    assert "copy the GGUF file" in message and FILENAME in message


def test_offline_mode_raises_offline_error(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(dl.OfflineError, match=r"offline mode is on \(HF_HUB_OFFLINE\)"):
        dl.download(tiny(), cache_dir=tmp_path)
    assert hub.file_requests() == []


def test_cli_lists_and_downloads(hub: FakeHub, tmp_path: Path, capsys, monkeypatch) -> None:
    assert dl.main(["--list"]) == 0
    listing = capsys.readouterr().out
    assert "gpt2-large+gpt2" in listing and "distilgpt2-q8_0" in listing

    catalog = tmp_path / "catalog.json"
    catalog.write_text(json.dumps({
        "format": 1, "default_pair": "p",
        "models": [
            {"id": "tiny", "description": "", "quantization": "Q8_0", "repo_id": REPO,
             "filename": FILENAME, "revision": "main", "sha256": PAYLOAD_SHA},
            {"id": "local", "description": "", "quantization": "Q8_0", "path": "x.gguf"},
        ],
        "pairs": [{"id": "p", "target": "tiny", "draft": "local"}],
    }))
    monkeypatch.setattr(dl, "load_catalog", lambda: load_catalog(catalog))
    assert dl.main(["tiny", "--cache-dir", str(tmp_path / "c")]) == 0
    assert Path(capsys.readouterr().out.strip()).read_bytes() == PAYLOAD
    assert dl.main(["p"]) == 1  # the pair's built-in draft is missing
    assert "built-in model 'local' is missing" in capsys.readouterr().err


# --- faults: each a DownloadError with a readable message, never a partial file as the model ----


def partial_file(cache: Path) -> Path:
    return cache / "models--test-org--tiny-GGUF" / "blobs" / f"{PAYLOAD_SHA}.incomplete"


def test_stalled_server_is_an_interruption_and_the_next_call_resumes(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 1)  # read at call time
    hub.pause_at = len(PAYLOAD) // 3  # sends that much, then nothing (until released)
    with pytest.raises(dl.DownloadInterrupted, match=r"connection lost after \d+ of \d+ bytes"):
        dl.download(tiny(), cache_dir=tmp_path)
    kept = partial_file(tmp_path).stat().st_size
    assert 0 < kept <= hub.pause_at
    assert dl.cached_path(tiny(), tmp_path) is None
    hub.release.set()

    path = dl.download(tiny(), cache_dir=tmp_path)
    assert hub.ranges() == [None, f"bytes={kept}-"]
    assert path.read_bytes() == PAYLOAD


def test_server_that_cannot_resume_starts_over(hub: FakeHub, tmp_path: Path) -> None:
    hub.drop_at = len(PAYLOAD) // 2
    with pytest.raises(dl.DownloadInterrupted):
        dl.download(tiny(), cache_dir=tmp_path)
    hub.ignore_range = True
    path = dl.download(tiny(), cache_dir=tmp_path)
    assert hub.ranges() == [None, f"bytes={len(PAYLOAD) // 2}-"]  # asked, got the whole file
    assert path.read_bytes() == PAYLOAD  # not the first half twice


def test_corrupt_partial_file_is_caught_after_resuming_and_deleted(
    hub: FakeHub, tmp_path: Path
) -> None:
    """A partial file whose bytes are wrong (a disk error, someone else's file) is resumed like
    any other; the checksum then refuses the result, and nothing is left to be taken for it."""
    partial = partial_file(tmp_path)
    partial.parent.mkdir(parents=True)
    partial.write_bytes(bytes(len(PAYLOAD) // 2))  # zeros instead of the first half
    with pytest.raises(dl.ChecksumError, match="corrupt"):
        dl.download(tiny(), cache_dir=tmp_path)
    assert blobs(tmp_path) == []
    assert dl.cached_path(tiny(), tmp_path) is None
    assert dl.download(tiny(), cache_dir=tmp_path).read_bytes() == PAYLOAD
    assert hub.ranges() == [f"bytes={len(PAYLOAD) // 2}-", None]


def test_not_enough_disk_space_is_refused_before_downloading(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(dl.shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(dl.DiskFullError, match=r"not enough disk space in .*: 3 MB more "
                                               r"needed, 0 MB free"):
        dl.download(tiny(), cache_dir=tmp_path)
    assert hub.ranges() == []
    assert dl.cached_path(tiny(), tmp_path) is None
    # the command line says so and exits with 1
    monkeypatch.setattr(dl, "load_catalog", lambda: _catalog_with_tiny(tmp_path))
    assert dl.main(["tiny", "--cache-dir", str(tmp_path)]) == 1
    assert "error: not enough disk space" in capsys.readouterr().err


class _FillingDisk:
    """A file on a disk with ``room`` bytes left: writes what fits, then fails with ENOSPC."""

    def __init__(self, f, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            self.f.write(data[:self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __enter__(self) -> _FillingDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()


def test_disk_filling_up_mid_download_keeps_what_fits_for_resume(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    room = 1_000_000 + 17
    real_open = Path.open

    def open_on_a_full_disk(self: Path, mode: str = "r", *args, **kwargs):
        f = real_open(self, mode, *args, **kwargs)
        return _FillingDisk(f, room) if self.suffix == ".incomplete" else f

    monkeypatch.setattr(Path, "open", open_on_a_full_disk)
    with pytest.raises(dl.DiskFullError, match=r"is full after 1 MB of 3 MB; free some space"):
        dl.download(tiny(), cache_dir=tmp_path)
    assert partial_file(tmp_path).stat().st_size == room
    assert dl.cached_path(tiny(), tmp_path) is None

    monkeypatch.setattr(Path, "open", real_open)  # space freed
    path = dl.download(tiny(), cache_dir=tmp_path)
    assert hub.ranges() == [None, f"bytes={room}-"]
    assert path.read_bytes() == PAYLOAD


def _unwritable_folder(tmp_path: Path) -> Path:
    """A folder nobody can write into. chmod stops everyone but root (and tests in containers
    often run as root), so root gets a path beneath a regular file, which nobody can create."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        (folder / "probe").touch()
    except PermissionError:
        return folder
    (folder / "probe").unlink()
    blocker = tmp_path / "a-regular-file"
    blocker.write_text("not a folder")
    return blocker / "cache"


@pytest.mark.parametrize("where", ["unwritable", "under-a-file"])
def test_cache_folder_that_cannot_be_written_is_a_clear_error(
    hub: FakeHub, tmp_path: Path, where: str
) -> None:
    if where == "unwritable":
        cache = _unwritable_folder(tmp_path)
    else:
        (tmp_path / "file").write_text("x")
        cache = tmp_path / "file" / "cache"
    with pytest.raises(dl.CacheNotWritableError,
                       match=r"cannot write to the model cache .*; choose a folder you can "
                             r"write to \(--cache-dir, or the HF_HUB_CACHE"):
        dl.download(tiny(), cache_dir=cache)
    assert hub.ranges() == []  # refused before any byte was fetched
    assert dl.cached_path(tiny(), cache) is None
    assert dl.download(tiny(), cache_dir=tmp_path / "writable").read_bytes() == PAYLOAD


def test_cancel_before_the_first_byte(hub: FakeHub, tmp_path: Path) -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(dl.DownloadCancelled, match="before it started"):
        dl.download(tiny(), cache_dir=tmp_path, cancel=cancel)
    assert hub.ranges() == []
    assert dl.cached_path(tiny(), tmp_path) is None


def test_every_fault_is_a_download_error() -> None:
    """Callers (the app, the command line) catch DownloadError alone."""
    for cls in (dl.OfflineError, dl.DownloadCancelled, dl.DownloadInterrupted, dl.ChecksumError,
                dl.DiskFullError, dl.CacheNotWritableError):
        assert issubclass(cls, dl.DownloadError)


def _catalog_with_tiny(tmp_path: Path):
    catalog = tmp_path / "catalog.json"
    catalog.write_text(json.dumps({
        "format": 1, "default_pair": "p",
        "models": [
            {"id": "tiny", "description": "", "quantization": "Q8_0", "repo_id": REPO,
             "filename": FILENAME, "revision": "main", "sha256": PAYLOAD_SHA},
            {"id": "other", "description": "", "quantization": "Q8_0", "path": "x.gguf"},
        ],
        "pairs": [{"id": "p", "target": "tiny", "draft": "other"}],
    }))
    return load_catalog(catalog)


# --- catalog ------------------------------------------------------------------------------------


def test_catalog_pairs_refer_to_entries_and_builtins_resolve_to_package_paths() -> None:
    catalog = load_catalog()
    ids = {m.id for m in catalog.models}
    assert catalog.default_pair in {p.id for p in catalog.pairs}
    for pair in catalog.pairs:
        assert {pair.target, pair.draft} <= ids and pair.target != pair.draft
    for m in catalog.models:
        if m.is_builtin:
            assert m.local_path.parent == CATALOG_PATH.parent / "builtin"
            assert m.local_path.name in {"target-q8_0.gguf", "draft-q8_0.gguf"}
        else:
            assert m.repo_id and m.filename.endswith(".gguf")
            assert re.fullmatch(r"[0-9a-f]{40}", m.revision)  # pinned: the checksum holds
            assert m.sha256 is None or re.fullmatch(r"[0-9a-f]{64}", m.sha256)
            assert set(m.verified) and m.source
    assert catalog.model("builtin-target").local_path.name == "target-q8_0.gguf"
    target, draft = catalog.pair_models("builtin")
    assert (target.id, draft.id) == ("builtin-target", "builtin-draft")


def test_builtin_model_absent_then_present(tmp_path: Path) -> None:
    shutil.copy(CATALOG_PATH, tmp_path / "catalog.json")
    entry = load_catalog(tmp_path / "catalog.json").model("builtin-draft")
    assert entry.local_path == tmp_path / "builtin" / "draft-q8_0.gguf"
    with pytest.raises(ModelNotAvailableError, match="built-in model 'builtin-draft' is missing"):
        dl.download(entry)
    assert dl.cached_path(entry) is None

    entry.local_path.parent.mkdir()
    entry.local_path.write_bytes(b"GGUF")
    assert dl.download(entry) == entry.local_path == dl.cached_path(entry)


def test_catalog_rejects_a_pair_with_an_unknown_model(tmp_path: Path) -> None:
    raw = json.loads(CATALOG_PATH.read_text())
    raw["pairs"].append({"id": "bad", "target": "gpt2-q8_0", "draft": "no-such-model"})
    (tmp_path / "catalog.json").write_text(json.dumps(raw))
    with pytest.raises(CatalogError, match="draft 'no-such-model'"):
        load_catalog(tmp_path / "catalog.json")
