"""What crosses between the HTTP side and the thread that owns the engine.

A ``Job`` is one checked request with the server's defaults it was admitted under (the
``ModelCard``). The thread that owns the engine (``engine_thread.EngineThread`` for ``staged-chat
serve``, the app's ``EngineWorker``) calls ``run_job`` for each job in arrival order; it renders
the prompt, decodes, and hands events back through ``Job.emit`` (thread-safe, set by the HTTP
side). All llama.cpp work, tokenizing included, happens on that thread. The HTTP side stops a
job by ``Job.cancel``; the engine reads it between steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence

from app.prompting import FORMATS, PromptFormat
from app.server.errors import ApiError
from app.server.requests import GenerationRequest
from speculative.engine import Engine
from speculative.errors import ContextOverflow, IncompatibleModels, LlamaError
from speculative.loading import ModelPair
from speculative.policies import Mode, SpecConfig
from speculative.sampling import SamplingParams
from speculative.stats import RunStats
from speculative.text import TextStream

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Defaults:
    """What a request that does not say gets."""

    spec: SpecConfig
    sampling: SamplingParams   # seed None: a fresh draw for every request
    max_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class ModelCard:
    """The models being served, as the HTTP side checks requests against them."""

    name: str                   # the model id clients name
    n_ctx: int                  # the context window, prompt and completion together
    modes: tuple[str, ...]      # speculation modes these models can run
    chat_format: str            # a key of app.prompting.FORMATS
    defaults: Defaults
    created: int = 0            # seconds since the epoch when it was loaded


@dataclasses.dataclass(frozen=True, slots=True)
class Started:
    prompt_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class Delta:
    pieces: list[tuple[str, str]]  # (text, origin) per token: speculative.stats.ORIGINS


@dataclasses.dataclass(frozen=True, slots=True)
class Finished:
    text: str
    finish: str              # "stop", "length", "context" or "cancelled"
    run: RunStats
    prompt_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class Failed:
    error: ApiError


Event = Started | Delta | Finished | Failed


class Job:
    """One request on its way through the engine's thread."""

    def __init__(self, request: GenerationRequest, card: ModelCard,
                 emit: Callable[[Event], None],
                 done: Callable[[Job, Event], None] = lambda job, event: None) -> None:
        self.request, self.card = request, card
        self._emit, self._done = emit, done
        self._cancelled = threading.Event()
        self._ended = False

    def cancel(self) -> None:
        """Stop at the next step (or skip the job if it has not started)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, event: Event) -> None:
        """Hand an event to the HTTP side; the last one (``Finished``, ``Failed``) ends the
        job. A client gone (its event loop closed) cancels it."""
        if self._ended:
            return
        if isinstance(event, Finished | Failed):
            # done first: a client that has its answer may send the next request at once,
            # and must find this one out of the queue
            self._ended = True
            self._done(self, event)
        try:
            self._emit(event)
        except RuntimeError:  # the server's event loop is closed: nobody is listening
            self.cancel()

    def fail(self, error: ApiError) -> None:
        self.emit(Failed(error))


def chat_text(fmt: PromptFormat, messages: Sequence[tuple[str, str]]) -> str:
    """The conversation in ``fmt``, opening the assistant's reply. System messages take the
    place of the format's header (the transcript's one-line description of the chat); in the
    code format, where every message is text of the file, they open the file."""
    system = "\n".join(text for role, text in messages if role == "system")
    turns = [(role, text) for role, text in messages if role != "system"]
    if system:
        header = system.rstrip("\n") + "\n\n" if fmt.header else system
        fmt = dataclasses.replace(fmt, header=header)
    return "".join(fmt.render(turns, continuing=False))


def prompt_tokens(job: Job, pair: ModelPair) -> tuple[list[int], tuple[str, ...]]:
    """The request's prompt as tokens, and the strings that end its completion (a chat's
    prompt format's and the request's own)."""
    request, vocab = job.request, pair.target.vocab
    if request.endpoint == "chat":
        fmt = FORMATS[job.card.chat_format]
        tokens = vocab.tokenize(chat_text(fmt, request.messages))
        stops = (*fmt.stops, *request.stop)
    elif isinstance(request.prompt, str):
        tokens, stops = vocab.tokenize(request.prompt), request.stop
    else:
        bad = [t for t in request.prompt if not 0 <= t < vocab.n_vocab]
        if bad:
            raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary "
                                f"(0..{vocab.n_vocab - 1})", param="prompt")
        tokens, stops = list(request.prompt), request.stop
    if not tokens:
        raise ApiError(400, "the prompt is empty", param="messages" if request.endpoint == "chat"
                       else "prompt")
    n_ctx = pair.target_ctx.n_ctx
    if len(tokens) > n_ctx - 1:  # at least one token of completion must fit
        raise ApiError(400, f"This model's context window is {n_ctx} tokens, and the prompt is "
                            f"{len(tokens)} tokens: at most {n_ctx - 1} leave room for a "
                            f"completion. Shorten the prompt.",
                       param="messages" if request.endpoint == "chat" else "prompt",
                       code="context_length_exceeded")
    return tokens, stops


def settings(job: Job) -> tuple[SpecConfig, SamplingParams, int]:
    """The job's speculation, sampling and length: the server's defaults, with what the
    request set."""
    request, defaults = job.request, job.card.defaults
    spec = defaults.spec
    if request.mode is not None:
        spec = dataclasses.replace(spec, mode=Mode(request.mode))
    sampling = dataclasses.replace(defaults.sampling, **dict(request.sampling))
    return spec, sampling, request.max_tokens or defaults.max_tokens


def run_job(job: Job, pair: ModelPair, engine: Engine) -> None:
    """Decode one job on the thread that owns ``engine``; every outcome becomes an event. The
    engine's settings are what they were afterwards."""
    saved = engine.config
    try:
        if job.cancelled:  # the client left while the job waited
            job.emit(Finished("", "cancelled", RunStats(), 0))
            return
        _decode(job, pair, engine)
    except ApiError as exc:
        job.fail(exc)
    except (ContextOverflow, IncompatibleModels, LlamaError, ValueError) as exc:
        log.warning("request failed: %s", exc)
        job.fail(ApiError(500, f"generation failed: {exc}", kind="server_error"))
    except Exception as exc:  # a bug: its traceback goes to the log, the client gets a 500
        log.exception("request failed")
        job.fail(ApiError(500, f"generation failed: {type(exc).__name__}: {exc}",
                          kind="server_error"))
    finally:
        engine.config = saved
        engine.sampling = None


def _decode(job: Job, pair: ModelPair, engine: Engine) -> None:
    spec, sampling, max_tokens = settings(job)
    try:
        engine.check(spec)
    except ValueError as exc:
        raise ApiError(400, f"speculation.mode: {exc}", param="speculation.mode") from None
    tokens, stops = prompt_tokens(job, pair)
    engine.config, engine.sampling = spec, None
    job.emit(Started(len(tokens)))
    text = TextStream(pair.target.vocab.piece, stops)
    run = RunStats()
    finish = "length"
    generated = engine.generate(tokens, max_tokens, sampling, stop={pair.target.vocab.eos},
                                cancel=lambda: job.cancelled, run=run)
    with contextlib.closing(generated):
        for step in generated:
            pieces = text.feed(step.tokens, step.origins, final=step.finish is not None)
            # a whole answer is sent at the end: no need to wake the HTTP side at every step
            if job.request.stream and any(t for t, _ in pieces):
                job.emit(Delta(pieces))
            if step.finish is not None or text.stopped:
                finish = "stop" if text.stopped else step.finish
                break
    job.emit(Finished(text.text, finish, run, len(tokens)))
