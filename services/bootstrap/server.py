"""Run the bootstrap service: bind first, then serve with uvicorn.

:func:`serve` is the single entry point (``meshnet bootstrap`` calls it). It
binds the listening socket itself before uvicorn starts, so that

* a port already taken fails at once with :class:`BindError` naming the
  address, instead of uvicorn's log-and-exit or a silent fallback;
* port 0 binds an ephemeral port, and the log line
  ``bootstrap listening on http://HOST:PORT (registry=R)`` names the one bound.

uvicorn runs its h11 protocol with a deadline on each request head and a
bound on connections per client address (:mod:`meshwire.slow_clients`); the
app bounds the body (:mod:`meshwire.body_guard`). Together no client, however
slow, holds a connection for more than about twice ``read_timeout_s`` per
request, ``max_connections_per_address`` bounds how many one address holds
at once, and ``max_connections`` how many all do. With ``tls_cert`` and
``tls_key`` it serves HTTPS.

:class:`BootstrapServer` runs the same service on a background thread, for a
process that embeds it (and for tests).
"""

from __future__ import annotations

import copy
import errno
import logging
import math
import socket
import threading
import time
from typing import Any, Final, Self

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from meshwire import slow_clients, tls
from services.bootstrap.app import create_app
from services.bootstrap.settings import BootstrapSettings

logger = logging.getLogger(__name__)

LISTEN_BACKLOG: Final = 2048
"""Connections the kernel queues before they are accepted."""
MAX_HEAD_BYTES: Final = 16 << 10
"""Largest request line plus headers accepted (h11 answers 400 beyond it)."""
STARTUP_TIMEOUT_S: Final = 30.0
"""How long :meth:`BootstrapServer.start` waits for the thread to serve."""
STARTUP_POLL_S: Final = 0.01
_LOOPBACK_FOR_WILDCARD: Final = {"0.0.0.0": "127.0.0.1", "::": "::1"}


class BindError(OSError):
    """The service could not listen on the address asked for (taken port, unknown host...).

    ``errno`` is the system's; ``str()`` is a sentence naming the address.
    """

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: an ephemeral one).

    ``SO_REUSEADDR`` lets a restarted service rebind a port whose old
    connections linger in TIME_WAIT; on Linux it never lets two sockets
    listen on one port, so a taken port still fails. An IPv6 host (``::``)
    also accepts IPv4 where the system allows it.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as error:
        raise BindError(errno.EADDRNOTAVAIL, f"bootstrap cannot listen on {host}:{port}: {error}") from error
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as error:
        sock.close()
        hint = " (is another service listening there?)" if error.errno == errno.EADDRINUSE else ""
        raise BindError(error.errno, f"bootstrap cannot listen on {host}:{port}: {error.strerror}{hint}") \
            from error
    return sock


def _http_url(host: str, port: int, scheme: str = "http") -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def listening_url(sock: socket.socket, scheme: str = "http") -> str:
    """``http(s)://HOST:PORT`` a socket is bound to, IPv6 hosts in brackets."""
    host, port = sock.getsockname()[:2]
    return _http_url(host, port, scheme)


def local_url(sock: socket.socket, scheme: str = "http") -> str:
    """The URL a client on this machine uses: a wildcard address becomes loopback."""
    host, port = sock.getsockname()[:2]
    return _http_url(_LOOPBACK_FOR_WILDCARD.get(host, host), port, scheme)


def _announce(sock: socket.socket, settings: BootstrapSettings) -> None:
    logger.info("bootstrap listening on %s (registry=%s)", listening_url(sock, _scheme(settings)), settings.registry)


def _scheme(settings: BootstrapSettings) -> str:
    return tls.scheme(settings.tls_cert is not None)


def _log_config() -> dict[str, Any] | None:
    """uvicorn's logging setup plus this package's logger, unless the process configured logging."""
    if logging.getLogger().handlers:
        return None
    config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    config["loggers"]["services.bootstrap"] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return config


def uvicorn_server(settings: BootstrapSettings, app: FastAPI) -> uvicorn.Server:
    """A uvicorn server for ``app`` with the service's limits."""
    config = uvicorn.Config(
        app,
        http=slow_clients.guarded_http(settings.read_timeout_s, settings.max_connections_per_address,
                                       base=H11Protocol),
        ws="none",
        lifespan="off",
        limit_concurrency=settings.max_connections,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout_s),
        access_log=settings.access_log,
        log_config=_log_config(),
        **tls.server_options(settings.tls_cert, settings.tls_key),
    )
    return uvicorn.Server(config)


def serve(settings: BootstrapSettings | None = None) -> None:
    """Serve in the foreground until SIGINT or SIGTERM.

    ``settings`` defaults to :class:`BootstrapSettings` read from the
    environment. Raises :class:`BindError` (before serving anything) when
    the address cannot be bound.
    """
    settings = settings if settings is not None else BootstrapSettings()
    server = uvicorn_server(settings, create_app(settings))  # configures logging first
    sock = bind_listener(settings.host, settings.port)
    _announce(sock, settings)
    server.run(sockets=[sock])


class BootstrapServer:
    """A bootstrap service on a background thread, for a process that embeds one (and tests)::

        with BootstrapServer(BootstrapSettings(host="127.0.0.1", port=0)) as server:
            async with AsyncBootstrapClient(server.url) as bootstrap:
                await bootstrap.get_sizes()
    """

    def __init__(self, settings: BootstrapSettings) -> None:
        self.settings = settings
        self.app = create_app(settings)
        self._server = uvicorn_server(settings, self.app)
        self._thread: threading.Thread | None = None
        self._url: str | None = None
        self.port = 0

    @property
    def url(self) -> str:
        """The base URL clients use (``127.0.0.1`` / ``::1`` for a wildcard host)."""
        if self._url is None:
            raise RuntimeError("the bootstrap server is not started")
        return self._url

    def start(self) -> Self:
        """Bind, serve on a thread, and return once requests are answered; :class:`BindError` if unbound."""
        if self._thread is not None:
            raise RuntimeError("the bootstrap server is already started")
        sock = bind_listener(self.settings.host, self.settings.port)
        self.port = sock.getsockname()[1]
        self._url = local_url(sock, _scheme(self.settings))
        _announce(sock, self.settings)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name=f"bootstrap-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the bootstrap server on port {self.port} did not start")
            time.sleep(STARTUP_POLL_S)
        return self

    def close(self) -> None:
        """Stop serving and release the port; idempotent."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Self:
        """Start the server unless it already is; :meth:`close` on leaving."""
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
