"""Download catalog models from the Hugging Face hub into the hub's cache, resumably.

``hf_hub_download`` (huggingface_hub 2.x) writes each attempt to a process-unique
``<etag>.<random>.incomplete`` file and deletes it when the attempt fails, so an interrupted
download always restarts, and it reports progress only through a tqdm class. Large GGUF files
need resume, a plain progress callback and cancellation, so the transfer is done here with the
hub's own pieces: ``get_hf_file_metadata`` (HEAD: commit, etag = LFS sha256, size, location),
its shared HTTP client (``get_session``) for one ranged GET, and its cache layout
(``blobs/<etag>``, ``snapshots/<commit>/<file>``, ``refs/<revision>``), so files fetched here and
by ``hf_hub_download`` are interchangeable. The partial file is ``blobs/<etag>.incomplete``: the
etag names the exact remote bytes, so a later call resumes it with ``Range: bytes=<size>-``.

Run ``python -m models.download --list`` or ``python -m models.download ID``.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import logging
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote, urlparse

import httpx2
from huggingface_hub import constants, get_hf_file_metadata, try_to_load_from_cache
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import WeakFileLock, build_hf_headers, get_session, hf_raise_for_status

from models.catalog import Catalog, ModelEntry, load_catalog

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int | None], None]
"""Called as ``progress(bytes_done, bytes_total)`` after every chunk written (~64 KiB) and once at
the start (with the resumed size); ``bytes_total`` is None if the server does not say. Called on
the downloading thread: a GUI forwards it through a signal, a CLI throttles its redraws."""

MANUAL_COPY_HINT = (
    "copy the GGUF file to this machine by hand ({url}) and open it in Staged Chat as a local "
    "model file"
)

_SHA256 = re.compile(r"[0-9a-f]{64}")
_HASH_BLOCK = 8 * 1024 * 1024


class DownloadError(RuntimeError):
    """A catalog model could not be downloaded; the message says why and what to do."""


class OfflineError(DownloadError):
    """The hub cannot be reached at all."""


class DownloadCancelled(DownloadError):
    """The cancel event was set; the partial file is kept for a later resume."""


class DownloadInterrupted(DownloadError):
    """The connection broke mid-transfer; the partial file is kept for a later resume."""


class ChecksumError(DownloadError):
    """The downloaded bytes do not hash to the expected sha256; the bad file was deleted."""


class DiskFullError(DownloadError):
    """Not enough free space for the file (checked first, or the disk filled up while writing);
    what was written is kept for a later resume."""


class CacheNotWritableError(DownloadError):
    """The cache folder cannot be created or written to (permissions, a file in the way)."""


def cached_path(entry: ModelEntry, cache_dir: str | Path | None = None) -> Path | None:
    """The model's local file if it is already there (built-in or in the hub cache), else None.
    Makes no network call."""
    if entry.is_builtin:
        return entry.local_path if entry.local_path.is_file() else None
    found = try_to_load_from_cache(
        entry.repo_id, entry.filename, cache_dir=_cache_dir(cache_dir), revision=entry.revision
    )
    return Path(found) if isinstance(found, str) else None


def download(
    entry: ModelEntry | str,
    *,
    cache_dir: str | Path | None = None,
    endpoint: str | None = None,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    token: str | bool | None = None,
) -> Path:
    """Return the local path of a catalog model, downloading (or resuming) it first if needed.

    ``entry`` is a ``ModelEntry`` or a catalog id. ``cache_dir`` defaults to the hub cache
    (``HF_HUB_CACHE``), ``endpoint`` to ``HF_ENDPOINT`` or huggingface.co. Setting ``cancel`` from
    another thread stops the transfer after the current chunk (``DownloadCancelled``); a read
    blocks at most the hub's download timeout (``HF_HUB_DOWNLOAD_TIMEOUT``, 10 s).
    Raises ``OfflineError``, ``DownloadInterrupted``, ``DownloadCancelled``, ``ChecksumError``,
    ``DiskFullError``, ``CacheNotWritableError`` or ``DownloadError``. Whatever fails, only a
    verified file is ever put where ``cached_path`` looks: partial bytes stay in
    ``blobs/<etag>.incomplete`` (resumed next time) or are deleted (a checksum mismatch).
    """
    if isinstance(entry, str):
        entry = load_catalog().model(entry)
    if entry.is_builtin:
        return entry.require_local()
    cache = _cache_dir(cache_dir)
    found = cached_path(entry, cache)
    if found is not None:
        size = found.stat().st_size
        _report(progress, size, size)
        return found

    url = resolve_url(entry, endpoint)
    commit, etag, size, location = _metadata(entry, url, token)
    expected = _expected_sha256(entry, etag)

    storage = cache / repo_folder_name(repo_id=entry.repo_id, repo_type="model")
    blob = storage / "blobs" / etag
    pointer = storage / "snapshots" / commit / entry.filename
    lock = cache / ".locks" / storage.name / f"{etag}.lock"
    headers = build_hf_headers(token=token)
    if urlparse(location).netloc != urlparse(url).netloc:
        headers.pop("authorization", None)  # a signed CDN url: the token stays on the hub
    try:
        blob.parent.mkdir(parents=True, exist_ok=True)
        lock.parent.mkdir(parents=True, exist_ok=True)
        with WeakFileLock(lock):
            if not blob.exists():
                partial = blob.with_name(f"{etag}.incomplete")
                _check_disk_space(partial, size)
                _transfer(location, partial, size, headers, progress, cancel)
                _verify(partial, expected, entry.filename)
                os.replace(partial, blob)  # atomic: the blob is either absent or verified
            _link(blob, pointer)
        if entry.revision != commit:
            (storage / "refs").mkdir(exist_ok=True)
            (storage / "refs" / entry.revision).write_text(commit)
    except OSError as e:  # the cache's file system, not the network (httpx errors are not OSError)
        raise _cache_error(e, cache) from e
    logger.info("%s is at %s", entry.id, pointer)
    return pointer


def resolve_url(entry: ModelEntry, endpoint: str | None = None) -> str:
    """The hub's download url of a hub entry (the same route ``hf_hub_url`` builds)."""
    # not hf_hub_url: it bakes the import-time endpoint into its template
    endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
    revision = quote(entry.revision, safe="")
    return f"{endpoint}/{entry.repo_id}/resolve/{revision}/{quote(entry.filename)}"


