"""The app's settings: one frozen dataclass, persisted with QSettings.

Every field has a default that suits chatting on a laptop. ``AppSettings`` is plain data (the
worker and the tests use it without Qt); ``SettingsStore`` reads and writes it through
``QSettings``, field by field, so a value written by an older version or edited by hand that
does not parse falls back to its default instead of breaking the start-up.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from PySide6.QtCore import QSettings

from speculative.backend import ContextConfig
from speculative.drafting import TreeBudget
from speculative.policies import Mode, SpecConfig
from speculative.sampling import SamplingParams

if TYPE_CHECKING:
    from app.prompting import PromptFormat

log = logging.getLogger(__name__)

REPETITION_LABELS: dict[str, str] = {
    # where a reply's repetition control and min-p come from, in menu order
    "format": "The prompt format's defaults",
    "custom": "My settings",
    "off": "Off",
}

# the key under which a chat keeps its own choice of REPETITION_LABELS (``Conversation.settings``)
CHAT_REPETITION = "chat_repetition"

MODE_LABELS: dict[str, str] = {
    # the user's words for each engine mode, in menu order
    Mode.AUTO.value: "Auto (what pays on this machine)",
    Mode.PLAIN.value: "Off (target alone)",
    Mode.CHAIN.value: "Standard speculative (draft chain)",
    Mode.TREE.value: "Stage 1: draft tree",
    Mode.STAGED.value: "Stages 1 + 2: draft tree + n-gram",
    Mode.NGRAM.value: "N-gram tree only",
}


@dataclasses.dataclass(frozen=True, slots=True)
class AppSettings:
    # speculation
    mode: str = Mode.AUTO.value       # drafts as much as pays on this machine, step by step
    max_nodes: int = 16               # tree budget: drafted nodes verified per target pass
    max_depth: int = 6
    max_children: int = 4             # branching: candidates per position
    chain_length: int = 4             # standard speculative decoding
    lookahead: int = 4                # stage 2: n-gram tokens decoded ahead by the draft
    adaptive: bool = True             # size each tree by the measured verification cost
    # sampling: chat defaults (greedy is for benchmarks; people like some variety)
    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    max_tokens: int = 200
    seed: int = -1                    # -1: a new seed per reply; >= 0: the same draws (the same
    #   text for the same tree shapes; auto and adaptive trees size them by measured timings)
    # repetition control and min-p: a chat's format's defaults, the values below, or none (a
    # chat can choose for itself: ``Conversation.settings[CHAT_REPETITION]``)
    repetition: str = "format"
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.8
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    # performance
    threads: int = 0                  # 0: chosen by the thread policy (see app/worker/loading.py)
    n_ctx: int = 1024                 # capped by the models' trained context
    gpu_layers: int = 0               # target layers on a GPU (-1: all), if llama.cpp has one
    draft_gpu_layers: int = 0
    # models: empty means the built-in pair
    target_path: str = ""
    draft_path: str = ""
    # display
    show_origins: bool = True         # colour each token by who proposed it
    theme: str = "system"             # "system", "light" or "dark"
    # the Local server (OpenAI-compatible, on 127.0.0.1 only); switched on from the toolbar
    server_port: int = 8080           # llama-server's, which local clients expect; 0: any free
    server_api_key: str = ""          # "": none required (only this machine can connect)

    def spec(self) -> SpecConfig:
        budget = TreeBudget(self.max_nodes, self.max_depth, self.max_children)
        return SpecConfig(mode=Mode(self.mode), tree=budget, chain_length=self.chain_length,
                          lookahead=self.lookahead, adaptive=self.adaptive)

    def sampling(self, seed: int, fmt: PromptFormat | None = None) -> SamplingParams:
        """The sampling of a reply in format ``fmt`` (None: without repetition control)."""
        params = SamplingParams(self.temperature, self.top_k, self.top_p, seed)
        if self.repetition == "custom":
            return dataclasses.replace(
                params, min_p=self.min_p, repeat_penalty=self.repeat_penalty,
                repeat_last_n=self.repeat_last_n, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, dry_multiplier=self.dry_multiplier,
                dry_base=self.dry_base, dry_allowed_length=self.dry_allowed_length,
                dry_breakers=fmt.sampler.dry_breakers if fmt is not None else
                params.dry_breakers)
        if self.repetition == "format" and fmt is not None:
            return params.with_sampler(fmt.sampler)
        return params

    def context(self, threads: int) -> ContextConfig:
        """Contexts big enough for any tree these settings can ask for (see ``Engine.check``)."""
        batch = max(self.max_nodes, self.chain_length) + 1 + max(self.lookahead, 0)
        # flash attention as measured fastest on this machine (speculative.loading)
        return ContextConfig(n_ctx=self.n_ctx, n_batch=max(64, batch), n_seq_max=256,
                             n_threads=threads, flash_attn=None)

    def model_key(self) -> tuple[Any, ...]:
        """What, when it changes, needs the models reloaded (the rest applies at once)."""
        return (self.target_path, self.draft_path, self.n_ctx, self.threads, self.gpu_layers,
                self.draft_gpu_layers,
                max(self.max_nodes, self.chain_length) + 1 + max(self.lookahead, 0) > 64)

    def validated(self) -> AppSettings:
        """Values clamped to what the engine accepts (a hand-edited file may hold anything)."""
        mode = self.mode if self.mode in MODE_LABELS else AppSettings.mode
        repetition = (self.repetition if self.repetition in REPETITION_LABELS
                      else AppSettings.repetition)
        return dataclasses.replace(
            self, mode=mode, repetition=repetition,
            min_p=min(max(self.min_p, 0.0), 0.99),
            repeat_penalty=min(max(self.repeat_penalty, 0.5), 3.0),
            repeat_last_n=_clamp(self.repeat_last_n, 0, 4096),
            presence_penalty=min(max(self.presence_penalty, -2.0), 2.0),
            frequency_penalty=min(max(self.frequency_penalty, -2.0), 2.0),
            dry_multiplier=min(max(self.dry_multiplier, 0.0), 10.0),
            dry_base=min(max(self.dry_base, 1.0), 4.0),
            dry_allowed_length=_clamp(self.dry_allowed_length, 1, 32),
            max_nodes=_clamp(self.max_nodes, 1, 128),
            max_depth=_clamp(self.max_depth, 1, 32), max_children=_clamp(self.max_children, 1, 16),
            chain_length=_clamp(self.chain_length, 1, 32), lookahead=_clamp(self.lookahead, 0, 16),
            temperature=min(max(self.temperature, 0.0), 5.0), top_k=_clamp(self.top_k, 0, 50257),
            top_p=min(max(self.top_p, 0.01), 1.0), max_tokens=_clamp(self.max_tokens, 1, 4096),
            seed=max(self.seed, -1), threads=_clamp(self.threads, 0, 256),
            gpu_layers=_clamp(self.gpu_layers, -1, 1000),
            draft_gpu_layers=_clamp(self.draft_gpu_layers, -1, 1000),
            n_ctx=_clamp(self.n_ctx, 64, 8192), server_port=_clamp(self.server_port, 0, 65535),
            theme=self.theme if self.theme in ("system", "light", "dark") else "system")


def _clamp(value: int, low: int, high: int) -> int:
    return min(max(int(value), low), high)


class SettingsStore:
    """``AppSettings`` in QSettings (the platform's place, or an ini file for tests)."""

    GROUP = "settings"

    def __init__(self, path: Path | None = None) -> None:
        self._qs = (QSettings(str(path), QSettings.Format.IniFormat) if path is not None
                    else QSettings())

    def load(self) -> AppSettings:
        values: dict[str, Any] = {}
        self._qs.beginGroup(self.GROUP)
        try:
            for field in dataclasses.fields(AppSettings):
                if not self._qs.contains(field.name):
                    continue
                raw = self._qs.value(field.name)
                try:
                    values[field.name] = _parse(raw, field.default)
                except (TypeError, ValueError):
                    log.warning("setting %s=%r ignored: not a %s", field.name, raw,
                                type(field.default).__name__)
        finally:
            self._qs.endGroup()
        return AppSettings(**values).validated()

    def save(self, settings: AppSettings) -> None:
        self._qs.beginGroup(self.GROUP)
        for field in dataclasses.fields(AppSettings):
            self._qs.setValue(field.name, getattr(settings, field.name))
        self._qs.endGroup()
        self._qs.sync()

    def value(self, key: str, default: Any = None) -> Any:
        """Window geometry and other state that is not a setting."""
        return self._qs.value(key, default)

    def set_value(self, key: str, value: Any) -> None:
        self._qs.setValue(key, value)


def _parse(raw: Any, default: Any) -> Any:
    """QSettings' ini backend returns strings: turn them back into the field's type."""
    if isinstance(default, bool):
        if isinstance(raw, str):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        return bool(raw)
    return type(default)(raw)
