"""The chat history store (app/history.py) on real SQLite files."""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from app import history as history_module
from app.history import (
    SCHEMA_VERSION,
    Conversation,
    History,
    HistoryError,
    Message,
    default_path,
    to_json,
    to_markdown,
    write_text_atomic,
)
from app.replies import footer
from speculative.stats import RunStats, StepStats

ROOT = Path(__file__).resolve().parents[2]


class Clock:
    """A clock that ticks one second per reading, so orderings never tie."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._ticks = itertools.count()
        self.start = start

    def __call__(self) -> float:
        return self.start + next(self._ticks)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "history.sqlite3"


@pytest.fixture
def store(path: Path) -> Iterator[History]:
    with History(path, clock=Clock()) as h:
        yield h


def _summary() -> dict:
    run = RunStats(mode="staged", prompt_tokens=5, t_prefill=0.01)
    run.add(StepStats(drafted=6, accepted=2, offered=3, emitted=3,
                      origins={"draft": 1, "ngram": 1, "target": 1}, draft_calls=3,
                      stage2_proposed=4, stage2_used=1, t_draft=0.01, t_stage2=0.001,
                      t_verify=0.02, t_other=0.001))
    return {**run.summary(), "estimated_speedup": 1.8}


def _reply(store: History, conversation_id: int, text: str = "return a + b") -> Message:
    return store.add_message(conversation_id, "assistant", text, tokens=[7, 8, 9],
                             origins=["draft", "ngram", "target"], finish="stop",
                             stats=_summary(), mode="staged")


def _raw(path: Path, sql: str) -> list[tuple]:
    """Look at the file with a connection of the test's own."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        return db.execute(sql).fetchall()


# round trips and ordering


def test_conversations_and_messages_survive_reopening(path: Path) -> None:
    settings = {"mode": "staged", "temperature": 0.0, "max_nodes": 16}
    with History(path) as store:
        c = store.create_conversation("Fibonacci", model="builtin-target",
                                      prompt_format="code", settings=settings)
        user = store.add_message(c.id, "user", "def fib(n):")
        reply = _reply(store, c.id)
        before = store.conversation(c.id)
    with History(path) as store:
        assert store.recovered_from is None
        assert store.conversations() == [before]
        assert store.messages(c.id) == [user, reply]
    assert (before.title, before.model, before.prompt_format) == ("Fibonacci", "builtin-target",
                                                                  "code")
    assert before.settings == settings
    assert reply.tokens == [7, 8, 9]
    assert reply.origins == ["draft", "ngram", "target"]
    assert (reply.finish, reply.mode, reply.role) == ("stop", "staged", "assistant")
    assert reply.stats == json.loads(json.dumps(_summary()))
    assert reply.stats["origins"] == {"draft": 1, "ngram": 1, "target": 1}
    assert (user.tokens, user.origins, user.finish, user.stats) == ([], [], None, {})


def test_list_is_newest_updated_first(store: History) -> None:
    a, b, c = (store.create_conversation(t) for t in "abc")
    assert [x.title for x in store.conversations()] == ["c", "b", "a"]
    store.add_message(a.id, "user", "hello")
    assert [x.title for x in store.conversations()] == ["a", "c", "b"]
    store.rename_conversation(b.id, "b2")  # renaming is not activity: b keeps its place
    assert [x.title for x in store.conversations()] == ["a", "c", "b2"]
    last = store.add_message(c.id, "user", "hi")
    store.add_message(a.id, "user", "again")
    store.delete_message(last.id)  # deleting is activity (Regenerate)
    assert [x.title for x in store.conversations()] == ["c", "a", "b2"]


def test_messages_in_order_and_ids_never_reused(store: History) -> None:
    c = store.create_conversation("t")
    texts = [f"m{i}" for i in range(5)]
    added = [store.add_message(c.id, "user", t) for t in texts]
    assert [m.text for m in store.messages(c.id)] == texts
    store.delete_message(added[-1].id)
    again = store.add_message(c.id, "user", "m4 again")
    assert again.id > added[-1].id
    assert [m.text for m in store.messages(c.id)] == [*texts[:4], "m4 again"]
    with pytest.raises(KeyError):
        store.delete_message(added[-1].id)
    with pytest.raises(KeyError):
        store.message(added[-1].id)


