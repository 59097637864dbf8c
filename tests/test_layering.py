"""Layering contracts: llama.cpp behind one module, no Qt in the algorithm."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKEND = ROOT / "speculative" / "backend.py"


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def project_files() -> list[Path]:
    packages = ("app", "speculative", "models", "tests")
    return [p for pkg in packages for p in (ROOT / pkg).rglob("*.py")]


def test_only_the_backend_imports_llama_cpp() -> None:
    offenders = [p.relative_to(ROOT) for p in project_files()
                 if p != BACKEND and "llama_cpp" in imported_modules(p)]
    assert offenders == []


def test_speculative_imports_no_qt() -> None:
    offenders = [p.relative_to(ROOT) for p in (ROOT / "speculative").rglob("*.py")
                 if imported_modules(p) & {"PySide6", "PyQt5", "PyQt6", "shiboken6", "app"}]
    assert offenders == []


QT = {"PySide6", "PyQt5", "PyQt6", "shiboken6", "pytestqt"}


def test_only_the_app_imports_qt() -> None:
    """The algorithm and the model tools run without a window (CLI, training, benchmarks)."""
    offenders = [p.relative_to(ROOT) for pkg in ("speculative", "models")
                 for p in (ROOT / pkg).rglob("*.py") if imported_modules(p) & QT]
    assert offenders == []


def test_the_command_line_does_not_load_qt() -> None:
    """``staged-chat generate`` and ``bench`` must not pay for Qt (nor need a display)."""
    import subprocess
    import sys

    code = ("import sys, app.tools.cli; app.tools.cli.build_parser(); "
            "print(sorted(m for m in sys.modules if m.startswith('PySide6')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == "[]"


def test_the_contract_check_sees_imports() -> None:
    """The checks above must be able to fail."""
    assert "llama_cpp" in imported_modules(BACKEND)
    assert {"numpy", "llama_cpp"} <= imported_modules(BACKEND)
    assert "PySide6" in imported_modules(ROOT / "app" / "worker" / "thread.py")
