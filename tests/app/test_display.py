"""A desktop without Qt's X11 libraries gets a hint naming them and the command that installs
them, not Qt's abort (``app.display``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.display import APT_PACKAGES, XCB_LIBRARIES, problem, uses_xcb

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("env", "platform", "expected"), [
    ({"DISPLAY": ":0"}, "linux", True),
    ({"DISPLAY": ":0", "QT_QPA_PLATFORM": "xcb"}, "linux", True),
    ({"DISPLAY": ":0", "QT_QPA_PLATFORM": "offscreen"}, "linux", False),
    ({"DISPLAY": ":0", "QT_QPA_PLATFORM": "wayland"}, "linux", False),
    ({}, "linux", False),  # no X display: Qt would not try xcb's libraries
    ({"DISPLAY": ":0", "XDG_SESSION_TYPE": "wayland", "WAYLAND_DISPLAY": "wayland-0"},
     "linux", False),  # Qt may take Wayland
    ({"DISPLAY": ":0", "XDG_SESSION_TYPE": "wayland", "WAYLAND_DISPLAY": "wayland-0",
      "QT_QPA_PLATFORM": "xcb"}, "linux", True),
    ({"DISPLAY": ":0"}, "darwin", False),
])
def test_when_qt_would_open_its_window_through_x11(env: dict, platform: str,
                                                   expected: bool) -> None:
    assert uses_xcb(env, platform) is expected


def test_missing_libraries_are_named_with_the_command_that_installs_them() -> None:
    absent = {"libxcb-cursor.so.0", "libxcb-icccm.so.4"}

    def load(name: str) -> None:
        if name in absent:
            raise OSError(f"{name}: cannot open shared object file")

    hint = problem({"DISPLAY": ":0"}, "linux", load)
    assert hint is not None
    assert "libxcb-cursor.so.0, libxcb-icccm.so.4" in hint
    assert not any(lib in hint for lib in set(XCB_LIBRARIES) - absent)
    assert "sudo apt install " + " ".join(APT_PACKAGES) in hint
    assert problem({"DISPLAY": ":0"}, "linux", lambda _name: None) is None

    def must_not_load(name: str) -> None:
        raise AssertionError(f"loaded {name} for a platform that needs no X11")

    assert problem({"DISPLAY": ":0", "QT_QPA_PLATFORM": "offscreen"}, "linux",
                   must_not_load) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="X11 libraries: Linux")
def test_the_app_exits_with_the_hint_where_a_library_cannot_load(tmp_path: Path) -> None:
    """The entry point with an X display and a library path that shadows one of xcb's
    libraries with a file that is not one: a hint and status 1, before Qt would abort."""
    shadow = tmp_path / "lib"
    shadow.mkdir()
    (shadow / "libxcb-cursor.so.0").write_bytes(b"not a library")
    env = {k: v for k, v in os.environ.items()
           if k not in ("QT_QPA_PLATFORM", "XDG_SESSION_TYPE", "WAYLAND_DISPLAY")}
    env.update(DISPLAY=":97", LD_LIBRARY_PATH=str(shadow))
    done = subprocess.run([sys.executable, "-m", "app.tools.cli", "app", "--data-dir",
                           str(tmp_path / "data")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "libxcb-cursor.so.0" in done.stderr and "sudo apt install" in done.stderr
    assert "could not load the Qt platform plugin" not in done.stderr
    assert not (tmp_path / "data").exists()  # nothing was opened before the check