def test_update_and_delete_conversation_cascade(path: Path, store: History) -> None:
    keep, drop = store.create_conversation("keep"), store.create_conversation("drop")
    store.add_message(keep.id, "user", "k")
    for i in range(3):
        store.add_message(drop.id, "user", f"d{i}")
    updated = store.update_conversation(drop.id, model="gpt2", settings={"top_k": 40})
    assert (updated.title, updated.model, updated.settings) == ("drop", "gpt2", {"top_k": 40})
    store.delete_conversation(drop.id)
    assert [c.title for c in store.conversations()] == ["keep"]
    assert store.messages(drop.id) == []
    assert _raw(path, "SELECT text FROM messages") == [("k",)]  # the cascade, in the file
    for call in (lambda: store.delete_conversation(drop.id),
                 lambda: store.rename_conversation(drop.id, "x"),
                 lambda: store.conversation(drop.id),
                 lambda: store.add_message(drop.id, "user", "x")):
        with pytest.raises(KeyError):
            call()


def test_search_titles_and_text_case_insensitively(store: History) -> None:
    store.create_conversation("Äpfel und Birnen an der Straße")
    code = store.create_conversation("code")
    store.add_message(code.id, "user", "def HELLO_world():")
    other = store.create_conversation("100% other")
    store.add_message(other.id, "assistant", "nothing here", finish="stop")

    def titles(query: str) -> list[str]:
        return [c.title for c in store.search(query)]

    fruit = ["Äpfel und Birnen an der Straße"]
    assert titles("äpfel") == fruit  # beyond ASCII, unlike SQLite's LIKE
    assert titles("STRASSE") == fruit  # casefold, not lower
    assert titles("hello_WORLD") == ["code"]
    assert titles("%") == ["100% other"]  # no LIKE wildcards
    assert titles("_") == ["code"]
    assert titles("missing") == []
    assert titles("  ") == ["100% other", "code", *fruit]
    assert store.search("HERE") == [store.conversation(other.id)]


def test_bad_messages_are_refused_and_nothing_is_written(store: History) -> None:
    c = store.create_conversation("t")
    bad: list[dict] = [{"role": "bot"}, {"finish": "done"},
                       {"tokens": [1, 2], "origins": ["draft"]},
                       {"tokens": [1], "origins": ["oracle"]}, {"stats": {"x": object()}}]
    for kwargs in bad:
        role = kwargs.pop("role", "assistant")
        with pytest.raises((ValueError, TypeError)):
            store.add_message(c.id, role, "text", **kwargs)
    assert store.messages(c.id) == []


def test_stats_are_stored_as_plain_json(store: History) -> None:
    c = store.create_conversation("t")
    m = store.add_message(c.id, "assistant", "x", finish="length",
                          stats={"speedup": float("inf"), "tau": float("nan"),
                                 "depth": (0.5, 0.25), "ok": True})
    assert m.stats == {"speedup": None, "tau": None, "depth": [0.5, 0.25], "ok": True}


def test_app_values(path: Path) -> None:
    with History(path) as store:
        assert store.get_value("last", 0) == 0
        store.set_value("last", 3)
        store.set_value("window", {"w": 800, "h": 600})
        store.set_value("last", 4)
    with History(path) as store:
        assert store.get_value("last") == 4
        assert store.get_value("window") == {"w": 800, "h": 600}


def test_file_is_wal_with_a_schema_version(path: Path, store: History) -> None:
    store.create_conversation("t")
    assert _raw(path, "PRAGMA journal_mode") == [("wal",)]
    assert _raw(path, "PRAGMA user_version") == [(SCHEMA_VERSION,)]
    assert SCHEMA_VERSION >= 1


def test_newer_schema_is_refused_and_left_alone(path: Path) -> None:
    History(path).close()
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    original = path.read_bytes()
    with pytest.raises(HistoryError, match="newer"):
        History(path)
    assert path.read_bytes() == original
    assert list(path.parent.glob("*.corrupt-*")) == []


