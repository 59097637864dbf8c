"""Binding the server's socket and running uvicorn on it: in the foreground for ``staged-chat
serve`` (Ctrl+C stops it), or on a thread of its own for the app's Local server.

The socket is bound before uvicorn starts, so that a port in use is an error the caller shows
at once, and port 0 (any free port) has its number to print.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable

import uvicorn
from starlette.types import ASGIApp

log = logging.getLogger(__name__)

# seconds open connections get to finish when the server stops, before their requests are
# cancelled (a streaming client would otherwise hold the shutdown)
GRACE = 2


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (0: any free port)."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def url(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket (an IPv6 address in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


class _Server(uvicorn.Server):
    """uvicorn, telling the application when it starts to stop: open streams are ended then
    rather than cut when the grace period runs out."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_stop = on_stop

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.on_stop()
        await super().shutdown(sockets)


def _server(app: ASGIApp, on_stop: Callable[[], None], verbose: bool) -> uvicorn.Server:
    config = uvicorn.Config(app, lifespan="off", log_config=None,
                            log_level="info" if verbose else "warning", access_log=verbose,
                            timeout_graceful_shutdown=GRACE)
    return _Server(config, on_stop)


def serve_forever(app: ASGIApp, on_stop: Callable[[], None], sock: socket.socket,
                  verbose: bool = False) -> None:
    """Serve on this thread until Ctrl+C (uvicorn handles the signals); ``on_stop`` is called
    when it starts to stop."""
    _server(app, on_stop, verbose).run(sockets=[sock])


class ServerThread:
    """uvicorn on a thread of its own; ``stop`` ends it and closes the socket."""

    def __init__(self, app: ASGIApp, on_stop: Callable[[], None], sock: socket.socket,
                 verbose: bool = False) -> None:
        self.sock = sock
        self.url = url(sock)
        self._server = _server(app, on_stop, verbose)
        self._thread = threading.Thread(target=self._run, name="http-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self.sock])
        except Exception:
            log.exception("the local server stopped")

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = GRACE + 5) -> bool:
        """Stop serving; whether the thread ended within ``timeout`` seconds."""
        self._server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()
        return not self._thread.is_alive()
