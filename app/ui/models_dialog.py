"""Choosing models: the built-in pair, the catalog with downloads, or any GGUF file.

Downloads run on their own thread (``DownloadWorker``, reusing ``models.download``: progress,
cancel, resume, checksum) so that chatting goes on meanwhile. Before a pair is used, the engine
thread checks which drafts share the target's tokenizer; only those can be chosen.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from PySide6.QtCore import QObject, QThread, Signal, Slot
from PySide6.QtGui import QShowEvent
from PySide6.QtWidgets import (
    QComboBox,
    QDialog,
    QFileDialog,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QProgressBar,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from models.catalog import Catalog, ModelEntry, load_catalog
from models.download import DownloadCancelled, DownloadError, cached_path, download

log = logging.getLogger(__name__)


class DownloadWorker(QObject):
    progress = Signal(str, int, object)  # model id, bytes done, bytes total (or None)
    done = Signal(str, str)              # model id, local path
    failed = Signal(str, str)            # model id, reason

    def __init__(self) -> None:
        super().__init__()
        self.cancels: dict[str, threading.Event] = {}

    @Slot(object)
    def fetch(self, entry: ModelEntry) -> None:
        cancel = self.cancels.setdefault(entry.id, threading.Event())
        try:
            path = download(entry, cancel=cancel,
                            progress=lambda d, t: self.progress.emit(entry.id, d, t))
            self.done.emit(entry.id, str(path))
        except DownloadCancelled:
            self.failed.emit(entry.id, "cancelled (the part already fetched is kept: "
                                       "Download resumes it)")
        except (DownloadError, OSError) as exc:
            self.failed.emit(entry.id, str(exc))
        finally:
            self.cancels.pop(entry.id, None)


class Downloads(QObject):
    """The download thread, owned by the main window (downloads outlive the dialog). Its
    signals repeat the worker's on the GUI thread."""

    _fetch = Signal(object)
    progress = Signal(str, int, object)
    done = Signal(str, str)
    failed = Signal(str, str)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName("downloads")
        self.worker = DownloadWorker()
        self.worker.moveToThread(self.thread)
        self._fetch.connect(self.worker.fetch)
        self.thread.start()
        self.active: set[str] = set()
        # bound methods of this QObject run on its (the GUI) thread; a lambda would run on the
        # download thread
        self.worker.progress.connect(self._progress)
        self.worker.done.connect(self._done)
        self.worker.failed.connect(self._failed)

    def _progress(self, model_id: str, done: int, total: object) -> None:
        self.progress.emit(model_id, done, total)

    def _done(self, model_id: str, path: str) -> None:
        self.active.discard(model_id)
        self.done.emit(model_id, path)

    def _failed(self, model_id: str, reason: str) -> None:
        self.active.discard(model_id)
        self.failed.emit(model_id, reason)

    def start(self, entry: ModelEntry) -> None:
        if entry.id in self.active:
            return
        self.active.add(entry.id)
        self.worker.cancels[entry.id] = threading.Event()
        self._fetch.emit(entry)

    def cancel(self, model_id: str) -> None:
        event = self.worker.cancels.get(model_id)
        if event is not None:
            event.set()

    def shutdown(self, timeout_ms: int = 15_000) -> bool:
        for event in list(self.worker.cancels.values()):
            event.set()
        self.thread.quit()
        return self.thread.wait(timeout_ms)


