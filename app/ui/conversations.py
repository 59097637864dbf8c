"""The conversation list: a Qt list model over the history, and the panel that shows it."""

from __future__ import annotations

import datetime
from typing import Any

from PySide6.QtCore import QAbstractListModel, QModelIndex, QPersistentModelIndex, Qt, Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import (
    QLineEdit,
    QListView,
    QMenu,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.history import Conversation

Index = QModelIndex | QPersistentModelIndex


class ConversationListModel(QAbstractListModel):
    """Conversations newest first; renaming through the view edits the title."""

    IdRole = Qt.ItemDataRole.UserRole + 1
    renamed = Signal(int, str)  # conversation id, new title

    def __init__(self) -> None:
        super().__init__()
        self.items: list[Conversation] = []

    def set_items(self, items: list[Conversation]) -> None:
        self.beginResetModel()
        self.items = list(items)
        self.endResetModel()

    def rowCount(self, parent: Index = QModelIndex()) -> int:  # noqa: B008 - Qt API
        return 0 if parent.isValid() else len(self.items)

    def data(self, index: Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if not index.isValid() or not 0 <= index.row() < len(self.items):
            return None
        c = self.items[index.row()]
        if role in (Qt.ItemDataRole.DisplayRole, Qt.ItemDataRole.EditRole):
            return c.title or "New chat"
        if role == Qt.ItemDataRole.ToolTipRole:
            when = datetime.datetime.fromtimestamp(c.updated).strftime("%Y-%m-%d %H:%M")
            return f"{c.title or 'New chat'}\n{c.model} · {c.prompt_format} · {when}"
        if role == self.IdRole:
            return c.id
        return None

    def flags(self, index: Index) -> Qt.ItemFlag:
        return super().flags(index) | Qt.ItemFlag.ItemIsEditable

    def setData(self, index: Index, value: Any, role: int = Qt.ItemDataRole.EditRole) -> bool:
        if role != Qt.ItemDataRole.EditRole or not index.isValid():
            return False
        title = str(value).strip()
        if not title:
            return False
        self.renamed.emit(self.items[index.row()].id, title)
        return True

    def row_of(self, conversation_id: int) -> int | None:
        for i, c in enumerate(self.items):
            if c.id == conversation_id:
                return i
        return None


class ConversationPanel(QWidget):
    """Search box, the list, and a New chat button. Emits what the user asks for."""

    selected = Signal(int)
    new_requested = Signal()
    delete_requested = Signal(int)
    search_changed = Signal(str)
    export_requested = Signal(int, str)  # conversation id, "markdown" or "json"

    def __init__(self, model: ConversationListModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search conversations")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(self.search_changed)
        self.view = QListView()
        self.view.setModel(model)
        self.view.setEditTriggers(QListView.EditTrigger.EditKeyPressed
                                  | QListView.EditTrigger.DoubleClicked)
        self.view.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.view.customContextMenuRequested.connect(self._menu)
        self.view.selectionModel().currentChanged.connect(self._current_changed)
        self.new_button = QPushButton("New chat")
        self.new_button.setToolTip("Start a new conversation (Ctrl+N)")
        self.new_button.clicked.connect(self.new_requested)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        layout.addWidget(self.new_button)
        layout.addWidget(self.search)
        layout.addWidget(self.view, 1)

    def select(self, conversation_id: int) -> None:
        row = self.model.row_of(conversation_id)
        if row is not None:
            self.view.selectionModel().blockSignals(True)
            self.view.setCurrentIndex(self.model.index(row))
            self.view.selectionModel().blockSignals(False)

    def rename_current(self) -> None:
        index = self.view.currentIndex()
        if index.isValid():
            self.view.edit(index)

    def _current_changed(self, current: QModelIndex, _previous: QModelIndex) -> None:
        if current.isValid():
            self.selected.emit(int(self.model.data(current, ConversationListModel.IdRole)))

    def _menu(self, pos: Any) -> None:
        index = self.view.indexAt(pos)
        if not index.isValid():
            return
        cid = int(self.model.data(index, ConversationListModel.IdRole))
        menu = QMenu(self)
        rename = QAction("Rename", menu)
        rename.triggered.connect(lambda: self.view.edit(index))
        md = QAction("Export as Markdown…", menu)
        md.triggered.connect(lambda: self.export_requested.emit(cid, "markdown"))
        js = QAction("Export as JSON…", menu)
        js.triggered.connect(lambda: self.export_requested.emit(cid, "json"))
        delete = QAction("Delete", menu)
        delete.triggered.connect(lambda: self.delete_requested.emit(cid))
        for action in (rename, md, js):
            menu.addAction(action)
        menu.addSeparator()
        menu.addAction(delete)
        menu.exec(self.view.viewport().mapToGlobal(pos))