def test_a_connection_stays_on_its_thread(store: History) -> None:
    errors: list[BaseException] = []

    def use() -> None:
        try:
            store.conversations()
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=use)
    worker.start()
    worker.join()
    assert len(errors) == 1 and isinstance(errors[0], sqlite3.ProgrammingError)
    assert store.conversations() == []  # still fine on its own thread


def test_closed_store_refuses_use(path: Path) -> None:
    store = History(path)
    store.close()
    store.close()  # idempotent
    with pytest.raises(sqlite3.ProgrammingError):
        store.conversations()


# odd text


ODD_TEXTS = [
    "",
    "\x00nul\x00 and \x01\x02\x1b[31mescapes\x7f\x9f",
    "line\r\nbreaks\rand\ttabs\n\n",
    "emoji \U0001f642 \u202ertl\u202c \u4e2d\u6587 \ufeff\ufffd",
    "x" * 3_000_000 + "end",
]


@pytest.mark.parametrize("text", ODD_TEXTS, ids=["empty", "control", "newlines", "unicode",
                                                  "long"])
def test_odd_text_round_trips(path: Path, text: str) -> None:
    with History(path) as store:
        c = store.create_conversation(text[:100])
        store.add_message(c.id, "assistant", text, finish="stop", stats={"note": text[:50]})
    with History(path) as store:
        [m] = store.messages(c.id)
        assert m.text == text
        assert store.conversation(c.id).title == text[:100]
        assert m.stats == {"note": text[:50]}
        if text:
            assert store.search(text[-3:]) == [store.conversation(c.id)]


def test_lone_surrogates_are_replaced_not_raised(path: Path) -> None:
    with History(path) as store:
        c = store.create_conversation("title \udcff")
        m = store.add_message(c.id, "assistant", "a\ud800b \ud83d\ude00 \udc80",
                              stats={"k\udfff": "v\ud800"}, finish="stop")
        store.set_value("key", "\ud800")
    with History(path) as store:
        assert store.messages(c.id) == [m]
        assert m.text == "a\ufffdb \U0001f600 \ufffd"  # a split pair is joined
        assert store.conversation(c.id).title == "title \ufffd"
        assert m.stats == {"k\ufffd": "v\ufffd"}
        assert store.get_value("key") == "\ufffd"


# damaged files


def _real_database(path: Path, messages: int = 300) -> None:
    with History(path) as store:
        c = store.create_conversation("real")
        for i in range(messages):
            store.add_message(c.id, "user", f"message {i} " + "x" * 1000)


def _random_bytes(path: Path) -> None:
    path.write_bytes(random.Random(1).randbytes(50_000))
    path.with_name(path.name + "-wal").write_bytes(random.Random(2).randbytes(5_000))


