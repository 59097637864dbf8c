"""The HTTP side: an ASGI application (Starlette) with OpenAI's routes.

Requests are checked here (``requests.parse``), admitted to the bounded queue
(``admission``), and handed to the thread that owns the engine as ``Job``s through a
``Backend``; their events come back on this event loop. A streamed answer is server-sent
events ending in ``data: [DONE]``; a client that disconnects, streaming or waiting, cancels
its job, which stops at the engine's next step.

Guards, before anything else: the ``Host`` header must name this server or a loopback name
(a web page on a DNS-rebinding domain that resolves to 127.0.0.1 sends its own name), a
request from a web page (an ``Origin`` header) is refused unless ``--allow-origin`` names that
origin (then, and only then, CORS headers are sent), bodies over 1 MB are refused, and with an
API key set every ``/v1`` route needs it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress
import json
import logging
import socket
import threading
from collections.abc import AsyncIterator
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from app.server.admission import Admission
from app.server.errors import ApiError
from app.server.jobs import Delta, Event, Failed, Finished, Job, ModelCard, Started
from app.server.requests import GenerationRequest, parse
from app.server.responses import DONE, Answer, sse

log = logging.getLogger(__name__)

MAX_BODY = 1 << 20  # bytes: a request body over this is refused (413)
WILDCARDS = {"0.0.0.0", "::", ""}


class Backend(Protocol):
    """The thread that owns the engine, as the HTTP side sees it."""

    def card(self) -> ModelCard | None:
        """The models served now; None while none is loaded."""
        ...

    def submit(self, job: Job) -> None:
        """Run ``job`` on the engine's thread after the jobs before it (thread-safe)."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class Security:
    bound_host: str = "127.0.0.1"          # the address the server listens on
    api_key: str | None = None             # required on /v1 routes when set
    allowed_origins: tuple[str, ...] = ()  # web origins allowed to call (CORS); none by default

    def host_allowed(self, host_header: str) -> bool:
        """Whether a ``Host`` header names this server: a loopback name or address, the
        address it was bound to, or, bound to every interface, any address or this machine's
        own name. Another name is what a DNS-rebinding page sends."""
        name = host_name(host_header)
        if not name:
            return True  # HTTP/1.0 without a Host header: no page's name to check
        if name == "localhost" or name.endswith(".localhost"):
            return True
        bound = self.bound_host.lower().strip("[]")
        if name == bound:
            return True
        try:
            address = ipaddress.ip_address(name)
        except ValueError:  # a name: only this machine's own, when listening everywhere
            own = socket.gethostname().lower()
            return bound in WILDCARDS and name in (own, f"{own}.local")
        return address.is_loopback or bound in WILDCARDS

    def origin_allowed(self, origin: str | None) -> bool:
        return origin is None or origin in self.allowed_origins


def host_name(header: str) -> str:
    """The host part of a ``Host`` header, lower-case: ``[::1]:8080`` -> ``::1``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    name = header.rsplit(":", 1)[0] if header.count(":") == 1 else header
    return name.rstrip(".")


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class Guard:
    """The checks every request passes first (ASGI middleware, outermost): Host, Origin and
    the declared body size."""

    def __init__(self, app: ASGIApp, security: Security) -> None:
        self.app, self.security = app, security

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self.check(Headers(scope=scope))
            if error is not None:
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def check(self, headers: Headers) -> ApiError | None:
        host = headers.get("host", "")
        if not self.security.host_allowed(host):
            return ApiError(403, f"Host {host!r} is not this server's address; requests must "
                                 f"name it or a loopback address (this refuses web pages that "
                                 f"reach it through their own domain names)",
                            code="host_not_allowed", kind="permission_error")
        origin = headers.get("origin")
        if not self.security.origin_allowed(origin):
            return ApiError(403, f"requests from web pages are refused (origin {origin!r}); "
                                 f"start the server with --allow-origin {origin} to let that "
                                 f"page use it", code="origin_not_allowed",
                            kind="permission_error")
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY:
            return too_large()
        return None


def stopping() -> ApiError:
    return ApiError(503, "the server is stopping: the request was cancelled",
                    kind="server_error", code="server_stopping")


def too_large() -> ApiError:
    return ApiError(413, f"the request body is over {MAX_BODY} bytes", code="body_too_large")


async def read_json(request: Request) -> Any:
    """The body as JSON, refused past ``MAX_BODY`` bytes even when it came without a
    length."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise too_large()
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request ({exc}). "
                            f"The body must be a JSON object.", code="invalid_json") from None


