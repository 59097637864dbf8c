"""Layering contracts: llama.cpp behind one module, no Qt in the algorithm nor in the headless
tools, and the GUI on the engine's public face."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKEND = ROOT / "speculative" / "backend.py"
QT = {"PySide6", "PyQt5", "PyQt6", "shiboken6", "pytestqt"}


@dataclasses.dataclass(frozen=True)
class Import:
    name: str    # the full dotted name; for ``from a import b``, both "a" and "a.b" are listed
    lazy: bool   # inside a function: runs only when that function is called


def imports(path: Path) -> list[Import]:
    """Every import in the file, relative ones resolved against its package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    functions = (f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef))
    lazy_nodes = {id(n) for f in functions for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, id(node) in lazy_nodes) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # an __init__ is its package: its level 1 is itself
                anchor = _module_name(path) + (".__init__" if path.name == "__init__.py" else "")
                package = anchor.rsplit(".", node.level)[0]
                base = f"{package}.{base}" if base else package
            found.append(Import(base, id(node) in lazy_nodes))
            found += [Import(f"{base}.{alias.name}", id(node) in lazy_nodes)
                      for alias in node.names]
    return found


def imported_modules(path: Path) -> set[str]:
    """The top-level packages the file imports."""
    return {i.name.split(".")[0] for i in imports(path)}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _within(name: str, prefixes: set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def project_files() -> list[Path]:
    packages = ("app", "speculative", "models", "tests")
    return [p for pkg in packages for p in (ROOT / pkg).rglob("*.py")]


def _project_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in project_files()}


def reaches_qt(module: str, seen: set[str] | None = None) -> list[str]:
    """The chain of module-level imports from ``module`` to Qt, or [] when there is none."""
    modules = _project_modules()
    seen = set() if seen is None else seen
    seen.add(module)
    for i in imports(modules[module]):
        if i.lazy:
            continue
        if i.name.split(".")[0] in QT:
            return [module, i.name]
        if i.name in modules and i.name not in seen:
            chain = reaches_qt(i.name, seen)
            if chain:
                return [module, *chain]
    return []


# ---------------------------------------------------------------- llama.cpp and Qt


def test_only_the_backend_imports_llama_cpp() -> None:
    offenders = [p.relative_to(ROOT) for p in project_files()
                 if p != BACKEND and "llama_cpp" in imported_modules(p)]
    assert offenders == []


def test_speculative_imports_no_qt() -> None:
    offenders = [p.relative_to(ROOT) for p in (ROOT / "speculative").rglob("*.py")
                 if imported_modules(p) & {*QT, "app"}]
    assert offenders == []


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


# ---------------------------------------------------------------- the headless tools

TOOLS = ROOT / "app" / "tools"
# the one exception: the benchmark's chart is drawn with Qt, imported only for ``--chart``
CHART = (TOOLS / "bench.py", "app.ui.bench_chart")
WINDOW = {"app.ui", "app.worker"}
# the command line opens the window (no subcommand, or ``app``) by importing these when asked
OPENS_THE_WINDOW = {"app.main", "app.diagnostics"}


def tool_offenders(files: list[Path], exception: tuple[Path, str] = CHART) -> list[str]:
    """Imports of Qt or of the window's side in headless tool files: the chart is the one
    exception, while it stays lazy; the start-up that opens the window may be imported lazily."""
    out = []
    for path in files:
        for i in imports(path):
            if path == exception[0] and i.lazy and _within(i.name, {exception[1]}):
                continue
            if (i.name.split(".")[0] in QT or _within(i.name, WINDOW)
                    or (not i.lazy and _within(i.name, OPENS_THE_WINDOW))):
                out.append(f"{path.name}: {i.name}" + (" (lazy)" if i.lazy else ""))
    return out


def test_the_headless_tools_import_no_qt_nor_the_window() -> None:
    assert tool_offenders(sorted(TOOLS.rglob("*.py"))) == []


def test_no_headless_tool_reaches_qt_through_its_imports() -> None:
    chains = {m: reaches_qt(m) for m in _project_modules() if m.startswith("app.tools")}
    assert {m: c for m, c in chains.items() if c} == {}


# ---------------------------------------------------------------- the server

SERVER = ROOT / "app" / "server"


