"""The engine's thread: models, replies and races run here, never on the GUI thread.

``EngineWorker`` is a QObject moved to its own QThread (superqt's generator-worker pattern,
GPT4All's ``ChatLLM`` thread): the GUI asks through queued signals, the worker runs the engine's
generator and turns every ``Step`` into a signal. Stop is a request id the GUI sets directly
(the worker's event loop is busy while it generates): every request up to it, running or
queued, is stopped, and the engine checks it between steps. Settings that change
mid-generation are handed over under a lock and applied between steps. Every failure becomes a
signal with a reason; nothing propagates into Qt.

The Local server's requests (``app.server.jobs.Job``) are queued to the same worker, so they
and the window's replies take turns on the one engine, in the order they arrive.

``EngineController`` lives on the GUI thread: it owns the thread and offers plain methods.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.server.errors import ApiError
from app.server.jobs import Job, run_job
from app.settings import AppSettings
from app.worker import loading, racing
from app.worker.messages import ChatRequest, ModelInfo, ReplyFailed, ReplyStarted
from app.worker.replying import LiveSettings, Reply, prompt_for, steps
from speculative.engine import Engine, Learned
from speculative.errors import ContextOverflow, IncompatibleModels, LlamaError
from speculative.loading import ModelPair

log = logging.getLogger(__name__)

# what bad input and full windows raise: reported without a traceback in the log
_EXPECTED = (ContextOverflow, IncompatibleModels, LlamaError, OSError, ValueError)


class EngineWorker(QObject):
    status = Signal(str)            # what the worker is doing, for the status bar
    loaded = Signal(object)         # ModelInfo
    load_failed = Signal(str)
    started = Signal(object)        # ReplyStarted
    step = Signal(object)           # StepEvent, one per target pass
    finished = Signal(object)       # ReplyDone
    failed = Signal(object)         # ReplyFailed
    race_progress = Signal(int, str, int)  # request id, mode, tokens so far
    race_finished = Signal(object)  # RaceResult
    compatible = Signal(str, object)  # target path, {draft path: None or why not}

    def __init__(self) -> None:
        super().__init__()
        # requests with an id up to this are stopped: a Stop pressed before the worker picks a
        # queued request up (it was loading models, or still busy) must stop that request too,
        # so the worker never clears it; an int is read and written atomically under the GIL
        self._stop_upto = 0
        self._live = LiveSettings()  # settings handed over mid-generation
        self._pair: ModelPair | None = None
        self._engine: Engine | None = None
        self._settings: AppSettings | None = None
        self._info: ModelInfo | None = None
        # the last reply's conversation (as a race of it sends it) and what the engine had
        # learned when it began: a race of that reply starts from there (``racing``)
        self._reply_start: tuple[tuple, Learned] | None = None

    # --- called from the GUI thread directly (thread-safe) ---
    def cancel(self, upto: int = sys.maxsize) -> None:
        """Stop the running request and the queued ones with ids up to ``upto`` (all, by
        default: shutting down)."""
        self._stop_upto = max(self._stop_upto, upto)

    def update_settings(self, settings: AppSettings) -> None:
        """Apply from the next step of the running reply (what the loaded models allow)."""
        self._live.offer(settings)

    # --- slots, run on the worker thread through queued signals ---
    @Slot(object)
    def load(self, settings: AppSettings) -> None:
        try:
            self._load(settings)
        except _EXPECTED as exc:
            log.warning("loading models failed: %s", exc)
            self.load_failed.emit(loading.reason(exc))
            self.status.emit("No model loaded" if self._pair is None else "Ready")
        except Exception as exc:  # a bug: its traceback goes to the log
            log.exception("loading models failed")
            self.load_failed.emit(loading.reason(exc))
            self.status.emit("No model loaded" if self._pair is None else "Ready")

    @Slot(object)
    def generate(self, request: ChatRequest) -> None:
        reply: Reply | None = None
        try:
            engine = self._ready(request.settings)
            assert self._pair is not None
            prompt = prompt_for(self._pair, engine, request)
            self._reply_start = (_raced(request), engine.learned().copy())
            self.started.emit(ReplyStarted(request.request_id, len(prompt.tokens),
                                           prompt.dropped, engine.config.mode.value))
            self.status.emit("Generating…")
            reply = Reply(request, self._pair, engine)
            with contextlib.closing(steps(engine, self._pair, request, prompt, self._live,
                                          self._stopper(request), reply.run)) as stream:
                for event in reply.stream(stream):
                    self.step.emit(event)
            self.finished.emit(reply.done())
        except _EXPECTED as exc:
            log.warning("generation failed: %s", exc)
            self._failed(request, exc, reply)
        except Exception as exc:
            log.exception("generation failed")
            self._failed(request, exc, reply)
        finally:
            self._remember()
            self.status.emit("Ready" if self._engine is not None else "No model loaded")

    @Slot(object)
    def race(self, request: ChatRequest) -> None:
        try:
            engine = self._ready(request.settings)
            assert self._pair is not None
            key, start = self._reply_start or (None, None)
            if key != _raced(request) or start is None:  # not the last reply's: from now
                start = engine.learned().copy()
            result = racing.race(engine, self._pair, request, start,
                                 self._stopper(request),
                                 lambda mode, n: self.race_progress.emit(request.request_id,
                                                                         mode, n),
                                 self.status.emit)
            self.race_finished.emit(result)
        except racing.RaceStopped:
            self.failed.emit(ReplyFailed(request.request_id, "race stopped"))
        except Exception as exc:
            log.exception("race failed")
            self._failed(request, exc, None)
        finally:  # the race's engines learned, not this one: nothing new to remember
            self.status.emit("Ready" if self._engine is not None else "No model loaded")

    @Slot(object)
    def serve(self, job: Job) -> None:
        """A request from the Local server, on the models the window has loaded."""
        if self._pair is None or self._engine is None or self._info is None:
            job.fail(ApiError(503, "no model is loaded yet; try again shortly",
                              kind="server_error", headers={"Retry-After": "5"}))
            return
        if job.card.name != self._info.target:  # the window switched models since
            job.fail(ApiError(503, f"the window has loaded {self._info.target!r} instead of "
                                   f"{job.card.name!r}; try again", kind="server_error",
                              headers={"Retry-After": "1"}))
            return
        self.status.emit("Answering a request to the local server…")
        try:
            run_job(job, self._pair, self._engine)  # every failure becomes the job's event
        finally:
            self._remember()
            self.status.emit("Ready")

    @Slot(str, object)
    def check_drafts(self, target: str, drafts: list[str]) -> None:
        self.compatible.emit(target, loading.check_drafts(target, drafts))

    @Slot()
    def shutdown(self) -> None:
        self._close()
        # the thread ends here, after the models are freed: a quit() from the GUI thread could
        # end its event loop before this queued call ran, leaving the llama.cpp contexts alive
        self.thread().quit()

    # --- internals ---
    def _stopper(self, request: ChatRequest) -> Callable[[], bool]:
        return lambda: request.request_id <= self._stop_upto

    def _failed(self, request: ChatRequest, exc: BaseException, reply: Reply | None) -> None:
        partial = reply.partial() if reply is not None else None
        self.failed.emit(ReplyFailed(request.request_id, loading.reason(exc), partial))

    def _remember(self) -> None:
        """Keep what the engine learned for the next start (``ModelPair.remember``); measure
        the target's curve again if the reply's own passes showed it too dear
        (``ModelPair.check_curve``)."""
        if self._pair is not None and self._engine is not None:
            try:
                if self._pair.curve_due(self._engine):
                    self.status.emit("Measuring the target's speed again…")
                    self._pair.check_curve(self._engine)
            except Exception:
                log.exception("measuring the target's speed again failed")
            self._pair.remember(self._engine)

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
        self._live.take()  # offered for an earlier reply: these settings are newer
        return self._engine

    def _load(self, settings: AppSettings) -> None:
        self.status.emit("Loading models…")
        self._close()
        loaded = loading.load(settings, self.status.emit)
        self._pair, self._engine, self._settings = loaded.pair, loaded.engine, loaded.settings
        self._info = loaded.info
        self.loaded.emit(loaded.info)
        self.status.emit("Ready")

    def _close(self) -> None:
        if self._pair is not None:
            self._pair.close()
        self._pair = self._engine = self._info = None


def _raced(request: ChatRequest) -> tuple:
    """What identifies a reply to a race of it: the conversation before it, its format and
    models (a race sends the conversation up to its last message of the user's)."""
    return request.messages, request.format, request.continuing, request.settings.model_key()


class EngineController(QObject):
    """The GUI thread's handle on the worker: starts its thread, forwards requests."""

    _load = Signal(object)
    _generate = Signal(object)
    _race = Signal(object)
    _check = Signal(str, object)
    _serve = Signal(object)
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
        self._serve.connect(self.worker.serve)
        self._shutdown.connect(self.worker.shutdown)
        self.thread.start()
        self._next_id = 0

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

    def serve(self, job: Job) -> None:
        """Queue a Local server request behind what the worker has been asked so far. Called
        on the server's thread: the signal crosses to the worker's as a queued call."""
        self._serve.emit(job)

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