class ModelsDialog(QDialog):
    chosen = Signal(str, str)               # target path ("" = built-in), draft path ("" = none)
    check_requested = Signal(str, object)   # target path, candidate draft paths

    COLUMNS = ("Model", "Size", "Status", "")

    def __init__(self, downloads: Downloads, target: str, draft: str,
                 parent: QWidget | None = None, catalog: Catalog | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Models")
        self.resize(860, 520)
        self.downloads = downloads
        self.catalog: Catalog = catalog or load_catalog()
        self.hub = [m for m in self.catalog.models if not m.is_builtin]
        self.target, self.draft = target, draft
        self.extra_files: list[str] = [p for p in (target, draft) if p]
        self.table = QTableWidget(len(self.hub), len(self.COLUMNS))
        self.table.setHorizontalHeaderLabels(self.COLUMNS)
        self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        self.table.verticalHeader().hide()
        self.table.setSelectionBehavior(QTableWidget.SelectionBehavior.SelectRows)
        self.table.setEditTriggers(QTableWidget.EditTrigger.NoEditTriggers)
        self._bars: dict[str, QProgressBar] = {}
        for row, entry in enumerate(self.hub):
            self._fill_row(row, entry)
        self.target_label = QLabel()
        self.draft_combo = QComboBox()
        self.compat = QLabel()
        self.compat.setWordWrap(True)
        builtin = QPushButton("Use the built-in pair")
        builtin.clicked.connect(self._use_builtin)
        as_target = QPushButton("Use selected as target")
        as_target.clicked.connect(self._selected_as_target)
        open_target = QPushButton("Open target GGUF…")
        open_target.clicked.connect(lambda: self._open_file(as_draft=False))
        open_draft = QPushButton("Open draft GGUF…")
        open_draft.clicked.connect(lambda: self._open_file(as_draft=True))
        apply = QPushButton("Apply")
        apply.setDefault(True)
        apply.clicked.connect(self._apply)
        close = QPushButton("Close")
        close.clicked.connect(self.close)
        row1 = QHBoxLayout()
        for b in (builtin, as_target, open_target, open_draft):
            row1.addWidget(b)
        row1.addStretch(1)
        pick = QHBoxLayout()
        pick.addWidget(QLabel("Draft:"))
        pick.addWidget(self.draft_combo, 1)
        row2 = QHBoxLayout()
        row2.addStretch(1)
        row2.addWidget(apply)
        row2.addWidget(close)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("Catalog (GPT-2 family GGUF files on the Hugging Face hub):"))
        layout.addWidget(self.table, 1)
        layout.addLayout(row1)
        layout.addWidget(self.target_label)
        layout.addLayout(pick)
        layout.addWidget(self.compat)
        layout.addLayout(row2)
        downloads.progress.connect(self._progress)
        downloads.done.connect(self._done)
        downloads.failed.connect(self._failed)

    def showEvent(self, event: QShowEvent) -> None:
        """Ask which drafts fit the target when shown: by then ``check_requested`` has its
        listener."""
        super().showEvent(event)
        self._refresh_choice()

    # --- catalog rows ---
    def _fill_row(self, row: int, entry: ModelEntry) -> None:
        name = QTableWidgetItem(f"{entry.id}\n{entry.description}")
        name.setToolTip(entry.description)
        self.table.setItem(row, 0, name)
        size = f"{entry.approx_size_bytes / 1e6:.0f} MB" if entry.approx_size_bytes else "?"
        self.table.setItem(row, 1, QTableWidgetItem(size))
        local = cached_path(entry)
        bar = QProgressBar()
        bar.setRange(0, 100)
        bar.setValue(100 if local else 0)
        bar.setFormat("downloaded" if local else "not downloaded")
        self._bars[entry.id] = bar
        self.table.setCellWidget(row, 2, bar)
        button = QPushButton("Cancel" if entry.id in self.downloads.active else
                             ("Downloaded" if local else "Download"))
        button.setEnabled(local is None)
        button.clicked.connect(lambda _=False, e=entry: self._toggle_download(e))
        self.table.setCellWidget(row, 3, button)
        self.table.setRowHeight(row, 44)

    def _row(self, model_id: str) -> int:
        return next(i for i, e in enumerate(self.hub) if e.id == model_id)

    def _toggle_download(self, entry: ModelEntry) -> None:
        if entry.id in self.downloads.active:
            self.downloads.cancel(entry.id)
            return
        self.downloads.start(entry)
        self.table.cellWidget(self._row(entry.id), 3).setText("Cancel")
        self._bars[entry.id].setFormat("starting…")

    def _progress(self, model_id: str, done: int, total: object) -> None:
        bar = self._bars.get(model_id)
        if bar is None:
            return
        if isinstance(total, int) and total > 0:
            bar.setValue(int(100 * done / total))
            bar.setFormat(f"{done / 1e6:.0f} / {total / 1e6:.0f} MB")
        else:
            bar.setFormat(f"{done / 1e6:.0f} MB")

    def _done(self, model_id: str, _path: str) -> None:
        if model_id in self._bars:
            self._fill_row(self._row(model_id), self.hub[self._row(model_id)])
            self._refresh_choice()

    def _failed(self, model_id: str, reason: str) -> None:
        if model_id in self._bars:
            row = self._row(model_id)
            self._fill_row(row, self.hub[row])
            self._bars[model_id].setFormat("failed")
            self._bars[model_id].setToolTip(reason)
            self.compat.setText(f"{model_id}: {reason}")

    # --- choosing ---
    def _use_builtin(self) -> None:
        self.target, self.draft = "", ""
        self._refresh_choice()

    def _selected_as_target(self) -> None:
        row = self.table.currentRow()
        if row < 0:
            return
        path = cached_path(self.hub[row])
        if path is None:
            self.compat.setText(f"{self.hub[row].id} is not downloaded yet.")
            return
        self.target, self.draft = str(path), ""
        self._refresh_choice()

    def _open_file(self, as_draft: bool) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a GGUF model", str(Path.home()),
                                              "GGUF models (*.gguf);;All files (*)")
        if not path:
            return
        self.extra_files.append(path)
        if as_draft:
            self.draft = path
        else:
            self.target, self.draft = path, ""
        self._refresh_choice()

    def candidates(self) -> list[str]:
        """Drafts worth offering: the built-in draft, downloaded catalog models, opened files."""
        from models.catalog import builtin_pair

        out = []
        try:
            out.append(str(builtin_pair()[1]))
        except OSError:
            pass
        out += [str(p) for e in self.hub if (p := cached_path(e)) is not None]
        out += self.extra_files
        return [p for p in dict.fromkeys(out) if p != (self.target or "")]

    def _refresh_choice(self) -> None:
        self.target_label.setText("Target: " + (Path(self.target).name if self.target
                                                else "built-in code model"))
        self.draft_combo.clear()
        self.draft_combo.addItem("(checking compatibility…)", None)
        self.check_requested.emit(self.target, self.candidates())

    def show_compatibility(self, target: str, verdicts: dict[str, str | None]) -> None:
        """The engine thread's answer to ``check_requested``."""
        if target != self.target:
            return
        self.draft_combo.clear()
        self.draft_combo.addItem("No draft (n-gram or plain modes only)", "")
        refused = []
        for path, why in verdicts.items():
            if why is None:
                self.draft_combo.addItem(Path(path).name, path)
            else:
                refused.append(f"{Path(path).name}: {why}")
        wanted = self.draft or (next((p for p, w in verdicts.items() if w is None), ""))
        index = self.draft_combo.findData(wanted)
        self.draft_combo.setCurrentIndex(max(0, index))
        self.refused = refused
        self.compat.setText("Compatible drafts share the target's tokenizer."
                            + ("\nNot compatible: " + "; ".join(refused) if refused else ""))

    def _apply(self) -> None:
        draft = self.draft_combo.currentData() or ""
        builtin_draft = ""
        if not self.target:  # the built-in target: an empty draft path means its own draft
            from models.catalog import builtin_pair

            try:
                builtin_draft = str(builtin_pair()[1])
            except OSError:
                builtin_draft = ""
        self.chosen.emit(self.target, "" if draft == builtin_draft else draft)
        self.close()
