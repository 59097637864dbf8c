"""The settings window. Every edit is applied at once: speculation and sampling from the next
step of the running reply, threads / context / models from the next reply (they reload the
models). The window only edits an ``AppSettings``; the main window applies and saves it."""

from __future__ import annotations

import dataclasses

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QGroupBox,
    QLabel,
    QLineEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.prompting import FORMATS, describe_sampler
from app.settings import MODE_LABELS, REPETITION_LABELS, AppSettings


class SettingsDialog(QDialog):
    changed = Signal(object)  # AppSettings

    def __init__(self, settings: AppSettings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self._settings = settings
        self._building = True
        self.mode = QComboBox()
        for value, label in MODE_LABELS.items():
            self.mode.addItem(label, value)
        self.max_nodes = _spin(1, 128, "drafted nodes the target verifies in one pass (upper "
                                       "bound when adaptive)")
        self.max_depth = _spin(1, 32, "longest drafted path")
        self.max_children = _spin(1, 16, "candidates tried per position (1 makes a chain)")
        self.chain_length = _spin(1, 32, "draft tokens per target pass in standard mode")
        self.lookahead = _spin(0, 16, "stage 2: n-gram tokens the draft decodes ahead")
        self.adaptive = QCheckBox("Size each tree by the measured verification cost")
        self.temperature = _dspin(0.0, 5.0, 0.05, "0 = greedy: exactly the target's own text")
        self.top_k = _spin(0, 50257, "keep the k most likely tokens (0 = all)")
        self.top_p = _dspin(0.01, 1.0, 0.01, "nucleus sampling mass (1 = all)")
        self.max_tokens = _spin(1, 4096, "tokens per reply at most")
        self.seed = _spin(-1, 2**31 - 1,
                          "-1: a new seed for every reply. A fixed seed repeats a sampled reply "
                          "exactly when the drafted trees have the same shapes: a fixed mode with "
                          "adaptive tree size off (auto and adaptive sizing follow timings)")
        self.repetition = QComboBox()
        for value, label in REPETITION_LABELS.items():
            self.repetition.addItem(label, value)
        self.repetition.setToolTip("A chat can choose for itself in the toolbar")
        self.min_p = _dspin(0.0, 0.99, 0.01, "drop tokens less likely than this times the most "
                                             "likely one: cuts the unlikely tail when sampling "
                                             "(0 = off; no effect at temperature 0)")
        self.repeat_penalty = _dspin(0.5, 3.0, 0.05,
                                     "makes every token of the recent text less likely: its "
                                     "logit is divided by this (1 = off). Also punishes "
                                     "names code must repeat")
        self.repeat_last_n = _spin(0, 4096, "how many recent tokens the repeat, presence and "
                                            "frequency penalties look at")
        self.presence_penalty = _dspin(-2.0, 2.0, 0.05, "subtracted from the logit of every "
                                                        "token in the recent text (0 = off)")
        self.frequency_penalty = _dspin(-2.0, 2.0, 0.05,
                                        "subtracted once per occurrence in the recent text "
                                        "(0 = off)")
        self.dry_multiplier = _dspin(0.0, 10.0, 0.05,
                                     "DRY (don't repeat yourself): penalises the token that "
                                     "would continue a repeat of earlier text, more the "
                                     "longer the repeat; stops loops like 'path, path, path' "
                                     "without punishing single repeated names (0 = off)")
        self.dry_base = _dspin(1.0, 4.0, 0.05, "DRY: the penalty grows by this factor per "
                                               "repeated token")
        self.dry_allowed_length = _spin(1, 32, "DRY: repeats this long or shorter are free")
        self.format_defaults = QLabel("\n".join(
            f"{f.label}: {describe_sampler(f.sampler)}" for f in FORMATS.values()))
        self.format_defaults.setWordWrap(True)
        self.threads = _spin(0, 256, "llama.cpp threads; 0 = automatic (each model on every "
                                     "core or one fewer, whichever decodes it faster here)")
        self.n_ctx = _spin(64, 8192, "context window in tokens (capped by the models)")
        self.n_ctx.setSingleStep(128)
        self.gpu_layers = _spin(-1, 1000, "target layers on a GPU (-1: all; 0: CPU only). Needs "
                                          "llama-cpp-python built with a GPU backend")
        self.draft_gpu_layers = _spin(-1, 1000, "draft layers on a GPU (-1: all; 0: CPU only)")
        self.server_port = _spin(0, 65535, "port of the Local server on 127.0.0.1 (0: any free "
                                           "port; the toolbar shows the address)")
        self.server_api_key = QLineEdit()
        self.server_api_key.setPlaceholderText("none")
        self.server_api_key.setToolTip("clients must send 'Authorization: Bearer KEY' (empty: "
                                       "no key; only this machine can connect either way)")
        self.theme = QComboBox()
        for value, label in (("system", "Follow the system"), ("light", "Light"),
                             ("dark", "Dark")):
            self.theme.addItem(label, value)
        spec = QGroupBox("Speculation (applies from the next step)")
        form = QFormLayout(spec)
        form.addRow("Mode", self.mode)
        form.addRow("Tree budget (nodes)", self.max_nodes)
        form.addRow("Tree depth", self.max_depth)
        form.addRow("Branching", self.max_children)
        form.addRow("Chain length", self.chain_length)
        form.addRow("Stage-2 lookahead", self.lookahead)
        form.addRow(self.adaptive)
        sampling = QGroupBox("Sampling")
        form = QFormLayout(sampling)
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-k", self.top_k)
        form.addRow("Top-p", self.top_p)
        form.addRow("Max tokens", self.max_tokens)
        form.addRow("Seed", self.seed)
        repetition = QGroupBox("Repetition control (applies from the next step)")
        form = QFormLayout(repetition)
        form.addRow("Use", self.repetition)
        form.addRow(self.format_defaults)
        form.addRow("Min-p", self.min_p)
        form.addRow("Repeat penalty", self.repeat_penalty)
        form.addRow("Penalty window", self.repeat_last_n)
        form.addRow("Presence penalty", self.presence_penalty)
        form.addRow("Frequency penalty", self.frequency_penalty)
        form.addRow("DRY multiplier", self.dry_multiplier)
        form.addRow("DRY base", self.dry_base)
        form.addRow("DRY allowed length", self.dry_allowed_length)
        perf = QGroupBox("Performance (applies from the next reply)")
        form = QFormLayout(perf)
        form.addRow("Threads", self.threads)
        form.addRow("Context size", self.n_ctx)
        form.addRow("GPU layers (target)", self.gpu_layers)
        form.addRow("GPU layers (draft)", self.draft_gpu_layers)
        server = QGroupBox("Local server (applies when it is next switched on)")
        form = QFormLayout(server)
        form.addRow("Port", self.server_port)
        form.addRow("API key", self.server_api_key)
        look = QGroupBox("Appearance")
        form = QFormLayout(look)
        form.addRow("Theme", self.theme)
        note = QLabel("Output stays exact in every mode: at temperature 0 the text is the "
                      "target's own, token for token; when sampling it follows the target's "
                      "distribution.")
        note.setWordWrap(True)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close
                                   | QDialogButtonBox.StandardButton.RestoreDefaults)
        buttons.rejected.connect(self.close)
        buttons.button(QDialogButtonBox.StandardButton.RestoreDefaults).clicked.connect(
            self._defaults)
        layout = QVBoxLayout(self)
        for w in (spec, sampling, repetition, perf, server, look, note, buttons):
            layout.addWidget(w)
        self.set_settings(settings)
        for w in (self.max_nodes, self.max_depth, self.max_children, self.chain_length,
                  self.lookahead, self.top_k, self.max_tokens, self.seed, self.threads,
                  self.n_ctx, self.gpu_layers, self.draft_gpu_layers, self.repeat_last_n,
                  self.dry_allowed_length, self.server_port):
            w.valueChanged.connect(self._edited)
        self.server_api_key.textEdited.connect(self._edited)
        for w in (self.temperature, self.top_p, *self._sampler_doubles()):
            w.valueChanged.connect(self._edited)
        self.repetition.currentIndexChanged.connect(self._edited)
        self.mode.currentIndexChanged.connect(self._edited)
        self.theme.currentIndexChanged.connect(self._edited)
        self.adaptive.toggled.connect(self._edited)
        self._building = False

    def set_settings(self, s: AppSettings) -> None:
        """Show ``s`` without emitting ``changed``."""
        building, self._building = self._building, True
        self._settings = s
        self.mode.setCurrentIndex(max(0, self.mode.findData(s.mode)))
        for name in ("max_nodes", "max_depth", "max_children", "chain_length", "lookahead",
                     "top_k", "max_tokens", "seed", "threads", "n_ctx", "temperature",
                     "top_p", "gpu_layers", "draft_gpu_layers", "server_port", *_SAMPLER):
            getattr(self, name).setValue(getattr(s, name))
        self.repetition.setCurrentIndex(max(0, self.repetition.findData(s.repetition)))
        self.server_api_key.setText(s.server_api_key)
        self.adaptive.setChecked(s.adaptive)
        self.theme.setCurrentIndex(max(0, self.theme.findData(s.theme)))
        self._update_enabled()
        self._building = building

    def settings(self) -> AppSettings:
        return dataclasses.replace(
            self._settings, mode=self.mode.currentData(), max_nodes=self.max_nodes.value(),
            max_depth=self.max_depth.value(), max_children=self.max_children.value(),
            chain_length=self.chain_length.value(), lookahead=self.lookahead.value(),
            adaptive=self.adaptive.isChecked(), temperature=self.temperature.value(),
            top_k=self.top_k.value(), top_p=self.top_p.value(),
            max_tokens=self.max_tokens.value(), seed=self.seed.value(),
            threads=self.threads.value(), n_ctx=self.n_ctx.value(),
            gpu_layers=self.gpu_layers.value(), draft_gpu_layers=self.draft_gpu_layers.value(),
            server_port=self.server_port.value(), server_api_key=self.server_api_key.text(),
            theme=self.theme.currentData(), repetition=self.repetition.currentData(),
            **{name: getattr(self, name).value() for name in _SAMPLER}).validated()

    def _sampler_doubles(self) -> list[QDoubleSpinBox]:
        return [getattr(self, n) for n in _SAMPLER if isinstance(getattr(self, n),
                                                                 QDoubleSpinBox)]

    def _edited(self) -> None:
        if self._building:
            return
        self._settings = self.settings()
        self._update_enabled()
        self.changed.emit(self._settings)

    def _update_enabled(self) -> None:
        mode = self.mode.currentData()
        tree = mode in ("tree", "staged", "ngram", "auto")
        for w in (self.max_nodes, self.max_depth, self.max_children):
            w.setEnabled(tree)
        self.chain_length.setEnabled(mode == "chain")
        self.lookahead.setEnabled(mode in ("staged", "auto"))
        self.adaptive.setEnabled(mode != "plain")
        custom = self.repetition.currentData() == "custom"
        for name in _SAMPLER:
            getattr(self, name).setEnabled(custom)
        self.format_defaults.setVisible(self.repetition.currentData() == "format")

    def _defaults(self) -> None:
        keep = {f: getattr(self._settings, f) for f in ("target_path", "draft_path",
                                                        "show_origins")}
        self.set_settings(AppSettings(**keep))
        self._settings = self.settings()
        self.changed.emit(self._settings)


# the repetition control's own values ("My settings")
_SAMPLER = ("min_p", "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty",
            "dry_multiplier", "dry_base", "dry_allowed_length")


def _spin(low: int, high: int, tip: str) -> QSpinBox:
    box = QSpinBox()
    box.setRange(low, high)
    box.setToolTip(tip)
    return box


def _dspin(low: float, high: float, step: float, tip: str) -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    box.setRange(low, high)
    box.setSingleStep(step)
    box.setDecimals(2)
    box.setToolTip(tip)
    return box