async def until_disconnected(receive: Receive) -> None:
    """Returns when the client has gone (the body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class Api:
    """The routes, on one backend, queue and set of guards; ``app`` is the ASGI application,
    ``stop`` ends what runs when the server stops."""

    def __init__(self, backend: Backend, admission: Admission, security: Security) -> None:
        self.backend, self.admission, self.security = backend, admission, security
        self._jobs: set[Job] = set()  # admitted and not yet done with
        self._lock = threading.Lock()  # the engine's thread removes jobs from the set
        middleware = [Middleware(Guard, security=security)]
        if security.allowed_origins:
            middleware.append(Middleware(
                CORSMiddleware, allow_origins=list(security.allowed_origins),
                allow_methods=["GET", "POST"], allow_headers=["Authorization", "Content-Type"]))
        self.app = Starlette(routes=self.routes(), middleware=middleware,
                             exception_handlers={ApiError: _api_error,
                                                 HTTPException: _http_error})

    def stop(self) -> None:
        """The server is stopping: every admitted job is cancelled (running ones at the
        engine's next step), so that open streams end instead of holding the shutdown."""
        with self._lock:
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel()

    def routes(self) -> list[Route]:
        return [Route("/health", self.health, methods=["GET"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"])]

    # ------------------------------------------------------------------ routes
    async def health(self, request: Request) -> Response:
        card, counts = self.backend.card(), self.admission.counts
        body = {"status": "ok" if card is not None else "loading",
                "model": card.name if card is not None else None,
                "queue": {"in_flight": counts.in_flight, "limit": self.admission.limit},
                **{k: getattr(counts, k) for k in ("answered", "cancelled", "failed",
                                                   "refused")}}
        return JSONResponse(body, status_code=200 if card is not None else 503)

    async def models(self, request: Request) -> Response:
        self.authorize(request)
        card = self.backend.card()
        return JSONResponse({"object": "list", "data": [model_entry(card)] if card else []})

    async def model(self, request: Request) -> Response:
        self.authorize(request)
        return JSONResponse(model_entry(self.card_named(request.path_params["model"])))

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, "completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self.generate(request, "chat")

    # ------------------------------------------------------------------ checks
    def authorize(self, request: Request) -> None:
        key = self.security.api_key
        if not key:
            return
        given = request.headers.get("authorization", "")
        if not given.lower().startswith("bearer "):
            raise ApiError(401, "You didn't provide an API key: send it as 'Authorization: "
                                "Bearer KEY'", code="missing_api_key")
        if not hmac.compare_digest(given[7:].strip().encode(), key.encode()):
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key")

    def loaded(self) -> ModelCard:
        card = self.backend.card()
        if card is None:
            raise ApiError(503, "no model is loaded yet; try again shortly",
                           kind="server_error", headers={"Retry-After": "5"})
        return card

    def card_named(self, name: str) -> ModelCard:
        card = self.loaded()
        if name != card.name:
            raise ApiError(404, f"The model {name!r} does not exist; this server has "
                                f"{card.name!r}", param="model", code="model_not_found")
        return card

    # ------------------------------------------------------------------ generation
    async def generate(self, request: Request, endpoint: str) -> Response:
        self.authorize(request)
        body = await read_json(request)
        parsed = parse(body, endpoint, self.loaded().modes)
        card = self.card_named(parsed.model)
        wait = self.admission.enter()
        if wait is not None:
            raise ApiError(503, f"the server is busy: {self.admission.limit} requests are "
                                f"waiting or running; retry in {wait} s", kind="server_error",
                           code="queue_full", headers={"Retry-After": str(wait)})
        events: asyncio.Queue[Event] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        job = Job(parsed, card, lambda event: loop.call_soon_threadsafe(events.put_nowait, event),
                  self.left)
        with self._lock:
            self._jobs.add(job)
        self.backend.submit(job)
        gone = asyncio.create_task(until_disconnected(request.receive))
        try:
            first = await next_event(events, gone)
            if first is None:  # the client left while its job waited
                job.cancel()
                return Response(status_code=204)  # nobody will read it
            if isinstance(first, Failed):
                raise first.error
            if isinstance(first, Finished):  # cancelled before it started: the server stops
                raise stopping()
            assert isinstance(first, Started)  # a job's first event
            answer = Answer(endpoint, card.name)
            if parsed.stream:
                gone.cancel()  # from here the streaming response watches the connection
                return EventStream(job, stream(events, answer, parsed))
            return await whole(job, events, gone, answer)
        except BaseException:  # a refusal, or the server stopping: nobody waits for the job
            job.cancel()
            raise
        finally:
            gone.cancel()

    def left(self, job: Job, event: Event) -> None:
        """A job's last event (on the engine's thread): it leaves the queue."""
        with self._lock:
            self._jobs.discard(job)
        if isinstance(event, Failed):
            self.admission.leave("failed")
        else:
            assert isinstance(event, Finished)
            outcome = "cancelled" if event.finish == "cancelled" else "answered"
            ran = event.run.seconds + event.run.t_prefill if event.run.steps else None
            self.admission.leave(outcome, ran)


async def next_event(events: asyncio.Queue[Event], gone: asyncio.Task[None]) -> Event | None:
    """The job's next event, or None if the client disconnected first."""
    get = asyncio.ensure_future(events.get())
    done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    return None


async def whole(job: Job, events: asyncio.Queue[Event], gone: asyncio.Task[None],
                answer: Answer) -> Response:
    """Wait for the end of the job: the non-streamed response."""
    while True:
        event = await next_event(events, gone)
        if event is None:
            job.cancel()
            return Response(status_code=204)  # nobody will read it
        if isinstance(event, Failed):
            raise event.error
        if isinstance(event, Finished):
            if event.finish == "cancelled":  # not by this client, which is still there
                raise stopping()
            return JSONResponse(answer.whole(event))


class EventStream(StreamingResponse):
    """Server-sent events for one job. Starlette stops sending when the client disconnects;
    however that happens, the job is cancelled and stops at the engine's next step (a no-op
    once it has finished)."""

    def __init__(self, job: Job, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()


async def stream(events: asyncio.Queue[Event], answer: Answer,
                 request: GenerationRequest) -> AsyncIterator[bytes]:
    """The chunks of a streamed answer, ending with ``data: [DONE]``."""
    for chunk in answer.opening():
        yield sse(chunk)
    while True:
        event = await events.get()
        if isinstance(event, Delta):
            for chunk in answer.pieces(event.pieces, request.include_origin):
                yield sse(chunk)
        elif isinstance(event, Finished):
            if event.finish == "cancelled":
                # a client that left reads nothing more: whoever still reads, the server stops
                yield sse(stopping().body())
            else:
                for chunk in answer.closing(event, request.include_usage):
                    yield sse(chunk)
            yield DONE
            return
        elif isinstance(event, Failed):  # after the 200: OpenAI's way is an error event
            yield sse(event.error.body())
            yield DONE
            return


def model_entry(card: ModelCard) -> dict[str, Any]:
    return {"id": card.name, "object": "model", "created": card.created,
            "owned_by": "staged-chat", "context_length": card.n_ctx,
            "speculation_modes": list(card.modes)}


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    if exc.status >= 500:
        log.info("answered %d: %s", exc.status, exc.message)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route, wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    what = {404: f"no route {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}"}
    return error_response(ApiError(exc.status_code, what.get(exc.status_code, exc.detail),
                                   headers=dict(exc.headers or {})))
