"""The main window: conversations on the left, the chat in the middle, statistics on the right.

It connects what the user asks for to the engine thread (``EngineController``), the history
(SQLite, on this thread: a message is one short transaction) and the settings; the widgets only
display. Requests and their replies are the ``ReplyController``'s (``reply_flow``). Streamed
tokens are buffered and drawn by a 30 Hz timer, so the window's work stays the same whether the
engine emits a hundred steps per second or thousands.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from PySide6.QtCore import QByteArray, QTimer, Signal
from PySide6.QtGui import QAction, QCloseEvent, QGuiApplication, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMessageBox,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from app.history import (
    Conversation,
    History,
    HistoryError,
    to_json,
    to_markdown,
    write_text_atomic,
)
from app.prompting import FORMATS, describe_sampler, format_for
from app.settings import (
    CHAT_REPETITION,
    MODE_LABELS,
    REPETITION_LABELS,
    AppSettings,
    SettingsStore,
)
from app.ui.about import about_text
from app.ui.chat_view import ChatView, shown
from app.ui.conversations import ConversationListModel, ConversationPanel
from app.ui.local_server import LocalServer
from app.ui.models_dialog import Downloads, ModelsDialog
from app.ui.race import RaceWindow
from app.ui.reply_flow import Pending, ReplyController
from app.ui.settings_dialog import SettingsDialog
from app.ui.stats_panel import StatsPanel
from app.ui.theme import apply_theme
from app.ui.widgets import Banner, PromptEdit
from app.worker.messages import ModelInfo
from app.worker.thread import EngineController
from models.catalog import Catalog
from speculative.policies import Mode

log = logging.getLogger(__name__)

FRAME_MS = 33  # redraw pace while streaming


class MainWindow(QMainWindow):
    reply_finished = Signal(int)   # request id: a reply was stored (or failed)
    models_loaded = Signal()
    load_failed = Signal(str)
    step_shown = Signal(object)    # a StepEvent of the current reply, on this thread
    race_done = Signal()

    def __init__(self, store: SettingsStore, history: History,
                 controller: EngineController | None = None) -> None:
        super().__init__()
        self.setWindowTitle("Staged Chat")
        self.store, self.history = store, history
        self.settings = store.load()
        self.controller = controller or EngineController(self)
        self.local_server = LocalServer(self.controller, self)
        self.downloads = Downloads(self)
        self.info: ModelInfo | None = None
        self.conversation: Conversation | None = None
        self.settings_dialog: SettingsDialog | None = None
        self.models_dialog: ModelsDialog | None = None
        self.catalog: Catalog | None = None  # None: models/catalog.json (tests give their own)
        self._build()
        self.replies = ReplyController(
            history=history, engine=self.controller, chat=self.chat, stats=self.stats,
            banner=self.banner, status=self.status, settings=self.chat_settings,
            prompt_format=self._format, shown_conversation=self._shown_id,
            models=lambda: self.info, parent=self)
        self._wire()
        self._frame = QTimer(self)
        self._frame.setInterval(FRAME_MS)
        self._frame.timeout.connect(self.replies.draw)
        self._frame.start()
        # "system" theme: follow the desktop when it switches between light and dark
        QGuiApplication.styleHints().colorSchemeChanged.connect(self._scheme_changed)
        self._restore_geometry()
        self._reload_list()
        if history.recovered_from is not None:
            self.banner.show_message(
                f"The chat history was damaged ({history.recovery_reason}); it was kept aside "
                f"as {history.recovered_from.name} and a new one was started.", "warning")
        items = self.list_model.items
        if items:
            self.open_conversation(items[0].id)
        else:
            self._show_empty()
        self.status.setText("Loading models…")
        self.input.setFocus()  # at first launch too: the user's first act is to type
        self.controller.load(self.settings)

    # ------------------------------------------------------------------ requests
    @property
    def pending(self) -> Pending | None:
        """The request the engine is working on, if any."""
        return self.replies.pending

    @property
    def race_window(self) -> RaceWindow | None:
        return self.replies.race_window

    def send_text(self, text: str) -> int | None:
        """Send ``text`` as the user (what pressing Enter does); returns the request id."""
        self.input.setPlainText(text)
        return self.send()

    def send(self) -> int | None:
        if self.pending is not None:
            return None
        # the raw text: toPlainText() turns no-break spaces into spaces, changing what was typed
        # (a string literal, say); blocks are joined by U+2029 in it, lines by "\n" in ours
        text = self.input.document().toRawText().replace("\u2029", "\n")
        if not text.strip():
            return None
        if FORMATS[self._format()].name == "code" and not text.endswith("\n"):
            text += "\n"  # Enter ends the line: the model writes the next one
        try:
            conversation = self._ensure_conversation(text)
        except HistoryError as exc:
            self.banner.show_message(f"Could not save the message: {exc}")
            return None
        request_id = self.replies.send(conversation.id, text)
        if request_id is not None:
            self.input.clear()
        return request_id

    def regenerate(self) -> None:
        if self.conversation is not None:
            self.replies.regenerate(self.conversation.id)

    def continue_reply(self) -> None:
        if self.conversation is not None:
            self.replies.continue_reply(self.conversation.id)

    def race(self) -> None:
        if self.conversation is not None:
            self.replies.race(self.conversation.id)

    def stop(self) -> None:
        self.replies.stop()

    def copy_last(self) -> None:
        self.replies.copy_last()

    def _send_or_stop(self) -> None:
        if self.pending is not None:
            self.stop()
        else:
            self.send()

    def _shown_id(self) -> int | None:
        return self.conversation.id if self.conversation is not None else None

    # ------------------------------------------------------------------ layout
    def _build(self) -> None:
        self.list_model = ConversationListModel()
        self.conversations = ConversationPanel(self.list_model)
        self.chat = ChatView()
        self.chat.show_origins = self.settings.show_origins
        self.banner = Banner()
        self.input = PromptEdit()
        self.send_button = QPushButton("Send")
        self.send_button.setDefault(True)
        self.send_button.setMinimumWidth(90)
        self.regenerate_button = QPushButton("Regenerate")
        self.continue_button = QPushButton("Continue")
        self.copy_button = QPushButton("Copy")
        self.race_button = QPushButton("Race")
        self.race_button.setToolTip("Replay the last prompt with plain decoding and with the "
                                    "current speculation, side by side (Ctrl+Shift+R)")
        actions = QHBoxLayout()
        for b in (self.regenerate_button, self.continue_button, self.copy_button,
                  self.race_button):
            actions.addWidget(b)
        actions.addStretch(1)
        self.format_label = QLabel()
        actions.addWidget(self.format_label)
        entry = QHBoxLayout()
        entry.addWidget(self.input, 1)
        entry.addWidget(self.send_button)
        center = QWidget()
        col = QVBoxLayout(center)
        col.setContentsMargins(4, 4, 4, 4)
        col.addWidget(self.banner)
        col.addWidget(self.chat, 1)
        col.addLayout(actions)
        col.addLayout(entry)
        self.stats = StatsPanel()
        self.stats.colour_tokens.setChecked(self.settings.show_origins)
        split = QSplitter()
        split.addWidget(self.conversations)
        split.addWidget(center)
        split.addWidget(self.stats)
        split.setStretchFactor(1, 1)
        split.setSizes([220, 700, 380])
        self.splitter = split
        self.setCentralWidget(split)
        self.mode_combo = QComboBox()
        for value, label in MODE_LABELS.items():
            self.mode_combo.addItem(label, value)
        self.mode_combo.setCurrentIndex(max(0, self.mode_combo.findData(self.settings.mode)))
        self.mode_combo.setToolTip("Speculation mode: applies from the next step")
        self.format_combo = QComboBox()
        for f in FORMATS.values():
            self.format_combo.addItem(f.label, f.name)
        self.format_combo.setToolTip("How the conversation is shown to the model (GPT-2 models "
                                     "are not instruction-tuned)")
        bar = self.addToolBar("Main")
        bar.setObjectName("main-toolbar")
        bar.setMovable(False)
        bar.addWidget(QLabel(" Speculation: "))
        bar.addWidget(self.mode_combo)
        bar.addSeparator()
        bar.addWidget(QLabel(" Prompt format: "))
        bar.addWidget(self.format_combo)
        self.repetition_combo = QComboBox()
        for value, label in REPETITION_LABELS.items():
            self.repetition_combo.addItem(label, value)
        bar.addWidget(QLabel(" Repetition control: "))
        bar.addWidget(self.repetition_combo)
        bar.addSeparator()
        self.model_label = QLabel(" models: loading…")
        bar.addWidget(self.model_label)
        bar.addSeparator()
        self.server_action = QAction("Local server", self)
        self.server_action.setCheckable(True)
        self.server_action.setToolTip(
            "Serve the loaded models to other programs on this machine through an "
            "OpenAI-compatible API (port and API key in Settings); their requests and this "
            "window's chats take turns")
        bar.addAction(self.server_action)
        self.server_label = QLabel()
        bar.addWidget(self.server_label)
        self._show_server()
        self.status = QLabel()
        self.statusBar().addWidget(self.status, 1)
        self._menus()
        self._set_idle(True)

    def _menus(self) -> None:
        def action(menu: Any, text: str, slot: Any, shortcut: Any = None) -> QAction:
            a = QAction(text, self)
            if shortcut is not None:
                a.setShortcut(QKeySequence(shortcut))
            a.triggered.connect(slot)
            menu.addAction(a)
            return a

        m = self.menuBar().addMenu("&File")
        action(m, "New chat", self.new_conversation, QKeySequence.StandardKey.New)
        action(m, "Rename chat", self.conversations.rename_current, "F2")
        action(m, "Export chat as Markdown…", lambda: self.export_current("markdown"), "Ctrl+E")
        action(m, "Export chat as JSON…", lambda: self.export_current("json"))
        action(m, "Delete chat", self.delete_current)
        m.addSeparator()
        action(m, "Quit", self.close, QKeySequence.StandardKey.Quit)
        m = self.menuBar().addMenu("&Chat")
        self.stop_action = action(m, "Stop", self.stop, "Esc")
        action(m, "Regenerate", self.regenerate, "Ctrl+R")
        action(m, "Continue", self.continue_reply, "Ctrl+Shift+Return")
        action(m, "Copy last reply", self.copy_last, "Ctrl+Shift+C")
        action(m, "Race plain vs speculation", self.race, "Ctrl+Shift+R")
        action(m, "Search chats", self.conversations.search.setFocus, QKeySequence.StandardKey.Find)
        m = self.menuBar().addMenu("&Settings")
        action(m, "Settings…", self.open_settings, QKeySequence.StandardKey.Preferences)
        action(m, "Models…", self.open_models, "Ctrl+M")
        m.addAction(self.server_action)
        self.origins_action = action(m, "Colour tokens by origin", self._toggle_origins)
        self.origins_action.setCheckable(True)
        self.origins_action.setChecked(self.settings.show_origins)
        m = self.menuBar().addMenu("&Help")
        action(m, "About Staged Chat", self.about, "F1")

    def _wire(self) -> None:
        w = self.controller.worker
        w.status.connect(self.status.setText)
        w.loaded.connect(self._loaded)
        w.load_failed.connect(self._load_failed)
        w.compatible.connect(self._compatibility)
        r = self.replies
        r.reply_finished.connect(self.reply_finished)
        r.step_shown.connect(self.step_shown)
        r.race_done.connect(self.race_done)
        r.busy_changed.connect(lambda busy: self._set_idle(not busy))
        r.stored.connect(lambda _conversation_id: self._reload_list())
        self.input.submitted.connect(self.send)
        self.send_button.clicked.connect(self._send_or_stop)
        self.regenerate_button.clicked.connect(self.regenerate)
        self.continue_button.clicked.connect(self.continue_reply)
        self.copy_button.clicked.connect(self.copy_last)
        self.race_button.clicked.connect(self.race)
        self.mode_combo.currentIndexChanged.connect(self._mode_picked)
        self.format_combo.currentIndexChanged.connect(self._format_picked)
        self.repetition_combo.currentIndexChanged.connect(self._repetition_picked)
        self.stats.show_origins_changed.connect(self._set_origins)
        self.conversations.selected.connect(self.open_conversation)
        self.conversations.new_requested.connect(self.new_conversation)
        self.conversations.delete_requested.connect(self.delete_conversation)
        self.conversations.search_changed.connect(lambda _q: self._reload_list())
        self.conversations.export_requested.connect(self.export)
        self.list_model.renamed.connect(self._rename)
        self.server_action.toggled.connect(self._server_toggled)
        self.local_server.counts_changed.connect(lambda _counts: self._show_server())

    # ------------------------------------------------------------------ conversations
    def _reload_list(self) -> None:
        query = self.conversations.search.text().strip()
        try:
            items = self.history.search(query) if query else self.history.conversations()
        except HistoryError as exc:
            self.banner.show_message(f"Could not read the chat history: {exc}")
            return
        self.list_model.set_items(items)
        if self.conversation is not None:
            self.conversations.select(self.conversation.id)

    def _format(self) -> str:
        if self.conversation is not None and self.conversation.prompt_format in FORMATS:
            return self.conversation.prompt_format
        builtin = self.info.builtin if self.info else not self.settings.target_path
        return format_for(builtin).name

    def new_conversation(self) -> None:
        if self.pending is not None:
            self.stop()
        self.conversation = None
        self._show_empty()
        self.input.setFocus()

    def _ensure_conversation(self, first_text: str) -> Conversation:
        if self.conversation is None:
            title = " ".join(first_text.split())[:60] or "New chat"
            self.conversation = self.history.create_conversation(
                title, model=self.info.target if self.info else "", prompt_format=self._format(),
                settings=dataclasses.asdict(self.settings))
            self._reload_list()
        return self.conversation

    def open_conversation(self, conversation_id: int) -> None:
        if self.conversation is not None and self.conversation.id == conversation_id:
            return
        if self.pending is not None:
            self.stop()
        try:
            self.conversation = self.history.conversation(conversation_id)
            messages = self.history.messages(conversation_id)
        except (HistoryError, KeyError) as exc:
            self.banner.show_message(f"Could not open that chat: {exc}")
            return
        fmt = FORMATS.get(self.conversation.prompt_format, FORMATS[self._format()])
        self.chat.show_messages([shown(m) for m in messages], fmt.monospace)
        self._sync_format_widgets()
        self.conversations.select(conversation_id)
        self.stats.show_conversation([m.stats for m in messages if m.role == "assistant"])
        self._set_idle(self.pending is None)

    def delete_conversation(self, conversation_id: int) -> None:
        answer = QMessageBox.question(self, "Delete chat", "Delete this chat and its messages?")
        if answer != QMessageBox.StandardButton.Yes:
            return
        if self.pending is not None and self.pending.conversation_id == conversation_id:
            self.stop()
        self.history.delete_conversation(conversation_id)
        if self.conversation is not None and self.conversation.id == conversation_id:
            self.conversation = None
            self._show_empty()
        self._reload_list()

    def delete_current(self) -> None:
        if self.conversation is not None:
            self.delete_conversation(self.conversation.id)

    def _rename(self, conversation_id: int, title: str) -> None:
        self.history.rename_conversation(conversation_id, title)
        if self.conversation is not None and self.conversation.id == conversation_id:
            self.conversation = self.history.conversation(conversation_id)
        self._reload_list()

    def export_current(self, kind: str) -> None:
        if self.conversation is not None:
            self.export(self.conversation.id, kind)

    def export(self, conversation_id: int, kind: str, path: str | None = None) -> None:
        conv = self.history.conversation(conversation_id)
        suffix = ".md" if kind == "markdown" else ".json"
        if path is None:
            safe = "".join(c if c.isalnum() or c in "-_ " else "_" for c in conv.title)[:50]
            path, _ = QFileDialog.getSaveFileName(self, "Export chat", str(Path.home() / (
                (safe.strip() or "chat") + suffix)))
            if not path:
                return
        messages = self.history.messages(conversation_id)
        text = to_markdown(conv, messages) if kind == "markdown" else to_json(conv, messages)
        try:
            write_text_atomic(path, text)
        except (HistoryError, OSError) as exc:
            self.banner.show_message(f"Could not export: {exc}")
            return
        self.status.setText(f"Exported to {path}")

    def _show_empty(self) -> None:
        fmt = FORMATS[self._format()]
        self.chat.show_messages([], fmt.monospace)
        self.stats.show_conversation([])
        self._sync_format_widgets()
        self._set_idle(self.pending is None)

    def _sync_format_widgets(self) -> None:
        fmt = FORMATS[self._format()]
        self.format_combo.blockSignals(True)
        self.format_combo.setCurrentIndex(max(0, self.format_combo.findData(fmt.name)))
        self.format_combo.blockSignals(False)
        chosen = self.chat_settings()
        self.repetition_combo.blockSignals(True)
        self.repetition_combo.setCurrentIndex(
            max(0, self.repetition_combo.findData(chosen.repetition)))
        self.repetition_combo.blockSignals(False)
        self.repetition_combo.setToolTip(
            "Penalties against repeating earlier text, for this chat (Settings explains "
            f"each). Now: {describe_sampler(chosen.sampling(0, fmt))}")
        self.format_label.setText(f"format: {fmt.label}")
        self.input.setPlaceholderText(
            "Start some Python for the model to complete: a function's signature and "
            "docstring works best — Enter sends, Shift+Enter adds a line" if fmt.name == "code" else
            "Message the model — Enter sends, Shift+Enter adds a line")

    # ------------------------------------------------------------------ models
    def _loaded(self, info: ModelInfo) -> None:
        self.info = info
        self.local_server.update(info, self.settings)
        draft = info.draft or "none"
        self.model_label.setText(f" target: {info.target} · draft: {draft} · "
                                 f"{info.n_ctx}-token window · {info.threads_text()} ")
        one = info.verify_ms.get(1)
        note = ("Speedup is estimated step by step: each target pass, scaled by this "
                "machine's cost curve to one token, says what plain decoding of the same "
                "target would take at that moment" + (f" (one target pass {one:.1f} ms at "
                f"load)" if one else "") + ", corrected by how drafted passes have lately "
                "compared with single ones. Race measures it side by side.")
        self.stats.set_plain_speed(info.plain_seconds_per_token, note)
        if self.conversation is None:
            self._sync_format_widgets()
        if self.banner.kind == "error" and "load" in self.banner.text().lower():
            self.banner.hide()
        self.models_loaded.emit()

    def _load_failed(self, reason: str) -> None:
        self.banner.show_message(f"Could not load the models: {reason}")
        if self.info is None:
            self.model_label.setText(" no model loaded ")
        self.load_failed.emit(reason)

    def _compatibility(self, target: str, verdicts: dict) -> None:
        if self.models_dialog is not None:
            self.models_dialog.show_compatibility(target, verdicts)

    # ------------------------------------------------------------------ settings
    def apply_settings(self, settings: AppSettings) -> None:
        old, self.settings = self.settings, settings.validated()
        self.store.save(self.settings)
        self.controller.update_settings(self.settings)  # the running reply, from its next step
        if old.theme != self.settings.theme:
            apply_theme(QApplication.instance(), self.settings.theme)
            self.stats.apply_palette()
            self.chat.set_show_origins(self.chat.show_origins)
        self.mode_combo.blockSignals(True)
        self.mode_combo.setCurrentIndex(max(0, self.mode_combo.findData(self.settings.mode)))
        self.mode_combo.blockSignals(False)
        if self.settings_dialog is not None:
            self.settings_dialog.set_settings(self.settings)
        if (old.target_path, old.draft_path) != (self.settings.target_path,
                                                 self.settings.draft_path):
            self.info = None
            self.model_label.setText(" models: loading… ")
            self.controller.load(self.settings)
        self.local_server.update(self.info, self.settings)

    def _scheme_changed(self, _scheme: object) -> None:
        if self.settings.theme == "system":
            apply_theme(QApplication.instance(), "system")
            self.stats.apply_palette()
            self.chat.set_show_origins(self.chat.show_origins)  # redraw with the new palette

    def _mode_picked(self) -> None:
        mode = self.mode_combo.currentData()
        if mode != self.settings.mode:
            self.apply_settings(dataclasses.replace(self.settings, mode=mode))

    def chat_settings(self) -> AppSettings:
        """The settings a reply in the shown chat runs with: the app's, with the chat's own
        choice of repetition control if it made one."""
        own = self.conversation.settings.get(CHAT_REPETITION) if self.conversation else None
        if own in REPETITION_LABELS and own != self.settings.repetition:
            return dataclasses.replace(self.settings, repetition=own)
        return self.settings

    def _repetition_picked(self) -> None:
        """The chat keeps its choice (a new chat starts from the settings' choice)."""
        choice = self.repetition_combo.currentData()
        if self.conversation is not None:
            settings = {**self.conversation.settings, CHAT_REPETITION: choice}
            self.conversation = self.history.update_conversation(self.conversation.id,
                                                                  settings=settings)
        elif choice != self.settings.repetition:
            self.apply_settings(dataclasses.replace(self.settings, repetition=choice))
        self._sync_format_widgets()

    def _format_picked(self) -> None:
        name = self.format_combo.currentData()
        if self.conversation is not None and name != self.conversation.prompt_format:
            self.conversation = self.history.update_conversation(self.conversation.id,
                                                                  prompt_format=name)
            self.chat.monospace = FORMATS[name].monospace
            self.chat.set_show_origins(self.chat.show_origins)
        self._sync_format_widgets()

    def _set_origins(self, on: bool) -> None:
        self.chat.set_show_origins(on)
        self.origins_action.setChecked(on)
        if on != self.settings.show_origins:
            self.apply_settings(dataclasses.replace(self.settings, show_origins=on))

    def _toggle_origins(self) -> None:
        self.stats.colour_tokens.setChecked(self.origins_action.isChecked())

    def open_settings(self) -> None:
        if self.settings_dialog is None:
            self.settings_dialog = SettingsDialog(self.settings, self)
            self.settings_dialog.changed.connect(self.apply_settings)
        self.settings_dialog.show()
        self.settings_dialog.raise_()

    def open_models(self) -> None:
        self.models_dialog = ModelsDialog(self.downloads, self.settings.target_path,
                                          self.settings.draft_path, self, self.catalog)
        self.models_dialog.check_requested.connect(self.controller.check_drafts)
        self.models_dialog.chosen.connect(self._models_chosen)
        self.models_dialog.show()

    def _models_chosen(self, target: str, draft: str) -> None:
        mode = self.settings.mode
        if target and not draft and Mode(mode).needs_draft:
            mode = Mode.NGRAM.value  # no draft: the n-gram model can still speculate
        self.apply_settings(dataclasses.replace(self.settings, target_path=target,
                                                draft_path=draft, mode=mode))

    # ------------------------------------------------------------------ local server
    def _server_toggled(self, on: bool) -> None:
        if on == self.local_server.running:
            return
        if on:
            try:
                self.local_server.start(self.settings)
            except OSError as exc:
                self.banner.show_message(f"Could not start the local server on port "
                                         f"{self.settings.server_port}: {exc}")
                self.server_action.setChecked(False)
        else:
            self.local_server.stop()
        self._show_server()

    def _show_server(self) -> None:
        url = self.local_server.url
        if url is None:
            self.server_label.setText(" off ")
            return
        n = self.local_server.counts().answered
        self.server_label.setText(f" {url} · {n} request{'s' if n != 1 else ''} answered ")

    def about(self) -> None:
        QMessageBox.about(self, "About Staged Chat", about_text(self.info))

    # ------------------------------------------------------------------ window
    def _set_idle(self, idle: bool) -> None:
        has_reply = bool(self.chat.messages) and self.chat.messages[-1].role == "assistant"
        self.send_button.setText("Send" if idle else "Stop")
        self.send_button.setToolTip("Send (Enter)" if idle else "Stop (Esc)")
        self.regenerate_button.setEnabled(idle and has_reply)
        self.continue_button.setEnabled(idle and has_reply)
        self.copy_button.setEnabled(has_reply)
        self.race_button.setEnabled(idle and any(m.role == "user" for m in self.chat.messages))

    def _restore_geometry(self) -> None:
        geometry = self.store.value("window/geometry")
        if isinstance(geometry, QByteArray) and not geometry.isEmpty():
            self.restoreGeometry(geometry)
        else:
            self.resize(1360, 820)

    def closeEvent(self, event: QCloseEvent) -> None:
        self.store.set_value("window/geometry", self.saveGeometry())
        self._frame.stop()
        self.local_server.stop()  # its requests are cancelled before the engine's thread ends
        self.controller.stop()
        self.controller.shutdown()
        self.downloads.shutdown()
        super().closeEvent(event)


