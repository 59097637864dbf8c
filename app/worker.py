"""The engine's thread: models, generation and races run here, never on the GUI thread.

``EngineWorker`` is a QObject moved to its own QThread (superqt's generator-worker pattern,
GPT4All's ``ChatLLM`` thread): the GUI asks through queued signals, the worker runs the engine's
generator and turns every ``Step`` into a signal. Stop is a request id the GUI sets directly
(the worker's event loop is busy while it generates): every request up to it, running or
queued, is stopped, and the engine checks it between steps. Settings that change
mid-generation are handed over under a lock and applied between steps. Every failure becomes a
``failed`` signal with a reason; nothing propagates into Qt.

``EngineController`` lives on the GUI thread: it owns the thread and offers plain methods.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.prompting import FORMATS, Prompt, chat_prompt
from app.settings import AppSettings
from models.catalog import BUILTIN_NGRAM, builtin_pair
from speculative.backend import system_info
from speculative.divergence import Divergence, explain
from speculative.engine import Engine
from speculative.errors import ContextOverflow, IncompatibleModels, LlamaError
from speculative.loading import ModelPair, open_pair
from speculative.policies import Mode
from speculative.stats import RunStats, StepStats
from speculative.text import TextStream

log = logging.getLogger(__name__)

# A sample of plain decoding, timed when models load: the basis of the estimated speedup.
_CALIBRATION_PROMPT = "def main():\n"
_CALIBRATION_TOKENS = 24


def app_threads(cores: int | None = None) -> int:
    """llama.cpp threads for the app when the user has not chosen: all cores but one for the
    window, which streams text and redraws the chart while the engine runs. llama.cpp's
    threads spin at barriers, and one that shares its core with the busy GUI thread stalls
    every barrier (decoding slowed 30-60x in measurements); a core of its own avoids that.
    Measure with ``staged-chat app --throughput-check``."""
    if cores is None:
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
    return max(1, cores - 1)


@dataclasses.dataclass(frozen=True, slots=True)
class ModelInfo:
    target: str                     # display names
    draft: str | None
    target_path: str
    draft_path: str | None
    builtin: bool                   # the built-in pair (code models)
    n_ctx: int
    threads: int
    has_ngram: bool
    plain_seconds_per_token: float  # measured plain decoding, for the estimated speedup
    verify_ms: dict[int, float]     # the target's measured cost of verifying n tokens
    load_seconds: float
    system: str = ""                # llama.cpp's build and CPU features


@dataclasses.dataclass(frozen=True, slots=True)
class ChatRequest:
    request_id: int
    messages: tuple[tuple[str, str], ...]  # (role, text), oldest first
    format: str                             # a key of app.prompting.FORMATS
    settings: AppSettings
    seed: int
    continuing: bool = False                # continue the last (assistant) message


@dataclasses.dataclass(frozen=True, slots=True)
class ReplyStarted:
    request_id: int
    prompt_tokens: int
    dropped: int          # oldest messages left out of the prompt to fit the window
    mode: str


@dataclasses.dataclass(frozen=True, slots=True)
class StepEvent:
    request_id: int
    pieces: list[tuple[str, str]]   # (text, origin) per emitted token; text may be "" while a
    tokens: list[int]               # multi-byte character is incomplete
    stats: StepStats


@dataclasses.dataclass(frozen=True, slots=True)
class ReplyDone:
    request_id: int
    text: str
    tokens: list[int]
    origins: list[str]
    finish: str           # "stop", "length", "context" or "cancelled"
    run: RunStats
    mode: str
    pieces: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (text, origin)


@dataclasses.dataclass(frozen=True, slots=True)
class RaceRun:
    mode: str
    text: str
    tokens: list[int]
    timeline: list[tuple[float, str]]  # (seconds since the run's first step began, text added)
    run: RunStats


@dataclasses.dataclass(frozen=True, slots=True)
class RaceResult:
    request_id: int
    plain: RaceRun
    speculative: RaceRun
    # greedy texts that differ: where, and whether the target's own logits tie there
    divergence: Divergence | None = None
    temperature: float = 0.0  # above 0 the two runs are two draws: their texts may differ

    @property
    def identical(self) -> bool:
        return self.plain.tokens == self.speculative.tokens

    @property
    def speedup(self) -> float:
        p, s = self.plain.run.seconds, self.speculative.run.seconds
        return (p / s) * (self.speculative.run.tokens / max(1, self.plain.run.tokens)) if s else 0.0


class _Cancelled(Exception):
    pass


# what bad input and full windows raise: reported without a traceback in the log
_EXPECTED = (ContextOverflow, IncompatibleModels, LlamaError, OSError, ValueError)


class EngineWorker(QObject):
    status = Signal(str)            # what the worker is doing, for the status bar
    loaded = Signal(object)         # ModelInfo
    load_failed = Signal(str)
    started = Signal(object)        # ReplyStarted
    step = Signal(object)           # StepEvent, one per target pass
    finished = Signal(object)       # ReplyDone
    failed = Signal(int, str)       # request id, reason
    race_progress = Signal(int, str, int)  # request id, mode, tokens so far
    race_finished = Signal(object)  # RaceResult
    compatible = Signal(str, object)  # target path, {draft path: None or why not}

    def __init__(self) -> None:
        super().__init__()
        # requests with an id up to this are stopped: a Stop pressed before the worker picks a
        # queued request up (it was loading models, or still busy) must stop that request too,
        # so the worker never clears it; an int is read and written atomically under the GIL
        self._stop_upto = 0
        self._lock = threading.Lock()
        self._live: AppSettings | None = None  # settings handed over mid-generation
        self._pair: ModelPair | None = None
        self._engine: Engine | None = None
        self._settings: AppSettings | None = None
        self._info: ModelInfo | None = None
        self._seed = 0  # the running reply's seed (a mid-reply sampling change keeps it)

    # --- called from the GUI thread directly (thread-safe) ---
    def cancel(self, upto: int = sys.maxsize) -> None:
        """Stop the running request and the queued ones with ids up to ``upto`` (all, by
        default: shutting down)."""
        self._stop_upto = max(self._stop_upto, upto)

    def _stopped(self, request_id: int) -> bool:
        return request_id <= self._stop_upto

    def update_settings(self, settings: AppSettings) -> None:
        """Apply from the next step of the running reply (what the loaded models allow)."""
        with self._lock:
            self._live = settings

    # --- slots, run on the worker thread through queued signals ---
    @Slot(object)
    def load(self, settings: AppSettings) -> None:
        try:
            self._load(settings)
        except _EXPECTED as exc:
            log.warning("loading models failed: %s", exc)
            self.load_failed.emit(_reason(exc))
            self.status.emit("No model loaded" if self._pair is None else "Ready")
        except Exception as exc:  # a bug: its traceback goes to the log
            log.exception("loading models failed")
            self.load_failed.emit(_reason(exc))
            self.status.emit("No model loaded" if self._pair is None else "Ready")

    @Slot(object)
    def generate(self, request: ChatRequest) -> None:
        try:
            engine = self._ready(request.settings)
            prompt = self._prompt(request)
            self.started.emit(ReplyStarted(request.request_id, len(prompt.tokens),
                                           prompt.dropped, engine.config.mode.value))
            self.status.emit("Generating…")
            done = self._reply(engine, request, prompt)
            self.finished.emit(done)
        except _EXPECTED as exc:
            log.warning("generation failed: %s", exc)
            self.failed.emit(request.request_id, _reason(exc))
        except Exception as exc:
            log.exception("generation failed")
            self.failed.emit(request.request_id, _reason(exc))
        finally:
            self.status.emit("Ready" if self._engine is not None else "No model loaded")

    @Slot(object)
    def race(self, request: ChatRequest) -> None:
        """Plain decoding, then the current speculation, one after the other (run at once they
        would share the cores and slow each other down), each timed step by step."""
        try:
            engine = self._ready(request.settings)
            prompt = self._prompt(request)
            runs = []
            for mode in (Mode.PLAIN, engine.config.mode):
                engine.config = dataclasses.replace(request.settings.spec(), mode=mode)
                self.status.emit(f"Race: {mode.value}…")
                runs.append(self._race_run(engine, request, prompt, mode.value))
            engine.config = request.settings.spec()
            why = None
            greedy = request.settings.sampling(request.seed).greedy
            if greedy and runs[0].tokens != runs[1].tokens:
                why = explain(engine.target.ctx, prompt.tokens, runs[0].tokens, runs[1].tokens)
                engine.target.reset()  # the replays used its cache
            self.race_finished.emit(RaceResult(request.request_id, *runs, why,
                                               request.settings.temperature))
        except _Cancelled:
            self.failed.emit(request.request_id, "race stopped")
        except Exception as exc:
            log.exception("race failed")
            self.failed.emit(request.request_id, _reason(exc))
        finally:
            if self._engine is not None and self._settings is not None:
                self._engine.config = self._settings.spec()
            self.status.emit("Ready" if self._engine is not None else "No model loaded")

    @Slot(str, object)
    def check_drafts(self, target: str, drafts: list[str]) -> None:
        """Which drafts share the target's tokenizer (vocabulary-only loads: fast)."""
        from speculative.backend import LlamaModel
        from speculative.loading import check_compatible

        verdicts: dict[str, str | None] = {}
        try:
            with LlamaModel(_target_path(target), vocab_only=True) as t:
                for d in drafts:
                    try:
                        with LlamaModel(d, vocab_only=True) as m:
                            check_compatible(t, m)
                        verdicts[d] = None
                    except (LlamaError, IncompatibleModels, OSError) as exc:
                        verdicts[d] = _reason(exc)
        except (LlamaError, OSError) as exc:
            verdicts = dict.fromkeys(drafts, f"target: {_reason(exc)}")
        self.compatible.emit(target, verdicts)

    @Slot()
    def shutdown(self) -> None:
        self._close()
        # the thread ends here, after the models are freed: a quit() from the GUI thread could
        # end its event loop before this queued call ran, leaving the llama.cpp contexts alive
        self.thread().quit()

    # --- internals ---
    def _ready(self, settings: AppSettings) -> Engine:
        """The engine for these settings, reloading models only when they need it."""
        if self._engine is None or self._settings is None or (
                settings.model_key() != self._settings.model_key()):
            self._load(settings)
        assert self._engine is not None
        spec = settings.spec()
        self._engine.check(spec)
        self._engine.config = spec
        self._settings = settings
        with self._lock:
            self._live = None
        return self._engine

    def _load(self, settings: AppSettings) -> None:
        t0 = time.perf_counter()
        self.status.emit("Loading models…")
        self._close()
        builtin = _is_builtin(settings.target_path)
        target, draft = _paths(settings)
        threads = settings.threads or app_threads()
        # the built-in n-gram model counts GPT-2 token ids: any GPT-2 model can use it
        pair = open_pair(target, draft, settings.context(threads),
                         (settings.gpu_layers, settings.draft_gpu_layers),
                         ngram=BUILTIN_NGRAM if BUILTIN_NGRAM.is_file() else None,
                         ngram_optional=True)
        try:
            self.status.emit("Measuring this machine's speed…")
            pair.measure_costs(settings.spec())
            engine = pair.engine(settings.spec())
            plain = _time_plain(engine, pair)
        except BaseException:
            pair.close()
            raise
        self._pair, self._engine, self._settings = pair, engine, settings
        cost = engine.verify_cost
        self._info = ModelInfo(
            target=pair.target.name, draft=pair.draft.name if pair.draft else None,
            target_path=str(target), draft_path=str(draft) if draft else None, builtin=builtin,
            n_ctx=pair.target_ctx.n_ctx, threads=threads, has_ngram=pair.ngram_path is not None,
            plain_seconds_per_token=plain,
            verify_ms={n: t * 1000 for n, t in zip(cost.sizes, cost.seconds, strict=True)}
            if cost else {}, load_seconds=time.perf_counter() - t0, system=system_info())
        self.loaded.emit(self._info)
        self.status.emit("Ready")

    def _close(self) -> None:
        if self._pair is not None:
            self._pair.close()
        self._pair = self._engine = self._info = None

    def _prompt(self, request: ChatRequest) -> Prompt:
        assert self._pair is not None
        vocab = self._pair.target.vocab
        n_ctx = self._engine.target.ctx.n_ctx if self._engine else self._pair.target_ctx.n_ctx
        return chat_prompt(request.format, request.messages, vocab.tokenize, n_ctx,
                           request.settings.max_tokens, request.continuing)

    def _steps(self, engine: Engine, request: ChatRequest, prompt: Prompt,
               run: RunStats) -> Iterator[tuple[list[int], list[str], StepStats, str | None]]:
        """The engine's steps, with mid-generation settings applied between them."""
        assert self._pair is not None
        stop = {self._pair.target.vocab.eos}
        params = request.settings.sampling(request.seed)
        self._seed, engine.sampling = request.seed, None
        steps = engine.generate(prompt.tokens, request.settings.max_tokens, params, stop=stop,
                                cancel=lambda: self._stopped(request.request_id), run=run)
        try:
            with contextlib.closing(steps):
                for step in steps:
                    yield step.tokens, step.origins, step.stats, step.finish
                    self._apply_live(engine)
        finally:
            engine.sampling = None  # mid-reply changes are in the settings of the next one

    def _apply_live(self, engine: Engine) -> None:
        with self._lock:
            live, self._live = self._live, None
        if live is None or self._settings is None:
            return
        engine.sampling = live.sampling(self._seed)  # temperature, top-k, top-p: next step
        spec = live.spec()
        try:
            engine.check(spec)
        except ValueError as exc:  # needs bigger contexts: applies when the next reply reloads
            log.info("settings wait for the next reply: %s", exc)
            return
        engine.config = spec

    def _reply(self, engine: Engine, request: ChatRequest, prompt: Prompt) -> ReplyDone:
        """Stream the reply (``TextStream``: text is shown once it cannot be the start of a
        stop string, and the reply ends before the stop)."""
        assert self._pair is not None
        text = TextStream(self._pair.target.vocab.piece, FORMATS[request.format].stops)
        run = RunStats()
        finish = "length"
        for step_tokens, step_origins, stats, step_finish in self._steps(engine, request,
                                                                         prompt, run):
            pieces = text.feed(step_tokens, step_origins, final=step_finish is not None)
            self.step.emit(StepEvent(request.request_id, pieces, step_tokens, stats))
            if step_finish is not None or text.stopped:
                finish = "stop" if text.stopped else step_finish
                break
        kept = text.kept()
        return ReplyDone(request.request_id, text.text, [t for t, _ in kept],
                         [o for _, o in kept], finish, run, engine.config.mode.value,
                         text.pieces())

    def _race_run(self, engine: Engine, request: ChatRequest, prompt: Prompt,
                  mode: str) -> RaceRun:
        assert self._pair is not None
        text = TextStream(self._pair.target.vocab.piece)
        run = RunStats()
        timeline: list[tuple[float, str]] = []
        tokens: list[int] = []
        elapsed = 0.0
        for step_tokens, _, stats, finish in self._steps(engine, request, prompt, run):
            if finish == "cancelled":
                raise _Cancelled
            elapsed += stats.seconds  # generation time only, as RunStats counts it
            pieces = text.feed(step_tokens, final=finish is not None)
            timeline.append((elapsed, "".join(t for t, _ in pieces)))
            tokens += step_tokens
            self.race_progress.emit(request.request_id, mode, len(tokens))
        return RaceRun(mode, text.text, tokens, timeline, run)