def test_the_server_imports_no_qt_nor_the_window() -> None:
    """``staged-chat serve`` runs without a window; the app hands the server its engine thread
    through the server's ``Backend`` protocol, not the other way round."""
    offenders = [f"{p.name}: {i.name}" for p in sorted(SERVER.rglob("*.py")) for i in imports(p)
                 if i.name.split(".")[0] in QT or _within(i.name, WINDOW | OPENS_THE_WINDOW
                                                          | {"app.settings", "app.tools"})]
    assert offenders == []
    chains = {m: reaches_qt(m) for m in _project_modules() if m.startswith("app.server")}
    assert {m: c for m, c in chains.items() if c} == {}


def test_the_server_uses_the_engines_public_face() -> None:
    """Requests run on ``Engine`` and ``open_pair`` only: llama.cpp stays behind the backend."""
    assert gui_offenders(sorted(SERVER.rglob("*.py")), PUBLIC) == []


# ---------------------------------------------------------------- the GUI and the engine

# the engine's public face: what the window and its worker may import from ``speculative``
PUBLIC = {f"speculative.{m}" for m in ("engine", "policies", "stats", "loading", "errors",
                                       "text", "sampling", "penalties", "divergence")}
WORKER_ONLY = {"speculative.backend"}  # llama.cpp's system information, vocabulary-only loads


def gui_offenders(files: list[Path], allowed: set[str]) -> list[str]:
    """Imports of ``speculative`` modules outside ``allowed``, and of llama_cpp."""
    out = []
    for path in files:
        for i in imports(path):
            top = i.name.split(".")[0]
            if top == "llama_cpp" or (top == "speculative" and i.name != "speculative"
                                      and not _within(i.name, allowed)):
                out.append(f"{path.name}: {i.name}")
    return out


def test_the_window_uses_the_engines_public_face() -> None:
    assert gui_offenders(sorted((ROOT / "app" / "ui").rglob("*.py")), PUBLIC) == []


def test_the_worker_uses_the_engines_public_face_and_the_backend_for_system_facts() -> None:
    assert gui_offenders(sorted((ROOT / "app" / "worker").rglob("*.py")),
                         PUBLIC | WORKER_ONLY) == []


# ---------------------------------------------------------------- the checks can fail


def test_the_contract_check_sees_imports(tmp_path: Path) -> None:
    """The checks above must be able to fail."""
    assert "llama_cpp" in imported_modules(BACKEND)
    assert {"numpy", "llama_cpp"} <= imported_modules(BACKEND)
    assert "PySide6" in imported_modules(ROOT / "app" / "worker" / "thread.py")
    # the chart's import is seen, and seen as lazy
    assert Import(CHART[1], lazy=True) in imports(CHART[0])
    # Qt is reached through module-level imports, and the chain is named
    assert reaches_qt("app.main")[-1].startswith("PySide6")
    assert reaches_qt("app.worker.loading")[:2] == ["app.worker.loading", "app.settings"]
    # a tool importing Qt or the window is an offender; the chart only while it stays lazy
    bad_tool = tmp_path / "bench.py"
    bad_tool.write_text("from PySide6.QtCore import QObject\nimport app.worker.thread\n"
                        "from app.ui.bench_chart import save_chart\n"
                        "def chart():\n    from app.ui.bench_chart import save_chart\n"
                        "def window():\n    from app.ui import main_window\n"
                        "import app.main\ndef start():\n    from app.main import run\n")
    assert sorted(tool_offenders([bad_tool], (bad_tool, CHART[1]))) == [
        "bench.py: PySide6.QtCore", "bench.py: PySide6.QtCore.QObject", "bench.py: app.main",
        "bench.py: app.ui (lazy)", "bench.py: app.ui.bench_chart",
        "bench.py: app.ui.bench_chart.save_chart", "bench.py: app.ui.main_window (lazy)",
        "bench.py: app.worker.thread"]
    # the GUI importing an engine internal or the backend is an offender
    bad_gui = tmp_path / "panel.py"
    bad_gui.write_text("from speculative.stats import RunStats\nfrom speculative import auto\n"
                       "from speculative.kvtree import KVTree\nimport speculative.backend\n")
    assert sorted(gui_offenders([bad_gui], PUBLIC)) == [
        "panel.py: speculative.auto", "panel.py: speculative.backend",
        "panel.py: speculative.kvtree", "panel.py: speculative.kvtree.KVTree"]
    assert gui_offenders([bad_gui], PUBLIC | {"speculative.auto", "speculative.kvtree",
                                              "speculative.backend"}) == []