def _truncated(path: Path) -> None:
    _real_database(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garbage_in_the_middle(path: Path) -> None:
    _real_database(path)
    _overwrite_middle_pages(path)


def _overwrite_middle_pages(path: Path) -> None:
    data = bytearray(path.read_bytes())
    page = 4096
    middle = (len(data) // page // 2) * page
    data[middle: middle + 3 * page] = random.Random(3).randbytes(3 * page)
    path.write_bytes(bytes(data))


def _garbage_in_the_middle_and_commits_in_the_wal(path: Path) -> None:
    """A damaged file whose WAL holds the latest commits, not yet checkpointed (as after a
    crash): the recovery must not checkpoint them into the damaged file or delete them."""
    source = path.with_name("source.sqlite3")
    _real_database(source)
    with contextlib.closing(sqlite3.connect(source, isolation_level=None)) as db:
        db.execute("PRAGMA wal_autocheckpoint = 0")
        db.execute("UPDATE messages SET text = 'latest' WHERE id = (SELECT max(id) FROM messages)")
        for suffix in ("", "-wal"):  # copied while open: closing would checkpoint
            shutil.copyfile(f"{source}{suffix}", f"{path}{suffix}")
    assert path.with_name(path.name + "-wal").stat().st_size > 0
    _overwrite_middle_pages(path)


@pytest.mark.parametrize("damage", [_random_bytes, _truncated, _garbage_in_the_middle,
                                    _garbage_in_the_middle_and_commits_in_the_wal])
def test_damaged_file_is_kept_aside_and_a_fresh_history_starts(path: Path, damage) -> None:
    damage(path)
    wal = path.with_name(path.name + "-wal")
    originals = {p.name: p.read_bytes() for p in (path, wal) if p.exists()}
    assert len(originals[path.name]) > 4096

    with History(path, clock=Clock()) as store:
        backup = store.recovered_from
        assert backup is not None
        assert backup.parent == path.parent
        assert backup.name.startswith("history.sqlite3.corrupt-")
        assert backup.read_bytes() == originals[path.name]  # the user's bytes, untouched
        assert store.recovery_reason  # something to show the user
        if wal.name in originals:
            assert Path(f"{backup}-wal").read_bytes() == originals[wal.name]
        assert store.conversations() == []
        c = store.create_conversation("after")
        store.add_message(c.id, "user", "works")
    with History(path) as store:
        assert (store.recovered_from, store.recovery_reason) == (None, "")
        assert [m.text for m in store.messages(c.id)] == ["works"]
    assert _raw(path, "PRAGMA integrity_check") == [("ok",)]


def test_backups_never_overwrite_each_other(path: Path) -> None:
    backups = []
    for seed in range(2):
        path.write_bytes(random.Random(seed).randbytes(10_000))
        with History(path, clock=lambda: 1_700_000_000.0) as store:  # the same second
            backups.append(store.recovered_from)
    assert backups[0] != backups[1]
    assert [b.read_bytes() for b in backups] == [random.Random(s).randbytes(10_000)
                                                  for s in range(2)]


# folders


def test_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(HistoryError, match="does not exist"):
        History(tmp_path / "missing" / "history.sqlite3")
    (tmp_path / "file").write_text("")
    with pytest.raises(HistoryError):
        History(tmp_path / "file" / "history.sqlite3")
    with pytest.raises(HistoryError, match="cannot create"):
        History(tmp_path / "file" / "sub" / "history.sqlite3", create_parent=True)
    with History(tmp_path / "a" / "b" / "history.sqlite3", create_parent=True) as store:
        assert store.conversations() == []


def _open_in_child(db: Path, *flags: str) -> dict:
    """Open the store in a process that file modes apply to, even when the tests run as root."""
    result = subprocess.run([sys.executable, "-m", "tests.app.history_child", "open", str(db),
                             *flags, "--drop-root-powers"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@contextlib.contextmanager
def _read_only(folder: Path) -> Iterator[None]:
    folder.chmod(0o555)
    try:
        yield
    finally:
        folder.chmod(0o755)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="file modes, prctl: Linux")
def test_read_only_folder_is_a_clear_error_and_data_stays(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    existing, damaged = folder / "existing.sqlite3", folder / "damaged.sqlite3"
    _real_database(existing, messages=3)
    damaged.write_bytes(random.Random(4).randbytes(10_000))
    originals = {p: p.read_bytes() for p in (existing, damaged)}
    cases = [(folder / "new.sqlite3", (), "is read-only"),
             (existing, (), "is read-only"),
             (damaged, (), "damaged and could not be moved aside"),
             (folder / "sub" / "history.sqlite3", ("--create-parent",), "cannot create")]
    with _read_only(folder):
        for db, flags, message in cases:
            outcome = _open_in_child(db, *flags)
            assert outcome["writable"] is False  # the premise: the child cannot write here
            assert outcome["opened"] is False
            assert message in outcome["error"] and str(folder) in outcome["error"]
    assert {p: p.read_bytes() for p in originals} == originals
    assert sorted(p.name for p in folder.iterdir()) == ["damaged.sqlite3", "existing.sqlite3"]
    with History(existing) as store:
        assert len(store.messages(store.conversations()[0].id)) == 3


# crash


def test_sigkill_mid_write_loses_only_the_message_being_written(path: Path) -> None:
    committed = 5
    result = subprocess.run([sys.executable, "-m", "tests.app.history_child", "crash",
                             str(path), str(committed)], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == -signal.SIGKILL, result.stdout + result.stderr
    report = {k: v for line in result.stdout.splitlines() for k, v in json.loads(line).items()}
    # the killed transaction had really reached the disk: uncommitted frames in the WAL
    assert report["wal_at_kill"] > report["wal_before"] + 1_000_000
    with History(path) as store:
        assert store.recovered_from is None
        [conversation] = store.conversations()
        texts = [m.text for m in store.messages(conversation.id)]
    assert texts == [f"message {i}" for i in range(committed)]
    assert _raw(path, "PRAGMA integrity_check") == [("ok",)]


# export


def _code_conversation(store: History) -> Conversation:
    c = store.create_conversation("Fib", model="builtin", prompt_format="code")
    store.add_message(c.id, "user", "def fib(n):\n")
    _reply(store, c.id, "    return n if n < 2 else fib(n - 1) + fib(n - 2)  # ```")
    return store.conversation(c.id)


def test_markdown_export_fences_code_conversations(store: History) -> None:
    c = _code_conversation(store)
    text = to_markdown(c, store.messages(c.id))
    assert text.startswith("# Fib\n")
    assert "## User\n\n```python\ndef fib(n):\n```" in text
    assert ("## Assistant\n\n````python\n    return n if n < 2 else fib(n - 1) + "
            "fib(n - 2)  # ```\n````") in text  # a longer fence than the backticks inside
    reply = store.messages(c.id)[-1]
    line = footer(reply.stats, reply.mode, reply.finish or "")
    assert f"*{line}*" in text  # the line the window shows under the reply
    assert "3 tokens" in line and "1.80" in line and "3.00" in line


def test_markdown_export_of_a_transcript_has_no_fences(store: History) -> None:
    c = store.create_conversation("", prompt_format="transcript")
    store.add_message(c.id, "system", "Be brief.")
    store.add_message(c.id, "user", "Hello?")
    _reply(store, c.id, "Hi.")
    text = to_markdown(store.conversation(c.id), store.messages(c.id))
    assert "```" not in text
    assert text.startswith("# Untitled conversation\n")
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings == ["## System", "## User", "## Assistant"]
    assert "## User\n\nHello?\n\n## Assistant\n\nHi.\n\n*staged  ·  3 tokens" in text
    assert "```" in to_markdown(store.conversation(c.id), store.messages(c.id), code=True)


def test_json_export_has_everything(store: History) -> None:
    c = _code_conversation(store)
    messages = store.messages(c.id)
    data = json.loads(to_json(c, messages))
    assert data["format"] == "staged-chat-conversation"
    assert data["conversation"]["title"] == "Fib"
    assert data["conversation"]["prompt_format"] == "code"
    assert [m["role"] for m in data["messages"]] == ["user", "assistant"]
    reply = data["messages"][1]
    assert reply["tokens"] == [7, 8, 9]
    assert reply["origins"] == ["draft", "ngram", "target"]
    assert reply["stats"]["tau"] == 3.0 and reply["stats"]["estimated_speedup"] == 1.8
    assert reply["finish"] == "stop" and reply["mode"] == "staged"
    assert [Message(**m) for m in data["messages"]] == messages


def test_atomic_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "export.md"
    write_text_atomic(target, "first \ud800")
    assert target.read_text(encoding="utf-8") == "first \ufffd"
    write_text_atomic(target, "second\r\n")
    assert target.read_bytes() == b"second\r\n"

    def fail(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(history_module.os, "replace", fail)
    with pytest.raises(HistoryError, match="No space left"):
        write_text_atomic(target, "third")
    assert target.read_bytes() == b"second\r\n"  # the old export, whole
    assert [p.name for p in tmp_path.iterdir()] == ["export.md"]  # no temporary left
    monkeypatch.undo()
    with pytest.raises(HistoryError):
        write_text_atomic(tmp_path / "missing" / "x.md", "x")


# location


@pytest.mark.skipif(sys.platform in ("win32", "darwin"), reason="the XDG branch")
def test_default_path_follows_xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert default_path() == tmp_path / "data" / "staged-chat" / "history.sqlite3"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_DATA_HOME", "relative/dir")  # invalid per the spec: ignored
    assert default_path() == tmp_path / "home" / ".local" / "share" / "staged-chat" / (
        "history.sqlite3")
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_path().parent == tmp_path / "home" / ".local" / "share" / "staged-chat"