def _paths(settings: AppSettings) -> tuple[Path, Path | None]:
    if settings.target_path:
        target = Path(settings.target_path)
        draft = Path(settings.draft_path) if settings.draft_path else None
        if draft is None and Mode(settings.mode).needs_draft:
            raise ValueError(f"the mode {settings.mode!r} needs a draft model: choose one in "
                             f"Models, or pick the n-gram or off mode")
        return target, draft
    target, draft = builtin_pair()
    return target, Path(settings.draft_path) if settings.draft_path else draft


def _is_builtin(target: str) -> bool:
    """The built-in code target, chosen by default or by its file."""
    if not target:
        return True
    try:
        return Path(target).resolve() == builtin_pair()[0].resolve()
    except OSError:
        return False


def _target_path(target: str) -> Path:
    return Path(target) if target else builtin_pair()[0]


def _time_plain(engine: Engine, pair: ModelPair) -> float:
    """Seconds per token of plain decoding on this machine (a short greedy sample)."""
    saved = engine.config
    engine.config = dataclasses.replace(saved, mode=Mode.PLAIN)
    run = RunStats()
    try:
        prompt = pair.target.vocab.tokenize(_CALIBRATION_PROMPT)
        for _ in engine.generate(prompt, _CALIBRATION_TOKENS, run=run):
            pass
    finally:
        engine.config = saved
    return run.seconds / max(1, run.tokens)


