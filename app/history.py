"""Chat history in SQLite: conversations, and messages with their tokens, origins and statistics.

Plain Python (no Qt); the app wraps it in its Qt models. Use one ``History`` from the GUI thread
only: sqlite3's ``check_same_thread`` makes a call from any other thread raise
``sqlite3.ProgrammingError`` rather than share the connection by accident.

Durability: every write is one transaction, committed before the method returns. An assistant
reply is inserted once, when it finishes or is stopped, never updated per token, so a crash loses
at most the reply being written. A damaged file is moved aside (never deleted) and a fresh
history starts; ``History.recovered_from`` names the backup for the app to show.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import numbers
import os
import re
import sqlite3
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from app.replies import footer
from speculative.stats import ORIGINS

log = logging.getLogger(__name__)

ROLES = ("user", "assistant", "system")
FINISH_REASONS = ("stop", "length", "context", "cancelled", "error")  # a reply's; None otherwise
CODE_FORMAT = "code"  # the prompt format whose messages export as code blocks
APP_FOLDER = "staged-chat"
FILE_NAME = "history.sqlite3"


class HistoryError(Exception):
    """The history cannot be opened or written; the message says why, in words for the user."""


class _Corrupt(Exception):
    """The file is not a healthy database: triggers the move-aside recovery."""


@dataclasses.dataclass(frozen=True, slots=True)
class Conversation:
    id: int
    title: str
    created: float         # seconds since the epoch
    updated: float         # last message added or deleted (the list's order); creation before
    model: str = ""        # the target model's name, as the app shows it
    prompt_format: str = ""  # e.g. "transcript", or CODE_FORMAT for code completion
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)  # JSON snapshot


@dataclasses.dataclass(frozen=True, slots=True)
class Message:
    id: int
    conversation_id: int
    role: str              # one of ROLES
    text: str
    created: float         # seconds since the epoch
    tokens: list[int] = dataclasses.field(default_factory=list)   # a reply's emitted token ids
    origins: list[str] = dataclasses.field(default_factory=list)  # per token: stats.ORIGINS
    finish: str | None = None  # FINISH_REASONS for a reply; None for user and system messages
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)  # a reply's: app.replies
    mode: str = ""         # the speculation mode that produced the reply


# Schema. _MIGRATIONS[v] upgrades a file at user_version v to v + 1. Append only: a shipped
# migration has already run on users' files. Ids are AUTOINCREMENT so that a deleted row's id,
# which the app may still hold, never comes back naming another row.
_SCHEMA_1 = (
    """CREATE TABLE conversations (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        title TEXT NOT NULL,
        created REAL NOT NULL,
        updated REAL NOT NULL,
        model TEXT NOT NULL,
        prompt_format TEXT NOT NULL,
        settings TEXT NOT NULL)""",  # JSON object
    "CREATE INDEX conversations_by_updated ON conversations (updated)",
    """CREATE TABLE messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        conversation_id INTEGER NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
        role TEXT NOT NULL CHECK (role IN ('user', 'assistant', 'system')),
        text TEXT NOT NULL,
        created REAL NOT NULL,
        tokens TEXT NOT NULL,   -- JSON list of ints
        origins TEXT NOT NULL,  -- JSON list of strings
        finish TEXT,
        stats TEXT NOT NULL,    -- JSON object
        mode TEXT NOT NULL)""",
    "CREATE INDEX messages_by_conversation ON messages (conversation_id, id)",
    "CREATE TABLE app_values (key TEXT PRIMARY KEY, value TEXT NOT NULL)",  # JSON values
)


def _migrate_to_1(db: sqlite3.Connection) -> None:
    for statement in _SCHEMA_1:
        db.execute(statement)


_MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_migrate_to_1,)
SCHEMA_VERSION = len(_MIGRATIONS)


class History:
    """The chat history in one SQLite file. Methods raise HistoryError when the disk fails them,
    KeyError for an unknown id and ValueError for a bad role, finish reason or origins."""

    def __init__(self, path: str | os.PathLike[str], *, create_parent: bool = False,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.recovered_from: Path | None = None  # the damaged file's backup, if one was made
        self.recovery_reason = ""  # what was wrong with it, for the app's banner
        self._clock = clock
        _check_folder(self.path.parent, create_parent)
        try:
            self._db = _open(self.path)
        except _Corrupt as exc:
            self.recovered_from = _move_aside(self.path, clock())
            self.recovery_reason = str(exc)
            log.warning("chat history %s is damaged (%s); kept as %s, starting a fresh one",
                        self.path, exc, self.recovered_from)
            try:
                self._db = _open(self.path)
            except _Corrupt as again:
                raise HistoryError(f"cannot start a fresh chat history at {self.path}: "
                                   f"{again}") from again

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # conversations

    def create_conversation(self, title: str = "", *, model: str = "", prompt_format: str = "",
                            settings: dict[str, Any] | None = None) -> Conversation:
        now = self._clock()
        with self._write() as db:
            cursor = db.execute(
                "INSERT INTO conversations (title, created, updated, model, prompt_format, "
                "settings) VALUES (?, ?, ?, ?, ?, ?)",
                (_clean(title), now, now, _clean(model), _clean(prompt_format),
                 _dumps(settings or {})))
        return self.conversation(_rowid(cursor))

    def conversation(self, conversation_id: int) -> Conversation:
        rows = self._read("SELECT * FROM conversations WHERE id = ?", (conversation_id,))
        if not rows:
            raise KeyError(conversation_id)
        return _conversation(rows[0])

    def conversations(self) -> list[Conversation]:
        """All conversations, the most recently updated first."""
        rows = self._read("SELECT * FROM conversations ORDER BY updated DESC, id DESC")
        return [_conversation(r) for r in rows]

    def update_conversation(self, conversation_id: int, *, title: str | None = None,
                            model: str | None = None, prompt_format: str | None = None,
                            settings: dict[str, Any] | None = None) -> Conversation:
        """Change the given fields. Does not touch ``updated``: renaming is not activity, so the
        conversation keeps its place in the list."""
        changes = {"title": title, "model": model, "prompt_format": prompt_format}
        values = {k: _clean(v) for k, v in changes.items() if v is not None}
        if settings is not None:
            values["settings"] = _dumps(settings)
        if values:
            assignments = ", ".join(f"{column} = ?" for column in values)  # our own column names
            with self._write() as db:
                cursor = db.execute(f"UPDATE conversations SET {assignments} WHERE id = ?",
                                    (*values.values(), conversation_id))
            if cursor.rowcount == 0:
                raise KeyError(conversation_id)
        return self.conversation(conversation_id)

    def rename_conversation(self, conversation_id: int, title: str) -> Conversation:
        return self.update_conversation(conversation_id, title=title)

    def delete_conversation(self, conversation_id: int) -> None:
        """Delete a conversation and (ON DELETE CASCADE) its messages."""
        with self._write() as db:
            cursor = db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))
        if cursor.rowcount == 0:
            raise KeyError(conversation_id)

    def search(self, query: str) -> list[Conversation]:
        """Conversations whose title or any message contains ``query`` (case-insensitive, any
        script: Python's casefold, not SQLite's ASCII-only LIKE), most recently updated first.
        A blank query matches every conversation."""
        needle = _clean(query).strip().casefold()
        if not needle:
            return self.conversations()
        # A full scan through a Python function: milliseconds for a personal chat history.
        rows = self._read(
            "SELECT * FROM conversations AS c WHERE contains_casefold(c.title, ?1) "
            "OR EXISTS (SELECT 1 FROM messages AS m "
            "WHERE m.conversation_id = c.id AND contains_casefold(m.text, ?1)) "
            "ORDER BY c.updated DESC, c.id DESC", (needle,))
        return [_conversation(r) for r in rows]

    # messages

    def add_message(self, conversation_id: int, role: str, text: str, *,
                    tokens: Iterable[int] = (), origins: Iterable[str] = (),
                    finish: str | None = None, stats: dict[str, Any] | None = None,
                    mode: str = "") -> Message:
        """Append a message in one committed transaction. Call it for a reply once it has
        finished or was stopped (``finish`` set), not per token."""
        tokens, origins = _checked_reply(role, tokens, origins, finish)
        now = self._clock()
        with self._write() as db:
            if not db.execute("SELECT 1 FROM conversations WHERE id = ?",
                              (conversation_id,)).fetchone():
                raise KeyError(conversation_id)
            cursor = db.execute(
                "INSERT INTO messages (conversation_id, role, text, created, tokens, origins, "
                "finish, stats, mode) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (conversation_id, role, _clean(text), now, _dumps(tokens), _dumps(origins),
                 finish, _dumps(stats or {}), _clean(mode)))
            db.execute("UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id))
        return self.message(_rowid(cursor))

    def message(self, message_id: int) -> Message:
        rows = self._read("SELECT * FROM messages WHERE id = ?", (message_id,))
        if not rows:
            raise KeyError(message_id)
        return _message(rows[0])

    def messages(self, conversation_id: int) -> list[Message]:
        """A conversation's messages in the order they were added ([] for an unknown id)."""
        rows = self._read("SELECT * FROM messages WHERE conversation_id = ? ORDER BY id",
                          (conversation_id,))
        return [_message(r) for r in rows]

    def delete_message(self, message_id: int) -> None:
        """Delete one message (Regenerate deletes the last reply, then adds the new one)."""
        with self._write() as db:
            row = db.execute("SELECT conversation_id FROM messages WHERE id = ?",
                             (message_id,)).fetchone()
            if row is None:
                raise KeyError(message_id)
            db.execute("DELETE FROM messages WHERE id = ?", (message_id,))
            db.execute("UPDATE conversations SET updated = ? WHERE id = ?",
                       (self._clock(), row["conversation_id"]))

    # small app values (e.g. the last open conversation)

    def set_value(self, key: str, value: Any) -> None:
        with self._write() as db:
            db.execute("INSERT OR REPLACE INTO app_values (key, value) VALUES (?, ?)",
                       (_clean(key), _dumps(value)))

    def get_value(self, key: str, default: Any = None) -> Any:
        rows = self._read("SELECT value FROM app_values WHERE key = ?", (_clean(key),))
        return json.loads(rows[0]["value"]) if rows else default

    # plumbing

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._disk_errors("save to"), _transaction(self._db):
            yield self._db

    def _read(self, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._disk_errors("read"):
            return self._db.execute(sql, params).fetchall()

    @contextlib.contextmanager
    def _disk_errors(self, verb: str) -> Iterator[None]:
        """sqlite3 errors the user can meet (disk full, I/O, a file damaged while open) become
        HistoryError; misuse (wrong thread, closed store) stays a ProgrammingError."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.ProgrammingError | sqlite3.IntegrityError):
                raise
            # Damage found mid-session is recovered at the next start (integrity check).
            raise HistoryError(f"cannot {verb} the chat history {self.path}: {exc}") from exc


# opening, checking, recovering


def _check_folder(folder: Path, create: bool) -> None:
    if create:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise HistoryError(f"cannot create the chat history folder {folder}: "
                               f"{exc.strerror or exc}") from exc
    if not folder.is_dir():
        raise HistoryError(f"the chat history folder {folder} does not exist")


def _open(path: Path) -> sqlite3.Connection:
    """A connection to a healthy, configured, up-to-date database; raises _Corrupt when the file
    is damaged and HistoryError when it cannot be used for another reason (permissions...)."""
    _check_integrity(path)
    try:
        # isolation_level=None: no implicit transactions; _transaction() makes them explicit.
        db = sqlite3.connect(path, isolation_level=None)
    except sqlite3.Error as exc:
        raise _open_error(path, exc) from exc
    try:
        db.row_factory = sqlite3.Row
        _configure(db)
        _migrate(db, path)
    except sqlite3.Error as exc:
        db.close()
        raise _open_error(path, exc) from exc
    except BaseException:
        db.close()
        raise
    return db


def _check_integrity(path: Path) -> None:
    """Raise _Corrupt if an existing file is damaged.

    Through a read-only connection: a read-write one would, on closing, checkpoint the WAL into
    the damaged file and delete the WAL, changing the very bytes the backup is meant to keep.
    The full check reads every page (milliseconds for a chat history), so it also finds damage
    in pages the first queries would not touch until the user scrolls back to them."""
    if not path.is_file() or path.stat().st_size == 0:  # nothing there to lose
        return
    try:
        db = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)
    except sqlite3.Error:
        return  # not about the data; the read-write open reports it
    try:
        problems = [row[0] for row in db.execute("PRAGMA integrity_check").fetchall()]
    except sqlite3.Error as exc:
        if _is_corrupt(exc):
            raise _Corrupt(str(exc)) from exc
        return  # e.g. a read-only folder: the read-write open reports it
    finally:
        db.close()
    if problems != ["ok"]:
        raise _Corrupt("; ".join(problems[:3]))


_CORRUPT_CODES = {11, 26}  # SQLITE_CORRUPT ("malformed"), SQLITE_NOTADB ("not a database")


def _is_corrupt(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)  # Python >= 3.11
    if code is None:
        return any(s in str(exc) for s in ("malformed", "not a database"))
    return code & 0xFF in _CORRUPT_CODES  # the primary code; extended codes add high bits


def _open_error(path: Path, exc: sqlite3.Error) -> Exception:
    if _is_corrupt(exc):
        return _Corrupt(str(exc))
    # Anything else (permissions, a locked or missing file) says nothing about the data: the
    # file stays where it is.
    hint = "" if os.access(path.parent, os.W_OK) else f" (the folder {path.parent} is read-only)"
    return HistoryError(f"cannot open the chat history {path}: {exc}{hint}")


def _configure(db: sqlite3.Connection) -> None:
    # WAL: a commit appends to the -wal file and never rewrites pages in place, so a process
    # killed mid-write leaves every earlier commit intact, and an uncommitted tail is ignored.
    mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if mode != "wal":  # e.g. a network filesystem; the rollback journal is safe, only slower
        log.warning("chat history journal mode is %s, not wal", mode)
    # FULL, not NORMAL: NORMAL survives a crashed process but may lose the last commits when the
    # OS crashes or the battery dies; FULL syncs the WAL at each commit, and at one commit per
    # message that costs a few milliseconds nobody waits for.
    db.execute("PRAGMA synchronous = FULL")
    db.execute("PRAGMA foreign_keys = ON")  # off by default, per connection; CASCADE needs it
    db.create_function("contains_casefold", 2, _contains_casefold, deterministic=True)


def _migrate(db: sqlite3.Connection, path: Path) -> None:
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise HistoryError(f"the chat history {path} was written by a newer Staged Chat "
                           f"(schema {version}, this one knows {SCHEMA_VERSION})")
    for v in range(version, SCHEMA_VERSION):
        with _transaction(db):
            _MIGRATIONS[v](db)
            db.execute(f"PRAGMA user_version = {v + 1}")  # in the same transaction
        log.info("chat history %s: schema %d -> %d", path, v, v + 1)


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    # IMMEDIATE takes the write lock at BEGIN: with a second app instance on the same file, a
    # deferred transaction could fail to upgrade its read lock halfway through.
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        if db.in_transaction:  # SQLite rolls back by itself after some errors (disk full)
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _sidecars(path: Path) -> list[Path]:
    return [path.with_name(path.name + suffix) for suffix in ("-wal", "-shm", "-journal")]


def _move_aside(path: Path, now: float) -> Path:
    """Rename a damaged file and its sidecars to ``<name>.corrupt-<timestamp>[-n]``, keeping the
    sidecars' suffixes so SQLite tools opening the backup see its WAL. Returns the backup."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    backup, n = path.with_name(f"{path.name}.corrupt-{stamp}"), 1
    while any(p.exists() for p in (backup, *_sidecars(backup))):  # never overwrite a backup
        n += 1
        backup = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
    # Sidecars first: a WAL left behind would be replayed into the fresh database.
    moves = [*zip(_sidecars(path), _sidecars(backup), strict=True), (path, backup)]
    try:
        for source, target in moves:
            if source.exists():
                os.replace(source, target)
    except OSError as exc:
        raise HistoryError(f"the chat history {path} is damaged and could not be moved "
                           f"aside: {exc.strerror or exc}") from exc
    return backup


def default_path() -> Path:
    """Where the app keeps its history: the user's data folder, ``staged-chat/history.sqlite3``
    ($XDG_DATA_HOME or ~/.local/share on Linux). The folder may not exist yet: open it with
    ``History(default_path(), create_parent=True)``."""
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = Path.home() / "Library" / "Application Support"
    else:
        xdg = os.environ.get("XDG_DATA_HOME", "")
        # the XDG spec: a relative path is invalid and is to be ignored
        base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".local" / "share"
    return base / APP_FOLDER / FILE_NAME


# values in and out


def _clean(text: str) -> str:
    """Text that UTF-8 (SQLite, files) can hold. Lone surrogates (half of a split pair, or bytes
    decoded with surrogateescape) become U+FFFD and split pairs are joined; everything else,
    control characters and NUL included, is kept."""
    if not isinstance(text, str):
        raise TypeError(f"expected text, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def _plain(value: Any) -> Any:
    """JSON data that round-trips: strings cleaned, numpy-style numbers made Python numbers,
    NaN and infinities (not JSON) stored as null. Raises TypeError for anything else."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        return _clean(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {_clean(str(k)): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    raise TypeError(f"not JSON data: {type(value).__name__}")


def _dumps(value: Any) -> str:
    return json.dumps(_plain(value), ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _checked_reply(role: str, tokens: Iterable[int], origins: Iterable[str],
                   finish: str | None) -> tuple[list[int], list[str]]:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    if finish is not None and finish not in FINISH_REASONS:
        raise ValueError(f"finish must be one of {FINISH_REASONS} or None, not {finish!r}")
    token_list = [int(t) for t in tokens]
    origin_list = list(origins)
    if origin_list and len(origin_list) != len(token_list):
        raise ValueError(f"{len(origin_list)} origins for {len(token_list)} tokens")
    if not set(origin_list) <= set(ORIGINS):
        raise ValueError(f"origins must be among {ORIGINS}: {sorted(set(origin_list))}")
    return token_list, origin_list


def _contains_casefold(haystack: str | None, needle: str) -> bool:
    return haystack is not None and needle in haystack.casefold()


def _rowid(cursor: sqlite3.Cursor) -> int:
    assert cursor.lastrowid is not None  # after an INSERT
    return cursor.lastrowid


def _conversation(row: sqlite3.Row) -> Conversation:
    return Conversation(id=row["id"], title=row["title"], created=row["created"],
                        updated=row["updated"], model=row["model"],
                        prompt_format=row["prompt_format"], settings=json.loads(row["settings"]))


def _message(row: sqlite3.Row) -> Message:
    return Message(id=row["id"], conversation_id=row["conversation_id"], role=row["role"],
                   text=row["text"], created=row["created"], tokens=json.loads(row["tokens"]),
                   origins=json.loads(row["origins"]), finish=row["finish"],
                   stats=json.loads(row["stats"]), mode=row["mode"])


# export


def to_json(conversation: Conversation, messages: Iterable[Message]) -> str:
    """Everything about a conversation, statistics and per-token origins included."""
    data = {"format": "staged-chat-conversation", "version": 1,
            "conversation": dataclasses.asdict(conversation),
            "messages": [dataclasses.asdict(m) for m in messages]}
    return json.dumps(_plain(data), ensure_ascii=False, allow_nan=False, indent=2) + "\n"


def to_markdown(conversation: Conversation, messages: Iterable[Message], *,
                code: bool | None = None, language: str = "python") -> str:
    """The conversation for reading: a heading per message; with ``code`` (by default: the
    conversation's prompt format is CODE_FORMAT) user and assistant text go in fenced code
    blocks, since a completion continues the user's code."""
    if code is None:
        code = conversation.prompt_format == CODE_FORMAT
    title = " ".join(conversation.title.split()) or "Untitled conversation"
    parts = [f"# {title}", _about(conversation)]
    for m in messages:
        parts.append(f"## {m.role.capitalize()}")
        parts.append(_fenced(m.text, language) if code and m.role != "system" else m.text)
        parts.append(_footer(m))
    return "\n\n".join(p for p in parts if p) + "\n"


def _about(conversation: Conversation) -> str:
    created = time.strftime("%Y-%m-%d %H:%M", time.localtime(conversation.created))
    facts = [f"model {conversation.model}" if conversation.model else "",
             f"format {conversation.prompt_format}" if conversation.prompt_format else "",
             created]
    return "*" + " · ".join(f for f in facts if f) + "*"


def _fenced(text: str, language: str) -> str:
    # CommonMark: a fence longer than any backtick run inside cannot be closed by the text
    longest = max((len(run) for run in re.findall("`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    body = text[:-1] if text.endswith("\n") else text
    return f"{fence}{language}\n{body}\n{fence}"


def _footer(m: Message) -> str:
    """A reply's statistics line, the one the window shows under it, in italics."""
    line = footer(m.stats, m.mode, m.finish or "") if m.role == "assistant" else ""
    return f"*{line}*" if line else ""


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write an export: a temporary file beside the target, then a rename, so the target is
    either the old file or the whole new one, never a partial one."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w", encoding="utf-8", newline="") as f:
            f.write(_clean(text))
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise HistoryError(f"cannot write {target}: {exc.strerror or exc}") from exc
