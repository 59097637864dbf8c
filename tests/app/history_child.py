"""A child process for tests/app/test_history.py: what a test cannot do in its own process.

    python -m tests.app.history_child crash DB N   commit N messages, then SIGKILL itself inside
                                                   the next add_message, before its COMMIT
    python -m tests.app.history_child open DB [--create-parent] [--drop-root-powers]
                                                   try to open DB; print what happened as JSON
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sqlite3
import sys
from pathlib import Path
from typing import Any

from app.history import History, HistoryError

BIG = 8_000_000  # characters: far above SQLite's 2 MB page cache, so the open transaction
                 # spills its pages into the WAL before the kill


def _kill_before_commit(armed: list[bool], wal: Path) -> None:
    """Make every connection SIGKILL this process when, once armed, it is about to COMMIT."""
    real_connect = sqlite3.connect

    def on_statement(sql: str) -> None:
        if armed and sql.strip().upper() == "COMMIT":
            print(json.dumps({"wal_at_kill": wal.stat().st_size}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        db = real_connect(*args, **kwargs)
        db.set_trace_callback(on_statement)  # called as each statement starts running
        return db

    sqlite3.connect = connect


def crash(path: Path, committed: int) -> None:
    armed: list[bool] = []
    wal = path.with_name(path.name + "-wal")
    _kill_before_commit(armed, wal)
    store = History(path)
    conversation = store.create_conversation("crash")
    for i in range(committed):
        store.add_message(conversation.id, "user" if i % 2 == 0 else "assistant", f"message {i}",
                          tokens=[i], origins=["target"], finish="stop" if i % 2 else None)
    print(json.dumps({"wal_before": wal.stat().st_size}), flush=True)
    armed.append(True)
    store.add_message(conversation.id, "assistant", "x" * BIG, finish="stop")
    print(json.dumps({"error": "still alive after the commit"}), flush=True)


def try_open(path: Path, create_parent: bool) -> None:
    folder = path.parent
    while not folder.exists():  # the folder that create_parent would write into
        folder = folder.parent
    probe = folder / "probe"
    try:
        probe.write_text("")
        writable = True
        probe.unlink()
    except OSError:
        writable = False
    try:
        History(path, create_parent=create_parent).close()
        outcome = {"writable": writable, "opened": True}
    except HistoryError as exc:
        outcome = {"writable": writable, "opened": False, "error": str(exc)}
    print(json.dumps(outcome), flush=True)


def drop_root_powers_and_restart() -> None:
    """Drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set and exec again, so
    that root then obeys file modes like anyone else (tests often run as root)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")
    args = [a for a in sys.argv[1:] if a != "--drop-root-powers"]
    os.execv(sys.executable, [sys.executable, "-m", "tests.app.history_child", *args])


if __name__ == "__main__":
    if "--drop-root-powers" in sys.argv and os.geteuid() == 0:
        drop_root_powers_and_restart()
    command, db = sys.argv[1], Path(sys.argv[2])
    if command == "crash":
        crash(db, int(sys.argv[3]))
    else:
        try_open(db, "--create-parent" in sys.argv[3:])