def _reason(exc: BaseException) -> str:
    """A message for the user: the exception's own words, with its kind where that helps."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, ContextOverflow | IncompatibleModels | LlamaError | ValueError | OSError):
        return text
    return f"{type(exc).__name__}: {text}"


class EngineController(QObject):
    """The GUI thread's handle on the worker: starts its thread, forwards requests."""

    _load = Signal(object)
    _generate = Signal(object)
    _race = Signal(object)
    _check = Signal(str, object)
    _shutdown = Signal()

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.thread = QThread()
        self.thread.setObjectName("engine")
        self.worker = EngineWorker()
        self.worker.moveToThread(self.thread)
        self._load.connect(self.worker.load)
        self._generate.connect(self.worker.generate)
        self._race.connect(self.worker.race)
        self._check.connect(self.worker.check_drafts)
        self._shutdown.connect(self.worker.shutdown)
        self.thread.start()
        self._next_id = 0
        self.busy = False

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def load(self, settings: AppSettings) -> None:
        self._load.emit(settings)

    def generate(self, request: ChatRequest) -> None:
        self._generate.emit(request)

    def race(self, request: ChatRequest) -> None:
        self._race.emit(request)

    def check_drafts(self, target: str, drafts: list[str]) -> None:
        self._check.emit(target, drafts)

    def stop(self) -> None:
        """Stop every request sent so far, running or still queued."""
        self.worker.cancel(self._next_id)

    def update_settings(self, settings: AppSettings) -> None:
        self.worker.update_settings(settings)

    def shutdown(self, timeout_ms: int = 30_000) -> bool:
        """Stop what runs, free the models on their own thread, end the thread."""
        self.worker.cancel()
        self._shutdown.emit()  # the worker frees the models, then quits its thread
        return self.thread.wait(timeout_ms)

    def info(self) -> Any:
        return self.worker._info
