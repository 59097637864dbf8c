"""Whether Qt can open a window on this desktop: the system libraries its X11 platform plugin
(xcb) loads. No Qt.

Qt's wheels bring Qt itself but not these; where one is missing, Qt aborts at start-up with
"could not load the Qt platform plugin xcb" and names none of them. ``problem`` says which are
missing and how to install them, before the application object is made.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Mapping

# what the xcb platform plugin and its GL, font and D-Bus integrations load, by soname
XCB_LIBRARIES = (
    "libxcb-cursor.so.0", "libxcb-icccm.so.4", "libxcb-image.so.0", "libxcb-keysyms.so.1",
    "libxcb-randr.so.0", "libxcb-render-util.so.0", "libxcb-shape.so.0", "libxcb-xinerama.so.0",
    "libxcb-xkb.so.1", "libxkbcommon-x11.so.0", "libEGL.so.1", "libGL.so.1",
    "libfontconfig.so.1", "libdbus-1.so.3",
)
# the Debian and Ubuntu packages that hold them
APT_PACKAGES = (
    "libxcb-cursor0", "libxcb-icccm4", "libxcb-image0", "libxcb-keysyms1", "libxcb-randr0",
    "libxcb-render-util0", "libxcb-shape0", "libxcb-xinerama0", "libxcb-xkb1",
    "libxkbcommon-x11-0", "libegl1", "libgl1", "libfontconfig1", "libdbus-1-3",
)


def uses_xcb(env: Mapping[str, str], platform: str = sys.platform) -> bool:
    """Whether Qt would open its window through X11 here: Linux, no other platform asked for
    (``QT_QPA_PLATFORM`` unset or "xcb") and an X display. In a Wayland session Qt may take
    its Wayland plugin instead when not told otherwise, so that is left to Qt."""
    if not platform.startswith("linux") or not env.get("DISPLAY"):
        return False
    asked = env.get("QT_QPA_PLATFORM", "")
    if asked == "xcb":
        return True
    wayland = env.get("XDG_SESSION_TYPE") == "wayland" and env.get("WAYLAND_DISPLAY")
    return asked == "" and not wayland


def missing_libraries(load: Callable[[str], object] = ctypes.CDLL) -> list[str]:
    """The xcb plugin's libraries that the dynamic loader cannot load."""
    missing = []
    for name in XCB_LIBRARIES:
        try:
            load(name)
        except OSError:
            missing.append(name)
    return missing


def problem(env: Mapping[str, str] = os.environ, platform: str = sys.platform,
            load: Callable[[str], object] = ctypes.CDLL) -> str | None:
    """What keeps Qt from opening a window here, with the command that fixes it; None when
    nothing is known to."""
    if not uses_xcb(env, platform):
        return None
    missing = missing_libraries(load)
    if not missing:
        return None
    return (f"staged-chat: Qt cannot open a window on this X11 desktop: its xcb platform "
            f"needs system libraries that are missing: {', '.join(missing)}.\n"
            f"On Debian or Ubuntu, install them with:\n"
            f"    sudo apt install {' '.join(APT_PACKAGES)}\n"
            f"(staged-chat generate and staged-chat bench need no window.)")
