"""The thread that owns the engine for ``staged-chat serve``: it runs one job at a time, in
arrival order. (In the app, the window's ``EngineWorker`` plays this part, so that the
window's replies and the server's requests take turns on its one engine.)"""

from __future__ import annotations

import logging
import queue
import threading

from app.server.jobs import Job, ModelCard, run_job
from speculative.engine import Engine
from speculative.loading import ModelPair

log = logging.getLogger(__name__)


class EngineThread:
    """Owns ``pair`` and ``engine`` once started; ``close`` stops it (the caller then frees
    the models)."""

    def __init__(self, pair: ModelPair, engine: Engine, card: ModelCard) -> None:
        self._pair, self._engine, self._card = pair, engine, card
        # unbounded here: the HTTP side admits at most Admission.limit jobs
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def card(self) -> ModelCard:
        return self._card

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def close(self, timeout: float = 30.0) -> None:
        """Cancel what waits, let the running job stop at its next step, end the thread."""
        self._closing.set()
        self._jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self._closing.is_set():
                job.cancel()
            run_job(job, self._pair, self._engine)
            if self._jobs.empty():  # between jobs: a curve its passes showed too dear
                self._pair.check_curve(self._engine)
            self._pair.remember(self._engine)  # what it learned, for the next run
