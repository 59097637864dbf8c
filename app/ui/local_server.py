"""The app's Local server: the window's models behind ``app.server``'s OpenAI-compatible API.

``LocalServer`` is the server's ``Backend``: it offers the models the window has loaded (a
``ModelCard`` made from the loaded ``ModelInfo`` and the window's settings, so requests that
do not say get the window's sampling and speculation) and queues each request to the window's
``EngineWorker``, where the window's replies and the server's requests take turns on the one
engine. It listens on 127.0.0.1 only; ``staged-chat serve`` is the way to listen elsewhere.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from PySide6.QtCore import QObject, Signal

from app.prompting import format_for
from app.server.admission import Admission, Counts
from app.server.http import Api, Security
from app.server.jobs import Defaults, Job, ModelCard
from app.server.running import ServerThread, bind
from app.settings import AppSettings
from app.worker.messages import ModelInfo
from app.worker.thread import EngineController
from speculative.policies import Mode

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
QUEUE = 32  # requests waiting or running at most, as ``staged-chat serve``'s default


def card_for(info: ModelInfo, settings: AppSettings) -> ModelCard:
    """What the server offers while ``info``'s models are loaded with ``settings``."""
    fmt = format_for(info.builtin)
    sampling = dataclasses.replace(settings.sampling(0, fmt),
                                   seed=settings.seed if settings.seed >= 0 else None)
    modes = tuple(m.value for m in Mode.selectable() if info.draft is not None
                  or not m.needs_draft)
    return ModelCard(name=info.target, n_ctx=info.n_ctx, modes=modes,
                     chat_format=fmt.name,
                     defaults=Defaults(settings.spec(), sampling, settings.max_tokens),
                     created=int(time.time()))


class LocalServer(QObject):
    """Start, stop, and what the window shows: the address and the counts."""

    counts_changed = Signal(object)  # Counts, from whichever thread changed them
    running_changed = Signal(bool)

    def __init__(self, engine: EngineController, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._engine = engine
        self._card: ModelCard | None = None  # swapped whole: read by the server's thread
        self._thread: ServerThread | None = None
        self.admission = Admission(QUEUE, self.counts_changed.emit)

    # --- the Backend the HTTP side calls, on its own thread ---
    def card(self) -> ModelCard | None:
        return self._card

    def submit(self, job: Job) -> None:
        self._engine.serve(job)

    # --- the GUI thread's ---
    def update(self, info: ModelInfo | None, settings: AppSettings) -> None:
        """The models now loaded (None while loading) and the window's settings."""
        self._card = card_for(info, settings) if info is not None else None

    @property
    def running(self) -> bool:
        return self._thread is not None

    @property
    def url(self) -> str | None:
        """The API's base URL while serving."""
        return f"{self._thread.url}/v1" if self._thread is not None else None

    def start(self, settings: AppSettings) -> str:
        """Listen on the settings' port; the base URL. Raises ``OSError`` (a port in use)."""
        if self._thread is None:
            security = Security(HOST, settings.server_api_key or None)
            sock = bind(HOST, settings.server_port)
            api = Api(self, self.admission, security)
            self._thread = ServerThread(api.app, api.stop, sock)
            log.info("local server at %s", self._thread.url)
            self.running_changed.emit(True)
        return f"{self._thread.url}/v1"

    def stop(self) -> None:
        """Stop listening; requests in progress are cancelled at the engine's next step."""
        if self._thread is not None:
            thread, self._thread = self._thread, None
            if not thread.stop():
                log.warning("the local server's thread did not end")
            self.running_changed.emit(False)

    def counts(self) -> Counts:
        return self.admission.counts