def _cache_dir(cache_dir: str | Path | None) -> Path:
    # read at call time, so a test or the app can point HF_HUB_CACHE elsewhere after import
    return Path(cache_dir if cache_dir is not None else constants.HF_HUB_CACHE).expanduser()


def _metadata(
    entry: ModelEntry, url: str, token: str | bool | None
) -> tuple[str, str, int | None, str]:
    """(commit, etag, size, location) from a HEAD on the file's resolve url."""
    try:
        meta = get_hf_file_metadata(url, token=token, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except OfflineModeIsEnabled as e:
        raise OfflineError(_offline_message(url, "offline mode is on (HF_HUB_OFFLINE)")) from e
    except (httpx2.ConnectError, httpx2.TimeoutException, httpx2.NetworkError) as e:
        raise OfflineError(_offline_message(url, str(e) or type(e).__name__)) from e
    except (RepositoryNotFoundError, RevisionNotFoundError, EntryNotFoundError) as e:
        raise DownloadError(
            f"{entry.id}: {entry.repo_id}/{entry.filename} at {entry.revision} is not on the hub "
            f"({type(e).__name__}); the catalog entry may be out of date"
        ) from e
    except HfHubHTTPError as e:
        raise DownloadError(f"{entry.id}: the hub answered with an error: {e}") from e
    if meta.commit_hash is None or meta.etag is None:
        raise DownloadError(
            f"{url} did not answer like a Hugging Face hub (no X-Repo-Commit or ETag header); "
            "check HF_ENDPOINT and any proxy"
        )
    return meta.commit_hash, meta.etag, meta.size, meta.location


def _offline_message(url: str, reason: str) -> str:
    host = urlparse(url).netloc
    return f"cannot reach {host}: {reason}; " + MANUAL_COPY_HINT.format(url=url)


def _expected_sha256(entry: ModelEntry, etag: str) -> str | None:
    """The checksum to verify against: the catalog's, else the hub's LFS etag (a sha256)."""
    hub_sha = etag if _SHA256.fullmatch(etag) else None
    if entry.sha256 and hub_sha and entry.sha256 != hub_sha:
        raise ChecksumError(
            f"{entry.id}: the hub serves {entry.filename} with sha256 {hub_sha}, but the catalog "
            f"expects {entry.sha256}; nothing was downloaded (the catalog entry is out of date)"
        )
    if entry.sha256 is None and hub_sha is None:
        logger.warning("%s: no sha256 known, only the size will be checked", entry.id)
    return entry.sha256 or hub_sha


def _transfer(
    url: str,
    partial: Path,
    size: int | None,
    headers: dict[str, str],
    progress: ProgressCallback | None,
    cancel: threading.Event | None,
) -> None:
    """Append the missing bytes of ``url`` to ``partial`` with one (ranged) GET."""
    done = partial.stat().st_size if partial.exists() else 0
    if size is not None and done > size:  # not a prefix of this file: start over
        partial.unlink()
        done = 0
    _report(progress, done, size)
    if size is not None and done == size:
        return
    if cancel is not None and cancel.is_set():
        raise DownloadCancelled(f"download cancelled before it started ({done} bytes kept)")
    headers = {**headers, "Accept-Encoding": "identity"}  # byte counts must be the file's
    if done:
        headers["Range"] = f"bytes={done}-"
    timeout = httpx2.Timeout(constants.HF_HUB_DOWNLOAD_TIMEOUT)
    try:
        with get_session().stream("GET", url, headers=headers, timeout=timeout) as response:
            hf_raise_for_status(response)
            if done and response.status_code != 206:  # the server ignored the Range header
                logger.warning("%s: server cannot resume, downloading from the start", url)
                done = 0
            with partial.open("ab" if done else "wb") as f:
                for chunk in response.iter_bytes():
                    try:
                        f.write(chunk)
                    except OSError as e:
                        raise _cache_error(e, partial.parent, done, size) from e
                    done += len(chunk)
                    _report(progress, done, size)
                    if cancel is not None and cancel.is_set():
                        raise DownloadCancelled(
                            f"download cancelled after {done} bytes; run it again to resume"
                        )
    except (httpx2.ConnectError, httpx2.ConnectTimeout) as e:
        raise OfflineError(_offline_message(url, str(e) or type(e).__name__)) from e
    except httpx2.TransportError as e:
        if cancel is not None and cancel.is_set():  # cancelled while the server stalled
            raise DownloadCancelled(
                f"download cancelled after {done} bytes; run it again to resume") from e
        raise DownloadInterrupted(
            f"connection lost after {done} of {size or '?'} bytes ({e}); run again to resume"
        ) from e
    except HfHubHTTPError as e:
        raise DownloadError(f"download of {url} failed: {e}") from e
    if size is not None and done != size:
        raise DownloadInterrupted(f"got {done} of {size} bytes; run again to resume")


def _check_disk_space(partial: Path, size: int | None) -> None:
    have = partial.stat().st_size if partial.exists() else 0
    free = shutil.disk_usage(partial.parent).free
    if size is not None and size - have > free:
        raise DiskFullError(
            f"not enough disk space in {partial.parent}: {_mb(size - have)} more needed, "
            f"{_mb(free)} free; free some space or choose another folder (--cache-dir, or the "
            "HF_HUB_CACHE environment variable)"
        )


def _cache_error(e: OSError, folder: Path, done: int | None = None,
                 size: int | None = None) -> DownloadError:
    """A readable error for a failed write into the cache (``done`` bytes written so far)."""
    where = "" if done is None else f" after {_mb(done)} of {_mb(size)}"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(
            f"the disk holding {folder} is full{where}; free some space and run again to resume "
            "(what was written is kept)"
        )
    return CacheNotWritableError(
        f"cannot write to the model cache {folder}{where}: {e.strerror or e}; choose a folder "
        "you can write to (--cache-dir, or the HF_HUB_CACHE environment variable)"
    )


def _verify(partial: Path, expected: str | None, filename: str) -> None:
    if expected is None:
        return
    digest = hashlib.sha256()
    with partial.open("rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    actual = digest.hexdigest()
    if actual != expected:
        partial.unlink()  # resuming a corrupt file would only stay corrupt
        raise ChecksumError(
            f"{filename} is corrupt: sha256 {actual}, expected {expected}; the bad file was "
            "deleted, run again to download it afresh"
        )


def _link(blob: Path, pointer: Path) -> None:
    """snapshots/<commit>/<file> -> ../../blobs/<etag>, as the hub cache lays it out."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    if pointer.is_symlink() or pointer.exists():
        pointer.unlink()
    try:
        pointer.symlink_to(os.path.relpath(blob, pointer.parent))
    except OSError:  # no symlinks (Windows without developer mode): the hub cache moves the blob
        os.replace(blob, pointer)


def _report(progress: ProgressCallback | None, done: int, total: int | None) -> None:
    if progress is not None:
        progress(done, total)


# --- command line ---------------------------------------------------------------------------


def _mb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e6:,.0f} MB"


def _list(catalog: Catalog, cache_dir: str | Path | None) -> None:
    print("models:")
    for m in catalog.models:
        params = "?" if m.parameters is None else f"{m.parameters / 1e6:,.0f}M"
        on_disk = cached_path(m, cache_dir) is not None
        where = "on disk" if on_disk else ("missing" if m.is_builtin else "")
        print(f"  {m.id:20} {params:>7} params  {m.quantization:5} {_mb(m.approx_size_bytes):>9}"
              f"  {where:8} {m.description}")
    print("pairs (target + draft):")
    for p in catalog.pairs:
        default = " (default)" if p.id == catalog.default_pair else ""
        print(f"  {p.id:24} {p.target} + {p.draft}{default}  {p.description}")


class _ProgressLine:
    """A one-line progress display on stderr, redrawn at most 5 times a second."""

    def __init__(self, label: str) -> None:
        self.label, self.start, self.last, self.first = label, time.monotonic(), 0.0, None

    def __call__(self, done: int, total: int | None) -> None:
        now = time.monotonic()
        self.first = done if self.first is None else self.first
        if now - self.last < 0.2 and done != total:
            return
        self.last = now
        rate = (done - self.first) / max(now - self.start, 1e-6) / 1e6
        share = f"{100 * done / total:5.1f}% " if total else ""
        sys.stderr.write(f"\r{self.label}: {share}{_mb(done)} of {_mb(total)}  {rate:.1f} MB/s ")
        sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m models.download",
        description="Download catalog models (or both models of a pair) from the Hugging Face hub.",
    )
    parser.add_argument("ids", nargs="*", metavar="ID", help="model or pair id (see --list)")
    parser.add_argument("--list", action="store_true", help="list catalog models and pairs")
    parser.add_argument("--cache-dir", help="download into this folder instead of the hub cache")
    parser.add_argument("--endpoint", help="hub url (default: HF_ENDPOINT or huggingface.co)")
    args = parser.parse_args(argv)
    catalog = load_catalog()
    if args.list or not args.ids:
        _list(catalog, args.cache_dir)
        return 0
    try:
        entries = [m for i in args.ids for m in _resolve_id(catalog, i)]
        for entry in entries:
            path = download(entry, cache_dir=args.cache_dir, endpoint=args.endpoint,
                            progress=_ProgressLine(entry.id))
            sys.stderr.write("\n")
            print(path)
    except KeyError as e:
        parser.error(str(e.args[0]))
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted; the partial file is kept, run again to resume\n")
        return 130
    except (DownloadError, FileNotFoundError) as e:
        sys.stderr.write(f"\nerror: {e}\n")
        return 1
    return 0


def _resolve_id(catalog: Catalog, item: str) -> tuple[ModelEntry, ...]:
    if any(p.id == item for p in catalog.pairs):
        return catalog.pair_models(item)
    if any(m.id == item for m in catalog.models):
        return (catalog.model(item),)
    raise KeyError(f"'{item}' is neither a model nor a pair of the catalog (see --list)")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    sys.exit(main())
