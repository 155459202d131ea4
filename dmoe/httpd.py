"""Small HTTP servers (an expert server's ``/metrics``, the monitor's page) that clients cannot use to pile up
threads.

``http.server``'s threading server starts a thread per connection and keeps it for as long as the client keeps the
connection open; a client that connects and never finishes its request (or trickles a byte now and then) holds one
forever. On a public host (``--host 0.0.0.0`` makes ``/metrics`` public by default) anyone could grow a server's
thread count until the process could start no more threads, gRPC's and torch's included. Here each connection is
closed after ``idle_timeout`` seconds without a byte, and at most ``max_connections`` are served at once: beyond
that, a new connection is closed at once (counted in :attr:`BoundedHTTPServer.refused`).
"""
from __future__ import annotations

import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from dmoe.endpoints import bare_host

logger = logging.getLogger(__name__)

#: connections served at once by default (each holds a thread while it lasts)
MAX_CONNECTIONS = 32
#: seconds a connection may send nothing before it is closed
IDLE_TIMEOUT = 30.0


class BoundedHTTPServer(ThreadingHTTPServer):
    """A :class:`ThreadingHTTPServer` (IPv6 for a host with a colon) serving at most ``max_connections``
    connections at once, each on a daemon thread. Give the handler class a ``timeout`` (see :func:`quiet_handler`):
    without one, an idle connection keeps its slot."""

    daemon_threads = True
    block_on_close = False  # threads are not kept in a list to join: they end with their connection or the process

    def __init__(self, host: str, port: int, handler: type[BaseHTTPRequestHandler],
                 max_connections: int = MAX_CONNECTIONS):
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        host = bare_host(host)
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.max_connections = max_connections
        self.refused = 0  # connections closed at once, every slot being taken
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__((host, port), handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            if self.refused == 1 or self.refused % 1000 == 0:
                logger.warning("HTTP on port %d: %d connections open, the most served at once; closing new ones "
                               "(%d so far)", self.server_address[1], self.max_connections, self.refused)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)  # a thread runs process_request_thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def quiet_handler(idle_timeout: float = IDLE_TIMEOUT) -> type[BaseHTTPRequestHandler]:
    """A base request handler that closes a connection idle for ``idle_timeout`` seconds and logs requests at DEBUG
    level (``http.server`` writes each to stderr)."""

    class Handler(BaseHTTPRequestHandler):
        timeout = idle_timeout  # applied to the socket: a read that waits longer ends the connection

        def send_body(self, body: bytes, content_type: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            logger.debug("%s %s", self.address_string(), format % args)

    return Handler


class HTTPThread:
    """Runs a :class:`BoundedHTTPServer` on a daemon thread it owns; ``close()`` stops it and frees the port."""

    def __init__(self, server: BoundedHTTPServer, name: str):
        self.server = server
        self._thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)

    @property
    def port(self) -> int:
        return self.server.server_address[1]

    def start(self) -> "HTTPThread":
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread.is_alive():
            self.server.shutdown()
            self._thread.join(5)
        self.server.server_close()
