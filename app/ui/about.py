"""The About box's text: versions of everything that matters."""

from __future__ import annotations

import platform

from app.worker.messages import ModelInfo


def about_text(info: ModelInfo | None) -> str:
    import importlib.metadata as md

    import numpy
    from PySide6 import QtCore

    def version(dist: str) -> str:
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return "?"

    lines = [
        "<h3>Staged Chat " + version("staged-chat") + "</h3>",
        "<p>Local chat with lossless staged tree speculative decoding (Spector &amp; Ré, 2023) "
        "on llama.cpp.</p>",
        f"<p>Python {platform.python_version()} · PySide6 {version('PySide6')} "
        f"(Qt {QtCore.qVersion()}) · llama-cpp-python {version('llama-cpp-python')} · "
        f"numpy {numpy.__version__}</p>",
    ]
    if info is not None:
        flash = " / ".join("on" if f else "off" for f in info.flash_attn if f is not None)
        lines.append(f"<p>Target: {info.target}<br>Draft: {info.draft or 'none'}<br>"
                     f"{info.n_ctx}-token window, {info.threads_text()}, flash attention "
                     f"{flash} (whichever decodes faster on this machine)</p>"
                     f"<p><small>llama.cpp: {info.system}</small></p>")
    return "".join(lines)

